//! A claim's start: the run's assistant message and the empty text part its
//! inference streams into, inside a caller's transaction.

use sea_orm::ActiveModelTrait;
use sea_orm::ActiveValue::Set;
use uuid::Uuid;

use super::WriteTx;
use super::parts::{OpenPart, PartContent, insert_part, part_event};
use crate::domain::cursor::Cursor;
use crate::domain::event::{EventKind, NewEvent};
use crate::domain::time::now_millis;
use crate::domain::{MessageRole, PartKind};
use crate::store::Result;
use crate::store::entities::{message, run};

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

/// Makes the run's assistant message, which all its steps write into, with
/// `message.created`.
pub(in crate::store) async fn assistant_message_new(
    tx: &WriteTx,
    row: &run::Model,
    events: &mut Vec<NewEvent>,
) -> Result<Uuid> {
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
    .insert(&**tx)
    .await?;
    events.push(NewEvent::message_created(
        id,
        MessageRole::Assistant,
        Some(row.id),
    ));
    Ok(id)
}

/// Opens the empty streaming text part a step's inference writes into.
pub(in crate::store) async fn open_text_part(
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

/// The start of a run's first claim (epoch 1: no message or part yet, so
/// nothing to look up or recover): its assistant message, the empty text
/// part, and `run.started`. Returns what the worker needs but the cursor,
/// which is known once the transaction commits.
pub(in crate::store) async fn start_first(
    tx: &WriteTx,
    row: &run::Model,
    events: &mut Vec<NewEvent>,
) -> Result<(Uuid, OpenPart)> {
    let message_id = assistant_message_new(tx, row, events).await?;
    let part = open_text_part(tx, row, message_id, 0, events).await?;
    events.extend(NewEvent::run_status(
        row.id,
        crate::domain::run::RunStatus::Running,
    ));
    Ok((message_id, part))
}

impl Begun {
    /// What a first claim started in a transaction that committed `events`
    /// (the cursor is the run's conversation's newest among them).
    pub(in crate::store) fn first(
        run: run::Model,
        message_id: Uuid,
        part: OpenPart,
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
            part: Some(part),
            cursor,
        }
    }
}
