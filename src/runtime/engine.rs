//! The step engine: executes one claim of a run. Phases, in order: run start
//! (the first commit of the claim), step start (limits), before inference
//! (the history from committed facts), inference (streamed, checkpointed),
//! after inference and step end and run end (one commit for a final step).
//! Every commit is fenced by the claim's epoch.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use serde_json::json;

use super::history::History;
use super::{batch, compaction, history, stop};
use crate::config::{AgentConfig, BUILTIN_TOOLS, FileConfig, Limits, PolicyConfig};
use crate::domain::PartKind;
use crate::domain::cursor::Cursor;
use crate::domain::event::{Event, EventBody, EventKind};
use crate::domain::retry::RetryPolicy;
use crate::domain::run::{EndCause, RunError, Usage, Waiting};
use crate::domain::time::{now_millis, secs_to_millis};
use crate::domain::tool_call::ToolOutcome;
use crate::failpoints;
use crate::providers::{self, ModelEvent, ModelRequest, Provider, ProviderError, ToolSpec};
use crate::store::commit::{Begun, Ending, Lease, OpenPart, PartText, utf16_len};
use crate::store::entities::{run, tool_call};
use crate::store::interactions;
use crate::store::queue;
use crate::store::runs::{self, Compaction, RetryAfterFailure};
use crate::store::tool_calls::{self, NewToolCall, Verdict};
use crate::store::{self, Store, reads};
use crate::tools::registry::{Registry, Tool};

/// The built-in tool that asks a person questions.
const ASK_QUESTIONS: &str = BUILTIN_TOOLS[0];

/// The most model events merged into one delta.
const MAX_COALESCED: usize = 256;

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

/// How an inference ended.
enum Inference {
    Done,
    Stopped(Stop),
    TimedOut,
    Failed(ProviderError),
}

pub async fn execute(
    store: Store,
    config: Arc<FileConfig>,
    tools: Arc<Registry>,
    claimed: queue::Claimed,
    control: Arc<Control>,
) {
    let lease = Lease::of(&claimed.run);
    let span = tracing::info_span!(
        "run",
        run_id = %lease.run_id,
        conversation_id = %lease.conversation_id,
        epoch = lease.epoch
    );
    match drive(&store, &config, &tools, &lease, claimed.begun, &control)
        .instrument(span.clone())
        .await
    {
        Ok(()) => {}
        Err(store::Error::Fenced) => {
            span.in_scope(|| tracing::info!("the lease moved on; stopped without writing"));
        }
        Err(err) => {
            // The lease runs out and the run is recovered from what was
            // committed.
            span.in_scope(|| tracing::error!(error = %err, "run execution failed"));
        }
    }
}

async fn drive(
    store: &Store,
    config: &FileConfig,
    tools: &Registry,
    lease: &Lease,
    begun: Option<Begun>,
    control: &Control,
) -> store::Result<()> {
    // Run start: done with the claim where it could be its first commit.
    let begun = match begun {
        Some(begun) => begun,
        None => {
            failpoints::hit("after_claim");
            runs::begin(store, lease).await?
        }
    };
    failpoints::hit("after_begin");
    let run = &begun.run;
    let mut attempt = Attempt::new(&begun);
    let so_far = usage_of(run);
    let Some(agent) = config.agent(&run.agent) else {
        let message = format!("agent {:?} is not configured", run.agent);
        let ending = failed(EndCause::Error, message, so_far, run.steps);
        return end(store, lease, &attempt, ending).await;
    };
    if run.cancel_requested || control.reason() == Some(Stop::Cancelled) {
        return end(
            store,
            lease,
            &attempt,
            ended(EndCause::Cancelled, so_far, run.steps),
        )
        .await;
    }
    let limits = &agent.limits;
    let remaining_ms = secs_to_millis(limits.timeout_secs).saturating_sub(run.active_ms);
    let deadline = Instant::now() + Duration::from_millis(u64::try_from(remaining_ms).unwrap_or(0));
    let provider = providers::for_agent(agent);
    let steps = Steps {
        store,
        lease,
        run,
        agent,
        tools,
        offered: tools.for_agent(agent),
        provider: provider.as_ref(),
        control,
        deadline,
        checkpoint_every: Duration::from_millis(config.runtime.checkpoint_ms),
        tool_concurrency: config.runtime.tool_concurrency,
        policy: &config.policy,
    };
    let mut step = run.steps;
    // A batch of tool calls that an earlier claim left unfinished is
    // finished, from its committed facts, before the model hears anything.
    if begun.part.is_none() {
        attempt.said = runs::step_text(store, run.id, step).await?;
        let calls = tool_calls::of_step(store.db(), run.id, step).await?;
        match steps.finish_batch(&calls, step, attempt).await? {
            Next::Step(next) => attempt = next,
            Next::Over => return Ok(()),
        }
        step += 1;
    }
    loop {
        match steps.step(step, attempt).await? {
            Next::Step(next) => attempt = next,
            Next::Over => return Ok(()),
        }
        step += 1;
    }
}

