//! Questions, approvals and connection consents: the worker's commits that
//! open them and park the run, the API's commits that resolve them (once, re-queueing a parked
//! run in the same transaction), the worker's claim of a decision, and the
//! sweep of expired ones. Parking and resolving both lock the conversation
//! row first, so a resolution is never slept through: either it commits
//! before the park (which then sees it and does not park) or after it
//! (and finds the run waiting, and re-queues it).

use sea_orm::ActiveValue::Set;
use sea_orm::{ActiveModelTrait, ColumnTrait, EntityTrait, QueryFilter, QueryOrder};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

use super::commit::{
    self, Lease, PartContent, WriteTx, cancel_where, change_in, change_through_in, close_pending,
    interaction_event, kind_of, open, resolving_event,
};
use super::connections::{self as stored_connections, Owner, Sealed};
use super::entities::{consent, grant, interaction, run, tool_call};
use super::{Actor, Error, Result, Store, parse_stored, reads};
use crate::domain::PartKind;
use crate::domain::event::{EventKind, NewEvent};
use crate::domain::interaction::{
    Answer, ApprovalDecision, ConnectionGap, InteractionKind, InteractionStatus, QuestionSpec,
    validate_answers,
};
use crate::domain::run::{EndCause, RunError, RunInput, RunStatus, Usage, Waiting, transition};
use crate::domain::time::{new_id, now_millis};
use crate::domain::tool_call::{ToolInput, closing_output};

/// What an approval would run, stored when it is asked for: the resumed run
/// executes exactly this.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalRequest {
    pub tool_name: String,
    pub summary: String,
    pub risk_category: String,
    pub input: Value,
    pub estimated_cost_usd: Option<f64>,
    pub idempotency_key: String,
}

/// What a consent offer asks of a person, stored when the call pauses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectionRequest {
    pub provider: String,
    pub gap: ConnectionGap,
    pub required_scopes: Vec<String>,
    pub login_url: String,
    /// Whose consent it is: the login URL carries the state, so it is shown
    /// to this principal only (anyone else could bind their own account to
    /// it by sending the person a crafted callback).
    pub principal: String,
}

/// The server's half of a consent offer: the `state` the browser brings
/// back, and the sealed PKCE verifier.
pub struct NewConsent {
    pub state: String,
    pub principal: String,
    pub verifier: String,
    pub key_id: String,
}

/// How a consent came back.
#[derive(Clone)]
pub enum Completion {
    /// The token endpoint granted these (already sealed for the owner).
    Granted(Sealed),
    /// The person declined (the provider's `error`, e.g. `access_denied`).
    Declined(String),
}

/// What a resolved connection interaction records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
enum Consented {
    Granted,
    Declined { error: String },
}

fn to_json<T: Serialize>(value: &T) -> Result<Value> {
    serde_json::to_value(value).map_err(|e| Error::Corrupt(e.to_string()))
}

pub fn status_of(row: &interaction::Model) -> Result<InteractionStatus> {
    parse_stored(&row.status, "interaction status")
}

pub fn questions_of(row: &interaction::Model) -> Result<Vec<QuestionSpec>> {
    serde_json::from_value(row.request.clone()).map_err(|e| Error::Corrupt(e.to_string()))
}

pub fn answers_of(row: &interaction::Model) -> Result<Option<Vec<Answer>>> {
    row.resolution
        .clone()
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| Error::Corrupt(e.to_string()))
}

pub fn approval_of(row: &interaction::Model) -> Result<ApprovalRequest> {
    serde_json::from_value(row.request.clone()).map_err(|e| Error::Corrupt(e.to_string()))
}

pub fn connection_of(row: &interaction::Model) -> Result<ConnectionRequest> {
    serde_json::from_value(row.request.clone()).map_err(|e| Error::Corrupt(e.to_string()))
}

fn consented_of(row: &interaction::Model) -> Result<Option<Consented>> {
    row.resolution
        .clone()
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| Error::Corrupt(e.to_string()))
}

pub fn decision_of(row: &interaction::Model) -> Result<Option<ApprovalDecision>> {
    row.resolution
        .clone()
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| Error::Corrupt(e.to_string()))
}

async fn pending_of_run(
    tx: &WriteTx,
    run_id: Uuid,
    kind: InteractionKind,
) -> Result<Vec<interaction::Model>> {
    Ok(interaction::Entity::find()
        .filter(interaction::Column::RunId.eq(run_id))
        .filter(interaction::Column::Kind.eq(kind.as_str()))
        .filter(interaction::Column::Status.eq(InteractionStatus::Pending.as_str()))
        .order_by_asc(interaction::Column::Id)
        .all(&**tx)
        .await?)
}

