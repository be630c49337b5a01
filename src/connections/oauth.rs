//! The OAuth 2.0 client side of a connection: the authorization request
//! (PKCE S256, state) and the token endpoint (code exchange, refresh).
//!
//! The protocol is the `oauth2` crate's: it builds the login URL, the PKCE
//! pair and the token requests, and reads the answers (RFC 6749, RFC 7636).
//! It sends nothing itself. Its `reqwest` feature would bring reqwest 0.12,
//! a second HTTP stack beside ours, so it is used without features and
//! hands its requests to `send`, which goes through the process's one
//! client ([`http::client`]): no redirects followed, a time limit, a capped
//! body, and failures named by kind only.

use std::fmt;
use std::time::Duration;

use oauth2::basic::{BasicClient, BasicErrorResponse, BasicTokenResponse};
use oauth2::{
    AuthUrl, AuthorizationCode, ClientId, ClientSecret, CsrfToken, EndpointNotSet, EndpointSet,
    HttpRequest, HttpResponse, PkceCodeChallenge, PkceCodeVerifier, RedirectUrl, RefreshToken,
    RequestTokenError, Scope, TokenResponse, TokenUrl,
};

use crate::config::ConnectionConfig;
use crate::domain::time::now_millis;
use crate::providers::http;
use crate::redact::{self, Hidden, Origin};

/// Random bytes in a state: enough that it cannot be guessed (RFC 6749
/// §10.12 asks for a value an attacker cannot forge).
const STATE_BYTES: u32 = 32;

/// Random bytes in a PKCE verifier: 43 characters, the least RFC 7636
/// allows.
const VERIFIER_BYTES: u32 = 32;

/// How long one token request may take, the answer read included.
const TIMEOUT: Duration = Duration::from_secs(30);

/// A token response is a few hundred bytes; more is not read.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// The longest error description passed on, in characters.
const MAX_DESCRIPTION_CHARS: usize = 200;

/// The longest error code passed on, in characters (RFC 6749 codes are
/// short ASCII words).
const MAX_CODE_CHARS: usize = 64;

/// What a consent offer needs: the login URL for the person, and the
/// secrets the server keeps.
pub struct Consent {
    pub login_url: String,
    /// Comes back on the redirect; ties it to this offer.
    pub state: String,
    /// The PKCE verifier; only the token endpoint ever sees it.
    pub verifier: String,
}

impl fmt::Debug for Consent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consent")
            .field("login_url", &Origin(&self.login_url))
            .field("state", &Hidden(&Some(())))
            .field("verifier", &Hidden(&Some(())))
            .finish()
    }
}

/// What a token endpoint granted.
pub struct Tokens {
    pub access_token: String,
    /// `None` on a refresh means the server keeps the old one valid.
    pub refresh_token: Option<String>,
    /// Unix milliseconds, from `expires_in`; `None` when it gave none.
    pub expires_at: Option<i64>,
    /// The answer's `scope`, when given; RFC 6749 §5.1 leaves it out when
    /// it is what was asked for.
    pub scopes: Option<Vec<String>>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokens")
            .field("access_token", &Hidden(&Some(())))
            .field("refresh_token", &Hidden(&self.refresh_token))
            .field("expires_at", &self.expires_at)
            .field("scopes", &self.scopes)
            .finish()
    }
}

/// Why a token endpoint call failed. Never carries a token, a code, a
/// verifier or the client secret.
#[derive(Debug, thiserror::Error)]
pub enum OAuthError {
    /// The endpoint answered with an OAuth error (RFC 6749 §5.2), such as
    /// `invalid_grant`: the code or refresh token is no good, and asking
    /// again will not help.
    #[error("the authorization server refused: {error}{}", shown(.description))]
    Refused {
        error: String,
        description: Option<String>,
    },
    /// Network trouble, an answer that is not OAuth, a 5xx: may pass.
    #[error("the token endpoint is unavailable: {0}")]
    Unavailable(String),
}

fn shown(description: &Option<String>) -> String {
    description
        .as_ref()
        .map(|d| format!(" ({d})"))
        .unwrap_or_default()
}

/// Begins an authorization-code flow with PKCE S256: a random state, a
/// random verifier, and the login URL. The scopes asked for are `scopes`
/// (the tool's) then the connection's own, each once, in that order. The
/// query of `authorize_url` is kept.
pub fn begin(config: &ConnectionConfig, scopes: &[String]) -> Consent {
    let auth_url = AuthUrl::new(config.authorize_url.clone().unwrap_or_default())
        .expect("authorize_url is validated at start-up");
    let client = BasicClient::new(client_id(config)).set_auth_uri(auth_url);
    let client = match redirect_url(config) {
        Some(redirect) => client.set_redirect_uri(redirect),
        None => client,
    };
    let (challenge, verifier) = PkceCodeChallenge::new_random_sha256_len(VERIFIER_BYTES);
    let (url, state) = client
        .authorize_url(|| CsrfToken::new_random_len(STATE_BYTES))
        .add_scopes(united(scopes, &config.scopes).map(Scope::new))
        .set_pkce_challenge(challenge)
        .url();
    Consent {
        login_url: url.into(),
        state: state.into_secret(),
        verifier: verifier.into_secret(),
    }
}

