use async_graphql::{Context, ID, Object, SimpleObject};

use super::context::{services, snapshot, viewer};
use super::cost;
use super::error::{ApiError, ApiResult};
use super::events::{EventPage, TransportEvent};
use super::types::{
    Connection, Conversation, ConversationConnection, Interaction, Message, Part, PendingApproval,
    PendingConnection, PendingQuestion, Run, parse_id, to_id,
};
use crate::domain::cursor::Cursor;
use crate::domain::interaction::{InteractionKind, InteractionStatus};
use crate::domain::time::now_millis;
use crate::store::{connections, interactions, reads};

pub struct Query;

/// The authenticated caller.
#[derive(SimpleObject)]
#[graphql(name = "Viewer")]
pub struct ViewerInfo {
    tenant: String,
    principal: String,
}

#[derive(SimpleObject)]
pub struct Agent {
    name: String,
    model: String,
    tools: Vec<String>,
}

pub fn parse_cursor(text: &str) -> ApiResult<Cursor> {
    Cursor::parse(text).map_err(|_| ApiError::bad_key("after", "malformed cursor"))
}

#[Object(name = "TenantQuery")]
impl Query {
    async fn me(&self, ctx: &Context<'_>) -> ApiResult<ViewerInfo> {
        let viewer = viewer(ctx)?;
        Ok(ViewerInfo {
            tenant: viewer.tenant.clone(),
            principal: viewer.principal.clone(),
        })
    }

    async fn agents(&self, ctx: &Context<'_>) -> Vec<Agent> {
        services(ctx)
            .config
            .agents
            .iter()
            .map(|agent| Agent {
                name: agent.name.clone(),
                model: agent.model_name().to_owned(),
                tools: agent.tools.clone(),
            })
            .collect()
    }

    async fn conversation(&self, ctx: &Context<'_>, id: ID) -> ApiResult<Option<Conversation>> {
        let Some(id) = parse_id(&id) else {
            return Ok(None);
        };
        let db = snapshot(ctx).await?;
        let row = reads::conversation(db, &viewer(ctx)?.tenant, id).await?;
        Ok(row.map(Conversation))
    }

