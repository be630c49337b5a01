//! Leases under clock skew and database outages (PostgreSQL; on SQLite one
//! process owns the database, so these return at once): leases are taken
//! and compared on the database's clock, a process whose clock is wrong
//! takes no live lease, and an outage longer than a lease neither loses a
//! call's result nor sends the call again nor counts as a recovery.

use std::time::Duration;

use serde_json::Value;

use crate::db_proxy::DbProxy;
use crate::downstream::Downstream;
use crate::support::{Companion, PATIENCE, Server, ServerOptions, http_client, on_postgres};
use crate::tools::{config, tool_calls};

const CALL: &str = r#"/tool gated {"text": "once"}"#;

/// How many lease sweeps a process has made that reached the database.
async fn sweeps(companion: &Companion) -> u64 {
    let text = http_client()
        .get(format!("{}/metrics", companion.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix("tether_lease_sweeps_total "))
        .map(|n| n.trim().parse().unwrap())
        .expect("the sweep counter is exported")
}

/// Waits until `companion` has made `more` sweeps after this call.
async fn sweeps_pass(companion: &Companion, more: u64) {
    let from = sweeps(companion).await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while sweeps(companion).await < from + more {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the process never swept"
        );
        tick.tick().await;
    }
}

/// Waits until the run's lease has run out on the database's clock.
async fn lease_runs_out(server: &Server, run: &str) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    while !server.lease_ran_out(run).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lease never ran out"
        );
        tick.tick().await;
    }
}

/// How long an outage goes on after the lease ran out: the issue's
/// `lease_secs + 3` s, a length of time the test sets, not a condition.
const PAST_THE_LEASE: Duration = Duration::from_secs(3);

/// Keeps the database away from a process (`proxy`, cut) until its run's
/// lease has been out for `PAST_THE_LEASE`, then brings it back.
async fn outage_past_the_lease(server: &Server, proxy: &DbProxy, run: &str) {
    lease_runs_out(server, run).await;
    tokio::time::sleep(PAST_THE_LEASE).await;
    proxy.restore();
}

