//! Reads shared by the API and the runtime. Each takes any connection, so the
//! API can run several in one snapshot. Every read is scoped to a tenant.

use std::collections::HashMap;

use sea_orm::{
    ColumnTrait, Condition, ConnectionTrait, EntityTrait, JoinType, Order, PrimaryKeyTrait,
    QueryFilter, QueryOrder, QuerySelect, Select,
};
use uuid::Uuid;

use super::entities::{conversation, event, interaction, message, part, run, tool_call};
use super::{Error, Result, parse_stored};
use crate::domain::cursor::Cursor;
use crate::domain::event::{Event, EventKind};
use crate::domain::run::RunStatus;

/// The most ids one `IN (…)` list binds: a model's history may name tens of
/// thousands of messages or parts, past what a statement may bind (32,766
/// variables on SQLite, 65,535 on PostgreSQL), so longer lists go in
/// several statements.
const IN_LIST_MAX: usize = 4_000;

/// One row by id, only if it belongs to `tenant`.
async fn owned<E, C>(
    db: &C,
    tenant_column: E::Column,
    tenant: &str,
    id: Uuid,
) -> Result<Option<E::Model>>
where
    E: EntityTrait,
    E::PrimaryKey: PrimaryKeyTrait<ValueType = Uuid>,
    C: ConnectionTrait,
{
    Ok(E::find_by_id(id)
        .filter(tenant_column.eq(tenant))
        .one(db)
        .await?)
}

pub async fn conversation<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    id: Uuid,
) -> Result<Option<conversation::Model>> {
    owned::<conversation::Entity, _>(db, conversation::Column::Tenant, tenant, id).await
}

/// The log heads (`event_seq`) of these conversations, whichever tenant's.
pub async fn heads<C: ConnectionTrait>(db: &C, ids: &[Uuid]) -> Result<Vec<(Uuid, i64)>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let rows = conversation::Entity::find()
        .select_only()
        .column(conversation::Column::Id)
        .column(conversation::Column::EventSeq)
        .filter(conversation::Column::Id.is_in(ids.iter().copied()))
        .into_tuple::<(Uuid, i64)>()
        .all(db)
        .await?;
    Ok(rows)
}

/// Newest first. Returns the page and whether more follow.
pub async fn conversations<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    first: u64,
    after: Option<Uuid>,
) -> Result<(Vec<conversation::Model>, bool)> {
    let mut query = conversation::Entity::find()
        .filter(conversation::Column::Tenant.eq(tenant))
        .order_by(conversation::Column::Id, Order::Desc)
        .limit(first + 1);
    if let Some(after) = after {
        query = query.filter(conversation::Column::Id.lt(after));
    }
    let mut rows = query.all(db).await?;
    let has_more = rows.len() as u64 > first;
    rows.truncate(first as usize);
    Ok((rows, has_more))
}

/// The last `last` messages (all without it) before `before` (when given),
/// oldest first.
/// A conversation's messages in reading order, the last `last` (all when
/// `None`), before the message `before` when given (in that order too).
pub async fn messages<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    conversation_id: Uuid,
    last: Option<u64>,
    before: Option<Uuid>,
) -> Result<Vec<message::Model>> {
    let mut query = message::Entity::find()
        .filter(message::Column::Tenant.eq(tenant))
        .filter(message::Column::ConversationId.eq(conversation_id));
    if let Some(before) = before {
        // A message of another conversation, or none, has nothing before it.
        let Some(mark) = message(db, tenant, before)
            .await?
            .filter(|m| m.conversation_id == conversation_id)
        else {
            return Ok(Vec::new());
        };
        query = query.filter(ReadingOrder::before(&mark));
    }
    let mut rows = ReadingOrder::sort(query, Order::Desc)
        .limit(last)
        .all(db)
        .await?;
    rows.reverse();
    Ok(rows)
}