/// Why a batch stopped before its calls were done.
enum Cut {
    Stop(Stop),
    Timeout,
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
    /// The tools this agent offers its model.
    offered: Vec<Arc<Tool>>,
    provider: &'a dyn Provider,
    control: &'a Control,
    deadline: Instant,
    checkpoint_every: Duration,
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
        let history = history::load(store, self.run).await?;
        let context = Context {
            store,
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
        let inference = stream.infer(self.provider, request, &mut attempt).await?;

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

    /// Commits the step's output and its tool calls, `REQUESTED` as a whole
    /// batch before any runs (refused ones already with their result).
    /// `None` when the batch reached the run's tool call limit and ended it.
    async fn request_tools(
        &self,
        step: i32,
        attempt: &mut Attempt,
    ) -> store::Result<Option<Vec<tool_call::Model>>> {
        let limits = &self.agent.limits;
        let earlier = reads::tool_calls_of_run(self.store.db(), &self.run.tenant, self.run.id)
            .await?
            .len();
        let asked = std::mem::take(&mut attempt.calls);
        let over_limit = earlier + asked.len() > limits.max_tool_calls as usize;
        let calls = asked
            .into_iter()
            .map(|call| {
                let verdict = if over_limit {
                    Verdict::Refuse(
                        ToolOutcome::NotStarted,
                        json!({
                            "error": format!(
                                "not started: the run reached its limit of {} tool calls",
                                limits.max_tool_calls
                            )
                        }),
                    )
                } else {
                    batch::verdict(&self.offered, &call.name, &call.input)
                };
                NewToolCall {
                    provider_call_id: call.id,
                    name: call.name,
                    model_input: call.input,
                    verdict,
                }
            })
            .collect();
        let ending = over_limit.then(|| {
            let message = format!(
                "the model asked for more than the run's limit of {} tool calls",
                limits.max_tool_calls
            );
            failed(
                EndCause::ToolCallLimit,
                message,
                attempt.usage(self.agent),
                step + 1,
            )
        });
        let ended = ending.is_some();
        let (calls, cursor) = tool_calls::request(
            self.store,
            self.lease,
            &attempt.texts(),
            calls,
            limits.max_inline_tool_output_bytes,
            ending,
        )
        .await?;
        failpoints::hit("after_tools_requested");
        // The step's parts are closed now.
        attempt.said = attempt.text();
        attempt.parts.clear();
        attempt.cursor = cursor;
        Ok((!ended).then_some(calls))
    }

    /// Runs what is left of a committed batch, then ends the step: the stop
    /// conditions and ceilings are checked, and the next step opens.
    async fn finish_batch(
        &self,
        calls: &[tool_call::Model],
        step: i32,
        attempt: Attempt,
    ) -> store::Result<Next> {
        let (store, lease, agent) = (self.store, self.lease, self.agent);
        let runner = batch::Runner {
            store,
            lease,
            tools: self.tools,
            run: self.run,
            rules: self.policy.for_tenant(&self.run.tenant),
            retry: retry_policy(agent),
            max_inline_bytes: agent.limits.max_inline_tool_output_bytes,
            concurrency: self.tool_concurrency,
        };
        let mut calls = calls.to_vec();
        loop {
            let outcome = {
                let work = runner.run(&calls);
                tokio::pin!(work);
                loop {
                    tokio::select! {
                        done = &mut work => break Ok(done),
                        () = self.control.token.cancelled(), if self.control.reason() != Some(Stop::Shutdown) => {
                            let stop = self.control.reason().unwrap_or(Stop::Cancelled);
                            if stop == Stop::Shutdown {
                                // The calls finish first (see below).
                                continue;
                            }
                            break Err(Cut::Stop(stop));
                        }
                        () = sleep_until(self.deadline) => break Err(Cut::Timeout),
                    }
                }
            };
            // The batch's work is dropped by now: its open transactions have
            // rolled back and its requests are closed, so the ending below
            // cannot wait on a lock that work still holds.
            let waited = match outcome {
                Ok(Ok(waited)) => waited,
                Ok(Err(store::Error::CancelRequested)) | Err(Cut::Stop(Stop::Cancelled)) => {
                    return self.stop(Stop::Cancelled, &attempt, step).await;
                }
                Ok(Err(err)) => return Err(err),
                Err(Cut::Stop(stop)) => return self.stop(stop, &attempt, step).await,
                Err(Cut::Timeout) => return self.timed_out(&attempt, step).await,
            };
            if !waited {
                break;
            }
            // Calls wait for decisions and nothing else runs: the run parks,
            // unless a decision came in meanwhile.
            let usage = attempt.usage(agent);
            match interactions::park(store, lease, Waiting::Approval, usage, false).await {
                Ok(true) => return Ok(Next::Over),
                Ok(false) => {}
                Err(store::Error::CancelRequested) => {
                    return self.stop(Stop::Cancelled, &attempt, step).await;
                }
                Err(err) => return Err(err),
            }
            calls = tool_calls::of_step(store.db(), self.run.id, step).await?;
        }
        // A shutdown lets the batch finish (within the grace period), then
        // hands the run back.
        if let Some(stop) = self.control.reason() {
            return self.stop(stop, &attempt, step).await;
        }
        // A consent that ran out while the batch ran ends the run (only a
        // call of a tool with a connection can have waited for one).
        let consented = calls.iter().any(|call| {
            self.tools
                .get(&call.name)
                .is_some_and(|tool| tool.connection.is_some())
        });
        if consented
            && let Some(request) = interactions::consent_expired(store, self.run.id).await?
        {
            let message = interactions::consent_expired_message(&request, None);
            let ending = failed(
                EndCause::ConsentExpired,
                message,
                attempt.usage(agent),
                step + 1,
            );
            return over(end(store, lease, &attempt, ending).await);
        }

        // Step end.
        let usage = attempt.usage(agent);
        let all = reads::tool_calls_of_run(store.db(), &self.run.tenant, self.run.id).await?;
        let text = attempt.text();
        let condition = over_ceiling(&agent.limits, &usage)
            .or_else(|| stop::after_tools(&agent.stop, &all, step, &text));
        if let Some((cause, message)) = condition {
            let ending = stopped_by(cause, message, usage, step + 1);
            return over(end(store, lease, &attempt, ending).await);
        }
        // A question asked in this step parks the run until it is answered
        // (or expires); the answers open the next step.
        let asked = all
            .iter()
            .any(|c| c.step == step && c.name == ASK_QUESTIONS);
        if asked {
            match interactions::park(store, lease, Waiting::Question, usage, true).await {
                Ok(true) => return Ok(Next::Over),
                Ok(false) => {}
                Err(store::Error::CancelRequested) => {
                    return self.stop(Stop::Cancelled, &attempt, step + 1).await;
                }
                Err(err) => return Err(err),
            }
        }
        let (part, cursor) = runs::end_step(store, lease, usage).await?;
        failpoints::hit("after_step");
        Ok(Next::Step(Attempt::next(usage, part, cursor)))
    }

    /// The worker stops before the run is done.
    async fn stop(&self, stop: Stop, attempt: &Attempt, step: i32) -> store::Result<Next> {
        let usage = attempt.usage(self.agent);
        match stop {
            Stop::Cancelled => {
                let ending = ended(EndCause::Cancelled, usage, step);
                over(end(self.store, self.lease, attempt, ending).await)
            }
            Stop::Shutdown => over(runs::release(self.store, self.lease, &attempt.texts()).await),
            Stop::LeaseLost => Err(store::Error::Fenced),
        }
    }

    async fn timed_out(&self, attempt: &Attempt, step: i32) -> store::Result<Next> {
        let ending = failed(
            EndCause::Timeout,
            "the run used up its time".into(),
            attempt.usage(self.agent),
            step,
        );
        over(end(self.store, self.lease, attempt, ending).await)
    }

    /// A failed model request: parked for another attempt when the failure
    /// is transient and the budget allows, else the run fails with it.
    async fn retry_or_fail(
        &self,
        err: ProviderError,
        attempt: &Attempt,
        usage: Usage,
        step: i32,
    ) -> store::Result<()> {
        let (store, lease) = (self.store, self.lease);
        let error = provider_error(&err);
        let policy = retry_policy(self.agent);
        let failed_attempt = attempt.request_attempt;
        if !(err.is_transient() && policy.allows_another(failed_attempt as u32)) {
            let ending = Ending {
                cause: EndCause::Error,
                reason: Some(error.message.clone()),
                error: Some(error),
                usage,
                steps: step,
            };
            return end(store, lease, attempt, ending).await;
        }
        let delay = policy.delay(failed_attempt as u32, err.retry_after(), fastrand::f64());
        // Parked, it would hold its conversation for the whole delay only to
        // find no time left.
        if Instant::now()
            .checked_add(delay)
            .is_none_or(|due| due >= self.deadline)
        {
            let message = format!(
                "the next attempt would start after {}s, past the run's time limit; last error: {}",
                delay.as_secs(),
                error.message
            );
            let ending = failed(EndCause::Timeout, message, usage, step);
            return end(store, lease, attempt, ending).await;
        }
        tracing::info!(
            attempt = failed_attempt,
            delay_ms = delay.as_millis() as u64,
            error = %err,
            "model request failed; retrying"
        );
        let retry = RetryAfterFailure {
            failed_attempt,
            max_attempts: policy.max_attempts as i32,
            delay_ms: i64::try_from(delay.as_millis()).unwrap_or(i64::MAX),
            error,
            usage,
        };
        match runs::schedule_retry(store, lease, &attempt.texts(), retry).await {
            Ok(_) => {}
            Err(store::Error::CancelRequested) => {
                let ending = ended(EndCause::Cancelled, usage, step);
                return end(store, lease, attempt, ending).await;
            }
            Err(err) => return Err(err),
        }
        failpoints::hit("after_retry_scheduled");
        // Any worker claims it when due (polling covers a crash); this one
        // wakes its own process right on time.
        let bus = store.bus().clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            bus.wake_workers();
        });
        Ok(())
    }
}

