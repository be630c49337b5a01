//! A worker's commits for the run it holds. Each is one transaction that
//! locks the conversation, checks the lease epoch (the fence), writes, and
//! appends its events. A worker whose lease was taken over gets
//! `Error::Fenced` and writes nothing.

use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::Expr;
use sea_orm::{ActiveModelTrait, ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};
use uuid::Uuid;

use super::entities::{message, part, run, run_audit, summary, tool_call};
use super::{Error, Result, Store, WriteTx, parse_stored};
use crate::domain::cursor::Cursor;
use crate::domain::event::{EventBody, EventKind, NewEvent};
use crate::domain::run::{EndCause, RunError, RunInput, RunStatus, Usage, transition};
use crate::domain::time::now_millis;
use crate::domain::{MessageRole, PartKind, PartState};

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

/// A part the worker streams into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenPart {
    pub id: Uuid,
    pub message_id: Uuid,
    pub index: i32,
    pub kind: PartKind,
}

/// A streamed part with its text so far, and data to keep with it (a
/// reasoning block's signature).
#[derive(Debug, Clone, PartialEq)]
pub struct PartText {
    pub part: OpenPart,
    pub text: String,
    pub data: Option<serde_json::Value>,
}

/// What the worker knows after its first commit of a claim.
#[derive(Debug, Clone)]
pub struct Begun {
    pub run: run::Model,
    /// The run's assistant message, which all its steps write into.
    pub message_id: Uuid,
    /// The text part the next inference streams into; none while a batch of
    /// tool calls from an earlier claim is still to be finished.
    pub part: Option<OpenPart>,
    /// The newest persisted cursor, for live deltas that follow it.
    pub cursor: Cursor,
}

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
pub(super) fn apply_usage(row: &mut run::Model, ending: &Ending) {
    row.steps = ending.steps;
    row.input_tokens = ending.usage.input_tokens;
    row.output_tokens = ending.usage.output_tokens;
    row.cost_usd = ending.usage.cost_usd;
}

/// Text length as clients count it: UTF-16 code units.
pub fn utf16_len(text: &str) -> i64 {
    text.encode_utf16().count() as i64
}

pub(super) async fn open(
    store: &Store,
    lease: &Lease,
) -> Result<(WriteTx, super::entities::conversation::Model, run::Model)> {
    let tx = store.begin_write().await?;
    let conversation = tx
        .lock_conversation(lease.conversation_id, &lease.tenant)
        .await?;
    let row = run::Entity::find_by_id(lease.run_id)
        .filter(run::Column::LeaseEpoch.eq(lease.epoch))
        .filter(run::Column::Status.eq(RunStatus::Running.as_str()))
        .lock_exclusive()
        .one(&*tx)
        .await?
        .ok_or(Error::Fenced)?;
    Ok((tx, conversation, row))
}

/// The first commit of a claim: closes what a cut-off attempt left open
/// (its text stays visible, `DONE`, followed by a `NOTICE`), makes sure the
/// run has its assistant message, opens a text part, and says `run.started`.
pub async fn begin(store: &Store, lease: &Lease) -> Result<Begun> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    // A run's first claim has epoch 1 (every claim and every release adds
    // one): it has no message and no parts yet, so there is nothing to look
    // up or recover.
    let first_claim = row.lease_epoch == 1;
    let mut events = if first_claim {
        Vec::new()
    } else {
        abandon_open_parts(&tx, row.id).await?
    };
    let existing = if first_claim {
        None
    } else {
        message::Entity::find()
            .filter(message::Column::RunId.eq(row.id))
            .filter(message::Column::Role.eq(MessageRole::Assistant.as_str()))
            .one(&*tx)
            .await?
    };
    // A batch of tool calls in the current step: the step is finished
    // before the model is asked anything, so no text part yet.
    let batch_pending = !first_claim
        && tool_call::Entity::find()
            .filter(tool_call::Column::RunId.eq(row.id))
            .filter(tool_call::Column::Step.eq(row.steps))
            .one(&*tx)
            .await?
            .is_some();
    let (message_id, index) = match existing {
        Some(existing) => (existing.id, next_index(&tx, existing.id).await?),
        None => {
            let id = Uuid::now_v7();
            message::ActiveModel {
                id: Set(id),
                conversation_id: Set(row.conversation_id),
                tenant: Set(row.tenant.clone()),
                role: Set(MessageRole::Assistant.as_str().to_owned()),
                run_id: Set(Some(row.id)),
                client_message_id: Set(None),
                created_at: Set(now_millis()),
            }
            .insert(&*tx)
            .await?;
            events.push(NewEvent::message_created(
                id,
                MessageRole::Assistant,
                Some(row.id),
            ));
            (id, 0)
        }
    };
    let part = if batch_pending {
        None
    } else {
        Some(open_text_part(&tx, &row, message_id, index, &mut events).await?)
    };
    events.extend(NewEvent::run_status(row.id, RunStatus::Running));
    tx.append(&conversation, events).await?;
    let committed = store.commit(tx).await?;
    let cursor = committed.last().map_or(Cursor::START, |e| e.cursor);
    Ok(Begun {
        run: row,
        message_id,
        part,
        cursor,
    })
}

