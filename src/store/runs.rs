//! A worker's commits for the run it holds. Each is one transaction that
//! locks the conversation, checks the lease epoch (the fence), writes, and
//! appends its events. A worker whose lease was taken over gets
//! `Error::Fenced` and writes nothing.

use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::Expr;
use sea_orm::{ActiveModelTrait, ColumnTrait, EntityTrait, QueryFilter};
use std::sync::Arc;

use uuid::Uuid;

use super::commit::{
    Begun, Ending, Finished, Lease, OpenPart, PartContent, PartText, WriteTx, Writes,
    abandon_open_parts, abandon_open_parts_with, apply_usage, clear_lease, end_closed, fence,
    fence_for_end, insert_part, join_steered, next_index, open, open_text_part, part_event,
    record_in, save_parts, save_parts_with_append, start, step_events, utf16_len,
};
use super::entities::{part, run, summary, tool_call};
use super::{Error, Result, Store};
use crate::domain::cursor::Cursor;
use crate::domain::event::{EventBody, EventKind, NewEvent};
use crate::domain::run::{RunError, RunInput, RunStatus, Usage, transition};
use crate::domain::time::{new_id, now_millis};
use crate::domain::tool_call::ToolCallStatus;
use crate::domain::{PartKind, PartState};

/// The first commit of a claim (where the claim did not start the run
/// itself, see `queue::take`): `commit::start` in a transaction of its own.
pub async fn begin(store: &Store, lease: &Lease) -> Result<Begun> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    let (mut events, mut writes) = (Vec::new(), Writes::default());
    let (message_id, first) = start(&tx, &mut writes, &row, &mut events).await?;
    tx.append_after(writes, &conversation, events).await?;
    let committed = store.commit(tx).await?;
    Ok(Begun::new(row, message_id, first, &committed))
}

/// The step's end when it asked for tools and every call has its result:
/// the step is counted, usage recorded, `run.checkpointed` said, the next
/// model request starts at attempt 1, messages steered into the run join it
/// (`run.steered`, and the reply goes on in a new message after them), and
/// the next step's text part opens. `finished`, the result of the batch's
/// last call, is recorded first in the same commit (a one-call batch's
/// result needs no commit of its own). `message_id` is the message the step
/// wrote into.
pub async fn end_step(
    store: &Store,
    lease: &Lease,
    message_id: Uuid,
    usage: Usage,
    finished: Option<&Finished>,
) -> Result<(OpenPart, Cursor)> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    let mut events = match finished {
        Some(finished) => record_in(&tx, &row, finished).await?.1,
        None => Vec::new(),
    };
    without_result(&tx, &row).await?;
    events.extend(step_events(&row, usage, true));
    let mut writes = Writes::default();
    // The next step's text part: first in the message after the steered
    // ones, else after the step's last part.
    let steered = join_steered(&tx, &mut writes, &row, &mut events).await?;
    let mut active: run::ActiveModel = row.clone().into();
    active.steps = Set(row.steps + 1);
    active.attempt = Set(1);
    active.input_tokens = Set(usage.input_tokens);
    active.output_tokens = Set(usage.output_tokens);
    active.cost_usd = Set(usage.cost_usd);
    let row = active.update(&*tx).await?;
    let (message_id, index) = match steered {
        Some(steered) => (steered, 0),
        None => (message_id, next_index(&tx, message_id).await?),
    };
    let opened = open_text_part(&tx, &mut writes, &row, message_id, index, &mut events)?;
    tx.append_after(writes, &conversation, events).await?;
    let committed = store.commit(tx).await?;
    Ok((opened, committed.last().map_or(Cursor::START, |e| e.cursor)))
}

/// A step never ends with a call that has no result (the model would read
/// one made up): a call of the step not finished is an internal error that
/// names it, and nothing is written.
async fn without_result(tx: &WriteTx, row: &run::Model) -> Result<()> {
    let unfinished = tool_call::Entity::find()
        .filter(tool_call::Column::RunId.eq(row.id))
        .filter(tool_call::Column::Step.eq(row.steps))
        .filter(tool_call::Column::Status.is_not_in([
            ToolCallStatus::Completed.as_str(),
            ToolCallStatus::Indeterminate.as_str(),
        ]))
        .one(&**tx)
        .await?;
    match unfinished {
        Some(call) => Err(Error::Corrupt(format!(
            "tool call {} ({}) is {} at the end of its step: it has no result",
            call.id, call.name, call.status
        ))),
        None => Ok(()),
    }
}

