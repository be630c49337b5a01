//! Before inference and inference: the history compacted to the context
//! budget, the model request streamed into the attempt's parts (live deltas,
//! checkpoints), and what the attempt used.

use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use serde_json::json;
use tokio::time::{Instant, sleep_until};

use super::{Control, Stop};
use crate::config::AgentConfig;
use crate::domain::PartKind;
use crate::domain::cursor::Cursor;
use crate::domain::event::{Event, EventBody, EventKind};
use crate::domain::run::Usage;
use crate::domain::time::now_millis;
use crate::failpoints;
use crate::providers::{ModelEvent, ModelRequest, Provider, ProviderError};
use crate::runtime::compaction;
use crate::runtime::history::{self, Histories, History};
use crate::store::commit::{Begun, Lease, OpenPart, PartText, utf16_len};
use crate::store::entities::run;
use crate::store::runs::{self, Compaction};
use crate::store::{self, Store};

/// The most model events merged into one delta.
const MAX_COALESCED: usize = 256;

/// How an inference ended.
pub(super) enum Inference {
    Done,
    Stopped(Stop),
    TimedOut,
    Failed(ProviderError),
}

/// Replaces the older turns by a summary when the history would exceed the
/// agent's context budget; the summary is committed (with its usage) before
/// it is used. If summarizing fails, the whole history goes out.
pub(super) async fn compact(
    context: &Context<'_>,
    history: History,
    attempt: &mut Attempt,
) -> store::Result<History> {
    let Context {
        store,
        histories,
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
    history::load(store, histories, run).await
}

/// What compaction works with.
#[derive(Clone, Copy)]
pub(super) struct Context<'a> {
    pub(super) store: &'a Store,
    pub(super) histories: &'a Histories,
    pub(super) lease: &'a Lease,
    pub(super) run: &'a run::Model,
    pub(super) agent: &'a AgentConfig,
    pub(super) provider: &'a dyn Provider,
    pub(super) control: &'a Control,
    pub(super) deadline: Instant,
}

/// The parts an attempt streams into (in display order), the tool calls
/// the model asked for, and what it used.
pub(super) struct Attempt {
    /// The run's usage before this inference.
    base: Usage,
    /// Which attempt of this step's model request this is, from 1.
    pub(super) request_attempt: i32,
    /// The message this step writes into.
    pub(super) message_id: uuid::Uuid,
    pub(super) parts: Vec<Streaming>,
    /// What the model said in this step in parts already closed (a step
    /// that asked for tools), for `content_match`.
    pub(super) said: String,
    pub(super) calls: Vec<AskedCall>,
    /// The newest persisted cursor, carried by live deltas.
    pub(super) cursor: Cursor,
    input_tokens: i64,
    output_tokens: i64,
}

/// A tool call as the model streamed it, not yet committed.
pub(super) struct AskedCall {
    pub(super) id: String,
    pub(super) name: String,
    pub(super) input: serde_json::Value,
}

pub(super) struct Streaming {
    part: OpenPart,
    text: String,
    /// `text`'s length in UTF-16 code units, the deltas' offsets, kept as
    /// it grows (counting the whole text at each delta is quadratic).
    utf16: i64,
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
            utf16: 0,
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
    pub(super) fn new(begun: &Begun) -> Attempt {
        Attempt {
            base: usage_of(&begun.run),
            request_attempt: begun.run.attempt.max(1),
            message_id: begun.message_id,
            parts: begun
                .part()
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
    pub(super) fn next(base: Usage, part: OpenPart, cursor: Cursor) -> Attempt {
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

    pub(super) fn texts(&self) -> Vec<PartText> {
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
    pub(super) fn text(&self) -> String {
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
    pub(super) fn usage(&self, agent: &AgentConfig) -> Usage {
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
pub(super) struct Stream<'a> {
    pub(super) store: &'a Store,
    pub(super) lease: &'a Lease,
    pub(super) checkpoint_every: Duration,
    pub(super) deadline: Instant,
    pub(super) control: &'a Control,
}

impl Stream<'_> {
    pub(super) async fn infer(
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
                offset: streaming.utf16,
                text: delta.to_owned(),
            },
        };
        // A live, unpersisted delta: it carries the newest persisted cursor.
        self.store.bus().publish(&[event]);
        streaming.text.push_str(delta);
        streaming.utf16 += utf16_len(delta);
        Ok(())
    }
}

fn stopped(control: &Control) -> Inference {
    Inference::Stopped(control.reason().unwrap_or(Stop::Cancelled))
}

/// Dollars for these totals at the agent's price.
fn cost(agent: &AgentConfig, input_tokens: i64, output_tokens: i64) -> f64 {
    agent.price.as_ref().map_or(0.0, |p| {
        (input_tokens as f64 * p.input_per_mtok + output_tokens as f64 * p.output_per_mtok)
            / 1_000_000.0
    })
}

pub(super) fn usage_of(run: &run::Model) -> Usage {
    Usage {
        input_tokens: run.input_tokens,
        output_tokens: run.output_tokens,
        cost_usd: run.cost_usd,
    }
}
