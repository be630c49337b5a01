//! Metrics for Prometheus: every family's name and help in one place, the
//! process's recorder, and what the code records, one function each.
//!
//! Counters and histograms are this process's own (they start at zero when
//! it starts, as Prometheus expects of counters). The figures about the
//! shared work (runs by status, the queue, pending interactions) are read
//! from the database when `/metrics` is scraped, so every instance reports
//! the same totals for them.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::domain::event::Event;
use crate::domain::run::{EndCause, RunStatus};
use crate::domain::time::now_millis;
use crate::domain::tool_call::ToolOutcome;

pub const RUNS_ENDED: &str = "tether_runs_ended_total";
pub const RUNS: &str = "tether_runs";
pub const QUEUE_DEPTH: &str = "tether_queue_depth";
pub const QUEUE_OLDEST_AGE: &str = "tether_queue_oldest_age_seconds";
pub const RUNS_CLAIMED: &str = "tether_runs_claimed_total";
pub const LEASE_SWEEPS: &str = "tether_lease_sweeps_total";
pub const CLAIM_DURATION: &str = "tether_claim_duration_seconds";
pub const STEP_DURATION: &str = "tether_step_duration_seconds";
pub const INFERENCE_DURATION: &str = "tether_inference_duration_seconds";
pub const TOOL_DURATION: &str = "tether_tool_duration_seconds";
pub const PROVIDER_ERRORS: &str = "tether_provider_errors_total";
pub const PROVIDER_RETRIES: &str = "tether_provider_retries_total";
pub const TOOL_CALLS_ENDED: &str = "tether_tool_calls_ended_total";
pub const INTERACTIONS_PENDING: &str = "tether_interactions_pending";
pub const WEBSOCKETS: &str = "tether_websocket_connections";
pub const SUBSCRIPTIONS: &str = "tether_subscriptions";
pub const EVENTS_COMMITTED: &str = "tether_events_committed_total";
pub const FANOUT_LAG: &str = "tether_fanout_lag_seconds";
pub const SUBSCRIBER_CATCH_UPS: &str = "tether_subscriber_catch_ups_total";
pub const DB_CONNECTIONS: &str = "tether_db_pool_connections";
pub const DB_CONNECTIONS_MAX: &str = "tether_db_pool_max_connections";
pub const LISTENER_RECONNECTS: &str = "tether_notify_listener_reconnects_total";
pub const LISTENER_UP: &str = "tether_notify_listener_up";

/// Latency buckets, in seconds: from a millisecond (a claim, a fan-out) to
/// two minutes (a model's long answer, a slow tool).
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs this process's recorder, once, and returns what renders it.
/// `None` when something else installed a recorder first (a program that
/// embeds Tether and records its own metrics): then `/metrics` answers 404.
pub fn install() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS)
                .ok()?
                .build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).ok()?;
            describe();
            // The families without labels are shown from the start, at zero.
            counter!(RUNS_CLAIMED).increment(0);
            counter!(LEASE_SWEEPS).increment(0);
            counter!(SUBSCRIBER_CATCH_UPS).increment(0);
            gauge!(WEBSOCKETS).increment(0.0);
            Some(handle)
        })
        .as_ref()
}

/// How often recorded histogram values are moved into their buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Moves recorded histogram values into their buckets every few seconds
/// until `stop`: the recorder keeps each value until then, so a process
/// nobody scrapes would otherwise hold every one it recorded.
pub async fn keep_up(stop: tokio_util::sync::CancellationToken) {
    let Some(handle) = install() else {
        return;
    };
    let mut every = tokio::time::interval(UPKEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = every.tick() => handle.run_upkeep(),
        }
    }
}

