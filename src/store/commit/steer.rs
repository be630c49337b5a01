//! Steered messages (`onActiveRun: STEER`) inside a caller's transaction:
//! where one waits, how the waiting ones join their run at a step boundary,
//! and the run of its own each gets when its run ends first. Also the queued
//! run a message starts, which `sendMessage` makes too.

use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::{Expr, ExprTrait, SimpleExpr};
use sea_orm::{ActiveModelTrait, ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};
use uuid::Uuid;

use super::start::assistant_message_new;
use super::{WriteTx, Writes};
use crate::domain::event::NewEvent;
use crate::domain::run::EndCause;
use crate::domain::run::RunStatus;
use crate::domain::time::{new_id, now_millis};
use crate::domain::{MessageRole, PartKind};
use crate::store::Result;
use crate::store::entities::{conversation, message, part, run};

/// `messages.pos` from which a steered message is still waiting for its
/// run's next step boundary. Joined messages are numbered from 0 up, one by
/// one, so they never come near it.
pub const PENDING_POS: i64 = 1 << 40;

/// A run about to be queued for the message that starts it.
pub(in crate::store) struct NewRun<'a> {
    pub id: Uuid,
    pub conversation_id: Uuid,
    pub tenant: &'a str,
    pub principal: &'a str,
    pub agent: &'a str,
    pub trigger_message_id: Uuid,
    pub max_attempts: i32,
    /// Its number, taken under the conversation's lock
    /// (`WriteTx::lock_conversation_for_run`).
    pub seq: i64,
}

/// Stores `new` `QUEUED`. The caller appends its `run.queued`.
async fn insert_queued_run(tx: &WriteTx, new: NewRun<'_>) -> Result<run::Model> {
    Ok(run::ActiveModel::from(queued_run(new))
        .insert(&**tx)
        .await?)
}

/// A new `QUEUED` run, as `insert_queued_run` stores it.
pub(in crate::store) fn queued_run(new: NewRun<'_>) -> run::Model {
    run::Model {
        id: new.id,
        conversation_id: new.conversation_id,
        tenant: new.tenant.to_owned(),
        principal: new.principal.to_owned(),
        agent: new.agent.to_owned(),
        trigger_message_id: new.trigger_message_id,
        status: RunStatus::Queued.as_str().to_owned(),
        end_cause: None,
        error: None,
        cancel_requested: false,
        attempt: 0,
        max_attempts: new.max_attempts,
        next_attempt_at: None,
        steps: 0,
        input_tokens: 0,
        output_tokens: 0,
        cost_usd: 0.0,
        created_at: now_millis(),
        started_at: None,
        ended_at: None,
        lease_owner: None,
        lease_epoch: 0,
        lease_expires_at: None,
        recoveries: 0,
        active_ms: 0,
        end_reason: None,
        claimed_at: None,
        seq: new.seq,
        cancel_cause: None,
        steering: 0,
        steered: false,
    }
}

/// Stores a message steered into `run` as waiting for its next step
/// boundary: returns its place, after every message already waiting, and
/// counts it on the run (`runs.steering`), which the boundary and the run's
/// end read before they look for waiting messages.
pub(in crate::store) async fn wait_for_boundary(tx: &WriteTx, run_id: Uuid) -> Result<i64> {
    let last = last_pos(tx, run_id, true).await?;
    set_steering(tx, run_id, Expr::col(run::Column::Steering).add(1)).await?;
    Ok(last.map_or(PENDING_POS, |pos| pos + 1))
}

async fn set_steering(tx: &WriteTx, run_id: Uuid, count: impl Into<SimpleExpr>) -> Result<()> {
    run::Entity::update_many()
        .col_expr(run::Column::Steering, count.into())
        .filter(run::Column::Id.eq(run_id))
        .exec(&**tx)
        .await?;
    Ok(())
}