fn over(result: store::Result<()>) -> store::Result<Next> {
    result.map(|()| Next::Over)
}

/// Replaces the older turns by a summary when the history would exceed the
/// agent's context budget; the summary is committed (with its usage) before
/// it is used. If summarizing fails, the whole history goes out.
async fn compact(
    context: &Context<'_>,
    history: History,
    attempt: &mut Attempt,
) -> store::Result<History> {
    let Context {
        store,
        lease,
        run,
        agent,
        provider,
        control,
        deadline,
    } = *context;
    let Some(plan) = compaction::plan(&history, agent.system.as_deref(), &agent.context) else {
        return Ok(history);
    };
    let summarized = tokio::select! {
        summarized = compaction::summarize(
            provider,
            agent.model_name(),
            agent.max_tokens,
            &history.turns[..plan.turns],
        ) => summarized,
        // The inference that follows sees the cancellation, or the
        // deadline, at once.
        () = control.token.cancelled() => return Ok(history),
        () = sleep_until(deadline) => return Ok(history),
    };
    let (text, input_tokens, output_tokens) = match summarized {
        Ok(summary) => summary,
        Err(err) => {
            tracing::warn!(error = %err, "compaction failed; sending the whole history");
            return Ok(history);
        }
    };
    let cost = cost(
        agent,
        attempt.base.input_tokens + input_tokens,
        attempt.base.output_tokens + output_tokens,
    );
    let compaction = Compaction {
        through_message_id: plan.through,
        messages_compacted: plan.messages as i32,
        text,
        input_tokens,
        output_tokens,
    };
    let (usage, cursor) = runs::record_compaction(store, lease, compaction, cost).await?;
    attempt.base = usage;
    attempt.cursor = cursor;
    history::load(store, run).await
}