fn describe() {
    describe_counter!(
        RUNS_ENDED,
        "Runs this process ended, by final status and end cause."
    );
    describe_gauge!(
        RUNS,
        "Runs not yet ended, by status, across all instances (read at scrape)."
    );
    describe_gauge!(
        QUEUE_DEPTH,
        "Runs waiting to be claimed: QUEUED, and RETRY_PENDING whose next attempt is due."
    );
    describe_gauge!(
        QUEUE_OLDEST_AGE,
        Unit::Seconds,
        "Age of the oldest QUEUED run (0 when none)."
    );
    describe_counter!(RUNS_CLAIMED, "Runs this process's workers claimed.");
    describe_counter!(
        LEASE_SWEEPS,
        "Sweeps for runs whose lease ran out that reached the database."
    );
    describe_histogram!(
        CLAIM_DURATION,
        Unit::Seconds,
        "How long a claim that took runs lasted, from its query to its commit."
    );
    describe_histogram!(
        STEP_DURATION,
        Unit::Seconds,
        "A step: history, inference and its tool batch."
    );
    describe_histogram!(
        INFERENCE_DURATION,
        Unit::Seconds,
        "A model request, from the request to its last streamed event, by provider."
    );
    describe_histogram!(
        TOOL_DURATION,
        Unit::Seconds,
        "A tool's invocation, retries within it included, by tool."
    );
    describe_counter!(
        PROVIDER_ERRORS,
        "Failed model requests, by provider and error class."
    );
    describe_counter!(
        PROVIDER_RETRIES,
        "Failed model requests parked for another attempt, by provider and error class."
    );
    describe_counter!(
        TOOL_CALLS_ENDED,
        "Tool calls that reached an outcome, by tool and outcome (UNKNOWN included)."
    );
    describe_gauge!(
        INTERACTIONS_PENDING,
        "Questions, approvals and connections waiting for a person, by kind (read at scrape)."
    );
    describe_gauge!(WEBSOCKETS, "Open WebSocket connections.");
    describe_gauge!(SUBSCRIPTIONS, "Subscriptions being served.");
    describe_counter!(
        EVENTS_COMMITTED,
        "Events this process committed to conversation logs, by type."
    );
    describe_histogram!(
        FANOUT_LAG,
        Unit::Seconds,
        "From an event's commit to its delivery to a live subscriber."
    );
    describe_counter!(
        SUBSCRIBER_CATCH_UPS,
        "Times a live subscriber fell behind the bus and read the log instead."
    );
    describe_gauge!(
        DB_CONNECTIONS,
        "Database connections, by pool (write, read) and state (in_use, idle)."
    );
    describe_gauge!(
        DB_CONNECTIONS_MAX,
        "The most connections a pool opens, by pool."
    );
    describe_counter!(
        LISTENER_RECONNECTS,
        "Times the PostgreSQL LISTEN connection was lost and made again."
    );
    describe_gauge!(
        LISTENER_UP,
        "1 while the PostgreSQL LISTEN connection is up (PostgreSQL only)."
    );
}

/// Counts what a transaction committed: its persisted events, the runs it
/// ended and the tool calls it gave an outcome.
pub fn committed(events: &[Event], tally: &Tally) {
    for event in events.iter().filter(|e| e.kind.is_persisted()) {
        counter!(EVENTS_COMMITTED, "type" => event.kind.as_str()).increment(1);
    }
    for (status, cause) in &tally.runs_ended {
        counter!(RUNS_ENDED, "status" => status.as_str(), "cause" => cause.as_str()).increment(1);
    }
    for (tool, outcome) in &tally.tool_outcomes {
        counter!(TOOL_CALLS_ENDED, "tool" => tool.clone(), "outcome" => outcome.as_str())
            .increment(1);
    }
}

/// What a write transaction ended, counted once it commits.
#[derive(Debug, Default)]
pub struct Tally {
    pub runs_ended: Vec<(RunStatus, EndCause)>,
    pub tool_outcomes: Vec<(String, ToolOutcome)>,
}

/// A sweep for leases that ran out went through.
pub fn swept() {
    counter!(LEASE_SWEEPS).increment(1);
}

pub fn claimed(runs: usize, took: Duration) {
    counter!(RUNS_CLAIMED).increment(runs as u64);
    histogram!(CLAIM_DURATION).record(took);
}

