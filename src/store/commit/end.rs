//! A step's end and a run's end inside a caller's fenced transaction: the
//! step's events, the run's final status with its audit row, and everything
//! the run left open closed (streaming parts, unfinished tool calls,
//! pending interactions).

use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::{Alias, Expr, Query};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, DatabaseBackend, DbErr, EntityTrait,
    FromQueryResult, QueryFilter, QueryOrder, QueryResult, QuerySelect, QueryTrait,
};
use uuid::Uuid;

use super::calls::{close_unfinished, unfinished};
use super::parts::{part_event_for, reply_message, show_at_end, utf16_len};
use super::pending::{cancel_pending, pending_where};
use super::steer;
use super::{Lease, WriteTx, fenced_run};
use crate::domain::event::{EventBody, EventKind, NewEvent};
use crate::domain::run::{EndCause, RunError, RunInput, RunStatus, Usage, transition};
use crate::domain::time::now_millis;
use crate::domain::{PartKind, PartState};
use crate::store::entities::{interaction, part, run, run_audit};
use crate::store::{Error, Result, parse_stored};

/// How a run ends, with what it used.
#[derive(Debug, Clone)]
pub struct Ending {
    pub cause: EndCause,
    pub error: Option<RunError>,
    /// Which limit or stop condition ended the run, in words.
    pub reason: Option<String>,
    pub usage: Usage,
    pub steps: i32,
}

/// Writes the usage and steps an ending reports onto the run's row.
pub(in crate::store) fn apply_usage(row: &mut run::Model, ending: &Ending) {
    row.steps = ending.steps;
    row.input_tokens = ending.usage.input_tokens;
    row.output_tokens = ending.usage.output_tokens;
    row.cost_usd = ending.usage.cost_usd;
}

/// `run.checkpointed` when a step ends, and `usage.updated` when the run's
/// usage moved from what `row` has.
pub(in crate::store) fn step_events(
    row: &run::Model,
    usage: Usage,
    step_ended: bool,
) -> Vec<NewEvent> {
    let mut events = Vec::new();
    if step_ended {
        events.push(NewEvent {
            kind: EventKind::RunCheckpointed,
            run_id: Some(row.id),
            body: EventBody::Run {
                status: RunStatus::Running,
            },
        });
    }
    if usage.input_tokens != row.input_tokens || usage.output_tokens != row.output_tokens {
        events.push(NewEvent {
            kind: EventKind::UsageUpdated,
            run_id: Some(row.id),
            body: EventBody::Usage { usage },
        });
    }
    events
}

/// Ends a run inside `tx`: status by cause, the run's open parts closed, the
/// audit row, and the final event. Used by workers and by the API alike.
pub(in crate::store) async fn end(
    tx: &WriteTx,
    row: run::Model,
    cause: EndCause,
    error: Option<RunError>,
) -> Result<Vec<NewEvent>> {
    let (events, _) = close_streaming_parts(tx, row.id, false).await?;
    end_closed(tx, row, None, cause, error, None, events).await
}