/// What compaction works with.
#[derive(Clone, Copy)]
struct Context<'a> {
    store: &'a Store,
    lease: &'a Lease,
    run: &'a run::Model,
    agent: &'a AgentConfig,
    provider: &'a dyn Provider,
    control: &'a Control,
    deadline: Instant,
}

/// The parts an attempt streams into (in display order), the tool calls
/// the model asked for, and what it used.
struct Attempt {
    /// The run's usage before this inference.
    base: Usage,
    /// Which attempt of this step's model request this is, from 1.
    request_attempt: i32,
    message_id: uuid::Uuid,
    parts: Vec<Streaming>,
    /// What the model said in this step in parts already closed (a step
    /// that asked for tools), for `content_match`.
    said: String,
    calls: Vec<AskedCall>,
    /// The newest persisted cursor, carried by live deltas.
    cursor: Cursor,
    input_tokens: i64,
    output_tokens: i64,
}

/// A tool call as the model streamed it, not yet committed.
struct AskedCall {
    id: String,
    name: String,
    input: serde_json::Value,
}

struct Streaming {
    part: OpenPart,
    text: String,
    persisted: usize,
    /// What closed a reasoning block (its signature, or the opaque data of
    /// redacted reasoning); no more text goes into it.
    seal: Option<serde_json::Value>,
    /// How many of the step's tool calls the model made before this part
    /// began: its place among them in the history sent back.
    calls_before: usize,
}

