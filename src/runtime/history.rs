//! The history sent to the model, rebuilt from committed facts only.

use std::collections::HashSet;

use uuid::Uuid;

use crate::domain::{MessageRole, PartKind};
use crate::providers::Turn;
use crate::store::entities::run;
use crate::store::{Result, Store, parse_stored, reads};

/// The turns the run's model request is built from: every user message up to
/// the run's own, and the text replies of the runs before it. Abandoned
/// attempts, notices and errors are shown to people, never to the model.
pub async fn turns(store: &Store, run: &run::Model) -> Result<Vec<Turn>> {
    let db = store.db();
    let runs = reads::runs_of(db, &run.tenant, run.conversation_id).await?;
    let visible_runs: HashSet<Uuid> = runs
        .iter()
        .filter(|r| r.trigger_message_id <= run.trigger_message_id)
        .map(|r| r.id)
        .collect();
    let messages = reads::messages(db, &run.tenant, run.conversation_id, None, None).await?;
    let ids: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
    let mut parts = reads::parts_of(db, &run.tenant, &ids).await?;
    let mut turns = Vec::new();
    for message in messages {
        let role: MessageRole = parse_stored(&message.role, "message role")?;
        let included = match role {
            MessageRole::User => message.id <= run.trigger_message_id,
            MessageRole::Assistant => message.run_id.is_some_and(|id| visible_runs.contains(&id)),
        };
        if !included {
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
            turns.push(Turn { role, text });
        }
    }
    Ok(turns)
}
