//! A tool call's state change inside a caller's fenced transaction, checked
//! against the call's state machine and announced with its events.

use sea_orm::ActiveValue::Set;
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder,
    QuerySelect,
};
use serde_json::Value;
use uuid::Uuid;

use super::WriteTx;
use super::parts::part_touched;
use crate::domain::event::{EventBody, EventKind, NewEvent};
use crate::domain::time::now_millis;
use crate::domain::tool_call::{
    InlineOutput, ToolCallState, ToolCallStatus, ToolInput, ToolOutcome, closing_output,
    inline_output,
};
use crate::store::entities::{run, tool_call};
use crate::store::{Error, Result, parse_stored};

/// The calls of a run's step, in batch order.
pub async fn of_step<C: ConnectionTrait>(
    db: &C,
    run_id: Uuid,
    step: i32,
) -> Result<Vec<tool_call::Model>> {
    Ok(tool_call::Entity::find()
        .filter(tool_call::Column::RunId.eq(run_id))
        .filter(tool_call::Column::Step.eq(step))
        .order_by_asc(tool_call::Column::Idx)
        .all(db)
        .await?)
}

pub fn state_of(call: &tool_call::Model) -> Result<ToolCallState> {
    Ok(ToolCallState {
        status: parse_stored(&call.status, "tool call status")?,
        attempt: call.attempt.max(0) as u32,
        outcome: call
            .outcome
            .as_deref()
            .map(|o| parse_stored(o, "tool call outcome"))
            .transpose()?,
    })
}

/// `change` inside a caller's fenced transaction; returns the call and the
/// events to append.
pub(in crate::store) async fn change_in(
    tx: &WriteTx,
    row: &run::Model,
    call_id: Uuid,
    input: ToolInput,
    fill: impl FnOnce(&mut tool_call::ActiveModel, ToolCallState),
) -> Result<(tool_call::Model, Vec<NewEvent>)> {
    change_through_in(tx, row, call_id, &[input], fill).await
}

/// Applies `inputs` to the call one after another, each checked against
/// its state machine, and writes the state they lead to once (an allowed
/// call that starts at once goes from `AWAITING` through `REQUESTED` to
/// `EXECUTING` in one write). The event is the last input's.
pub(in crate::store) async fn change_through_in(
    tx: &WriteTx,
    row: &run::Model,
    call_id: Uuid,
    inputs: &[ToolInput],
    fill: impl FnOnce(&mut tool_call::ActiveModel, ToolCallState),
) -> Result<(tool_call::Model, Vec<NewEvent>)> {
    let call = tool_call::Entity::find_by_id(call_id)
        .filter(tool_call::Column::RunId.eq(row.id))
        .lock_exclusive()
        .one(&**tx)
        .await?
        .ok_or(Error::NotFound)?;
    let before = state_of(&call)?;
    let after = inputs.iter().try_fold(before, |state, &input| {
        state
            .apply(input)
            .map_err(|e| Error::Conflict(e.to_string()))
    })?;
    let mut events = Vec::new();
    // Waiting for a person and being allowed are told by the interaction's
    // own events.
    if !matches!(
        inputs.last(),
        None | Some(ToolInput::Await | ToolInput::Allow)
    ) {
        events.push(tool_event(event_for(after), row.id, call.id, &call.name));
    }
    let part_id = call.part_id;
    count_outcome(tx, &call.name, before, after);
    let mut active: tool_call::ActiveModel = call.into();
    set_state(&mut active, after);
    fill(&mut active, after);
    let saved = active.update(&**tx).await?;
    events.push(part_touched(tx, row, part_id).await?);
    Ok((saved, events))
}

/// What a started call came to: its result, to be committed alone
/// (`tool_calls::record`) or with the step's end (`runs::end_step`).
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub call_id: Uuid,
    pub outcome: Outcome,
    /// Outputs larger than this are kept whole aside, and cut inline.
    pub max_inline_bytes: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The tool answered, succeeded or failed, with this output; `cut`
    /// when it said more than was read, which marks the output truncated
    /// whatever its size.
    Answered {
        succeeded: bool,
        output: Value,
        cut: bool,
    },
    /// It may or may not have taken effect (`UNKNOWN`, once; the model is
    /// told to check). The output says what is known, if anything.
    Unknown(Option<Value>),
}

