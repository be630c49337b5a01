//! Workers: claim queued runs, hold them under heartbeats, recover runs
//! whose worker died, and stop cleanly on shutdown.

mod batch;
pub mod compaction;
pub mod engine;
pub mod history;
mod stop;
mod sweep;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use uuid::Uuid;

use crate::config::FileConfig;
use crate::domain::retry::RetryPolicy;
use crate::store::commit::Lease;
use crate::store::interactions;
use crate::store::queue::{self, Heartbeat, Reclaim};
use crate::store::{Store, retry_within};
use crate::telemetry;
use crate::tools::registry::Registry as ToolRegistry;
use engine::{Control, Executed, Stop};
use history::Histories;

/// How often workers look for cancellations that no notification brought.
const CANCEL_POLL: Duration = Duration::from_secs(1);

/// The waits between attempts to give a failed run back: from 100 ms,
/// doubling up to 2 s.
const GIVE_BACK_AGAIN: RetryPolicy =
    RetryPolicy::unbounded(Duration::from_millis(100), Duration::from_secs(2));

pub struct RuntimeOptions {
    /// Names this process's leases; a restart with the same id reclaims
    /// those nobody renews any more without waiting for them to run out.
    pub instance_id: String,
    /// This process holds the database's worker lock (embedded SQLite), so
    /// no other can hold a lease: every lease left over at start-up is
    /// reclaimed at once. Never set it without holding that lock.
    pub sole_owner: bool,
}

/// The workers of one process.
pub struct Runtime {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// The controls of the runs this process executes, by run id. A run that
/// parks, resumes and is claimed again here gets a new entry while its old
/// execution may still be cleaning up, so each execution removes only its
/// own.
#[derive(Clone, Default)]
struct Controls(Arc<Mutex<HashMap<Uuid, Arc<Control>>>>);

impl Controls {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Arc<Control>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A fresh control for a claim of `run_id`, replacing an older one.
    fn open(&self, run_id: Uuid) -> Arc<Control> {
        let control = Arc::new(Control::default());
        self.lock().insert(run_id, control.clone());
        control
    }

    /// Removes `control` if it is still the entry for `run_id`.
    fn close(&self, run_id: Uuid, control: &Arc<Control>) {
        let mut controls = self.lock();
        if controls
            .get(&run_id)
            .is_some_and(|current| Arc::ptr_eq(current, control))
        {
            controls.remove(&run_id);
        }
    }

    fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The runs this process is executing now.
    fn runs(&self) -> Vec<Uuid> {
        self.lock().keys().copied().collect()
    }

    fn stop(&self, run_id: Uuid, reason: Stop) {
        if let Some(control) = self.lock().get(&run_id) {
            control.stop(reason);
        }
    }

    fn stop_all(&self, reason: Stop) {
        for control in self.lock().values() {
            control.stop(reason);
        }
    }
}

impl Runtime {
    pub fn start(
        store: Store,
        config: Arc<FileConfig>,
        tools: Arc<ToolRegistry>,
        options: RuntimeOptions,
    ) -> Runtime {
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(dispatch(store, config, tools, options, shutdown.clone()));
        Runtime { shutdown, task }
    }

    /// Stops claiming, asks running executions to give their runs back at
    /// their next commit point, and waits for them (within the grace period).
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }
}

