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

pub(in crate::store) use audit::record as record_operator_action;
pub use audit::{Operator, OperatorAction};
pub use calls::{Finished, Outcome, of_step, state_of};
pub(in crate::store) use calls::{change_in, change_through_in, record_in, set_output, tool_event};
pub use end::Ending;
pub(in crate::store) use end::{
    abandon_open_parts, abandon_open_parts_with, apply_usage, clear_lease, end, end_closed,
    fence_for_end, step_events,
};
pub(in crate::store) use group::Pending;
pub use parts::{OpenPart, PartText, utf16_len};
pub(in crate::store) use parts::{
    PartContent, add_part, assistant_message, insert_part, next_index, part_event, save_parts,
    save_parts_with_append,
};
pub(in crate::store) use pending::{
    cancel_where, close_pending, interaction_event, kind_of, resolving_event,
};
pub use start::{Begun, FirstStep, StepBatch};
pub(in crate::store) use start::{open_text_part, start};
pub use steer::PENDING_POS;
pub(in crate::store) use steer::{NewRun, join as join_steered, queued_run, wait_for_boundary};

use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use sea_orm::sea_query::{Expr, ExprTrait, Query};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, DatabaseBackend, DatabaseTransaction,
    EntityTrait, QueryFilter, QuerySelect, QueryTrait, SqliteTransactionMode, Statement,
    TransactionOptions, TransactionTrait,
};
use tokio::sync::OwnedMutexGuard;
use uuid::Uuid;