/// `end` for a caller that has closed the run's parts itself. Every tool
/// call still without a result gets one here, and every message steered
/// into the run that it did not answer is settled (`steer::settle`). A run
/// cancelled because a message interrupted it ends `INTERRUPTED`, whoever
/// commits its end. `fenced` is what the caller's fence asked already
/// (`fence_for_end`); `None`: ask what is open, and take it that a run may
/// be queued behind this one. When one may, this process's workers are
/// woken once the end commits, to claim it.
pub(in crate::store) async fn end_closed(
    tx: &WriteTx,
    row: run::Model,
    fenced: Option<EndFence>,
    cause: EndCause,
    error: Option<RunError>,
    reason: Option<String>,
    mut events: Vec<NewEvent>,
) -> Result<Vec<NewEvent>> {
    let cause = match (cause, row.cancel_cause.as_deref()) {
        (EndCause::Cancelled, Some(asked)) => parse_stored(asked, "cancel cause")?,
        _ => cause,
    };
    let (open, queued_behind) = match fenced {
        Some(fenced) => (fenced.open, fenced.queued_behind),
        None => (anything_open(tx, row.id).await?, true),
    };
    if queued_behind {
        tx.wake_workers_on_commit();
    }
    // What the caller deferred (its parts' final texts) is written before
    // anything below reads or changes parts and messages; a plain end
    // (most) does neither, and it goes with the append.
    if open || error.is_some() || steer::has_steered(&row) {
        tx.flush_deferred().await?;
    }
    if open {
        events.extend(close_unfinished(tx, &row).await?);
        events.extend(cancel_pending(tx, &row).await?);
    }
    // A failure is shown where the reply is read, not only on the run.
    if let Some(error) = &error
        && let Some(message_id) = reply_message(tx, &row).await?
    {
        events.push(show_at_end(tx, &row, message_id, PartKind::Error, &error.message).await?);
    }
    let from: RunStatus = parse_stored(&row.status, "run status")?;
    let to = transition(from, RunInput::End(cause)).map_err(|e| Error::Conflict(e.to_string()))?;
    let now = now_millis();
    let active_ms = if from == RunStatus::Running {
        row.active_ms + (now - row.claimed_at.unwrap_or(now)).max(0)
    } else {
        row.active_ms
    };
    // Nothing in a write reads it back: it goes with the next append.
    tx.defer_insert(run_audit::ActiveModel {
        run_id: Set(row.id),
        tenant: Set(row.tenant.clone()),
        conversation_id: Set(row.conversation_id),
        status: Set(to.as_str().to_owned()),
        end_cause: Set(cause.as_str().to_owned()),
        steps: Set(row.steps),
        input_tokens: Set(row.input_tokens),
        output_tokens: Set(row.output_tokens),
        cost_usd: Set(row.cost_usd),
        active_ms: Set(active_ms),
        recoveries: Set(row.recoveries),
        ended_at: Set(now),
    });
    let run_id = row.id;
    let error = match error {
        Some(error) => {
            Some(serde_json::to_value(&error).map_err(|e| Error::Corrupt(e.to_string()))?)
        }
        None => None,
    };
    let mut active: run::ActiveModel = row.clone().into();
    // Everything the caller changed on the row is written too.
    active.steps = Set(row.steps);
    active.input_tokens = Set(row.input_tokens);
    active.output_tokens = Set(row.output_tokens);
    active.cost_usd = Set(row.cost_usd);
    active.status = Set(to.as_str().to_owned());
    active.end_cause = Set(Some(cause.as_str().to_owned()));
    active.end_reason = Set(reason);
    active.error = Set(error);
    active.ended_at = Set(Some(now));
    active.next_attempt_at = Set(None);
    active.active_ms = Set(active_ms);
    clear_lease(&mut active);
    active.update(&**tx).await?;
    tx.count_run_end(to, cause);
    events.extend(NewEvent::run_status(run_id, to));
    steer::settle(tx, &row, cause, &mut events).await?;
    Ok(events)
}

/// Whether the run has a tool call without a result or a pending
/// interaction, in one query: a run that has neither (most) is ended
/// without looking for them one by one.
async fn anything_open(tx: &WriteTx, run_id: Uuid) -> Result<bool> {
    let query = Query::select().expr(open_in(run_id)).to_owned();
    let row = tx
        .query_one_raw(tx.get_database_backend().build(&query))
        .await?
        .ok_or(Error::NotFound)?;
    Ok(row.try_get_by_index::<bool>(0)?)
}

/// `anything_open`'s question, as an expression.
fn open_in(run_id: Uuid) -> Expr {
    use sea_orm::sea_query::ExprTrait as _;
    let one = || Expr::value(1);
    let calls = unfinished(run_id).select_only().expr(one()).into_query();
    let pending = pending_where(interaction::Column::RunId.eq(run_id))
        .select_only()
        .expr(one())
        .into_query();
    Expr::exists(calls).or(Expr::exists(pending))
}

/// What the fence of a commit that ends a run asked beside the run's row
/// (`fence_for_end`), for `end_closed`.
#[derive(Debug, Clone, Copy)]
pub(in crate::store) struct EndFence {
    /// Whether the run has a tool call without a result or a pending
    /// interaction (`anything_open`).
    open: bool,
    /// Whether a later run of its conversation is queued, to be claimed
    /// once this one ends.
    queued_behind: bool,
}

