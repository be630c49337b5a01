//! GraphQL object types over stored rows.

use async_graphql::{Context, ID, Json, Object, Scalar, ScalarType, Value};
use uuid::Uuid;

use super::context::{
    InteractionOfPart, ToolCallOfPart, full_output_allowance, services, shown_by_part, snapshot,
    viewer,
};
use super::cost;
use super::error::{ApiError, ApiResult};
use crate::domain::cursor::Cursor;
use crate::domain::interaction::{
    Answer, ApprovalDecision, ConnectionGap, InteractionStatus, QuestionSpec,
};
use crate::domain::run::{EndCause, RunError, RunStatus, Usage};
use crate::domain::time::{Millis, from_rfc3339, now_millis, to_rfc3339};
use crate::domain::tool_call::{ToolCallStatus, ToolOutcome};
use crate::domain::{MessageRole, PartKind, PartState};
use crate::store::connections;
use crate::store::entities::{
    connection, conversation, interaction, message, part, run, tool_call,
};
use crate::store::interactions::{self, ApprovalRequest, ConnectionRequest};
use crate::store::{parse_stored, reads};

/// RFC 3339 in UTC with `Z` and exactly milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DateTime(pub Millis);

#[Scalar(name = "DateTime")]
impl ScalarType for DateTime {
    fn parse(value: Value) -> async_graphql::InputValueResult<Self> {
        match &value {
            Value::String(text) => from_rfc3339(text)
                .map(DateTime)
                .ok_or_else(|| async_graphql::InputValueError::custom("expected RFC 3339")),
            _ => Err(async_graphql::InputValueError::expected_type(value)),
        }
    }

    fn to_value(&self) -> Value {
        Value::String(to_rfc3339(self.0).unwrap_or_default())
    }
}

/// A malformed id counts as unknown.
pub fn parse_id(id: &ID) -> Option<Uuid> {
    Uuid::try_parse(id.as_str()).ok()
}

pub fn to_id(id: Uuid) -> ID {
    ID(id.to_string())
}

pub struct Conversation(pub conversation::Model);

#[Object]
impl Conversation {
    async fn id(&self) -> ID {
        to_id(self.0.id)
    }

    async fn agent(&self) -> &str {
        &self.0.agent
    }

    async fn title(&self) -> Option<&str> {
        self.0.title.as_deref()
    }

    async fn created_at(&self) -> DateTime {
        DateTime(self.0.created_at)
    }

    /// The last `last` messages (before `before`, when given), in reading
    /// order: the order the model reads them in, each run's message
    /// followed by its reply, runs in their order.
    #[graphql(complexity = "cost::list(last.unwrap_or(cost::MESSAGES_PAGE), child_complexity)")]
    async fn messages(
        &self,
        ctx: &Context<'_>,
        #[graphql(default_with = "Some(cost::MESSAGES_PAGE)")] last: Option<i32>,
        before: Option<ID>,
    ) -> ApiResult<Vec<Message>> {
        let last = cost::page("last", last, cost::MESSAGES_PAGE, cost::MAX_PAGE)?;
        let before = match before {
            Some(id) => Some(parse_id(&id).ok_or(ApiError::NotFound)?),
            None => None,
        };
        let tenant = &viewer(ctx)?.tenant;
        let db = snapshot(ctx).await?;
        let rows = reads::messages(db, tenant, self.0.id, Some(last as u64), before).await?;
        let ids: Vec<Uuid> = rows.iter().map(|m| m.id).collect();
        let mut parts = reads::parts_of(db, tenant, &ids).await?;
        Ok(rows
            .into_iter()
            .map(|row| {
                let preloaded = parts.remove(&row.id).unwrap_or_default();
                Message::with_parts(row, preloaded)
            })
            .collect())
    }

