//! Connections: a principal's accounts at other services (OAuth 2.0 or a
//! static token), the tokens tools call them with, and the consent that
//! opens one.
//!
//! A tool that declares `connection = { provider, scopes }` gets its token
//! here. What stands in the way is told structurally, as a
//! [`ConnectionGap`]: the engine pauses on it (OAuth 2.0 providers) or
//! fails the call with [`Connections::gap_failure`], never reading message
//! text. Where a pause resumes: [`Connections::complete`].

pub mod crypto;
pub mod oauth;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use serde_json::{Value, json};

use crate::config::{ConnectionConfig, ConnectionMode, FileConfig, ToolConnection};
use crate::domain::interaction::{ConnectionGap, InteractionStatus};
use crate::domain::time::now_millis;
use crate::store::Actor;
use crate::store::connections::{self as stored, Owner, Sealed};
use crate::store::entities::{connection, interaction, run};
use crate::store::interactions::{self, Completion, ConnectionRequest, NewConsent};
use crate::store::{self, Error, Store, reads};
use crypto::Cipher;
use oauth::{OAuthError, Tokens};

/// An access token this close to its expiry counts as expired: it could
/// lapse on its way to the tool.
const EXPIRY_MARGIN_MS: i64 = 10_000;

/// The most of a provider's `error` kept from a declined consent.
const MAX_ERROR_CHARS: usize = 200;

/// What a call gets for its connection.
pub enum Credential {
    /// Sent as `Authorization: Bearer`.
    Bearer(String),
    /// Why there is no usable token.
    Gap(ConnectionGap),
    /// The provider could not be asked (a refresh that found no server);
    /// the call fails with this message.
    Unavailable(String),
}

/// A consent ready to offer: what the person sees, and what the server
/// keeps.
pub struct Offer {
    pub request: ConnectionRequest,
    pub consent: NewConsent,
    pub ttl_ms: i64,
}

/// The configured providers, the key that seals their tokens, and the
/// refreshes and consents under way.
#[derive(Default)]
pub struct Connections {
    providers: HashMap<String, ConnectionConfig>,
    cipher: Option<Cipher>,
    flights: Flights,
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connections")
            .field("providers", &self.providers.keys().collect::<Vec<_>>())
            .field("cipher", &self.cipher)
            .finish_non_exhaustive()
    }
}

fn owner<'a>(tenant: &'a str, principal: &'a str, provider: &'a str) -> Owner<'a> {
    Owner {
        tenant,
        principal,
        provider,
    }
}

fn aad(owner: Owner<'_>) -> Vec<u8> {
    crypto::owner(&[owner.tenant, owner.principal, owner.provider])
}

fn consent_aad(tenant: &str, principal: &str, state: &str) -> Vec<u8> {
    crypto::owner(&["consent", tenant, principal, state])
}

fn covers(granted: &[String], needed: &[String]) -> bool {
    needed.iter().all(|scope| granted.contains(scope))
}

impl Connections {
    /// `key` seals tokens; start-up requires it once a provider is
    /// configured.
    pub fn new(file: &FileConfig, key: Option<&[u8; 32]>) -> Connections {
        Connections {
            providers: file
                .connections
                .iter()
                .map(|c| (c.provider.clone(), c.clone()))
                .collect(),
            cipher: key.map(Cipher::new),
            flights: Flights::default(),
        }
    }

    fn cipher(&self) -> store::Result<&Cipher> {
        self.cipher
            .as_ref()
            .ok_or_else(|| Error::Unavailable("no TETHER_ENCRYPTION_KEY is configured".into()))
    }

    /// The token a call of a tool needing `need` sends for this principal.
    /// An expired OAuth token with a refresh token is refreshed first, once
    /// however many calls need it at the same time.
    pub async fn credential(
        &self,
        store: &Store,
        tenant: &str,
        principal: &str,
        need: &ToolConnection,
    ) -> store::Result<Credential> {
        let Some(config) = self.providers.get(&need.provider) else {
            return Ok(Credential::Unavailable(format!(
                "the connection provider {:?} is not configured",
                need.provider
            )));
        };
        if config.mode == ConnectionMode::Token {
            return Ok(match config.token.as_deref().filter(|t| !t.is_empty()) {
                Some(token) => Credential::Bearer(token.to_owned()),
                None => Credential::Gap(ConnectionGap::Absent),
            });
        }
        let cipher = self.cipher()?;
        let owner = owner(tenant, principal, &need.provider);
        let Some(row) = stored::find(store.db(), owner).await? else {
            return Ok(Credential::Gap(ConnectionGap::Absent));
        };
        if let Some(usable) = self.usable(cipher, &row, owner, need)? {
            return Ok(usable);
        }
        // Expired. One refresh per connection at a time, in this process
        // and across processes: whoever waited finds the refreshed row.
        let _flight = self
            .flights
            .enter(format!("refresh\0{tenant}\0{principal}\0{}", need.provider))
            .await;
        let hold = stored::RefreshHold::take(store, owner).await?;
        let refreshed = self.refresh(store, cipher, config, owner, need).await;
        hold.release().await;
        refreshed
    }

