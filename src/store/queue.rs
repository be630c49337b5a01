//! The run queue: claim, lease renewal, and recovery of runs whose worker
//! is gone. A claim is one statement; every later write of the worker is
//! fenced by the epoch the claim gave it (see `store::runs`).

use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::Expr;
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseBackend, EntityTrait, IdenStatic, Iterable, QueryFilter,
    QueryOrder, QuerySelect, Statement, Value,
};

use uuid::Uuid;

use super::clock;
use super::commit::{self, Begun, Lease, Log, WriteTx, Writes};
use super::entities::{run, run_audit};
use super::reads::Claimable;
use super::{Result, Store};
use crate::domain::event::NewEvent;
use crate::domain::run::{EndCause, RunError, RunInput, RunStatus, transition};
use crate::domain::time::now_millis;
use crate::failpoints;

/// How many runs a claim may take: `free` for this process, and at most
/// `per_tenant` of one tenant running at once over every process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slots {
    pub free: usize,
    pub per_tenant: Option<usize>,
}

impl From<usize> for Slots {
    fn from(free: usize) -> Slots {
        Slots {
            free,
            per_tenant: None,
        }
    }
}

/// Claims up to `slots.free` runs that may run now: queued (or due for a
/// retry), and not behind an unended earlier run of their conversation (by
/// `seq`), so at most one run of a conversation at a time.
///
/// Tenants take turns: each candidate's turn is the number of its tenant's
/// runs running now plus its place among its tenant's candidates, and the
/// lowest turns go first, so a tenant with a flood of runs queued (or
/// running) gets the next free slot only after every other tenant with
/// fewer under way; with `per_tenant`, no turn past it is taken at all.
/// Within a turn, the one that has been ready longest goes first: a run
/// becomes ready when it is queued or when the run before it ends, so a
/// conversation with a long queue takes its turn after the others that
/// were waiting, round-robin, and never holds them up. Returns them with
/// their new leases, in one statement. On PostgreSQL concurrent claimers
/// skip each other's rows.
pub async fn claim(
    store: &Store,
    owner: &str,
    lease_ms: i64,
    slots: impl Into<Slots>,
) -> Result<Vec<run::Model>> {
    let tx = store.begin_write().await?;
    let claimed = claim_in(&*tx, owner, lease_ms, slots.into()).await?;
    if claimed.is_empty() || overtaken(&tx, &claimed).await? {
        tx.rollback().await?;
        return Ok(Vec::new());
    }
    store.commit(tx).await?;
    Ok(claimed)
}

/// Whether a run this claim took is behind an unended earlier run of its
/// conversation after all. On PostgreSQL the claim statement reads what
/// was committed when it began, so a run re-queued ahead of one it takes
/// (`requeue`) while it ran is not in what it read; this second statement,
/// under the conversation locks the claim holds, sees it, and the claim is
/// rolled back (the next wake-up claims in order). On SQLite a write
/// transaction reads everything committed before it.
async fn overtaken(tx: &WriteTx, claimed: &[run::Model]) -> Result<bool> {
    if tx.get_database_backend() != DatabaseBackend::Postgres {
        return Ok(false);
    }
    let ids = claimed
        .iter()
        .map(|r| format!("'{}'", r.id))
        .collect::<Vec<_>>()
        .join(", ");
    let sql = format!(
        "SELECT r.id FROM runs r WHERE r.id IN ({ids}) AND {}",
        Claimable::behind_unended()
    );
    let found = tx
        .query_one_raw(Statement::from_string(DatabaseBackend::Postgres, sql))
        .await?;
    if found.is_some() {
        tracing::info!("a run was re-queued ahead of a claimed one; claiming again");
    }
    Ok(found.is_some())
}

/// A claimed run, already started when its claim could be its first commit.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub run: run::Model,
    pub begun: Option<Begun>,
}

