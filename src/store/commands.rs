//! The API's writes: each is one transaction that changes state and appends
//! the events reporting it.

use std::sync::Arc;

use sea_orm::{
    ActiveModelTrait, ActiveValue::Set, ColumnTrait, EntityTrait, QueryFilter, QueryOrder,
    QuerySelect,
};
use uuid::Uuid;

use super::commit::{self, WriteTx};
use super::entities::{conversation, message, part, run};
use super::{Actor, Error, Result, Store, is_unique_violation, reads};
use crate::domain::event::NewEvent;
use crate::domain::run::{EndCause, RunStatus};
use crate::domain::time::{new_id, now_millis};
use crate::domain::{ActiveRunStrategy, MessageRole, PartKind, PartState};

pub struct NewConversation {
    pub agent: String,
    pub title: Option<String>,
}

#[derive(Debug, Clone)]
pub struct NewMessage {
    pub conversation_id: Uuid,
    pub text: String,
    pub client_message_id: Option<String>,
    pub on_active_run: ActiveRunStrategy,
    /// `agents.retry.max_attempts` of the conversation's agent.
    pub max_attempts: MaxAttempts,
}

/// How many attempts a new run gets (`agents.retry.max_attempts`), from
/// its conversation's agent: looked up once the write has locked the
/// conversation, which names its agent, rather than by a read before it.
#[derive(Clone)]
pub enum MaxAttempts {
    /// The same for every agent.
    Fixed(i32),
    /// By the agent's name.
    ByAgent(Arc<dyn Fn(&str) -> i32 + Send + Sync>),
}

impl MaxAttempts {
    fn of(&self, agent: &str) -> i32 {
        match self {
            MaxAttempts::Fixed(n) => *n,
            MaxAttempts::ByAgent(by_agent) => by_agent(agent),
        }
    }
}

impl std::fmt::Debug for MaxAttempts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MaxAttempts::Fixed(n) => f.debug_tuple("Fixed").field(n).finish(),
            MaxAttempts::ByAgent(_) => f.write_str("ByAgent"),
        }
    }
}

pub async fn create_conversation(
    store: &Store,
    actor: &Actor,
    new: NewConversation,
) -> Result<conversation::Model> {
    let row = conversation::ActiveModel {
        id: Set(new_id()),
        tenant: Set(actor.tenant.clone()),
        principal: Set(actor.principal.clone()),
        agent: Set(new.agent),
        title: Set(new.title),
        created_at: Set(now_millis()),
        event_seq: Set(0),
        run_seq: Set(0),
    };
    let _lane = store.write_lane().await;
    Ok(row.insert(store.db()).await?)
}

/// Stores the user's message and a queued run for it in one transaction,
/// with `message.created` and `run.queued`; a message that steers the
/// active run is stored waiting for that run's next step boundary, and the
/// pair returned holds that run. A repeated `client_message_id` returns the
/// original pair and stores nothing.
pub async fn send_message(
    store: &Store,
    actor: &Actor,
    new: NewMessage,
) -> Result<(message::Model, run::Model)> {
    let actor = actor.clone();
    let (sent, _) = store
        .write(move |tx| {
            let (actor, new) = (actor.clone(), new.clone());
            Box::pin(async move { send_in(tx, &actor, new).await })
        })
        .await?;
    Ok(sent)
}