impl Streaming {
    fn new(part: OpenPart, calls_before: usize) -> Streaming {
        Streaming {
            part,
            text: String::new(),
            persisted: 0,
            seal: None,
            calls_before,
        }
    }

    /// The data a reasoning part keeps: its seal, and its place among the
    /// step's tool calls when calls came before it.
    fn data(&self) -> Option<serde_json::Value> {
        if self.part.kind != PartKind::Reasoning {
            return None;
        }
        let mut data = self.seal.clone();
        if self.calls_before > 0 {
            let data = data.get_or_insert_with(|| json!({}));
            data["afterCalls"] = json!(self.calls_before);
        }
        data
    }
}

/// What the model streamed, in its order.
enum Piece {
    Delta(PartKind, String),
    /// Closes the reasoning block being streamed.
    Signed(String),
    Redacted(String),
    Call(AskedCall),
}

/// Adds a delta to the pieces, joined with the one before when of its kind.
fn push_delta(pieces: &mut Vec<Piece>, kind: PartKind, chunk: String) {
    match pieces.last_mut() {
        Some(Piece::Delta(last, text)) if *last == kind => text.push_str(&chunk),
        _ => pieces.push(Piece::Delta(kind, chunk)),
    }
}

impl Attempt {
    fn new(begun: &Begun) -> Attempt {
        Attempt {
            base: usage_of(&begun.run),
            request_attempt: begun.run.attempt.max(1),
            message_id: begun.message_id,
            parts: begun
                .part
                .into_iter()
                .map(|p| Streaming::new(p, 0))
                .collect(),
            said: String::new(),
            calls: Vec::new(),
            cursor: begun.cursor,
            input_tokens: 0,
            output_tokens: 0,
        }
    }

    /// The next step's attempt, streaming into the part its step opened.
    fn next(base: Usage, part: OpenPart, cursor: Cursor) -> Attempt {
        Attempt {
            base,
            request_attempt: 1,
            message_id: part.message_id,
            parts: vec![Streaming::new(part, 0)],
            said: String::new(),
            calls: Vec::new(),
            cursor,
            input_tokens: 0,
            output_tokens: 0,
        }
    }

    fn part_text(streaming: &Streaming) -> PartText {
        PartText {
            part: streaming.part,
            text: streaming.text.clone(),
            data: streaming.data(),
        }
    }

    fn texts(&self) -> Vec<PartText> {
        self.parts.iter().map(Attempt::part_text).collect()
    }

    /// Parts with text not yet persisted.
    fn unsaved(&self) -> Vec<PartText> {
        self.parts
            .iter()
            .filter(|s| s.text.len() != s.persisted)
            .map(Attempt::part_text)
            .collect()
    }