/// The step's end when it asked for tools and every call has its result:
/// the step is counted, usage recorded, `run.checkpointed` said, the next
/// model request starts at attempt 1, and the next step's text part opens.
pub async fn end_step(store: &Store, lease: &Lease, usage: Usage) -> Result<(OpenPart, Cursor)> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    let message_id = assistant_message(&tx, &row).await?;
    let mut events = step_events(&row, usage, true);
    let mut active: run::ActiveModel = row.clone().into();
    active.steps = Set(row.steps + 1);
    active.attempt = Set(1);
    active.input_tokens = Set(usage.input_tokens);
    active.output_tokens = Set(usage.output_tokens);
    active.cost_usd = Set(usage.cost_usd);
    let row = active.update(&*tx).await?;
    let index = next_index(&tx, message_id).await?;
    let opened = open_text_part(&tx, &row, message_id, index, &mut events).await?;
    tx.append(&conversation, events).await?;
    let committed = store.commit(tx).await?;
    Ok((opened, committed.last().map_or(Cursor::START, |e| e.cursor)))
}

/// Opens the empty streaming text part a step's inference writes into.
async fn open_text_part(
    tx: &WriteTx,
    row: &run::Model,
    message_id: Uuid,
    index: i32,
    events: &mut Vec<NewEvent>,
) -> Result<OpenPart> {
    let part = insert_part(
        tx,
        row,
        message_id,
        index,
        PartContent::streaming(PartKind::Text),
    )
    .await?;
    events.push(part_event(EventKind::PartAdded, row, &part, Some(0))?);
    Ok(OpenPart {
        id: part.id,
        message_id,
        index,
        kind: PartKind::Text,
    })
}

/// `run.checkpointed` when a step ends, and `usage.updated` when the run's
/// usage moved from what `row` has.
pub(super) fn step_events(row: &run::Model, usage: Usage, step_ended: bool) -> Vec<NewEvent> {
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

/// The text a run's step committed (its kept text parts, in order).
pub async fn step_text(store: &Store, run_id: Uuid, step: i32) -> Result<String> {
    let parts = part::Entity::find()
        .filter(part::Column::RunId.eq(run_id))
        .filter(part::Column::Step.eq(step))
        .filter(part::Column::Kind.eq(PartKind::Text.as_str()))
        .filter(part::Column::Abandoned.eq(false))
        .order_by_asc(part::Column::Idx)
        .all(store.db())
        .await?;
    Ok(parts.into_iter().filter_map(|p| p.text).collect())
}

/// The run's assistant message (made by its first `begin`).
pub(super) async fn assistant_message(tx: &WriteTx, row: &run::Model) -> Result<Uuid> {
    message::Entity::find()
        .filter(message::Column::RunId.eq(row.id))
        .filter(message::Column::Role.eq(MessageRole::Assistant.as_str()))
        .one(&**tx)
        .await?
        .map(|m| m.id)
        .ok_or(Error::NotFound)
}

/// Persists the streamed text of these parts so far, each with
/// `part.updated`.
pub async fn checkpoint(store: &Store, lease: &Lease, parts: &[PartText]) -> Result<Cursor> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    let events = save_parts(&tx, &row, parts, PartState::Streaming).await?;
    tx.append(&conversation, events).await?;
    let committed = store.commit(tx).await?;
    Ok(committed.last().map_or(Cursor::START, |e| e.cursor))
}