/// The run ended with its one call made once, at attempt 1, and without
/// a recovery.
async fn ended_once(server: &Server, downstream: &Downstream, token: &str, run: &str) {
    let ended = server.wait_until_ended(token, run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let calls = tool_calls(server, token, run).await;
    let call: &Value = &calls[0];
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(call["status"], "COMPLETED", "{call}");
    assert_eq!(call["outcome"], "SUCCEEDED", "{call}");
    assert_eq!(call["attempt"], 1, "{call}");
    assert_eq!(downstream.requests_to("/gated").len(), 1, "requested once");
    assert_eq!(server.recoveries(run).await, 0, "no recovery");
}

/// A server with no workers of its own (the test starts them), and the
/// configuration they share: lease 3 s, the `tools` agent calling
/// `downstream`.
async fn api_server(config: &str) -> Server {
    Server::start_with(ServerOptions {
        config: config.to_owned(),
        ..Default::default()
    })
    .await
}

/// Ada's run of `text` with the `tools` agent: its token and run id.
async fn adas_run(server: &Server, text: &str) -> (String, String) {
    let token = server.token("acme", "ada");
    let conversation = server.conversation_with(&token, "tools").await;
    let (_, run) = server.send(&token, &conversation, text).await;
    (token, run)
}

/// Ada's run of the gated call, once the call has reached `downstream`.
async fn the_call_under_way(server: &Server, downstream: &Downstream) -> (String, String) {
    let (token, run) = adas_run(server, CALL).await;
    downstream
        .wait_for("the call", |d| d.requests_to("/gated").len() == 1)
        .await;
    (token, run)
}

#[tokio::test]
async fn a_process_whose_clock_runs_ahead_leaves_a_live_lease_alone() {
    if !on_postgres() {
        return;
    }
    let downstream = Downstream::start().await;
    let config = config(&downstream, "", &[("tools", "")]);
    let server = Server::start_workers(&config).await;
    let (token, run) = the_call_under_way(&server, &downstream).await;
    // A second worker whose clock is 20 s ahead: by its clock the lease
    // (3 s) ran out long ago, by the database's it is renewed.
    let ahead = server
        .companion_with("worker", &config, &[("TETHER_CLOCK_SKEW_MS", "20000")])
        .await;
    sweeps_pass(&ahead, 3).await;
    assert!(!server.lease_ran_out(&run).await);
    downstream.open_gate();
    ended_once(&server, &downstream, &token, &run).await;
}

/// A worker whose clock is 20 s behind claims the run and renews its
/// lease: on its own clock the lease it wrote would have run out 17 s
/// before it was taken, so another worker's sweeps would take the run at
/// once; on the database's it is live, and stays so.
#[tokio::test]
async fn a_process_whose_clock_runs_behind_claims_and_renews_a_live_lease() {
    if !on_postgres() {
        return;
    }
    let downstream = Downstream::start().await;
    let config = config(&downstream, "", &[("tools", "")]);
    let server = api_server(&config).await;
    let _behind = server
        .companion_with("worker", &config, &[("TETHER_CLOCK_SKEW_MS", "-20000")])
        .await;
    let (token, run) = the_call_under_way(&server, &downstream).await;
    let sweeper = server.companion_with("worker", &config, &[]).await;
    sweeps_pass(&sweeper, 3).await;
    assert!(!server.lease_ran_out(&run).await);
    downstream.open_gate();
    ended_once(&server, &downstream, &token, &run).await;
}

/// The worker reaches the database through a relay the test cuts while
/// its call runs, for longer than its lease; the call's result comes back
/// after the database does, or while it is still away.
async fn an_outage_longer_than_the_lease(result_during_the_outage: bool) {
    let downstream = Downstream::start().await;
    let config = config(&downstream, "", &[("tools", "")]);
    let server = api_server(&config).await;
    let proxy = DbProxy::start(server.database_url()).await;
    let worker = server
        .companion_with("worker", &config, &[("TETHER_DATABASE_URL", &proxy.url)])
        .await;
    let (token, run) = the_call_under_way(&server, &downstream).await;

    proxy.cut();
    if result_during_the_outage {
        downstream.open_gate();
    }
    outage_past_the_lease(&server, &proxy, &run).await;
    if !result_during_the_outage {
        // The worker's own sweeps see its lapsed lease and leave it.
        sweeps_pass(&worker, 2).await;
        downstream.open_gate();
    }
    ended_once(&server, &downstream, &token, &run).await;
}

#[tokio::test]
async fn an_outage_longer_than_the_lease_during_a_call_loses_nothing() {
    if !on_postgres() {
        return;
    }
    an_outage_longer_than_the_lease(false).await;
}

#[tokio::test]
async fn a_result_that_comes_back_during_an_outage_is_committed_once_the_database_returns() {
    if !on_postgres() {
        return;
    }
    an_outage_longer_than_the_lease(true).await;
}

/// The database goes away while the model streams a reply, for longer
/// than the lease: the worker gives the run back once the database answers
/// (its own sweep leaves it meanwhile), uncounted, and the run completes on
/// its next claim. It was given up after one lease and then swept as a
/// crash (`recoveries 1`; three such outages ended a run `RECOVERY_LIMIT`).
#[tokio::test]
async fn an_outage_longer_than_the_lease_while_the_model_streams_is_no_recovery() {
    if !on_postgres() {
        return;
    }
    let downstream = Downstream::start().await;
    let config = config(&downstream, "", &[("tools", "")]);
    let server = api_server(&config).await;
    let proxy = DbProxy::start(server.database_url()).await;
    let _worker = server
        .companion_with("worker", &config, &[("TETHER_DATABASE_URL", &proxy.url)])
        .await;
    let (token, run) = adas_run(&server, "/hold 3").await;
    server
        .wait_for_run(&token, &run, |r| r["status"] == "RUNNING")
        .await;

    proxy.cut();
    outage_past_the_lease(&server, &proxy, &run).await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    assert_eq!(server.recoveries(&run).await, 0, "no recovery");
}

/// The database goes away for two workers at once, for longer than a
/// lease, and comes back for the one that does not execute the run first:
/// it waits for live workers to renew their leases before it sweeps, and
/// the worker executing the run renews its own and commits the call's
/// result.
#[tokio::test]
async fn after_an_outage_a_process_gives_live_workers_time_to_renew_before_it_sweeps() {
    if !on_postgres() {
        return;
    }
    let downstream = Downstream::start().await;
    // A 4 s lease renewed every second: the sweeps (every 2 s) wait 2 s
    // once the database is back.
    let config = config(&downstream, "", &[("tools", "")]).replacen(
        "lease_secs = 3\nheartbeat_secs = 0.5",
        "lease_secs = 4\nheartbeat_secs = 1",
        1,
    );
    assert!(config.contains("lease_secs = 4"), "{config}");
    let server = api_server(&config).await;
    let (to_runner, to_sweeper) = (
        DbProxy::start(server.database_url()).await,
        DbProxy::start(server.database_url()).await,
    );
    let _runner = server
        .companion_with(
            "worker",
            &config,
            &[("TETHER_DATABASE_URL", &to_runner.url)],
        )
        .await;
    let (token, run) = the_call_under_way(&server, &downstream).await;
    let sweeper = server
        .companion_with(
            "worker",
            &config,
            &[
                ("TETHER_DATABASE_URL", &to_sweeper.url),
                ("RUST_LOG", "info"),
            ],
        )
        .await;
    sweeps_pass(&sweeper, 1).await;

    to_runner.cut();
    to_sweeper.cut();
    lease_runs_out(&server, &run).await;
    // The sweeper hears the database first; the runner's heartbeat comes
    // after its next ping.
    to_sweeper.restore();
    server.wait_for_log("the database answers again", 1).await;
    to_runner.restore();
    sweeps_pass(&sweeper, 2).await;
    downstream.open_gate();
    ended_once(&server, &downstream, &token, &run).await;
}
