//! JWT authentication. HS256 tokens verify against `TETHER_JWT_SECRET` and
//! the previous secrets still accepted during a rotation; asymmetric tokens
//! (RS256, ES256, EdDSA and their kin) against an identity provider's JWKS.
//! The algorithm in a token's header only chooses which of the two is
//! asked, never which kind of key: an HS256 token is never checked against
//! a JWKS key, nor an RS256 token against a secret.

mod jwks;
pub mod secret_file;

use std::time::Duration;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde_json::{Map, Value};

use crate::config::{AuthConfig, MIN_SECRET_BYTES};
use crate::domain::time::now_millis;
use jwks::{Jwks, JwksSettings};

pub use jwks::JwksError;

/// The longest an open connection waits for its token to expire: beyond
/// this a timer could not be set. A connection that outlives it is closed as
/// expired and reconnects.
const MAX_EXPIRY_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// The authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Viewer {
    pub tenant: String,
    pub principal: String,
    /// When the token expires, in seconds since the epoch.
    pub expires_at: i64,
    /// The token carries `auth.operator_claim`: its holder may use the
    /// operators' queries and mutations, across tenants.
    pub operator: bool,
    /// The token carries `auth.delegation_claim`: its holder may act on
    /// other principals' runs of its tenant.
    pub delegate: bool,
    /// The token's `iss`, when it has one: who vouches for the principal
    /// (recorded with an operator's actions).
    pub issuer: Option<String>,
}

impl Viewer {
    /// How long from now until the token expires, zero once it has. A token
    /// may carry any `exp`: nothing here overflows.
    pub fn expires_in(&self) -> Duration {
        let left_ms = self
            .expires_at
            .saturating_mul(1000)
            .saturating_sub(now_millis());
        Duration::from_millis(u64::try_from(left_ms).unwrap_or(0)).min(MAX_EXPIRY_WAIT)
    }

    /// Who sends a request the schema is preparing: over HTTP the viewer
    /// comes with the request, over a WebSocket with its connection.
    pub fn of_request<'a>(
        request: &'a async_graphql::Request,
        ctx: &'a async_graphql::extensions::ExtensionContext<'a>,
    ) -> Option<&'a Viewer> {
        request
            .data
            .get(&std::any::TypeId::of::<Viewer>())
            .and_then(|viewer| viewer.downcast_ref::<Viewer>())
            .or_else(|| ctx.data_opt::<Viewer>())
    }

    /// A plain principal of `tenant` whose token never expires, for the
    /// API's unit tests.
    #[cfg(test)]
    pub fn of(tenant: &str, principal: &str) -> Viewer {
        Viewer {
            tenant: tenant.into(),
            principal: principal.into(),
            expires_at: i64::MAX,
            operator: false,
            delegate: false,
            issuer: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing token")]
    Missing,
    #[error("invalid token: {0}")]
    Invalid(Refusal),
    #[error("no secret to sign tokens with: set TETHER_JWT_SECRET")]
    CannotSign,
    #[error("no token can be an operator's: set auth.operator_claim")]
    NoOperators,
}

impl AuthError {
    /// Why the caller was refused, in the words of `extensions.reason`:
    /// enough for its developer to fix the token, nothing of the secrets.
    pub fn reason(&self) -> String {
        match self {
            AuthError::Invalid(refusal) => refusal.to_string(),
            other => other.to_string(),
        }
    }
}

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("not a bearer token")]
    NotBearer,
    #[error("malformed token")]
    Malformed,
    #[error("algorithm not accepted")]
    Algorithm,
    /// A JWKS token whose `kid` the identity provider does not list.
    #[error("unknown signing key")]
    UnknownKey,
    #[error("bad signature")]
    BadSignature,
    #[error("expired")]
    Expired,
    #[error("not yet valid")]
    NotYetValid,
    #[error("wrong issuer")]
    WrongIssuer,
    #[error("wrong audience")]
    WrongAudience,
    #[error("missing claim {0}")]
    MissingClaim(String),
    /// Present, but not of the type it must have (a number for `exp`, a
    /// non-empty string for the tenant and the principal).
    #[error("invalid claim {0}")]
    InvalidClaim(String),
    /// A token sent in a URL (where proxies and browsers keep it) that
    /// lives longer than such a token may.
    #[error("a token in the URL must expire within {0} s")]
    LongLivedInUrl(u64),
}

