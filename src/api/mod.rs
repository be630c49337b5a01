//! The GraphQL API: schema, authentication, HTTP and WebSocket transports.

pub mod auth;
pub mod context;
pub mod cost;
pub mod error;
pub mod events;
mod feed;
mod http;
pub mod listener;
pub mod mutation;
pub mod query;
pub mod subscription;
pub mod types;
mod ws;

use std::sync::Arc;

use async_graphql::{SDLExportOptions, Schema};
use axum::Router;
use axum::routing::get;

use crate::config::ApiConfig;
use auth::Authenticator;
use context::{Services, Snapshots};
use cost::QueryCost;
use error::ErrorCodes;
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
}

pub fn schema(services: Services) -> TetherSchema {
    let limits = &services.config.api;
    Schema::build(Query, Mutation, Subscription)
        .limit_depth(limits.max_query_depth)
        .limit_complexity(limits.max_query_complexity)
        .extension(ErrorCodes)
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
    let state = AppState {
        schema: schema(services.clone()),
        limits: Arc::new(services.config.api.clone()),
        services,
        auth: Arc::new(auth),
    };
    Router::new()
        .route("/graphql", get(http::graphql_get).post(http::graphql_post))
        .route("/graphiql", get(http::graphiql))
        .route("/healthz", get(http::healthz))
        .route("/readyz", get(http::readyz))
        .with_state(state)
}
