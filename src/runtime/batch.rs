//! A step's batch of tool calls: what the model asked for is judged before
//! anything runs, then the calls that may run do, in parallel (bounded),
//! each committed `EXECUTING` before its effect and its result committed as
//! it finishes. The same code finishes a batch an earlier claim left: a
//! call still `REQUESTED` runs, an `EXECUTING` one is replayed with its key
//! when its tool is idempotent and ends `UNKNOWN` otherwise, and a call
//! with a recorded result is left alone.

use std::sync::Arc;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use serde_json::{Value, json};
use tokio::sync::{Notify, Semaphore, SemaphorePermit};
use tracing::Instrument;

use crate::config::{Recovery, TenantRules};
use crate::connections::Credential;
use crate::domain::interaction::questions;
use crate::domain::retry::RetryPolicy;
use crate::domain::time::secs_to_millis;
use crate::domain::tool_call::{ToolCallStatus, ToolOutcome};
use crate::failpoints;
use crate::store::commit::{self, Lease};
use crate::store::entities::{run, tool_call};
use crate::store::interactions::{self, ApprovalRequest, Decided, Take};
use crate::store::queue::{self, Heartbeat};
use crate::store::tool_calls::{self, Finished, Outcome, Verdict};
use crate::store::{self, Store};
use crate::telemetry;
use crate::tools::invoke::{Effect, Invocation, invoke};
use crate::tools::registry::{Registry, Runner as ToolRunner, Tool};

/// Whether a call the model asked for may run, and with which input. Input
/// the schema refuses never runs: the model gets the problems back.
pub fn verdict(offered: &[Arc<Tool>], name: &str, input: &Value) -> Verdict {
    let Some(tool) = offered.iter().find(|t| t.name == name) else {
        let names: Vec<&str> = offered.iter().map(|t| t.name.as_str()).collect();
        return Verdict::Refuse(
            ToolOutcome::Failed,
            json!({
                "error": format!("there is no tool {name:?}; the tools are: {}", names.join(", "))
            }),
        );
    };
    match tool.normalize(input) {
        Ok(normalized) => Verdict::Run(normalized),
        Err(invalid) => Verdict::Refuse(
            ToolOutcome::Failed,
            json!({ "error": invalid.to_string(), "input_schema": tool.input_schema }),
        ),
    }
}

pub struct Runner<'a> {
    pub store: &'a Store,
    pub lease: &'a Lease,
    pub tools: &'a Registry,
    pub run: &'a run::Model,
    pub rules: TenantRules,
    pub retry: RetryPolicy,
    pub max_inline_bytes: usize,
    pub concurrency: usize,
    /// How long a lease lasts when renewed.
    pub lease_ms: i64,
}

/// How often a call's result is tried again while the database is away.
const RESULT_AGAIN: RetryPolicy =
    RetryPolicy::unbounded(Duration::from_millis(100), Duration::from_secs(2));

/// What the calls of one batch share while they run.
struct Batch {
    /// Effects running at once, at most `concurrency`.
    slots: Semaphore,
    /// The batch's only call hands its result back (`Reached::Held`)
    /// instead of committing it: the step's end commits it.
    hold: bool,
    /// Calls still on their way (neither finished nor only waiting for a
    /// person); a waiting call keeps looking for its decision while any is.
    active: AtomicUsize,
    changed: Notify,
}

