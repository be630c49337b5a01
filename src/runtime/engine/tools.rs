//! A step's tool batch: the calls the model asked for committed `REQUESTED`
//! as a whole, then run (`runtime/batch.rs`) until done or parked, and the
//! step ended after them.

use serde_json::json;
use tokio::time::sleep_until;

use super::end::{end, failed, over, over_ceiling, retry_policy, stopped_by};
use super::inference::Attempt;
use super::{Next, Steps, Stop};
use crate::config::BUILTIN_TOOLS;
use crate::domain::run::{EndCause, Waiting};
use crate::domain::tool_call::ToolOutcome;
use crate::failpoints;
use crate::runtime::{batch, stop};
use crate::store::entities::tool_call;
use crate::store::interactions;
use crate::store::runs;
use crate::store::tool_calls::{self, NewToolCall, Verdict};
use crate::store::{self, commit, reads};

/// The built-in tool that asks a person questions.
const ASK_QUESTIONS: &str = BUILTIN_TOOLS[0];

/// Why a batch stopped before its calls were done.
enum Cut {
    Stop(Stop),
    Timeout,
}

impl Steps<'_> {
    /// Commits the step's output and its tool calls, `REQUESTED` as a whole
    /// batch before any runs (refused ones already with their result).
    /// `None` when the batch reached the run's tool call limit and ended it.
    pub(super) async fn request_tools(
        &self,
        step: i32,
        attempt: &mut Attempt,
    ) -> store::Result<Option<Vec<tool_call::Model>>> {
        let limits = &self.agent.limits;
        let earlier =
            reads::tool_calls_of_run(self.store.db(), &self.run.tenant, self.run.id, None)
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
    pub(super) async fn finish_batch(
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
            lease_ms: self.lease_ms,
            concurrency: self.tool_concurrency,
        };
        let mut calls = calls.to_vec();
        let mut held = loop {
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
            let ran = match outcome {
                Ok(Ok(ran)) => ran,
                Ok(Err(store::Error::CancelRequested)) | Err(Cut::Stop(Stop::Cancelled)) => {
                    return self.stop(Stop::Cancelled, &attempt, step).await;
                }
                Ok(Err(err)) => return Err(err),
                Err(Cut::Stop(stop)) => return self.stop(stop, &attempt, step).await,
                Err(Cut::Timeout) => return self.timed_out(&attempt, step).await,
            };
            if !ran.waiting {
                break ran.held;
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
            calls = commit::of_step(store.db(), self.run.id, step).await?;
        };
        // The batch's only call handed its result back for the step's end to
        // commit; anything but a plain step end commits it first, alone.
        let mut record_held = async || -> store::Result<()> {
            if let Some(finished) = held.take() {
                runner.record(finished).await?;
                failpoints::hit("after_tool_committed");
            }
            Ok(())
        };
        // A shutdown lets the batch finish (within the grace period), then
        // hands the run back.
        if let Some(stop) = self.control.reason() {
            record_held().await?;
            return self.stop(stop, &attempt, step).await;
        }
        // A consent that ran out while the batch ran ends the run (only a
        // call of a tool with a connection can have waited for one).
        let consented = calls.iter().any(|call| {
            self.tools
                .get(&call.name)
                .is_some_and(|tool| tool.connection.is_some())
        });
        if consented {
            record_held().await?;
            if let Some(request) = interactions::consent_expired(store, self.run.id).await? {
                let message = interactions::consent_expired_message(&request, None);
                let ending = failed(
                    EndCause::ConsentExpired,
                    message,
                    attempt.usage(agent),
                    step + 1,
                );
                return over(end(store, lease, &attempt, ending).await);
            }
        }

        // Step end.
        let usage = attempt.usage(agent);
        let all = if stop::looks_at_calls(&agent.stop) {
            record_held().await?;
            reads::tool_calls_of_run(store.db(), &self.run.tenant, self.run.id, None).await?
        } else {
            Vec::new()
        };
        let text = attempt.text();
        let condition = over_ceiling(&agent.limits, &usage)
            .or_else(|| stop::after_tools(&agent.stop, &all, step, &text));
        if let Some((cause, message)) = condition {
            record_held().await?;
            let ending = stopped_by(cause, message, usage, step + 1);
            return over(end(store, lease, &attempt, ending).await);
        }
        // A question asked in this step parks the run until it is answered
        // (or expires); the answers open the next step.
        let asked = calls.iter().any(|c| c.name == ASK_QUESTIONS);
        if asked {
            record_held().await?;
            match interactions::park(store, lease, Waiting::Question, usage, true).await {
                Ok(true) => return Ok(Next::Over),
                Ok(false) => {}
                Err(store::Error::CancelRequested) => {
                    return self.stop(Stop::Cancelled, &attempt, step + 1).await;
                }
                Err(err) => return Err(err),
            }
        }
        let finished = held.take();
        let recorded = finished.is_some();
        let message_id = attempt.message_id;
        let (part, cursor) = runner
            .durably(move |s, l| {
                let finished = finished.clone();
                async move { runs::end_step(&s, &l, message_id, usage, finished.as_ref()).await }
            })
            .await?;
        if recorded {
            failpoints::hit("after_tool_committed");
        }
        failpoints::hit("after_step");
        Ok(Next::Step(Attempt::next(usage, part, cursor)))
    }
}