    /// What the model said in this step (its text parts).
    fn text(&self) -> String {
        let mut text = self.said.clone();
        for streaming in &self.parts {
            if streaming.part.kind == PartKind::Text {
                text.push_str(&streaming.text);
            }
        }
        text
    }

    fn saved(&mut self) {
        for streaming in &mut self.parts {
            streaming.persisted = streaming.text.len();
        }
    }

    /// The trailing text part while it is still empty: the step's first
    /// text part, which new reasoning goes before (reasoning is shown
    /// before the text it led to).
    fn empty_text(&self) -> Option<usize> {
        let last = self.parts.len().checked_sub(1)?;
        let streaming = &self.parts[last];
        (streaming.part.kind == PartKind::Text && streaming.text.is_empty()).then_some(last)
    }

    /// The part that content of `kind` goes on in, if any: one part per
    /// block, in the order the model streamed them.
    fn target(&self, kind: PartKind) -> Option<usize> {
        if kind == PartKind::Text && self.empty_text().is_some() {
            return self.empty_text();
        }
        let current = self
            .empty_text()
            .unwrap_or(self.parts.len())
            .checked_sub(1)?;
        let streaming = &self.parts[current];
        (streaming.part.kind == kind && streaming.seal.is_none()).then_some(current)
    }

    /// Closes the reasoning block being streamed (one with no text yet
    /// when its signature comes alone).
    fn seal(&mut self, index: usize, seal: serde_json::Value) {
        self.parts[index].seal = Some(seal);
    }

    /// The run's usage with this attempt added.
    fn usage(&self, agent: &AgentConfig) -> Usage {
        let input = self.base.input_tokens + self.input_tokens;
        let output = self.base.output_tokens + self.output_tokens;
        Usage {
            input_tokens: input,
            output_tokens: output,
            cost_usd: cost(agent, input, output),
        }
    }
}

/// Streams one inference into the attempt's parts.
struct Stream<'a> {
    store: &'a Store,
    lease: &'a Lease,
    checkpoint_every: Duration,
    deadline: Instant,
    control: &'a Control,
}