impl Batch {
    fn settle(&self) {
        self.active.fetch_sub(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
}

/// What a call has for its connection.
enum Access {
    /// Ready to run, with the token when its tool declares a connection.
    Token(Option<String>),
    /// It failed without a token, and has its result.
    Failed,
    /// Its consent was settled without a token (declined, expired).
    Settled,
    /// It waits for a consent, and nothing else of the batch runs.
    Waiting,
}

/// Where a call of the batch got to.
enum Reached {
    /// Its result is committed.
    Result,
    /// It waits for a person.
    Waiting,
    /// Its result is handed back uncommitted (see `Batch::hold`).
    Held(Finished),
}

/// What a batch's run came to.
pub struct Ran {
    /// Some call waits for a person's decision, and nothing else runs.
    pub waiting: bool,
    /// The result of the batch's only call, for the step's end to commit
    /// (`runs::end_step`), or alone (`tool_calls::record`) when the step
    /// ends otherwise.
    pub held: Option<Finished>,
}

/// How often a waiting call looks for its decision while others run.
const DECISION_POLL: Duration = Duration::from_millis(200);

impl Runner<'_> {
    /// Brings every call of the batch to its result, or to waiting for a
    /// person's decision. The result of a batch's only call is handed back,
    /// not committed. Dropping the future aborts the calls still running
    /// (their requests are closed).
    pub async fn run(&self, calls: &[tool_call::Model]) -> store::Result<Ran> {
        let mut open = Vec::new();
        for call in calls {
            if !commit::state_of(call)?.is_terminal() {
                open.push(call);
            }
        }
        let batch = Batch {
            slots: Semaphore::new(self.concurrency.max(1)),
            hold: open.len() == 1,
            active: AtomicUsize::new(open.len()),
            changed: Notify::new(),
        };
        // Boxed up front: a lazily mapped stream of borrowing futures trips
        // the compiler's Send inference for the spawned run task.
        let calls: Vec<BoxFuture<'_, store::Result<Reached>>> = open
            .into_iter()
            .map(|call| {
                let span =
                    tracing::info_span!("tool_call", tool_call_id = %call.id, tool = %call.name, run_id = %call.run_id, tenant = %call.tenant);
                self.call(call, &batch).instrument(span).boxed()
            })
            .collect();
        let reached = futures_util::future::try_join_all(calls).await?;
        let waiting = reached.iter().any(|r| matches!(r, Reached::Waiting));
        let held = reached.into_iter().find_map(|r| match r {
            Reached::Held(finished) => Some(finished),
            _ => None,
        });
        Ok(Ran { waiting, held })
    }

    /// One call to its result, or to waiting for a person.
    async fn call(&self, call: &tool_call::Model, batch: &Batch) -> store::Result<Reached> {
        let id = call.id;
        let status = commit::state_of(call)?.status;
        let tool = self.tools.get(&call.name);
        let input = call.input.as_ref();
        let (Some(tool), Some(input)) = (tool, input) else {
            // The configuration lost the tool since the call was asked for.
            let output =
                json!({ "error": format!("the tool {:?} is not configured any more", call.name) });
            match status {
                ToolCallStatus::Executing => {
                    let finished = Finished {
                        call_id: id,
                        outcome: Outcome::Unknown(Some(output)),
                        max_inline_bytes: self.max_inline_bytes,
                    };
                    self.record(finished).await?;
                }
                ToolCallStatus::Awaiting => {
                    self.whole(move |s, l| async move {
                        interactions::abandon_waiting(&s, &l, id, output).await
                    })
                    .await?;
                }
                _ => self.fail_at_once(call, &output).await?,
            }
            batch.settle();
            return Ok(Reached::Result);
        };
        let mut approved = false;
        let waited = match status {
            ToolCallStatus::Awaiting => true,
            ToolCallStatus::Requested if tool.risk.is_some() => {
                if self
                    .whole(move |s, _| async move { interactions::approved(&s, id).await })
                    .await?
                {
                    // Allowed and claimed by an earlier claim of the run.
                    approved = true;
                    false
                } else if self.granted(&tool.name).await? {
                    false
                } else {
                    let request = ApprovalRequest {
                        tool_name: tool.name.clone(),
                        summary: tool.summary.clone(),
                        risk_category: tool.risk.clone().unwrap_or_default(),
                        input: input.clone(),
                        estimated_cost_usd: tool.estimated_cost_usd,
                        idempotency_key: call.idempotency_key.clone(),
                    };
                    let ttl = secs_to_millis(self.rules.approval_ttl_secs);
                    let call = call.clone();
                    self.whole(move |s, l| async move {
                        interactions::ask_approval(&s, &l, &call, &request, ttl).await
                    })
                    .await?;
                    true
                }
            }
            ToolCallStatus::Requested if matches!(tool.runner, ToolRunner::AskQuestions) => {
                match questions(input) {
                    Ok(specs) => {
                        let ttl = secs_to_millis(self.rules.question_ttl_secs);
                        let call = call.clone();
                        self.whole(move |s, l| async move {
                            interactions::ask(&s, &l, &call, &specs, ttl).await
                        })
                        .await?;
                    }
                    Err(problem) => {
                        self.fail_at_once(call, &json!({ "error": problem }))
                            .await?;
                    }
                }
                batch.settle();
                return Ok(Reached::Result);
            }
            _ => false,
        };
        let mut begun = None;
        if waited {
            // A resumed run was woken by a decision: it takes it at once. A
            // tool without a connection has nothing left to look up once
            // allowed, and starts in the decision's commit.
            let take = Take {
                read_first: status != ToolCallStatus::Awaiting,
                start: tool.connection.is_none(),
            };
            let (decided, slot) = self.decision(call, batch, take).await?;
            match decided {
                Decided::Run => {}
                Decided::Started(started) => begun = Some((*started, slot)),
                Decided::Settled => return Ok(Reached::Result),
                // Nothing else of the batch is on its way: the run parks.
                Decided::Pending => return Ok(Reached::Waiting),
            }
            failpoints::hit("after_decision_taken");
        }
        let replay = status == ToolCallStatus::Executing;
        let bearer = match self.access(call, tool, replay, batch).await? {
            Access::Token(bearer) => bearer,
            Access::Failed => {
                batch.settle();
                return Ok(Reached::Result);
            }
            Access::Settled => return Ok(Reached::Result),
            Access::Waiting => return Ok(Reached::Waiting),
        };
        let result = self
            .effect(
                call,
                tool,
                input,
                replay,
                waited || approved,
                batch,
                bearer.as_deref(),
                begun,
            )
            .await;
        batch.settle();
        Ok(match result? {
            Some(finished) => Reached::Held(finished),
            None => Reached::Result,
        })
    }

    /// The token of the call's connection. A gap pauses the call for a
    /// consent when the provider offers one (and this call has not had one
    /// already); otherwise the call fails, saying which credential and why.
    async fn access(
        &self,
        call: &tool_call::Model,
        tool: &Tool,
        replay: bool,
        batch: &Batch,
    ) -> store::Result<Access> {
        let Some(need) = &tool.connection else {
            return Ok(Access::Token(None));
        };
        let connections = self.tools.connections.clone();
        loop {
            let (run, need_now) = (self.run.clone(), need.clone());
            let found = {
                let connections = connections.clone();
                self.whole(move |s, _| async move {
                    connections
                        .credential(&s, &run.tenant, &run.principal, &need_now)
                        .await
                })
                .await?
            };
            let output = match found {
                Credential::Bearer(token) => return Ok(Access::Token(Some(token))),
                Credential::Unavailable(why) => json!({ "error": why }),
                Credential::Gap(gap) => {
                    let id = call.id;
                    let offer = if replay
                        || self
                            .whole(move |s, _| async move {
                                interactions::consented_before(&s, id).await
                            })
                            .await?
                    {
                        None
                    } else {
                        connections.offer(&self.run.tenant, &self.run.principal, need, gap)
                    };
                    match offer {
                        Some(offer) => {
                            let call_row = call.clone();
                            self.whole(move |s, l| async move {
                                interactions::ask_connection(
                                    &s,
                                    &l,
                                    &call_row,
                                    &offer.request,
                                    offer.consent,
                                    offer.ttl_ms,
                                )
                                .await
                            })
                            .await?;
                            let take = Take {
                                read_first: true,
                                start: false,
                            };
                            match self.decision(call, batch, take).await?.0 {
                                // Consent given: the token is there now.
                                Decided::Run | Decided::Started(_) => continue,
                                Decided::Settled => return Ok(Access::Settled),
                                Decided::Pending => return Ok(Access::Waiting),
                            }
                        }
                        None => connections.gap_failure(&tool.name, need, gap),
                    }
                }
            };
            if replay {
                let finished = Finished {
                    call_id: call.id,
                    outcome: Outcome::Answered {
                        succeeded: false,
                        output,
                        cut: false,
                    },
                    max_inline_bytes: self.max_inline_bytes,
                };
                self.record(finished).await?;
            } else {
                self.fail_at_once(call, &output).await?;
            }
            return Ok(Access::Failed);
        }
    }

    /// A call that cannot run ends `FAILED` with `output`, never started.
    async fn fail_at_once(&self, call: &tool_call::Model, output: &Value) -> store::Result<()> {
        let (id, output, max) = (call.id, output.clone(), self.max_inline_bytes);
        self.whole(move |s, l| async move { tool_calls::reject(&s, &l, id, &output, max).await })
            .await?;
        Ok(())
    }

    /// Commits what a started call came to.
    pub async fn record(&self, finished: Finished) -> store::Result<()> {
        self.durably(move |s, l| {
            let finished = finished.clone();
            async move { tool_calls::record(&s, &l, finished).await }
        })
        .await?;
        Ok(())
    }

    /// Runs a commit that carries a call's result (`whole`) until the
    /// database takes it: the effect happened, and an outage must not lose
    /// what it came to. While the database cannot be reached it is tried
    /// again; a lease that ran out meanwhile is renewed first (it is still
    /// this worker's while nobody moved the run on), and one that moved on
    /// is `Fenced`.
    pub async fn durably<T, F, Fut>(&self, operation: F) -> store::Result<T>
    where
        F: Fn(Store, Lease) -> Fut,
        Fut: Future<Output = store::Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let mut failures = 0;
        loop {
            let err = match self.whole(&operation).await {
                Err(store::Error::Lapsed) => {
                    match queue::heartbeat(self.store, self.lease, self.lease_ms).await {
                        Ok(Heartbeat::Renewed { .. }) => continue,
                        Ok(Heartbeat::Lost) => return Err(store::Error::Fenced),
                        Err(err) => err,
                    }
                }
                Err(err) => err,
                done => return done,
            };
            if !err.is_unreachable() {
                return Err(err);
            }
            failures += 1;
            tracing::warn!(
                error = %err,
                run_id = %self.lease.run_id,
                "the database is away; a call's result waits to be committed"
            );
            tokio::time::sleep(RESULT_AGAIN.delay(failures, None, fastrand::f64())).await;
        }
    }

