//! Tether: a durable agent-run server.
//!
//! Data flows one way: the API writes facts through the store (one
//! transaction per fact, events inside it); committed events are fanned out
//! on the bus to subscriptions, which catch up from the log.

pub mod api;
pub mod bus;
pub mod config;
pub mod connections;
pub mod domain;
pub mod failpoints;
pub mod logs;
pub mod providers;
pub mod redact;
pub mod report;
pub mod runtime;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod tools;
