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

use super::history::History;
use super::{compaction, failpoints, history};
use crate::config::{AgentConfig, FileConfig, Limits};
use crate::domain::PartKind;
use crate::domain::cursor::Cursor;
use crate::domain::event::{Event, EventBody, EventKind};
use crate::domain::retry::RetryPolicy;
use crate::domain::run::{EndCause, RunError, Usage};
use crate::domain::time::now_millis;
use crate::providers::{self, ModelEvent, ModelRequest, Provider, ProviderError};
use crate::store::entities::run;
use crate::store::runs::{
    self, Begun, Compaction, Ending, Lease, OpenPart, PartText, RetryAfterFailure, utf16_len,
};
use crate::store::{self, Store};

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

    fn reason(&self) -> Option<Stop> {
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
    claimed: run::Model,
    control: Arc<Control>,
) {
    let lease = Lease::of(&claimed);
    let span = tracing::info_span!(
        "run",
        run_id = %lease.run_id,
        conversation_id = %lease.conversation_id,
        epoch = lease.epoch
    );
    match drive(&store, &config, &lease, &control)
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
    lease: &Lease,
    control: &Control,
) -> store::Result<()> {
    failpoints::hit("after_claim");
    // Run start.
    let begun = runs::begin(store, lease).await?;
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

    // Step start: limits.
    let limits = &agent.limits;
    let remaining_ms = (limits.timeout_secs as i64 * 1000 - run.active_ms).max(0);
    if remaining_ms == 0 {
        let ending = failed(
            EndCause::Timeout,
            "the run used up its time".into(),
            so_far,
            run.steps,
        );
        return end(store, lease, &attempt, ending).await;
    }
    if run.steps >= limits.max_steps as i32 {
        let message = format!("the run reached {} steps", limits.max_steps);
        let ending = failed(EndCause::StepLimit, message, so_far, run.steps);
        return end(store, lease, &attempt, ending).await;
    }
    let deadline = Instant::now() + Duration::from_millis(remaining_ms as u64);

    // Before inference: the history, from committed facts only, compacted
    // when it would exceed the context budget.
    let provider = providers::for_agent(agent);
    let history = history::load(store, run).await?;
    let context = Context {
        store,
        lease,
        run,
        agent,
        provider: provider.as_ref(),
        control,
    };
    let history = compact(&context, history, &mut attempt).await?;
    let request = ModelRequest {
        model: agent.model_name().to_owned(),
        system: agent.system.clone(),
        turns: history.turns,
        tools: Vec::new(),
        max_tokens: agent.max_tokens,
        thinking_budget: agent.thinking_budget_tokens,
        attempt: run.attempt.max(1) as u32,
    };

    // Inference.
    let stream = Stream {
        store,
        lease,
        checkpoint_every: Duration::from_millis(config.runtime.checkpoint_ms),
        deadline,
        control,
    };
    let inference = stream
        .infer(provider.as_ref(), request, &mut attempt)
        .await?;

    // After inference, step end, run end.
    let steps = run.steps + 1;
    let usage = attempt.usage(agent);
    match inference {
        Inference::Done => {
            let ending = match over_ceiling(limits, &usage) {
                Some((cause, message)) => failed(cause, message, usage, steps),
                None => ended(EndCause::Natural, usage, steps),
            };
            end(store, lease, &attempt, ending).await
        }
        Inference::TimedOut => {
            let ending = failed(
                EndCause::Timeout,
                "the run used up its time".into(),
                usage,
                steps,
            );
            end(store, lease, &attempt, ending).await
        }
        Inference::Failed(err) => {
            let error = provider_error(&err);
            let policy = retry_policy(agent);
            let failed_attempt = run.attempt.max(1);
            if !(err.is_transient() && policy.allows_another(failed_attempt as u32)) {
                let ending = Ending {
                    cause: EndCause::Error,
                    error: Some(error),
                    usage,
                    steps,
                };
                return end(store, lease, &attempt, ending).await;
            }
            let delay = policy.delay(failed_attempt as u32, err.retry_after(), fastrand::f64());
            tracing::info!(
                attempt = failed_attempt,
                delay_ms = delay.as_millis() as u64,
                error = %err,
                "model request failed; retrying"
            );
            let retry = RetryAfterFailure {
                failed_attempt,
                max_attempts: policy.max_attempts as i32,
                delay_ms: delay.as_millis() as i64,
                error,
            };
            runs::schedule_retry(store, lease, &attempt.texts(), retry).await?;
            failpoints::hit("after_retry_scheduled");
            // Any worker claims it when due (polling covers a crash); this
            // one wakes its own process right on time.
            let bus = store.bus().clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                bus.wake_workers();
            });
            Ok(())
        }
        Inference::Stopped(Stop::Cancelled) => {
            end(
                store,
                lease,
                &attempt,
                ended(EndCause::Cancelled, usage, run.steps),
            )
            .await
        }
        Inference::Stopped(Stop::Shutdown) => runs::release(store, lease, &attempt.texts()).await,
        Inference::Stopped(Stop::LeaseLost) => Err(store::Error::Fenced),
    }
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
        // The inference that follows sees the cancellation at once.
        () = control.token.cancelled() => return Ok(history),
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
}