/// Writes the parts' texts in `state`, returning their `part.updated`.
pub(super) async fn save_parts(
    tx: &WriteTx,
    row: &run::Model,
    parts: &[PartText],
    state: PartState,
) -> Result<Vec<NewEvent>> {
    let mut events = Vec::with_capacity(parts.len());
    for streamed in parts {
        let saved = update_part(tx, streamed, state).await?;
        events.push(part_event(
            EventKind::PartUpdated,
            row,
            &saved,
            Some(utf16_len(&streamed.text)),
        )?);
    }
    Ok(events)
}

/// Opens another streaming part in the run's message. With `before`, the new
/// part takes that part's place and `before` moves one down (reasoning that
/// starts before any text is shown before the text).
pub async fn open_part(
    store: &Store,
    lease: &Lease,
    message_id: Uuid,
    kind: PartKind,
    before: Option<&OpenPart>,
) -> Result<(OpenPart, Option<OpenPart>, Cursor)> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    let mut events = Vec::new();
    let (index, moved) = match before {
        Some(existing) => {
            let moved = part::Entity::update_many()
                .col_expr(part::Column::Idx, Expr::value(existing.index + 1))
                .filter(part::Column::Id.eq(existing.id))
                .exec_with_returning(&*tx)
                .await?
                .pop()
                .ok_or(Error::NotFound)?;
            let length = moved.text.as_deref().map(utf16_len);
            events.push(part_event(EventKind::PartUpdated, &row, &moved, length)?);
            let moved = OpenPart {
                index: moved.idx,
                ..*existing
            };
            (existing.index, Some(moved))
        }
        None => (next_index(&tx, message_id).await?, None),
    };
    let added = insert_part(&tx, &row, message_id, index, PartContent::streaming(kind)).await?;
    events.push(part_event(EventKind::PartAdded, &row, &added, Some(0))?);
    tx.append(&conversation, events).await?;
    let committed = store.commit(tx).await?;
    let cursor = committed.last().map_or(Cursor::START, |e| e.cursor);
    let opened = OpenPart {
        id: added.id,
        message_id,
        index,
        kind,
    };
    Ok((opened, moved, cursor))
}

/// The last commit of a run: the parts' final texts, the step's
/// checkpoint, usage, the final status and the audit row, in one
/// transaction.
pub async fn finish(
    store: &Store,
    lease: &Lease,
    parts: &[PartText],
    ending: Ending,
) -> Result<()> {
    let (mut tx, conversation, mut row) = open(store, lease).await?;
    let mut events = save_parts(&tx, &row, parts, PartState::Done).await?;
    events.extend(step_events(&row, ending.usage, true));
    apply_usage(&mut row, &ending);
    // The worker's open parts are all closed just above.
    let events = end_closed(&tx, row, ending.cause, ending.error, ending.reason, events).await?;
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(())
}

/// Gives the run back to the queue (shutdown): the streamed text is kept,
/// closed as an abandoned attempt, and another worker starts the step again.
pub async fn release(store: &Store, lease: &Lease, parts: &[PartText]) -> Result<()> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    save_parts(&tx, &row, parts, PartState::Streaming).await?;
    let mut events = abandon_open_parts(&tx, row.id).await?;
    let to = transition(RunStatus::Running, RunInput::Requeue)
        .map_err(|e| Error::Conflict(e.to_string()))?;
    let now = now_millis();
    let run_id = row.id;
    let active_ms = row.active_ms + (now - row.claimed_at.unwrap_or(now)).max(0);
    let mut active: run::ActiveModel = row.into();
    active.status = Set(to.as_str().to_owned());
    active.active_ms = Set(active_ms);
    clear_lease(&mut active);
    active.update(&*tx).await?;
    events.extend(NewEvent::run_status(run_id, to));
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(())
}

