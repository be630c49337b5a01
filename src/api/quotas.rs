//! What one principal, and one tenant, may hold at once: WebSockets,
//! subscriptions, and queries and mutations in flight. Each is a count per
//! key, taken by a guard and given back when the guard drops, so that one
//! principal cannot take every socket, subscription or request the process
//! serves, and another tenant's are still served.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};

use async_graphql::extensions::{Extension, ExtensionContext, ExtensionFactory, NextExecute};
use async_graphql::{Pos, Response};
use tokio::sync::OwnedSemaphorePermit;

use super::auth::Viewer;
use super::error::ApiError;
use crate::config::ApiConfig;

/// Counts per key, each up to `limit`.
struct Counts<K> {
    held: Mutex<HashMap<K, usize>>,
    limit: usize,
}

/// One held unit of a key's count, given back on drop.
pub struct Held<K: Hash + Eq> {
    counts: Arc<Counts<K>>,
    key: K,
}

impl<K: Hash + Eq> Drop for Held<K> {
    fn drop(&mut self) {
        let mut held = self
            .counts
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = held.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

impl<K: Hash + Eq + Clone> Counts<K> {
    fn new(limit: usize) -> Arc<Counts<K>> {
        Arc::new(Counts {
            held: Mutex::new(HashMap::new()),
            limit,
        })
    }

    /// One more for `key`, unless it holds `limit` already.
    fn take(self: &Arc<Counts<K>>, key: K) -> Option<Held<K>> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let n = held.entry(key.clone()).or_insert(0);
        if *n >= self.limit {
            return None;
        }
        *n += 1;
        Some(Held {
            counts: self.clone(),
            key,
        })
    }

    #[cfg(test)]
    fn holding(&self, key: &K) -> usize {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.get(key).copied().unwrap_or(0)
    }
}

type Principal = (String, String);

/// A principal's and its tenant's share of one kind of thing.
struct Shares {
    principal: Arc<Counts<Principal>>,
    tenant: Arc<Counts<String>>,
    what: &'static str,
}

/// What a principal holds of one share, as long as it is held.
pub struct Share {
    _principal: Held<Principal>,
    _tenant: Held<String>,
}

impl Shares {
    fn new(per_principal: usize, per_tenant: usize, what: &'static str) -> Shares {
        Shares {
            principal: Counts::new(per_principal),
            tenant: Counts::new(per_tenant),
            what,
        }
    }

    fn take(&self, tenant: &str, principal: &str) -> Result<Share, ApiError> {
        let refused = |whose: &str, limit: usize| ApiError::RateLimited {
            message: format!(
                "{whose} holds as many {} as it may (at most {limit}); close one first",
                self.what
            ),
            retry_after_secs: 1,
        };
        let principal = self
            .principal
            .take((tenant.to_owned(), principal.to_owned()))
            .ok_or_else(|| refused("one person", self.principal.limit))?;
        let tenant = self
            .tenant
            .take(tenant.to_owned())
            .ok_or_else(|| refused("one tenant", self.tenant.limit))?;
        Ok(Share {
            _principal: principal,
            _tenant: tenant,
        })
    }
}

/// The shares of the process's sockets, subscriptions and requests.
pub struct Quotas {
    sockets: Shares,
    subscriptions: Shares,
    requests: Shares,
}

/// A subscription's hold: the process's permit (`api.max_subscriptions`)
/// and its principal's and tenant's shares, for as long as it is served.
pub struct SubscriptionPermit {
    _process: OwnedSemaphorePermit,
    _share: Share,
}

impl Quotas {
    pub fn new(api: &ApiConfig) -> Quotas {
        Quotas {
            sockets: Shares::new(
                api.max_sockets_per_principal,
                api.max_sockets_per_tenant,
                "WebSockets",
            ),
            subscriptions: Shares::new(
                api.max_subscriptions_per_principal,
                api.max_subscriptions_per_tenant,
                "subscriptions",
            ),
            requests: Shares::new(
                api.max_requests_per_principal,
                api.max_requests_per_tenant,
                "requests in flight",
            ),
        }
    }

    /// An acknowledged WebSocket of `principal`'s.
    pub fn socket(&self, tenant: &str, principal: &str) -> Result<Share, ApiError> {
        self.sockets.take(tenant, principal)
    }