/// Opens the interaction of `call` with its part, inside the caller's
/// transaction.
async fn open_interaction(
    tx: &WriteTx,
    row: &run::Model,
    call: &tool_call::Model,
    kind: InteractionKind,
    request: Value,
    ttl_ms: i64,
) -> Result<(Uuid, Vec<NewEvent>)> {
    let id = new_id();
    let message_id = commit::assistant_message(tx, row).await?;
    let part_kind = match kind {
        InteractionKind::Question => PartKind::Question,
        InteractionKind::Approval => PartKind::Approval,
        InteractionKind::Connection => PartKind::Connection,
    };
    let data = json!({ "interactionId": id, "toolCallId": call.id });
    let part = commit::add_part(tx, row, message_id, PartContent::data(part_kind, data)).await?;
    let now = now_millis();
    interaction::ActiveModel {
        id: Set(id),
        tenant: Set(row.tenant.clone()),
        conversation_id: Set(row.conversation_id),
        run_id: Set(row.id),
        tool_call_id: Set(call.id),
        part_id: Set(part.id),
        kind: Set(kind.as_str().to_owned()),
        status: Set(InteractionStatus::Pending.as_str().to_owned()),
        request: Set(request),
        resolution: Set(None),
        resolved_by: Set(None),
        created_at: Set(now),
        expires_at: Set(now + ttl_ms),
        resolved_at: Set(None),
        claimed_at: Set(None),
    }
    .insert(&**tx)
    .await?;
    let requested = match kind {
        InteractionKind::Question => EventKind::QuestionRequested,
        InteractionKind::Approval => EventKind::ApprovalRequested,
        InteractionKind::Connection => EventKind::ConnectionRequested,
    };
    Ok((
        id,
        vec![
            commit::part_event(EventKind::PartAdded, row, &part, None)?,
            interaction_event(requested, row.id, id),
        ],
    ))
}

/// `ask_questions`: the questions are stored as a pending interaction and
/// the call is answered at once with a result naming it. A second
/// `ask_questions` while one of the run is pending fails at once.
pub async fn ask(
    store: &Store,
    lease: &Lease,
    call: &tool_call::Model,
    specs: &[QuestionSpec],
    ttl_ms: i64,
) -> Result<()> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    let mut events = Vec::new();
    let pending = pending_of_run(&tx, row.id, InteractionKind::Question).await?;
    let (succeeded, output) = if pending.is_empty() {
        let (id, opened) = open_interaction(
            &tx,
            &row,
            call,
            InteractionKind::Question,
            to_json(&specs)?,
            ttl_ms,
        )
        .await?;
        events.extend(opened);
        let output = json!({
            "interactionId": id,
            "status": InteractionStatus::Pending.as_str(),
            "note": "The person has been asked; their answers follow in a user message.",
        });
        (true, output)
    } else {
        let output = json!({
            "error": "earlier questions of this run are still waiting for their answers; ask again once they arrive"
        });
        (false, output)
    };
    let (_, started) = change_in(&tx, &row, call.id, ToolInput::Start, |_, _| {}).await?;
    let (_, finished) = change_in(
        &tx,
        &row,
        call.id,
        ToolInput::Finish { succeeded },
        |active, _| {
            active.output = Set(Some(output));
            active.started_at = Set(Some(now_millis()));
        },
    )
    .await?;
    events.extend(started);
    events.extend(finished);
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(())
}

/// A gated call without a grant: it waits (`AWAITING`) for its own
/// decision, with what it would run stored.
pub async fn ask_approval(
    store: &Store,
    lease: &Lease,
    call: &tool_call::Model,
    request: &ApprovalRequest,
    ttl_ms: i64,
) -> Result<()> {
    let request = to_json(request)?;
    wait_for_person(
        store,
        lease,
        call,
        InteractionKind::Approval,
        request,
        ttl_ms,
        None,
    )
    .await
}

/// A call that needs a connection the principal lacks: it waits
/// (`AWAITING`) for the consent, whose `state` and verifier are kept for
/// `complete`.
pub async fn ask_connection(
    store: &Store,
    lease: &Lease,
    call: &tool_call::Model,
    request: &ConnectionRequest,
    consent: NewConsent,
    ttl_ms: i64,
) -> Result<()> {
    let kind = InteractionKind::Connection;
    let (provider, request) = (request.provider.clone(), to_json(request)?);
    let consent = Some((provider, consent));
    wait_for_person(store, lease, call, kind, request, ttl_ms, consent).await
}

/// The call waits (`AWAITING`) for a person, with its interaction (and the
/// consent it offers, for a connection) in one transaction.
async fn wait_for_person(
    store: &Store,
    lease: &Lease,
    call: &tool_call::Model,
    kind: InteractionKind,
    request: Value,
    ttl_ms: i64,
    consent: Option<(String, NewConsent)>,
) -> Result<()> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    let (_, mut events) = change_in(&tx, &row, call.id, ToolInput::Await, |_, _| {}).await?;
    let (id, opened) = open_interaction(&tx, &row, call, kind, request, ttl_ms).await?;
    if let Some((provider, consent)) = consent {
        consent::ActiveModel {
            state: Set(consent.state),
            interaction_id: Set(id),
            tenant: Set(row.tenant.clone()),
            principal: Set(consent.principal),
            provider: Set(provider),
            verifier: Set(consent.verifier),
            key_id: Set(consent.key_id),
            created_at: Set(now_millis()),
        }
        .insert(&*tx)
        .await?;
    }
    events.extend(opened);
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(())
}

/// Whether this call already waited for a consent (a second gap after one
/// fails instead of asking again).
pub async fn consented_before(store: &Store, call_id: Uuid) -> Result<bool> {
    Ok(interaction::Entity::find()
        .filter(interaction::Column::ToolCallId.eq(call_id))
        .filter(interaction::Column::Kind.eq(InteractionKind::Connection.as_str()))
        .one(store.db())
        .await?
        .is_some())
}