/// The parts an attempt streams into (in display order), and what it used.
struct Attempt {
    /// The run's usage before this inference.
    base: Usage,
    message_id: uuid::Uuid,
    parts: Vec<Streaming>,
    /// The newest persisted cursor, carried by live deltas.
    cursor: Cursor,
    input_tokens: i64,
    output_tokens: i64,
}

struct Streaming {
    part: OpenPart,
    text: String,
    persisted: usize,
}

impl Attempt {
    fn new(begun: &Begun) -> Attempt {
        Attempt {
            base: usage_of(&begun.run),
            message_id: begun.part.message_id,
            parts: vec![Streaming {
                part: begun.part,
                text: String::new(),
                persisted: 0,
            }],
            cursor: begun.cursor,
            input_tokens: 0,
            output_tokens: 0,
        }
    }

    fn texts(&self) -> Vec<PartText> {
        self.parts
            .iter()
            .map(|s| PartText {
                part: s.part,
                text: s.text.clone(),
            })
            .collect()
    }

    /// Parts with text not yet persisted.
    fn unsaved(&self) -> Vec<PartText> {
        self.parts
            .iter()
            .filter(|s| s.text.len() != s.persisted)
            .map(|s| PartText {
                part: s.part,
                text: s.text.clone(),
            })
            .collect()
    }

    fn saved(&mut self) {
        for streaming in &mut self.parts {
            streaming.persisted = streaming.text.len();
        }
    }

    fn find(&self, kind: PartKind) -> Option<usize> {
        self.parts.iter().position(|s| s.part.kind == kind)
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
                    let mut text = String::new();
                    let mut reasoning = String::new();
                    let mut outcome = None;
                    for item in items {
                        match item {
                            Some(Ok(ModelEvent::Text(chunk))) => text.push_str(&chunk),
                            Some(Ok(ModelEvent::Reasoning(chunk))) => reasoning.push_str(&chunk),
                            Some(Ok(ModelEvent::Usage { input_tokens, output_tokens })) => {
                                attempt.input_tokens = input_tokens;
                                attempt.output_tokens = output_tokens;
                            }
                            Some(Ok(ModelEvent::ReasoningSignature(_) | ModelEvent::ToolCall { .. })) => {}
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
                    for (kind, delta) in [(PartKind::Reasoning, reasoning), (PartKind::Text, text)] {
                        if !delta.is_empty() {
                            self.append(attempt, kind, &delta).await?;
                            grew = true;
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

    /// Adds streamed text to the attempt's part of `kind`, opening that part
    /// first when there is none (reasoning before any text is shown before
    /// the text), and sends the live delta.
    async fn append(
        &self,
        attempt: &mut Attempt,
        kind: PartKind,
        delta: &str,
    ) -> store::Result<()> {
        let index = match attempt.find(kind) {
            Some(index) => index,
            None => {
                let text_part = attempt.find(PartKind::Text);
                let before = text_part
                    .filter(|i| attempt.parts[*i].text.is_empty())
                    .map(|i| attempt.parts[i].part);
                let (opened, moved, cursor) = runs::open_part(
                    self.store,
                    self.lease,
                    attempt.message_id,
                    kind,
                    before.as_ref(),
                )
                .await?;
                attempt.cursor = cursor;
                let streaming = Streaming {
                    part: opened,
                    text: String::new(),
                    persisted: 0,
                };
                match (moved, text_part) {
                    (Some(moved), Some(i)) => {
                        attempt.parts[i].part = moved;
                        attempt.parts.insert(i, streaming);
                        i
                    }
                    _ => {
                        attempt.parts.push(streaming);
                        attempt.parts.len() - 1
                    }
                }
            }
        };
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
        usage,
        steps,
    }
}

fn failed(cause: EndCause, message: String, usage: Usage, steps: i32) -> Ending {
    Ending {
        cause,
        error: Some(run_error(cause, message)),
        usage,
        steps,
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

fn run_error(cause: EndCause, message: String) -> RunError {
    RunError {
        code: cause.as_str().to_owned(),
        message,
        http_status: None,
        retryable: false,
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
        ProviderError::Stream { code, message } => RunError {
            code: code.clone(),
            message: message.clone(),
            http_status: None,
            retryable,
        },
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