pub fn step(took: Duration) {
    histogram!(STEP_DURATION).record(took);
}

pub fn inference(provider: &'static str, took: Duration) {
    histogram!(INFERENCE_DURATION, "provider" => provider).record(took);
}

pub fn tool(tool: &str, took: Duration) {
    histogram!(TOOL_DURATION, "tool" => tool.to_owned()).record(took);
}

/// A failed model request.
pub fn provider_failed(provider: &'static str, class: &'static str) {
    counter!(PROVIDER_ERRORS, "provider" => provider, "class" => class).increment(1);
}

/// A failed model request parked for another attempt.
pub fn provider_retried(provider: &'static str, class: &'static str) {
    counter!(PROVIDER_RETRIES, "provider" => provider, "class" => class).increment(1);
}

/// Counts an open WebSocket for as long as it is kept.
pub struct WebSocketOpen(());

/// A WebSocket opened; it is counted until the value is dropped.
pub fn websocket_opened() -> WebSocketOpen {
    gauge!(WEBSOCKETS).increment(1.0);
    WebSocketOpen(())
}

impl Drop for WebSocketOpen {
    fn drop(&mut self) {
        gauge!(WEBSOCKETS).decrement(1.0);
    }
}

/// A live event delivered to a subscriber, `at` being its commit time.
pub fn delivered(at: i64) {
    let lag_ms = (now_millis() - at).max(0) as u64;
    histogram!(FANOUT_LAG).record(Duration::from_millis(lag_ms));
}

pub fn subscriber_fell_behind() {
    counter!(SUBSCRIBER_CATCH_UPS).increment(1);
}

/// The figures read when `/metrics` is scraped.
#[derive(Debug, Default)]
pub struct Scrape {
    /// Runs not ended, by status (every such status, zeros included).
    pub runs: Vec<(RunStatus, u64)>,
    pub queue_depth: u64,
    pub queue_oldest_age: Duration,
    /// Pending interactions by kind (every kind, zeros included).
    pub interactions_pending: Vec<(&'static str, u64)>,
    pub subscriptions: usize,
    pub pools: Vec<Pool>,
    /// `None` on SQLite, where there is no listener.
    pub listener: Option<Listener>,
}

#[derive(Debug)]
pub struct Pool {
    pub name: &'static str,
    pub in_use: u32,
    pub idle: u32,
    pub max: u32,
}

#[derive(Debug)]
pub struct Listener {
    pub up: bool,
    pub reconnects: u64,
}

/// Sets the scrape's figures, then renders every family in Prometheus's
/// text format.
pub fn render(handle: &PrometheusHandle, scrape: &Scrape) -> String {
    for (status, count) in &scrape.runs {
        gauge!(RUNS, "status" => status.as_str()).set(*count as f64);
    }
    gauge!(QUEUE_DEPTH).set(scrape.queue_depth as f64);
    gauge!(QUEUE_OLDEST_AGE).set(scrape.queue_oldest_age.as_secs_f64());
    for (kind, count) in &scrape.interactions_pending {
        gauge!(INTERACTIONS_PENDING, "kind" => *kind).set(*count as f64);
    }
    gauge!(SUBSCRIPTIONS).set(scrape.subscriptions as f64);
    for pool in &scrape.pools {
        gauge!(DB_CONNECTIONS, "pool" => pool.name, "state" => "in_use").set(pool.in_use);
        gauge!(DB_CONNECTIONS, "pool" => pool.name, "state" => "idle").set(pool.idle);
        gauge!(DB_CONNECTIONS_MAX, "pool" => pool.name).set(pool.max);
    }
    if let Some(listener) = &scrape.listener {
        gauge!(LISTENER_UP).set(if listener.up { 1.0 } else { 0.0 });
        counter!(LISTENER_RECONNECTS).absolute(listener.reconnects);
    }
    handle.run_upkeep();
    handle.render()
}