    /// The last `last` runs of the conversation, oldest first.
    #[graphql(complexity = "cost::list(last.unwrap_or(cost::RUNS_PAGE), child_complexity)")]
    async fn runs(
        &self,
        ctx: &Context<'_>,
        #[graphql(default_with = "Some(cost::RUNS_PAGE)")] last: Option<i32>,
    ) -> ApiResult<Vec<Run>> {
        let last = cost::page("last", last, cost::RUNS_PAGE, cost::MAX_PAGE)?;
        let tenant = &viewer(ctx)?.tenant;
        let db = snapshot(ctx).await?;
        let rows = reads::runs_of(db, tenant, self.0.id, last as u64).await?;
        Ok(rows.into_iter().map(Run).collect())
    }

    /// The oldest run that has not ended, queued ones included.
    async fn active_run(&self, ctx: &Context<'_>) -> ApiResult<Option<Run>> {
        let tenant = &viewer(ctx)?.tenant;
        let db = snapshot(ctx).await?;
        let rows = reads::unended_runs(db, tenant, self.0.id).await?;
        Ok(rows.into_iter().next().map(Run))
    }

    /// The cursor of the newest event, read in the same snapshot as the
    /// messages and runs beside it; a before-first cursor when empty.
    async fn last_cursor(&self, ctx: &Context<'_>) -> ApiResult<String> {
        let tenant = &viewer(ctx)?.tenant;
        let db = snapshot(ctx).await?;
        let row = reads::conversation(db, tenant, self.0.id)
            .await?
            .ok_or(ApiError::NotFound)?;
        Ok(Cursor(row.event_seq).to_string())
    }
}

#[derive(async_graphql::SimpleObject)]
pub struct ConversationConnection {
    pub nodes: Vec<Conversation>,
    pub end_cursor: Option<String>,
    pub has_more: bool,
}

pub struct Message {
    row: message::Model,
    parts: Option<Vec<part::Model>>,
}

impl Message {
    pub fn new(row: message::Model) -> Message {
        Message { row, parts: None }
    }

    fn with_parts(row: message::Model, parts: Vec<part::Model>) -> Message {
        Message {
            row,
            parts: Some(parts),
        }
    }
}

#[Object]
impl Message {
    async fn id(&self) -> ID {
        to_id(self.row.id)
    }

    async fn conversation_id(&self) -> ID {
        to_id(self.row.conversation_id)
    }

    async fn role(&self) -> ApiResult<MessageRole> {
        stored(&self.row.role, "message role")
    }

    async fn run_id(&self) -> Option<ID> {
        self.row.run_id.map(to_id)
    }

    async fn created_at(&self) -> DateTime {
        DateTime(self.row.created_at)
    }

    /// True while a message sent with `onActiveRun: STEER` waits for its
    /// run's next step boundary, where the run reads it (`run.steered`); if
    /// the run ends first, the message gets a run of its own and this turns
    /// false.
    async fn steering(&self) -> bool {
        self.row.pos >= crate::store::commit::PENDING_POS
    }

    /// The message's first `first` parts, in order.
    #[graphql(complexity = "cost::list(first.unwrap_or(cost::PARTS_PAGE), child_complexity)")]
    async fn parts(
        &self,
        ctx: &Context<'_>,
        #[graphql(default_with = "Some(cost::PARTS_PAGE)")] first: Option<i32>,
    ) -> ApiResult<Vec<Part>> {
        let first = cost::page("first", first, cost::PARTS_PAGE, cost::MAX_PAGE)?;
        let mut rows = match &self.parts {
            Some(rows) => rows.clone(),
            None => {
                let tenant = &viewer(ctx)?.tenant;
                let db = snapshot(ctx).await?;
                reads::parts_of(db, tenant, &[self.row.id])
                    .await?
                    .remove(&self.row.id)
                    .unwrap_or_default()
            }
        };
        rows.truncate(first);
        Ok(rows.into_iter().map(Part).collect())
    }
}

pub struct Part(pub part::Model);

#[Object]
impl Part {
    async fn id(&self) -> ID {
        to_id(self.0.id)
    }

    async fn message_id(&self) -> ID {
        to_id(self.0.message_id)
    }