/// `first` then `second`, without repeats or empty names.
fn united<'a>(first: &'a [String], second: &'a [String]) -> impl Iterator<Item = String> + 'a {
    let mut seen = std::collections::HashSet::new();
    first
        .iter()
        .chain(second)
        .filter(move |scope| !scope.is_empty() && seen.insert(scope.as_str()))
        .cloned()
}

/// Trades the code of a consent's redirect for tokens; `verifier` is the
/// consent's.
pub async fn exchange(
    config: &ConnectionConfig,
    code: &str,
    verifier: &str,
) -> Result<Tokens, OAuthError> {
    let answer = token_client(config)?
        .exchange_code(AuthorizationCode::new(code.to_owned()))
        .set_pkce_verifier(PkceCodeVerifier::new(verifier.to_owned()))
        .request_async(&send)
        .await;
    tokens(answer, &[code, verifier, secret(config)])
}

/// A new access token for a refresh token. Servers that rotate refresh
/// tokens send a new one, and the old one is then spent.
pub async fn refresh(config: &ConnectionConfig, refresh_token: &str) -> Result<Tokens, OAuthError> {
    let answer = token_client(config)?
        .exchange_refresh_token(&RefreshToken::new(refresh_token.to_owned()))
        .request_async(&send)
        .await;
    tokens(answer, &[refresh_token, secret(config)])
}

type TokenClient =
    BasicClient<EndpointNotSet, EndpointNotSet, EndpointNotSet, EndpointNotSet, EndpointSet>;

/// The client for token requests. With a secret it authenticates with
/// HTTP Basic (`client_secret_basic`, the id and secret form-urlencoded as
/// RFC 6749 §2.3.1 asks); without, it is a public client and sends its
/// `client_id` in the body.
fn token_client(config: &ConnectionConfig) -> Result<TokenClient, OAuthError> {
    let token_url = TokenUrl::new(config.token_url.clone().unwrap_or_default())
        .map_err(|_| OAuthError::Unavailable("the token_url is not a URL".to_owned()))?;
    let client = BasicClient::new(client_id(config)).set_token_uri(token_url);
    let client = match &config.client_secret {
        Some(secret) => client.set_client_secret(ClientSecret::new(secret.clone())),
        None => client,
    };
    // The code exchange repeats the redirect URI of the authorization
    // request (RFC 6749 §4.1.3).
    Ok(match redirect_url(config) {
        Some(redirect) => client.set_redirect_uri(redirect),
        None => client,
    })
}

fn client_id(config: &ConnectionConfig) -> ClientId {
    ClientId::new(config.client_id.clone().unwrap_or_default())
}

fn redirect_url(config: &ConnectionConfig) -> Option<RedirectUrl> {
    config
        .redirect_uri
        .clone()
        .and_then(|uri| RedirectUrl::new(uri).ok())
}

fn secret(config: &ConnectionConfig) -> &str {
    config.client_secret.as_deref().unwrap_or_default()
}

/// Why sending a token request failed, in words fit for [`OAuthError`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Failure(String);

/// Sends one token request for the `oauth2` crate. Only a 2xx, or a 4xx
/// with an OAuth error in it, goes back to it to read: a redirect is not
/// followed (it could carry the form elsewhere), a 5xx is the server's
/// trouble, and a 4xx without an `error` (a proxy's 404 page) is no
/// refusal either.
async fn send(request: HttpRequest) -> Result<HttpResponse, Failure> {
    let client = http::client().map_err(|e| Failure(e.to_string()))?;
    let mut request = reqwest::Request::try_from(request).map_err(|e| Failure(http::failure(e)))?;
    *request.timeout_mut() = Some(TIMEOUT);
    let response = client
        .execute(request)
        .await
        .map_err(|e| Failure(http::failure(e)))?;
    let status = response.status();
    if status.is_redirection() {
        return Err(Failure(format!(
            "HTTP {status}: the token endpoint redirected, and redirects are not followed"
        )));
    }
    if !status.is_success() && !status.is_client_error() {
        return Err(Failure(format!("HTTP {status}")));
    }
    let headers = response.headers().clone();
    let (body, more) = http::read_capped(response, MAX_ANSWER_BYTES)
        .await
        .map_err(|e| Failure(http::failure(e)))?;
    if more {
        return Err(Failure(format!(
            "HTTP {status}: the answer is over {} KiB",
            MAX_ANSWER_BYTES / 1024
        )));
    }
    if status.is_client_error() && !is_oauth_error(&body) {
        return Err(Failure(format!(
            "HTTP {status}, without an OAuth 2.0 error"
        )));
    }
    // GitHub answers a refusal with a 200 and the error in the body; it is
    // read as the refusal it is.
    let status = if status.is_success() && is_oauth_error(&body) {
        reqwest::StatusCode::BAD_REQUEST
    } else {
        status
    };
    let mut answer = HttpResponse::new(body);
    *answer.status_mut() = status;
    *answer.headers_mut() = headers;
    Ok(answer)
}

