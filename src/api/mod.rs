//! The GraphQL API: schema, authentication, HTTP and WebSocket transports.

pub mod admission;
mod ai_chat;
pub mod auth;
pub mod context;
pub mod cost;
mod counts;
pub mod error;
pub mod events;
mod fanout;
pub mod feed;
mod graphql_sse;
mod http;
mod introspection;
pub mod listener;
mod literals;
pub mod mutation;
mod operations;
mod operators;
mod playground;
pub mod query;
mod quotas;
pub mod rates;
mod sse;
pub mod subscription;
pub mod types;
mod ws;

use std::sync::Arc;

use async_graphql::{MergedObject, SDLExportOptions, Schema};
use axum::Router;
use axum::http::{HeaderValue, Method, header};
use axum::routing::{any, get, post};
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::config::{ApiConfig, MetricsConfig};
use admission::DocumentAdmission;
use auth::Authenticator;
use context::{Services, Snapshots};
use cost::QueryCost;
use error::ErrorCodes;
use literals::EnumLiterals;
use mutation::Mutation;
use operators::{OperatorMutation, OperatorQuery};
use query::Query;
use subscription::Subscription;

/// The query root: the tenants' fields and the operators'.
#[derive(MergedObject)]
#[graphql(name = "Query")]
pub struct QueryRoot(Query, OperatorQuery);

/// The mutation root: the tenants' fields and the operators'.
#[derive(MergedObject)]
#[graphql(name = "Mutation")]
pub struct MutationRoot(Mutation, OperatorMutation);

fn roots() -> (QueryRoot, MutationRoot, Subscription) {
    (
        QueryRoot(Query, OperatorQuery),
        MutationRoot(Mutation, OperatorMutation),
        Subscription,
    )
}

pub type TetherSchema = Schema<QueryRoot, MutationRoot, Subscription>;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub schema: TetherSchema,
    pub services: Services,
    pub auth: Arc<Authenticator>,
    pub limits: Arc<ApiConfig>,
    pub fanout: Arc<fanout::Fanout>,
    /// Where the transports admit a document before they execute it.
    pub admission: Arc<DocumentAdmission>,
    /// What every WebSocket's loop uses, in one place for all of them.
    ws: Arc<ws::Shared>,
    /// The streams reserved over `graphql-sse` in this process.
    graphql_sse: Arc<graphql_sse::Reservations>,
}

pub fn schema(services: Services) -> TetherSchema {
    let admission = DocumentAdmission::new(&services.config.api);
    admitting_schema(services, &admission)
}

/// The schema, its documents admitted by `admission` (which the transports
/// also use where they look at a document before executing it).
fn admitting_schema(services: Services, admission: &Arc<DocumentAdmission>) -> TetherSchema {
    let limits = &services.config.api;
    let (query, mutation, subscription) = roots();
    // The caller's share of requests in flight is taken before anything
    // else (it reads no document), then the document is admitted: nothing
    // else of the schema sees a document before.
    let builder = Schema::build(query, mutation, subscription)
        .extension(quotas::InFlight(services.quotas.clone()))
        .extension(admission.extension());
    // Without the playground, the schema is not handed out either, and a
    // request that asks for it is told so.
    let builder = if limits.playground {
        builder
    } else {
        builder
            .disable_introspection()
            .extension(introspection::RefuseIntrospection)
    };
    builder
        .limit_depth(limits.max_query_depth)
        .limit_complexity(limits.max_query_complexity)
        // The nesting admission already measured; async-graphql's own check
        // then never refuses what admission let through.
        .limit_recursive_depth(limits.max_document_nesting)
        .extension(ErrorCodes)
        .extension(EnumLiterals)
        .extension(Snapshots(
            services.store.clone(),
            limits.max_full_output_bytes_per_response,
        ))
        .extension(QueryCost {
            timeout: limits.request_timeout(),
        })
        .data(services.clone())
        .finish()
}

/// The schema in SDL, sorted, as committed in `schema.graphql`.
pub fn sdl() -> String {
    let (query, mutation, subscription) = roots();
    Schema::build(query, mutation, subscription)
        .finish()
        .sdl_with_options(
            SDLExportOptions::new()
                .sorted_fields()
                .sorted_arguments()
                .sorted_enum_items(),
        )
}