impl Stream<'_> {
    async fn infer(
        &self,
        provider: &dyn Provider,
        request: ModelRequest,
        attempt: &mut Attempt,
    ) -> store::Result<Inference> {
        let mut stream = tokio::select! {
            started = provider.stream(request) => match started {
                Ok(stream) => stream,
                Err(err) => return Ok(Inference::Failed(err)),
            },
            () = self.control.token.cancelled() => return Ok(stopped(self.control)),
            () = sleep_until(self.deadline) => return Ok(Inference::TimedOut),
        };
        let mut next_checkpoint: Option<Instant> = None;
        loop {
            let checkpoint_due = async {
                match next_checkpoint {
                    Some(at) => sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                () = self.control.token.cancelled() => return Ok(stopped(self.control)),
                () = sleep_until(self.deadline) => return Ok(Inference::TimedOut),
                () = checkpoint_due => {
                    attempt.cursor = runs::checkpoint(self.store, self.lease, &attempt.unsaved()).await?;
                    attempt.saved();
                    next_checkpoint = None;
                    failpoints::hit("after_checkpoint");
                }
                item = stream.next() => {
                    // Whatever else the model has already sent goes out in
                    // the same deltas: fewer, larger frames, no added delay.
                    let mut items = vec![item];
                    while items.len() < MAX_COALESCED {
                        match stream.next().now_or_never() {
                            Some(next) => items.push(next),
                            None => break,
                        }
                    }
                    let mut pieces = Vec::new();
                    let mut outcome = None;
                    for item in items {
                        match item {
                            Some(Ok(ModelEvent::Text(chunk))) => {
                                push_delta(&mut pieces, PartKind::Text, chunk);
                            }
                            Some(Ok(ModelEvent::Reasoning(chunk))) => {
                                push_delta(&mut pieces, PartKind::Reasoning, chunk);
                            }
                            Some(Ok(ModelEvent::Usage { input_tokens, output_tokens })) => {
                                attempt.input_tokens = input_tokens;
                                attempt.output_tokens = output_tokens;
                            }
                            Some(Ok(ModelEvent::ReasoningSignature(signature))) => {
                                pieces.push(Piece::Signed(signature));
                            }
                            Some(Ok(ModelEvent::RedactedReasoning(data))) => {
                                pieces.push(Piece::Redacted(data));
                            }
                            Some(Ok(ModelEvent::ToolCall { id, name, input })) => {
                                pieces.push(Piece::Call(AskedCall { id, name, input }));
                            }
                            Some(Ok(ModelEvent::Finished { .. })) | None => {
                                outcome = Some(Inference::Done);
                                break;
                            }
                            Some(Err(err)) => {
                                outcome = Some(Inference::Failed(err));
                                break;
                            }
                        }
                    }
                    let mut grew = false;
                    for piece in pieces {
                        match piece {
                            Piece::Delta(kind, delta) => {
                                if !delta.is_empty() {
                                    self.append(attempt, kind, &delta).await?;
                                    grew = true;
                                }
                            }
                            Piece::Signed(signature) => {
                                let index = self.part_for(attempt, PartKind::Reasoning).await?;
                                attempt.seal(index, json!({ "signature": signature }));
                            }
                            Piece::Redacted(data) => {
                                let index = self.open(attempt, PartKind::Reasoning).await?;
                                attempt.seal(index, json!({ "redactedData": data }));
                            }
                            Piece::Call(call) => attempt.calls.push(call),
                        }
                    }
                    if grew {
                        next_checkpoint.get_or_insert_with(|| Instant::now() + self.checkpoint_every);
                    }
                    if let Some(outcome) = outcome {
                        return Ok(outcome);
                    }
                }
            }
        }
    }

    /// The part that content of `kind` goes into, opened when there is none.
    async fn part_for(&self, attempt: &mut Attempt, kind: PartKind) -> store::Result<usize> {
        match attempt.target(kind) {
            Some(index) => Ok(index),
            None => self.open(attempt, kind).await,
        }
    }

    /// Opens a part of `kind` after the others, or before the step's text
    /// part while that is empty.
    async fn open(&self, attempt: &mut Attempt, kind: PartKind) -> store::Result<usize> {
        let before = attempt.empty_text();
        let (opened, moved, cursor) = runs::open_part(
            self.store,
            self.lease,
            attempt.message_id,
            kind,
            before.map(|i| &attempt.parts[i].part),
        )
        .await?;
        attempt.cursor = cursor;
        let streaming = Streaming::new(opened, attempt.calls.len());
        Ok(match (moved, before) {
            (Some(moved), Some(i)) => {
                attempt.parts[i].part = moved;
                attempt.parts.insert(i, streaming);
                i
            }
            _ => {
                attempt.parts.push(streaming);
                attempt.parts.len() - 1
            }
        })
    }

    /// Adds streamed text to the attempt's part for `kind` and sends the
    /// live delta.
    async fn append(
        &self,
        attempt: &mut Attempt,
        kind: PartKind,
        delta: &str,
    ) -> store::Result<()> {
        let index = self.part_for(attempt, kind).await?;
        let streaming = &mut attempt.parts[index];
        let event = Event {
            conversation_id: self.lease.conversation_id,
            cursor: attempt.cursor,
            kind: EventKind::PartDelta,
            run_id: Some(self.lease.run_id),
            at: now_millis(),
            body: EventBody::Delta {
                message_id: streaming.part.message_id,
                part_id: streaming.part.id,
                offset: utf16_len(&streaming.text),
                text: delta.to_owned(),
            },
        };
        // A live, unpersisted delta: it carries the newest persisted cursor.
        self.store.bus().publish(&[event]);
        streaming.text.push_str(delta);
        Ok(())
    }
}

fn stopped(control: &Control) -> Inference {
    Inference::Stopped(control.reason().unwrap_or(Stop::Cancelled))
}

fn ended(cause: EndCause, usage: Usage, steps: i32) -> Ending {
    Ending {
        cause,
        error: None,
        reason: None,
        usage,
        steps,
    }
}

fn failed(cause: EndCause, message: String, usage: Usage, steps: i32) -> Ending {
    Ending {
        cause,
        error: Some(RunError::of_cause(cause, message.clone())),
        reason: Some(message),
        usage,
        steps,
    }
}

