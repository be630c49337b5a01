//! The write path's shared primitives, at the bottom of `store/`: the write
//! transaction (begin, lock the conversation, append events, commit and
//! fan out), the fence every worker commit opens with, and what several
//! kinds of fact write (parts, a tool call's state change, pending
//! interactions closed, a step's and a run's end).
//!
//! The modules of each fact (`commands`, `queue`, `runs`, `tool_calls`,
//! `interactions`, `connections`) build on these and never on each other,
//! so the arrows inside `store/` point one way: down to here, to `reads`
//! and to `entities`.

mod audit;
mod calls;
mod end;
mod group;
mod parts;
mod pending;
mod start;
mod steer;

pub use audit::OperatorAction;
pub(in crate::store) use audit::record as record_operator_action;
pub use calls::state_of;
pub(in crate::store) use calls::{change_in, tool_event};
pub use end::Ending;
pub(in crate::store) use end::{
    abandon_open_parts, abandon_open_parts_with, apply_usage, clear_lease, end, end_closed,
    step_events,
};
pub(in crate::store) use group::Pending;
pub use parts::{OpenPart, PartText, utf16_len};
pub(in crate::store) use parts::{
    PartContent, add_part, assistant_message, insert_part, next_index, part_event, save_parts,
};
pub(in crate::store) use pending::{
    cancel_where, close_pending, interaction_event, kind_of, resolving_event,
};
pub use start::Begun;
pub(in crate::store) use start::{open_text_part, start};
pub use steer::PENDING_POS;
pub(in crate::store) use steer::{
    NewRun, insert_queued_run, join as join_steered, wait_for_boundary,
};

use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{
    ActiveValue::Set, ColumnTrait, ConnectionTrait, DatabaseBackend, DatabaseTransaction,
    EntityTrait, QueryFilter, QuerySelect, SqliteTransactionMode, Statement, TransactionOptions,
    TransactionTrait,
};
use tokio::sync::OwnedMutexGuard;
use uuid::Uuid;

use super::entities::{conversation, event, run};
use super::{Error, Result, Store};
use crate::bus::pg;
use crate::domain::cursor::Cursor;
use crate::domain::event::{Event, EventKind, NewEvent};
use crate::domain::run::{EndCause, RunStatus};
use crate::domain::time::now_millis;
use crate::domain::tool_call::ToolOutcome;
use crate::telemetry::{self, Tally};

impl Store {
    /// Waits for this process's turn to write and counts the write. Every
    /// write takes it: transactions through `begin_write`, single statements
    /// directly.
    pub(crate) async fn write_lane(&self) -> WriteLane {
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.lane().await
    }

    /// This process's turn to write, uncounted.
    async fn lane(&self) -> WriteLane {
        match &self.write_lane {
            Some(lane) => Some(lane.clone().lock_owned().await),
            None => None,
        }
    }

    /// This process's turn to write if nobody has it now (SQLite only).
    fn lane_if_free(&self) -> WriteLane {
        self.write_lane
            .as_ref()
            .and_then(|lane| lane.clone().try_lock_owned().ok())
    }

    /// Begins a write transaction. On SQLite it is `BEGIN IMMEDIATE`, so two
    /// writers never deadlock upgrading a read lock.
    pub async fn begin_write(&self) -> Result<WriteTx> {
        let lane = self.lane().await;
        self.begin_write_in(lane).await
    }

    /// `begin_write` for a caller that holds the lane already.
    async fn begin_write_in(&self, lane: WriteLane) -> Result<WriteTx> {
        self.writes.fetch_add(1, Ordering::Relaxed);
        let tx = self
            .db
            .begin_with_options(TransactionOptions {
                sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
                ..Default::default()
            })
            .await?;
        let notify_as = (self.backend() == DatabaseBackend::Postgres).then(|| self.bus.origin());
        Ok(WriteTx {
            tx,
            events: Vec::new(),
            cancels: Vec::new(),
            notify_as,
            lane,
            tally: std::sync::Mutex::default(),
        })
    }

    /// Commits, then announces the transaction's events on the bus.
    pub async fn commit(&self, write: WriteTx) -> Result<Vec<Event>> {
        let committed = self.commit_unannounced(write).await?;
        self.announce(&committed);
        Ok(committed.events)
    }

    /// Commits; the caller announces what committed (a group commit answers
    /// its writers first, so that a writer's response is not behind the work
    /// its events wake up). The write lane stays held until then, so that
    /// the bus hears commits in their order.
    async fn commit_unannounced(&self, write: WriteTx) -> Result<Committed> {
        let WriteTx {
            tx,
            events,
            cancels,
            lane,
            tally,
            ..
        } = write;
        tx.commit().await?;
        Ok(Committed {
            events,
            cancels,
            tally: tally.into_inner().unwrap_or_else(PoisonError::into_inner),
            _lane: lane,
        })
    }