async fn dispatch(
    store: Store,
    config: Arc<FileConfig>,
    tools: Arc<ToolRegistry>,
    options: RuntimeOptions,
    shutdown: CancellationToken,
) {
    let rt = &config.runtime;
    let budget = rt.crash_retry_budget;
    let lease_ms = rt.lease_ms();
    // How long live workers need to renew their leases: two heartbeats, at
    // most a lease.
    let heartbeat = Duration::from_secs_f64(rt.heartbeat_secs);
    let renewal = (heartbeat * 2).min(Duration::from_millis(lease_ms.max(0) as u64));
    if options.sole_owner {
        match queue::reclaim(&store, Reclaim::All, budget).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(runs = n, "recovered runs left by an earlier process"),
            Err(err) => tracing::error!(error = %err, "start-up recovery failed"),
        }
    } else {
        // Listed before this process claims anything under the same id.
        match queue::held_by(&store, &options.instance_id).await {
            Ok(held) if held.is_empty() => {}
            Ok(held) => {
                tokio::spawn(reclaim_unrenewed(store.clone(), held, renewal, budget));
            }
            Err(err) => tracing::error!(error = %err, "start-up recovery failed"),
        }
    }

    let controls = Controls::default();
    let histories = Arc::new(Histories::new(rt.history_cache_mib));
    let slots = Arc::new(Semaphore::new(rt.concurrency));
    let mut tasks = JoinSet::new();
    let mut cancels = store.bus().cancel_requests();
    let poll = Duration::from_millis(rt.poll_ms);
    let mut reap = tokio::time::interval(Duration::from_millis((lease_ms / 2).max(100) as u64));
    reap.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sweeper = sweep::Sweeper::new(renewal, heartbeat, budget);
    let mut look_for_cancels = tokio::time::interval(CANCEL_POLL);
    look_for_cancels.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    // Whether runs may be waiting for a free slot: the last claim took as
    // many as there were free, or a wake-up came with none free. A run's
    // end then claims again; otherwise it needs no claim of its own (a run
    // queued behind it in its conversation wakes the workers when the end
    // commits, as `run.queued` does).
    let mut saturated = false;
    let mut claim = true;
    // The poll (`poll_ms`) counts from the last claim, whatever woke the
    // loop since: wake-ups that claim nothing must not put it off.
    let polled = tokio::time::sleep(poll);
    tokio::pin!(polled);
    loop {
        // Claim while there are free slots and runs to claim, as many at
        // once as there are free slots.
        if claim {
            loop {
                let free = slots.available_permits();
                if free == 0 {
                    saturated = true;
                    break;
                }
                let began = std::time::Instant::now();
                let taking = queue::Slots {
                    free,
                    per_tenant: config.runtime.max_runs_per_tenant,
                };
                let claimed =
                    match queue::take(&store, &options.instance_id, lease_ms, taking).await {
                        Ok(claimed) => {
                            if !claimed.is_empty() {
                                telemetry::claimed(claimed.len(), began.elapsed());
                            }
                            claimed
                        }
                        Err(err) => {
                            tracing::warn!(error = %err, "claiming failed");
                            break;
                        }
                    };
                let exhausted = claimed.len() < free;
                for claimed in claimed {
                    // Only this loop takes permits, so one is free for each.
                    let Ok(permit) = slots.clone().try_acquire_owned() else {
                        break;
                    };
                    let control = controls.open(claimed.run.id);
                    let (store, config, tools, histories, controls) = (
                        store.clone(),
                        config.clone(),
                        tools.clone(),
                        histories.clone(),
                        controls.clone(),
                    );
                    // The task's end frees its slot, and wakes the loop below
                    // (`join_next`) to claim again if runs wait for one.
                    tasks.spawn(async move {
                        let run_id = claimed.run.id;
                        hold(store, config, tools, histories, claimed, control.clone()).await;
                        controls.close(run_id, &control);
                        drop(permit);
                    });
                }
                if exhausted {
                    // Under a tenant cap a run's end may let a run of its
                    // tenant go that the cap held back: claim after ends.
                    saturated = config.runtime.max_runs_per_tenant.is_some();
                    break;
                }
            }
            polled.as_mut().reset(tokio::time::Instant::now() + poll);
        }
        claim = true;
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = store.bus().run_queued() => {}
            () = &mut polled => {}
            _ = reap.tick() => {
                // Never a run this process executes: its heartbeat renews
                // a lease that ran out while the database was away.
                sweeper.sweep(&store, &controls.runs()).await;
                // Questions and approvals nobody resolved in time end their
                // wait, and their runs go on.
                match interactions::expire_due(&store).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(interactions = n, "expired unanswered interactions"),
                    Err(err) => tracing::warn!(error = %err, "expiring interactions failed"),
                }
            }
            // Cancels asked of another process: this one hears of them by
            // NOTIFY on PostgreSQL when its listener is up, and otherwise
            // here, within about a second.
            _ = look_for_cancels.tick(), if !controls.is_empty() => {
                match queue::cancels_requested(&store, &options.instance_id).await {
                    Ok(runs) => {
                        for run_id in runs {
                            controls.stop(run_id, Stop::Cancelled);
                        }
                    }
                    Err(err) => tracing::warn!(error = %err, "looking for cancellations failed"),
                }
                // Nothing to claim: a run a cancel ends frees its slot.
                claim = false;
            }
            request = cancels.recv() => {
                if let Ok(run_id) = request {
                    controls.stop(run_id, Stop::Cancelled);
                }
                claim = false;
            }
            // A run's task ended and freed its slot: claim again if runs
            // may be waiting for one.
            Some(_) = tasks.join_next() => claim = saturated,
        }
    }

    controls.stop_all(Stop::Shutdown);
    let grace = Duration::from_secs_f64(rt.shutdown_grace_secs);
    let drained =
        tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!("runs still in flight after the grace period; their leases will expire");
        tasks.abort_all();
    }
}