/// The provider of a consent of the run that expired: the run ends
/// `CONSENT_EXPIRED`.
pub async fn consent_expired(store: &Store, run_id: Uuid) -> Result<Option<ConnectionRequest>> {
    let found = interaction::Entity::find()
        .filter(interaction::Column::RunId.eq(run_id))
        .filter(interaction::Column::Kind.eq(InteractionKind::Connection.as_str()))
        .filter(interaction::Column::Status.eq(InteractionStatus::Expired.as_str()))
        .one(store.db())
        .await?;
    found.as_ref().map(connection_of).transpose()
}

/// Why a run whose consent expired ends.
pub fn consent_expired_message(request: &ConnectionRequest, ttl_ms: Option<i64>) -> String {
    let within = ttl_ms.map_or(String::new(), |ms| format!(" within {} s", ms / 1000));
    format!(
        "the consent to connect {} was not completed{within}",
        request.provider
    )
}

/// The consent a `state` belongs to, with its interaction, for the tenant
/// and principal it was bound to; `None` for anyone else.
pub async fn consent_of(
    store: &Store,
    actor: &Actor,
    state: &str,
) -> Result<Option<(consent::Model, interaction::Model)>> {
    let Some(found) = consent::Entity::find_by_id(state.to_owned())
        .one(store.db())
        .await?
    else {
        return Ok(None);
    };
    if found.tenant != actor.tenant || found.principal != actor.principal {
        return Ok(None);
    }
    let Some(row) = reads::interaction(store.db(), &actor.tenant, found.interaction_id).await?
    else {
        return Ok(None);
    };
    Ok(Some((found, row)))
}

/// Records how a consent came back, once: the connection stored (when it
/// was granted), the interaction resolved with `connection.completed`, and a
/// parked run re-queued, in one transaction. A consent already resolved
/// gives `false`; an expired or cancelled one is `NOT_FOUND`, like a
/// stranger's.
pub async fn complete(
    store: &Store,
    actor: &Actor,
    interaction_id: Uuid,
    completion: Completion,
) -> Result<(run::Model, bool)> {
    let Some(found) = reads::interaction(store.db(), &actor.tenant, interaction_id).await? else {
        return Err(Error::NotFound);
    };
    let Some(Locked {
        mut tx,
        conversation,
        row,
        run_row,
    }) = lock_for_resolution(store, actor, &found).await?
    else {
        return Err(Error::NotFound);
    };
    match status_of(&row)? {
        InteractionStatus::Pending => {}
        InteractionStatus::Resolved => return Ok((run_row, false)),
        InteractionStatus::Expired | InteractionStatus::Cancelled => return Err(Error::NotFound),
    }
    let request = connection_of(&row)?;
    let recorded = match completion {
        Completion::Granted(sealed) => {
            let owner = Owner {
                tenant: &actor.tenant,
                principal: &actor.principal,
                provider: &request.provider,
            };
            stored_connections::save_in(&*tx, owner, sealed).await?;
            Consented::Granted
        }
        Completion::Declined(error) => Consented::Declined { error },
    };
    mark_resolved(&tx, row, to_json(&recorded)?, actor, now_millis()).await?;
    let mut events = vec![interaction_event(
        EventKind::ConnectionCompleted,
        run_row.id,
        interaction_id,
    )];
    let run_row = resume_parked(&tx, run_row, InteractionKind::Connection, &mut events).await?;
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok((run_row, true))
}

/// A waiting call that can no longer run (its tool is gone): its
/// interaction closes (`CANCELLED`) and the call gets its one result,
/// `NOT_STARTED` with `output`, in one transaction.
pub async fn abandon_waiting(
    store: &Store,
    lease: &Lease,
    call_id: Uuid,
    output: Value,
) -> Result<()> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    let mut events = cancel_where(&tx, interaction::Column::ToolCallId.eq(call_id)).await?;
    // Taken with the call's result, whatever a person decided meanwhile:
    // an untaken resolution would keep a later park of the run waiting for
    // a take that never comes.
    interaction::Entity::update_many()
        .col_expr(
            interaction::Column::ClaimedAt,
            sea_orm::sea_query::Expr::value(now_millis()),
        )
        .filter(interaction::Column::ToolCallId.eq(call_id))
        .filter(interaction::Column::ClaimedAt.is_null())
        .exec(&*tx)
        .await?;
    let (_, changed) = change_in(&tx, &row, call_id, ToolInput::Cancel, |active, _| {
        active.output = Set(Some(output));
    })
    .await?;
    events.extend(changed);
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(())
}

/// Whether a standing grant lets this tool run without asking.
pub async fn granted(store: &Store, run: &run::Model, tool: &str) -> Result<bool> {
    let grants = grant::Entity::find()
        .filter(grant::Column::Tenant.eq(run.tenant.as_str()))
        .filter(grant::Column::Tool.eq(tool))
        .all(store.db())
        .await?;
    Ok(grants.iter().any(|g| {
        let principal = g.principal.as_deref() == Some(run.principal.as_str());
        match g.scope.as_str() {
            "CONVERSATION" => principal && g.conversation_id == Some(run.conversation_id),
            "ALWAYS" => principal,
            _ => false,
        }
    }))
}