/// `send_message` inside `tx`. The workers of running runs it interrupts
/// are told once it commits (`WriteTx::notify_cancel`).
async fn send_in(
    tx: &mut WriteTx,
    actor: &Actor,
    new: NewMessage,
) -> Result<(message::Model, run::Model)> {
    // The new run's number comes with the lock.
    let conversation = tx
        .lock_conversation_for_run(new.conversation_id, &actor.tenant)
        .await?;

    if let Some(client_id) = &new.client_message_id
        && let Some(original) = message::Entity::find()
            .filter(message::Column::ConversationId.eq(conversation.id))
            .filter(message::Column::ClientMessageId.eq(client_id.as_str()))
            .one(&**tx)
            .await?
    {
        let run_id = original
            .run_id
            .ok_or_else(|| Error::Corrupt("user message without its run".into()))?;
        let run = run::Entity::find_by_id(run_id)
            .one(&**tx)
            .await?
            .ok_or_else(|| Error::Corrupt("user message's run is missing".into()))?;
        return Ok((original, run));
    }

    let mut events = Vec::new();
    // The run the message joins when it steers one; otherwise it starts
    // its own.
    let mut steered = None;
    match new.on_active_run {
        // Runs of a conversation execute in order: nothing to look at.
        ActiveRunStrategy::Queue => {}
        ActiveRunStrategy::Reject => {
            if !reads::unended_runs(&**tx, &actor.tenant, conversation.id)
                .await?
                .is_empty()
            {
                return Err(Error::Conflict(
                    "the conversation has an active run".to_owned(),
                ));
            }
        }
        ActiveRunStrategy::Steer => {
            // With no active run, as QUEUE; also when another person's run
            // is active (a run acts with its principal's connections and
            // grants, which a message of someone else's must not direct) or
            // the active run is asked to stop.
            steered = unended_locked(tx, &actor.tenant, conversation.id)
                .await?
                .into_iter()
                .next()
                .filter(|active| active.principal == actor.principal && !active.cancel_requested);
        }
        ActiveRunStrategy::Interrupt => {
            for row in unended_locked(tx, &actor.tenant, conversation.id).await? {
                if reads::run_status(&row)? == RunStatus::Running {
                    // Its worker may still be streaming or calling tools:
                    // it is asked to stop, and ends the run INTERRUPTED
                    // when it has (or, should it be gone, the claim after
                    // its lease lapses does). The new run waits behind it,
                    // so no two runs' effects overlap.
                    let mut active: run::ActiveModel = row.clone().into();
                    active.cancel_requested = Set(true);
                    active.cancel_cause = Set(Some(EndCause::Interrupted.as_str().to_owned()));
                    active.update(&**tx).await?;
                    tx.notify_cancel(row.id).await?;
                } else {
                    events.extend(commit::end(tx, row, EndCause::Interrupted, None).await?);
                }
            }
        }
    }

    let now = now_millis();
    let message_id = new_id();
    let (run_id, run_seq, pos) = match &steered {
        Some(active) => (
            active.id,
            active.seq,
            commit::wait_for_boundary(tx, active.id).await?,
        ),
        None => (new_id(), conversation.run_seq, 0),
    };
    // The rows go with the append, in one hand-over on SQLite.
    let mut writes = commit::Writes::default();
    let message = message::Model {
        id: message_id,
        conversation_id: conversation.id,
        tenant: actor.tenant.clone(),
        role: MessageRole::User.as_str().to_owned(),
        run_id: Some(run_id),
        client_message_id: new.client_message_id.clone(),
        created_at: now,
        run_seq,
        pos,
    };
    writes.insert(tx, message::ActiveModel::from(message.clone()));
    writes.insert(
        tx,
        part::ActiveModel {
            id: Set(new_id()),
            message_id: Set(message_id),
            conversation_id: Set(conversation.id),
            tenant: Set(actor.tenant.clone()),
            idx: Set(0),
            kind: Set(PartKind::Text.as_str().to_owned()),
            state: Set(PartState::Done.as_str().to_owned()),
            text: Set(Some(new.text)),
            data: Set(None),
            created_at: Set(now),
            updated_at: Set(now),
            run_id: Set(None),
            abandoned: Set(false),
            step: Set(0),
        },
    );
    events.push(NewEvent::message_created(
        message_id,
        MessageRole::User,
        Some(run_id),
    ));
    let run = match steered {
        Some(active) => active,
        None => {
            let run = commit::queued_run(commit::NewRun {
                id: run_id,
                conversation_id: conversation.id,
                tenant: &actor.tenant,
                principal: &actor.principal,
                agent: &conversation.agent,
                trigger_message_id: message_id,
                max_attempts: new.max_attempts.of(&conversation.agent),
                seq: conversation.run_seq,
            });
            writes.insert(tx, run::ActiveModel::from(run.clone()));
            events.extend(NewEvent::run_status(run_id, RunStatus::Queued));
            run
        }
    };
    let has_client_id = new.client_message_id.is_some();
    match tx.append_after(writes, &conversation, events).await {
        // The one unique key a new message can break (the earlier read
        // under the conversation's lock makes it a race lost at most).
        Err(Error::Database(e)) if has_client_id && is_unique_violation(&e) => Err(
            Error::Conflict("clientMessageId is already in use".to_owned()),
        ),
        Err(e) => Err(e),
        Ok(()) => Ok((message, run)),
    }
}