impl From<Refusal> for AuthError {
    fn from(refusal: Refusal) -> AuthError {
        AuthError::Invalid(refusal)
    }
}

impl Refusal {
    fn of(err: &jsonwebtoken::errors::Error) -> Refusal {
        use jsonwebtoken::errors::ErrorKind;
        match err.kind() {
            ErrorKind::InvalidSignature => Refusal::BadSignature,
            ErrorKind::ExpiredSignature => Refusal::Expired,
            ErrorKind::ImmatureSignature => Refusal::NotYetValid,
            ErrorKind::InvalidIssuer => Refusal::WrongIssuer,
            ErrorKind::InvalidAudience => Refusal::WrongAudience,
            ErrorKind::MissingRequiredClaim(claim) => Refusal::MissingClaim(claim.clone()),
            ErrorKind::InvalidClaimFormat(claim) => Refusal::InvalidClaim(claim.clone()),
            ErrorKind::InvalidAlgorithm
            | ErrorKind::MissingAlgorithm
            | ErrorKind::InvalidAlgorithmName
            | ErrorKind::UnsupportedAlgorithm => Refusal::Algorithm,
            _ => Refusal::Malformed,
        }
    }
}

/// Why an authenticator cannot be built from its configuration.
#[derive(Debug, thiserror::Error)]
pub enum AuthSetupError {
    #[error("TETHER_JWT_SECRET: the secret must be at least {MIN_SECRET_BYTES} bytes long")]
    WeakSecret,
    #[error("TETHER_JWT_SECRET is not a usable HS256 secret: {0}")]
    Secret(#[from] jsonwebtoken::errors::Error),
    #[error("auth.algorithms: {0:?} is not an algorithm a JWKS can verify")]
    Algorithm(String),
    #[error("neither a secret nor a JWKS is configured: set TETHER_JWT_SECRET or TETHER_JWKS_URL")]
    Nothing,
    #[error(transparent)]
    Jwks(#[from] JwksError),
}

pub struct Authenticator {
    /// The first signs `tether token`; all verify.
    secrets: Vec<(EncodingKey, DecodingKey)>,
    jwks: Option<(Jwks, Vec<Algorithm>)>,
    /// `exp`, `nbf`, `iss` and `aud` as configured; the algorithm is set
    /// per token.
    validation: Validation,
    tenant_claim: String,
    principal_claim: String,
    operator_claim: Option<String>,
    /// Where operators' tokens may come from; empty: anywhere.
    operator_issuers: Vec<String>,
    operator_tenants: Vec<String>,
    delegation_claim: Option<String>,
}

impl Authenticator {
    /// HS256 with one secret and the default claim names.
    pub fn new(secret: &str) -> Result<Authenticator, AuthSetupError> {
        Authenticator::from_config(&AuthConfig::default(), vec![secret.to_owned()])
    }

    /// `secrets`: the HS256 secrets, the signing one first; the JWKS and
    /// the claims from `config`.
    pub fn from_config(
        config: &AuthConfig,
        secrets: Vec<String>,
    ) -> Result<Authenticator, AuthSetupError> {
        let secrets = secrets
            .iter()
            .map(|secret| {
                if secret.len() < MIN_SECRET_BYTES {
                    return Err(AuthSetupError::WeakSecret);
                }
                Ok((
                    EncodingKey::from_secret(secret.as_bytes())?,
                    DecodingKey::from_secret(secret.as_bytes())?,
                ))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let jwks = match &config.jwks_url {
            Some(url) => {
                let algorithms = config
                    .jwks_algorithms()
                    .into_iter()
                    .map(|name| match name.parse::<Algorithm>() {
                        Ok(alg) if alg.family() != jsonwebtoken::AlgorithmFamily::Hmac => Ok(alg),
                        _ => Err(AuthSetupError::Algorithm(name.to_owned())),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let jwks = Jwks::new(JwksSettings {
                    url: url.clone(),
                    refresh: Duration::from_secs(config.jwks_refresh_secs),
                    min_refetch: Duration::from_secs(config.jwks_min_refetch_secs),
                    timeout: Duration::from_secs(config.jwks_timeout_secs),
                })?;
                Some((jwks, algorithms))
            }
            None => None,
        };
        if secrets.is_empty() && jwks.is_none() {
            return Err(AuthSetupError::Nothing);
        }
        let mut validation = Validation::new(Algorithm::HS256);
        let mut required = vec!["exp"];
        validation.leeway = 0;
        validation.validate_exp = true;
        validation.validate_nbf = true;
        if let Some(issuer) = &config.issuer {
            validation.set_issuer(&[issuer]);
            required.push("iss");
        }
        match &config.audience {
            Some(audience) => {
                validation.set_audience(&[audience]);
                required.push("aud");
            }
            // Identity providers put an audience in every token; with none
            // configured there is nothing to hold it against.
            None => validation.validate_aud = false,
        }
        validation.set_required_spec_claims(&required);
        Ok(Authenticator {
            secrets,
            jwks,
            validation,
            tenant_claim: config.tenant_claim.clone(),
            principal_claim: config.principal_claim.clone(),
            operator_claim: config.operator_claim.clone(),
            operator_issuers: config.operator_issuers.clone(),
            operator_tenants: config.operator_tenants.clone(),
            delegation_claim: config.delegation_claim.clone(),
        })
    }

    /// Verifies a bearer token.
    pub async fn verify(&self, token: &str) -> Result<Viewer, AuthError> {
        let header = jsonwebtoken::decode_header(token).map_err(|err| match names_alg(token) {
            // A header that parses but names an algorithm this library
            // does not verify (`none`).
            true => Refusal::Algorithm,
            false => Refusal::of(&err),
        })?;
        let mut validation = self.validation.clone();
        validation.algorithms = vec![header.alg];
        let claims = if header.alg == Algorithm::HS256 {
            if self.secrets.is_empty() {
                return Err(Refusal::Algorithm.into());
            }
            // The signature is checked before the claims: a secret that
            // verifies it decides, and a token none verifies has a bad
            // signature.
            let mut refused = Refusal::BadSignature;
            let mut claims = None;
            for (_, key) in &self.secrets {
                match decode(token, key, &validation) {
                    Ok(verified) => {
                        claims = Some(verified);
                        break;
                    }
                    Err(Refusal::BadSignature) => {}
                    Err(refusal) => {
                        refused = refusal;
                        break;
                    }
                }
            }
            claims.ok_or(refused)?
        } else {
            let (jwks, algorithms) = self.jwks.as_ref().ok_or(Refusal::Algorithm)?;
            if !algorithms.contains(&header.alg) {
                return Err(Refusal::Algorithm.into());
            }
            let key = jwks
                .key(header.kid.as_deref())
                .await
                .ok_or(Refusal::UnknownKey)?;
            let pinned = key.algorithm.is_none_or(|alg| alg == header.alg);
            if !pinned || key.decoding.family() != header.alg.family() {
                return Err(Refusal::Algorithm.into());
            }
            decode(token, &key.decoding, &validation)?
        };
        self.viewer(claims)
    }

    fn viewer(&self, claims: Map<String, Value>) -> Result<Viewer, AuthError> {
        let claimed = |claim: &Option<String>| {
            claim
                .as_ref()
                .is_some_and(|claim| claims.get(claim) == Some(&Value::Bool(true)))
        };
        let text = |name: &str| match claims.get(name) {
            None | Some(Value::Null) => Err(Refusal::MissingClaim(name.to_owned())),
            Some(Value::String(value)) if !value.is_empty() => Ok(value.clone()),
            Some(_) => Err(Refusal::InvalidClaim(name.to_owned())),
        };
        let tenant = text(&self.tenant_claim)?;
        let issuer = claims.get("iss").and_then(Value::as_str).map(str::to_owned);
        let listed = |allowed: &[String], value: Option<&str>| {
            allowed.is_empty() || value.is_some_and(|v| allowed.iter().any(|a| a == v))
        };
        let operator = claimed(&self.operator_claim)
            && listed(&self.operator_issuers, issuer.as_deref())
            && listed(&self.operator_tenants, Some(&tenant));
        Ok(Viewer {
            tenant,
            principal: text(&self.principal_claim)?,
            expires_at: claims
                .get("exp")
                .and_then(Value::as_i64)
                .ok_or_else(|| Refusal::InvalidClaim("exp".to_owned()))?,
            operator,
            delegate: claimed(&self.delegation_claim),
            issuer,
        })
    }

    /// Verifies an `Authorization` header value of the form `Bearer <jwt>`.
    /// A refusal is logged at debug level with its reason.
    pub async fn verify_header(&self, value: Option<&str>) -> Result<Viewer, AuthError> {
        let verified = self.verify_bearer(value).await;
        if let Err(err) = &verified {
            tracing::debug!(reason = %err.reason(), "authentication refused");
        }
        verified
    }

    async fn verify_bearer(&self, value: Option<&str>) -> Result<Viewer, AuthError> {
        let value = value.ok_or(AuthError::Missing)?.trim();
        if value.is_empty() {
            return Err(AuthError::Missing);
        }
        let (scheme, token) = value.split_once(' ').unwrap_or((value, ""));
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(Refusal::NotBearer.into());
        }
        let token = token.trim();
        if token.is_empty() {
            return Err(AuthError::Missing);
        }
        self.verify(token).await
    }

    /// Signs an HS256 token for `sub` in `tenant`, valid for `ttl`, with
    /// the configured claim names and issuer and audience.
    pub fn mint(&self, tenant: &str, sub: &str, ttl: Duration) -> Result<String, AuthError> {
        self.sign(tenant, sub, ttl, None)
    }

    /// `mint`, with `auth.operator_claim` set: an operator's token.
    pub fn mint_operator(
        &self,
        tenant: &str,
        sub: &str,
        ttl: Duration,
    ) -> Result<String, AuthError> {
        let claim = self
            .operator_claim
            .as_deref()
            .ok_or(AuthError::NoOperators)?;
        self.sign(tenant, sub, ttl, Some(claim))
    }

    fn sign(
        &self,
        tenant: &str,
        sub: &str,
        ttl: Duration,
        operator_claim: Option<&str>,
    ) -> Result<String, AuthError> {
        let (key, _) = self.secrets.first().ok_or(AuthError::CannotSign)?;
        let ttl = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX);
        let mut claims = Map::new();
        claims.insert(self.principal_claim.clone(), sub.into());
        claims.insert(self.tenant_claim.clone(), tenant.into());
        claims.insert(
            "exp".into(),
            (now_millis() / 1000).saturating_add(ttl).into(),
        );
        if let Some(issuer) = self.validation.iss.iter().flatten().next() {
            claims.insert("iss".into(), issuer.clone().into());
        }
        if let Some(audience) = self.validation.aud.iter().flatten().next() {
            claims.insert("aud".into(), audience.clone().into());
        }
        if let Some(claim) = operator_claim {
            claims.insert(claim.to_owned(), true.into());
        }
        // Encoding HS256 with an in-memory key cannot fail.
        Ok(jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, key).unwrap_or_default())
    }
}

/// Whether the token's header is a JSON object naming an algorithm.
fn names_alg(token: &str) -> bool {
    use base64::Engine;
    let Some(header) = token.split('.').next() else {
        return false;
    };
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(header)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<Map<String, Value>>(&bytes).ok())
        .is_some_and(|header| header.get("alg").is_some_and(Value::is_string))
}

fn decode(
    token: &str,
    key: &DecodingKey,
    validation: &Validation,
) -> Result<Map<String, Value>, Refusal> {
    jsonwebtoken::decode::<Map<String, Value>>(token, key, validation)
        .map(|data| data.claims)
        .map_err(|err| Refusal::of(&err))
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    const SECRET: &str = "unit-test-secret-of-at-least-32-bytes";
    const OTHER: &str = "another-unit-test-secret-32-bytes-long";

    fn b64(value: serde_json::Value) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(value.to_string())
    }

    fn hs256(claims: serde_json::Value, secret: &str) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(secret.as_bytes()).unwrap(),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn a_minted_token_verifies() {
        let auth = Authenticator::new(SECRET).unwrap();
        let token = auth.mint("acme", "ada", Duration::from_secs(60)).unwrap();
        let viewer = auth.verify(&token).await.unwrap();
        assert_eq!(
            (viewer.tenant.as_str(), viewer.principal.as_str()),
            ("acme", "ada")
        );
        assert_eq!(
            auth.verify_header(Some(&format!("bearer {token}")))
                .await
                .unwrap(),
            viewer
        );
    }

    #[tokio::test]
    async fn forged_expired_premature_and_incomplete_tokens_are_refused() {
        let auth = Authenticator::new(SECRET).unwrap();
        let other = Authenticator::new(OTHER)
            .unwrap()
            .mint("acme", "ada", Duration::from_secs(60))
            .unwrap();
        assert_eq!(auth.verify(&other).await, Err(Refusal::BadSignature.into()));

        let exp = now_millis() / 1000 + 60;
        let unsigned = format!(
            "{}.{}.",
            b64(serde_json::json!({"alg": "none", "typ": "JWT"})),
            b64(serde_json::json!({"sub": "ada", "tenant": "acme", "exp": exp}))
        );
        assert_eq!(auth.verify(&unsigned).await, Err(Refusal::Algorithm.into()));
        let claim = |name: &str| name.to_owned();
        for (claims, refusal) in [
            (
                serde_json::json!({"sub": "ada", "tenant": "acme", "exp": exp - 120}),
                Refusal::Expired,
            ),
            (
                serde_json::json!({"sub": "ada", "tenant": "acme", "exp": exp, "nbf": exp - 1}),
                Refusal::NotYetValid,
            ),
            (
                serde_json::json!({"sub": "ada", "exp": exp}),
                Refusal::MissingClaim(claim("tenant")),
            ),
            (
                serde_json::json!({"sub": "ada", "tenant": "acme"}),
                Refusal::MissingClaim(claim("exp")),
            ),
            (
                serde_json::json!({"sub": "", "tenant": "acme", "exp": exp}),
                Refusal::InvalidClaim(claim("sub")),
            ),
            (
                serde_json::json!({"sub": "ada", "tenant": 7, "exp": exp}),
                Refusal::InvalidClaim(claim("tenant")),
            ),
        ] {
            assert_eq!(
                auth.verify(&hs256(claims.clone(), SECRET)).await,
                Err(refusal.into()),
                "{claims}"
            );
        }
        assert_eq!(
            auth.verify("not.a.jwt").await,
            Err(Refusal::Malformed.into())
        );
        assert_eq!(auth.verify_header(None).await, Err(AuthError::Missing));
        assert_eq!(
            auth.verify_header(Some("Bearer ")).await,
            Err(AuthError::Missing)
        );
        assert_eq!(
            auth.verify_header(Some("Basic abc")).await,
            Err(Refusal::NotBearer.into())
        );
    }

    #[tokio::test]
    async fn previous_secrets_verify_and_the_first_signs() {
        let rotated = Authenticator::from_config(
            &AuthConfig::default(),
            vec![SECRET.to_owned(), OTHER.to_owned()],
        )
        .unwrap();
        let old = Authenticator::new(OTHER).unwrap();
        let old_token = old.mint("acme", "ada", Duration::from_secs(60)).unwrap();
        assert!(rotated.verify(&old_token).await.is_ok());
        let new_token = rotated
            .mint("acme", "ada", Duration::from_secs(60))
            .unwrap();
        assert_eq!(
            old.verify(&new_token).await,
            Err(Refusal::BadSignature.into())
        );
        assert!(
            Authenticator::new(SECRET)
                .unwrap()
                .verify(&new_token)
                .await
                .is_ok()
        );
    }

    #[tokio::test]
    async fn the_operator_claim_counts_only_from_the_configured_issuers_and_tenants() {
        let config = AuthConfig {
            operator_claim: Some("ops".into()),
            operator_issuers: vec!["https://staff.example".into()],
            operator_tenants: vec!["ops".into()],
            ..AuthConfig::default()
        };
        let auth = Authenticator::from_config(&config, vec![SECRET.to_owned()]).unwrap();
        let exp = now_millis() / 1000 + 60;
        let token = |iss: Option<&str>, tenant: &str| {
            let mut claims =
                serde_json::json!({"sub": "olga", "tenant": tenant, "exp": exp, "ops": true});
            if let Some(iss) = iss {
                claims["iss"] = iss.into();
            }
            let key = EncodingKey::from_secret(SECRET.as_bytes()).unwrap();
            jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &key).unwrap()
        };
        let operator = |iss, tenant| {
            let token = token(iss, tenant);
            let auth = &auth;
            async move { auth.verify(&token).await.unwrap().operator }
        };
        assert!(operator(Some("https://staff.example"), "ops").await);
        // A tenant's own identity provider, or a tenant's administrator
        // setting the claim, makes no operator.
        assert!(!operator(Some("https://tenant-idp.example"), "ops").await);
        assert!(!operator(None, "ops").await);
        assert!(!operator(Some("https://staff.example"), "acme").await);
        let viewer = auth
            .verify(&token(Some("https://staff.example"), "ops"))
            .await
            .unwrap();
        assert_eq!(viewer.issuer.as_deref(), Some("https://staff.example"));
    }