/// Whether a person allowed this call and its run already took the
/// decision (a claim cut off before the call started resumes here).
pub async fn approved(store: &Store, call_id: Uuid) -> Result<bool> {
    let found = interaction::Entity::find()
        .filter(interaction::Column::ToolCallId.eq(call_id))
        .filter(interaction::Column::Kind.eq(InteractionKind::Approval.as_str()))
        .filter(interaction::Column::Status.eq(InteractionStatus::Resolved.as_str()))
        .filter(interaction::Column::ClaimedAt.is_not_null())
        .one(store.db())
        .await?;
    Ok(match found {
        Some(row) => !matches!(decision_of(&row)?, None | Some(ApprovalDecision::Deny)),
        None => false,
    })
}

/// What a waiting call may do now.
#[derive(Debug, Clone, PartialEq)]
pub enum Decided {
    /// Allowed (and claimed): it runs, with its stored input.
    Run,
    /// Allowed, claimed and committed `EXECUTING` in the same commit (see
    /// `Take::start`): its effect starts now, with this row's key.
    Started(Box<tool_call::Model>),
    /// Denied, expired or cancelled: it has its result.
    Settled,
    /// Nobody has decided yet.
    Pending,
}

/// How a waiting call takes its decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Take {
    /// Look without a write transaction first whether the call still waits:
    /// true for a call that asks again and again while the rest of its
    /// batch runs; false for a resumed run's first look, which a decision
    /// woke.
    pub read_first: bool,
    /// An allowed call is committed `EXECUTING` in the decision's own
    /// commit (`Decided::Started`): nothing stands between its decision and
    /// its effect (no connection to look up, and its caller holds a slot).
    /// Not once the run is asked to stop: no effect starts then.
    pub start: bool,
}

/// Takes the decision on a waiting call into the run, once: the
/// interaction is claimed with a compare-and-set, and the call moves
/// (allowed: back to `REQUESTED`, or on to `EXECUTING` with `take.start`;
/// denied: `DENIED`; expired: `EXPIRED`).
/// Of a call's interactions, the one it waits for: a pending one, else
/// the one decided but not yet taken into the run, else (all taken) any,
/// to say so. `None` when the call has none.
fn waited_for(interactions: Vec<interaction::Model>) -> Result<Option<interaction::Model>> {
    let mut taken = None;
    let mut decided = None;
    for found in interactions {
        if status_of(&found)? == InteractionStatus::Pending {
            return Ok(Some(found));
        }
        match found.claimed_at {
            None => decided = Some(found),
            Some(_) => taken = Some(found),
        }
    }
    Ok(decided.or(taken))
}

pub async fn take_decision(
    store: &Store,
    lease: &Lease,
    call_id: Uuid,
    take: Take,
) -> Result<Decided> {
    if take.read_first {
        let still_pending = interaction::Entity::find()
            .filter(interaction::Column::ToolCallId.eq(call_id))
            .filter(interaction::Column::Status.eq(InteractionStatus::Pending.as_str()))
            .one(store.db())
            .await?
            .is_some();
        if still_pending {
            return Ok(Decided::Pending);
        }
    }
    let (mut tx, conversation, row) = open(store, lease).await?;
    // The interaction the call waits for is chosen by state, never by id
    // order (ids follow the clocks of the processes that made them): an
    // approved call may wait for a connection next.
    let interactions = interaction::Entity::find()
        .filter(interaction::Column::ToolCallId.eq(call_id))
        .filter(interaction::Column::RunId.eq(row.id))
        .all(&*tx)
        .await?;
    let Some(found) = waited_for(interactions)? else {
        return Err(Error::NotFound);
    };
    let status = status_of(&found)?;
    if status == InteractionStatus::Pending {
        return Ok(Decided::Pending);
    }
    if found.claimed_at.is_some() {
        // Taken by an earlier claim: the call moved with it.
        return Ok(Decided::Settled);
    }
    let claimed = interaction::Entity::update_many()
        .col_expr(
            interaction::Column::ClaimedAt,
            sea_orm::sea_query::Expr::value(now_millis()),
        )
        .filter(interaction::Column::Id.eq(found.id))
        .filter(interaction::Column::ClaimedAt.is_null())
        .exec(&*tx)
        .await?;
    if claimed.rows_affected != 1 {
        return Ok(Decided::Settled);
    }
    let mut output = None;
    let (input, decided) = match (status, kind_of(&found)?) {
        (InteractionStatus::Resolved, InteractionKind::Connection) => match consented_of(&found)? {
            Some(Consented::Declined { error }) => {
                let provider = connection_of(&found)?.provider;
                output = Some(json!({
                    "error": format!(
                        "the person declined to connect {provider} ({error}); the tool did not run"
                    )
                }));
                (ToolInput::Reject, Decided::Settled)
            }
            _ => (ToolInput::Allow, Decided::Run),
        },
        (InteractionStatus::Resolved, _) => match decision_of(&found)? {
            Some(ApprovalDecision::Deny) => {
                (ToolInput::Refuse { expired: false }, Decided::Settled)
            }
            _ => (ToolInput::Allow, Decided::Run),
        },
        (InteractionStatus::Expired, _) => (ToolInput::Refuse { expired: true }, Decided::Settled),
        // Cancelled with its run, which closed the call too.
        _ => {
            store.commit(tx).await?;
            return Ok(Decided::Settled);
        }
    };
    let start = take.start && decided == Decided::Run && !row.cancel_requested;
    let inputs: &[ToolInput] = if start {
        &[input, ToolInput::Start]
    } else {
        &[input]
    };
    let (saved, events) = change_through_in(&tx, &row, call_id, inputs, |active, state| {
        if let Some(outcome) = state.outcome {
            active.output = Set(Some(output.unwrap_or_else(|| closing_output(outcome))));
        }
        if start {
            active.started_at = Set(Some(now_millis()));
        }
    })
    .await?;
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(if start {
        Decided::Started(Box::new(saved))
    } else {
        decided
    })
}