/// The dispatcher's claim, which is also each claimed run's first commit:
/// the start of every run it takes (`commit::start`: an interrupted attempt
/// closed, the assistant message, the text part, `run.started`) commits
/// with the claim, and the `after_claim` failpoint aborts before that
/// commit. Should starting one of them fail, the claim commits alone
/// instead, and each worker starts its run in a commit of its own.
///
/// On PostgreSQL the claim also locks the claimed runs' conversations,
/// skipping a run whose conversation another transaction holds, as it
/// skips a run another claim holds: every other write locks a
/// conversation before its runs, and a claim that locked a run, then
/// waited for its conversation, could deadlock with one of them. A run
/// skipped so is claimed at the next wake-up or poll.
pub async fn take(
    store: &Store,
    owner: &str,
    lease_ms: i64,
    slots: impl Into<Slots>,
) -> Result<Vec<Claimed>> {
    let slots = slots.into();
    match claim_and_start(store, owner, lease_ms, slots).await {
        Ok(taken) => return Ok(taken),
        // One run that cannot be started must not hold up the others: the
        // claim commits alone, and each worker starts its own run (and ends
        // the one that cannot start, as it would anyway).
        Err(err) => tracing::warn!(error = %err, "starting runs with their claim failed"),
    }
    let claimed = claim(store, owner, lease_ms, slots).await?;
    Ok(claimed
        .into_iter()
        .map(|run| Claimed { run, begun: None })
        .collect())
}

/// The claim and the start of every run it takes, in one transaction. An
/// empty or failed one is rolled back at once, not on drop: a dropped
/// transaction keeps its PostgreSQL locks until its connection is next
/// used, and the claim then tried alone would skip the runs it locked.
async fn claim_and_start(
    store: &Store,
    owner: &str,
    lease_ms: i64,
    slots: Slots,
) -> Result<Vec<Claimed>> {
    let mut tx = store.begin_write().await?;
    let (claimed, started) = match start_claimed(&mut tx, owner, lease_ms, slots).await {
        Ok(taken) if !taken.0.is_empty() => taken,
        Ok(_) => {
            tx.rollback().await?;
            return Ok(Vec::new());
        }
        Err(err) => {
            if let Err(rollback) = tx.rollback().await {
                tracing::warn!(error = %rollback, "rolling back a failed claim failed");
            }
            return Err(err);
        }
    };
    failpoints::hit("after_claim");
    let committed = store.commit(tx).await?;
    Ok(claimed
        .into_iter()
        .zip(started)
        .map(|(run, (message_id, first))| Claimed {
            begun: Some(Begun::new(run.clone(), message_id, first, &committed)),
            run,
        })
        .collect())
}

/// The claim, then `commit::start` of each run it took, in `tx`.
async fn start_claimed(
    tx: &mut WriteTx,
    owner: &str,
    lease_ms: i64,
    slots: Slots,
) -> Result<(Vec<run::Model>, Vec<(Uuid, commit::FirstStep)>)> {
    let claimed = claim_in(&**tx, owner, lease_ms, slots).await?;
    if claimed.is_empty() || overtaken(tx, &claimed).await? {
        return Ok((Vec::new(), Vec::new()));
    }
    let mut started = Vec::with_capacity(claimed.len());
    for row in &claimed {
        let (mut events, mut writes) = (Vec::new(), Writes::default());
        started.push(commit::start(tx, &mut writes, row, &mut events).await?);
        let log = Log {
            id: row.conversation_id,
            tenant: &row.tenant,
        };
        tx.append_after(writes, log, events).await?;
    }
    Ok((claimed, started))
}

