//! An identity provider's JSON Web Key Set, fetched on first use, used for
//! `jwks_refresh_secs`, and fetched again early when a token names a `kid`
//! it does not hold (the provider rotated its keys). Fetches are serialized
//! and at least `jwks_min_refetch_secs` apart, so a flood of made-up `kid`s
//! costs the provider one request per interval.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};
use tokio::time::Instant;

/// A key set larger than this is not a key set.
const MAX_BODY_BYTES: usize = 256 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum JwksError {
    #[error("cannot build the JWKS client: {0}")]
    Client(String),
    #[error("cannot fetch the JWKS: {0}")]
    Fetch(String),
    #[error("the JWKS answered HTTP {0}")]
    Status(u16),
    #[error("the JWKS is larger than {MAX_BODY_BYTES} bytes")]
    TooLarge,
    #[error("the JWKS is not a JSON Web Key Set: {0}")]
    Malformed(String),
}

pub struct JwksSettings {
    pub url: String,
    pub refresh: Duration,
    pub min_refetch: Duration,
    pub timeout: Duration,
}

#[derive(Clone)]
pub struct VerifyingKey {
    pub decoding: DecodingKey,
    /// The algorithm the key set pins this key to, if it does.
    pub algorithm: Option<Algorithm>,
}

#[derive(Default)]
struct KeySet {
    by_kid: HashMap<String, VerifyingKey>,
    /// Keys without a `kid`: usable only when the set holds one key.
    unnamed: Vec<VerifyingKey>,
    fetched_at: Option<Instant>,
}

impl KeySet {
    fn find(&self, kid: Option<&str>) -> Option<VerifyingKey> {
        match kid {
            Some(kid) => self.by_kid.get(kid).cloned(),
            None if self.by_kid.len() + self.unnamed.len() == 1 => self
                .by_kid
                .values()
                .chain(self.unnamed.iter())
                .next()
                .cloned(),
            None => None,
        }
    }
}

pub struct Jwks {
    settings: JwksSettings,
    client: reqwest::Client,
    keys: RwLock<Arc<KeySet>>,
    /// Held while fetching; holds when the last fetch started.
    last_fetch: tokio::sync::Mutex<Option<Instant>>,
}

impl Jwks {
    pub fn new(settings: JwksSettings) -> Result<Jwks, JwksError> {
        crate::providers::http::install_tls();
        // The key set decides who may sign in: a redirect could hand that
        // decision to another host.
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(settings.timeout)
            .build()
            .map_err(|e| JwksError::Client(e.without_url().to_string()))?;
        Ok(Jwks {
            settings,
            client,
            keys: RwLock::default(),
            last_fetch: tokio::sync::Mutex::new(None),
        })
    }

    fn current(&self) -> Arc<KeySet> {
        self.keys
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The key for a token's `kid`. A stale set, or a `kid` the set does not
    /// hold, leads to a fetch if the last one is long enough ago; a set that
    /// cannot be fetched again stays in use.
    pub async fn key(&self, kid: Option<&str>) -> Option<VerifyingKey> {
        let keys = self.current();
        let fresh = keys
            .fetched_at
            .is_some_and(|at| at.elapsed() < self.settings.refresh);
        match keys.find(kid) {
            Some(key) if fresh => return Some(key),
            // A stale key serves while another request fetches: nobody
            // with a known key waits on the provider.
            Some(key) => match self.last_fetch.try_lock() {
                Ok(last) => self.refetch(last).await,
                Err(_) => return Some(key),
            },
            None => self.refetch(self.last_fetch.lock().await).await,
        }
        self.current().find(kid)
    }

    async fn refetch(&self, mut last: tokio::sync::MutexGuard<'_, Option<Instant>>) {
        if last.is_some_and(|at| at.elapsed() < self.settings.min_refetch) {
            return;
        }
        *last = Some(Instant::now());
        match self.fetch().await {
            Ok(keys) => {
                tracing::debug!(
                    keys = keys.by_kid.len() + keys.unnamed.len(),
                    "fetched the JWKS"
                );
                *self.keys.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(keys);
            }
            Err(err) => tracing::warn!(error = %err, "JWKS fetch failed; keeping the keys held"),
        }
    }

    async fn fetch(&self) -> Result<KeySet, JwksError> {
        let mut response = self
            .client
            .get(&self.settings.url)
            .header(reqwest::header::ACCEPT, "application/json")
            .send()
            .await
            .map_err(|e| JwksError::Fetch(e.without_url().to_string()))?;
        if !response.status().is_success() {
            return Err(JwksError::Status(response.status().as_u16()));
        }
        let mut body = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| JwksError::Fetch(e.without_url().to_string()))?
        {
            if body.len() + chunk.len() > MAX_BODY_BYTES {
                return Err(JwksError::TooLarge);
            }
            body.extend_from_slice(&chunk);
        }
        let set: JwkSet =
            serde_json::from_slice(&body).map_err(|e| JwksError::Malformed(e.to_string()))?;
        Ok(key_set(set))
    }
}

/// The usable signing keys of a set. Symmetric keys are never taken from
/// it: an `oct` key would let anyone who can read the set sign tokens.
fn key_set(set: JwkSet) -> KeySet {
    let mut keys = KeySet {
        fetched_at: Some(Instant::now()),
        ..KeySet::default()
    };
    for jwk in set.keys {
        if matches!(jwk.algorithm, AlgorithmParameters::OctetKey(_))
            || matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption))
        {
            continue;
        }
        let algorithm = match jwk.common.key_algorithm.map(Algorithm::try_from) {
            None => None,
            Some(Ok(algorithm)) => Some(algorithm),
            // An encryption algorithm, or one this server cannot verify.
            Some(Err(_)) => continue,
        };
        let Ok(decoding) = DecodingKey::from_jwk(&jwk) else {
            tracing::debug!(kid = ?jwk.common.key_id, "skipping a JWK that is not a usable key");
            continue;
        };
        let key = VerifyingKey {
            decoding,
            algorithm,
        };
        match jwk.common.key_id {
            Some(kid) => {
                keys.by_kid.insert(kid, key);
            }
            None => keys.unnamed.push(key),
        }
    }
    keys
}