/// Parks the run until a person answers: `WAITING_FOR_*`, no worker holds
/// it. Returns false, changing nothing, when nothing of `waiting`'s kind is
/// pending any more or a decision already waits to be taken (it arrived
/// while the worker was busy). `end_step` counts the step as done (a
/// question's batch is complete; an approval's batch resumes on the next
/// claim).
pub async fn park(
    store: &Store,
    lease: &Lease,
    waiting: Waiting,
    usage: Usage,
    end_step: bool,
) -> Result<bool> {
    let (mut tx, conversation, row) = open(store, lease).await?;
    if row.cancel_requested {
        return Err(Error::CancelRequested);
    }
    let batch_kinds = [
        InteractionKind::Approval.as_str(),
        InteractionKind::Connection.as_str(),
    ];
    let waiting = match waiting {
        Waiting::Question => {
            if pending_of_run(&tx, row.id, InteractionKind::Question)
                .await?
                .is_empty()
            {
                return Ok(false);
            }
            Waiting::Question
        }
        // A batch waits for approvals and consents alike; the run shows the
        // kind of its earliest waiting call (call ids follow batch order).
        Waiting::Approval | Waiting::Connection => {
            let earliest = interaction::Entity::find()
                .filter(interaction::Column::RunId.eq(row.id))
                .filter(interaction::Column::Kind.is_in(batch_kinds))
                .filter(interaction::Column::Status.eq(InteractionStatus::Pending.as_str()))
                .order_by_asc(interaction::Column::ToolCallId)
                .one(&*tx)
                .await?;
            match earliest.as_ref().map(kind_of).transpose()? {
                None => return Ok(false),
                Some(InteractionKind::Connection) => Waiting::Connection,
                Some(_) => Waiting::Approval,
            }
        }
    };
    if waiting != Waiting::Question {
        // Only a decision this step's batch can still take counts: one of
        // an earlier step, or a cancelled one, is never taken, and would
        // keep the run from parking for good.
        let this_step = sea_orm::sea_query::Query::select()
            .column(tool_call::Column::Id)
            .from(tool_call::Entity)
            .and_where(tool_call::Column::RunId.eq(row.id))
            .and_where(tool_call::Column::Step.eq(row.steps))
            .to_owned();
        let untaken = interaction::Entity::find()
            .filter(interaction::Column::RunId.eq(row.id))
            .filter(interaction::Column::Kind.is_in(batch_kinds))
            .filter(interaction::Column::Status.is_in([
                InteractionStatus::Resolved.as_str(),
                InteractionStatus::Expired.as_str(),
            ]))
            .filter(interaction::Column::ClaimedAt.is_null())
            .filter(interaction::Column::ToolCallId.in_subquery(this_step))
            .one(&*tx)
            .await?;
        if untaken.is_some() {
            return Ok(false);
        }
    }
    let to = transition(RunStatus::Running, RunInput::Park(waiting))
        .map_err(|e| Error::Conflict(e.to_string()))?;
    let now = now_millis();
    let events = commit::step_events(&row, usage, end_step);
    let active_ms = row.active_ms + (now - row.claimed_at.unwrap_or(now)).max(0);
    let steps = row.steps + i32::from(end_step);
    let mut active: run::ActiveModel = row.into();
    active.status = Set(to.as_str().to_owned());
    active.steps = Set(steps);
    active.attempt = Set(1);
    active.input_tokens = Set(usage.input_tokens);
    active.output_tokens = Set(usage.output_tokens);
    active.cost_usd = Set(usage.cost_usd);
    active.active_ms = Set(active_ms);
    commit::clear_lease(&mut active);
    active.update(&*tx).await?;
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(true)
}

/// How a person resolves an interaction.
#[derive(Debug, Clone)]
pub enum Resolution {
    Answers(Vec<Answer>),
    Decision {
        decision: ApprovalDecision,
        /// Whether the tenant's policy offers `ALLOW_ALWAYS`.
        allow_always: bool,
    },
}

