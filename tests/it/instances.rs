//! A split deployment: an API process and a worker process on one database.
//! The worker's events reach the API's subscribers (NOTIFY on PostgreSQL,
//! the log's head on SQLite), and a cancellation reaches the worker. An
//! overlapping deploy never takes runs from a live process.

use serde_json::json;

use crate::support::{
    Launch, PATIENCE, Server, ServerOptions, WORKER_CONFIG, WsClient, of_type, on_postgres,
};

const EVENTS: &str = "subscription($c: ID!, $a: String) { conversationEvents(conversationId: $c, after: $a) { cursor type runId } }";

#[tokio::test]
async fn the_api_streams_what_a_separate_worker_commits() {
    let api = Server::api_only(WORKER_CONFIG).await;
    let _worker = api.companion("worker").await;
    let token = api.token("acme", "ada");
    let conversation = api.create_conversation(&token).await;
    let mut client = WsClient::connect(&api, &token).await;
    client
        .subscribe(
            "e",
            EVENTS,
            json!({ "c": conversation, "a": "0000000000000000" }),
        )
        .await;
    let (_, run) = api
        .send(&token, &conversation, "hello across processes")
        .await;

    let mut seen = Vec::new();
    loop {
        let event = client.next_event("e").await["data"]["conversationEvents"].clone();
        let done = event["type"] == "run.completed";
        seen.push(event);
        if done {
            break;
        }
    }
    // Live deltas cross processes through NOTIFY on PostgreSQL; everywhere
    // the text arrives with the checkpoints.
    let deltas = seen.iter().filter(|e| e["type"] == "part.delta").count();
    if on_postgres() {
        assert!(deltas > 0, "no live delta reached the API's subscriber");
    }
    let seen: Vec<_> = seen
        .into_iter()
        .filter(|e| e["type"] != "part.delta")
        .collect();
    let types: Vec<&str> = seen.iter().map(|e| e["type"].as_str().unwrap()).collect();
    let checkpoints = types.iter().filter(|t| **t == "part.updated").count();
    assert!(checkpoints >= 2, "checkpoints while streaming: {types:?}");
    for expected in [
        "message.created",
        "run.queued",
        "run.started",
        "part.added",
        "run.checkpointed",
        "run.completed",
    ] {
        assert!(types.contains(&expected), "{expected} missing: {types:?}");
    }
    for (i, event) in seen.iter().enumerate() {
        assert_eq!(event["cursor"], format!("{:016}", i + 1), "{types:?}");
    }
    assert_eq!(seen.last().unwrap()["runId"], run.as_str());

    // A cancellation asked of the API reaches the other process's worker.
    let (_, held) = api.send(&token, &conversation, "/hold 60").await;
    api.wait_for_run(&token, &held, |r| r["status"] == "RUNNING")
        .await;
    let data = api
        .gql(
            &token,
            "mutation($r: ID!) { cancelRun(runId: $r) { status cancelRequested } }",
            json!({ "r": held }),
        )
        .await;
    assert_eq!(data["cancelRun"]["cancelRequested"], true);
    let ended = api.wait_until_ended(&token, &held).await;
    assert_eq!(ended["status"], "CANCELLED");
    assert_eq!(ended["endCause"], "CANCELLED");
}

/// Waits for the run to end, then checks that it completed after exactly
/// one claim: nobody took it from the process that held it.
async fn completed_on_one_claim(server: &Server, token: &str, conversation: &str, run: &str) {
    let ended = server.wait_until_ended(token, run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let events = server.all_events(token, conversation).await;
    let started = of_type(&events, "run.started");
    assert_eq!(started.len(), 1, "claimed once: {events:?}");
    assert_eq!(
        of_type(&events, "run.queued").len(),
        1,
        "never re-queued: {events:?}"
    );
}

#[tokio::test]
async fn a_second_worker_on_one_sqlite_file_is_refused_and_the_first_keeps_its_run() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "/hold 6").await;
    server
        .wait_for_run(&token, &run, |r| r["status"] == "RUNNING")
        .await;

    let second = server.launch_beside("worker", false).await;
    if on_postgres() {
        // Workers of many processes share PostgreSQL; their claims skip
        // each other's rows.
        assert!(
            matches!(second, Launch::Serving { .. }),
            "a second worker on PostgreSQL starts"
        );
    } else {
        let Launch::Exited { status, stderr } = second else {
            panic!("a second worker process on the same SQLite file started");
        };
        assert!(!status.success(), "{status}");
        assert!(
            stderr.contains("another tether process runs workers on this SQLite database"),
            "{stderr}"
        );
        assert!(stderr.contains("--role api"), "{stderr}");
    }
    // An API-only process beside the workers is fine, and serves.
    let Launch::Serving { child: mut api, .. } = server.launch_beside("api", false).await else {
        panic!("an API-only process beside the worker did not start");
    };
    assert!(
        api.try_wait().unwrap().is_none(),
        "the API process keeps running"
    );

    completed_on_one_claim(&server, &token, &conversation, &run).await;
}