    /// Publishes committed events on the bus, and tells this process's
    /// workers of the cancellations the transaction committed: the one place
    /// persisted events are fanned out.
    fn announce(&self, committed: &Committed) {
        telemetry::committed(&committed.events, &committed.tally);
        self.bus.publish(&committed.events);
        for run_id in &committed.cancels {
            self.bus.request_cancel(*run_id);
        }
    }
}

/// The right to write, held until a write's commit is announced (SQLite
/// only).
pub(crate) type WriteLane = Option<OwnedMutexGuard<()>>;

/// A committed transaction, not yet announced, still holding the lane.
struct Committed {
    events: Vec<Event>,
    cancels: Vec<Uuid>,
    tally: Tally,
    _lane: WriteLane,
}

/// A write transaction that collects the events appended in it, to publish
/// once it has committed. Dropping it rolls back and publishes nothing.
pub struct WriteTx {
    tx: DatabaseTransaction,
    events: Vec<Event>,
    /// Runs whose cancellation this transaction requests, for this
    /// process's workers once it commits.
    cancels: Vec<Uuid>,
    /// On PostgreSQL, this process's origin for NOTIFY payloads.
    notify_as: Option<Uuid>,
    lane: WriteLane,
    /// The runs it ends and the tool calls it gives an outcome, counted in
    /// the metrics once it commits.
    tally: std::sync::Mutex<Tally>,
}

impl std::ops::Deref for WriteTx {
    type Target = DatabaseTransaction;
    fn deref(&self) -> &DatabaseTransaction {
        &self.tx
    }
}

impl WriteTx {
    /// Notes a run this transaction ends, for the metrics.
    pub(in crate::store) fn count_run_end(&self, status: RunStatus, cause: EndCause) {
        self.tally().runs_ended.push((status, cause));
    }

    /// Notes a tool call this transaction gives an outcome, for the metrics.
    pub(in crate::store) fn count_tool_outcome(&self, tool: &str, outcome: ToolOutcome) {
        self.tally().tool_outcomes.push((tool.to_owned(), outcome));
    }

    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks a conversation of `tenant` for the rest of the transaction, so
    /// that its writers serialize and its event sequence follows commit order.
    pub async fn lock_conversation(&self, id: Uuid, tenant: &str) -> Result<conversation::Model> {
        conversation::Entity::find_by_id(id)
            .filter(conversation::Column::Tenant.eq(tenant))
            .lock_exclusive()
            .one(&self.tx)
            .await?
            .ok_or(Error::NotFound)
    }

    /// `lock_conversation`, taking the conversation's next run number
    /// (`run_seq` of the row returned) with the lock, in one statement. A
    /// number taken by a transaction that then stores no run is skipped:
    /// runs are ordered by their numbers, which need no gaps.
    pub async fn lock_conversation_for_run(
        &self,
        id: Uuid,
        tenant: &str,
    ) -> Result<conversation::Model> {
        conversation::Entity::update_many()
            .col_expr(
                conversation::Column::RunSeq,
                Expr::col(conversation::Column::RunSeq).add(1),
            )
            .filter(conversation::Column::Id.eq(id))
            .filter(conversation::Column::Tenant.eq(tenant))
            .exec_with_returning(&self.tx)
            .await?
            .into_iter()
            .next()
            .ok_or(Error::NotFound)
    }