/// Records a person's resolution, once, with its event, the grant it
/// makes, and the move of a parked run back to the queue, in one
/// transaction. Returns the run and whether this call resumed it (true
/// exactly once per interaction). Repeating the recorded resolution gives
/// false; a different one, or one for an expired or cancelled interaction,
/// is `CONFLICT`; an interaction of another kind is `NOT_FOUND`.
pub async fn resolve(
    store: &Store,
    actor: &Actor,
    interaction_id: Uuid,
    resolution: Resolution,
) -> Result<(run::Model, bool)> {
    let wanted = match &resolution {
        Resolution::Answers(_) => InteractionKind::Question,
        Resolution::Decision { .. } => InteractionKind::Approval,
    };
    // Someone else's pause is not found, as a random id is: before anything
    // about it (its kind, whether an answer fits) is told.
    let Some(found) = reads::interaction_for(store.db(), actor, interaction_id).await? else {
        return Err(Error::NotFound);
    };
    if kind_of(&found)? != wanted {
        return Err(Error::NotFound);
    }
    // Checked before anything is written: bad input changes nothing.
    let (recorded, decision) = match &resolution {
        Resolution::Answers(answers) => {
            let valid =
                validate_answers(&questions_of(&found)?, answers).map_err(|e| Error::Invalid {
                    key: e.key,
                    message: e.message,
                })?;
            (to_json(&valid)?, None)
        }
        Resolution::Decision {
            decision,
            allow_always,
        } => {
            if *decision == ApprovalDecision::AllowAlways && !allow_always {
                return Err(Error::Forbidden(
                    "ALLOW_ALWAYS is not offered to this tenant".into(),
                ));
            }
            (to_json(decision)?, Some(*decision))
        }
    };
    let Some(Locked {
        mut tx,
        conversation,
        row,
        run_row,
    }) = lock_for_resolution(store, actor, &found).await?
    else {
        return Err(Error::Conflict("this interaction has expired".into()));
    };
    match status_of(&row)? {
        InteractionStatus::Pending => {}
        InteractionStatus::Resolved if row.resolution.as_ref() == Some(&recorded) => {
            return Ok((run_row, false));
        }
        InteractionStatus::Resolved => {
            return Err(Error::Conflict(
                "this interaction was already resolved differently".into(),
            ));
        }
        InteractionStatus::Expired | InteractionStatus::Cancelled => {
            return Err(Error::Conflict(format!(
                "this interaction is {}",
                row.status.to_lowercase()
            )));
        }
    }
    let now = now_millis();
    let run_id = row.run_id;
    let conversation_id = row.conversation_id;
    let tool_name = match wanted {
        InteractionKind::Approval => Some(approval_of(&row)?.tool_name),
        _ => None,
    };
    mark_resolved(&tx, row, recorded, actor, now).await?;
    // A grant covers the calls of the principal whose run asked (a delegate
    // decides for them), never anyone else's.
    let scope = match decision {
        Some(ApprovalDecision::AllowConversation) => Some(("CONVERSATION", Some(conversation_id))),
        Some(ApprovalDecision::AllowAlways) => Some(("ALWAYS", None)),
        _ => None,
    };
    if let (Some((scope, conversation)), Some(tool)) = (scope, tool_name) {
        grant::ActiveModel {
            id: Set(new_id()),
            tenant: Set(actor.tenant.clone()),
            scope: Set(scope.to_owned()),
            conversation_id: Set(conversation),
            principal: Set(Some(run_row.principal.clone())),
            tool: Set(tool),
            interaction_id: Set(interaction_id),
            created_at: Set(now),
        }
        .insert(&*tx)
        .await?;
    }
    let mut events = vec![interaction_event(
        resolving_event(wanted),
        run_id,
        interaction_id,
    )];
    let run_row = resume_parked(&tx, run_row, wanted, &mut events).await?;
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok((run_row, true))
}

/// Records who resolved an interaction, how and when.
async fn mark_resolved(
    tx: &WriteTx,
    row: interaction::Model,
    resolution: Value,
    actor: &Actor,
    at: i64,
) -> Result<()> {
    let mut active: interaction::ActiveModel = row.into();
    active.status = Set(InteractionStatus::Resolved.as_str().to_owned());
    active.resolution = Set(Some(resolution));
    active.resolved_by = Set(Some(actor.principal.clone()));
    active.resolved_at = Set(Some(at));
    active.update(&**tx).await?;
    Ok(())
}

/// The transaction that resolves an interaction: its conversation locked,
/// the interaction and its run read again under the lock.
struct Locked {
    tx: WriteTx,
    conversation: super::entities::conversation::Model,
    row: interaction::Model,
    run_row: run::Model,
}

/// `None` when the interaction was pending past its time: it expired there
/// and then (even if no sweeper had seen it yet), and nothing resolves it.
async fn lock_for_resolution(
    store: &Store,
    actor: &Actor,
    found: &interaction::Model,
) -> Result<Option<Locked>> {
    let mut tx = store.begin_write().await?;
    let conversation = tx
        .lock_conversation(found.conversation_id, &actor.tenant)
        .await?;
    let row = interaction::Entity::find_by_id(found.id)
        .one(&*tx)
        .await?
        .ok_or(Error::NotFound)?;
    let run_row = run::Entity::find_by_id(row.run_id)
        .one(&*tx)
        .await?
        .ok_or(Error::NotFound)?;
    if status_of(&row)? == InteractionStatus::Pending && row.expires_at <= now_millis() {
        if let Some(events) = expire_in(&tx, &row).await? {
            tx.append(&conversation, events).await?;
            store.commit(tx).await?;
        }
        return Ok(None);
    }
    Ok(Some(Locked {
        tx,
        conversation,
        row,
        run_row,
    }))
}