    #[tokio::test]
    async fn claim_names_issuer_and_audience_come_from_the_configuration() {
        let config = AuthConfig {
            tenant_claim: "org_id".into(),
            principal_claim: "email".into(),
            issuer: Some("https://idp.example".into()),
            audience: Some("tether".into()),
            ..AuthConfig::default()
        };
        let auth = Authenticator::from_config(&config, vec![SECRET.to_owned()]).unwrap();
        let token = auth
            .mint("acme", "ada@acme.test", Duration::from_secs(60))
            .unwrap();
        let viewer = auth.verify(&token).await.unwrap();
        assert_eq!(
            (viewer.tenant.as_str(), viewer.principal.as_str()),
            ("acme", "ada@acme.test")
        );
        let exp = now_millis() / 1000 + 60;
        let base = serde_json::json!({"org_id": "acme", "email": "ada", "exp": exp,
            "iss": "https://idp.example", "aud": "tether"});
        assert!(auth.verify(&hs256(base.clone(), SECRET)).await.is_ok());
        for (field, value, refusal) in [
            (
                "iss",
                serde_json::json!("https://evil.example"),
                Refusal::WrongIssuer,
            ),
            (
                "aud",
                serde_json::json!("someone-else"),
                Refusal::WrongAudience,
            ),
            (
                "aud",
                serde_json::json!(null),
                Refusal::MissingClaim("aud".into()),
            ),
            (
                "org_id",
                serde_json::json!(null),
                Refusal::MissingClaim("org_id".into()),
            ),
        ] {
            let mut claims = base.clone();
            match value {
                serde_json::Value::Null => {
                    claims.as_object_mut().unwrap().remove(field);
                }
                value => claims[field] = value,
            }
            assert_eq!(
                auth.verify(&hs256(claims.clone(), SECRET)).await,
                Err(refusal.into()),
                "{claims}"
            );
        }
    }