use super::clock;
use super::entities::{conversation, run};
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
            deferred: std::sync::Mutex::default(),
            wake: std::sync::atomic::AtomicBool::new(false),
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
        write.flush_deferred().await?;
        let WriteTx {
            tx,
            events,
            cancels,
            lane,
            tally,
            wake,
            ..
        } = write;
        tx.commit().await?;
        Ok(Committed {
            events,
            cancels,
            tally: tally.into_inner().unwrap_or_else(PoisonError::into_inner),
            wake: wake.into_inner(),
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
        if committed.wake {
            self.bus.wake_workers();
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
    wake: bool,
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
    /// Writes no later statement reads back, sent with the next append or,
    /// at the latest, before the commit (`defer`).
    deferred: std::sync::Mutex<Writes>,
    /// Whether this process's workers are woken once it commits: a run may
    /// be ready to claim that no `run.queued` announces (the next of a
    /// conversation whose run this transaction ends).
    wake: std::sync::atomic::AtomicBool,
}

impl std::ops::Deref for WriteTx {
    type Target = DatabaseTransaction;
    fn deref(&self) -> &DatabaseTransaction {
        &self.tx
    }
}

impl WriteTx {
    /// Rolls back now, rather than on drop: dropping a transaction only
    /// queues its `ROLLBACK` until the connection is next used, and its
    /// locks are held meanwhile.
    pub async fn rollback(self) -> Result<()> {
        self.tx.rollback().await?;
        Ok(())
    }

    /// Wakes this process's workers once this transaction commits.
    pub(in crate::store) fn wake_workers_on_commit(&self) {
        self.wake.store(true, Ordering::Relaxed);
    }

    /// Notes a run this transaction ends, for the metrics.
    pub(in crate::store) fn count_run_end(&self, status: RunStatus, cause: EndCause) {
        self.tally().runs_ended.push((status, cause));
    }

    /// Inserts `model`, as built, with this transaction's next append (in
    /// the append's own query), or before it commits. For rows
    /// that nothing in the transaction reads back.
    pub(in crate::store) fn defer_insert<A: ActiveModelTrait>(&self, model: A) {
        self.defer(A::Entity::insert(model).build(self.get_database_backend()));
    }

    /// Runs `write` with this transaction's next append (in the append's own
    /// query), or before it commits. For a write whose effect nothing in
    /// the transaction reads before then, and which changes rows that
    /// nothing else in the transaction writes.
    pub(in crate::store) fn defer(&self, write: Statement) {
        self.deferred
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0
            .push(write);
    }

    /// Runs the deferred writes now.
    pub(in crate::store) async fn flush_deferred(&self) -> Result<()> {
        let deferred =
            std::mem::take(&mut *self.deferred.lock().unwrap_or_else(PoisonError::into_inner));
        for write in deferred.0 {
            self.tx.execute_raw(write).await?;
        }
        Ok(())
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
        self.append_after(Writes::default(), log, new_events).await
    }

    /// Runs `writes`, then `append`s, in one query (on SQLite one hand-over
    /// to the connection's thread, on PostgreSQL one round trip).
    pub(in crate::store) async fn append_after<'a>(
        &mut self,
        writes: Writes,
        log: impl Into<Log<'a>>,
        new_events: Vec<NewEvent>,
    ) -> Result<()> {
        let conversation = log.into();
        // The deferred writes go first, in the order they were deferred.
        let mut writes = writes;
        let deferred = self
            .deferred
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if !deferred.0.is_empty() {
            let mut all = std::mem::take(deferred);
            all.0.append(&mut writes.0);
            writes = all;
        }
        let sqlite = self.get_database_backend() == DatabaseBackend::Sqlite;
        // The append's query carries them; without events they go alone.
        if new_events.is_empty() {
            for write in writes.0 {
                self.tx.execute_raw(write).await?;
            }
            return Ok(());
        }
        let count = new_events.len() as i64;
        let at = now_millis();
        let mut rows = Vec::with_capacity(new_events.len());
        for new in &new_events {
            let payload = serde_json::to_value(&new.body)
                .map_err(|e| Error::Corrupt(format!("event body: {e}")))?;
            rows.push((new.run_id, new.kind.as_str(), payload));
        }
        let last = if sqlite {
            append_sqlite(&self.tx, writes, conversation, at, rows).await?
        } else {
            // Every process's subscribers of the conversation, and on a
            // new run every process's workers, hear of the commit.
            let queued = self
                .events
                .iter()
                .map(|e| e.kind)
                .chain(new_events.iter().map(|n| n.kind))
                .any(|kind| kind == EventKind::RunQueued);
            let mut notices = Vec::new();
            if let Some(origin) = self.notify_as {
                notices.push((pg::EVENTS, notice(origin, Some(conversation.id))));
                if queued {
                    notices.push((pg::QUEUED, notice(origin, None)));
                }
            }
            append_postgres(&self.tx, writes, conversation, at, rows, notices).await?
        };
        for (offset, new) in new_events.into_iter().enumerate() {
            self.events.push(Event {
                conversation_id: conversation.id,
                cursor: Cursor(last - count + 1 + offset as i64),
                kind: new.kind,
                run_id: new.run_id,
                at,
                body: new.body,
            });
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
        self.tx
            .execute_raw(Statement::from_sql_and_values(
                DatabaseBackend::Postgres,
                "SELECT pg_notify($1, $2)",
                [channel.into(), notice(origin, id).into()],
            ))
            .await?;
        Ok(())
    }
}

/// A NOTIFY payload: the process it comes from, and what it is about.
fn notice(origin: Uuid, id: Option<Uuid>) -> String {
    match id {
        Some(id) => format!("{origin}:{id}"),
        None => origin.to_string(),
    }
}

/// Writes whose results nobody reads in the transaction, kept to be sent
/// with its next append (`WriteTx::append_after`), in the order added: rows
/// a caller built whole, and updates of rows nothing else in the
/// transaction writes (`WriteTx::defer`). The caller reads nothing they
/// would change before that append.
#[derive(Default)]
pub(in crate::store) struct Writes(Vec<Statement>);

impl Writes {
    /// Inserts `model`, as built, in `tx`.
    pub(in crate::store) fn insert<A>(&mut self, tx: &WriteTx, model: A)
    where
        A: ActiveModelTrait,
    {
        self.0
            .push(A::Entity::insert(model).build(tx.get_database_backend()));
    }
}

/// An event row to append: its run, kind and payload.
type EventRow<'k> = (Option<Uuid>, &'k str, serde_json::Value);

/// `writes`, then `append`'s rows, on PostgreSQL, in one statement (one
/// round trip): each write a data-modifying `WITH` query of its own (they
/// insert or update rows nothing else in the statement reads or writes,
/// and the foreign keys between them are checked at its end), the
/// conversation's sequence moved on, the rows numbered from its new last
/// number, which it returns, and the `notices` sent (delivered on commit). No row is returned when there is
/// no such conversation, and the caller's transaction then fails.
async fn append_postgres(
    tx: &DatabaseTransaction,
    writes: Writes,
    conversation: Log<'_>,
    at: i64,
    rows: Vec<EventRow<'_>>,
    notices: Vec<(&str, String)>,
) -> Result<i64> {
    let count = rows.len() as i64;
    let mut values: Vec<sea_orm::Value> = vec![
        count.into(),
        conversation.id.into(),
        conversation.tenant.into(),
        at.into(),
    ];
    let mut with = String::new();
    for (i, write) in writes.0.into_iter().enumerate() {
        let sql = renumbered(&write.sql, values.len());
        with.push_str(&format!("w{i} AS ({sql}), "));
        values.extend(write.values.map(|v| v.0).unwrap_or_default());
    }
    let mut param = |value: sea_orm::Value| {
        values.push(value);
        format!("${}", values.len())
    };
    let mut tuples = Vec::with_capacity(rows.len());
    for (offset, (run_id, kind, payload)) in rows.into_iter().enumerate() {
        // Each row's distance from the last number.
        tuples.push(format!(
            "({}::bigint, {}::uuid, {}::text, {}::json)",
            param((count - 1 - offset as i64).into()),
            param(run_id.into()),
            param(kind.into()),
            param(payload.into()),
        ));
    }
    let mut sent = String::new();
    for (channel, payload) in notices {
        let (channel, payload) = (param(channel.into()), param(payload.into()));
        sent.push_str(&format!(", pg_notify({channel}, {payload})"));
    }
    let sql = format!(
        "WITH {with}c AS (UPDATE conversations SET event_seq = event_seq + $1 WHERE id = $2 \
                    RETURNING event_seq), \
              e AS (INSERT INTO events \
                      (conversation_id, seq, tenant, run_id, kind, payload, created_at) \
                    SELECT $2, c.event_seq - v.d, $3, v.r, v.k, v.p, $4 \
                    FROM c, (VALUES {}) AS v (d, r, k, p)) \
         SELECT c.event_seq{sent} FROM c",
        tuples.join(", ")
    );
    let row = tx
        .query_one_raw(Statement::from_sql_and_values(
            DatabaseBackend::Postgres,
            sql,
            values,
        ))
        .await?
        .ok_or(Error::NotFound)?;
    Ok(row.try_get_by_index::<i64>(0)?)
}

/// PostgreSQL's `sql` with each placeholder `$n` moved on to `$(n + by)`,
/// for a statement that goes after `by` parameters in a longer one. Text in
/// quotes (identifiers, literals) is left as it is.
fn renumbered(sql: &str, by: usize) -> String {
    let mut out = String::with_capacity(sql.len() + 8);
    let mut chars = sql.chars().peekable();
    let mut quote = None;
    while let Some(c) = chars.next() {
        match quote {
            Some(q) => {
                if c == q {
                    quote = None;
                }
                out.push(c);
            }
            None if c == '\'' || c == '"' => {
                quote = Some(c);
                out.push(c);
            }
            None if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) => {
                let mut digits = String::new();
                while let Some(d) = chars.next_if(char::is_ascii_digit) {
                    digits.push(d);
                }
                let n: usize = digits.parse().unwrap_or(0);
                out.push_str(&format!("${}", n + by));
            }
            None => out.push(c),
        }
    }
    out
}

