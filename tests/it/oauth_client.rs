//! The OAuth 2.0 client (`tether::connections::oauth`) against a real
//! authorization server: the authorization-code flow with PKCE, single-use
//! codes, rotating refresh tokens, and client authentication.

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use tether::config::ConnectionConfig;
use tether::connections::oauth::{self, OAuthError, Tokens};
use tether::domain::time::now_millis;

use crate::oauth_server::{AuthServer, CLIENT_SECRET, CONFIDENTIAL_CLIENT};

const REDIRECT_URI: &str = "http://127.0.0.1:9/oauth/callback";

/// A connection to `server` as `client_id`, with `secret` when given.
fn connection(server: &AuthServer, client_id: &str, secret: Option<&str>) -> ConnectionConfig {
    let text = format!(
        r#"
provider = "example"
mode = "oauth2"
authorize_url = "{}"
token_url = "{}"
client_id = "{client_id}"
redirect_uri = "{REDIRECT_URI}"
scopes = ["profile"]
"#,
        server.authorize_url(),
        server.token_url()
    );
    let mut config: ConnectionConfig = toml::from_str(&text).unwrap();
    config.client_secret = secret.map(str::to_owned);
    config
}

/// Consent given in the browser, and its code traded for tokens.
async fn consented(server: &AuthServer, config: &ConnectionConfig) -> Tokens {
    let consent = oauth::begin(config, &["files.read".to_owned()]);
    let (code, state) = server.consent(&consent.login_url).await;
    assert_eq!(state, consent.state);
    oauth::exchange(config, &code, &consent.verifier)
        .await
        .unwrap()
}