/// A conversation's messages of the run numbered `from` and every later
/// one (`runs.seq`), in reading order, with their parts (each message's in
/// order), in one query: a range of the `(conversation_id, run_seq)`
/// index, however long the conversation before it, joined to each
/// message's parts by their `(message_id, idx)` index.
pub async fn messages_from_run<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    conversation_id: Uuid,
    from: i64,
) -> Result<(Vec<message::Model>, HashMap<Uuid, Vec<part::Model>>)> {
    let of_message = part::Entity::belongs_to(message::Entity)
        .from(part::Column::MessageId)
        .to(message::Column::Id)
        .into();
    let query = message::Entity::find()
        .filter(message::Column::Tenant.eq(tenant))
        .filter(message::Column::ConversationId.eq(conversation_id))
        .filter(message::Column::RunSeq.gte(from));
    let rows = ReadingOrder::sort(query, Order::Asc)
        .join_rev(JoinType::LeftJoin, of_message)
        .select_also(part::Entity)
        .order_by(part::Column::Idx, Order::Asc)
        .all(db)
        .await?;
    let mut messages: Vec<message::Model> = Vec::new();
    let mut parts: HashMap<Uuid, Vec<part::Model>> = HashMap::new();
    for (message, part) in rows {
        if let Some(part) = part {
            parts.entry(message.id).or_default().push(part);
        }
        // A message's rows are adjacent: it comes once per part.
        if messages.last().is_none_or(|last| last.id != message.id) {
            messages.push(message);
        }
    }
    Ok((messages, parts))
}

/// The one order a conversation's messages are read in, by people
/// (`Conversation.messages`) and by the model (its history) alike: by run
/// (`run_seq`), then by place within the run (`pos`: the message that
/// started it, its reply, then steered messages and the reply's later
/// messages where they joined; messages still waiting to steer it last),
/// then by id. Not by id alone: a reply is made when its run starts, after
/// messages queued meanwhile, and ids come from the clocks of several
/// processes.
pub struct ReadingOrder;

impl ReadingOrder {
    fn sort(query: Select<message::Entity>, order: Order) -> Select<message::Entity> {
        query
            .order_by(message::Column::RunSeq, order.clone())
            .order_by(message::Column::Pos, order.clone())
            .order_by(message::Column::Id, order)
    }

    /// The messages that come before `mark`.
    fn before(mark: &message::Model) -> Condition {
        Condition::any()
            .add(message::Column::RunSeq.lt(mark.run_seq))
            .add(
                Condition::all()
                    .add(message::Column::RunSeq.eq(mark.run_seq))
                    .add(
                        Condition::any().add(message::Column::Pos.lt(mark.pos)).add(
                            Condition::all()
                                .add(message::Column::Pos.eq(mark.pos))
                                .add(message::Column::Id.lt(mark.id)),
                        ),
                    ),
            )
    }
}

pub async fn message<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    id: Uuid,
) -> Result<Option<message::Model>> {
    owned::<message::Entity, _>(db, message::Column::Tenant, tenant, id).await
}

/// The parts of several messages in one query (per `IN_LIST_MAX` messages),
/// each message's in order.
pub async fn parts_of<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    message_ids: &[Uuid],
) -> Result<HashMap<Uuid, Vec<part::Model>>> {
    let mut grouped: HashMap<Uuid, Vec<part::Model>> = HashMap::new();
    for chunk in message_ids.chunks(IN_LIST_MAX) {
        let rows = part::Entity::find()
            .filter(part::Column::Tenant.eq(tenant))
            .filter(part::Column::MessageId.is_in(chunk.iter().copied()))
            .order_by(part::Column::MessageId, Order::Asc)
            .order_by(part::Column::Idx, Order::Asc)
            .all(db)
            .await?;
        for row in rows {
            grouped.entry(row.message_id).or_default().push(row);
        }
    }
    Ok(grouped)
}

pub async fn part<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    id: Uuid,
) -> Result<Option<part::Model>> {
    owned::<part::Entity, _>(db, part::Column::Tenant, tenant, id).await
}

pub async fn run<C: ConnectionTrait>(db: &C, tenant: &str, id: Uuid) -> Result<Option<run::Model>> {
    owned::<run::Entity, _>(db, run::Column::Tenant, tenant, id).await
}

/// A conversation's last `last` runs, oldest first (by `seq`).
pub async fn runs_of<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    conversation_id: Uuid,
    last: u64,
) -> Result<Vec<run::Model>> {
    let mut rows = run::Entity::find()
        .filter(run::Column::Tenant.eq(tenant))
        .filter(run::Column::ConversationId.eq(conversation_id))
        .order_by(run::Column::Seq, Order::Desc)
        .limit(last)
        .all(db)
        .await?;
    rows.reverse();
    Ok(rows)
}

