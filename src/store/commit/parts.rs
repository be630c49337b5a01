//! Parts: a message's pieces (streamed text, reasoning, tool calls, pauses),
//! appended and saved inside a caller's fenced transaction.

use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::Expr;
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder,
    QueryTrait,
};
use uuid::Uuid;

use super::WriteTx;
use crate::domain::event::{EventBody, EventKind, NewEvent};
use crate::domain::time::{new_id, now_millis};
use crate::domain::{MessageRole, PartKind, PartState};
use crate::store::entities::{message, part, run};
use crate::store::{Error, Result, parse_stored};

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

/// Text length as clients count it: UTF-16 code units.
pub fn utf16_len(text: &str) -> i64 {
    text.encode_utf16().count() as i64
}

/// The message the run's reply is written into now (made by its first
/// `begin`, or the latest after steered messages joined).
pub(in crate::store) async fn assistant_message(tx: &WriteTx, row: &run::Model) -> Result<Uuid> {
    reply_message(tx, row).await?.ok_or(Error::NotFound)
}

/// Shows `text` as a finished part of `kind` (a run's `ERROR`, an
/// attempt's `NOTICE`) at the end of the message: in place of its last part
/// when that is an empty text part, which an attempt that ended before its
/// first token leaves, else after it. Returns the part's event.
pub(in crate::store) async fn show_at_end(
    tx: &WriteTx,
    run: &run::Model,
    message_id: Uuid,
    kind: PartKind,
    text: &str,
) -> Result<NewEvent> {
    let last = part::Entity::find()
        .filter(part::Column::MessageId.eq(message_id))
        .order_by_desc(part::Column::Idx)
        .one(&**tx)
        .await?;
    let length = Some(utf16_len(text));
    match last {
        Some(last)
            if last.kind == PartKind::Text.as_str()
                && last.text.as_deref().is_none_or(str::is_empty) =>
        {
            let mut active: part::ActiveModel = last.into();
            active.kind = Set(kind.as_str().to_owned());
            active.state = Set(PartState::Done.as_str().to_owned());
            active.text = Set(Some(text.to_owned()));
            // It no longer holds an attempt's text.
            active.abandoned = Set(false);
            active.updated_at = Set(now_millis());
            let shown = active.update(&**tx).await?;
            part_event(EventKind::PartUpdated, run, &shown, length)
        }
        _ => {
            let content = PartContent {
                kind,
                state: PartState::Done,
                text: Some(text),
                data: None,
            };
            let shown = add_part(tx, run, message_id, content).await?;
            part_event(EventKind::PartAdded, run, &shown, length)
        }
    }
}

/// The message the run's reply is written into now, if its first `begin`
/// made one: the latest of its assistant messages.
pub(in crate::store) async fn reply_message(
    tx: &WriteTx,
    row: &run::Model,
) -> Result<Option<Uuid>> {
    Ok(message::Entity::find()
        .filter(message::Column::RunId.eq(row.id))
        .filter(message::Column::Role.eq(MessageRole::Assistant.as_str()))
        .order_by_desc(message::Column::Pos)
        .one(&**tx)
        .await?
        .map(|m| m.id))
}

/// The text a run's step committed (its kept text parts, in order).
pub(in crate::store) async fn step_text<C: ConnectionTrait>(
    db: &C,
    run_id: Uuid,
    step: i32,
) -> Result<String> {
    let parts = part::Entity::find()
        .filter(part::Column::RunId.eq(run_id))
        .filter(part::Column::Step.eq(step))
        .filter(part::Column::Kind.eq(PartKind::Text.as_str()))
        .filter(part::Column::Abandoned.eq(false))
        .order_by_asc(part::Column::Idx)
        .all(db)
        .await?;
    Ok(parts.into_iter().filter_map(|p| p.text).collect())
}

