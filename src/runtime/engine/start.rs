//! Run start: a claim's first commit, then its steps, one after another,
//! beginning with any batch of tool calls an earlier claim left unfinished.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use super::end::{end, ended, failed};
use super::inference::{Attempt, usage_of};
use super::{Control, Next, Steps, Stop};
use crate::config::FileConfig;
use crate::domain::run::EndCause;
use crate::domain::time::secs_to_millis;
use crate::failpoints;
use crate::providers;
use crate::runtime::history::Histories;
use crate::store::commit::{Begun, FirstStep, Lease};
use crate::store::queue;
use crate::store::runs;
use crate::store::{self, Store};
use crate::telemetry;
use crate::tools::registry::Registry;

/// Executes one claim of a run; whether it failed, so that the caller gives
/// the run back (`queue::abandon`). A lease that moved on is no failure:
/// the run is someone else's.
pub async fn execute(
    store: Store,
    config: Arc<FileConfig>,
    tools: Arc<Registry>,
    histories: Arc<Histories>,
    claimed: queue::Claimed,
    control: Arc<Control>,
) -> Executed {
    let lease = Lease::of(&claimed.run);
    let span = tracing::info_span!(
        "run",
        run_id = %lease.run_id,
        conversation_id = %lease.conversation_id,
        tenant = %lease.tenant,
        epoch = lease.epoch
    );
    match drive(
        &store,
        &config,
        &tools,
        &histories,
        &lease,
        claimed.begun,
        &control,
    )
    .instrument(span.clone())
    .await
    {
        Ok(()) => Executed::Done,
        Err(store::Error::Fenced) => {
            span.in_scope(|| tracing::info!("the lease moved on; stopped without writing"));
            Executed::Done
        }
        // The lease ran out while the database was away, or the worker
        // stalled: the run goes back, not counted, unless a heartbeat
        // renewed it meanwhile (then it is still ours to give).
        Err(err) if err.is_unreachable() || matches!(err, store::Error::Lapsed) => {
            span.in_scope(|| {
                tracing::warn!(error = %err, "the database went away mid-run; giving the run back")
            });
            Executed::Failed {
                run_at_fault: false,
            }
        }
        Err(err) => {
            span.in_scope(
                || tracing::error!(error = %err, "run execution failed; giving the run back"),
            );
            Executed::Failed { run_at_fault: true }
        }
    }
}

/// How an execution ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Executed {
    /// It ended the run, handed it back, parked it, or lost its lease.
    Done,
    /// An error stopped it half-way: the run is to be recovered from what
    /// was committed. Counted against the crash retry budget unless the
    /// database merely went away (a restart, a cut connection).
    Failed { run_at_fault: bool },
}

async fn drive(
    store: &Store,
    config: &FileConfig,
    tools: &Registry,
    histories: &Histories,
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
        histories,
        offered: tools.for_agent(agent),
        provider: provider.as_ref(),
        control,
        deadline,
        checkpoint_every: Duration::from_millis(config.runtime.checkpoint_ms),
        lease_ms: config.runtime.lease_ms(),
        tool_concurrency: config.runtime.tool_concurrency,
        policy: &config.policy,
    };
    let mut step = run.steps;
    // A batch of tool calls that an earlier claim left unfinished is
    // finished, from its committed facts, before the model hears anything.
    if let FirstStep::FinishBatch(batch) = &begun.first {
        attempt.said = batch.said.clone();
        match steps.finish_batch(&batch.calls, step, attempt).await? {
            Next::Step(next) => attempt = next,
            Next::Over => return Ok(()),
        }
        step += 1;
    }
    loop {
        let began = std::time::Instant::now();
        let next = steps
            .step(step, attempt)
            .instrument(tracing::info_span!("step", step))
            .await;
        telemetry::step(began.elapsed());
        match next? {
            Next::Step(next) => attempt = next,
            Next::Over => return Ok(()),
        }
        step += 1;
    }
}
