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
    let api = Server::start_with(ServerOptions {
        config: WORKER_CONFIG.to_owned(),
        role: "api",
        ..Default::default()
    })
    .await;
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