#[tokio::test]
async fn an_overlapping_process_with_the_same_instance_id_leaves_live_runs_alone() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "/hold 10").await;
    server
        .wait_for_run(&token, &run, |r| r["status"] == "RUNNING")
        .await;

    // Kept running until the run ends: it has every chance to take it.
    let _second = match server.launch_beside("all", true).await {
        Launch::Serving { child, mut log, .. } => {
            assert!(on_postgres(), "a second worker on one SQLite file started");
            // It lists the leases held under its id, sees them renewed, and
            // leaves them to the live process.
            let noticed = tokio::time::timeout(PATIENCE, async {
                while let Some(line) = log.recv().await {
                    if line.contains("renewed or moved on since start-up") {
                        return true;
                    }
                }
                false
            })
            .await;
            assert_eq!(
                noticed,
                Ok(true),
                "the start-up recovery did not leave the run alone"
            );
            Some(child)
        }
        Launch::Exited { status, stderr } => {
            assert!(!on_postgres(), "refused on PostgreSQL ({status}): {stderr}");
            assert!(!status.success(), "{status}");
            assert!(
                stderr.contains("another tether process runs workers"),
                "{stderr}"
            );
            None
        }
    };
    completed_on_one_claim(&server, &token, &conversation, &run).await;
}

/// A minute behind: ids this process makes sort before those made by a
/// process with the right time up to a minute earlier.
const CLOCK_BEHIND: (&str, &str) = ("TETHER_CLOCK_SKEW_MS", "-60000");