/// The claim statement, in a write transaction. On PostgreSQL it locks the
/// runs it takes and their conversations, skipping a run another claim
/// holds or whose conversation another transaction holds, never waiting.
/// A run so skipped stays locked until the claim's transaction ends
/// (PostgreSQL keeps the locks of rows a `SKIP LOCKED` passed over): a
/// write on it waits those few milliseconds, never the other way round.
async fn claim_in<C: ConnectionTrait>(
    db: &C,
    owner: &str,
    lease_ms: i64,
    slots: Slots,
) -> Result<Vec<run::Model>> {
    let limit = slots.free;
    let now = now_millis();
    let backend = db.get_database_backend();
    let mut n = 0;
    let mut param = || {
        n += 1;
        match backend {
            DatabaseBackend::Postgres => format!("${n}"),
            _ => "?".to_owned(),
        }
    };
    // A conversation's lock is `NO KEY UPDATE`, as the event append's
    // update of its row takes: it leaves the key-share locks of rows
    // inserted elsewhere that refer to the conversation alone.
    let (join, skip_locked) = match backend {
        DatabaseBackend::Postgres => (
            " JOIN conversations c ON c.id = r.conversation_id",
            " FOR UPDATE OF r SKIP LOCKED FOR NO KEY UPDATE OF c SKIP LOCKED",
        ),
        _ => ("", ""),
    };
    // Named columns, not `*`: sqlx's SQLite driver keeps the column list it
    // saw when it first prepared a statement, and a `*` that grew under it
    // (a migration on another connection) reads past that list. Qualified,
    // not quoted: a connection whose schema predates a migration would
    // compile a quoted name it does not know yet as a string literal
    // (SQLite's double-quoted strings), where an unknown qualified column
    // makes SQLite read the schema again and prepare anew.
    let columns = run::Column::iter()
        .map(|c| format!("runs.{}", c.as_str()))
        .collect::<Vec<_>>()
        .join(", ");
    let (p_owner, p_claimed, p_started, p_due) = (param(), param(), param(), param());
    // The lease runs out on the database's clock (`store::clock`).
    let expires = format!("{} + {lease_ms}", clock::now_sql(backend));
    let Claimable {
        condition,
        ready_since,
    } = Claimable::sql(backend, &p_due);
    // The candidates with their readiness (`ready`), then each one's turn
    // in its tenant (`turn`), in derived tables: PostgreSQL locks no row of
    // a query level that has a window function, and this leaves the level
    // that locks `r` without one.
    // The level that locks `r` checks its status itself: PostgreSQL
    // re-reads a row a concurrent claim changed only against this level's
    // conditions, and the derived tables' would let it lock (and count
    // against the limit) a run another claim took meanwhile.
    let capped = match slots.per_tenant {
        Some(cap) => format!(" AND t.turn <= {cap}"),
        None => String::new(),
    };
    let sql = format!(
        "UPDATE runs SET status = 'RUNNING', lease_owner = {p_owner}, \
         lease_epoch = lease_epoch + 1, lease_expires_at = {expires}, \
         claimed_at = {p_claimed}, started_at = COALESCE(started_at, {p_started}), \
         next_attempt_at = NULL, attempt = CASE WHEN attempt = 0 THEN 1 ELSE attempt END \
         WHERE status IN ('QUEUED', 'RETRY_PENDING') AND id IN (\
           SELECT r.id FROM runs r{join} JOIN (\
             SELECT c.id, c.ready, c.seq, \
               (SELECT COUNT(*) FROM runs a WHERE a.tenant = c.tenant AND a.status = 'RUNNING') \
               + ROW_NUMBER() OVER (PARTITION BY c.tenant ORDER BY c.ready, c.seq, c.id) AS turn \
             FROM (SELECT r.id, r.tenant, r.seq, {ready_since} AS ready \
                   FROM runs r WHERE {condition}) c\
           ) t ON t.id = r.id WHERE r.status IN ('QUEUED', 'RETRY_PENDING'){capped} \
           ORDER BY t.turn, t.ready, t.seq, r.id \
           LIMIT {limit}{skip_locked}) \
         RETURNING {columns}"
    );
    let values: Vec<Value> = vec![owner.into(), now.into(), now.into(), now.into()];
    let mut claimed = run::Entity::find()
        .from_raw_sql(Statement::from_sql_and_values(backend, sql, values))
        .all(db)
        .await?;
    claimed.sort_by_key(|r| r.id);
    Ok(claimed)
}

/// What a heartbeat learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heartbeat {
    Renewed {
        cancel_requested: bool,
    },
    /// Another claim holds the run now, or it ended: stop without writing.
    Lost,
}