/// A summary of older messages, made by the run's model.
#[derive(Debug, Clone)]
pub struct Compaction {
    pub through_message_id: Uuid,
    pub messages_compacted: i32,
    pub text: String,
    pub input_tokens: i64,
    pub output_tokens: i64,
}

/// Commits a summary that replaces older messages in the model's history,
/// with its usage added to the run's, `context.compacted` and
/// `usage.updated`. Returns the run's usage now.
pub async fn record_compaction(
    store: &Store,
    lease: &Lease,
    compaction: Compaction,
    cost_usd: f64,
) -> Result<(Usage, Cursor)> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    summary::ActiveModel {
        id: Set(Uuid::now_v7()),
        conversation_id: Set(row.conversation_id),
        tenant: Set(row.tenant.clone()),
        run_id: Set(row.id),
        through_message_id: Set(compaction.through_message_id),
        messages_compacted: Set(compaction.messages_compacted),
        text: Set(compaction.text),
        input_tokens: Set(compaction.input_tokens),
        output_tokens: Set(compaction.output_tokens),
        created_at: Set(now_millis()),
    }
    .insert(&*tx)
    .await?;
    let usage = Usage {
        input_tokens: row.input_tokens + compaction.input_tokens,
        output_tokens: row.output_tokens + compaction.output_tokens,
        cost_usd,
    };
    let run_id = row.id;
    let mut active: run::ActiveModel = row.into();
    active.input_tokens = Set(usage.input_tokens);
    active.output_tokens = Set(usage.output_tokens);
    active.cost_usd = Set(usage.cost_usd);
    active.update(&*tx).await?;
    let events = vec![
        NewEvent {
            kind: EventKind::ContextCompacted,
            run_id: Some(run_id),
            body: EventBody::ContextCompacted {
                messages_compacted: i64::from(compaction.messages_compacted),
            },
        },
        NewEvent {
            kind: EventKind::UsageUpdated,
            run_id: Some(run_id),
            body: EventBody::Usage { usage },
        },
    ];
    tx.append(&conversation, events).await?;
    let committed = store.commit(tx).await?;
    Ok((usage, committed.last().map_or(Cursor::START, |e| e.cursor)))
}

/// A failed attempt of a model request, to be tried again.
#[derive(Debug, Clone)]
pub struct RetryAfterFailure {
    /// The attempt that failed, from 1.
    pub failed_attempt: i32,
    pub max_attempts: i32,
    pub delay_ms: i64,
    pub error: RunError,
    /// The run's usage with what the failed attempt reported: tokens a
    /// provider counted are paid for even when the answer was lost.
    pub usage: Usage,
}

