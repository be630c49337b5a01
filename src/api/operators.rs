//! The operators' queries and mutations: across tenants, for a token that
//! carries `auth.operator_claim`. Every other caller is refused with
//! `FORBIDDEN`, whatever the arguments.

use async_graphql::{Context, Enum, ID, InputObject, Json, Object, SimpleObject};

use super::context::{services, viewer};
use super::error::{ApiError, ApiResult};
use super::types::{DateTime, Run, ToolCall, parse_id, to_id};
use crate::store::commit::Operator;
use crate::store::entities::tool_call;
use crate::store::operations::{self, Stuck};
use crate::store::{queue, tool_calls};

/// The longest note an operator may leave, in characters.
const MAX_NOTE_CHARS: usize = 2000;

/// The caller, if it is an operator.
pub(super) fn operator<'a>(ctx: &Context<'a>) -> ApiResult<Operator<'a>> {
    let viewer = viewer(ctx)?;
    if viewer.operator {
        Ok(Operator {
            principal: &viewer.principal,
            issuer: viewer.issuer.as_deref(),
        })
    } else {
        Err(ApiError::Forbidden(
            "this operation is for operators: a token with auth.operator_claim".into(),
        ))
    }
}

#[derive(Enum, Clone, Copy, PartialEq, Eq)]
pub enum StuckReason {
    /// `RUNNING`, but its lease ran out and no worker reclaimed it.
    LeaseExpired,
    /// Claimable for longer than the threshold, and nobody claimed it.
    QueuedTooLong,
    /// Waiting on a question, approval or consent past its expiry.
    InteractionExpired,
}

impl From<Stuck> for StuckReason {
    fn from(why: Stuck) -> StuckReason {
        match why {
            Stuck::LeaseExpired => StuckReason::LeaseExpired,
            Stuck::QueuedTooLong => StuckReason::QueuedTooLong,
            Stuck::InteractionExpired => StuckReason::InteractionExpired,
        }
    }
}

#[derive(SimpleObject)]
pub struct StuckRun {
    run: Run,
    tenant: String,
    reason: StuckReason,
    /// Since when: the lease's expiry, when the run became ready, or the
    /// interaction's expiry.
    since: DateTime,
}

/// A call whose outcome is `UNKNOWN`, with what an operator needs to ask
/// the downstream system about it.
pub struct UnknownToolCall {
    row: tool_call::Model,
    target: Option<String>,
}

#[Object]
impl UnknownToolCall {
    async fn tool_call(&self) -> ToolCall {
        ToolCall(self.row.clone())
    }

    async fn tenant(&self) -> &str {
        &self.row.tenant
    }

    async fn conversation_id(&self) -> ID {
        to_id(self.row.conversation_id)
    }

    /// The `Idempotency-Key` the call was sent with.
    async fn idempotency_key(&self) -> &str {
        &self.row.idempotency_key
    }

    /// Where the call went: the tool's method and URL, as configured now.
    async fn target(&self) -> Option<&str> {
        self.target.as_deref()
    }
}

/// What the downstream system says became of the call.
#[derive(Enum, Clone, Copy, PartialEq, Eq)]
pub enum ResolvedOutcome {
    Completed,
    Failed,
}

#[derive(InputObject)]
pub struct ResolveToolCallInput {
    tool_call_id: ID,
    outcome: ResolvedOutcome,
    /// What the downstream system reports, as the call's output.
    output: Json<serde_json::Value>,
    /// Why, and from whom the operator learned it; kept in the audit.
    note: String,
}

#[derive(InputObject)]
pub struct RequeueRunInput {
    run_id: ID,
    /// Why; kept in the audit.
    note: String,
}

fn note(note: &str) -> ApiResult<&str> {
    let trimmed = note.trim();
    if trimmed.is_empty() {
        return Err(ApiError::bad_key(
            "note",
            "say why: the note must not be empty",
        ));
    }
    if trimmed.chars().count() > MAX_NOTE_CHARS {
        return Err(ApiError::bad_key(
            "note",
            format!("at most {MAX_NOTE_CHARS} characters"),
        ));
    }
    Ok(trimmed)
}

#[derive(Default)]
pub struct OperatorQuery;

#[Object]
impl OperatorQuery {
    /// Runs nobody is moving on, oldest first (operators only).
    async fn stuck_runs(
        &self,
        ctx: &Context<'_>,
        #[graphql(default_with = "operations::QUEUED_TOO_LONG.as_secs()")]
        queued_longer_than_secs: u64,
    ) -> ApiResult<Vec<StuckRun>> {
        operator(ctx)?;
        let threshold = std::time::Duration::from_secs(queued_longer_than_secs);
        let stuck = operations::stuck_runs(&services(ctx).store, threshold).await?;
        Ok(stuck
            .into_iter()
            .map(|s| StuckRun {
                tenant: s.run.tenant.clone(),
                reason: s.why.into(),
                since: DateTime(s.since),
                run: Run(s.run),
            })
            .collect())
    }

    /// Tool calls whose outcome is `UNKNOWN`, oldest first (operators only).
    async fn unknown_tool_calls(&self, ctx: &Context<'_>) -> ApiResult<Vec<UnknownToolCall>> {
        operator(ctx)?;
        let services = services(ctx);
        let calls = operations::unknown_tool_calls(&services.store).await?;
        Ok(calls
            .into_iter()
            .map(|row| UnknownToolCall {
                target: services.config.tool_target(&row.name),
                row,
            })
            .collect())
    }
}

#[derive(Default)]
pub struct OperatorMutation;

#[Object]
impl OperatorMutation {
    /// Records what the downstream system says became of a call whose
    /// outcome is `UNKNOWN` (operators only). The call reads `COMPLETED`;
    /// the model reads the outcome as a fact, and the call is never made
    /// again. Audited.
    async fn resolve_tool_call(
        &self,
        ctx: &Context<'_>,
        input: ResolveToolCallInput,
    ) -> ApiResult<ToolCall> {
        let operator = operator(ctx)?;
        let note = note(&input.note)?;
        let id = parse_id(&input.tool_call_id).ok_or(ApiError::NotFound)?;
        let resolution = tool_calls::OperatorResolution {
            operator,
            succeeded: input.outcome == ResolvedOutcome::Completed,
            output: input.output.0,
            note,
        };
        let row = tool_calls::resolve(&services(ctx).store, id, resolution).await?;
        tracing::info!(operator = operator.principal, tool_call_id = %id, tenant = %row.tenant, "an operator resolved a tool call");
        Ok(ToolCall(row))
    }

    /// Queues again a run that failed `RECOVERY_LIMIT` (operators only): it
    /// goes on from its committed steps. Audited.
    async fn requeue_run(&self, ctx: &Context<'_>, input: RequeueRunInput) -> ApiResult<Run> {
        let operator = operator(ctx)?;
        let note = note(&input.note)?;
        let id = parse_id(&input.run_id).ok_or(ApiError::NotFound)?;
        let row = queue::requeue(&services(ctx).store, operator, id, note).await?;
        tracing::info!(operator = operator.principal, run_id = %id, tenant = %row.tenant, "an operator queued a run again");
        Ok(Run(row))
    }
}