    async fn index(&self) -> i32 {
        self.0.idx
    }

    async fn kind(&self) -> ApiResult<PartKind> {
        stored(&self.0.kind, "part kind")
    }

    async fn state(&self) -> ApiResult<PartState> {
        stored(&self.0.state, "part state")
    }

    /// The text of TEXT, REASONING, ERROR and NOTICE parts.
    async fn text(&self) -> Option<&str> {
        self.0.text.as_deref()
    }

    async fn data(&self) -> Option<Json<serde_json::Value>> {
        self.0.data.clone().map(Json)
    }

    /// The interaction a QUESTION, APPROVAL or CONNECTION part shows.
    async fn interaction_id(&self) -> Option<ID> {
        self.0
            .data
            .as_ref()
            .and_then(|d| d.get("interactionId"))
            .and_then(|id| id.as_str())
            .map(|id| ID(id.to_owned()))
    }

    async fn question(&self, ctx: &Context<'_>) -> ApiResult<Option<QuestionPart>> {
        if self.0.kind != PartKind::Question.as_str() {
            return Ok(None);
        }
        Ok(self.interaction(ctx).await?.map(QuestionPart))
    }

    async fn approval(&self, ctx: &Context<'_>) -> ApiResult<Option<ApprovalPart>> {
        if self.0.kind != PartKind::Approval.as_str() {
            return Ok(None);
        }
        Ok(self.interaction(ctx).await?.map(ApprovalPart))
    }

    async fn connection(&self, ctx: &Context<'_>) -> ApiResult<Option<ConnectionPart>> {
        if self.0.kind != PartKind::Connection.as_str() {
            return Ok(None);
        }
        Ok(self.interaction(ctx).await?.map(ConnectionPart))
    }

    /// The call a TOOL_CALL part shows.
    async fn tool_call(&self, ctx: &Context<'_>) -> ApiResult<Option<ToolCall>> {
        if self.0.kind != PartKind::ToolCall.as_str() {
            return Ok(None);
        }
        let row = shown_by_part(ctx, ToolCallOfPart, self.0.id).await?;
        Ok(row.map(ToolCall))
    }
}

impl Part {
    async fn interaction(&self, ctx: &Context<'_>) -> ApiResult<Option<Interaction>> {
        let row = shown_by_part(ctx, InteractionOfPart, self.0.id).await?;
        Ok(row.map(Interaction))
    }
}

pub struct ToolCall(pub tool_call::Model);

#[Object]
impl ToolCall {
    async fn id(&self) -> ID {
        to_id(self.0.id)
    }

    async fn run_id(&self) -> ID {
        to_id(self.0.run_id)
    }

    /// The run's step that asked for it, from 0.
    async fn step(&self) -> i32 {
        self.0.step
    }

    async fn name(&self) -> &str {
        &self.0.name
    }

    /// The validated, normalized input that runs; the model's own input
    /// when the schema refused it.
    async fn input(&self) -> Json<serde_json::Value> {
        Json(
            self.0
                .input
                .clone()
                .unwrap_or_else(|| self.0.model_input.clone()),
        )
    }

    async fn status(&self) -> ApiResult<ToolCallStatus> {
        stored(&self.0.status, "tool call status")
    }

    async fn outcome(&self) -> ApiResult<Option<ToolOutcome>> {
        self.0
            .outcome
            .as_deref()
            .map(|text| stored(text, "tool outcome"))
            .transpose()
    }

    /// The output as the model reads it: cut, with a note, when larger than
    /// the agent's `max_inline_tool_output_bytes`.
    async fn output(&self) -> Option<Json<serde_json::Value>> {
        self.0.output.clone().map(Json)
    }

    async fn output_truncated(&self) -> bool {
        self.0.output_truncated
    }