/// Renews a lease, on the database's clock, while the run is still
/// `RUNNING` under its epoch: one that ran out while the database could not
/// be reached is renewed too, since nobody took it. A sweep that listed it
/// as stale meanwhile checks again under the run's lock (`recover`) and
/// leaves a renewed lease alone; one that took it first moved the run on,
/// and this lease is lost.
pub async fn heartbeat(store: &Store, lease: &Lease, lease_ms: i64) -> Result<Heartbeat> {
    let _lane = store.write_lane().await;
    let backend = store.db().get_database_backend();
    let rows = run::Entity::update_many()
        .col_expr(
            run::Column::LeaseExpiresAt,
            Expr::cust(format!("{} + {lease_ms}", clock::now_sql(backend))),
        )
        .filter(run::Column::Id.eq(lease.run_id))
        .filter(run::Column::LeaseEpoch.eq(lease.epoch))
        .filter(run::Column::Status.eq(RunStatus::Running.as_str()))
        .exec_with_returning(store.db())
        .await?;
    Ok(match rows.first() {
        Some(row) => Heartbeat::Renewed {
            cancel_requested: row.cancel_requested,
        },
        None => Heartbeat::Lost,
    })
}

/// Which running runs to recover.
#[derive(Debug, Clone, Copy)]
pub enum Reclaim<'a> {
    /// Leases that ran out on the database's clock, but for those of the
    /// runs this process is executing (`executing`): their heartbeat
    /// renews them once the database answers again.
    Expired { executing: &'a [Uuid] },
    /// Every running run: only for a process that holds the database's
    /// exclusive lock (embedded SQLite), so that nobody else can hold one.
    All,
    /// Runs an earlier process with this instance id held, whose leases
    /// nobody renewed since `Reclaim::held_by` listed them.
    Unrenewed(&'a [Held]),
}

/// A running run's lease as a start-up listing saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub run_id: uuid::Uuid,
    pub epoch: i64,
    pub expires_at: Option<i64>,
}

/// The runs held under `owner` whose cancellation was requested. Workers
/// look every second, so that a cancel asked of another process reaches
/// them whether or not a notification does (SQLite has none, and a
/// PostgreSQL listener may be reconnecting).
pub async fn cancels_requested(store: &Store, owner: &str) -> Result<Vec<Uuid>> {
    Ok(run::Entity::find()
        .select_only()
        .column(run::Column::Id)
        .filter(run::Column::Status.eq(RunStatus::Running.as_str()))
        .filter(run::Column::LeaseOwner.eq(owner))
        .filter(run::Column::CancelRequested.eq(true))
        .into_tuple()
        .all(store.db())
        .await?)
}

/// The leases held under `owner` now. A process restarted with the same
/// instance id lists them, waits longer than a heartbeat, and reclaims
/// with `Reclaim::Unrenewed` only those still unchanged: a live process
/// with the same id (an overlapping deploy) keeps what it renews.
pub async fn held_by(store: &Store, owner: &str) -> Result<Vec<Held>> {
    let rows = run::Entity::find()
        .filter(run::Column::Status.eq(RunStatus::Running.as_str()))
        .filter(run::Column::LeaseOwner.eq(owner))
        .order_by_asc(run::Column::Id)
        .all(store.db())
        .await?;
    Ok(rows
        .into_iter()
        .map(|r| Held {
            run_id: r.id,
            epoch: r.lease_epoch,
            expires_at: r.lease_expires_at,
        })
        .collect())
}