/// The conversation's runs that have not ended, oldest first, locked: a
/// claim that commits meanwhile (a claim that commits alone takes no
/// conversation lock) is seen before the caller moves the run on.
async fn unended_locked(
    tx: &WriteTx,
    tenant: &str,
    conversation_id: Uuid,
) -> Result<Vec<run::Model>> {
    Ok(run::Entity::find()
        .filter(run::Column::Tenant.eq(tenant))
        .filter(run::Column::ConversationId.eq(conversation_id))
        .filter(run::Column::Status.is_in(RunStatus::not_ended().map(RunStatus::as_str)))
        .order_by_asc(run::Column::Seq)
        .lock_exclusive()
        .all(&**tx)
        .await?)
}

/// Cancels a run: one no worker holds ends in this transaction; a running one
/// is marked `cancelRequested` and its worker is told; an ended run is
/// returned unchanged. Only the run's principal may, or a delegate; an
/// operator acting on someone else's run (`operator`) is audited in the
/// transaction that changes it.
pub async fn cancel_run(
    store: &Store,
    actor: &Actor,
    run_id: Uuid,
    operator: Option<commit::Operator<'_>>,
) -> Result<run::Model> {
    let Some(found) = reads::run(store.db(), &actor.tenant, run_id)
        .await?
        .filter(|run| actor.acts_for(&run.principal))
    else {
        return Err(Error::NotFound);
    };
    let mut tx = store.begin_write().await?;
    let conversation = tx
        .lock_conversation(found.conversation_id, &actor.tenant)
        .await?;
    // Read again under the locks: the run may have moved since (a claim
    // that commits alone takes no conversation lock, hence the row's own).
    let row = run::Entity::find_by_id(run_id)
        .lock_exclusive()
        .one(&*tx)
        .await?
        .ok_or(Error::NotFound)?;
    let status = reads::run_status(&row)?;
    if status.is_ended() {
        return Ok(row);
    }
    if let Some(operator) = operator
        && !(status == RunStatus::Running && row.cancel_requested)
    {
        commit::record_operator_action(
            &tx,
            commit::OperatorAction {
                operator,
                action: "cancelRun",
                tenant: &row.tenant,
                run_id: Some(run_id),
                tool_call_id: None,
                note: "",
                detail: serde_json::json!({
                    "before": { "status": status.as_str() },
                    "after": { "status": if status == RunStatus::Running { "RUNNING" } else { "CANCELLED" },
                               "cancelRequested": status == RunStatus::Running },
                }),
            },
        )
        .await?;
    }
    if status == RunStatus::Running {
        // Returned as this mutation left it, `RUNNING`: its worker, told at
        // once, may well have ended it before another read.
        if row.cancel_requested {
            // Asked again: the worker is told again.
            store.bus().request_cancel(run_id);
            return Ok(row);
        }
        let mut active: run::ActiveModel = row.into();
        active.cancel_requested = Set(true);
        let requested = active.update(&*tx).await?;
        tx.notify_cancel(run_id).await?;
        store.commit(tx).await?;
        return Ok(requested);
    }
    let events = commit::end(&tx, row, EndCause::Cancelled, None).await?;
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    reads::run(store.db(), &actor.tenant, run_id)
        .await?
        .ok_or(Error::NotFound)
}
