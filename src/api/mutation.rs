use async_graphql::{Context, ID, InputObject, Object, SimpleObject};
use std::sync::Arc;

use super::context::{services, viewer};
use super::error::{ApiError, ApiResult};
use super::operators::operator;
use super::rates::Action;
use super::types::{Conversation, Message, Run, parse_id};
use crate::domain::ActiveRunStrategy;
use crate::domain::interaction::{Answer, ApprovalDecision};
use crate::store::Actor;
use crate::store::commands::{self, MaxAttempts, NewConversation, NewMessage};
use crate::store::connections::{self, Owner};
use crate::store::interactions::{self, Resolution};
use crate::store::{operations, reads};

pub struct Mutation;

/// The longest accepted `clientMessageId`, in bytes.
const MAX_CLIENT_MESSAGE_ID: usize = 200;

#[derive(InputObject)]
pub struct CreateConversationInput {
    /// An agent's name; the configured default agent when absent.
    agent: Option<String>,
    title: Option<String>,
}

#[derive(InputObject)]
pub struct SendMessageInput {
    conversation_id: ID,
    text: String,
    /// A retried mutation with the same id returns the original message and
    /// run.
    client_message_id: Option<String>,
    /// `null` means the default, `QUEUE`.
    #[graphql(default_with = "Some(ActiveRunStrategy::Queue)")]
    on_active_run: Option<ActiveRunStrategy>,
}

#[derive(SimpleObject)]
pub struct SendMessagePayload {
    message: Message,
    run: Run,
}

fn actor(ctx: &Context<'_>) -> ApiResult<Actor> {
    let viewer = viewer(ctx)?;
    Ok(Actor {
        tenant: viewer.tenant.clone(),
        principal: viewer.principal.clone(),
        delegate: viewer.delegate,
    })
}