    /// `credential`'s refresh, holding the connection's refresh: the row
    /// read again (another refresh may have come first), then refreshed.
    async fn refresh(
        &self,
        store: &Store,
        cipher: &Cipher,
        config: &ConnectionConfig,
        owner: Owner<'_>,
        need: &ToolConnection,
    ) -> store::Result<Credential> {
        let Some(row) = stored::find(store.db(), owner).await? else {
            return Ok(Credential::Gap(ConnectionGap::Absent));
        };
        if let Some(usable) = self.usable(cipher, &row, owner, need)? {
            return Ok(usable);
        }
        let Some(sealed_refresh) = &row.refresh_token else {
            return Ok(Credential::Gap(ConnectionGap::Expired));
        };
        let Some(refresh_token) = self.open(cipher, &row.key_id, sealed_refresh, owner) else {
            return Ok(Credential::Gap(ConnectionGap::Expired));
        };
        let tokens = match oauth::refresh(config, &refresh_token).await {
            Ok(tokens) => tokens,
            Err(OAuthError::Refused { error, .. }) => {
                tracing::info!(provider = %need.provider, %error, "a refresh token was refused");
                return Ok(Credential::Gap(ConnectionGap::Expired));
            }
            Err(OAuthError::Unavailable(why)) => {
                return Ok(Credential::Unavailable(format!(
                    "the {} token could not be refreshed: {why}",
                    need.provider
                )));
            }
        };
        let granted = stored::scopes_of(&row)?;
        let access_token = tokens.access_token.clone();
        let scopes = tokens.scopes.clone().unwrap_or(granted);
        let enough = covers(&scopes, &need.scopes);
        // A server that does not rotate the refresh token keeps the old one.
        let sealed = self.seal(cipher, owner, tokens, scopes, Some(refresh_token));
        if !stored::save_refreshed(store, &row, sealed).await? {
            // Disconnected (or consented again) while the refresh was out:
            // what is stored now decides, never the tokens just refreshed.
            tracing::info!(provider = %need.provider, "the connection changed during its refresh; the refreshed tokens are dropped");
            return Ok(match stored::find(store.db(), owner).await? {
                None => Credential::Gap(ConnectionGap::Absent),
                Some(now) => self
                    .usable(cipher, &now, owner, need)?
                    .unwrap_or(Credential::Gap(ConnectionGap::Expired)),
            });
        }
        Ok(if enough {
            Credential::Bearer(access_token)
        } else {
            Credential::Gap(ConnectionGap::InsufficientScope)
        })
    }

    /// The row's access token, or its gap; `None` when it has expired.
    fn usable(
        &self,
        cipher: &Cipher,
        row: &connection::Model,
        owner: Owner<'_>,
        need: &ToolConnection,
    ) -> store::Result<Option<Credential>> {
        if !covers(&stored::scopes_of(row)?, &need.scopes) {
            return Ok(Some(Credential::Gap(ConnectionGap::InsufficientScope)));
        }
        if row
            .expires_at
            .is_some_and(|at| at <= now_millis() + EXPIRY_MARGIN_MS)
        {
            return Ok(None);
        }
        Ok(Some(
            match self.open(cipher, &row.key_id, &row.access_token, owner) {
                Some(token) => Credential::Bearer(token),
                None => Credential::Gap(ConnectionGap::Absent),
            },
        ))
    }

    /// Opens a sealed token of `owner`; a value that does not open (another
    /// key, another row) counts as no token, and a new consent replaces it.
    fn open(
        &self,
        cipher: &Cipher,
        key_id: &str,
        sealed: &str,
        owner: Owner<'_>,
    ) -> Option<String> {
        match cipher.open(key_id, sealed, &aad(owner)) {
            Ok(token) => Some(token),
            Err(err) => {
                tracing::warn!(provider = %owner.provider, error = %err, "a stored connection token does not open");
                None
            }
        }
    }

    fn seal(
        &self,
        cipher: &Cipher,
        owner: Owner<'_>,
        tokens: Tokens,
        scopes: Vec<String>,
        previous_refresh: Option<String>,
    ) -> Sealed {
        let aad = aad(owner);
        let refresh = tokens.refresh_token.or(previous_refresh);
        Sealed {
            scopes,
            access_token: cipher.seal(&tokens.access_token, &aad),
            refresh_token: refresh.map(|r| cipher.seal(&r, &aad)),
            key_id: cipher.key_id().to_owned(),
            expires_at: tokens.expires_at,
        }
    }

