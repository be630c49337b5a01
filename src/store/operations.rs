//! What operators read across tenants: the workload the metrics report, the
//! runs that are stuck, and the tool calls whose outcome nobody knows.
//! Reads only; the operators' writes are with their facts
//! (`tool_calls::resolve`, `queue::requeue`).

use std::time::Duration;

use sea_orm::{
    ColumnTrait, DatabaseBackend, EntityTrait, FromQueryResult, QueryFilter, QueryOrder,
    QuerySelect, Statement, Value,
};
use uuid::Uuid;

use super::entities::{interaction, run, tool_call};
use super::reads::Claimable;
use super::{Result, Store};
use crate::domain::interaction::{InteractionKind, InteractionStatus};
use crate::domain::run::RunStatus;
use crate::domain::time::now_millis;
use crate::domain::tool_call::{ToolCallStatus, ToolOutcome};

/// The shared work, as the metrics report it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Workload {
    /// Runs not ended, by status; every such status, zeros included.
    pub runs: Vec<(RunStatus, u64)>,
    /// Runs workers may claim now.
    pub queue_depth: u64,
    /// How long the longest-waiting claimable run has been ready.
    pub oldest_ready: Duration,
    /// Pending interactions by kind; every kind, zeros included.
    pub pending: Vec<(InteractionKind, u64)>,
}

pub async fn workload(store: &Store) -> Result<Workload> {
    let db = store.api_reads();
    let counted: Vec<(String, i64)> = run::Entity::find()
        .select_only()
        .column(run::Column::Status)
        .column_as(run::Column::Id.count(), "n")
        .filter(run::Column::Status.is_in(RunStatus::not_ended().map(RunStatus::as_str)))
        .group_by(run::Column::Status)
        .into_tuple()
        .all(db)
        .await?;
    let runs = RunStatus::not_ended()
        .map(|status| {
            let n = counted
                .iter()
                .find(|(s, _)| s == status.as_str())
                .map_or(0, |(_, n)| *n);
            (status, n.max(0) as u64)
        })
        .collect();

    let now = now_millis();
    let backend = db.get_database_backend();
    let Claimable {
        condition,
        ready_since,
    } = Claimable::sql(backend, &param(backend, 1));
    let sql = format!(
        "SELECT COUNT(*) AS n, MIN(ready) AS oldest FROM \
         (SELECT {ready_since} AS ready FROM runs r WHERE {condition}) claimable"
    );
    #[derive(FromQueryResult)]
    struct Queue {
        n: i64,
        oldest: Option<i64>,
    }
    let queue = Queue::find_by_statement(Statement::from_sql_and_values(
        backend,
        sql,
        [Value::from(now)],
    ))
    .one(db)
    .await?;
    let (queue_depth, oldest_ready) = match queue {
        Some(Queue { n, oldest }) => (
            n.max(0) as u64,
            oldest.map_or(Duration::ZERO, |at| {
                Duration::from_millis((now - at).max(0) as u64)
            }),
        ),
        None => (0, Duration::ZERO),
    };

    let counted: Vec<(String, i64)> = interaction::Entity::find()
        .select_only()
        .column(interaction::Column::Kind)
        .column_as(interaction::Column::Id.count(), "n")
        .filter(interaction::Column::Status.eq(InteractionStatus::Pending.as_str()))
        .group_by(interaction::Column::Kind)
        .into_tuple()
        .all(db)
        .await?;
    let pending = InteractionKind::ALL
        .iter()
        .map(|kind| {
            let n = counted
                .iter()
                .find(|(k, _)| k == kind.as_str())
                .map_or(0, |(_, n)| *n);
            (*kind, n.max(0) as u64)
        })
        .collect();
    Ok(Workload {
        runs,
        queue_depth,
        oldest_ready,
        pending,
    })
}

fn param(backend: DatabaseBackend, n: usize) -> String {
    match backend {
        DatabaseBackend::Postgres => format!("${n}"),
        _ => "?".to_owned(),
    }
}

/// How long a claimable run may wait before it is listed as stuck, unless
/// the operator says otherwise.
pub const QUEUED_TOO_LONG: Duration = Duration::from_secs(300);

/// The most runs of one kind a listing returns.
const LIST_MAX: usize = 1000;

/// Why a run is listed as stuck.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stuck {
    /// `RUNNING`, but its lease ran out and no worker has reclaimed it.
    LeaseExpired,
    /// Claimable for longer than the threshold, and nobody claimed it.
    QueuedTooLong,
    /// Waiting for a person whose question, approval or consent is past
    /// its expiry, and nobody expired it.
    InteractionExpired,
}

impl Stuck {
    pub fn as_str(self) -> &'static str {
        match self {
            Stuck::LeaseExpired => "LEASE_EXPIRED",
            Stuck::QueuedTooLong => "QUEUED_TOO_LONG",
            Stuck::InteractionExpired => "INTERACTION_EXPIRED",
        }
    }
}