    /// The whole output when `output` was truncated (its JSON text), cut
    /// with a marker past the server's `max_full_output_bytes`, or past
    /// what the response may still carry of all its `fullOutput`s
    /// (`max_full_output_bytes_per_response`).
    #[graphql(complexity = "cost::FULL_OUTPUT")]
    async fn full_output(&self, ctx: &Context<'_>) -> ApiResult<Option<String>> {
        let cap = services(ctx).config.api.max_full_output_bytes;
        let Some(text) = self.0.full_output.as_deref() else {
            return Ok(None);
        };
        let allowed = full_output_allowance(ctx, text.len().min(cap))?;
        Ok(Some(cost::capped(text, allowed)))
    }

    /// EXECUTING commits so far; 0 = never started.
    async fn attempt(&self) -> i32 {
        self.0.attempt
    }

    async fn idempotency_key(&self) -> Option<&str> {
        Some(&self.0.idempotency_key)
    }

    async fn started_at(&self) -> Option<DateTime> {
        self.0.started_at.map(DateTime)
    }

    async fn ended_at(&self) -> Option<DateTime> {
        self.0.ended_at.map(DateTime)
    }
}

pub struct Run(pub run::Model);

#[Object]
impl Run {
    async fn id(&self) -> ID {
        to_id(self.0.id)
    }

    async fn conversation_id(&self) -> ID {
        to_id(self.0.conversation_id)
    }

    async fn status(&self) -> ApiResult<RunStatus> {
        stored(&self.0.status, "run status")
    }

    async fn end_cause(&self) -> ApiResult<Option<EndCause>> {
        self.0
            .end_cause
            .as_deref()
            .map(|text| stored(text, "end cause"))
            .transpose()
    }

    async fn error(&self) -> ApiResult<Option<RunError>> {
        self.0
            .error
            .clone()
            .map(|value| {
                serde_json::from_value(value).map_err(|e| {
                    tracing::error!(error = %e, "corrupt run error");
                    ApiError::Internal
                })
            })
            .transpose()
    }

    async fn cancel_requested(&self) -> bool {
        self.0.cancel_requested
    }

    /// The 1-based attempt of the current model request; 0 before the first.
    async fn attempt(&self) -> i32 {
        self.0.attempt
    }

    async fn max_attempts(&self) -> i32 {
        self.0.max_attempts
    }

    async fn next_attempt_at(&self) -> Option<DateTime> {
        self.0.next_attempt_at.map(DateTime)
    }

    async fn steps(&self) -> i32 {
        self.0.steps
    }

    /// The run's first `first` tool calls, in the order the model asked
    /// for them.
    #[graphql(complexity = "cost::list(first.unwrap_or(cost::TOOL_CALLS_PAGE), child_complexity)")]
    async fn tool_calls(
        &self,
        ctx: &Context<'_>,
        #[graphql(default_with = "Some(cost::TOOL_CALLS_PAGE)")] first: Option<i32>,
    ) -> ApiResult<Vec<ToolCall>> {
        let first = cost::page("first", first, cost::TOOL_CALLS_PAGE, cost::MAX_PAGE)?;
        let tenant = &viewer(ctx)?.tenant;
        let db = snapshot(ctx).await?;
        let rows = reads::tool_calls_of_run(db, tenant, self.0.id, Some(first as u64)).await?;
        Ok(rows.into_iter().map(ToolCall).collect())
    }

    /// Which limit or stop condition ended the run, in words.
    async fn end_reason(&self) -> Option<&str> {
        self.0.end_reason.as_deref()
    }

    async fn usage(&self) -> Usage {
        Usage {
            input_tokens: self.0.input_tokens,
            output_tokens: self.0.output_tokens,
            cost_usd: self.0.cost_usd,
        }
    }

    async fn created_at(&self) -> DateTime {
        DateTime(self.0.created_at)
    }

    async fn started_at(&self) -> Option<DateTime> {
        self.0.started_at.map(DateTime)
    }

    async fn ended_at(&self) -> Option<DateTime> {
        self.0.ended_at.map(DateTime)
    }
}

