//! A step's batch of tool calls: what the model asked for is judged before
//! anything runs, then the calls that may run do, in parallel (bounded),
//! each committed `EXECUTING` before its effect and its result committed as
//! it finishes. The same code finishes a batch an earlier claim left: a
//! call still `REQUESTED` runs, an `EXECUTING` one is replayed with its key
//! when its tool is idempotent and ends `UNKNOWN` otherwise, and a call
//! with a recorded result is left alone.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt, TryStreamExt};
use serde_json::{Value, json};
use tracing::Instrument;
use uuid::Uuid;

use super::failpoints;
use crate::config::Recovery;
use crate::domain::retry::RetryPolicy;
use crate::domain::tool_call::{ToolCallStatus, ToolOutcome};
use crate::store::entities::tool_call;
use crate::store::runs::Lease;
use crate::store::tool_calls::{self, Verdict};
use crate::store::{self, Store};
use crate::tools::invoke::{Effect, Invocation, invoke};
use crate::tools::registry::{Registry, Tool};

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
    pub run_id: Uuid,
    pub retry: RetryPolicy,
    pub max_inline_bytes: usize,
    pub concurrency: usize,
}

impl Runner<'_> {
    /// Brings every call of the batch to its result. Dropping the future
    /// aborts the calls still running (their requests are closed).
    pub async fn run(&self, calls: &[tool_call::Model]) -> store::Result<()> {
        let mut open = Vec::new();
        for call in calls {
            if !tool_calls::state_of(call)?.is_terminal() {
                open.push(call);
            }
        }
        // Boxed up front: a lazily mapped stream of borrowing futures trips
        // the compiler's Send inference for the spawned run task.
        let calls: Vec<BoxFuture<'_, store::Result<()>>> = open
            .into_iter()
            .map(|call| {
                let span =
                    tracing::info_span!("tool_call", tool_call_id = %call.id, tool = %call.name);
                self.call(call).instrument(span).boxed()
            })
            .collect();
        futures_util::stream::iter(calls)
            .buffer_unordered(self.concurrency)
            .try_collect::<()>()
            .await
    }

    async fn call(&self, call: &tool_call::Model) -> store::Result<()> {
        let (store, lease) = (self.store, self.lease);
        let replay = tool_calls::state_of(call)?.status == ToolCallStatus::Executing;
        let tool = self.tools.get(&call.name);
        let input = call.input.as_ref();
        let (Some(tool), Some(input)) = (tool, input) else {
            // The configuration lost the tool since the call was asked for.
            let output =
                json!({ "error": format!("the tool {:?} is not configured any more", call.name) });
            if replay {
                tool_calls::indeterminate(store, lease, call.id, Some(output)).await?;
            } else {
                tool_calls::start(store, lease, call.id, false).await?;
                tool_calls::complete(store, lease, call.id, false, &output, self.max_inline_bytes)
                    .await?;
            }
            return Ok(());
        };
        if replay && tool.recovery == Recovery::NeverReplay {
            tracing::warn!("a call that must not be replayed was cut off; its outcome is unknown");
            tool_calls::indeterminate(store, lease, call.id, None).await?;
            return Ok(());
        }
        let started = tool_calls::start(store, lease, call.id, replay).await?;
        failpoints::hit("after_tool_executing");
        let effect = invoke(Invocation {
            tool,
            input,
            run_id: self.run_id,
            tool_call_id: call.id,
            idempotency_key: &started.idempotency_key,
            retry: &self.retry,
        })
        .await;
        failpoints::hit("after_tool_response");
        match effect {
            Effect::Succeeded(output) => {
                tool_calls::complete(store, lease, call.id, true, &output, self.max_inline_bytes)
                    .await?;
            }
            Effect::Failed(output) => {
                tool_calls::complete(store, lease, call.id, false, &output, self.max_inline_bytes)
                    .await?;
            }
            Effect::Unknown(output) => {
                tool_calls::indeterminate(store, lease, call.id, Some(output)).await?;
            }
        }
        failpoints::hit("after_tool_committed");
        Ok(())
    }
}