    /// A consent offer for this gap, when one can be made: only OAuth 2.0
    /// providers offer one.
    pub fn offer(
        &self,
        tenant: &str,
        principal: &str,
        need: &ToolConnection,
        gap: ConnectionGap,
    ) -> Option<Offer> {
        let config = self.providers.get(&need.provider)?;
        if config.mode != ConnectionMode::Oauth2 {
            return None;
        }
        let cipher = self.cipher.as_ref()?;
        let begun = oauth::begin(config, &need.scopes);
        let verifier = cipher.seal(
            &begun.verifier,
            &consent_aad(tenant, principal, &begun.state),
        );
        Some(Offer {
            request: ConnectionRequest {
                provider: need.provider.clone(),
                gap,
                required_scopes: need.scopes.clone(),
                login_url: begun.login_url,
                principal: principal.to_owned(),
            },
            consent: NewConsent {
                state: begun.state,
                principal: principal.to_owned(),
                verifier,
                key_id: cipher.key_id().to_owned(),
            },
            ttl_ms: i64::try_from(config.consent_ttl_secs.saturating_mul(1000)).unwrap_or(i64::MAX),
        })
    }

    /// The failed result of a call whose gap cannot be paused on: it names
    /// the credential and the gap, one sentence for each gap.
    pub fn gap_failure(&self, tool: &str, need: &ToolConnection, gap: ConnectionGap) -> Value {
        let provider = &need.provider;
        let reference = match self.providers.get(provider) {
            Some(ConnectionConfig {
                mode: ConnectionMode::Token,
                token_env: Some(var),
                ..
            }) => format!("token_env = {var}"),
            _ => format!("the {provider} connection of this user"),
        };
        let sentence = match gap {
            ConnectionGap::Absent => {
                format!("{tool} needs a {provider} credential ({reference}), and none is available")
            }
            ConnectionGap::Expired => format!(
                "{tool} needs a {provider} credential ({reference}), and it has expired and cannot be renewed"
            ),
            ConnectionGap::InsufficientScope => format!(
                "{tool} needs a {provider} credential ({reference}) with the scopes {}, and it lacks some of them",
                need.scopes.join(" ")
            ),
        };
        json!({
            "error": format!("{sentence}; the tool did not run"),
            "connection": { "provider": provider, "gap": gap.as_str() },
        })
    }

    /// `completeConnection`: the person's browser came back with `state`
    /// and either a `code` (consent given) or an `error` (declined). The
    /// code is exchanged with the PKCE verifier, the connection stored, and
    /// the run re-queued, once; later calls answer `false`. A state that is
    /// unknown, expired, or another tenant's or principal's is `NOT_FOUND`,
    /// word for word the same.
    pub async fn complete(
        &self,
        store: &Store,
        actor: &Actor,
        state: &str,
        code: Option<&str>,
        error: Option<&str>,
    ) -> store::Result<(run::Model, bool)> {
        let given = match (
            code.filter(|c| !c.is_empty()),
            error.filter(|e| !e.is_empty()),
        ) {
            (Some(code), None) => Ok(code),
            (None, Some(error)) => Err(error),
            _ => {
                return Err(Error::Invalid {
                    key: None,
                    message: "give exactly one of code and error".into(),
                });
            }
        };
        // One completion of a state at a time, so a double click or a
        // prefetch exchanges the code once.
        let _flight = self.flights.enter(format!("consent\0{state}")).await;
        let Some((consent, row)) = interactions::consent_of(store, actor, state).await? else {
            return Err(Error::NotFound);
        };
        match interactions::status_of(&row)? {
            InteractionStatus::Pending if row.expires_at <= now_millis() => {
                interactions::expire_one(store, &row).await?;
                return Err(Error::NotFound);
            }
            InteractionStatus::Pending => {}
            InteractionStatus::Resolved => return Ok((run_of(store, actor, &row).await?, false)),
            InteractionStatus::Expired | InteractionStatus::Cancelled => {
                return Err(Error::NotFound);
            }
        }
        let code = match given {
            Ok(code) => code,
            Err(error) => {
                let error: String = error.chars().take(MAX_ERROR_CHARS).collect();
                let declined = Completion::Declined(crate::redact::message(&error));
                return interactions::complete(store, actor, row.id, declined).await;
            }
        };
        let config = self.providers.get(&consent.provider).ok_or_else(|| {
            Error::Unavailable(format!(
                "the provider {:?} is not configured",
                consent.provider
            ))
        })?;
        let cipher = self.cipher()?;
        let verifier = cipher
            .open(
                &consent.key_id,
                &consent.verifier,
                &consent_aad(&actor.tenant, &actor.principal, state),
            )
            .map_err(|e| Error::Corrupt(e.to_string()))?;
        let tokens = match oauth::exchange(config, code, &verifier).await {
            Ok(tokens) => tokens,
            // Only `invalid_grant` is about the code; other refusals are
            // about the configuration (the client, the grant type).
            Err(OAuthError::Refused { error, .. }) if error == "invalid_grant" => {
                // Another instance may have spent the code on this very
                // consent a moment ago: then this is a replay.
                if let Some((_, now)) = interactions::consent_of(store, actor, state).await?
                    && interactions::status_of(&now)? == InteractionStatus::Resolved
                {
                    return Ok((run_of(store, actor, &now).await?, false));
                }
                return Err(Error::Invalid {
                    key: Some("code".into()),
                    message: format!(
                        "the authorization server refused the code ({error}); the consent is still open, start it again from its login URL"
                    ),
                });
            }
            Err(OAuthError::Refused { error, .. }) => {
                tracing::warn!(provider = %consent.provider, %error, "the token endpoint refused the client");
                return Err(Error::Unavailable(format!(
                    "the authorization server refused the exchange ({error}); check the {} connection's configuration",
                    consent.provider
                )));
            }
            Err(OAuthError::Unavailable(why)) => {
                return Err(Error::Unavailable(format!(
                    "the authorization server could not be reached: {why}"
                )));
            }
        };
        let request = interactions::connection_of(&row)?;
        let scopes = tokens.scopes.clone().unwrap_or_else(|| {
            let mut asked = request.required_scopes.clone();
            for scope in &config.scopes {
                if !asked.contains(scope) {
                    asked.push(scope.clone());
                }
            }
            asked
        });
        let owner = owner(&actor.tenant, &actor.principal, &consent.provider);
        let sealed = self.seal(cipher, owner, tokens, scopes, None);
        interactions::complete(store, actor, row.id, Completion::Granted(sealed)).await
    }
}