    #[test]
    fn short_secrets_and_nothing_to_verify_with_are_refused() {
        assert!(matches!(
            Authenticator::new("short"),
            Err(AuthSetupError::WeakSecret)
        ));
        assert!(matches!(
            Authenticator::from_config(&AuthConfig::default(), Vec::new()),
            Err(AuthSetupError::Nothing)
        ));
        let jwks_only = AuthConfig {
            jwks_url: Some("http://127.0.0.1:9/jwks".into()),
            ..AuthConfig::default()
        };
        let auth = Authenticator::from_config(&jwks_only, Vec::new()).unwrap();
        assert_eq!(
            auth.mint("acme", "ada", Duration::from_secs(60)),
            Err(AuthError::CannotSign)
        );
    }

    #[test]
    fn expiry_arithmetic_saturates() {
        let viewer = |expires_at| Viewer {
            tenant: "t".into(),
            principal: "p".into(),
            expires_at,
            operator: false,
            delegate: false,
            issuer: None,
        };
        assert_eq!(viewer(i64::MAX).expires_in(), MAX_EXPIRY_WAIT);
        assert_eq!(viewer(i64::MIN).expires_in(), Duration::ZERO);
        assert_eq!(viewer(0).expires_in(), Duration::ZERO);
        let soon = viewer(now_millis() / 1000 + 100).expires_in();
        assert!(soon > Duration::from_secs(90) && soon <= Duration::from_secs(100));
        let auth = Authenticator::new(SECRET).unwrap();
        assert!(auth.mint("acme", "ada", Duration::MAX).is_ok());
    }
}