/// Reads a stored enum, failing closed on a value this build does not know.
fn stored<T: std::str::FromStr>(value: &str, what: &str) -> ApiResult<T>
where
    T::Err: std::fmt::Display,
{
    parse_stored(value, what).map_err(ApiError::from)
}

/// A question, an approval or a consent, as its part and the pending
/// queries show it.
pub struct Interaction(pub interaction::Model);

impl Interaction {
    fn connection(&self) -> ApiResult<ConnectionRequest> {
        Ok(interactions::connection_of(&self.0)?)
    }

    fn questions(&self) -> ApiResult<Vec<QuestionSpec>> {
        Ok(interactions::questions_of(&self.0)?)
    }

    fn approval(&self) -> ApiResult<ApprovalRequest> {
        Ok(interactions::approval_of(&self.0)?)
    }

    fn status(&self) -> ApiResult<InteractionStatus> {
        Ok(interactions::status_of(&self.0)?)
    }
}

pub struct QuestionPart(pub Interaction);

#[Object]
impl QuestionPart {
    async fn questions(&self) -> ApiResult<Vec<QuestionSpec>> {
        self.0.questions()
    }

    async fn answers(&self) -> ApiResult<Option<Vec<Answer>>> {
        Ok(interactions::answers_of(&self.0.0)?)
    }

    async fn status(&self) -> ApiResult<InteractionStatus> {
        self.0.status()
    }
}

pub struct ApprovalPart(pub Interaction);

#[Object]
impl ApprovalPart {
    async fn tool_name(&self) -> ApiResult<String> {
        Ok(self.0.approval()?.tool_name)
    }

    async fn summary(&self) -> ApiResult<String> {
        Ok(self.0.approval()?.summary)
    }

    async fn risk_category(&self) -> ApiResult<String> {
        Ok(self.0.approval()?.risk_category)
    }

    /// The normalized input that runs if it is allowed.
    async fn input(&self) -> ApiResult<Json<serde_json::Value>> {
        Ok(Json(self.0.approval()?.input))
    }

    async fn decision(&self) -> ApiResult<Option<ApprovalDecision>> {
        Ok(interactions::decision_of(&self.0.0)?)
    }

    /// Who decided (the audit of a decision, with `decidedAt`).
    async fn decided_by(&self) -> Option<&str> {
        self.0.0.resolved_by.as_deref()
    }

    async fn decided_at(&self) -> Option<DateTime> {
        self.0
            .0
            .resolved_by
            .as_ref()
            .and(self.0.0.resolved_at)
            .map(DateTime)
    }

    async fn status(&self) -> ApiResult<InteractionStatus> {
        self.0.status()
    }
}

pub struct PendingQuestion(pub Interaction);

#[Object]
impl PendingQuestion {
    /// Equal to `interactionId`, so client caches can normalize it.
    async fn id(&self) -> ID {
        to_id(self.0.0.id)
    }

    async fn interaction_id(&self) -> ID {
        to_id(self.0.0.id)
    }

    async fn run_id(&self) -> ID {
        to_id(self.0.0.run_id)
    }

    async fn questions(&self) -> ApiResult<Vec<QuestionSpec>> {
        self.0.questions()
    }

    async fn created_at(&self) -> DateTime {
        DateTime(self.0.0.created_at)
    }

    async fn expires_at(&self) -> DateTime {
        DateTime(self.0.0.expires_at)
    }
}

pub struct PendingApproval {
    pub interaction: Interaction,
    /// Whether the tenant's policy offers `ALLOW_ALWAYS`.
    pub allow_always: bool,
}

#[Object]
impl PendingApproval {
    /// Equal to `interactionId`, so client caches can normalize it.
    async fn id(&self) -> ID {
        to_id(self.interaction.0.id)
    }

    async fn interaction_id(&self) -> ID {
        to_id(self.interaction.0.id)
    }

    async fn run_id(&self) -> ID {
        to_id(self.interaction.0.run_id)
    }

