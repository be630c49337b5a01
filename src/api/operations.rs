//! What operators' tools read over HTTP: Prometheus's `/metrics` and the
//! readiness probe.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sea_orm::DatabaseBackend;
use subtle::ConstantTimeEq;

use super::context::Services;
use super::listener::LocalAddr;
use crate::store::operations;
use crate::telemetry::{self, Listener, Scrape};

/// Headers a proxy adds to say whom it forwards for. A request with any of
/// them came through a proxy, whatever address it arrived from.
const PROXY_HEADERS: [&str; 8] = [
    "forwarded",
    "via",
    "x-real-ip",
    "true-client-ip",
    "cf-connecting-ip",
    "fastly-client-ip",
    "x-client-ip",
    "x-cluster-client-ip",
];

/// `GET /metrics`: every family in Prometheus's text format. With
/// `metrics.bearer_token_env`, for that token only; without it, only on a
/// loopback listener, for loopback callers that no proxy forwards.
pub async fn metrics(State(services): State<Services>, request: Request) -> Response {
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(addr)| *addr);
    let local = request
        .extensions()
        .get::<LocalAddr>()
        .map(|LocalAddr(addr)| *addr);
    if let Some(refusal) = refusal(&services, peer, local, request.headers()) {
        return refusal;
    }
    let Some(handle) = telemetry::install() else {
        return (
            StatusCode::NOT_FOUND,
            "another metrics recorder is installed in this process",
        )
            .into_response();
    };
    let workload = match operations::workload(&services.store).await {
        Ok(workload) => workload,
        Err(err) => {
            tracing::warn!(error = %err, "reading the workload for /metrics failed");
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "the database cannot be read",
            )
                .into_response();
        }
    };
    let store = &services.store;
    let scrape = Scrape {
        runs: workload.runs,
        queue_depth: workload.queue_depth,
        queue_oldest_age: workload.oldest_ready,
        interactions_pending: workload
            .pending
            .into_iter()
            .map(|(kind, n)| (kind.as_str(), n))
            .collect(),
        subscriptions: services
            .config
            .api
            .max_subscriptions
            .saturating_sub(services.subscriptions.available_permits()),
        pools: store.pool_usage(),
        listener: (store.backend() == DatabaseBackend::Postgres).then(|| Listener {
            up: store.bus().listening(),
            reconnects: store.bus().listener_reconnects(),
        }),
    };
    let body = telemetry::render(handle, &scrape);
    let mut response = body.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

/// Why the caller may not read `/metrics`, if it may not.
fn refusal(
    services: &Services,
    peer: Option<SocketAddr>,
    local: Option<SocketAddr>,
    headers: &HeaderMap,
) -> Option<Response> {
    let config = &services.config.metrics;
    if let Some(token) = &config.bearer_token {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        return match given {
            Some(given) if bool::from(given.as_bytes().ct_eq(token.as_bytes())) => None,
            _ => {
                let mut refusal =
                    (StatusCode::UNAUTHORIZED, "a bearer token is required").into_response();
                refusal
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                Some(refusal)
            }
        };
    }
    // A listener others can reach needs the token, whoever calls; and a
    // proxy on this host makes every caller look local, so a forwarded
    // request is not a loopback caller's.
    let loopback = |addr: Option<SocketAddr>| addr.is_some_and(|addr| addr.ip().is_loopback());
    if loopback(local) && loopback(peer) && !forwarded(headers) {
        None
    } else {
        Some(
            (
                StatusCode::FORBIDDEN,
                "/metrics answers loopback callers on a loopback listener only; set \
                 metrics.bearer_token_env to scrape from elsewhere",
            )
                .into_response(),
        )
    }
}

/// Whether a proxy forwarded the request (any header a proxy adds to name
/// the client: `Forwarded`, `Via`, `X-Forwarded-*`, `X-Real-IP` and kin).
fn forwarded(headers: &HeaderMap) -> bool {
    headers.keys().any(|name| {
        let name = name.as_str();
        name.starts_with("x-forwarded-") || PROXY_HEADERS.contains(&name)
    })
}

/// `GET /readyz`: ready while the database answers, the PostgreSQL
/// listener listens, and the process is not draining.
pub async fn readyz(State(services): State<Services>) -> Response {
    let unready = |why: &'static str| (StatusCode::SERVICE_UNAVAILABLE, why).into_response();
    if services.draining.load(Ordering::Relaxed) {
        return unready("draining");
    }
    let store = &services.store;
    if let Err(err) = store.ping().await {
        tracing::warn!(error = %err, "readiness check failed");
        return unready("database unreachable");
    }
    if store.backend() == DatabaseBackend::Postgres && !store.bus().listening() {
        return unready("not listening for notifications");
    }
    "ready".into_response()
}
