//! A worker's commits for the tool calls of the run it holds, each fenced
//! like every other run commit (`runs::open`). Commit before effect: a batch
//! is committed `REQUESTED` whole before any call runs, and each call
//! `EXECUTING` before its effect starts. The rows are also the idempotency
//! record: one unique key per call, and the recorded result of a call that
//! has one is never asked for again.

use sea_orm::ActiveValue::Set;
use sea_orm::{ActiveModelTrait, EntityTrait};
use serde_json::{Value, json};
use uuid::Uuid;

use super::commit::{
    self, Ending, Lease, PartContent, PartText, change_in, end_closed, open, record_in, set_output,
    tool_event,
};
pub use super::commit::{Finished, Outcome};
use super::entities::tool_call;
use super::{Error, Result, Store};
use crate::domain::cursor::Cursor;
use crate::domain::event::EventKind;
use crate::domain::time::{new_id, now_millis};
use crate::domain::tool_call::{
    ToolCallState, ToolCallStatus, ToolInput, ToolOutcome, inline_output,
};
use crate::domain::{PartKind, PartState};

/// Keys derive from tenant, run and call identity under this namespace, so
/// they are stable across retries, recoveries and resumptions.
const KEY_NAMESPACE: Uuid = Uuid::from_u128(0x6a1c_54f0_9d3e_4b7a_8e21_7c3f_0b9d_d2e5);

pub fn idempotency_key(tenant: &str, run_id: Uuid, tool_call_id: Uuid) -> String {
    Uuid::new_v5(
        &KEY_NAMESPACE,
        format!("{tenant}/{run_id}/{tool_call_id}").as_bytes(),
    )
    .to_string()
}

/// What becomes of a call the model asked for, decided before anything runs.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// It may run with this validated, normalized input.
    Run(Value),
    /// It never runs: it is committed `COMPLETED` with this outcome and
    /// output (input the schema refuses, an unknown tool, a limit).
    Refuse(ToolOutcome, Value),
}

#[derive(Debug, Clone, PartialEq)]
pub struct NewToolCall {
    pub provider_call_id: String,
    pub name: String,
    pub model_input: Value,
    pub verdict: Verdict,
}

/// Commits the step's model output that asked for tools, in one
/// transaction: its streamed parts closed with their final text, one
/// `TOOL_CALL` part and one call per request (`REQUESTED`, or `COMPLETED`
/// when refused up front). With `ending`, the run ends in the same
/// transaction (a limit reached by this very batch).
pub async fn request(
    store: &Store,
    lease: &Lease,
    parts: &[PartText],
    calls: Vec<NewToolCall>,
    max_inline_bytes: usize,
    ending: Option<Ending>,
) -> Result<(Vec<tool_call::Model>, Cursor)> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    let mut events = commit::save_parts(&tx, &row, parts, PartState::Done).await?;
    let message_id = match parts.first() {
        Some(first) => first.part.message_id,
        None => commit::assistant_message(&tx, &row).await?,
    };
    let now = now_millis();
    let mut stored = Vec::with_capacity(calls.len());
    for (idx, call) in calls.into_iter().enumerate() {
        let id = new_id();
        let content = PartContent::data(PartKind::ToolCall, json!({ "toolCallId": id }));
        let part = commit::add_part(&tx, &row, message_id, content).await?;
        events.push(commit::part_event(EventKind::PartAdded, &row, &part, None)?);
        let (state, input, output) = match call.verdict {
            Verdict::Run(input) => (ToolCallState::REQUESTED, Some(input), None),
            Verdict::Refuse(outcome, output) => {
                events.push(tool_event(EventKind::ToolFailed, row.id, id, &call.name));
                let state = ToolCallState {
                    status: ToolCallStatus::Completed,
                    attempt: 0,
                    outcome: Some(outcome),
                };
                (state, None, Some(output))
            }
        };
        let inline = output.as_ref().map(|o| inline_output(o, max_inline_bytes));
        let model = tool_call::ActiveModel {
            id: Set(id),
            tenant: Set(row.tenant.clone()),
            conversation_id: Set(row.conversation_id),
            run_id: Set(row.id),
            part_id: Set(part.id),
            step: Set(row.steps),
            idx: Set(idx as i32),
            provider_call_id: Set(call.provider_call_id),
            name: Set(call.name),
            model_input: Set(call.model_input),
            input: Set(input),
            status: Set(state.status.as_str().to_owned()),
            outcome: Set(state.outcome.map(|o| o.as_str().to_owned())),
            attempt: Set(0),
            output: Set(inline.as_ref().map(|i| i.inline.clone())),
            full_output: Set(inline.as_ref().and_then(|i| i.full.clone())),
            output_truncated: Set(inline.as_ref().is_some_and(|i| i.truncated)),
            idempotency_key: Set(idempotency_key(&row.tenant, row.id, id)),
            created_at: Set(now),
            started_at: Set(None),
            ended_at: Set(state.is_terminal().then_some(now)),
        }
        .insert(&*tx)
        .await?;
        stored.push(model);
    }
    if let Some(ending) = ending {
        let mut row = row;
        commit::apply_usage(&mut row, &ending);
        events = end_closed(
            &tx,
            row,
            None,
            ending.cause,
            ending.error,
            ending.reason,
            events,
        )
        .await?;
        stored = commit::of_step(&*tx, lease.run_id, stored.first().map_or(0, |c| c.step)).await?;
    }
    tx.append(&conversation, events).await?;
    let committed = store.commit(tx).await?;
    Ok((stored, committed.last().map_or(Cursor::START, |e| e.cursor)))
}

