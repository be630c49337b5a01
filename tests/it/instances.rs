//! A split deployment: an API process and a worker process on one database.
//! The worker's events reach the API's subscribers (NOTIFY on PostgreSQL,
//! the log's head on SQLite), and a cancellation reaches the worker.

use serde_json::json;

use crate::support::{Server, ServerOptions, WORKER_CONFIG, WsClient};

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
    if std::env::var("TETHER_TEST_DATABASE_URL").is_ok_and(|u| u.starts_with("postgres")) {
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