/// The place of the run's last message that has joined it (its reply, or
/// a steered message), or of its last waiting one.
async fn last_pos(tx: &WriteTx, run_id: Uuid, waiting: bool) -> Result<Option<i64>> {
    let query = message::Entity::find()
        .select_only()
        .column(message::Column::Pos)
        .filter(message::Column::RunId.eq(run_id));
    let query = if waiting {
        query.filter(message::Column::Pos.gte(PENDING_POS))
    } else {
        query.filter(message::Column::Pos.lt(PENDING_POS))
    };
    Ok(query
        .order_by_desc(message::Column::Pos)
        .into_tuple::<i64>()
        .one(&**tx)
        .await?)
}

/// The next place among the run's joined messages.
pub(in crate::store) async fn next_pos(tx: &WriteTx, run_id: Uuid) -> Result<i64> {
    Ok(last_pos(tx, run_id, false).await?.map_or(0, |pos| pos + 1))
}

/// The run's messages still waiting for a step boundary, in the order sent.
async fn waiting(tx: &WriteTx, run_id: Uuid) -> Result<Vec<message::Model>> {
    Ok(message::Entity::find()
        .filter(message::Column::RunId.eq(run_id))
        .filter(message::Column::Pos.gte(PENDING_POS))
        .order_by_asc(message::Column::Pos)
        .all(&**tx)
        .await?)
}

/// At a step boundary of `row`, just before an inference (an earlier
/// inference and its whole batch of tool calls committed, never between a
/// call and its result): the messages steered into it join the run in the
/// order sent, `run.steered` says so, and the reply goes on in a new message
/// after them, so that every reader sees them where the model reads them.
/// Returns that message (its insert goes with the caller's append,
/// `writes`); `None`, and nothing written, when no message was waiting or
/// the run is asked to stop (its end settles them).
pub(in crate::store) async fn join(
    tx: &WriteTx,
    writes: &mut Writes,
    row: &run::Model,
    events: &mut Vec<NewEvent>,
) -> Result<Option<Uuid>> {
    if row.steering == 0 || row.cancel_requested {
        return Ok(None);
    }
    let waiting = waiting(tx, row.id).await?;
    run::Entity::update_many()
        .col_expr(run::Column::Steering, Expr::value(0))
        .col_expr(run::Column::Steered, Expr::value(true))
        .filter(run::Column::Id.eq(row.id))
        .exec(&**tx)
        .await?;
    if waiting.is_empty() {
        return Ok(None);
    }
    let mut pos = next_pos(tx, row.id).await?;
    for steered in waiting {
        let mut active: message::ActiveModel = steered.into();
        active.pos = Set(pos);
        active.update(&**tx).await?;
        pos += 1;
    }
    events.push(NewEvent::run_steered(row.id));
    Ok(Some(assistant_message_new(tx, writes, row, pos, events)))
}

/// Whether messages were steered into the run, or wait to be: what `settle`
/// has to settle when it ends.
pub(in crate::store) fn has_steered(row: &run::Model) -> bool {
    row.steering > 0 || row.steered
}

/// `row` ends: every steered message it did not answer is settled, so that
/// none is dropped. Those still waiting, and those that joined at a boundary
/// no answer of the model followed (the run ended at its next step's start:
/// a step limit, a deadline, a cancel), each get a `QUEUED` run of their
/// own, in the order sent: right after this run, as if sent with `QUEUE`
/// before the messages queued meanwhile; or, when a message interrupted the
/// run, after the runs already queued, so that the interrupting message's
/// run goes first.
pub(in crate::store) async fn settle(
    tx: &WriteTx,
    row: &run::Model,
    cause: EndCause,
    events: &mut Vec<NewEvent>,
) -> Result<()> {
    if !has_steered(row) {
        return Ok(());
    }
    let mut left = if row.steered {
        unanswered(tx, row).await?
    } else {
        Vec::new()
    };
    if row.steering > 0 {
        set_steering(tx, row.id, Expr::value(0)).await?;
        left.extend(waiting(tx, row.id).await?);
    }
    if left.is_empty() {
        return Ok(());
    }
    let interrupted = cause == EndCause::Interrupted
        || row.cancel_cause.as_deref() == Some(EndCause::Interrupted.as_str());
    if !interrupted {
        make_room(tx, row, left.len() as i64).await?;
    }
    for (after, message) in (1..).zip(left) {
        let seq = if interrupted {
            // After every run already queued: the interrupting message's
            // goes first, as the interrupt asked.
            tx.lock_conversation_for_run(row.conversation_id, &row.tenant)
                .await?
                .run_seq
        } else {
            row.seq + after
        };
        let run = insert_queued_run(
            tx,
            NewRun {
                id: new_id(),
                conversation_id: row.conversation_id,
                tenant: &row.tenant,
                principal: &row.principal,
                agent: &row.agent,
                trigger_message_id: message.id,
                max_attempts: row.max_attempts,
                seq,
            },
        )
        .await?;
        let mut active: message::ActiveModel = message.into();
        active.run_id = Set(Some(run.id));
        active.run_seq = Set(seq);
        active.pos = Set(0);
        active.update(&**tx).await?;
        events.extend(NewEvent::run_status(run.id, RunStatus::Queued));
    }
    Ok(())
}