#[Object(name = "TenantMutation")]
impl Mutation {
    async fn create_conversation(
        &self,
        ctx: &Context<'_>,
        input: CreateConversationInput,
    ) -> ApiResult<Conversation> {
        let services = services(ctx);
        let config = &services.config;
        let agent = match input.agent {
            Some(name) => config
                .agent(&name)
                .ok_or_else(|| ApiError::bad_key("agent", "unknown agent"))?
                .name
                .clone(),
            None => config.default_agent_name().to_owned(),
        };
        let title = input
            .title
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty());
        if let Some(title) = &title
            && title.chars().count() > config.api.max_title_chars
        {
            return Err(ApiError::bad_key(
                "title",
                format!(
                    "title is longer than {} characters",
                    config.api.max_title_chars
                ),
            ));
        }
        let actor = actor(ctx)?;
        services
            .rates
            .check(Action::CreateConversation, &actor.tenant, &actor.principal)?;
        let row = commands::create_conversation(
            &services.store,
            &actor,
            NewConversation { agent, title },
        )
        .await?;
        Ok(Conversation(row))
    }

    /// Stores the message and a queued run for it, in one transaction.
    async fn send_message(
        &self,
        ctx: &Context<'_>,
        input: SendMessageInput,
    ) -> ApiResult<SendMessagePayload> {
        let services = services(ctx);
        let limit = services.config.api.max_message_bytes;
        if input.text.trim().is_empty() {
            return Err(ApiError::bad_key("text", "text must not be empty"));
        }
        if input.text.len() > limit {
            return Err(ApiError::bad_key(
                "text",
                format!("text is longer than {limit} bytes"),
            ));
        }
        if let Some(id) = &input.client_message_id
            && (id.is_empty() || id.len() > MAX_CLIENT_MESSAGE_ID)
        {
            return Err(ApiError::bad_key(
                "clientMessageId",
                format!("clientMessageId must be 1 to {MAX_CLIENT_MESSAGE_ID} bytes"),
            ));
        }
        let conversation_id = parse_id(&input.conversation_id).ok_or(ApiError::NotFound)?;
        let actor = actor(ctx)?;
        services
            .rates
            .check(Action::SendMessage, &actor.tenant, &actor.principal)?;
        let runtime = &services.config.runtime;
        for (most, principal, whose) in [
            (
                runtime.max_waiting_runs_per_principal,
                Some(actor.principal.as_str()),
                "of yours",
            ),
            (
                runtime.max_waiting_runs_per_tenant,
                None,
                "of your tenant's",
            ),
        ] {
            if most > 0
                && reads::waiting_runs_of(services.store.api_reads(), &actor.tenant, principal)
                    .await?
                    >= most
            {
                return Err(ApiError::RateLimited {
                    message: format!(
                        "{most} runs {whose} are waiting to run already; send again when some have started"
                    ),
                    retry_after_secs: 5,
                });
            }
        }
        let config = services.config.clone();
        let max_attempts = MaxAttempts::ByAgent(Arc::new(move |agent| {
            config
                .agent(agent)
                .map_or(1, |agent| agent.retry.max_attempts as i32)
        }));
        let (message, run) = commands::send_message(
            &services.store,
            &actor,
            NewMessage {
                conversation_id,
                text: input.text,
                client_message_id: input.client_message_id,
                on_active_run: input.on_active_run.unwrap_or(ActiveRunStrategy::Queue),
                max_attempts,
            },
        )
        .await?;
        Ok(SendMessagePayload {
            message: Message::new(message),
            run: Run(run),
        })
    }

    /// Ends a run that has not started in this transaction; returns an ended
    /// run unchanged.
    /// An operator may cancel any tenant's run.
    async fn cancel_run(&self, ctx: &Context<'_>, run_id: ID) -> ApiResult<Run> {
        let run_id = parse_id(&run_id).ok_or(ApiError::NotFound)?;
        let store = &services(ctx).store;
        let mut actor = actor(ctx)?;
        // An operator may cancel anyone's run, of any tenant, and is audited
        // when it is not their own.
        let mut audited = None;
        if viewer(ctx)?.operator
            && let Some((tenant, principal)) = operations::owner_of_run(store, run_id).await?
            && (tenant != actor.tenant || principal != actor.principal)
        {
            tracing::info!(operator = %actor.principal, %run_id, %tenant, "an operator cancels someone else's run");
            actor.tenant = tenant;
            actor.delegate = true;
            audited = Some(operator(ctx)?);
        }
        let row = commands::cancel_run(store, &actor, run_id, audited).await?;
        Ok(Run(row))
    }

    /// Answers a run's questions; `resumed` is true exactly once.
    async fn answer_question(
        &self,
        ctx: &Context<'_>,
        input: AnswerQuestionInput,
    ) -> ApiResult<ResumePayload> {
        let answers = input
            .answers
            .into_iter()
            .map(|a| Answer {
                key: a.key,
                values: a.values,
                other: a.other,
            })
            .collect();
        resolve(ctx, &input.interaction_id, Resolution::Answers(answers)).await
    }

    /// Decides on a gated tool call; `resumed` is true exactly once.
    async fn decide_approval(
        &self,
        ctx: &Context<'_>,
        input: DecideApprovalInput,
    ) -> ApiResult<ResumePayload> {
        let tenant = &viewer(ctx)?.tenant;
        let allow_always = services(ctx).config.policy.for_tenant(tenant).allow_always;
        let resolution = Resolution::Decision {
            decision: input.decision,
            allow_always,
        };
        resolve(ctx, &input.interaction_id, resolution).await
    }

    /// The person came back from the provider's consent screen: with a
    /// `code` (given) or an `error` such as `access_denied` (declined).
    /// `resumed` is true exactly once; a state that is unknown, expired,
    /// or another's is `NOT_FOUND`.
    async fn complete_connection(
        &self,
        ctx: &Context<'_>,
        input: CompleteConnectionInput,
    ) -> ApiResult<ResumePayload> {
        if input.state.len() > MAX_OAUTH_PARAMETER {
            // No state this long was ever handed out.
            return Err(ApiError::NotFound);
        }
        if input
            .code
            .as_ref()
            .is_some_and(|c| c.len() > MAX_OAUTH_PARAMETER)
        {
            return Err(ApiError::bad_key("code", "code is too long"));
        }
        let services = services(ctx);
        let (run, resumed) = services
            .connections
            .complete(
                &services.store,
                &actor(ctx)?,
                &input.state,
                input.code.as_deref(),
                input.error.as_deref(),
            )
            .await?;
        Ok(ResumePayload {
            run: Run(run),
            resumed,
        })
    }

    /// Deletes the caller's connection to `provider`; false when there was
    /// none. A run that needs it afterwards asks for a new consent.
    async fn disconnect(&self, ctx: &Context<'_>, provider: String) -> ApiResult<bool> {
        let actor = actor(ctx)?;
        let owner = Owner {
            tenant: &actor.tenant,
            principal: &actor.principal,
            provider: &provider,
        };
        Ok(connections::delete(&services(ctx).store, owner).await?)
    }
}

/// The longest `state` or `code` accepted, in bytes.
const MAX_OAUTH_PARAMETER: usize = 4096;

async fn resolve(
    ctx: &Context<'_>,
    interaction_id: &ID,
    resolution: Resolution,
) -> ApiResult<ResumePayload> {
    let id = parse_id(interaction_id).ok_or(ApiError::NotFound)?;
    let (run, resumed) =
        interactions::resolve(&services(ctx).store, &actor(ctx)?, id, resolution).await?;
    Ok(ResumePayload {
        run: Run(run),
        resumed,
    })
}

#[derive(InputObject)]
pub struct AnswerQuestionInput {
    interaction_id: ID,
    answers: Vec<QuestionAnswerInput>,
}

#[derive(InputObject)]
pub struct QuestionAnswerInput {
    key: String,
    values: Vec<String>,
    other: Option<String>,
}

#[derive(InputObject)]
pub struct DecideApprovalInput {
    interaction_id: ID,
    decision: ApprovalDecision,
}

/// Exactly one of `code` (consent given) and `error` (declined).
#[derive(InputObject)]
pub struct CompleteConnectionInput {
    state: String,
    code: Option<String>,
    error: Option<String>,
}

#[derive(SimpleObject)]
pub struct ResumePayload {
    run: Run,
    /// True for the one call that resumed the run from this interaction.
    resumed: bool,
}
