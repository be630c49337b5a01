//! Runs executed by workers, seen through the real API: streaming, order,
//! cancellation, limits.

use serde_json::{Value, json};

use crate::support::{Server, WORKER_CONFIG, WsClient};

const EVENTS: &str = "subscription($c: ID!, $a: String) { conversationEvents(conversationId: $c, after: $a) { cursor type runId ... on RunEvent { status } ... on PartEvent { partId messageId kind textLength } ... on PartDelta { partId offset text } } }";

fn utf16_len(text: &str) -> i64 {
    text.encode_utf16().count() as i64
}

/// Subscribes to a conversation from its current end.
async fn follow(server: &Server, token: &str, conversation: &str) -> WsClient {
    let cursor = server
        .gql(
            token,
            "query($c: ID!) { conversation(id: $c) { lastCursor } }",
            json!({ "c": conversation }),
        )
        .await["conversation"]["lastCursor"]
        .clone();
    let mut client = WsClient::connect(server, token).await;
    client
        .subscribe("e", EVENTS, json!({ "c": conversation, "a": cursor }))
        .await;
    client
}

/// Events of the subscription until `run`'s final event.
async fn until_run_ends(client: &mut WsClient, run: &str) -> Vec<Value> {
    let mut events = Vec::new();
    loop {
        let event = client.next_event("e").await["data"]["conversationEvents"].clone();
        let last = event["runId"] == run
            && matches!(
                event["type"].as_str(),
                Some("run.completed" | "run.failed" | "run.cancelled")
            );
        events.push(event);
        if last {
            return events;
        }
    }
}

#[tokio::test]
async fn streamed_deltas_stitch_into_the_persisted_text() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let mut client = follow(&server, &token, &conversation).await;
    // Deltas are live only: a subscription registered after they went out
    // never sees them. It registers before it emits anything, so once a
    // first run's events came through, the next run's deltas all will.
    let (_, first) = server.send(&token, &conversation, "first").await;
    until_run_ends(&mut client, &first).await;
    let (_, run) = server.send(&token, &conversation, "héllo 🚀 wörld").await;
    let events = until_run_ends(&mut client, &run).await;

    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    let position = |t: &str| {
        types
            .iter()
            .position(|x| *x == t)
            .unwrap_or_else(|| panic!("no {t}: {types:?}"))
    };
    assert!(position("run.started") < position("run.checkpointed"));
    assert!(position("run.checkpointed") < position("run.completed"));
    assert_eq!(types.last(), Some(&"run.completed"));

    // The text part is announced before any delta, and the deltas' offsets
    // (UTF-16) continue each other exactly.
    let added = events
        .iter()
        .find(|e| e["type"] == "part.added" && e["kind"] == "TEXT")
        .expect("part.added");
    let part_id = added["partId"].clone();
    let first_delta = types
        .iter()
        .position(|t| *t == "part.delta")
        .expect("deltas");
    assert!(position("part.added") < first_delta);
    let mut stitched = String::new();
    for delta in events.iter().filter(|e| e["type"] == "part.delta") {
        assert_eq!(delta["partId"], part_id);
        assert_eq!(
            delta["offset"].as_i64().unwrap(),
            utf16_len(&stitched),
            "{delta}"
        );
        stitched.push_str(delta["text"].as_str().unwrap());
    }

    // Checkpoints while streaming, then the final length.
    let updates: Vec<i64> = events
        .iter()
        .filter(|e| e["type"] == "part.updated" && e["partId"] == part_id)
        .map(|e| e["textLength"].as_i64().unwrap())
        .collect();
    assert!(
        updates.len() >= 2,
        "checkpoints while streaming: {updates:?}"
    );
    assert!(updates.windows(2).all(|w| w[0] <= w[1]), "{updates:?}");
    assert_eq!(*updates.last().unwrap(), utf16_len(&stitched));

    let parts = server.reply_parts(&token, &conversation, &run).await;
    assert_eq!(parts.len(), 1, "{parts:?}");
    assert_eq!(parts[0]["state"], "DONE");
    assert_eq!(parts[0]["text"].as_str().unwrap(), stitched);
    assert!(
        stitched.starts_with("You said: \"héllo 🚀 wörld\""),
        "{stitched}"
    );

    let run = server.wait_until_ended(&token, &run).await;
    assert_eq!(run["status"], "COMPLETED");
    assert_eq!(run["endCause"], "NATURAL");
    assert_eq!(run["steps"], 1);
    assert!(run["usage"]["outputTokens"].as_i64().unwrap() > 0);
}