/// A conversation's runs that have not ended, in their order (`seq`).
pub async fn unended_runs<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    conversation_id: Uuid,
) -> Result<Vec<run::Model>> {
    // Sorted here, not in SQL: with an `ORDER BY seq` SQLite walks the
    // `(conversation_id, seq)` index through every run the conversation ever
    // had to save a sort, instead of reading the few unended ones from
    // `(conversation_id, status, seq)`.
    let mut rows = run::Entity::find()
        .filter(run::Column::Tenant.eq(tenant))
        .filter(run::Column::ConversationId.eq(conversation_id))
        .filter(run::Column::Status.is_in(RunStatus::not_ended().map(RunStatus::as_str)))
        .all(db)
        .await?;
    rows.sort_by_key(|row| row.seq);
    Ok(rows)
}

/// Persisted events after `after`, oldest first, at most `limit`.
pub async fn events_after<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    conversation_id: Uuid,
    after: Cursor,
    limit: u64,
) -> Result<Vec<Event>> {
    event::Entity::find()
        .filter(event::Column::Tenant.eq(tenant))
        .filter(event::Column::ConversationId.eq(conversation_id))
        .filter(event::Column::Seq.gt(after.0))
        .order_by(event::Column::Seq, Order::Asc)
        .limit(limit)
        .all(db)
        .await?
        .into_iter()
        .map(event_from_row)
        .collect()
}

fn event_from_row(row: event::Model) -> Result<Event> {
    let kind = EventKind::parse(&row.kind)
        .ok_or_else(|| Error::Corrupt(format!("event kind {:?}", row.kind)))?;
    let body = serde_json::from_value(row.payload)
        .map_err(|e| Error::Corrupt(format!("event payload: {e}")))?;
    Ok(Event {
        conversation_id: row.conversation_id,
        cursor: Cursor(row.seq),
        kind,
        run_id: row.run_id,
        at: row.created_at,
        body,
    })
}

/// A run's status, read back with the fail-closed parser.
pub fn run_status(row: &run::Model) -> Result<RunStatus> {
    parse_stored(&row.status, "run status")
}

/// A run's tool calls (its first `first`, when given), in the order the
/// model asked for them.
pub async fn tool_calls_of_run<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    run_id: Uuid,
    first: Option<u64>,
) -> Result<Vec<tool_call::Model>> {
    Ok(tool_call::Entity::find()
        .filter(tool_call::Column::Tenant.eq(tenant))
        .filter(tool_call::Column::RunId.eq(run_id))
        .order_by(tool_call::Column::Step, Order::Asc)
        .order_by(tool_call::Column::Idx, Order::Asc)
        .limit(first)
        .all(db)
        .await?)
}

/// The tool calls that `TOOL_CALL` parts show, by part, in one query (per
/// `IN_LIST_MAX` parts).
pub async fn tool_calls_of_parts<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    part_ids: &[Uuid],
) -> Result<HashMap<Uuid, tool_call::Model>> {
    by_part::<tool_call::Entity, _>(
        db,
        (tool_call::Column::Tenant, tool_call::Column::PartId),
        tenant,
        part_ids,
        |row| row.part_id,
    )
    .await
}

/// Rows of `tenant` shown by the given parts, by part, in one query per
/// `IN_LIST_MAX` parts.
async fn by_part<E, C>(
    db: &C,
    (tenant_column, part_column): (E::Column, E::Column),
    tenant: &str,
    part_ids: &[Uuid],
    part_of: fn(&E::Model) -> Uuid,
) -> Result<HashMap<Uuid, E::Model>>
where
    E: EntityTrait,
    C: ConnectionTrait,
{
    let mut found = HashMap::new();
    for chunk in part_ids.chunks(IN_LIST_MAX) {
        let rows = E::find()
            .filter(tenant_column.eq(tenant))
            .filter(part_column.is_in(chunk.iter().copied()))
            .all(db)
            .await?;
        found.extend(rows.into_iter().map(|row| (part_of(&row), row)));
    }
    Ok(found)
}

/// An interaction of the tenant.
pub async fn interaction<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    id: Uuid,
) -> Result<Option<interaction::Model>> {
    owned::<interaction::Entity, _>(db, interaction::Column::Tenant, tenant, id).await
}

/// How many runs of `principal`'s, or of the whole tenant's without one,
/// are waiting to run (queued, or waiting for a retry).
pub async fn waiting_runs_of<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    principal: Option<&str>,
) -> Result<u64> {
    use sea_orm::PaginatorTrait;
    let mut waiting = run::Entity::find()
        .filter(
            run::Column::Status
                .is_in([RunStatus::Queued.as_str(), RunStatus::RetryPending.as_str()]),
        )
        .filter(run::Column::Tenant.eq(tenant));
    if let Some(principal) = principal {
        waiting = waiting.filter(run::Column::Principal.eq(principal));
    }
    Ok(waiting.count(db).await?)
}