/// Applies `input` to one call of the held run inside the fenced
/// transaction, writes what the caller adds, and announces it.
async fn change(
    store: &Store,
    lease: &Lease,
    call_id: Uuid,
    input: ToolInput,
    fill: impl FnOnce(&mut tool_call::ActiveModel, ToolCallState),
) -> Result<tool_call::Model> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    if row.cancel_requested
        && matches!(
            input,
            ToolInput::Start | ToolInput::Recover { replayable: true }
        )
    {
        // No effect starts once a cancellation is committed.
        return Err(Error::CancelRequested);
    }
    let (saved, events) = change_in(&tx, &row, call_id, input, fill).await?;
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(saved)
}

/// Commits the call `EXECUTING` before its effect starts: its first start,
/// or the replay of an idempotent call cut off by a crash (same key).
pub async fn start(
    store: &Store,
    lease: &Lease,
    call_id: Uuid,
    replay: bool,
) -> Result<tool_call::Model> {
    let input = if replay {
        ToolInput::Recover { replayable: true }
    } else {
        ToolInput::Start
    };
    change(store, lease, call_id, input, |active, _| {
        if let sea_orm::ActiveValue::Unchanged(None) = active.started_at {
            active.started_at = Set(Some(now_millis()));
        }
    })
    .await
}

/// Fails a call that cannot run at all, in one commit, without starting it
/// (`attempt` stays 0).
pub async fn reject(
    store: &Store,
    lease: &Lease,
    call_id: Uuid,
    output: &Value,
    max_inline_bytes: usize,
) -> Result<tool_call::Model> {
    let inline = inline_output(output, max_inline_bytes);
    change(store, lease, call_id, ToolInput::Reject, |active, _| {
        set_output(active, inline);
    })
    .await
}

/// Commits what a started call came to, alone (a batch's result, as each
/// call finishes; see `runs::end_step` for a result that goes with the
/// step's end).
pub async fn record(store: &Store, lease: &Lease, finished: Finished) -> Result<tool_call::Model> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    let (saved, events) = record_in(&tx, &row, &finished).await?;
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(saved)
}

/// How an operator says a call of unknown outcome came out.
#[derive(Debug, Clone)]
pub struct OperatorResolution<'a> {
    pub operator: commit::Operator<'a>,
    pub succeeded: bool,
    /// What the downstream system reports, as the call's output.
    pub output: Value,
    pub note: &'a str,
}

/// Records what the downstream system says became of a call whose outcome
/// is `UNKNOWN`: the call is `COMPLETED`, its output says what the
/// operator learned, and the action is audited, in one transaction. The
/// model reads it in the history of the run's next step or of the next run,
/// as a fact: nothing is called again. Any tenant's call (operators only).
pub async fn resolve(
    store: &Store,
    call_id: Uuid,
    resolution: OperatorResolution<'_>,
) -> Result<tool_call::Model> {
    let mut tx = store.begin_write().await?;
    let call = tool_call::Entity::find_by_id(call_id)
        .one(&*tx)
        .await?
        .ok_or(Error::NotFound)?;
    let conversation = tx
        .lock_conversation(call.conversation_id, &call.tenant)
        .await?;
    let before = commit::state_of(&call)?;
    if before.outcome != Some(ToolOutcome::Unknown) {
        let now = match before.outcome {
            Some(outcome) => format!("{} ({})", before.status, outcome),
            None => before.status.to_string(),
        };
        return Err(Error::Conflict(format!(
            "only a tool call whose outcome is UNKNOWN can be resolved; this one is {now}"
        )));
    }
    let run = super::entities::run::Entity::find_by_id(call.run_id)
        .one(&*tx)
        .await?
        .ok_or(Error::NotFound)?;
    let OperatorResolution {
        operator,
        succeeded,
        output,
        note,
    } = resolution;
    let earlier = call.output.clone();
    let recorded = json!({
        "outcome": if succeeded { "COMPLETED" } else { "FAILED" },
        "output": output,
        "note": note,
        "resolved": "the call was cut off mid-flight and its outcome was unknown; an operator \
                     learned this outcome from the downstream system. Do not repeat the call.",
    });
    let stored = recorded.clone();
    let (saved, events) = change_in(
        &tx,
        &run,
        call_id,
        ToolInput::Resolve { succeeded },
        move |active, _| active.output = Set(Some(stored)),
    )
    .await?;
    commit::record_operator_action(
        &tx,
        commit::OperatorAction {
            operator,
            action: "resolveToolCall",
            tenant: &call.tenant,
            run_id: Some(call.run_id),
            tool_call_id: Some(call_id),
            note,
            detail: json!({ "before": { "outcome": "UNKNOWN", "output": earlier }, "after": recorded }),
        },
    )
    .await?;
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(saved)
}
