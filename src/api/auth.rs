//! JWT authentication: HS256 tokens with `sub`, `tenant` and `exp`.

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

use crate::domain::time::now_millis;

/// The secret used when `TETHER_JWT_SECRET` is unset (loopback only).
pub const DEVELOPMENT_SECRET: &str = "tether-development-secret-do-not-use-in-production";

/// The authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Viewer {
    pub tenant: String,
    pub principal: String,
    /// When the token expires, in seconds since the epoch.
    pub expires_at: i64,
}

impl Viewer {
    /// How long until the token expires; zero once it has.
    pub fn expires_in(&self) -> std::time::Duration {
        let left = self
            .expires_at
            .saturating_mul(1000)
            .saturating_sub(now_millis());
        std::time::Duration::from_millis(u64::try_from(left).unwrap_or(0))
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    sub: String,
    tenant: String,
    exp: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing bearer token")]
    Missing,
    #[error("invalid token")]
    Invalid,
}

#[derive(Clone)]
pub struct Authenticator {
    encoding: EncodingKey,
    decoding: DecodingKey,
    validation: Validation,
}

impl Authenticator {
    pub fn new(secret: &str) -> Result<Authenticator, jsonwebtoken::errors::Error> {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_required_spec_claims(&["exp", "sub"]);
        validation.leeway = 0;
        validation.validate_exp = true;
        Ok(Authenticator {
            encoding: EncodingKey::from_secret(secret.as_bytes())?,
            decoding: DecodingKey::from_secret(secret.as_bytes())?,
            validation,
        })
    }

    /// Verifies a bearer token; only HS256 with this secret is accepted.
    pub fn verify(&self, token: &str) -> Result<Viewer, AuthError> {
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation)
            .map_err(|_| AuthError::Invalid)?;
        let claims = data.claims;
        if claims.sub.is_empty() || claims.tenant.is_empty() {
            return Err(AuthError::Invalid);
        }
        Ok(Viewer {
            tenant: claims.tenant,
            principal: claims.sub,
            expires_at: claims.exp,
        })
    }

    /// Verifies an `Authorization` header value of the form `Bearer <jwt>`.
    pub fn verify_header(&self, value: Option<&str>) -> Result<Viewer, AuthError> {
        let value = value.ok_or(AuthError::Missing)?.trim();
        let (scheme, token) = value.split_once(' ').ok_or(AuthError::Invalid)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(AuthError::Invalid);
        }
        self.verify(token.trim())
    }

    /// Signs a token for `sub` in `tenant`, valid for `ttl`.
    pub fn mint(&self, tenant: &str, sub: &str, ttl: std::time::Duration) -> String {
        let claims = Claims {
            sub: sub.to_owned(),
            tenant: tenant.to_owned(),
            exp: now_millis() / 1000 + ttl.as_secs() as i64,
        };
        // Encoding HS256 with an in-memory key cannot fail.
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &self.encoding)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;
    use std::time::Duration;

    fn b64(value: serde_json::Value) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(value.to_string())
    }

    #[test]
    fn a_minted_token_verifies() {
        let auth = Authenticator::new("s3cret").unwrap();
        let token = auth.mint("acme", "ada", Duration::from_secs(60));
        let viewer = auth.verify(&token).unwrap();
        assert_eq!(
            (viewer.tenant.as_str(), viewer.principal.as_str()),
            ("acme", "ada")
        );
        assert_eq!(
            auth.verify_header(Some(&format!("bearer {token}")))
                .unwrap(),
            viewer
        );
    }

    #[test]
    fn forged_expired_and_incomplete_tokens_are_refused() {
        let auth = Authenticator::new("s3cret").unwrap();
        let other =
            Authenticator::new("other")
                .unwrap()
                .mint("acme", "ada", Duration::from_secs(60));
        assert_eq!(auth.verify(&other), Err(AuthError::Invalid));

        let exp = now_millis() / 1000 + 60;
        let unsigned = format!(
            "{}.{}.",
            b64(serde_json::json!({"alg": "none", "typ": "JWT"})),
            b64(serde_json::json!({"sub": "ada", "tenant": "acme", "exp": exp}))
        );
        assert_eq!(auth.verify(&unsigned), Err(AuthError::Invalid));

        let expired = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &serde_json::json!({"sub": "ada", "tenant": "acme", "exp": exp - 120}),
            &EncodingKey::from_secret(b"s3cret").unwrap(),
        )
        .unwrap();
        assert_eq!(auth.verify(&expired), Err(AuthError::Invalid));

        let no_tenant = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &serde_json::json!({"sub": "ada", "exp": exp}),
            &EncodingKey::from_secret(b"s3cret").unwrap(),
        )
        .unwrap();
        assert_eq!(auth.verify(&no_tenant), Err(AuthError::Invalid));
        assert_eq!(auth.verify_header(None), Err(AuthError::Missing));
        assert_eq!(
            auth.verify_header(Some("Basic abc")),
            Err(AuthError::Invalid)
        );
    }
}