/// A stuck run, with since when (milliseconds since the epoch) it has been
/// in that state: the lease's expiry, the time it became ready, or the
/// interaction's expiry.
#[derive(Debug, Clone, PartialEq)]
pub struct StuckRun {
    pub run: run::Model,
    pub why: Stuck,
    pub since: i64,
}

/// Runs that no worker is moving on: leases expired without a reclaim,
/// claimable runs ready for longer than `queued_longer_than`, and runs
/// waiting on interactions past their expiry. Oldest first.
pub async fn stuck_runs(store: &Store, queued_longer_than: Duration) -> Result<Vec<StuckRun>> {
    let db = store.db();
    let now = now_millis();
    let mut stuck = Vec::new();

    // Leases run out on the database's clock.
    let db_now = super::clock::now(db).await?;
    let expired = run::Entity::find()
        .filter(run::Column::Status.eq(RunStatus::Running.as_str()))
        .filter(run::Column::LeaseExpiresAt.lt(db_now))
        .all(db)
        .await?;
    stuck.extend(expired.into_iter().map(|run| StuckRun {
        since: run.lease_expires_at.unwrap_or(db_now),
        run,
        why: Stuck::LeaseExpired,
    }));

    let backend = db.get_database_backend();
    let Claimable {
        condition,
        ready_since,
    } = Claimable::sql(backend, &param(backend, 1));
    let threshold = now - queued_longer_than.as_millis().min(i64::MAX as u128) as i64;
    #[derive(FromQueryResult)]
    struct Ready {
        id: Uuid,
        ready: i64,
    }
    let ready = Ready::find_by_statement(Statement::from_sql_and_values(
        backend,
        format!(
            "SELECT id, ready FROM (SELECT r.id AS id, {ready_since} AS ready FROM runs r \
             WHERE {condition}) claimable WHERE ready <= {} ORDER BY ready LIMIT {LIST_MAX}",
            param(backend, 2)
        ),
        [Value::from(now), Value::from(threshold)],
    ))
    .all(db)
    .await?;
    let ids: Vec<Uuid> = ready.iter().map(|r| r.id).collect();
    let rows = if ids.is_empty() {
        Vec::new()
    } else {
        run::Entity::find()
            .filter(run::Column::Id.is_in(ids))
            .all(db)
            .await?
    };
    for run in rows {
        if let Some(found) = ready.iter().find(|r| r.id == run.id) {
            stuck.push(StuckRun {
                since: found.ready,
                run,
                why: Stuck::QueuedTooLong,
            });
        }
    }

    let overdue = interaction::Entity::find()
        .filter(interaction::Column::Status.eq(InteractionStatus::Pending.as_str()))
        .filter(interaction::Column::ExpiresAt.lt(now))
        .order_by_asc(interaction::Column::ExpiresAt)
        .limit(LIST_MAX as u64)
        .all(db)
        .await?;
    let waiting = [
        RunStatus::WaitingForQuestion,
        RunStatus::WaitingForApproval,
        RunStatus::WaitingForConnection,
    ];
    let run_ids: Vec<Uuid> = overdue.iter().map(|i| i.run_id).collect();
    let waiting_runs = if run_ids.is_empty() {
        Vec::new()
    } else {
        run::Entity::find()
            .filter(run::Column::Id.is_in(run_ids))
            .filter(run::Column::Status.is_in(waiting.map(RunStatus::as_str)))
            .all(db)
            .await?
    };
    // Each run once, since its earliest overdue interaction.
    for run in waiting_runs {
        let since = overdue
            .iter()
            .filter(|i| i.run_id == run.id)
            .map(|i| i.expires_at)
            .min()
            .unwrap_or(now);
        if !stuck.iter().any(|s| s.run.id == run.id) {
            stuck.push(StuckRun {
                since,
                run,
                why: Stuck::InteractionExpired,
            });
        }
    }
    stuck.sort_by_key(|s| (s.since, s.run.id));
    Ok(stuck)
}

/// The tenant a run belongs to, whichever it is (for operators).
pub async fn owner_of_run(store: &Store, run_id: Uuid) -> Result<Option<(String, String)>> {
    Ok(run::Entity::find_by_id(run_id)
        .select_only()
        .column(run::Column::Tenant)
        .column(run::Column::Principal)
        .into_tuple()
        .one(store.db())
        .await?)
}

/// Tool calls whose outcome is `UNKNOWN`: cut off mid-flight, not to be
/// replayed, waiting for an operator to learn from the downstream system
/// what happened. Oldest first.
pub async fn unknown_tool_calls(store: &Store) -> Result<Vec<tool_call::Model>> {
    Ok(tool_call::Entity::find()
        .filter(tool_call::Column::Status.eq(ToolCallStatus::Indeterminate.as_str()))
        .filter(tool_call::Column::Outcome.eq(ToolOutcome::Unknown.as_str()))
        .order_by_asc(tool_call::Column::CreatedAt)
        .order_by_asc(tool_call::Column::Id)
        .all(store.db())
        .await?)
}