/// An interaction of a run `actor` may act on (its own, or any of its
/// tenant's for a delegate), in one statement; `None` for anyone else's, as
/// for an id that does not exist.
pub async fn interaction_for<C: ConnectionTrait>(
    db: &C,
    actor: &super::Actor,
    id: Uuid,
) -> Result<Option<interaction::Model>> {
    let mut found = interaction::Entity::find_by_id(id)
        .filter(interaction::Column::Tenant.eq(actor.tenant.as_str()));
    if !actor.delegate {
        found = found.filter(
            interaction::Column::RunId.in_subquery(
                sea_orm::sea_query::Query::select()
                    .column(run::Column::Id)
                    .from(run::Entity)
                    .and_where(run::Column::Tenant.eq(actor.tenant.as_str()))
                    .and_where(run::Column::Principal.eq(actor.principal.as_str()))
                    .to_owned(),
            ),
        );
    }
    Ok(found.one(db).await?)
}

/// A run's interactions of one kind and status, in the order of their tool
/// calls (the calls of a batch open theirs concurrently).
pub async fn interactions_of_run<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    run_id: Uuid,
    kind: &str,
    status: &str,
) -> Result<Vec<interaction::Model>> {
    let mut rows = interaction::Entity::find()
        .filter(interaction::Column::Tenant.eq(tenant))
        .filter(interaction::Column::RunId.eq(run_id))
        .filter(interaction::Column::Kind.eq(kind))
        .filter(interaction::Column::Status.eq(status))
        .all(db)
        .await?;
    let order: HashMap<Uuid, (i32, i32)> = tool_calls_of_run(db, tenant, run_id, None)
        .await?
        .into_iter()
        .map(|call| (call.id, (call.step, call.idx)))
        .collect();
    rows.sort_by_key(|row| order.get(&row.tool_call_id).copied());
    Ok(rows)
}

/// The interactions that QUESTION and APPROVAL parts show, by part, in one
/// query (per `IN_LIST_MAX` parts).
pub async fn interactions_of_parts<C: ConnectionTrait>(
    db: &C,
    tenant: &str,
    part_ids: &[Uuid],
) -> Result<HashMap<Uuid, interaction::Model>> {
    by_part::<interaction::Entity, _>(
        db,
        (interaction::Column::Tenant, interaction::Column::PartId),
        tenant,
        part_ids,
        |row| row.part_id,
    )
    .await
}

/// Which runs workers may claim, as SQL over `runs r`.
pub(in crate::store) struct Claimable {
    /// The condition: queued, or due for another attempt at `due` (a
    /// parameter), with no earlier run of its conversation unended.
    pub condition: String,
    /// Since when each has been ready: its next attempt's time, or when it
    /// was created or, if later, when the run before it ended. Claims take
    /// the longest ready first.
    pub ready_since: String,
}

impl Claimable {
    /// Whether run `r` is behind an unended earlier run of its
    /// conversation, as SQL.
    pub(in crate::store) fn behind_unended() -> String {
        let unended = RunStatus::not_ended()
            .map(|s| format!("'{}'", s.as_str()))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "EXISTS (SELECT 1 FROM runs o WHERE o.conversation_id = r.conversation_id \
             AND o.seq < r.seq AND o.status IN ({unended}))"
        )
    }

    pub(in crate::store) fn sql(backend: sea_orm::DatabaseBackend, due: &str) -> Claimable {
        let behind = Claimable::behind_unended();
        let greatest = match backend {
            sea_orm::DatabaseBackend::Postgres => "GREATEST",
            _ => "MAX",
        };
        Claimable {
            condition: format!(
                "(r.status = 'QUEUED' OR (r.status = 'RETRY_PENDING' AND r.next_attempt_at <= {due})) \
                 AND NOT {behind}"
            ),
            ready_since: format!(
                "CASE WHEN r.status = 'RETRY_PENDING' THEN r.next_attempt_at \
                 ELSE {greatest}(r.created_at, COALESCE((SELECT p.ended_at FROM runs p \
                   WHERE p.conversation_id = r.conversation_id AND p.seq < r.seq \
                   ORDER BY p.seq DESC LIMIT 1), 0)) END"
            ),
        }
    }
}