    /// Appends events to a conversation's log in this transaction. Sequence
    /// numbers come from the conversation row, whose lock is held until
    /// commit: a later number is always a later commit.
    pub async fn append<'a>(
        &mut self,
        log: impl Into<Log<'a>>,
        new_events: Vec<NewEvent>,
    ) -> Result<()> {
        let conversation = log.into();
        if new_events.is_empty() {
            return Ok(());
        }
        let count = new_events.len() as i64;
        let updated = conversation::Entity::update_many()
            .col_expr(
                conversation::Column::EventSeq,
                Expr::col(conversation::Column::EventSeq).add(count),
            )
            .filter(conversation::Column::Id.eq(conversation.id))
            .exec_with_returning(&self.tx)
            .await?;
        let last = updated.first().ok_or(Error::NotFound)?.event_seq;
        let at = now_millis();
        let mut rows = Vec::with_capacity(new_events.len());
        for (offset, new) in new_events.into_iter().enumerate() {
            let seq = last - count + 1 + offset as i64;
            let payload = serde_json::to_value(&new.body)
                .map_err(|e| Error::Corrupt(format!("event body: {e}")))?;
            rows.push(event::ActiveModel {
                conversation_id: Set(conversation.id),
                seq: Set(seq),
                tenant: Set(conversation.tenant.to_owned()),
                run_id: Set(new.run_id),
                kind: Set(new.kind.as_str().to_owned()),
                payload: Set(payload),
                created_at: Set(at),
            });
            self.events.push(Event {
                conversation_id: conversation.id,
                cursor: Cursor(seq),
                kind: new.kind,
                run_id: new.run_id,
                at,
                body: new.body,
            });
        }
        event::Entity::insert_many(rows).exec(&self.tx).await?;
        self.notify(pg::EVENTS, Some(conversation.id)).await?;
        if self.events.iter().any(|e| e.kind == EventKind::RunQueued) {
            self.notify(pg::QUEUED, None).await?;
        }
        Ok(())
    }

    /// Requests a run's cancellation once this transaction commits: this
    /// process's worker is told when the commit is announced, other
    /// processes by NOTIFY (delivered on commit only).
    pub async fn notify_cancel(&mut self, run_id: Uuid) -> Result<()> {
        self.cancels.push(run_id);
        self.notify(pg::CANCEL, Some(run_id)).await
    }

    /// NOTIFY inside the transaction, so it is delivered on commit only.
    async fn notify(&self, channel: &str, id: Option<Uuid>) -> Result<()> {
        let Some(origin) = self.notify_as else {
            return Ok(());
        };
        let payload = match id {
            Some(id) => format!("{origin}:{id}"),
            None => origin.to_string(),
        };
        self.tx
            .execute_raw(Statement::from_sql_and_values(
                DatabaseBackend::Postgres,
                "SELECT pg_notify($1, $2)",
                [channel.into(), payload.into()],
            ))
            .await?;
        Ok(())
    }
}

/// The conversation whose event log a transaction appends to.
#[derive(Debug, Clone, Copy)]
pub struct Log<'a> {
    pub id: Uuid,
    pub tenant: &'a str,
}

impl<'a> From<&'a conversation::Model> for Log<'a> {
    fn from(conversation: &'a conversation::Model) -> Self {
        Log {
            id: conversation.id,
            tenant: &conversation.tenant,
        }
    }
}

impl<'a> From<&'a Log<'a>> for Log<'a> {
    fn from(log: &'a Log<'a>) -> Self {
        *log
    }
}

impl<'a> From<&'a Lease> for Log<'a> {
    fn from(lease: &'a Lease) -> Self {
        Log {
            id: lease.conversation_id,
            tenant: &lease.tenant,
        }
    }
}

/// The right to write for one claim of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub run_id: Uuid,
    pub conversation_id: Uuid,
    pub tenant: String,
    pub epoch: i64,
}

impl Lease {
    pub fn of(row: &run::Model) -> Lease {
        Lease {
            run_id: row.id,
            conversation_id: row.conversation_id,
            tenant: row.tenant.clone(),
            epoch: row.lease_epoch,
        }
    }
}

/// Opens a worker's commit: a write transaction in which the run is still
/// `RUNNING` under this lease's epoch (else `Fenced`, and nothing is
/// written). See `fence`.
pub(in crate::store) async fn open<'a>(
    store: &Store,
    lease: &'a Lease,
) -> Result<(WriteTx, Log<'a>, run::Model)> {
    let tx = store.begin_write().await?;
    let row = fence(&tx, lease).await?;
    Ok((tx, Log::from(lease), row))
}

/// The fence every worker commit starts with: the run's row, still
/// `RUNNING` under this lease's epoch, else `Fenced` (and the caller writes
/// nothing). On PostgreSQL the run's conversation is locked first. On SQLite
/// the transaction itself (`BEGIN IMMEDIATE`) already excludes every other
/// writer, so the lock needs no statement of its own.
pub(in crate::store) async fn fence(tx: &WriteTx, lease: &Lease) -> Result<run::Model> {
    if tx.get_database_backend() == DatabaseBackend::Postgres {
        tx.lock_conversation(lease.conversation_id, &lease.tenant)
            .await?;
    }
    run::Entity::find_by_id(lease.run_id)
        .filter(run::Column::LeaseEpoch.eq(lease.epoch))
        .filter(run::Column::Status.eq(RunStatus::Running.as_str()))
        .lock_exclusive()
        .one(&**tx)
        .await?
        .ok_or(Error::Fenced)
}
