//! The clock leases are taken and compared on: the database's, so that
//! processes need not agree on the time. On PostgreSQL every process reads
//! the server's clock in the statement that writes or compares a lease
//! (`clock_timestamp()`, not the transaction's start, so that a statement
//! that waited for a lock compares with the time it ran). On SQLite one
//! process owns the database file (the worker lock), so the clock is that
//! process's own, read by SQLite itself. Either way `TETHER_CLOCK_SKEW_MS`
//! (a test's way of setting a process's clock wrong) does not move it.
//!
//! Other times (when a run was claimed, created, ended, when a retry is
//! due) are the writing process's; ARCHITECTURE.md says why those are safe.

use sea_orm::sea_query::{Expr, SimpleExpr};
use sea_orm::{ConnectionTrait, DatabaseBackend, Statement};

use super::{Error, Result};

/// The database's time in Unix milliseconds, as an SQL expression.
pub fn now_sql(backend: DatabaseBackend) -> &'static str {
    match backend {
        DatabaseBackend::Postgres => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        _ => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    }
}

/// `now_sql` for the query builder.
pub fn now_expr(backend: DatabaseBackend) -> SimpleExpr {
    Expr::cust(now_sql(backend))
}

/// The database's time in Unix milliseconds, read now.
pub async fn now<C: ConnectionTrait>(db: &C) -> Result<i64> {
    let backend = db.get_database_backend();
    let sql = format!("SELECT {} AS now", now_sql(backend));
    let row = db
        .query_one_raw(Statement::from_string(backend, sql))
        .await?
        .ok_or_else(|| Error::Corrupt("the database did not tell its time".to_owned()))?;
    Ok(row.try_get("", "now")?)
}