/// Reclaims the runs an earlier process with this instance id left, once
/// `wait` (longer than a heartbeat) shows that nobody renews their leases.
/// Claims meanwhile go on: they only take queued runs.
async fn reclaim_unrenewed(store: Store, held: Vec<queue::Held>, wait: Duration, budget: u32) {
    tokio::time::sleep(wait).await;
    match queue::reclaim(&store, Reclaim::Unrenewed(&held), budget).await {
        Ok(n) => {
            if n > 0 {
                tracing::info!(runs = n, "recovered runs left by an earlier process");
            }
            if n < held.len() {
                tracing::warn!(
                    runs = held.len() - n,
                    "runs under this instance id were renewed or moved on since start-up, \
                     so they are left alone (does a live process share TETHER_INSTANCE_ID?)"
                );
            }
        }
        Err(err) => tracing::error!(error = %err, "start-up recovery failed"),
    }
}

/// Executes a claimed run while a heartbeat renews its lease.
async fn hold(
    store: Store,
    config: Arc<FileConfig>,
    tools: Arc<ToolRegistry>,
    histories: Arc<Histories>,
    claimed: queue::Claimed,
    control: Arc<Control>,
) {
    let lease = Lease::of(&claimed.run);
    let rt = &config.runtime;
    let lease_ms = rt.lease_ms();
    let every = Duration::from_secs_f64(rt.heartbeat_secs);
    let heartbeat = {
        let (store, control, lease) = (store.clone(), control.clone(), lease.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                match queue::heartbeat(&store, &lease, lease_ms).await {
                    Ok(Heartbeat::Renewed {
                        cancel_requested: true,
                    }) => control.stop(Stop::Cancelled),
                    Ok(Heartbeat::Renewed { .. }) => {}
                    Ok(Heartbeat::Lost) => {
                        control.stop(Stop::LeaseLost);
                        return;
                    }
                    Err(err) => tracing::warn!(error = %err, "heartbeat failed"),
                }
            }
        })
    };
    // Aborted however the execution ends (a panic, or the task aborted at
    // the end of the shutdown grace): a lease nobody works under must run
    // out so that the run is recovered.
    let heartbeat = AbortOnDropHandle::new(heartbeat);
    let executed = engine::execute(
        store.clone(),
        config.clone(),
        tools,
        histories,
        claimed,
        control,
    )
    .await;
    if let Executed::Failed { run_at_fault } = executed {
        // A run at fault stops renewing its lease at once. One the database
        // went away under keeps renewing it while it waits for the database,
        // so that when it answers the lease is this process's again before
        // the sweeps of processes that saw the outage too (they wait two
        // heartbeats) could count the run as crashed.
        let _renewing = (!run_at_fault).then_some(heartbeat);
        let within = Duration::from_millis(lease_ms.max(0) as u64);
        let budget = run_at_fault.then_some(rt.crash_retry_budget);
        give_back(&store, &lease, budget, within).await;
    }
}

/// Gives back a run whose execution failed (`queue::abandon`), trying again
/// while the database cannot be reached: for as long as the lease would
/// have lasted when the run is at fault (past that, the sweep of whichever
/// process is up recovers it anyway, counted), and for as long as the
/// database is away when it went away under the run. Meanwhile the run is
/// still this process's, so its own sweep leaves it, and once the database
/// answers it goes back uncounted instead of being swept as a crash.
async fn give_back(store: &Store, lease: &Lease, budget: Option<u32>, within: Duration) {
    let give = || queue::abandon(store, lease, budget);
    let started = tokio::time::Instant::now();
    let again = |err: &crate::store::Error| {
        started.elapsed() < within || (budget.is_none() && err.is_unreachable())
    };
    if let Err(err) = retry_within(&GIVE_BACK_AGAIN, Duration::MAX, give, again).await {
        tracing::warn!(
            error = %err,
            run_id = %lease.run_id,
            "could not give the run back; it is recovered when its lease runs out"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_old_execution_removes_only_its_own_control() {
        let controls = Controls::default();
        let run_id = Uuid::now_v7();
        let old = controls.open(run_id);
        // The run parked, resumed and was claimed again by this process
        // before the old execution's clean-up ran.
        let new = controls.open(run_id);
        controls.close(run_id, &old);
        controls.stop(run_id, Stop::Cancelled);
        assert_eq!(
            new.reason(),
            Some(Stop::Cancelled),
            "the new claim's control is reachable"
        );
        assert_eq!(old.reason(), None);
        controls.close(run_id, &new);
        assert!(controls.lock().is_empty());
    }
}
