//! What one principal, and one tenant, may hold at once: WebSockets,
//! subscriptions, and queries and mutations in flight. Each is a count per
//! key, taken by a guard and given back when the guard drops, so that one
//! principal cannot take every socket, subscription or request the process
//! serves, and another tenant's are still served.

use std::sync::{Arc, Mutex, PoisonError};

use async_graphql::extensions::{
    Extension, ExtensionContext, ExtensionFactory, NextParseQuery, NextPrepareRequest,
};
use async_graphql::parser::types::{ExecutableDocument, OperationType};
use async_graphql::{Request, ServerError, ServerResult, Variables};
use tokio::sync::OwnedSemaphorePermit;

use super::admission::operation_of;
use super::auth::Viewer;
use super::counts::{Counts, Held};
use super::error::ApiError;
use crate::config::ApiConfig;

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
            .ok_or_else(|| refused("one person", self.principal.limit()))?;
        let tenant = self
            .tenant
            .take(tenant.to_owned())
            .ok_or_else(|| refused("one tenant", self.tenant.limit()))?;
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
                "streams (WebSockets and event streams)",
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

    /// An acknowledged WebSocket, or an SSE stream, of `principal`'s.
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

/// Holds the caller's share of requests in flight from before its document
/// is admitted (the schema's first extension) until its answer, for queries
/// and mutations over HTTP or a WebSocket alike; a subscription gives it
/// back once its document shows it is one (it holds a share of
/// subscriptions for as long as it is served). Past the share, the request
/// is `RATE_LIMITED` and nothing of it is parsed or runs.
pub struct InFlight(pub Arc<Quotas>);

impl ExtensionFactory for InFlight {
    fn create(&self) -> Arc<dyn Extension> {
        Arc::new(RequestInFlight {
            quotas: self.0.clone(),
            held: Mutex::new(None),
        })
    }
}

/// One request's hold, given back when the request's extensions drop.
struct RequestInFlight {
    quotas: Arc<Quotas>,
    /// The share, and the name of the operation the request runs.
    held: Mutex<Option<(Share, Option<String>)>>,
}

#[async_trait::async_trait]
impl Extension for RequestInFlight {
    async fn prepare_request(
        &self,
        ctx: &ExtensionContext<'_>,
        request: Request,
        next: NextPrepareRequest<'_>,
    ) -> ServerResult<Request> {
        if let Some(viewer) = Viewer::of_request(&request, ctx) {
            let share = self
                .quotas
                .requests
                .take(&viewer.tenant, &viewer.principal)
                .map_err(refusal)?;
            *self.held.lock().unwrap_or_else(PoisonError::into_inner) =
                Some((share, request.operation_name.clone()));
        }
        next.run(ctx, request).await
    }

    async fn parse_query(
        &self,
        ctx: &ExtensionContext<'_>,
        query: &str,
        variables: &Variables,
        next: NextParseQuery<'_>,
    ) -> ServerResult<ExecutableDocument> {
        let document = next.run(ctx, query, variables).await?;
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let subscription = held.as_ref().is_some_and(|(_, name)| {
            operation_of(&document, name.as_deref()) == Some(OperationType::Subscription)
        });
        if subscription {
            held.take();
        }
        Ok(document)
    }
}

/// A refusal as a request-level error: no location, the code and
/// `retryAfter` in its extensions.
fn refusal(refused: ApiError) -> ServerError {
    let err = async_graphql::Error::from(refused);
    let mut refusal = ServerError::new(err.message, None);
    refusal.extensions = err.extensions;
    refusal
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Waits until `principal` holds `n` requests in flight.
    async fn until_holding(quotas: &Quotas, tenant: &str, principal: &str, n: usize) {
        let key = (tenant.to_owned(), principal.to_owned());
        let holding = async {
            while quotas.requests.principal.holding(&key) < n {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), holding)
            .await
            .expect("the requests are let in");
    }

    /// A subscription that sends nothing until it is dropped; the flag is
    /// set once it is served.
    struct Quiet(Arc<std::sync::atomic::AtomicBool>);

    #[async_graphql::Subscription]
    impl Quiet {
        async fn quiet(&self) -> impl futures_util::Stream<Item = bool> {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            futures_util::stream::pending()
        }
    }

    #[tokio::test]
    async fn a_subscription_gives_its_request_share_back_once_its_document_is_read() {
        use async_graphql::{Data, EmptyMutation, Request, Schema};
        use futures_util::{FutureExt, StreamExt};
        let quotas = Arc::new(Quotas::new(&ApiConfig {
            max_requests_per_principal: 1,
            ..ApiConfig::default()
        }));
        let gate = Arc::new(tokio::sync::Semaphore::new(1));
        let served = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let schema = Schema::build(Slow(gate), EmptyMutation, Quiet(served.clone()))
            .extension(InFlight(quotas.clone()))
            .finish();
        let mut session = Data::default();
        session.insert(viewer("acme", "ada"));
        let mut quiet = schema.execute_stream_with_session_data(
            Request::new("subscription { quiet }"),
            Arc::new(session),
        );
        assert!(quiet.next().now_or_never().is_none(), "quiet");
        assert!(served.load(std::sync::atomic::Ordering::Relaxed), "served");
        let query = schema
            .execute(Request::new("{ slow }").data(viewer("acme", "ada")))
            .await;
        assert!(query.errors.is_empty(), "{:?}", query.errors);
    }

    fn viewer(tenant: &str, principal: &str) -> Viewer {
        Viewer::of(tenant, principal)
    }

    #[tokio::test]
    async fn requests_in_flight_are_counted_per_principal_and_tenant_while_they_execute() {
        use async_graphql::{EmptyMutation, EmptySubscription, Request, Response, Schema};
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
        let ada = [run("acme", "ada"), run("acme", "ada")];
        until_holding(&quotas, "acme", "ada", 2).await;
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
            assert!(err.locations.is_empty(), "{err:?}");
            assert_eq!(response.data, async_graphql::Value::Null);
        };
        refused(run("acme", "ada").await.unwrap(), "one person");
        // Refused before its document is read: a malformed one alike.
        let malformed = schema
            .execute(Request::new("{ slow").data(viewer("acme", "ada")))
            .await;
        refused(malformed, "one person");
        // Bob of the same tenant has a share of his own, up to the tenant's.
        let bob = run("acme", "bob");
        until_holding(&quotas, "acme", "bob", 1).await;
        refused(run("acme", "cy").await.unwrap(), "one tenant");
        // Another tenant's request is let in while acme holds its share.
        let eve = run("globex", "eve");
        until_holding(&quotas, "globex", "eve", 1).await;
        // Each query lets the next through as it ends.
        gate.add_permits(1);
        let [first, second] = ada;
        for answered in [first, second, bob, eve] {
            let response = answered.await.unwrap();
            assert!(response.errors.is_empty(), "{:?}", response.errors);
        }
        let ada_key = ("acme".to_owned(), "ada".to_owned());
        assert_eq!(
            quotas.requests.principal.holding(&ada_key),
            0,
            "given back when they end"
        );
        let again = run("acme", "ada").await.unwrap();
        assert!(again.errors.is_empty(), "{:?}", again.errors);
    }
}