/// Re-queues running runs whose worker is gone, counting each against the
/// crash retry budget; a run over budget ends `FAILED` with
/// `RECOVERY_LIMIT`. Returns how many runs were recovered or ended.
pub async fn reclaim(store: &Store, which: Reclaim<'_>, budget: u32) -> Result<usize> {
    let backend = store.db().get_database_backend();
    let mut query = run::Entity::find()
        .filter(run::Column::Status.eq(RunStatus::Running.as_str()))
        .order_by_asc(run::Column::Id)
        .limit(200);
    query = match which {
        Reclaim::Expired { executing } => query
            .filter(sea_orm::sea_query::ExprTrait::lt(
                Expr::col(run::Column::LeaseExpiresAt),
                clock::now_expr(backend),
            ))
            .filter(run::Column::Id.is_not_in(executing.iter().copied())),
        Reclaim::All => query,
        Reclaim::Unrenewed(held) => {
            query.filter(run::Column::Id.is_in(held.iter().map(|h| h.run_id)))
        }
    };
    let stale = query.all(store.db()).await?;
    let mut count = 0;
    for row in stale {
        if recover(store, row, Some(which), Some(budget)).await? {
            count += 1;
        }
    }
    Ok(count)
}

/// Gives back a run whose execution here failed while this process still
/// holds its lease: it is re-queued from what was committed now, not when
/// the lease runs out. With a `budget` the failure counts against it, as a
/// lost worker does; without one (the database went away, which says
/// nothing about the run) it does not. False when the lease had moved on.
pub async fn abandon(store: &Store, lease: &Lease, budget: Option<u32>) -> Result<bool> {
    let Some(row) = run::Entity::find_by_id(lease.run_id)
        .one(store.db())
        .await?
    else {
        return Ok(false);
    };
    if row.lease_epoch != lease.epoch {
        return Ok(false);
    }
    recover(store, row, None, budget).await
}

/// Whether a run's lease, read under the run's lock, may be taken: the
/// listing is stale by then, and a lease renewed since must stay.
fn still_stale(row: &run::Model, which: Reclaim<'_>, now: i64) -> bool {
    match which {
        Reclaim::Expired { .. } => row.lease_expires_at.is_some_and(|at| at < now),
        Reclaim::All => true,
        Reclaim::Unrenewed(held) => held.iter().any(|h| {
            h.run_id == row.id && h.epoch == row.lease_epoch && h.expires_at == row.lease_expires_at
        }),
    }
}

/// Recovers one run if it still holds the lease we saw and that lease is
/// still stale (`which` listing found it; `None`: this process gives up a
/// lease it holds); false if it moved or was renewed. The recovery counts
/// against `budget`, and a run over it ends `FAILED`; without one it does
/// not count. A run asked to stop ends instead, with the cause asked.
async fn recover(
    store: &Store,
    seen: run::Model,
    which: Option<Reclaim<'_>>,
    budget: Option<u32>,
) -> Result<bool> {
    let mut tx = store.begin_write().await?;
    let conversation = tx
        .lock_conversation(seen.conversation_id, &seen.tenant)
        .await?;
    let Some(row) = run::Entity::find_by_id(seen.id)
        .filter(run::Column::LeaseEpoch.eq(seen.lease_epoch))
        .filter(run::Column::Status.eq(RunStatus::Running.as_str()))
        .lock_exclusive()
        .one(&*tx)
        .await?
    else {
        return Ok(false);
    };
    // The database's time: leases are on its clock.
    let now = clock::now(&*tx).await?;
    if which.is_some_and(|which| !still_stale(&row, which, now)) {
        return Ok(false);
    }
    let held_until = row.lease_expires_at.unwrap_or(now).min(now);
    let active_ms = row.active_ms + (held_until - row.claimed_at.unwrap_or(held_until)).max(0);
    let counted = budget.is_some();
    let events = if row.cancel_requested {
        // Asked to stop (`cancelRun`, or a message that interrupts it) and
        // its worker is gone: it ends now, as the worker would have ended it.
        tracing::info!(run_id = %row.id, "ending a cancelled run whose worker is gone");
        let mut ended = row;
        ended.active_ms = active_ms;
        commit::end(&tx, ended, EndCause::Cancelled, None).await?
    } else if budget.is_some_and(|budget| row.recoveries as u32 >= budget) {
        tracing::warn!(run_id = %row.id, recoveries = row.recoveries, "recovery budget exhausted");
        let error = RunError {
            code: EndCause::RecoveryLimit.as_str().to_owned(),
            message: format!(
                "the run lost its worker {} times; giving up",
                row.recoveries + 1
            ),
            http_status: None,
            retryable: false,
        };
        let mut ended = row;
        ended.active_ms = active_ms;
        commit::end(&tx, ended, EndCause::RecoveryLimit, Some(error)).await?
    } else {
        tracing::info!(run_id = %row.id, epoch = row.lease_epoch, "re-queueing a run whose worker is gone");
        let to = transition(RunStatus::Running, RunInput::Requeue)
            .map_err(|e| super::Error::Conflict(e.to_string()))?;
        let mut events = commit::abandon_open_parts(&tx, row.id).await?;
        let run_id = row.id;
        let recoveries = row.recoveries + i32::from(counted);
        let mut active: run::ActiveModel = row.into();
        active.status = sea_orm::ActiveValue::Set(to.as_str().to_owned());
        active.recoveries = sea_orm::ActiveValue::Set(recoveries);
        active.active_ms = sea_orm::ActiveValue::Set(active_ms);
        commit::clear_lease(&mut active);
        sea_orm::ActiveModelTrait::update(active, &*tx).await?;
        events.extend(NewEvent::run_status(run_id, to));
        events
    };
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(true)
}

