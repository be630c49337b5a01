//! The step engine: executes one claim of a run. Phases, in order: run start
//! (the first commit of the claim), step start (limits), before inference
//! (the history from committed facts), inference (streamed, checkpointed),
//! after inference and step end and run end (one commit for a final step).
//! Every commit is fenced by the claim's epoch.
//!
//! The phases live in their own files: `start.rs` (the claim's first commit
//! and the steps that follow it), `inference.rs` (the model request, streamed
//! into parts), `tools.rs` (a step's batch of tool calls, from its request
//! to the step's end) and `end.rs` (how a step or a run ends: the end states,
//! ceilings, retries, timeouts and stops). This file holds what they share
//! and one step through them, in order.

mod end;
mod inference;
mod start;
mod tools;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::history::{self, Histories};
use super::stop;
use crate::config::{AgentConfig, PolicyConfig};
use crate::domain::run::EndCause;
use crate::providers::{ModelRequest, Provider, ToolSpec};
use crate::store::commit::Lease;
use crate::store::entities::run;
use crate::store::{self, Store};
use crate::telemetry;
use crate::tools::registry::{Registry, Tool};
use end::{end, ended, failed, over, over_ceiling, stopped_by};
use inference::{Attempt, Context, Inference, Stream, compact};

pub use start::{Executed, execute};

/// Why a worker stops a run it holds before the model is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// `cancelRun`: end it `CANCELLED` with what was streamed.
    Cancelled,
    /// The lease was taken over: stop without writing.
    LeaseLost,
    /// The process is shutting down: give the run back to the queue.
    Shutdown,
}

/// How the rest of the process reaches a running execution.
#[derive(Default)]
pub struct Control {
    token: CancellationToken,
    reason: Mutex<Option<Stop>>,
}

impl Control {
    /// Asks the execution to stop; the first reason given wins.
    pub fn stop(&self, reason: Stop) {
        let mut current = self.reason.lock().unwrap_or_else(PoisonError::into_inner);
        current.get_or_insert(reason);
        self.token.cancel();
    }

    pub(crate) fn reason(&self) -> Option<Stop> {
        *self.reason.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What comes after a step: another one, or nothing (the run ended, was
/// handed back, or parked for a retry).
enum Next {
    Step(Attempt),
    Over,
}

/// Everything a run's steps share within one claim.
struct Steps<'a> {
    store: &'a Store,
    lease: &'a Lease,
    run: &'a run::Model,
    agent: &'a AgentConfig,
    tools: &'a Registry,
    /// The histories of ended runs kept between claims.
    histories: &'a Histories,
    /// The tools this agent offers its model.
    offered: Vec<Arc<Tool>>,
    provider: &'a dyn Provider,
    control: &'a Control,
    deadline: Instant,
    checkpoint_every: Duration,
    /// How long a lease lasts when renewed.
    lease_ms: i64,
    tool_concurrency: usize,
    policy: &'a PolicyConfig,
}

impl Steps<'_> {
    /// One step: limits, the history, an inference, and then either the run's
    /// end or a batch of tool calls.
    async fn step(&self, step: i32, mut attempt: Attempt) -> store::Result<Next> {
        let (store, lease, agent) = (self.store, self.lease, self.agent);
        let limits = &agent.limits;
        // Step start: limits.
        if let Some(stop) = self.control.reason() {
            return self.stop(stop, &attempt, step).await;
        }
        if Instant::now() >= self.deadline {
            return self.timed_out(&attempt, step).await;
        }
        if step >= limits.max_steps as i32 {
            let message = format!("the run reached its limit of {} steps", limits.max_steps);
            let ending = failed(EndCause::StepLimit, message, attempt.usage(agent), step);
            return over(end(store, lease, &attempt, ending).await);
        }

        // Before inference: the history, from committed facts only, compacted
        // when it would exceed the context budget.
        let history = history::load(store, self.histories, self.run).await?;
        let context = Context {
            store,
            histories: self.histories,
            lease,
            run: self.run,
            agent,
            provider: self.provider,
            control: self.control,
            deadline: self.deadline,
        };
        let history = compact(&context, history, &mut attempt).await?;
        let request = ModelRequest {
            model: agent.model_name().to_owned(),
            system: agent.system.clone(),
            turns: history.turns,
            tools: self
                .offered
                .iter()
                .map(|tool| ToolSpec {
                    name: tool.name.clone(),
                    description: tool.description.clone(),
                    input_schema: tool.input_schema.clone(),
                })
                .collect(),
            max_tokens: agent.max_tokens,
            thinking_budget: agent.thinking_budget_tokens,
            attempt: attempt.request_attempt as u32,
        };

        // Inference.
        let stream = Stream {
            store,
            lease,
            checkpoint_every: self.checkpoint_every,
            deadline: self.deadline,
            control: self.control,
        };
        let began = std::time::Instant::now();
        let span = tracing::info_span!(
            "inference",
            provider = agent.provider.as_str(),
            model = %request.model,
            attempt = attempt.request_attempt
        );
        let inference = stream
            .infer(self.provider, request, &mut attempt)
            .instrument(span)
            .await;
        telemetry::inference(agent.provider.as_str(), began.elapsed());
        let inference = inference?;

        // After inference.
        let usage = attempt.usage(agent);
        match inference {
            Inference::Done if attempt.calls.is_empty() => {
                // Step end and run end, in one commit.
                let text = attempt.text();
                let ending = match over_ceiling(limits, &usage)
                    .or_else(|| stop::content_matched(&agent.stop, &text))
                {
                    Some((cause, message)) => stopped_by(cause, message, usage, step + 1),
                    None => ended(EndCause::Natural, usage, step + 1),
                };
                over(end(store, lease, &attempt, ending).await)
            }
            Inference::Done => {
                let calls = self.request_tools(step, &mut attempt).await?;
                match calls {
                    Some(calls) => self.finish_batch(&calls, step, attempt).await,
                    None => Ok(Next::Over),
                }
            }
            Inference::TimedOut => self.timed_out(&attempt, step).await,
            Inference::Failed(err) => {
                self.retry_or_fail(err, &attempt, usage, step).await?;
                Ok(Next::Over)
            }
            Inference::Stopped(stop) => self.stop(stop, &attempt, step).await,
        }
    }
}