#[tokio::test]
async fn messages_sent_quickly_run_in_order_each_seeing_the_replies_before_it() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let mut runs = Vec::new();
    for text in ["one", "two", "three"] {
        runs.push(server.send(&token, &conversation, text).await.1);
    }
    for run in &runs {
        assert_eq!(
            server.wait_until_ended(&token, run).await["status"],
            "COMPLETED"
        );
    }
    for (i, run) in runs.iter().enumerate() {
        let parts = server.reply_parts(&token, &conversation, run).await;
        let text = parts[0]["text"].as_str().unwrap();
        assert!(
            text.contains(&format!("sees {} earlier messages", 2 * i)),
            "{text}"
        );
    }
    // One at a time: each run starts after the one before it ended.
    let events = server.all_events(&token, &conversation).await;
    let at = |kind: &str, run: &str| {
        events
            .iter()
            .position(|e| e["type"] == kind && e["runId"] == run)
            .unwrap()
    };
    assert!(at("run.completed", &runs[0]) < at("run.started", &runs[1]));
    assert!(at("run.completed", &runs[1]) < at("run.started", &runs[2]));
}

#[tokio::test]
async fn cancelling_a_streaming_run_keeps_what_was_streamed() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let mut client = follow(&server, &token, &conversation).await;
    let (_, run) = server.send(&token, &conversation, "/hold 60").await;
    loop {
        let event = client.next_event("e").await["data"]["conversationEvents"].clone();
        if event["type"] == "part.delta" {
            break;
        }
    }
    let cancelled = server.cancel(&token, &run).await;
    assert_eq!(cancelled["status"], "RUNNING");
    assert_eq!(cancelled["cancelRequested"], true);

    let events = until_run_ends(&mut client, &run).await;
    assert_eq!(events.last().unwrap()["type"], "run.cancelled");
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "CANCELLED");
    assert_eq!(ended["endCause"], "CANCELLED");
    let parts = server.reply_parts(&token, &conversation, &run).await;
    assert_eq!(parts[0]["state"], "DONE");
    assert!(
        parts[0]["text"].as_str().unwrap().starts_with("holding 1"),
        "{parts:?}"
    );

    // Cancelling it again changes nothing.
    let again = server
        .gql(
            &token,
            "mutation($r: ID!) { cancelRun(runId: $r) { status endCause } }",
            json!({ "r": run }),
        )
        .await;
    assert_eq!(
        again["cancelRun"],
        json!({ "status": "CANCELLED", "endCause": "CANCELLED" })
    );

    // The conversation is not stuck: the next message runs.
    let (_, next) = server.send(&token, &conversation, "after").await;
    assert_eq!(
        server.wait_until_ended(&token, &next).await["status"],
        "COMPLETED"
    );
}

/// The running run is asked to stop (its worker ends it `INTERRUPTED`
/// with what it streamed), and the new run starts only after that.
#[tokio::test]
async fn interrupt_ends_the_running_run_first_then_runs_the_new_one() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, first) = server.send(&token, &conversation, "/hold 60").await;
    server
        .wait_for_run(&token, &first, |r| r["status"] == "RUNNING")
        .await;
    let data = server
        .gql(
            &token,
            "mutation($c: ID!) { sendMessage(input: {conversationId: $c, text: \"instead\", onActiveRun: INTERRUPT}) { run { id } } }",
            json!({ "c": conversation }),
        )
        .await;
    let second = data["sendMessage"]["run"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let ended = server.wait_until_ended(&token, &first).await;
    assert_eq!(
        (&ended["status"], &ended["endCause"]),
        (&json!("CANCELLED"), &json!("INTERRUPTED")),
        "{ended}"
    );
    assert_eq!(
        server.wait_until_ended(&token, &second).await["status"],
        "COMPLETED"
    );
    let times = |run: &str| {
        let (server, token) = (&server, &token);
        let run = run.to_owned();
        async move {
            server
                .gql(
                    token,
                    "query($r: ID!) { run(id: $r) { startedAt endedAt } }",
                    json!({ "r": run }),
                )
                .await["run"]
                .clone()
        }
    };
    let (old, new) = (times(&first).await, times(&second).await);
    assert!(
        old["endedAt"].as_str() <= new["startedAt"].as_str(),
        "the new run started before the old one ended: {old} {new}"
    );
    let parts = server.reply_parts(&token, &conversation, &first).await;
    assert!(parts.iter().all(|p| p["state"] == "DONE"), "{parts:?}");
    let reply = server.reply_parts(&token, &conversation, &second).await;
    assert!(reply[0]["text"].as_str().unwrap().contains("\"instead\""));
}

#[tokio::test]
async fn a_run_over_its_time_ends_with_timeout() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server
        .gql(
            &token,
            "mutation { createConversation(input: {agent: \"brief\"}) { id } }",
            json!({}),
        )
        .await["createConversation"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (_, run) = server.send(&token, &conversation, "/hold 30").await;
    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "FAILED");
    assert_eq!(ended["endCause"], "TIMEOUT");
    assert_eq!(ended["error"]["code"], "TIMEOUT");
    let parts = server.reply_parts(&token, &conversation, &run).await;
    assert!(
        parts[0]["text"].as_str().unwrap().starts_with("holding"),
        "{parts:?}"
    );
}