/// The run a consent of `actor` belongs to.
async fn run_of(
    store: &Store,
    actor: &Actor,
    row: &interaction::Model,
) -> store::Result<run::Model> {
    reads::run(store.db(), &actor.tenant, row.run_id)
        .await?
        .ok_or(Error::NotFound)
}

/// Keyed single flight: who enters a key waits for whoever holds it.
#[derive(Default)]
struct Flights(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

struct Flight<'a> {
    flights: &'a Flights,
    key: String,
    lock: Arc<tokio::sync::Mutex<()>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Flights {
    async fn enter(&self, key: String) -> Flight<'_> {
        let lock = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key.clone())
            .or_default()
            .clone();
        let guard = lock.clone().lock_owned().await;
        Flight {
            flights: self,
            key,
            lock,
            guard: Some(guard),
        }
    }
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        self.guard.take();
        let mut map = self
            .flights
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Only the map and this flight hold it: nobody waits, so it goes.
        if Arc::strong_count(&self.lock) == 2 {
            map.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_flight_lets_one_holder_in_at_a_time_and_leaves_nothing_behind() {
        let flights = Arc::new(Flights::default());
        let first = flights.enter("k".into()).await;
        let waiting = {
            let flights = flights.clone();
            tokio::spawn(async move {
                let _second = flights.enter("k".into()).await;
            })
        };
        // Another key is not held up.
        drop(flights.enter("other".into()).await);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(first);
        waiting.await.unwrap();
        assert!(flights.0.lock().unwrap().is_empty());
    }

    #[test]
    fn each_gap_has_its_own_sentence_naming_the_credential() {
        let file: FileConfig = toml::from_str(
            "[[agents]]\nname = \"a\"\nprovider = \"scripted\"\n[[connections]]\nprovider = \"acme\"\nmode = \"token\"\ntoken_env = \"ACME_API_TOKEN\"\n",
        )
        .unwrap();
        let connections = Connections::new(&file, None);
        let need = ToolConnection {
            provider: "acme".into(),
            scopes: vec!["read".into()],
        };
        let sentences: Vec<String> = ConnectionGap::ALL
            .iter()
            .map(|gap| {
                connections.gap_failure("lookup", &need, *gap)["error"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        for sentence in &sentences {
            assert!(
                sentence.contains("token_env = ACME_API_TOKEN"),
                "{sentence}"
            );
        }
        assert_ne!(sentences[0], sentences[1]);
        assert_ne!(sentences[1], sentences[2]);
        assert_ne!(sentences[0], sentences[2]);
        assert!(
            connections
                .offer("t", "p", &need, ConnectionGap::Absent)
                .is_none()
        );
    }
}