    /// Whether a standing grant covers this tool for the run.
    async fn granted(&self, tool: &str) -> store::Result<bool> {
        let (run, tool) = (self.run.clone(), tool.to_owned());
        self.whole(move |s, _| async move { interactions::granted(&s, &run, &tool).await })
            .await
    }

    /// Runs a store operation to its end in a task of its own. Dropping the
    /// batch (a cancel, a deadline) aborts the calls' requests, but must not
    /// cut a transaction off mid-statement: its connection would go back to
    /// the pool half-used. The same holds for a commit that carries a call's
    /// result after the batch (the run's task may be aborted when a
    /// shutdown's grace period ends).
    pub async fn whole<T, F, Fut>(&self, operation: F) -> store::Result<T>
    where
        F: FnOnce(Store, Lease) -> Fut,
        Fut: Future<Output = store::Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let task = tokio::spawn(operation(self.store.clone(), self.lease.clone()));
        task.await
            .map_err(|e| store::Error::Corrupt(format!("a store operation did not finish: {e}")))?
    }

    /// Waits for a person's decision on a waiting call while other calls
    /// of the batch are on their way, and takes it into the run: `Run` (it
    /// is allowed and runs now, counted active again), `Started` (the same,
    /// committed `EXECUTING` already, with the slot it runs in), `Settled`
    /// (it has its result) or `Pending` (nothing else of the batch is
    /// running).
    async fn decision<'b>(
        &self,
        call: &tool_call::Model,
        batch: &'b Batch,
        mut take: Take,
    ) -> store::Result<(Decided, Option<SemaphorePermit<'b>>)> {
        let mut counted = true;
        loop {
            let changed = batch.changed.notified();
            let id = call.id;
            // A call that may start in the decision's commit holds its slot
            // first, as any start does.
            let slot = if take.start {
                batch.slots.acquire().await.ok()
            } else {
                None
            };
            let decided = self
                .whole(
                    move |s, l| async move { interactions::take_decision(&s, &l, id, take).await },
                )
                .await?;
            match decided {
                Decided::Run | Decided::Started(_) => {
                    if !counted {
                        batch.active.fetch_add(1, Ordering::SeqCst);
                    }
                    return Ok((decided, slot));
                }
                Decided::Settled => {
                    if counted {
                        batch.settle();
                    }
                    return Ok((Decided::Settled, None));
                }
                // No slot is held while the call waits.
                Decided::Pending => drop(slot),
            }
            take.read_first = true;
            if counted {
                counted = false;
                batch.settle();
            }
            if batch.active.load(Ordering::SeqCst) == 0 {
                return Ok((Decided::Pending, None));
            }
            tokio::select! {
                () = changed => {}
                () = tokio::time::sleep(DECISION_POLL) => {}
            }
        }
    }

    /// Runs the call's effect: committed `EXECUTING` first (`begun`: with
    /// its decision already, in the slot it holds), the result after,
    /// committed or handed back (`Batch::hold`). A `never_replay` call cut
    /// off while executing ends `UNKNOWN`.
    #[allow(clippy::too_many_arguments)]
    async fn effect(
        &self,
        call: &tool_call::Model,
        tool: &Tool,
        input: &Value,
        replay: bool,
        approved: bool,
        batch: &Batch,
        bearer: Option<&str>,
        begun: Option<(tool_call::Model, Option<SemaphorePermit<'_>>)>,
    ) -> store::Result<Option<Finished>> {
        let id = call.id;
        if replay && tool.recovery == Recovery::NeverReplay {
            tracing::warn!("a call that must not be replayed was cut off; its outcome is unknown");
            let finished = Finished {
                call_id: id,
                outcome: Outcome::Unknown(None),
                max_inline_bytes: self.max_inline_bytes,
            };
            self.record(finished).await?;
            return Ok(None);
        }
        // A gated call gets here only approved, or covered by a grant
        // (checked just before, or when it was first started).
        let cleared = tool.risk.is_none() || approved || replay || self.granted(&tool.name).await?;
        let (started, _slot) = match begun {
            Some(begun) => begun,
            None => {
                let slot = batch.slots.acquire().await.ok();
                let started = self
                    .whole(move |s, l| async move { tool_calls::start(&s, &l, id, replay).await })
                    .await?;
                (started, slot)
            }
        };
        failpoints::hit("after_tool_executing");
        let began = std::time::Instant::now();
        let outcome = invoke(Invocation {
            tool,
            input,
            run_id: self.run.id,
            tool_call_id: call.id,
            idempotency_key: &started.idempotency_key,
            retry: &self.retry,
            cleared,
            bearer,
        })
        .await;
        telemetry::tool(&tool.name, began.elapsed());
        failpoints::hit("after_tool_response");
        let cut = outcome.cut;
        let answered = |succeeded, output| Outcome::Answered {
            succeeded,
            output,
            cut,
        };
        let finished = Finished {
            call_id: id,
            outcome: match outcome.effect {
                Effect::Succeeded(output) => answered(true, output),
                Effect::Failed(output) => answered(false, output),
                Effect::Unknown(output) => Outcome::Unknown(Some(output)),
            },
            max_inline_bytes: self.max_inline_bytes,
        };
        if batch.hold {
            return Ok(Some(finished));
        }
        self.record(finished).await?;
        failpoints::hit("after_tool_committed");
        Ok(None)
    }
}