/// The messages that joined `row` at a step boundary and that no answer of
/// the model followed: after its last reply with something the model said
/// or asked for in it.
async fn unanswered(tx: &WriteTx, row: &run::Model) -> Result<Vec<message::Model>> {
    let joined = message::Entity::find()
        .filter(message::Column::RunId.eq(row.id))
        .filter(message::Column::Pos.lt(PENDING_POS))
        .order_by_asc(message::Column::Pos)
        .all(&**tx)
        .await?;
    let replies: Vec<Uuid> = joined
        .iter()
        .filter(|m| m.role == MessageRole::Assistant.as_str())
        .map(|m| m.id)
        .collect();
    let said = part::Entity::find()
        .filter(part::Column::MessageId.is_in(replies))
        .filter(part::Column::Abandoned.eq(false))
        .all(&**tx)
        .await?;
    let answered = joined
        .iter()
        .filter(|m| {
            said.iter()
                .any(|p| p.message_id == m.id && says_something(p))
        })
        .map(|m| m.pos)
        .max()
        .unwrap_or(0);
    Ok(joined
        .into_iter()
        .filter(|m| m.role == MessageRole::User.as_str() && m.pos > answered)
        .collect())
}

/// Whether a reply's part answers: text, a tool call or a pause the model
/// asked for (not reasoning alone, a notice or an error).
fn says_something(part: &part::Model) -> bool {
    match part.kind.as_str() {
        k if k == PartKind::Text.as_str() => part.text.as_deref().is_some_and(|t| !t.is_empty()),
        k => ![PartKind::Reasoning, PartKind::Notice, PartKind::Error]
            .iter()
            .any(|other| other.as_str() == k),
    }
}

/// Moves the runs queued after `row`, and their messages, `n` places
/// later, so that the `n` runs made for `row`'s steered messages come right
/// after it. Readers see nothing move: the messages already stood there.
/// (Every later run is queued: runs execute in order and `row` is the
/// active one.) In two steps, through negative numbers, because a run's
/// number is unique within its conversation at every row written.
async fn make_room(tx: &WriteTx, row: &run::Model, n: i64) -> Result<()> {
    run::Entity::update_many()
        .col_expr(run::Column::Seq, Expr::cust(format!("-(seq + {n})")))
        .filter(run::Column::ConversationId.eq(row.conversation_id))
        .filter(run::Column::Seq.gt(row.seq))
        .exec(&**tx)
        .await?;
    run::Entity::update_many()
        .col_expr(run::Column::Seq, Expr::cust("-seq"))
        .filter(run::Column::ConversationId.eq(row.conversation_id))
        .filter(run::Column::Seq.lt(0))
        .exec(&**tx)
        .await?;
    message::Entity::update_many()
        .col_expr(
            message::Column::RunSeq,
            Expr::col(message::Column::RunSeq).add(n),
        )
        .filter(message::Column::ConversationId.eq(row.conversation_id))
        .filter(message::Column::RunSeq.gt(row.seq))
        .exec(&**tx)
        .await?;
    conversation::Entity::update_many()
        .col_expr(
            conversation::Column::RunSeq,
            Expr::col(conversation::Column::RunSeq).add(n),
        )
        .filter(conversation::Column::Id.eq(row.conversation_id))
        .exec(&**tx)
        .await?;
    Ok(())
}