fn refusal(result: Result<Tokens, OAuthError>) -> (String, Option<String>) {
    match result {
        Err(OAuthError::Refused { error, description }) => (error, description),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn oauth_a_code_with_its_verifier_gives_tokens() {
    let server = AuthServer::start().await;
    let config = connection(&server, "tether-public", None);
    let before = now_millis();
    let tokens = consented(&server, &config).await;
    assert!(!tokens.access_token.is_empty());
    assert!(
        tokens
            .refresh_token
            .as_deref()
            .is_some_and(|t| !t.is_empty())
    );
    // The mock's default lifetime is an hour.
    let expires_at = tokens.expires_at.unwrap();
    assert!(
        (before + 3_600_000..=now_millis() + 3_600_000).contains(&expires_at),
        "{expires_at}"
    );
    assert_eq!(
        tokens.scopes,
        Some(vec!["files.read".to_owned(), "profile".to_owned()])
    );
    assert_eq!(server.token_requests("authorization_code").await, 1);
    assert_eq!(server.token_requests("refresh_token").await, 0);
}

#[tokio::test]
async fn oauth_a_wrong_verifier_is_refused_and_nothing_secret_is_repeated() {
    let server = AuthServer::start().await;
    let config = connection(&server, "tether-public", None);
    let consent = oauth::begin(&config, &[]);
    let other = oauth::begin(&config, &[]);
    let (code, _) = server.consent(&consent.login_url).await;
    let err = oauth::exchange(&config, &code, &other.verifier)
        .await
        .unwrap_err();
    let shown = format!("{err} {err:?}");
    for secret in [&code, &consent.verifier, &other.verifier] {
        assert!(!shown.contains(secret.as_str()), "{shown}");
    }
    let (error, _) = refusal(Err(err));
    assert_eq!(error, "invalid_grant");
}

#[tokio::test]
async fn oauth_a_code_is_good_once() {
    let server = AuthServer::start().await;
    let config = connection(&server, "tether-public", None);
    let consent = oauth::begin(&config, &[]);
    let (code, _) = server.consent(&consent.login_url).await;
    oauth::exchange(&config, &code, &consent.verifier)
        .await
        .unwrap();
    let again = oauth::exchange(&config, &code, &consent.verifier).await;
    assert_eq!(refusal(again).0, "invalid_grant");
    assert_eq!(server.token_requests("authorization_code").await, 2);
}

#[tokio::test]
async fn oauth_refresh_rotates_the_refresh_token_and_the_old_one_is_refused() {
    let server = AuthServer::start().await;
    server.set_expires_in(2).await;
    let config = connection(&server, "tether-public", None);
    let first = consented(&server, &config).await;
    let expires_at = first.expires_at.unwrap();
    assert!(expires_at <= now_millis() + 2_000, "{expires_at}");
    let old = first.refresh_token.unwrap();

    let second = oauth::refresh(&config, &old).await.unwrap();
    assert_ne!(second.access_token, first.access_token);
    let new = second.refresh_token.unwrap();
    assert_ne!(new, old);
    assert_eq!(second.scopes, first.scopes);

    let spent = oauth::refresh(&config, &old).await;
    assert_eq!(refusal(spent).0, "invalid_grant");
    oauth::refresh(&config, &new).await.unwrap();
    assert_eq!(server.token_requests("refresh_token").await, 3);
}

#[tokio::test]
async fn oauth_a_client_secret_goes_as_basic_auth() {
    let server = AuthServer::start().await;
    let config = connection(&server, CONFIDENTIAL_CLIENT, Some(CLIENT_SECRET));
    let tokens = consented(&server, &config).await;
    oauth::refresh(&config, &tokens.refresh_token.unwrap())
        .await
        .unwrap();

    // The mock refuses a wrong secret, and a confidential client that does
    // not authenticate (its client_id in the body only).
    for secret in [Some("not-the-secret"), None] {
        let config = connection(&server, CONFIDENTIAL_CLIENT, secret);
        let consent = oauth::begin(&config, &[]);
        let (code, _) = server.consent(&consent.login_url).await;
        let err = oauth::exchange(&config, &code, &consent.verifier).await;
        assert_eq!(refusal(err).0, "invalid_client", "{secret:?}");
    }
}

#[tokio::test]
async fn oauth_an_error_in_a_200_answer_is_a_refusal() {
    // As GitHub answers a bad code.
    let server = AuthServer::start().await;
    let mut config = connection(&server, "tether-public", None);
    let body = r#"{"error":"bad_verification_code","error_description":"The code passed is incorrect or expired."}"#;
    config.token_url = Some(answering(StatusCode::OK, "application/json", body).await);
    let (error, description) = refusal(oauth::exchange(&config, "c0de", "v3r1f13r").await);
    assert_eq!(error, "bad_verification_code");
    assert_eq!(
        description.as_deref(),
        Some("The code passed is incorrect or expired.")
    );
}

/// A token endpoint that always answers `status` with `body`.
async fn answering(status: StatusCode, content_type: &'static str, body: &'static str) -> String {
    let app = Router::new().route(
        "/token",
        post(move || async move { (status, [("content-type", content_type)], body) }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}/token")
}

fn unavailable(result: Result<Tokens, OAuthError>) -> String {
    match result {
        Err(OAuthError::Unavailable(message)) => message,
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test]
async fn oauth_trouble_at_the_token_endpoint_is_unavailable_and_quotes_no_body() {
    let server = AuthServer::start().await;
    let mut config = connection(&server, "tether-public", None);

    let json = "application/json";
    config.token_url = Some(
        answering(
            StatusCode::SERVICE_UNAVAILABLE,
            json,
            r#"{"error":"temporarily_unavailable"}"#,
        )
        .await,
    );
    let message = unavailable(oauth::refresh(&config, "rt-1").await);
    assert!(message.contains("503"), "{message}");

    config.token_url = Some(answering(StatusCode::OK, json, r#"{"access_token": 7}"#).await);
    let message = unavailable(oauth::refresh(&config, "rt-1").await);
    assert!(message.contains("access_token"), "{message}");
    assert!(!message.contains('7'), "{message}");

    config.token_url = Some(answering(StatusCode::NOT_FOUND, "text/html", "<h1>No</h1>").await);
    let message = unavailable(oauth::refresh(&config, "rt-1").await);
    assert!(message.contains("404"), "{message}");

    config.token_url = Some(answering(StatusCode::FOUND, json, "").await);
    let message = unavailable(oauth::refresh(&config, "rt-1").await);
    assert!(message.contains("redirect"), "{message}");

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    config.token_url = Some(format!("http://127.0.0.1:{port}/token?key=s3cr3t"));
    let message = unavailable(oauth::refresh(&config, "rt-1").await);
    assert_eq!(message, "connection refused");
}