/// The end a limit or a stop condition calls for: `STOPPED` completes the
/// run with its reason, every other cause fails it.
fn stopped_by(cause: EndCause, message: String, usage: Usage, steps: i32) -> Ending {
    if cause == EndCause::Stopped {
        Ending {
            reason: Some(message),
            ..ended(cause, usage, steps)
        }
    } else {
        failed(cause, message, usage, steps)
    }
}

async fn end(store: &Store, lease: &Lease, attempt: &Attempt, ending: Ending) -> store::Result<()> {
    runs::finish(store, lease, &attempt.texts(), ending).await?;
    failpoints::hit("after_finish");
    Ok(())
}

/// Dollars for these totals at the agent's price.
fn cost(agent: &AgentConfig, input_tokens: i64, output_tokens: i64) -> f64 {
    agent.price.as_ref().map_or(0.0, |p| {
        (input_tokens as f64 * p.input_per_mtok + output_tokens as f64 * p.output_per_mtok)
            / 1_000_000.0
    })
}

fn usage_of(run: &run::Model) -> Usage {
    Usage {
        input_tokens: run.input_tokens,
        output_tokens: run.output_tokens,
        cost_usd: run.cost_usd,
    }
}

/// The first usage ceiling the run has gone over, if any.
fn over_ceiling(limits: &Limits, usage: &Usage) -> Option<(EndCause, String)> {
    if let Some(max) = limits.max_input_tokens
        && usage.input_tokens as u64 > max
    {
        return Some((
            EndCause::TokenLimit,
            format!(
                "the run used {} input tokens; the limit is {max}",
                usage.input_tokens
            ),
        ));
    }
    if let Some(max) = limits.max_output_tokens
        && usage.output_tokens as u64 > max
    {
        return Some((
            EndCause::TokenLimit,
            format!(
                "the run used {} output tokens; the limit is {max}",
                usage.output_tokens
            ),
        ));
    }
    if let Some(max) = limits.max_cost_usd
        && usage.cost_usd > max
    {
        return Some((
            EndCause::CostLimit,
            format!(
                "the run cost ${:.4}; the limit is ${max:.4}",
                usage.cost_usd
            ),
        ));
    }
    None
}

fn retry_policy(agent: &AgentConfig) -> RetryPolicy {
    RetryPolicy {
        max_attempts: agent.retry.max_attempts,
        initial_delay: Duration::from_millis(agent.retry.initial_delay_ms),
        max_delay: Duration::from_millis(agent.retry.max_delay_ms),
    }
}

/// The provider's error as the run shows it: its error type as the code.
fn provider_error(err: &ProviderError) -> RunError {
    let retryable = err.is_transient();
    match err {
        ProviderError::Http {
            status,
            code,
            message,
            ..
        } => RunError {
            code: code.clone(),
            message: message.clone(),
            http_status: Some(i32::from(*status)),
            retryable,
        },
        ProviderError::Stream { code, message } | ProviderError::Unusable { code, message } => {
            RunError {
                code: code.clone(),
                message: message.clone(),
                http_status: None,
                retryable,
            }
        }
        other => RunError {
            code: EndCause::Error.as_str().to_owned(),
            message: other.to_string(),
            http_status: None,
            retryable,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceilings_name_their_cause() {
        let limits = Limits {
            max_input_tokens: Some(100),
            max_output_tokens: Some(10),
            max_cost_usd: Some(0.5),
            ..Limits::default()
        };
        let usage = |i, o, c| Usage {
            input_tokens: i,
            output_tokens: o,
            cost_usd: c,
        };
        assert_eq!(over_ceiling(&limits, &usage(100, 10, 0.5)), None);
        assert_eq!(
            over_ceiling(&limits, &usage(101, 0, 0.0)).unwrap().0,
            EndCause::TokenLimit
        );
        assert_eq!(
            over_ceiling(&limits, &usage(0, 11, 0.0)).unwrap().0,
            EndCause::TokenLimit
        );
        assert_eq!(
            over_ceiling(&limits, &usage(0, 0, 0.51)).unwrap().0,
            EndCause::CostLimit
        );
    }
}
