//! Integration tests: the real `tether` binary over real HTTP and WebSocket,
//! on SQLite, or on PostgreSQL when `TETHER_TEST_DATABASE_URL` is set.

mod support;

mod admission;
mod arguments;
mod auth;
mod cli;
mod connections;
mod conversations;
mod cors;
mod crash;
mod deploy;
mod downstream;
mod during_a_run;
mod fairness;
mod fakes;
mod graphiql;
mod history_tail;
mod http_limits;
mod identity_providers;
mod input_limits;
mod instances;
mod interactions;
mod migrations;
mod model_history;
mod oauth_client;
mod oauth_server;
mod operations;
mod operators;
mod provider_tools;
mod providers;
mod query_cost;
mod rate_limits;
mod retries;
mod runs;
mod scale_out;
mod schema_drift;
mod secrets;
mod startup;
mod subscriptions;
mod tool_crash;
mod tools;
mod traces;
mod websocket_abuse;
mod websocket_close;
mod workers;