/// Only the probes (and `/metrics`, unless it has an address of its own),
/// for `--role worker`.
pub fn health_router(services: Services) -> Router {
    let router = Router::new()
        .route("/healthz", get(http::healthz))
        .route("/readyz", get(operations::readyz));
    with_metrics(router, &services.config.metrics).with_state(services)
}

/// `/metrics` alone, for `metrics.listen`.
pub fn metrics_router(services: Services) -> Router {
    Router::new()
        .route("/metrics", get(operations::metrics))
        .with_state(services)
}

/// Adds `/metrics` to the main listener's routes, where it is served.
fn with_metrics<S>(router: Router<S>, config: &MetricsConfig) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
    Services: axum::extract::FromRef<S>,
{
    if config.enabled && config.listen.is_none() {
        router.route("/metrics", get(operations::metrics))
    } else {
        router
    }
}

pub fn router(services: Services, auth: Authenticator) -> Router {
    routes(AppState::new(services, auth))
}

impl AppState {
    pub fn new(services: Services, auth: Authenticator) -> AppState {
        let admission = DocumentAdmission::new(&services.config.api);
        let schema = admitting_schema(services.clone(), &admission);
        let limits = Arc::new(services.config.api.clone());
        let auth = Arc::new(auth);
        let fanout: Arc<fanout::Fanout> = Arc::default();
        let ws = Arc::new(ws::Shared {
            schema: schema.clone(),
            store: services.store.clone(),
            auth: auth.clone(),
            limits: limits.clone(),
            fanout: fanout.clone(),
            admission: admission.clone(),
            quotas: services.quotas.clone(),
            sockets: Arc::new(tokio::sync::Semaphore::new(
                services.config.api.websockets(),
            )),
        });
        AppState {
            schema,
            limits,
            services,
            auth,
            fanout,
            admission,
            ws,
            graphql_sse: Arc::default(),
        }
    }
}

impl axum::extract::FromRef<AppState> for Services {
    fn from_ref(state: &AppState) -> Services {
        state.services.clone()
    }
}

fn routes(state: AppState) -> Router {
    let cors = cors(&state.services.config.api);
    let mut router = Router::new()
        .route("/graphql", get(http::graphql_get).post(http::graphql_post))
        .route("/graphql/stream", any(graphql_sse::graphql_stream))
        .route("/ai/chat", post(ai_chat::chat))
        .route("/ai/chat/{id}/stream", get(ai_chat::resume))
        .route("/conversations/{id}/events", get(sse::conversation_events))
        .route("/runs/{id}/events", get(sse::run_events))
        .route("/healthz", get(http::healthz))
        .route("/readyz", get(operations::readyz));
    if state.services.config.api.playground {
        router = router
            .route("/graphiql", get(playground::page))
            .route("/graphiql/assets/{name}", get(playground::asset));
    }
    let router = with_metrics(router, &state.services.config.metrics).with_state(state);
    // Outermost, so that every answer carries the headers, the 401s and
    // 413s the handlers give themselves included: a page cannot read an
    // answer without them.
    match cors {
        Some(cors) => router.layer(cors),
        None => router,
    }
}

/// CORS for the configured origins; `None` when there are none, so that
/// no answer carries CORS headers and a preflight is refused (405).
/// Tokens travel in `Authorization`, never in cookies: no credentials mode.
fn cors(api: &ApiConfig) -> Option<CorsLayer> {
    if api.cors_origins.is_empty() {
        return None;
    }
    // Validated at start-up: each is an ASCII origin.
    let origins: Vec<HeaderValue> = api
        .cors_origins
        .iter()
        .filter_map(|origin| HeaderValue::from_str(origin).ok())
        .collect();
    Some(
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(origins))
            // `PUT` and `DELETE`: graphql-sse's reservations and stops.
            .allow_methods([
                Method::GET,
                Method::POST,
                Method::PUT,
                Method::DELETE,
                Method::OPTIONS,
            ])
            // `Last-Event-ID`: a fetch-based SSE reader resuming a stream;
            // graphql-sse's stream token.
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                header::HeaderName::from_static("last-event-id"),
                header::HeaderName::from_static(graphql_sse::TOKEN_HEADER),
            ]),
    )
}