/// Whether a body is an OAuth 2.0 error answer (RFC 6749 §5.2).
fn is_oauth_error(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .is_ok_and(|answer| answer.get("error").is_some_and(|e| e.is_string()))
}

/// The tokens of an answer, or why there are none. `sent` are the secrets
/// of the request, masked wherever the server's words repeat them.
fn tokens(
    answer: Result<BasicTokenResponse, RequestTokenError<Failure, BasicErrorResponse>>,
    sent: &[&str],
) -> Result<Tokens, OAuthError> {
    match answer {
        Ok(answer) => Ok(Tokens {
            access_token: answer.access_token().secret().clone(),
            refresh_token: answer.refresh_token().map(|t| t.secret().clone()),
            expires_at: answer.expires_in().map(|lasts| {
                let lasts = i64::try_from(lasts.as_millis()).unwrap_or(i64::MAX);
                now_millis().saturating_add(lasts)
            }),
            scopes: answer
                .scopes()
                .map(|scopes| scopes.iter().map(|s| s.to_string()).collect()),
        }),
        Err(RequestTokenError::ServerResponse(refusal)) => Err(OAuthError::Refused {
            error: outside(refusal.error().as_ref(), sent, MAX_CODE_CHARS),
            description: refusal
                .error_description()
                .map(|d| outside(d, sent, MAX_DESCRIPTION_CHARS)),
        }),
        Err(RequestTokenError::Request(Failure(kind))) => Err(OAuthError::Unavailable(kind)),
        // The body is not repeated: it may hold a token. The path names
        // the field only.
        Err(RequestTokenError::Parse(err, _)) => Err(OAuthError::Unavailable(format!(
            "the answer is not an OAuth 2.0 token response (at `{}`)",
            err.path()
        ))),
        Err(RequestTokenError::Other(text)) => Err(OAuthError::Unavailable(outside(
            &text,
            sent,
            MAX_DESCRIPTION_CHARS,
        ))),
    }
}