/// Runs of one conversation execute, show and are read by the model in the
/// order their messages were sent, whatever the clocks of the processes
/// that stored them: the second message goes through an API process whose
/// clock is a minute behind, so its run's id sorts before the first's.
#[tokio::test]
async fn runs_keep_their_order_when_the_instances_clocks_disagree() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let behind = server
        .companion_with("api", WORKER_CONFIG, &[CLOCK_BEHIND])
        .await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, first) = server.send(&token, &conversation, "/hold 2").await;
    server
        .wait_for_run(&token, &first, |r| r["status"] == "RUNNING")
        .await;
    let (_, second) = server
        .send_at(&behind.base, &token, &conversation, "second")
        .await;
    assert!(
        second < first,
        "the clock behind made the later id: {second} {first}"
    );

    let data = server
        .gql(
            &token,
            "query($c: ID!) { conversation(id: $c) { activeRun { id } runs { id status } } }",
            json!({ "c": conversation }),
        )
        .await;
    assert_eq!(data["conversation"]["activeRun"]["id"], first.as_str());
    let runs = data["conversation"]["runs"].as_array().unwrap();
    let ids: Vec<&str> = runs.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [first.as_str(), second.as_str()]);
    assert_eq!(
        runs[1]["status"], "QUEUED",
        "it waits for the first: {runs:?}"
    );

    let ended = server.wait_until_ended(&token, &second).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let events = server.all_events(&token, &conversation).await;
    let cursor = |kind: &str, run: &str| {
        events
            .iter()
            .find(|e| e["type"] == kind && e["runId"] == run)
            .unwrap_or_else(|| panic!("no {kind} of {run}: {events:?}"))["cursor"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert!(
        cursor("run.completed", &first) < cursor("run.started", &second),
        "the second started after the first ended: {events:?}"
    );
    // The model read the first exchange before the second message.
    let reply: String = server
        .reply_parts(&token, &conversation, &second)
        .await
        .iter()
        .filter_map(|p| p["text"].as_str())
        .collect();
    assert!(reply.contains("You said: \"second\""), "{reply}");
    assert!(reply.contains("sees 2 earlier messages"), "{reply}");
}

/// One worker, as the tightest case: each run of one conversation waits
/// for the one before, and the runs of ten other conversations do not wait
/// for the hundred queued in the first.
const ONE_WORKER_CONFIG: &str = r#"
default_agent = "fast"

[runtime]
concurrency = 1
poll_ms = 200

[[agents]]
name = "fast"
provider = "scripted"
stream_delay_ms = 0
"#;

#[tokio::test]
async fn a_conversation_with_a_long_queue_does_not_hold_up_the_others() {
    let server = Server::api_only(ONE_WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let long = server.create_conversation(&token).await;
    let mut long_runs = Vec::new();
    for i in 0..100 {
        long_runs.push(server.send(&token, &long, &format!("long {i}")).await.1);
    }
    let mut others = Vec::new();
    for i in 0..10 {
        let conversation = server.create_conversation(&token).await;
        others.push(
            server
                .send(&token, &conversation, &format!("other {i}"))
                .await
                .1,
        );
    }
    // Everything is queued before the worker starts.
    let _worker = server.companion("worker").await;

    let mut last_other_end = String::new();
    for run in &others {
        server.wait_until_ended(&token, run).await;
        let ended = run_times(&server, &token, run).await;
        assert_eq!(ended["status"], "COMPLETED", "{ended}");
        last_other_end = last_other_end.max(ended["endedAt"].as_str().unwrap().to_owned());
    }
    // The long conversation's first run was ready before the others were
    // queued; its second became ready when the first ended, after them.
    let second = server
        .wait_for_run(&token, &long_runs[1], |r| r["status"] != "QUEUED")
        .await;
    let second = run_times(&server, &token, second["id"].as_str().unwrap()).await;
    let started = second["startedAt"].as_str().unwrap();
    assert!(
        last_other_end.as_str() <= started,
        "the ten waited for the long queue: the last of them ended at {last_other_end}, \
         its second run started at {started}"
    );
    let first = run_times(&server, &token, &long_runs[0]).await;
    assert_eq!(first["status"], "COMPLETED", "{first}");
}

async fn run_times(server: &Server, token: &str, run: &str) -> serde_json::Value {
    server
        .gql(
            token,
            "query($r: ID!) { run(id: $r) { status startedAt endedAt } }",
            json!({ "r": run }),
        )
        .await["run"]
        .clone()
}

/// A cancel asked of an API process reaches a worker in another process
/// within about a second, not at its next heartbeat (20 s here). On SQLite
/// no notification carries it.
#[tokio::test]
async fn a_cancel_reaches_a_worker_in_another_process_within_about_a_second() {
    let slow_heartbeat = WORKER_CONFIG.replace(
        "lease_secs = 3\nheartbeat_secs = 0.5",
        "lease_secs = 60\nheartbeat_secs = 20",
    );
    assert_ne!(slow_heartbeat, WORKER_CONFIG);
    let api = Server::api_only(&slow_heartbeat).await;
    let _worker = api.companion("worker").await;
    let token = api.token("acme", "ada");
    let conversation = api.create_conversation(&token).await;
    let (_, run) = api.send(&token, &conversation, "/hold 60").await;
    api.wait_for_run(&token, &run, |r| r["status"] == "RUNNING")
        .await;
    let asked = std::time::Instant::now();
    assert_eq!(api.cancel(&token, &run).await["cancelRequested"], true);
    let ended = api.wait_until_ended(&token, &run).await;
    let took = asked.elapsed();
    assert_eq!(ended["status"], "CANCELLED", "{ended}");
    assert!(
        took < std::time::Duration::from_secs(5),
        "the cancel took {took:?} to reach the worker"
    );
}

/// PostgreSQL: when the listeners' connections are cut, each process logs
/// it once, reconnects by itself, and work goes on across processes.
#[tokio::test]
async fn listeners_reconnect_after_their_connections_are_cut() {
    if !on_postgres() {
        return;
    }
    let info = ("RUST_LOG".to_owned(), "info".to_owned());
    let api = Server::start_with(ServerOptions {
        config: WORKER_CONFIG.to_owned(),
        role: "api",
        env: vec![info],
    })
    .await;
    let _worker = api
        .companion_with("worker", WORKER_CONFIG, &[("RUST_LOG", "info")])
        .await;
    let token = api.token("acme", "ada");
    let conversation = api.create_conversation(&token).await;
    let (_, run) = api.send(&token, &conversation, "before").await;
    api.wait_until_ended(&token, &run).await;

    let admin = sea_orm::Database::connect(api.database_url())
        .await
        .unwrap();
    let cut = sea_orm::ConnectionTrait::execute_unprepared(
        &admin,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .await
    .unwrap();
    assert!(cut.rows_affected() >= 2, "both processes listen: {cut:?}");
    // Both came back, each having said once that it lost its listener.
    let logs = api
        .wait_for_log("listening for notifications again", 2)
        .await;
    assert_eq!(
        logs.matches("not listening for notifications").count(),
        2,
        "{logs}"
    );

    // A subscriber of the API sees the worker's live deltas again.
    let mut client = WsClient::connect(&api, &token).await;
    client
        .subscribe("e", EVENTS, json!({ "c": conversation }))
        .await;
    let (_, run) = api.send(&token, &conversation, "after").await;
    let mut deltas = 0;
    loop {
        let event = client.next_event("e").await["data"]["conversationEvents"].clone();
        if event["type"] == "part.delta" {
            deltas += 1;
        }
        if event["type"] == "run.completed" && event["runId"] == run.as_str() {
            break;
        }
    }
    assert!(deltas > 0, "no live delta crossed processes after the cut");
}