/// Parks the run in `RETRY_PENDING` until its next attempt is due: the failed
/// attempt's text stays visible, closed and never sent to the model again,
/// with a `NOTICE` after it; `run.retry-pending` says when and why. No
/// worker holds the run meanwhile, so a crash loses nothing: any worker
/// claims it once it is due.
pub async fn schedule_retry(
    store: &Store,
    lease: &Lease,
    parts: &[PartText],
    retry: RetryAfterFailure,
) -> Result<i64> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    if row.cancel_requested {
        return Err(Error::CancelRequested);
    }
    save_parts(&tx, &row, parts, PartState::Streaming).await?;
    let notice = format!(
        "The model request failed ({}); attempt {} of {} follows.",
        retry.error.message,
        retry.failed_attempt + 1,
        retry.max_attempts
    );
    let mut events = abandon_open_parts_with(&tx, row.id, &notice).await?;
    events.extend(step_events(&row, retry.usage, false));
    let to = transition(RunStatus::Running, RunInput::ScheduleRetry)
        .map_err(|e| Error::Conflict(e.to_string()))?;
    let now = now_millis();
    let next_attempt_at = now.saturating_add(retry.delay_ms);
    let run_id = row.id;
    // The wait counts towards the run's time, like running does.
    let active_ms = row.active_ms + (now - row.claimed_at.unwrap_or(now)).max(0) + retry.delay_ms;
    let error_json =
        serde_json::to_value(&retry.error).map_err(|e| Error::Corrupt(e.to_string()))?;
    let mut active: run::ActiveModel = row.into();
    active.status = Set(to.as_str().to_owned());
    active.attempt = Set(retry.failed_attempt + 1);
    active.next_attempt_at = Set(Some(next_attempt_at));
    active.error = Set(Some(error_json));
    active.active_ms = Set(active_ms);
    active.input_tokens = Set(retry.usage.input_tokens);
    active.output_tokens = Set(retry.usage.output_tokens);
    active.cost_usd = Set(retry.usage.cost_usd);
    clear_lease(&mut active);
    active.update(&*tx).await?;
    events.push(NewEvent {
        kind: EventKind::RunRetryPending,
        run_id: Some(run_id),
        body: EventBody::RetryPending {
            attempt: retry.failed_attempt,
            max_attempts: retry.max_attempts,
            delay_ms: retry.delay_ms,
            next_attempt_at,
            error: retry.error,
        },
    });
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(next_attempt_at)
}

/// Ends a run inside `tx`: status by cause, the run's open parts closed, the
/// audit row, and the final event. Used by workers and by the API alike.
pub async fn end(
    tx: &WriteTx,
    row: run::Model,
    cause: EndCause,
    error: Option<RunError>,
) -> Result<Vec<NewEvent>> {
    let (events, _) = close_streaming_parts(tx, row.id, false).await?;
    end_closed(tx, row, cause, error, None, events).await
}

/// `end` for a caller that has closed the run's parts itself. Every tool
/// call still without a result gets one here.
pub(super) async fn end_closed(
    tx: &WriteTx,
    row: run::Model,
    cause: EndCause,
    error: Option<RunError>,
    reason: Option<String>,
    mut events: Vec<NewEvent>,
) -> Result<Vec<NewEvent>> {
    events.extend(super::tool_calls::close_unfinished(tx, &row).await?);
    events.extend(super::interactions::cancel_pending(tx, &row).await?);
    let from: RunStatus = parse_stored(&row.status, "run status")?;
    let to = transition(from, RunInput::End(cause)).map_err(|e| Error::Conflict(e.to_string()))?;
    let now = now_millis();
    let active_ms = if from == RunStatus::Running {
        row.active_ms + (now - row.claimed_at.unwrap_or(now)).max(0)
    } else {
        row.active_ms
    };
    run_audit::ActiveModel {
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
    }
    .insert(&**tx)
    .await?;
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
    events.extend(NewEvent::run_status(run_id, to));
    Ok(events)
}

