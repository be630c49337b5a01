//! A real OAuth 2.0 authorization server for tests: `scripts/oauth-mock`
//! (the `oauth2-mock-server` package, made as strict as a real server:
//! PKCE S256 checked, codes good once, refresh tokens rotated, client
//! secrets checked) in a node process of its own per test.

use std::process::Stdio;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

use crate::support::PATIENCE;

/// The client the server knows as confidential: it must authenticate with
/// this secret over HTTP Basic. Any other client id is a public client.
pub const CONFIDENTIAL_CLIENT: &str = "tether-confidential";
/// Has characters RFC 6749 §2.3.1 makes the client form-urlencode.
pub const CLIENT_SECRET: &str = "s3cret: with+odd&chars%";

pub struct AuthServer {
    base_url: String,
    http: reqwest::Client,
    /// Killed when the server is dropped.
    _child: Child,
    /// The server exits when this closes, should the kill not happen (a
    /// test process that is killed itself).
    _stdin: ChildStdin,
}

impl AuthServer {
    /// Starts a server on a free port and waits until it listens.
    pub async fn start() -> AuthServer {
        let dir = crate::support::npm_package("oauth-mock", "oauth2-mock-server");
        let mut child = Command::new("node")
            .arg(dir.join("server.mjs"))
            .arg("0")
            .arg("--client")
            .arg(format!("{CONFIDENTIAL_CLIENT}:{CLIENT_SECRET}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("node runs (Node.js 20.19 or later is needed)");
        let stdin = child.stdin.take().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(PATIENCE, lines.next_line())
            .await
            .expect("the OAuth mock did not start in time")
            .unwrap()
            .expect("the OAuth mock exited before listening");
        let base_url = line
            .strip_prefix("listening ")
            .unwrap_or_else(|| panic!("unexpected first line from the OAuth mock: {line}"))
            .to_owned();
        tether::providers::http::install_tls();
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(PATIENCE)
            .build()
            .unwrap();
        AuthServer {
            base_url,
            http,
            _child: child,
            _stdin: stdin,
        }
    }

    pub fn authorize_url(&self) -> String {
        format!("{}/authorize", self.base_url)
    }

    pub fn token_url(&self) -> String {
        format!("{}/token", self.base_url)
    }

    /// Plays the person's browser: GETs the login URL (no redirects) and
    /// returns the redirect's `code` and `state` query parameters.
    pub async fn consent(&self, login_url: &str) -> (String, String) {
        let response = self.http.get(login_url).send().await.unwrap();
        let status = response.status();
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .map(|l| l.to_str().unwrap().to_owned());
        let Some(location) = location.filter(|_| status.is_redirection()) else {
            let body = response.text().await.unwrap_or_default();
            panic!("the login URL did not redirect: HTTP {status}: {body}");
        };
        let location = reqwest::Url::parse(&location).unwrap();
        let param = |name: &str| {
            location
                .query_pairs()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.into_owned())
                .unwrap_or_else(|| panic!("the redirect has no `{name}`: {location}"))
        };
        (param("code"), param("state"))
    }

    /// Token requests received of a grant type (`authorization_code`,
    /// `refresh_token`), refused ones too.
    pub async fn token_requests(&self, grant_type: &str) -> u64 {
        let stats: Value = self
            .http
            .get(format!("{}/stats", self.base_url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        stats[grant_type]
            .as_u64()
            .unwrap_or_else(|| panic!("no count for {grant_type}: {stats}"))
    }

    /// The lifetime (`expires_in`) of the tokens issued from now on.
    pub async fn set_expires_in(&self, secs: u64) {
        self.control(json!({ "expires_in": secs })).await;
    }

    /// How long each refresh from now on is held before it is answered.
    pub async fn set_refresh_delay(&self, delay: std::time::Duration) {
        self.control(json!({ "refresh_delay_ms": delay.as_millis() as u64 }))
            .await;
    }

    async fn control(&self, settings: Value) {
        let response = self
            .http
            .post(format!("{}/control", self.base_url))
            .json(&settings)
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success(), "{response:?}");
    }
}
