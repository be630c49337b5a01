//! Database migrations for Tether, shared by SQLite and PostgreSQL.
//!
//! Timestamps are stored as milliseconds since the Unix epoch (BIGINT) so that
//! both backends compare and order them the same way.

pub use sea_orm_migration::prelude::*;

mod m0001_initial;
mod m0002_runtime;
mod m0003_summaries;
mod m0004_tool_calls;
mod m0005_interactions;
mod m0006_connections;
mod m0007_read_indexes;
mod m0008_run_order;
mod m0009_operator_actions;
mod m0010_steering;
mod m0011_grants_by_principal;
mod m0012_operator_issuer;
mod m0013_runs_by_owner;
mod shape;

pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m0001_initial::Migration),
            Box::new(m0002_runtime::Migration),
            Box::new(m0003_summaries::Migration),
            Box::new(m0004_tool_calls::Migration),
            Box::new(m0005_interactions::Migration),
            Box::new(m0006_connections::Migration),
            Box::new(m0007_read_indexes::Migration),
            Box::new(m0008_run_order::Migration),
            Box::new(m0009_operator_actions::Migration),
            Box::new(m0010_steering::Migration),
            Box::new(m0011_grants_by_principal::Migration),
            Box::new(m0012_operator_issuer::Migration),
            Box::new(m0013_runs_by_owner::Migration),
        ]
    }
}