/// Persists the streamed text of these parts so far, each with
/// `part.updated`.
pub async fn checkpoint(store: &Store, lease: &Lease, parts: &[PartText]) -> Result<Cursor> {
    // Shared by the closure's calls (a group's, then perhaps its own).
    let (lease, parts) = (lease.clone(), Arc::<[PartText]>::from(parts));
    let ((), committed) = store
        .write(move |tx| {
            let (lease, parts) = (lease.clone(), parts.clone());
            Box::pin(async move {
                let row = fence(tx, &lease).await?;
                let events = save_parts(tx, &row, &parts, PartState::Streaming).await?;
                tx.append(&lease, events).await
            })
        })
        .await?;
    Ok(committed.last().map_or(Cursor::START, |e| e.cursor))
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
    // Shared by the closure's calls (a group's, then perhaps its own).
    let (lease, parts) = (lease.clone(), Arc::<[PartText]>::from(parts));
    store
        .write(move |tx| {
            let (lease, parts, ending) = (lease.clone(), parts.clone(), ending.clone());
            Box::pin(async move {
                let (mut row, fenced) = fence_for_end(tx, &lease).await?;
                // The parts' texts go with the append (`end_closed` writes
                // them first if it reads or changes parts).
                let mut events = save_parts_with_append(tx, &row, &parts, PartState::Done);
                events.extend(step_events(&row, ending.usage, true));
                apply_usage(&mut row, &ending);
                // The worker's open parts are all closed by the deferred
                // updates above (written before anything reads parts).
                let (cause, error, reason) = (ending.cause, ending.error, ending.reason);
                let events =
                    end_closed(tx, row, Some(fenced), cause, error, reason, events).await?;
                tx.append(&lease, events).await
            })
        })
        .await?;
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
        id: Set(new_id()),
        conversation_id: Set(row.conversation_id),
        tenant: Set(row.tenant.clone()),
        run_id: Set(row.id),
        through_message_id: Set(compaction.through_message_id),
        messages_compacted: Set(compaction.messages_compacted),
        text: Set(compaction.text),
        input_tokens: Set(compaction.input_tokens),
        output_tokens: Set(compaction.output_tokens),
        created_at: Set(now_millis()),
        run_seq: Set(row.seq),
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::store::entities::tool_call;
    use crate::store::test_support::{event_seq, kinds_after, requested_call, temp_store};
    use crate::store::tool_calls::{self, Outcome};

    /// A call of the step started (`EXECUTING`), and the message the step
    /// writes into.
    async fn started_call(store: &Store) -> (Lease, tool_call::Model, Uuid) {
        let (lease, call) = requested_call(store, "effect").await;
        tool_calls::start(store, &lease, call.id, false)
            .await
            .unwrap();
        let message_id = part::Entity::find_by_id(call.part_id)
            .one(store.db())
            .await
            .unwrap()
            .unwrap()
            .message_id;
        (lease, call, message_id)
    }

    #[tokio::test]
    async fn a_held_result_is_recorded_with_the_step_end_in_one_commit() {
        let (store, dir) = temp_store().await;
        let (lease, call, message_id) = started_call(&store).await;
        let before = event_seq(&store, lease.conversation_id).await;
        let writes = store.write_transactions();
        let finished = Finished {
            call_id: call.id,
            outcome: Outcome::Answered {
                succeeded: true,
                output: json!({ "published": true }),
                cut: false,
            },
            max_inline_bytes: 16384,
        };
        let (_, cursor) = end_step(
            &store,
            &lease,
            message_id,
            Usage::default(),
            Some(&finished),
        )
        .await
        .unwrap();
        assert_eq!(store.write_transactions(), writes + 1, "one commit");
        let call = tool_call::Entity::find_by_id(call.id)
            .one(store.db())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (call.status.as_str(), call.outcome.as_deref()),
            ("COMPLETED", Some("SUCCEEDED"))
        );
        assert_eq!(call.output, Some(json!({ "published": true })));
        let row = run::Entity::find_by_id(lease.run_id)
            .one(store.db())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.steps, 1, "the step is counted");
        let kinds = kinds_after(&store, lease.conversation_id, before).await;
        assert_eq!(
            kinds,
            [
                "tool.completed",
                "part.updated",
                "run.checkpointed",
                "part.added"
            ],
            "the result told before the step's end"
        );
        assert_eq!(cursor.0, before + kinds.len() as i64);
        std::fs::remove_dir_all(dir).ok();
    }

    /// A step whose call has no result does not end: the error names the
    /// call, and nothing is written (no made-up result for the model).
    #[tokio::test]
    async fn a_step_with_a_call_without_a_result_does_not_end() {
        let (store, dir) = temp_store().await;
        let (lease, call, message_id) = started_call(&store).await;
        let before = event_seq(&store, lease.conversation_id).await;
        let refused = end_step(&store, &lease, message_id, Usage::default(), None).await;
        let Err(Error::Corrupt(message)) = refused else {
            panic!("a typed internal error, not {refused:?}");
        };
        assert!(message.contains(&call.id.to_string()), "{message}");
        assert!(
            message.contains("effect") && message.contains("EXECUTING"),
            "{message}"
        );
        assert_eq!(event_seq(&store, lease.conversation_id).await, before);
        let row = run::Entity::find_by_id(lease.run_id)
            .one(store.db())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.steps, 0, "the step is not counted");
        std::fs::remove_dir_all(dir).ok();
    }
}