/// The fence (`commit::fence`) of a commit that ends the run, asking in
/// the same query whether anything is open and whether a run is queued
/// behind it, for `end_closed`: a statement fewer on every run's last
/// commit, and no claim after it when nothing waits.
pub(in crate::store) async fn fence_for_end(
    tx: &WriteTx,
    lease: &Lease,
) -> Result<(run::Model, EndFence)> {
    /// The run's row and the answers beside it.
    struct Fenced(run::Model, EndFence);
    impl FromQueryResult for Fenced {
        fn from_query_result(row: &QueryResult, pre: &str) -> std::result::Result<Self, DbErr> {
            Ok(Fenced(
                run::Model::from_query_result(row, pre)?,
                EndFence {
                    open: row.try_get(pre, OPEN)?,
                    queued_behind: row.try_get(pre, QUEUED_BEHIND)?,
                },
            ))
        }
    }
    use sea_orm::sea_query::ExprTrait as _;
    const OPEN: &str = "anything_open";
    const QUEUED_BEHIND: &str = "queued_behind";
    let later = Alias::new("later");
    let behind = Query::select()
        .expr(Expr::value(1))
        .from_as(run::Entity, later.clone())
        .and_where(
            Expr::col((later.clone(), run::Column::ConversationId))
                .equals((run::Entity, run::Column::ConversationId)),
        )
        .and_where(
            Expr::col((later.clone(), run::Column::Seq))
                .gt(Expr::col((run::Entity, run::Column::Seq))),
        )
        .and_where(Expr::col((later, run::Column::Status)).eq(RunStatus::Queued.as_str()))
        .to_owned();
    // On PostgreSQL the conversation is locked in a statement of its own,
    // before: a statement reads what others committed before it began, and
    // one that waited for the lock would miss a run queued meanwhile (its
    // `run.queued` came while this run still held the conversation back).
    if tx.get_database_backend() == DatabaseBackend::Postgres {
        tx.lock_conversation(lease.conversation_id, &lease.tenant)
            .await?;
    }
    let found = fenced_run(tx.get_database_backend(), lease)
        .expr_as(open_in(lease.run_id), OPEN)
        .expr_as(Expr::exists(behind), QUEUED_BEHIND)
        .into_model::<Fenced>()
        .one(&**tx)
        .await?;
    match found {
        Some(Fenced(row, fenced)) => Ok((row, fenced)),
        None => Err(super::lapsed_or_fenced(tx, lease).await?),
    }
}

/// No worker holds the run any more; the epoch moves on so a late writer of
/// the last claim is fenced.
pub(in crate::store) fn clear_lease(active: &mut run::ActiveModel) {
    let epoch = match &active.lease_epoch {
        sea_orm::ActiveValue::Set(v) | sea_orm::ActiveValue::Unchanged(v) => *v,
        sea_orm::ActiveValue::NotSet => 0,
    };
    active.lease_epoch = Set(epoch + 1);
    active.lease_owner = Set(None);
    active.lease_expires_at = Set(None);
    active.claimed_at = Set(None);
}

/// Parts of this run still streaming belong to an attempt that was cut off:
/// they are closed, marked abandoned (never sent to the model again), and a
/// `NOTICE` follows them.
pub(in crate::store) async fn abandon_open_parts(
    tx: &WriteTx,
    run_id: Uuid,
) -> Result<Vec<NewEvent>> {
    abandon_open_parts_with(tx, run_id, INTERRUPTED_NOTICE).await
}

const INTERRUPTED_NOTICE: &str = "The response above was interrupted and is starting again.";

pub(in crate::store) async fn abandon_open_parts_with(
    tx: &WriteTx,
    run_id: Uuid,
    notice: &str,
) -> Result<Vec<NewEvent>> {
    let (mut events, last) = close_streaming_parts(tx, run_id, true).await?;
    let Some(message_id) = last else {
        return Ok(events);
    };
    let run = run::Entity::find_by_id(run_id)
        .one(&**tx)
        .await?
        .ok_or(Error::NotFound)?;
    // An attempt cut off before its first token leaves no empty text part:
    // that part becomes the notice.
    events.push(show_at_end(tx, &run, message_id, PartKind::Notice, notice).await?);
    Ok(events)
}

/// Closes the run's streaming parts as they are (`abandoned` when their
/// attempt was cut off). Returns their events and the message of the last.
async fn close_streaming_parts(
    tx: &WriteTx,
    run_id: Uuid,
    abandoned: bool,
) -> Result<(Vec<NewEvent>, Option<Uuid>)> {
    let mut events = Vec::new();
    let mut last_message = None;
    for row in streaming_parts(tx, run_id).await? {
        let length = row.text.as_deref().map(utf16_len);
        last_message = Some(row.message_id);
        let mut active: part::ActiveModel = row.into();
        active.state = Set(PartState::Done.as_str().to_owned());
        if abandoned {
            active.abandoned = Set(true);
        }
        active.updated_at = Set(now_millis());
        let saved = active.update(&**tx).await?;
        events.push(part_event_for(
            EventKind::PartUpdated,
            run_id,
            &saved,
            length,
        )?);
    }
    Ok((events, last_message))
}

async fn streaming_parts(tx: &WriteTx, run_id: Uuid) -> Result<Vec<part::Model>> {
    Ok(part::Entity::find()
        .filter(part::Column::RunId.eq(run_id))
        .filter(part::Column::State.eq(PartState::Streaming.as_str()))
        .order_by_asc(part::Column::MessageId)
        .order_by_asc(part::Column::Idx)
        .all(&**tx)
        .await?)
}