    /// Newest first.
    #[graphql(
        complexity = "cost::list(first.unwrap_or(cost::CONVERSATIONS_PAGE), child_complexity)"
    )]
    async fn conversations(
        &self,
        ctx: &Context<'_>,
        #[graphql(default_with = "Some(cost::CONVERSATIONS_PAGE)")] first: Option<i32>,
        after: Option<String>,
    ) -> ApiResult<ConversationConnection> {
        let first = cost::page(
            "first",
            first,
            cost::CONVERSATIONS_PAGE,
            cost::MAX_CONVERSATIONS_PAGE,
        )?;
        let after = match after {
            Some(text) => Some(
                parse_id(&ID(text))
                    .ok_or_else(|| ApiError::bad_key("after", "malformed cursor"))?,
            ),
            None => None,
        };
        let db = snapshot(ctx).await?;
        let (rows, has_more) =
            reads::conversations(db, &viewer(ctx)?.tenant, first as u64, after).await?;
        Ok(ConversationConnection {
            end_cursor: rows.last().map(|c| to_id(c.id).to_string()),
            nodes: rows.into_iter().map(Conversation).collect(),
            has_more,
        })
    }

    async fn message(&self, ctx: &Context<'_>, id: ID) -> ApiResult<Option<Message>> {
        let Some(id) = parse_id(&id) else {
            return Ok(None);
        };
        let db = snapshot(ctx).await?;
        let row = reads::message(db, &viewer(ctx)?.tenant, id).await?;
        Ok(row.map(Message::new))
    }

    async fn part(&self, ctx: &Context<'_>, id: ID) -> ApiResult<Option<Part>> {
        let Some(id) = parse_id(&id) else {
            return Ok(None);
        };
        let db = snapshot(ctx).await?;
        let row = reads::part(db, &viewer(ctx)?.tenant, id).await?;
        Ok(row.map(Part))
    }

    async fn run(&self, ctx: &Context<'_>, id: ID) -> ApiResult<Option<Run>> {
        let Some(id) = parse_id(&id) else {
            return Ok(None);
        };
        let db = snapshot(ctx).await?;
        let row = reads::run(db, &viewer(ctx)?.tenant, id).await?;
        Ok(row.map(Run))
    }

    /// The run's pending questions; null once resolved.
    async fn pending_question(
        &self,
        ctx: &Context<'_>,
        run_id: ID,
    ) -> ApiResult<Option<PendingQuestion>> {
        let pending = pending(ctx, &run_id, InteractionKind::Question).await?;
        Ok(pending.into_iter().next().map(PendingQuestion))
    }

    /// The earliest pending approval of the run; null when none.
    async fn pending_approval(
        &self,
        ctx: &Context<'_>,
        run_id: ID,
    ) -> ApiResult<Option<PendingApproval>> {
        Ok(approvals(ctx, &run_id).await?.into_iter().next())
    }

    /// Every pending approval of the run, in batch order.
    async fn pending_approvals(
        &self,
        ctx: &Context<'_>,
        run_id: ID,
    ) -> ApiResult<Vec<PendingApproval>> {
        approvals(ctx, &run_id).await
    }

    /// The run's pending consent; null once it is resolved, and for anyone
    /// but the principal whose consent it is.
    async fn pending_connection(
        &self,
        ctx: &Context<'_>,
        run_id: ID,
    ) -> ApiResult<Option<PendingConnection>> {
        let principal = &viewer(ctx)?.principal;
        let pending = pending(ctx, &run_id, InteractionKind::Connection).await?;
        for interaction in pending {
            if &interactions::connection_of(&interaction.0)?.principal == principal {
                return Ok(Some(PendingConnection(interaction)));
            }
        }
        Ok(None)
    }

    /// The caller's own connections (its tenant and principal); never a
    /// token.
    async fn connections(&self, ctx: &Context<'_>) -> ApiResult<Vec<Connection>> {
        let viewer = viewer(ctx)?;
        let db = snapshot(ctx).await?;
        let rows = connections::of_principal(db, &viewer.tenant, &viewer.principal).await?;
        Ok(rows.into_iter().map(Connection).collect())
    }

    /// Persisted events of a conversation after `after` (from the first
    /// event without it), oldest first.
    #[graphql(complexity = "cost::list(first.unwrap_or(cost::EVENTS_PAGE), child_complexity)")]
    async fn events(
        &self,
        ctx: &Context<'_>,
        conversation_id: ID,
        after: Option<String>,
        #[graphql(default_with = "Some(cost::EVENTS_PAGE)")] first: Option<i32>,
    ) -> ApiResult<EventPage> {
        let first = cost::page("first", first, cost::EVENTS_PAGE, cost::MAX_EVENTS_PAGE)?;
        let after = after.as_deref().map(parse_cursor).transpose()?;
        let conversation_id = parse_id(&conversation_id).ok_or(ApiError::NotFound)?;
        let tenant = &viewer(ctx)?.tenant;
        let db = snapshot(ctx).await?;
        reads::conversation(db, tenant, conversation_id)
            .await?
            .ok_or(ApiError::NotFound)?;
        let mut events = reads::events_after(
            db,
            tenant,
            conversation_id,
            after.unwrap_or(Cursor::START),
            first as u64 + 1,
        )
        .await?;
        let has_more = events.len() > first;
        events.truncate(first);
        let end_cursor = events
            .last()
            .map(|e| e.cursor)
            .or(after)
            .map(|c| c.to_string());
        Ok(EventPage {
            events: events.iter().map(TransportEvent::from).collect(),
            end_cursor,
            has_more,
        })
    }
}

/// A run's pending interactions of one kind, in the order they were asked.
async fn pending(
    ctx: &Context<'_>,
    run_id: &ID,
    kind: InteractionKind,
) -> ApiResult<Vec<Interaction>> {
    let Some(run_id) = parse_id(run_id) else {
        return Ok(Vec::new());
    };
    let db = snapshot(ctx).await?;
    let rows = reads::interactions_of_run(
        db,
        &viewer(ctx)?.tenant,
        run_id,
        kind.as_str(),
        InteractionStatus::Pending.as_str(),
    )
    .await?;
    // Past its time it is no longer pending, even before the sweeper says so.
    let now = now_millis();
    Ok(rows
        .into_iter()
        .filter(|row| row.expires_at > now)
        .map(Interaction)
        .collect())
}

async fn approvals(ctx: &Context<'_>, run_id: &ID) -> ApiResult<Vec<PendingApproval>> {
    let tenant = &viewer(ctx)?.tenant;
    let allow_always = services(ctx).config.policy.for_tenant(tenant).allow_always;
    let pending = pending(ctx, run_id, InteractionKind::Approval).await?;
    Ok(pending
        .into_iter()
        .map(|interaction| PendingApproval {
            interaction,
            allow_always,
        })
        .collect())
}