/// Writes the parts' texts in `state`, returning their `part.updated`.
pub(in crate::store) async fn save_parts(
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

/// `save_parts` with the updates sent with the transaction's append
/// (`WriteTx::defer`), for a commit that reads and changes none of these
/// parts before it, or flushes them first (`end_closed`): the events are
/// made from what the worker holds of each part.
pub(in crate::store) fn save_parts_with_append(
    tx: &WriteTx,
    row: &run::Model,
    parts: &[PartText],
    state: PartState,
) -> Vec<NewEvent> {
    let backend = tx.get_database_backend();
    let mut events = Vec::with_capacity(parts.len());
    for streamed in parts {
        tx.defer(part_update(streamed, state).build(backend));
        let part = &streamed.part;
        let length = Some(utf16_len(&streamed.text));
        events.push(part_event_of(
            EventKind::PartUpdated,
            row.id,
            part.message_id,
            part.id,
            part.kind,
            length,
        ));
    }
    events
}

/// Marks a part changed (its tool call moved on) and says `part.updated`.
pub(in crate::store) async fn part_touched(
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
pub(in crate::store) struct PartContent<'a> {
    pub kind: PartKind,
    pub state: PartState,
    pub text: Option<&'a str>,
    pub data: Option<serde_json::Value>,
}

impl PartContent<'static> {
    /// An empty part that text will stream into.
    pub(in crate::store) fn streaming(kind: PartKind) -> Self {
        PartContent {
            kind,
            state: PartState::Streaming,
            text: Some(""),
            data: None,
        }
    }

    /// A finished part with data only (a tool call, a question, an
    /// approval).
    pub(in crate::store) fn data(kind: PartKind, data: serde_json::Value) -> Self {
        PartContent {
            kind,
            state: PartState::Done,
            text: None,
            data: Some(data),
        }
    }
}

/// Adds a part after the message's last one.
pub(in crate::store) async fn add_part(
    tx: &WriteTx,
    run: &run::Model,
    message_id: Uuid,
    content: PartContent<'_>,
) -> Result<part::Model> {
    let index = next_index(tx, message_id).await?;
    insert_part(tx, run, message_id, index, content).await
}

pub(in crate::store) async fn next_index(tx: &WriteTx, message_id: Uuid) -> Result<i32> {
    let last: Option<part::Model> = part::Entity::find()
        .filter(part::Column::MessageId.eq(message_id))
        .order_by_desc(part::Column::Idx)
        .one(&**tx)
        .await?;
    Ok(last.map_or(0, |p| p.idx + 1))
}

pub(in crate::store) async fn insert_part(
    tx: &WriteTx,
    run: &run::Model,
    message_id: Uuid,
    index: i32,
    content: PartContent<'_>,
) -> Result<part::Model> {
    Ok(
        part::ActiveModel::from(new_part(run, message_id, index, content))
            .insert(&**tx)
            .await?,
    )
}

/// A new part of the run's, as `insert_part` stores it.
pub(in crate::store) fn new_part(
    run: &run::Model,
    message_id: Uuid,
    index: i32,
    content: PartContent<'_>,
) -> part::Model {
    let now = now_millis();
    part::Model {
        id: new_id(),
        message_id,
        conversation_id: run.conversation_id,
        tenant: run.tenant.clone(),
        idx: index,
        kind: content.kind.as_str().to_owned(),
        state: content.state.as_str().to_owned(),
        text: content.text.map(str::to_owned),
        data: content.data,
        created_at: now,
        updated_at: now,
        run_id: Some(run.id),
        abandoned: false,
        step: run.steps,
    }
}

async fn update_part(tx: &WriteTx, streamed: &PartText, state: PartState) -> Result<part::Model> {
    part_update(streamed, state)
        .exec_with_returning(&**tx)
        .await?
        .pop()
        .ok_or(Error::NotFound)
}

/// A streamed part's text, state and data saved.
fn part_update(streamed: &PartText, state: PartState) -> sea_orm::UpdateMany<part::Entity> {
    let mut update = part::Entity::update_many()
        .col_expr(part::Column::Text, Expr::value(streamed.text.as_str()))
        .col_expr(part::Column::State, Expr::value(state.as_str()))
        .col_expr(part::Column::UpdatedAt, Expr::value(now_millis()));
    if let Some(data) = &streamed.data {
        update = update.col_expr(part::Column::Data, Expr::value(data.clone()));
    }
    update.filter(part::Column::Id.eq(streamed.part.id))
}

pub(in crate::store) fn part_event(
    kind: EventKind,
    run: &run::Model,
    part: &part::Model,
    text_length: Option<i64>,
) -> Result<NewEvent> {
    part_event_for(kind, run.id, part, text_length)
}

pub(in crate::store) fn part_event_for(
    kind: EventKind,
    run_id: Uuid,
    part: &part::Model,
    text_length: Option<i64>,
) -> Result<NewEvent> {
    let part_kind = parse_stored(&part.kind, "part kind")?;
    Ok(part_event_of(
        kind,
        run_id,
        part.message_id,
        part.id,
        part_kind,
        text_length,
    ))
}

fn part_event_of(
    kind: EventKind,
    run_id: Uuid,
    message_id: Uuid,
    part_id: Uuid,
    part_kind: PartKind,
    text_length: Option<i64>,
) -> NewEvent {
    NewEvent {
        kind,
        run_id: Some(run_id),
        body: EventBody::Part {
            message_id,
            part_id,
            kind: part_kind,
            text_length,
        },
    }
}