/// Records `finished` inside a caller's fenced transaction; returns the
/// call and the events to append.
pub(in crate::store) async fn record_in(
    tx: &WriteTx,
    row: &run::Model,
    finished: &Finished,
) -> Result<(tool_call::Model, Vec<NewEvent>)> {
    let id = finished.call_id;
    match &finished.outcome {
        Outcome::Answered {
            succeeded,
            output,
            cut,
        } => {
            let mut inline = inline_output(output, finished.max_inline_bytes);
            inline.truncated |= cut;
            let input = ToolInput::Finish {
                succeeded: *succeeded,
            };
            change_in(tx, row, id, input, |active, _| set_output(active, inline)).await
        }
        Outcome::Unknown(output) => {
            let input = ToolInput::Recover { replayable: false };
            change_in(tx, row, id, input, |active, state| {
                let output = output.clone().or_else(|| state.outcome.map(closing_output));
                active.output = Set(output);
            })
            .await
        }
    }
}

/// An output as the call keeps it: inline (cut when large) and whole.
pub(in crate::store) fn set_output(active: &mut tool_call::ActiveModel, inline: InlineOutput) {
    active.output = Set(Some(inline.inline));
    active.full_output = Set(inline.full);
    active.output_truncated = Set(inline.truncated);
}

/// A call that gets its outcome in this change is counted in the metrics.
fn count_outcome(tx: &WriteTx, tool: &str, before: ToolCallState, after: ToolCallState) {
    if before.outcome.is_none()
        && let Some(outcome) = after.outcome
    {
        tx.count_tool_outcome(tool, outcome);
    }
}

fn set_state(active: &mut tool_call::ActiveModel, state: ToolCallState) {
    active.status = Set(state.status.as_str().to_owned());
    active.attempt = Set(state.attempt as i32);
    active.outcome = Set(state.outcome.map(|o| o.as_str().to_owned()));
    if state.is_terminal() {
        active.ended_at = Set(Some(now_millis()));
    }
}

fn event_for(state: ToolCallState) -> EventKind {
    match (state.status, state.outcome) {
        (ToolCallStatus::Executing, _) => EventKind::ToolStarted,
        (_, Some(ToolOutcome::Succeeded)) => EventKind::ToolCompleted,
        _ => EventKind::ToolFailed,
    }
}

/// The run's tool calls without a result yet.
pub(in crate::store) fn unfinished(run_id: Uuid) -> sea_orm::Select<tool_call::Entity> {
    tool_call::Entity::find()
        .filter(tool_call::Column::RunId.eq(run_id))
        .filter(tool_call::Column::Status.is_not_in([
            ToolCallStatus::Completed.as_str(),
            ToolCallStatus::Indeterminate.as_str(),
        ]))
}

/// Gives every unfinished call of an ending run its one result: a started
/// call `INTERRUPTED`, an unstarted one `NOT_STARTED`.
pub(in crate::store) async fn close_unfinished(
    tx: &WriteTx,
    row: &run::Model,
) -> Result<Vec<NewEvent>> {
    let open_calls = unfinished(row.id)
        .order_by_asc(tool_call::Column::Step)
        .order_by_asc(tool_call::Column::Idx)
        .all(&**tx)
        .await?;
    let mut events = Vec::new();
    for call in open_calls {
        let before = state_of(&call)?;
        let state = before
            .apply(ToolInput::Cancel)
            .map_err(|e| Error::Conflict(e.to_string()))?;
        events.push(tool_event(
            EventKind::ToolFailed,
            row.id,
            call.id,
            &call.name,
        ));
        let part_id = call.part_id;
        count_outcome(tx, &call.name, before, state);
        let mut active: tool_call::ActiveModel = call.into();
        set_state(&mut active, state);
        if let Some(outcome) = state.outcome {
            active.output = Set(Some(closing_output(outcome)));
        }
        active.update(&**tx).await?;
        events.push(part_touched(tx, row, part_id).await?);
    }
    Ok(events)
}

pub(in crate::store) fn tool_event(
    kind: EventKind,
    run_id: Uuid,
    tool_call_id: Uuid,
    name: &str,
) -> NewEvent {
    NewEvent {
        kind,
        run_id: Some(run_id),
        body: EventBody::Tool {
            tool_call_id,
            tool_name: name.to_owned(),
        },
    }
}