/// `writes`, then the rows, on SQLite, where all of it goes to the
/// connection's thread as one query (one hand-over instead of one per
/// statement): the rows take their numbers from the row the update moved
/// on, and none is inserted when there is no such conversation.
async fn append_sqlite(
    tx: &DatabaseTransaction,
    writes: Writes,
    conversation: Log<'_>,
    at: i64,
    rows: Vec<EventRow<'_>>,
) -> Result<i64> {
    let count = rows.len() as i64;
    let mut sql = String::new();
    let mut values: Vec<sea_orm::Value> = Vec::new();
    // Positional parameters number on across a query's statements.
    for write in writes.0 {
        sql.push_str(&write.sql);
        sql.push_str("; ");
        values.extend(write.values.map(|v| v.0).unwrap_or_default());
    }
    // In the order of the placeholders: the update's, the select list's,
    // the rows', the filter's.
    values.extend([
        count.into(),
        conversation.id.into(),
        conversation.tenant.into(),
        at.into(),
    ]);
    let mut tuples = Vec::with_capacity(rows.len());
    for (offset, (run_id, kind, payload)) in rows.into_iter().enumerate() {
        // Each row's distance from the last number.
        values.push((count - 1 - offset as i64).into());
        values.push(run_id.into());
        values.push(kind.into());
        values.push(payload.into());
        tuples.push("(?, ?, ?, ?)");
    }
    values.push(conversation.id.into());
    sql.push_str(&format!(
        "UPDATE conversations SET event_seq = event_seq + ? WHERE id = ? RETURNING event_seq; \
         INSERT INTO events (conversation_id, seq, tenant, run_id, kind, payload, created_at) \
         SELECT c.id, c.event_seq - v.column1, ?, v.column2, v.column3, v.column4, ? \
         FROM (VALUES {}) AS v, conversations AS c WHERE c.id = ?",
        tuples.join(", ")
    ));
    // All rows, not one: a query for one row stops after the first
    // statement's row, and the insert would never run. The writes return
    // none, so the first row is the update's.
    let returned = tx
        .query_all_raw(Statement::from_sql_and_values(
            DatabaseBackend::Sqlite,
            sql,
            values,
        ))
        .await?;
    let row = returned.first().ok_or(Error::NotFound)?;
    Ok(row.try_get_by_index::<i64>(0)?)
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
/// `RUNNING` under this lease's epoch and with its lease not run out on the
/// database's clock, else `Fenced` (or `Lapsed`, see `lapsed_or_fenced`)
/// and the caller writes nothing: no effect starts under a lapsed lease. On PostgreSQL the run's conversation is locked first. On SQLite
/// the transaction itself (`BEGIN IMMEDIATE`) already excludes every other
/// writer, so the lock needs no statement of its own.
pub(in crate::store) async fn fence(tx: &WriteTx, lease: &Lease) -> Result<run::Model> {
    let backend = tx.get_database_backend();
    let mut fenced = fenced_run(backend, lease);
    if backend == DatabaseBackend::Postgres {
        // The conversation locked in the same statement, first: an
        // uncorrelated `EXISTS (… FOR UPDATE)` is a one-time filter whose
        // plan runs before the statement's top `LockRows` takes the run
        // (every write locks a conversation before its runs). The run's row
        // is read as its latest version however long that lock took (a row
        // changed meanwhile is read again as `FOR UPDATE` does); a query
        // that asks more beside it locks first (`end::fence_for_end`).
        let conversation = Query::select()
            .expr(Expr::value(1))
            .from(conversation::Entity)
            .and_where(conversation::Column::Id.eq(lease.conversation_id))
            .and_where(conversation::Column::Tenant.eq(lease.tenant.as_str()))
            .lock_exclusive()
            .to_owned();
        fenced = fenced.filter(Expr::exists(conversation));
    }
    match fenced.one(&**tx).await? {
        Some(row) => Ok(row),
        None => Err(lapsed_or_fenced(tx, lease).await?),
    }
}

/// The fence's query, without the conversation's lock: the run still
/// `RUNNING` under this lease's epoch, its lease not run out, locked.
pub(in crate::store) fn fenced_run(
    backend: DatabaseBackend,
    lease: &Lease,
) -> sea_orm::Select<run::Entity> {
    held_run(lease)
        .filter(Expr::col(run::Column::LeaseExpiresAt).gte(clock::now_expr(backend)))
        .lock_exclusive()
}

/// The run still `RUNNING` under this lease's epoch, whenever its lease
/// runs out.
fn held_run(lease: &Lease) -> sea_orm::Select<run::Entity> {
    run::Entity::find_by_id(lease.run_id)
        .filter(run::Column::LeaseEpoch.eq(lease.epoch))
        .filter(run::Column::Status.eq(RunStatus::Running.as_str()))
}

/// Why the fence refused: `Lapsed` if the run is still this lease's but
/// its lease ran out (nobody took it, and a heartbeat renews it), else
/// `Fenced`.
pub(in crate::store) async fn lapsed_or_fenced(tx: &WriteTx, lease: &Lease) -> Result<Error> {
    Ok(match held_run(lease).one(&**tx).await? {
        Some(_) => Error::Lapsed,
        None => Error::Fenced,
    })
}

#[cfg(test)]
mod tests {
    use sea_orm::{ColumnTrait, EntityTrait, IntoActiveModel, QueryFilter, QueryOrder};
    use uuid::Uuid;

    use super::Log;
    use crate::domain::MessageRole;
    use crate::domain::cursor::Cursor;
    use crate::domain::event::NewEvent;
    use crate::domain::run::RunStatus;
    use crate::store::entities::{conversation, event, run, run_audit};
    use crate::store::test_support::{conversation, queued_run, temp_store};
    use crate::store::{Error, Store};

    /// A statement's placeholders move on past the ones before it; what
    /// is quoted stays as it is.
    #[test]
    fn placeholders_are_renumbered_outside_quotes() {
        let sql = r#"INSERT INTO "t$1" ("a", "b") VALUES ($1, $12) -- '$2''$3' $"#;
        assert_eq!(
            super::renumbered(sql, 4),
            r#"INSERT INTO "t$1" ("a", "b") VALUES ($5, $16) -- '$2''$3' $"#
        );
    }

    async fn rows(store: &Store, id: Uuid) -> Vec<event::Model> {
        event::Entity::find()
            .filter(event::Column::ConversationId.eq(id))
            .order_by_asc(event::Column::Seq)
            .all(store.db())
            .await
            .unwrap()
    }

    /// Appends in one transaction and in the next number a conversation's
    /// events on from its sequence, gap-free, each row as its event says.
    #[tokio::test]
    async fn appends_number_events_on_from_the_conversation() {
        let (store, dir) = temp_store().await;
        let found = conversation(&store).await;
        let before = rows(&store, found.id).await.len() as i64;
        let (run, message) = (Uuid::now_v7(), Uuid::now_v7());
        let mut tx = store.begin_write().await.unwrap();
        let first = vec![
            NewEvent::message_created(message, MessageRole::User, None),
            NewEvent::run_status(run, RunStatus::Queued).unwrap(),
        ];
        tx.append(&found, first).await.unwrap();
        let second = vec![NewEvent::run_status(run, RunStatus::Running).unwrap()];
        tx.append(&found, second).await.unwrap();
        let committed = store.commit(tx).await.unwrap();
        let mut tx = store.begin_write().await.unwrap();
        let third = vec![NewEvent::message_created(
            Uuid::now_v7(),
            MessageRole::Assistant,
            Some(run),
        )];
        tx.append(&found, third).await.unwrap();
        let later = store.commit(tx).await.unwrap();

        let all: Vec<_> = committed.iter().chain(&later).collect();
        let cursors: Vec<Cursor> = all.iter().map(|e| e.cursor).collect();
        let expected: Vec<Cursor> = (before + 1..=before + 4).map(Cursor).collect();
        assert_eq!(cursors, expected);
        let stored = rows(&store, found.id).await;
        assert_eq!(stored.len() as i64, before + 4);
        for (row, sent) in stored[before as usize..].iter().zip(&all) {
            assert_eq!(row.seq, sent.cursor.0);
            assert_eq!(row.kind, sent.kind.as_str());
            assert_eq!(row.run_id, sent.run_id);
            assert_eq!(row.tenant, found.tenant);
            assert_eq!(row.created_at, sent.at);
            assert_eq!(row.payload, serde_json::to_value(&sent.body).unwrap());
        }
        let head = conversation::Entity::find_by_id(found.id)
            .one(store.db())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(head.event_seq, before + 4);
        std::fs::remove_dir_all(dir).ok();
    }

    fn audit_of(run: &run::Model) -> run_audit::ActiveModel {
        run_audit::Model {
            run_id: run.id,
            tenant: run.tenant.clone(),
            conversation_id: run.conversation_id,
            status: "COMPLETED".into(),
            end_cause: "NATURAL".into(),
            steps: 1,
            input_tokens: 0,
            output_tokens: 0,
            cost_usd: 0.0,
            active_ms: 0,
            recoveries: 0,
            ended_at: 0,
        }
        .into_active_model()
    }

    async fn audited<C: sea_orm::ConnectionTrait>(db: &C, run: &run::Model) -> bool {
        run_audit::Entity::find_by_id(run.id)
            .one(db)
            .await
            .unwrap()
            .is_some()
    }

    /// A deferred insert is sent with the transaction's next append, or
    /// before its commit when none follows, and is gone with a transaction
    /// rolled back.
    #[tokio::test]
    async fn a_deferred_insert_goes_with_the_next_append_or_the_commit() {
        let (store, dir) = temp_store().await;
        let (appended, committed, rolled_back) = (
            queued_run(&store).await,
            queued_run(&store).await,
            queued_run(&store).await,
        );
        let mut tx = store.begin_write().await.unwrap();
        tx.defer_insert(audit_of(&appended));
        assert!(!audited(&*tx, &appended).await, "not before the append");
        let log = Log {
            id: appended.conversation_id,
            tenant: "acme",
        };
        let new = vec![NewEvent::run_status(appended.id, RunStatus::Running).unwrap()];
        tx.append(log, new).await.unwrap();
        assert!(audited(&*tx, &appended).await, "with the append");
        tx.defer_insert(audit_of(&committed));
        store.commit(tx).await.unwrap();
        assert!(audited(store.db(), &committed).await, "before the commit");

        let tx = store.begin_write().await.unwrap();
        tx.defer_insert(audit_of(&rolled_back));
        drop(tx);
        assert!(!audited(store.db(), &rolled_back).await, "rolled back");
        std::fs::remove_dir_all(dir).ok();
    }

    /// An append to a conversation that is not there is `NotFound` and
    /// stores nothing.
    #[tokio::test]
    async fn an_append_to_no_conversation_stores_nothing() {
        let (store, dir) = temp_store().await;
        let missing = Uuid::now_v7();
        let mut tx = store.begin_write().await.unwrap();
        let log = Log {
            id: missing,
            tenant: "acme",
        };
        let new = vec![NewEvent::message_created(
            Uuid::now_v7(),
            MessageRole::User,
            None,
        )];
        let err = tx.append(log, new).await.unwrap_err();
        assert!(matches!(err, Error::NotFound), "{err:?}");
        store.commit(tx).await.unwrap();
        assert!(rows(&store, missing).await.is_empty());
        std::fs::remove_dir_all(dir).ok();
    }
}