    /// A subscription of `principal`'s, with the process's `permit`.
    pub fn subscription(
        &self,
        tenant: &str,
        principal: &str,
        permit: OwnedSemaphorePermit,
    ) -> Result<SubscriptionPermit, ApiError> {
        Ok(SubscriptionPermit {
            _share: self.subscriptions.take(tenant, principal)?,
            _process: permit,
        })
    }
}

/// Holds the caller's share of requests in flight while a query or a
/// mutation executes, over HTTP or a WebSocket alike (subscriptions hold
/// theirs for as long as they are served). Past it, the operation is
/// `RATE_LIMITED` and nothing of it runs.
pub struct InFlight(pub Arc<Quotas>);

impl ExtensionFactory for InFlight {
    fn create(&self) -> Arc<dyn Extension> {
        Arc::new(InFlight(self.0.clone()))
    }
}

#[async_trait::async_trait]
impl Extension for InFlight {
    async fn execute(
        &self,
        ctx: &ExtensionContext<'_>,
        operation_name: Option<&str>,
        next: NextExecute<'_>,
    ) -> Response {
        let Some(viewer) = ctx.data_opt::<Viewer>() else {
            return next.run(ctx, operation_name).await;
        };
        match self.0.requests.take(&viewer.tenant, &viewer.principal) {
            Ok(_held) => next.run(ctx, operation_name).await,
            Err(refused) => Response::from_errors(vec![
                async_graphql::Error::from(refused).into_server_error(Pos::default()),
            ]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_given_back_when_its_guard_drops() {
        let counts = Counts::new(2);
        let a = counts.take("k").unwrap();
        let _b = counts.take("k").unwrap();
        assert!(counts.take("k").is_none());
        assert!(counts.take("other").is_some());
        drop(a);
        assert_eq!(counts.holding(&"k"), 1);
        assert!(counts.take("k").is_some());
    }

    #[test]
    fn a_principal_and_a_tenant_each_have_a_share() {
        let shares = Shares::new(2, 3, "things");
        let _a = shares.take("acme", "ada").unwrap();
        let _b = shares.take("acme", "ada").unwrap();
        let Err(ApiError::RateLimited { message, .. }) = shares.take("acme", "ada") else {
            panic!("ada holds her share");
        };
        assert!(message.contains("one person"), "{message}");
        let _c = shares.take("acme", "bob").unwrap();
        let Err(ApiError::RateLimited { message, .. }) = shares.take("acme", "cy") else {
            panic!("acme holds its share");
        };
        assert!(message.contains("one tenant"), "{message}");
        // A refusal by the tenant gives back what the principal took.
        assert_eq!(shares.principal.holding(&("acme".into(), "cy".into())), 0);
        assert!(shares.take("globex", "eve").is_ok());
    }

    /// A query that runs until the test lets it end.
    struct Slow(Arc<tokio::sync::Semaphore>);

    #[async_graphql::Object]
    impl Slow {
        async fn slow(&self) -> bool {
            let _go = self.0.acquire().await;
            true
        }
    }

    fn viewer(tenant: &str, principal: &str) -> Viewer {
        Viewer {
            tenant: tenant.into(),
            principal: principal.into(),
            expires_at: i64::MAX,
            operator: false,
            delegate: false,
            issuer: None,
        }
    }

    #[tokio::test]
    async fn requests_in_flight_are_counted_per_principal_and_tenant_while_they_execute() {
        use async_graphql::{EmptyMutation, EmptySubscription, Request, Schema};
        let quotas = Arc::new(Quotas::new(&ApiConfig {
            max_requests_per_principal: 2,
            max_requests_per_tenant: 3,
            ..ApiConfig::default()
        }));
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let schema = Schema::build(Slow(gate.clone()), EmptyMutation, EmptySubscription)
            .extension(InFlight(quotas.clone()))
            .finish();
        let run = |tenant: &str, principal: &str| {
            let (schema, viewer) = (schema.clone(), viewer(tenant, principal));
            tokio::spawn(async move { schema.execute(Request::new("{ slow }").data(viewer)).await })
        };
        let held = |tenant: &str, principal: &str| {
            quotas
                .requests
                .principal
                .holding(&(tenant.to_owned(), principal.to_owned()))
        };
        let ada = [run("acme", "ada"), run("acme", "ada")];
        while held("acme", "ada") < 2 {
            tokio::task::yield_now().await;
        }
        let refused = |response: Response, whose: &str| {
            let err = &response.errors[0];
            let extensions = err.extensions.as_ref().unwrap();
            assert_eq!(
                extensions.get("code"),
                Some(&async_graphql::Value::from("RATE_LIMITED")),
                "{err:?}"
            );
            assert!(extensions.get("retryAfter").is_some(), "{err:?}");
            assert!(err.message.contains(whose), "{}", err.message);
            assert_eq!(response.data, async_graphql::Value::Null);
        };
        refused(run("acme", "ada").await.unwrap(), "one person");
        // Bob of the same tenant has a share of his own, up to the tenant's.
        let bob = run("acme", "bob");
        while held("acme", "bob") < 1 {
            tokio::task::yield_now().await;
        }
        refused(run("acme", "cy").await.unwrap(), "one tenant");
        // Another tenant's request is let in while acme holds its share.
        let eve = run("globex", "eve");
        while held("globex", "eve") < 1 {
            tokio::task::yield_now().await;
        }
        // Each query lets the next through as it ends.
        gate.add_permits(1);
        let [first, second] = ada;
        for answered in [first, second, bob, eve] {
            let response = answered.await.unwrap();
            assert!(response.errors.is_empty(), "{:?}", response.errors);
        }
        assert_eq!(held("acme", "ada"), 0, "given back when they end");
        let again = run("acme", "ada").await.unwrap();
        assert!(again.errors.is_empty(), "{:?}", again.errors);
    }
}
