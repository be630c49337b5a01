//! The GraphQL API: schema, authentication, HTTP and WebSocket transports.

pub mod auth;
pub mod context;
pub mod cost;
pub mod error;
pub mod events;
mod fanout;
pub mod feed;
mod http;
pub mod listener;
mod literals;
pub mod mutation;
pub mod query;
pub mod subscription;
pub mod types;
mod ws;

use std::sync::Arc;

use async_graphql::{SDLExportOptions, Schema};
use axum::Router;
use axum::http::{HeaderValue, Method, header};
use axum::routing::get;
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::config::ApiConfig;
use auth::Authenticator;
use context::{Services, Snapshots};
use cost::QueryCost;
use error::ErrorCodes;
use literals::EnumLiterals;
use mutation::Mutation;
use query::Query;
use subscription::Subscription;

pub type TetherSchema = Schema<Query, Mutation, Subscription>;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub schema: TetherSchema,
    pub services: Services,
    pub auth: Arc<Authenticator>,
    pub limits: Arc<ApiConfig>,
    pub fanout: Arc<fanout::Fanout>,
    /// What every WebSocket's loop uses, in one place for all of them.
    ws: Arc<ws::Shared>,
}

pub fn schema(services: Services) -> TetherSchema {
    let limits = &services.config.api;
    Schema::build(Query, Mutation, Subscription)
        .limit_depth(limits.max_query_depth)
        .limit_complexity(limits.max_query_complexity)
        .extension(ErrorCodes)
        .extension(EnumLiterals)
        .extension(Snapshots(services.store.clone()))
        .extension(QueryCost {
            max_aliases: limits.max_aliases,
            // Validation walks every field of the expanded document; one
            // with more fields than the complexity limit allows is refused
            // before that walk.
            max_fields: limits.max_query_complexity,
            timeout: limits.request_timeout(),
        })
        .data(services.clone())
        .finish()
}

/// The schema in SDL, sorted, as committed in `schema.graphql`.
pub fn sdl() -> String {
    Schema::build(Query, Mutation, Subscription)
        .finish()
        .sdl_with_options(
            SDLExportOptions::new()
                .sorted_fields()
                .sorted_arguments()
                .sorted_enum_items(),
        )
}

/// Only the probes, for `--role worker`.
pub fn health_router(services: Services) -> Router {
    Router::new()
        .route("/healthz", get(http::healthz))
        .route("/readyz", get(http::readyz_store))
        .with_state(services.store)
}

pub fn router(services: Services, auth: Authenticator) -> Router {
    routes(AppState::new(services, auth))
}

impl AppState {
    pub fn new(services: Services, auth: Authenticator) -> AppState {
        let schema = schema(services.clone());
        let limits = Arc::new(services.config.api.clone());
        let auth = Arc::new(auth);
        let fanout: Arc<fanout::Fanout> = Arc::default();
        let ws = Arc::new(ws::Shared {
            schema: schema.clone(),
            store: services.store.clone(),
            auth: auth.clone(),
            limits: limits.clone(),
            fanout: fanout.clone(),
        });
        AppState {
            schema,
            limits,
            services,
            auth,
            fanout,
            ws,
        }
    }
}

fn routes(state: AppState) -> Router {
    let cors = cors(&state.services.config.api);
    let router = Router::new()
        .route("/graphql", get(http::graphql_get).post(http::graphql_post))
        .route("/graphiql", get(http::graphiql))
        .route("/healthz", get(http::healthz))
        .route("/readyz", get(http::readyz))
        .with_state(state);
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
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
    )
}