/// Queues again a run that failed `RECOVERY_LIMIT` (its worker kept dying):
/// an operator's decision, for any tenant's run, audited with the ending it
/// undoes. Its recoveries start again from zero, and it goes on from its
/// committed steps. Refused for any other run, and when a later run of its
/// conversation has started: the conversation would no longer read in its
/// runs' order.
pub async fn requeue(
    store: &Store,
    operator: commit::Operator<'_>,
    run_id: Uuid,
    note: &str,
) -> Result<run::Model> {
    let mut tx = store.begin_write().await?;
    let found = run::Entity::find_by_id(run_id)
        .one(&*tx)
        .await?
        .ok_or(super::Error::NotFound)?;
    let conversation = tx
        .lock_conversation(found.conversation_id, &found.tenant)
        .await?;
    let row = run::Entity::find_by_id(run_id)
        .lock_exclusive()
        .one(&*tx)
        .await?
        .ok_or(super::Error::NotFound)?;
    if row.end_cause.as_deref() != Some(EndCause::RecoveryLimit.as_str()) {
        return Err(super::Error::Conflict(format!(
            "only a run that failed RECOVERY_LIMIT can be queued again; this one is {}{}",
            row.status,
            row.end_cause
                .as_deref()
                .map(|cause| format!(" ({cause})"))
                .unwrap_or_default()
        )));
    }
    let from: RunStatus = super::parse_stored(&row.status, "run status")?;
    let to =
        transition(from, RunInput::Reopen).map_err(|e| super::Error::Conflict(e.to_string()))?;
    let later_started = run::Entity::find()
        .filter(run::Column::ConversationId.eq(row.conversation_id))
        .filter(run::Column::Seq.gt(row.seq))
        .filter(
            sea_orm::Condition::any()
                .add(run::Column::Status.ne(RunStatus::Queued.as_str()))
                .add(run::Column::StartedAt.is_not_null()),
        )
        .one(&*tx)
        .await?;
    if later_started.is_some() {
        return Err(super::Error::Conflict(
            "a later run of this conversation has started; queueing this one again would \
             take the conversation out of its runs' order"
                .into(),
        ));
    }
    let audit = run_audit::Entity::find_by_id(run_id).one(&*tx).await?;
    let before = serde_json::json!({
        "status": row.status,
        "endCause": row.end_cause,
        "error": row.error,
        "endedAt": row.ended_at,
        "recoveries": row.recoveries,
        "audit": audit.map(|a| serde_json::json!({
            "status": a.status,
            "endCause": a.end_cause,
            "steps": a.steps,
            "activeMs": a.active_ms,
            "endedAt": a.ended_at,
        })),
    });
    // The ending it undoes is kept in the operator's record; the run's
    // audit row is written again when it ends.
    run_audit::Entity::delete_by_id(run_id).exec(&*tx).await?;
    let mut active: run::ActiveModel = row.clone().into();
    active.status = Set(to.as_str().to_owned());
    active.end_cause = Set(None);
    active.end_reason = Set(None);
    active.error = Set(None);
    active.ended_at = Set(None);
    active.recoveries = Set(0);
    active.cancel_requested = Set(false);
    active.cancel_cause = Set(None);
    let requeued = sea_orm::ActiveModelTrait::update(active, &*tx).await?;
    commit::record_operator_action(
        &tx,
        commit::OperatorAction {
            operator,
            action: "requeueRun",
            tenant: &row.tenant,
            run_id: Some(run_id),
            tool_call_id: None,
            note,
            detail: serde_json::json!({ "before": before, "after": { "status": to.as_str() } }),
        },
    )
    .await?;
    tx.append(
        &conversation,
        NewEvent::run_status(run_id, to).into_iter().collect(),
    )
    .await?;
    store.commit(tx).await?;
    Ok(requeued)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::test_support::{conversation, queued_run, send_hi, temp_store};

    /// Claims one run, as a worker with one slot would, and ends it; the
    /// run claimed.
    async fn claim_one_and_end_it(store: &Store) -> run::Model {
        let mut claimed = claim(store, "w", 60_000, 1).await.unwrap();
        assert_eq!(claimed.len(), 1, "one run to claim");
        reclaim(store, Reclaim::All, 0).await.unwrap();
        claimed.remove(0)
    }

    #[tokio::test]
    async fn runs_are_numbered_in_their_conversation_and_claimed_in_turn() {
        let (store, dir) = temp_store().await;
        let long = conversation(&store).await;
        let mut long_runs = Vec::new();
        for _ in 0..4 {
            long_runs.push(send_hi(&store, long.id, 1).await);
        }
        let seqs: Vec<i64> = long_runs.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [1, 2, 3, 4]);
        let mut others = Vec::new();
        for _ in 0..3 {
            others.push(queued_run(&store).await);
        }
        assert!(others.iter().all(|r| r.seq == 1));

        // The long conversation's first run was ready first; its second
        // became ready when the first ended, after the others had queued.
        let mut order = Vec::new();
        for _ in 0..5 {
            order.push(claim_one_and_end_it(&store).await.id);
        }
        let expected: Vec<Uuid> = [long_runs[0].id]
            .into_iter()
            .chain(others.iter().map(|r| r.id))
            .chain([long_runs[1].id])
            .collect();
        assert_eq!(order, expected);
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn a_lease_renewed_after_the_sweep_listed_it_is_not_recovered() {
        let (store, dir) = temp_store().await;
        let queued = queued_run(&store).await;
        let claimed = claim(&store, "w", 60_000, 1).await.unwrap().remove(0);
        // The sweep listed the run while its lease had run out (by its own
        // clock); the worker renewed it before the sweep took the lock.
        let mut listed = claimed.clone();
        listed.lease_expires_at = Some(now_millis() - 1);
        assert!(
            !recover(
                &store,
                listed,
                Some(Reclaim::Expired { executing: &[] }),
                Some(3)
            )
            .await
            .unwrap()
        );
        let row = run::Entity::find_by_id(queued.id)
            .one(store.db())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.status, "RUNNING");
        assert_eq!(row.lease_epoch, claimed.lease_epoch);
        assert_eq!(row.recoveries, 0);
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn on_sqlite_a_claim_is_its_runs_first_commit() {
        let (store, dir) = temp_store().await;
        let queued = queued_run(&store).await;
        let before = store.write_transactions();
        let taken = take(&store, "w", 60_000, 4).await.unwrap();
        assert_eq!(store.write_transactions() - before, 1, "one transaction");
        let [
            Claimed {
                run,
                begun: Some(begun),
            },
        ] = taken.as_slice()
        else {
            panic!("one run, started: {taken:?}");
        };
        assert_eq!((run.id, run.lease_epoch), (queued.id, 1));
        let log = crate::store::reads::events_after(
            store.db(),
            "acme",
            run.conversation_id,
            crate::domain::cursor::Cursor::START,
            100,
        )
        .await
        .unwrap();
        let kinds: Vec<&str> = log.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "message.created",
                "run.queued",
                "message.created",
                "part.added",
                "run.started"
            ]
        );
        assert_eq!(begun.cursor, log.last().unwrap().cursor);
        assert!(begun.part().is_some());
        // A run claimed again is started with its claim too, in its one
        // assistant message.
        let lease = Lease::of(run);
        crate::store::runs::release(&store, &lease, &[])
            .await
            .unwrap();
        let again = take(&store, "w", 60_000, 4).await.unwrap();
        let [
            Claimed {
                begun: Some(resumed),
                ..
            },
        ] = again.as_slice()
        else {
            panic!("one run, started: {again:?}");
        };
        assert_eq!(resumed.message_id, begun.message_id);
        assert_eq!(resumed.run.lease_epoch, 3);
        assert!(resumed.part().is_some());
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn a_claim_reads_the_batch_a_run_left_unfinished() {
        use crate::store::entities::part;
        use crate::store::test_support::requested_call;

        let (store, dir) = temp_store().await;
        // The run asked for a tool after saying "ok", and lost its worker.
        let (lease, call) = requested_call(&store, "effect").await;
        crate::store::runs::release(&store, &lease, &[])
            .await
            .unwrap();
        let statements = store.statements();
        let taken = take(&store, "w", 60_000, 4).await.unwrap();
        let statements = store.statements() - statements;
        let [
            Claimed {
                begun: Some(begun), ..
            },
        ] = taken.as_slice()
        else {
            panic!("one run, started: {taken:?}");
        };
        // No text part while the batch is unfinished: the batch comes with
        // the claim, and the worker reads nothing more before it runs it.
        let commit::FirstStep::FinishBatch(batch) = &begun.first else {
            panic!("the step's batch: {begun:?}");
        };
        assert_eq!(batch.said, "ok");
        let ids: Vec<_> = batch.calls.iter().map(|c| c.id).collect();
        assert_eq!(ids, [call.id]);
        let called_from = part::Entity::find_by_id(call.part_id)
            .one(store.db())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(begun.message_id, called_from.message_id);
        assert_eq!(
            statements, 6,
            "the claim, the run's streaming parts, its reply message, the step's calls, \
             their step's text, the append"
        );
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn a_run_that_cannot_start_holds_up_no_other() {
        use crate::store::entities::part;
        use crate::store::test_support::{conversation, send_hi};
        use sea_orm::sea_query::Expr;

        let (store, dir) = temp_store().await;
        let broken = queued_run(&store).await;
        take(&store, "w", 60_000, 4).await.unwrap();
        // Its worker died mid-stream, and the part it left open is one this
        // build cannot read. (Its empty text part became the reclaim's
        // notice: the run's only part.)
        reclaim(&store, Reclaim::All, 3).await.unwrap();
        part::Entity::update_many()
            .col_expr(part::Column::Kind, Expr::value("HOLOGRAM"))
            .col_expr(part::Column::State, Expr::value("STREAMING"))
            .filter(part::Column::RunId.eq(broken.id))
            .exec(store.db())
            .await
            .unwrap();
        let other = conversation(&store).await;
        let healthy = send_hi(&store, other.id, 3).await;

        let taken = take(&store, "w", 60_000, 4).await.unwrap();
        let ids: Vec<_> = taken
            .iter()
            .map(|c| (c.run.id, c.begun.is_none()))
            .collect();
        assert_eq!(ids, [(broken.id, true), (healthy.id, true)]);
        let lease = |id| Lease::of(&taken.iter().find(|c| c.run.id == id).unwrap().run);
        crate::store::runs::begin(&store, &lease(healthy.id))
            .await
            .unwrap();
        let refused = crate::store::runs::begin(&store, &lease(broken.id)).await;
        assert!(
            matches!(refused, Err(crate::store::Error::Corrupt(_))),
            "{refused:?}"
        );
        std::fs::remove_dir_all(dir).ok();
    }
}