/// A run parked for an interaction of `kind` goes back to the queue (a
/// worker running it takes the resolution itself; a run parked for another
/// kind finds it when that one is resolved).
async fn resume_parked(
    tx: &WriteTx,
    run_row: run::Model,
    kind: InteractionKind,
    events: &mut Vec<NewEvent>,
) -> Result<run::Model> {
    let status = reads::run_status(&run_row)?;
    let waits_for_it = match kind {
        InteractionKind::Question => status == RunStatus::WaitingForQuestion,
        InteractionKind::Approval => status == RunStatus::WaitingForApproval,
        InteractionKind::Connection => status == RunStatus::WaitingForConnection,
    };
    if !waits_for_it {
        return Ok(run_row);
    }
    let to = transition(status, RunInput::Resume).map_err(|e| Error::Conflict(e.to_string()))?;
    let run_id = run_row.id;
    let mut active: run::ActiveModel = run_row.into();
    active.status = Set(to.as_str().to_owned());
    let saved = active.update(&**tx).await?;
    events.extend(NewEvent::run_status(run_id, to));
    Ok(saved)
}

/// Expires the pending interactions that are due, each in its own
/// transaction with its resolving event (the interaction reads `EXPIRED`)
/// and the re-queue of a parked run, which then goes on without them.
/// Returns how many expired.
pub async fn expire_due(store: &Store) -> Result<usize> {
    let due = interaction::Entity::find()
        .filter(interaction::Column::Status.eq(InteractionStatus::Pending.as_str()))
        .filter(interaction::Column::ExpiresAt.lte(now_millis()))
        .all(store.db())
        .await?;
    let mut expired = 0;
    for found in due {
        // One that cannot be expired is logged; the others still are.
        match expire_one(store, &found).await {
            Ok(true) => expired += 1,
            Ok(false) => {}
            Err(err) => tracing::warn!(
                interaction_id = %found.id,
                error = %err,
                "could not expire an interaction"
            ),
        }
    }
    Ok(expired)
}

pub(crate) async fn expire_one(store: &Store, found: &interaction::Model) -> Result<bool> {
    let mut tx = store.begin_write().await?;
    let conversation = tx
        .lock_conversation(found.conversation_id, &found.tenant)
        .await?;
    let Some(events) = expire_in(&tx, found).await? else {
        return Ok(false);
    };
    tx.append(&conversation, events).await?;
    store.commit(tx).await?;
    Ok(true)
}

