//! A claim's start inside a caller's transaction: what a cut-off attempt
//! left open closed, the run's assistant message, and the empty text part
//! its inference streams into.

use sea_orm::ActiveValue::Set;
use uuid::Uuid;

use super::calls::of_step;
use super::end::abandon_open_parts;
use super::parts::{
    OpenPart, PartContent, new_part, next_index, part_event, reply_message, step_text,
};
use super::steer;
use super::{WriteTx, Writes};
use crate::domain::cursor::Cursor;
use crate::domain::event::{EventKind, NewEvent};
use crate::domain::run::RunStatus;
use crate::domain::time::{new_id, now_millis};
use crate::domain::{MessageRole, PartKind};
use crate::store::Result;
use crate::store::entities::{message, part, run, tool_call};

/// What the worker knows after its first commit of a claim.
#[derive(Debug, Clone)]
pub struct Begun {
    pub run: run::Model,
    /// The run's assistant message, which all its steps write into.
    pub message_id: Uuid,
    /// What the run does first.
    pub first: FirstStep,
    /// The newest persisted cursor, for live deltas that follow it.
    pub cursor: Cursor,
}

/// What a claimed run does first.
#[derive(Debug, Clone)]
pub enum FirstStep {
    /// An inference, streaming into this text part.
    Infer(OpenPart),
    /// Finish a batch of tool calls an earlier claim left unfinished (read
    /// with the claim), before the model is asked anything.
    FinishBatch(StepBatch),
}

/// The tool calls of a run's current step that an earlier claim left
/// unfinished (a call that waited for an approval, a worker cut off in the
/// middle of a batch), with what the step had said before them.
#[derive(Debug, Clone)]
pub struct StepBatch {
    /// The step's kept text parts, in order.
    pub said: String,
    /// The step's calls, in batch order.
    pub calls: Vec<tool_call::Model>,
}

/// Makes a message for the run's reply at `pos` among the run's messages,
/// with `message.created`: the first (`pos` 1, after the message that
/// started the run), or the one the reply goes on in after steered messages
/// joined. Its insert goes with the transaction's next append (`writes`).
pub(in crate::store) fn assistant_message_new(
    tx: &WriteTx,
    writes: &mut Writes,
    row: &run::Model,
    pos: i64,
    events: &mut Vec<NewEvent>,
) -> Uuid {
    let id = new_id();
    writes.insert(
        tx,
        message::ActiveModel {
            id: Set(id),
            conversation_id: Set(row.conversation_id),
            tenant: Set(row.tenant.clone()),
            role: Set(MessageRole::Assistant.as_str().to_owned()),
            run_id: Set(Some(row.id)),
            client_message_id: Set(None),
            created_at: Set(now_millis()),
            run_seq: Set(row.seq),
            pos: Set(pos),
        },
    );
    events.push(NewEvent::message_created(
        id,
        MessageRole::Assistant,
        Some(row.id),
    ));
    id
}

/// Opens the empty streaming text part a step's inference writes into. Its
/// insert goes with the transaction's next append (`writes`).
pub(in crate::store) fn open_text_part(
    tx: &WriteTx,
    writes: &mut Writes,
    row: &run::Model,
    message_id: Uuid,
    index: i32,
    events: &mut Vec<NewEvent>,
) -> Result<OpenPart> {
    let part = new_part(
        row,
        message_id,
        index,
        PartContent::streaming(PartKind::Text),
    );
    writes.insert(tx, part::ActiveModel::from(part.clone()));
    events.push(part_event(EventKind::PartAdded, row, &part, Some(0))?);
    Ok(OpenPart {
        id: part.id,
        message_id,
        index,
        kind: PartKind::Text,
    })
}

/// A claim's start inside `tx`: closes what a cut-off attempt left open
/// (its text stays visible, `DONE`, followed by a `NOTICE`), makes sure the
/// run has its assistant message, opens a text part, and says
/// `run.started`. A claim whose next step is an inference (a first claim,
/// a run resumed after its question, one retried or recovered with no batch
/// to finish) takes the messages steered into the run meanwhile
/// (`steer::join`). Returns the message the next step writes into and the
/// part, none while a batch of tool calls of the current step is still to
/// be finished; the cursor is known once the transaction commits. The new
/// rows go with the caller's append (`writes`).
pub(in crate::store) async fn start(
    tx: &WriteTx,
    writes: &mut Writes,
    row: &run::Model,
    events: &mut Vec<NewEvent>,
) -> Result<(Uuid, FirstStep)> {
    // A run's first claim has epoch 1 (every claim and every release adds
    // one): it has no message and no parts yet, so there is nothing to look
    // up or recover.
    if row.lease_epoch == 1 {
        // Messages steered into it while it was queued are read with the
        // message that started it.
        let message_id = match steer::join(tx, writes, row, events).await? {
            Some(steered) => steered,
            None => assistant_message_new(tx, writes, row, 1, events),
        };
        let part = open_text_part(tx, writes, row, message_id, 0, events)?;
        events.extend(NewEvent::run_status(row.id, RunStatus::Running));
        return Ok((message_id, FirstStep::Infer(part)));
    }
    events.extend(abandon_open_parts(tx, row.id).await?);
    let existing = reply_message(tx, row).await?;
    // A batch of tool calls in the current step: the step is finished
    // before the model is asked anything, so no text part yet.
    let calls = of_step(&**tx, row.id, row.steps).await?;
    let steered = if calls.is_empty() {
        steer::join(tx, writes, row, events).await?
    } else {
        None
    };
    // The new text part's place: first in a message made now, else after
    // the reply's last part.
    let (message_id, new_message) = match (steered, existing) {
        (Some(steered), _) => (steered, true),
        (None, Some(existing)) => (existing, false),
        (None, None) => {
            let pos = steer::next_pos(tx, row.id).await?;
            (assistant_message_new(tx, writes, row, pos, events), true)
        }
    };
    let first = if calls.is_empty() {
        let index = match new_message {
            true => 0,
            false => next_index(tx, message_id).await?,
        };
        let part = open_text_part(tx, writes, row, message_id, index, events)?;
        FirstStep::Infer(part)
    } else {
        let said = step_text(&**tx, row.id, row.steps).await?;
        FirstStep::FinishBatch(StepBatch { said, calls })
    };
    events.extend(NewEvent::run_status(row.id, RunStatus::Running));
    Ok((message_id, first))
}

impl Begun {
    /// What a claim started in a transaction that committed `committed`
    /// (the cursor is the run's conversation's newest among them).
    pub(in crate::store) fn new(
        run: run::Model,
        message_id: Uuid,
        first: FirstStep,
        committed: &[crate::domain::event::Event],
    ) -> Begun {
        let cursor = committed
            .iter()
            .rev()
            .find(|e| e.conversation_id == run.conversation_id)
            .map_or(Cursor::START, |e| e.cursor);
        Begun {
            run,
            message_id,
            first,
            cursor,
        }
    }

    /// The text part the first inference streams into; none while a batch
    /// is still to be finished.
    pub fn part(&self) -> Option<OpenPart> {
        match &self.first {
            FirstStep::Infer(part) => Some(*part),
            FirstStep::FinishBatch(_) => None,
        }
    }
}
