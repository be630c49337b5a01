//! The OAuth 2.0 client side of a connection: the authorization request
//! (PKCE S256, state) and the token endpoint (code exchange, refresh).
//! PLACEHOLDER while the real client is written on its branch.

use crate::config::ConnectionConfig;

pub struct Consent {
    pub login_url: String,
    pub state: String,
    pub verifier: String,
}

pub fn begin(config: &ConnectionConfig, scopes: &[String]) -> Consent {
    let _ = (config, scopes);
    unimplemented!()
}

pub struct Tokens {
    pub access_token: String,
    pub refresh_token: Option<String>,
    pub expires_at: Option<i64>,
    pub scopes: Option<Vec<String>>,
}

#[derive(Debug, thiserror::Error)]
pub enum OAuthError {
    #[error("refused: {error}")]
    Refused {
        error: String,
        description: Option<String>,
    },
    #[error("{0}")]
    Unavailable(String),
}

pub async fn exchange(
    config: &ConnectionConfig,
    code: &str,
    verifier: &str,
) -> Result<Tokens, OAuthError> {
    let _ = (config, code, verifier);
    unimplemented!()
}

pub async fn refresh(config: &ConnectionConfig, refresh_token: &str) -> Result<Tokens, OAuthError> {
    let _ = (config, refresh_token);
    unimplemented!()
}