    async fn tool_call_id(&self) -> ID {
        to_id(self.interaction.0.tool_call_id)
    }

    async fn tool_name(&self) -> ApiResult<String> {
        Ok(self.interaction.approval()?.tool_name)
    }

    async fn summary(&self) -> ApiResult<String> {
        Ok(self.interaction.approval()?.summary)
    }

    async fn risk_category(&self) -> ApiResult<String> {
        Ok(self.interaction.approval()?.risk_category)
    }

    /// Exactly what runs if it is allowed.
    async fn input(&self) -> ApiResult<Json<serde_json::Value>> {
        Ok(Json(self.interaction.approval()?.input))
    }

    async fn estimated_cost_usd(&self) -> ApiResult<Option<f64>> {
        Ok(self.interaction.approval()?.estimated_cost_usd)
    }

    async fn expires_at(&self) -> DateTime {
        DateTime(self.interaction.0.expires_at)
    }

    async fn allowed_decisions(&self) -> Vec<ApprovalDecision> {
        ApprovalDecision::ALL
            .iter()
            .copied()
            .filter(|d| self.allow_always || *d != ApprovalDecision::AllowAlways)
            .collect()
    }
}

pub struct ConnectionPart(pub Interaction);

#[Object]
impl ConnectionPart {
    async fn provider(&self) -> ApiResult<String> {
        Ok(self.0.connection()?.provider)
    }

    async fn gap(&self) -> ApiResult<ConnectionGap> {
        Ok(self.0.connection()?.gap)
    }

    async fn status(&self) -> ApiResult<InteractionStatus> {
        self.0.status()
    }
}

pub struct PendingConnection(pub Interaction);

#[Object]
impl PendingConnection {
    /// Equal to `interactionId`, so client caches can normalize it.
    async fn id(&self) -> ID {
        to_id(self.0.0.id)
    }

    async fn interaction_id(&self) -> ID {
        to_id(self.0.0.id)
    }

    async fn run_id(&self) -> ID {
        to_id(self.0.0.run_id)
    }

    async fn tool_call_id(&self) -> ID {
        to_id(self.0.0.tool_call_id)
    }

    async fn provider(&self) -> ApiResult<String> {
        Ok(self.0.connection()?.provider)
    }

    async fn gap(&self) -> ApiResult<ConnectionGap> {
        Ok(self.0.connection()?.gap)
    }

    /// The scopes the waiting call needs.
    async fn required_scopes(&self) -> ApiResult<Vec<String>> {
        Ok(self.0.connection()?.required_scopes)
    }

    /// Where the person gives consent; it brings them back to the
    /// provider's `redirect_uri` with `code` and `state`.
    async fn login_url(&self) -> ApiResult<String> {
        Ok(self.0.connection()?.login_url)
    }

    async fn created_at(&self) -> DateTime {
        DateTime(self.0.0.created_at)
    }

    async fn expires_at(&self) -> DateTime {
        DateTime(self.0.0.expires_at)
    }
}

/// Whether a stored connection's token still works (or can be renewed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, async_graphql::Enum)]
pub enum ConnectionStatus {
    Active,
    Expired,
}

/// One of the caller's connections: never a token.
pub struct Connection(pub connection::Model);

#[Object]
impl Connection {
    async fn provider(&self) -> &str {
        &self.0.provider
    }

    async fn scopes(&self) -> ApiResult<Vec<String>> {
        Ok(connections::scopes_of(&self.0)?)
    }

    /// `EXPIRED` once the access token has run out and there is no refresh
    /// token to renew it.
    async fn status(&self) -> ConnectionStatus {
        let lapsed = self.0.expires_at.is_some_and(|at| at <= now_millis());
        if lapsed && self.0.refresh_token.is_none() {
            ConnectionStatus::Expired
        } else {
            ConnectionStatus::Active
        }
    }

    /// When the access token runs out; null when the provider did not say.
    async fn expires_at(&self) -> Option<DateTime> {
        self.0.expires_at.map(DateTime)
    }
}
