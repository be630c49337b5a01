//! The history sent to the model, rebuilt from committed facts only.

use sea_orm::{ColumnTrait, EntityTrait, QueryFilter, QueryOrder};
use uuid::Uuid;

use crate::domain::{MessageRole, PartKind};
use crate::providers::Turn;
use crate::store::entities::{run, summary};
use crate::store::{Result, Store, parse_stored, reads};

/// The opening of the turn that stands in for compacted messages.
pub const SUMMARY_HEADING: &str = "Summary of the earlier conversation:";

/// The turns for a run's model request, with the message each came from
/// (`None` for a summary standing in for older ones).
#[derive(Debug, Clone, Default)]
pub struct History {
    pub turns: Vec<Turn>,
    pub sources: Vec<Option<Uuid>>,
}

/// Every user message up to the run's own and every text reply so far;
/// messages covered by the latest summary are replaced by it. (Runs of a
/// conversation execute one at a time in order, so every reply there is
/// belongs to this run or to one before it.) Abandoned attempts, reasoning,
/// notices and errors are shown to people, never to the model.
pub async fn load(store: &Store, run: &run::Model) -> Result<History> {
    let db = store.db();
    let latest_summary = summary::Entity::find()
        .filter(summary::Column::Tenant.eq(run.tenant.as_str()))
        .filter(summary::Column::ConversationId.eq(run.conversation_id))
        .filter(summary::Column::ThroughMessageId.lt(run.trigger_message_id))
        .order_by_desc(summary::Column::Id)
        .one(db)
        .await?;
    let messages = reads::messages(db, &run.tenant, run.conversation_id, None, None).await?;
    let ids: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
    let mut parts = reads::parts_of(db, &run.tenant, &ids).await?;
    let mut history = History::default();
    if let Some(summary) = &latest_summary {
        history.turns.push(Turn::text(
            MessageRole::User,
            format!("{SUMMARY_HEADING}\n{}", summary.text),
        ));
        history.sources.push(None);
    }
    for message in messages {
        if latest_summary
            .as_ref()
            .is_some_and(|s| message.id <= s.through_message_id)
        {
            continue;
        }
        let role: MessageRole = parse_stored(&message.role, "message role")?;
        if role == MessageRole::User && message.id > run.trigger_message_id {
            continue;
        }
        let mut text = String::new();
        for part in parts.remove(&message.id).unwrap_or_default() {
            let kind: PartKind = parse_stored(&part.kind, "part kind")?;
            if kind == PartKind::Text && !part.abandoned {
                text.push_str(part.text.as_deref().unwrap_or_default());
            }
        }
        if !text.is_empty() {
            history.turns.push(Turn::text(role, text));
            history.sources.push(Some(message.id));
        }
    }
    Ok(history)
}