/// No worker holds the run any more; the epoch moves on so a late writer of
/// the last claim is fenced.
pub(crate) fn clear_lease(active: &mut run::ActiveModel) {
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
pub(crate) async fn abandon_open_parts(tx: &WriteTx, run_id: Uuid) -> Result<Vec<NewEvent>> {
    abandon_open_parts_with(tx, run_id, INTERRUPTED_NOTICE).await
}

const INTERRUPTED_NOTICE: &str = "The response above was interrupted and is starting again.";

async fn abandon_open_parts_with(
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
    let content = PartContent {
        kind: PartKind::Notice,
        state: PartState::Done,
        text: Some(notice),
        data: None,
    };
    let notice = add_part(tx, &run, message_id, content).await?;
    events.push(part_event(
        EventKind::PartAdded,
        &run,
        &notice,
        notice.text.as_deref().map(utf16_len),
    )?);
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

/// Marks a part changed (its tool call moved on) and says `part.updated`.
pub(super) async fn part_touched(
    tx: &WriteTx,
    run: &run::Model,
    part_id: Uuid,
) -> Result<NewEvent> {
    let touched = part::Entity::update_many()
        .col_expr(part::Column::UpdatedAt, Expr::value(now_millis()))
        .filter(part::Column::Id.eq(part_id))
        .exec_with_returning(&**tx)
        .await?
        .pop()
        .ok_or(Error::NotFound)?;
    part_event(EventKind::PartUpdated, run, &touched, None)
}

/// What a new part holds.
pub(super) struct PartContent<'a> {
    pub kind: PartKind,
    pub state: PartState,
    pub text: Option<&'a str>,
    pub data: Option<serde_json::Value>,
}

impl PartContent<'static> {
    /// An empty part that text will stream into.
    fn streaming(kind: PartKind) -> Self {
        PartContent {
            kind,
            state: PartState::Streaming,
            text: Some(""),
            data: None,
        }
    }

    /// A finished part with data only (a tool call, a question, an
    /// approval).
    pub(super) fn data(kind: PartKind, data: serde_json::Value) -> Self {
        PartContent {
            kind,
            state: PartState::Done,
            text: None,
            data: Some(data),
        }
    }
}

/// Adds a part after the message's last one.
pub(super) async fn add_part(
    tx: &WriteTx,
    run: &run::Model,
    message_id: Uuid,
    content: PartContent<'_>,
) -> Result<part::Model> {
    let index = next_index(tx, message_id).await?;
    insert_part(tx, run, message_id, index, content).await
}

async fn next_index(tx: &WriteTx, message_id: Uuid) -> Result<i32> {
    let last: Option<part::Model> = part::Entity::find()
        .filter(part::Column::MessageId.eq(message_id))
        .order_by_desc(part::Column::Idx)
        .one(&**tx)
        .await?;
    Ok(last.map_or(0, |p| p.idx + 1))
}

async fn insert_part(
    tx: &WriteTx,
    run: &run::Model,
    message_id: Uuid,
    index: i32,
    content: PartContent<'_>,
) -> Result<part::Model> {
    let now = now_millis();
    Ok(part::ActiveModel {
        id: Set(Uuid::now_v7()),
        message_id: Set(message_id),
        conversation_id: Set(run.conversation_id),
        tenant: Set(run.tenant.clone()),
        idx: Set(index),
        kind: Set(content.kind.as_str().to_owned()),
        state: Set(content.state.as_str().to_owned()),
        text: Set(content.text.map(str::to_owned)),
        data: Set(content.data),
        created_at: Set(now),
        updated_at: Set(now),
        run_id: Set(Some(run.id)),
        abandoned: Set(false),
        step: Set(run.steps),
    }
    .insert(&**tx)
    .await?)
}

async fn update_part(tx: &WriteTx, streamed: &PartText, state: PartState) -> Result<part::Model> {
    let mut update = part::Entity::update_many()
        .col_expr(part::Column::Text, Expr::value(streamed.text.as_str()))
        .col_expr(part::Column::State, Expr::value(state.as_str()))
        .col_expr(part::Column::UpdatedAt, Expr::value(now_millis()));
    if let Some(data) = &streamed.data {
        update = update.col_expr(part::Column::Data, Expr::value(data.clone()));
    }
    update
        .filter(part::Column::Id.eq(streamed.part.id))
        .exec_with_returning(&**tx)
        .await?
        .pop()
        .ok_or(Error::NotFound)
}

pub(super) fn part_event(
    kind: EventKind,
    run: &run::Model,
    part: &part::Model,
    text_length: Option<i64>,
) -> Result<NewEvent> {
    part_event_for(kind, run.id, part, text_length)
}

fn part_event_for(
    kind: EventKind,
    run_id: Uuid,
    part: &part::Model,
    text_length: Option<i64>,
) -> Result<NewEvent> {
    Ok(NewEvent {
        kind,
        run_id: Some(run_id),
        body: EventBody::Part {
            message_id: part.message_id,
            part_id: part.id,
            kind: parse_stored(&part.kind, "part kind")?,
            text_length,
        },
    })
}