/// The server's text as it may be passed on: what we sent masked, then
/// anything else key-like, at most `max` characters.
fn outside(text: &str, sent: &[&str], max: usize) -> String {
    let mut text = text.trim().to_owned();
    for secret in sent.iter().filter(|s| !s.is_empty()) {
        text = text.replace(secret, redact::MASK);
    }
    let text = redact::secrets(&text);
    match text.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use base64::Engine;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use sha2::{Digest, Sha256};

    use super::*;

    fn config(authorize_url: &str, scopes: &[&str]) -> ConnectionConfig {
        let text = format!(
            r#"
provider = "example"
mode = "oauth2"
authorize_url = "{authorize_url}"
token_url = "https://auth.example.com/token"
client_id = "tether app"
redirect_uri = "https://tether.example.com/oauth/callback"
scopes = {scopes:?}
"#
        );
        toml::from_str(&text).unwrap()
    }

    fn query(url: &str) -> (String, Vec<(String, String)>) {
        let url = reqwest::Url::parse(url).unwrap();
        let base = format!("{}{}", url.origin().ascii_serialization(), url.path());
        (base, url.query_pairs().into_owned().collect())
    }

    fn challenge_of(verifier: &str) -> String {
        URL_SAFE_NO_PAD.encode(Sha256::digest(verifier.as_bytes()))
    }

    #[test]
    fn the_login_url_asks_for_a_code_with_pkce_s256() {
        let config = config("https://auth.example.com/authorize", &["read"]);
        let consent = begin(&config, &["write".to_owned()]);
        let (base, pairs) = query(&consent.login_url);
        assert_eq!(base, "https://auth.example.com/authorize");
        let params: HashMap<_, _> = pairs.iter().cloned().collect();
        assert_eq!(params.len(), pairs.len(), "no parameter twice: {pairs:?}");
        let expected = [
            ("response_type", "code"),
            ("client_id", "tether app"),
            ("redirect_uri", "https://tether.example.com/oauth/callback"),
            ("scope", "write read"),
            ("state", consent.state.as_str()),
            ("code_challenge_method", "S256"),
        ];
        for (name, value) in expected {
            assert_eq!(params.get(name).map(String::as_str), Some(value), "{name}");
        }
        assert_eq!(params["code_challenge"], challenge_of(&consent.verifier));
        assert!(!consent.login_url.contains(&consent.verifier));
    }

    #[test]
    fn the_challenge_is_the_rfc_7636_s256_of_the_verifier() {
        // RFC 7636, appendix B.
        let verifier = "dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk";
        assert_eq!(
            challenge_of(verifier),
            "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
        );
        let ours = PkceCodeChallenge::from_code_verifier_sha256(&PkceCodeVerifier::new(
            verifier.to_owned(),
        ));
        assert_eq!(ours.as_str(), challenge_of(verifier));
    }

    #[test]
    fn state_and_verifier_are_long_random_and_fresh_each_time() {
        let config = config("https://auth.example.com/authorize", &[]);
        let consents: Vec<Consent> = (0..16).map(|_| begin(&config, &[])).collect();
        for consent in &consents {
            let state = URL_SAFE_NO_PAD.decode(&consent.state).unwrap();
            assert_eq!(state.len(), 32);
            let verifier = URL_SAFE_NO_PAD.decode(&consent.verifier).unwrap();
            assert_eq!(verifier.len(), 32);
            assert_eq!(consent.verifier.len(), 43, "RFC 7636 §4.1: 43 to 128");
        }
        let states: std::collections::HashSet<_> = consents.iter().map(|c| &c.state).collect();
        let verifiers: std::collections::HashSet<_> =
            consents.iter().map(|c| &c.verifier).collect();
        assert_eq!(states.len(), consents.len());
        assert_eq!(verifiers.len(), consents.len());
        assert!(consents.iter().all(|c| c.state != c.verifier));
    }

    #[test]
    fn scopes_are_united_in_order_without_repeats_and_none_means_no_scope() {
        let scoped = config("https://auth.example.com/authorize", &["b", "a", "c"]);
        let tool = ["a".to_owned(), "d".to_owned(), "a".to_owned()];
        let (_, pairs) = query(&begin(&scoped, &tool).login_url);
        let scope = pairs.iter().find(|(k, _)| k == "scope").unwrap();
        assert_eq!(scope.1, "a d b c");

        let unscoped = config("https://auth.example.com/authorize", &[]);
        let (_, pairs) = query(&begin(&unscoped, &[]).login_url);
        assert!(pairs.iter().all(|(k, _)| k != "scope"), "{pairs:?}");
    }

    #[test]
    fn the_query_of_the_authorize_url_is_kept() {
        let config = config(
            "https://auth.example.com/o/authorize?audience=api&prompt=consent",
            &[],
        );
        let (base, pairs) = query(&begin(&config, &[]).login_url);
        assert_eq!(base, "https://auth.example.com/o/authorize");
        assert_eq!(pairs[0], ("audience".to_owned(), "api".to_owned()));
        assert_eq!(pairs[1], ("prompt".to_owned(), "consent".to_owned()));
        assert!(
            pairs
                .iter()
                .any(|(k, v)| k == "response_type" && v == "code")
        );
    }

    #[test]
    fn debug_shows_no_secret() {
        let config = config("https://auth.example.com/authorize", &[]);
        let consent = begin(&config, &[]);
        let shown = format!("{consent:?}");
        assert!(!shown.contains(&consent.state), "{shown}");
        assert!(!shown.contains(&consent.verifier), "{shown}");
        let tokens = Tokens {
            access_token: "at-s3cr3t".into(),
            refresh_token: Some("rt-s3cr3t".into()),
            expires_at: Some(1),
            scopes: Some(vec!["read".into()]),
        };
        let shown = format!("{tokens:?}");
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert!(shown.contains("read"), "{shown}");
    }

    #[test]
    fn server_text_loses_what_was_sent_and_is_capped() {
        let text = format!(
            "code c0de-abc does not match verifier v3r1f {}",
            "x".repeat(300)
        );
        let shown = outside(&text, &["c0de-abc", "v3r1f", ""], MAX_DESCRIPTION_CHARS);
        assert!(
            !shown.contains("c0de-abc") && !shown.contains("v3r1f"),
            "{shown}"
        );
        assert!(
            shown.starts_with("code [redacted] does not match"),
            "{shown}"
        );
        assert_eq!(shown.chars().count(), MAX_DESCRIPTION_CHARS + 1);
        assert!(shown.ends_with('…'));
    }
}