/// Expires a pending interaction inside the caller's transaction (which
/// holds its conversation's lock): its resolving event, and the re-queue of
/// a run parked for it. `None` when it was no longer pending.
async fn expire_in(tx: &WriteTx, found: &interaction::Model) -> Result<Option<Vec<NewEvent>>> {
    let expired = close_pending(
        tx,
        interaction::Column::Id.eq(found.id),
        InteractionStatus::Expired,
    )
    .await?;
    if expired != 1 {
        return Ok(None);
    }
    let kind = kind_of(found)?;
    let mut events = vec![interaction_event(
        resolving_event(kind),
        found.run_id,
        found.id,
    )];
    let Some(run_row) = run::Entity::find_by_id(found.run_id).one(&**tx).await? else {
        return Ok(Some(events));
    };
    let status = reads::run_status(&run_row)?;
    if kind != InteractionKind::Connection {
        resume_parked(tx, run_row, kind, &mut events).await?;
    } else if !status.is_ended() && status != RunStatus::Running {
        // A consent past its time ends the run; a running one is ended by
        // its worker, which finds the consent expired.
        let message = consent_expired_message(
            &connection_of(found)?,
            Some(found.expires_at - found.created_at),
        );
        let error = RunError::of_cause(EndCause::ConsentExpired, message);
        events.extend(commit::end(tx, run_row, EndCause::ConsentExpired, Some(error)).await?);
    }
    Ok(Some(events))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::domain::interaction::ApprovalDecision;
    use crate::store::commands;
    use crate::store::test_support::{ada, event_seq, kinds_after, requested_call, temp_store};

    /// An interaction of one call, in `status`, taken into its run or not.
    fn of_call(id: Uuid, kind: &str, status: &str, claimed: bool) -> interaction::Model {
        interaction::Model {
            id,
            tenant: "acme".into(),
            conversation_id: Uuid::nil(),
            run_id: Uuid::nil(),
            tool_call_id: Uuid::nil(),
            part_id: Uuid::nil(),
            kind: kind.into(),
            status: status.into(),
            request: json!({}),
            resolution: None,
            resolved_by: None,
            created_at: 0,
            expires_at: 0,
            resolved_at: None,
            claimed_at: claimed.then_some(1),
        }
    }

    /// An approval taken, then a connection asked by a process whose clock
    /// is behind: the connection's id sorts first, and it is still the one
    /// the call waits for, pending and then resolved.
    #[test]
    fn the_interaction_a_call_waits_for_is_chosen_by_state_not_id_order() {
        let (earlier_id, later_id) = (Uuid::from_u128(2), Uuid::from_u128(1));
        let approval = of_call(earlier_id, "APPROVAL", "RESOLVED", true);
        let pending = of_call(later_id, "CONNECTION", "PENDING", false);
        let chosen = waited_for(vec![pending.clone(), approval.clone()]).unwrap();
        assert_eq!(chosen.map(|i| i.id), Some(later_id));
        let resolved = of_call(later_id, "CONNECTION", "RESOLVED", false);
        for order in [
            vec![resolved.clone(), approval.clone()],
            vec![approval.clone(), resolved.clone()],
        ] {
            assert_eq!(waited_for(order).unwrap().map(|i| i.id), Some(later_id));
        }
        // Both taken: either says the call moved on.
        let taken = of_call(later_id, "CONNECTION", "RESOLVED", true);
        let chosen = waited_for(vec![taken, approval]).unwrap().unwrap();
        assert!(chosen.claimed_at.is_some());
        assert!(waited_for(Vec::new()).unwrap().is_none());
    }

    /// A claimed run with one gated call waiting for approval, asked with
    /// this time to live: the lease, the run and the call.
    async fn waiting_call(store: &Store, ttl_ms: i64) -> (Lease, Uuid, Uuid) {
        let (lease, call) = requested_call(store, "demo_publish").await;
        let request = ApprovalRequest {
            tool_name: "demo_publish".into(),
            summary: "Publish".into(),
            risk_category: "publish".into(),
            input: json!({ "text": "x" }),
            estimated_cost_usd: None,
            idempotency_key: call.idempotency_key.clone(),
        };
        ask_approval(store, &lease, &call, &request, ttl_ms)
            .await
            .unwrap();
        let run_id = lease.run_id;
        (lease, run_id, call.id)
    }

    /// A person allows the run's one pending approval, once.
    async fn allow(store: &Store, run_id: Uuid) {
        let pending = reads::interactions_of_run(store.db(), "acme", run_id, "APPROVAL", "PENDING")
            .await
            .unwrap();
        let decision = Resolution::Decision {
            decision: ApprovalDecision::AllowOnce,
            allow_always: false,
        };
        resolve(store, &ada(), pending[0].id, decision)
            .await
            .unwrap();
    }

    const START_AT_ONCE: Take = Take {
        read_first: false,
        start: true,
    };

    #[tokio::test]
    async fn an_allowed_call_starts_in_the_commit_that_takes_its_decision() {
        let (store, dir) = temp_store().await;
        let (lease, run_id, call_id) = waiting_call(&store, 86_400_000).await;
        let untaken = take_decision(&store, &lease, call_id, START_AT_ONCE).await;
        assert_eq!(untaken.unwrap(), Decided::Pending);
        allow(&store, run_id).await;
        let before = event_seq(&store, lease.conversation_id).await;
        let Decided::Started(started) = take_decision(&store, &lease, call_id, START_AT_ONCE)
            .await
            .unwrap()
        else {
            panic!("the allowed call was not started with its decision");
        };
        assert_eq!(started.status, "EXECUTING");
        assert_eq!(started.attempt, 1);
        assert!(started.started_at.is_some());
        let stored = tool_call::Entity::find_by_id(call_id)
            .one(store.db())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stored, *started, "what was committed is what the run got");
        assert_eq!(
            kinds_after(&store, lease.conversation_id, before).await,
            ["tool.started", "part.updated"],
            "one commit, the call's start told once"
        );
        // Taken once: a second look finds it claimed.
        let again = take_decision(&store, &lease, call_id, START_AT_ONCE).await;
        assert_eq!(again.unwrap(), Decided::Settled);
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn a_run_asked_to_stop_takes_its_decision_without_starting_the_call() {
        let (store, dir) = temp_store().await;
        let (lease, run_id, call_id) = waiting_call(&store, 86_400_000).await;
        allow(&store, run_id).await;
        let answered = commands::cancel_run(&store, &ada(), run_id, None)
            .await
            .unwrap();
        assert!(answered.cancel_requested);
        let taken = take_decision(&store, &lease, call_id, START_AT_ONCE).await;
        assert_eq!(taken.unwrap(), Decided::Run);
        let stored = tool_call::Entity::find_by_id(call_id)
            .one(store.db())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            stored.status, "REQUESTED",
            "no effect starts once a stop is asked"
        );
        assert_eq!(stored.started_at, None);
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn a_cancel_committed_before_the_park_is_not_parked_over() {
        let (store, dir) = temp_store().await;
        let (lease, run_id, _) = waiting_call(&store, 86_400_000).await;
        // cancelRun lands while the worker is about to park: the run is
        // RUNNING, so only cancelRequested is set.
        let answered = commands::cancel_run(&store, &ada(), run_id, None)
            .await
            .unwrap();
        assert!(answered.cancel_requested);
        let parked = park(&store, &lease, Waiting::Approval, Usage::default(), false).await;
        assert!(matches!(parked, Err(Error::CancelRequested)), "{parked:?}");
        let row = reads::run(store.db(), "acme", run_id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.status, "RUNNING", "the worker ends it CANCELLED next");
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn an_interaction_past_its_expiry_is_expired_not_resolved() {
        let (store, dir) = temp_store().await;
        // Expired a second ago, and no sweeper has run.
        let (lease, run_id, _) = waiting_call(&store, -1000).await;
        assert!(
            park(&store, &lease, Waiting::Approval, Usage::default(), false)
                .await
                .unwrap()
        );
        let pending = reads::interactions_of_run(store.db(), "acme", run_id, "APPROVAL", "PENDING")
            .await
            .unwrap();
        let decision = Resolution::Decision {
            decision: ApprovalDecision::AllowOnce,
            allow_always: true,
        };
        let result = resolve(&store, &ada(), pending[0].id, decision).await;
        assert!(matches!(result, Err(Error::Conflict(_))), "{result:?}");
        let row = reads::interaction(store.db(), "acme", pending[0].id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.status, "EXPIRED");
        let run = reads::run(store.db(), "acme", run_id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(run.status, "QUEUED", "the run goes on without it");
        std::fs::remove_dir_all(dir).ok();
    }
}
