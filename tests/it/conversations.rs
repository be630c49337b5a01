//! Conversations, messages and runs through the real HTTP surface.

use serde_json::json;

use crate::support::{Server, assert_datetime};

const SEND: &str = "mutation($input: SendMessageInput!) { sendMessage(input: $input) { message { id role runId conversationId createdAt parts { id index kind state text } } run { id status conversationId attempt maxAttempts createdAt } } }";

#[tokio::test]
async fn a_sent_message_is_stored_with_a_queued_run_and_reads_back() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let data = server
        .gql(
            &token,
            "mutation { createConversation(input: {title: \"  Plans  \"}) { id agent title createdAt lastCursor messages { id } activeRun { id } } }",
            json!({}),
        )
        .await;
    let conversation = &data["createConversation"];
    assert_eq!(conversation["agent"], "demo");
    assert_eq!(conversation["title"], "Plans");
    assert_eq!(conversation["lastCursor"], "0000000000000000");
    assert_eq!(conversation["messages"], json!([]));
    assert!(conversation["activeRun"].is_null());
    assert_datetime(&conversation["createdAt"]);
    let id = conversation["id"].as_str().unwrap();

    let data = server
        .gql(
            &token,
            SEND,
            json!({ "input": { "conversationId": id, "text": "hello ✓" } }),
        )
        .await;
    let message = &data["sendMessage"]["message"];
    let run = &data["sendMessage"]["run"];
    assert_eq!(message["role"], "USER");
    assert_eq!(message["conversationId"], id);
    assert_eq!(message["runId"], run["id"]);
    assert_eq!(message["parts"][0]["text"], "hello ✓");
    assert_eq!(message["parts"][0]["kind"], "TEXT");
    assert_eq!(message["parts"][0]["state"], "DONE");
    assert_eq!(run["status"], "QUEUED");
    assert_eq!(run["attempt"], 0);
    assert_eq!(run["maxAttempts"], 5);
    assert_datetime(&message["createdAt"]);
    assert_datetime(&run["createdAt"]);

    let data = server
        .gql(
            &token,
            "query($id: ID!, $m: ID!, $r: ID!, $p: ID!) { conversation(id: $id) { lastCursor messages { id parts { text } } runs { id status } activeRun { id } } message(id: $m) { id } run(id: $r) { status endCause cancelRequested usage { inputTokens outputTokens costUsd } } part(id: $p) { messageId index text } }",
            json!({ "id": id, "m": message["id"], "r": run["id"], "p": message["parts"][0]["id"] }),
        )
        .await;
    let read = &data["conversation"];
    assert_eq!(read["lastCursor"], "0000000000000002");
    assert_eq!(read["messages"][0]["id"], message["id"]);
    assert_eq!(read["runs"][0]["id"], run["id"]);
    assert_eq!(read["activeRun"]["id"], run["id"]);
    assert_eq!(data["message"]["id"], message["id"]);
    assert_eq!(data["run"]["status"], "QUEUED");
    assert!(data["run"]["endCause"].is_null());
    assert_eq!(data["run"]["cancelRequested"], false);
    assert_eq!(
        data["run"]["usage"],
        json!({"inputTokens": 0, "outputTokens": 0, "costUsd": 0.0})
    );
    assert_eq!(data["part"]["messageId"], message["id"]);
    assert_eq!(data["part"]["text"], "hello ✓");

    let events = server.all_events(&token, id).await;
    let types: Vec<_> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["message.created", "run.queued"]);
    assert_eq!(events[1]["runId"], run["id"]);
}

#[tokio::test]
async fn a_retried_send_with_the_same_client_message_id_stores_one_message() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let id = server.create_conversation(&token).await;
    let input =
        json!({ "input": { "conversationId": id, "text": "once", "clientMessageId": "c-1" } });
    let first = server.gql(&token, SEND, input.clone()).await;
    let second = server.gql(&token, SEND, input).await;
    assert_eq!(
        first["sendMessage"]["message"]["id"],
        second["sendMessage"]["message"]["id"]
    );
    assert_eq!(
        first["sendMessage"]["run"]["id"],
        second["sendMessage"]["run"]["id"]
    );

    let data = server
        .gql(
            &token,
            "query($id: ID!) { conversation(id: $id) { messages { id } runs { id } } }",
            json!({ "id": id }),
        )
        .await;
    assert_eq!(
        data["conversation"]["messages"].as_array().unwrap().len(),
        1
    );
    assert_eq!(data["conversation"]["runs"].as_array().unwrap().len(), 1);
    assert_eq!(server.all_events(&token, &id).await.len(), 2);

    // Concurrent retries of a new id still store exactly one.
    let sends = (0..6).map(|_| {
        server.gql(
            &token,
            SEND,
            json!({ "input": { "conversationId": id, "text": "twice", "clientMessageId": "c-2" } }),
        )
    });
    let results = futures_util::future::join_all(sends).await;
    let ids: std::collections::HashSet<_> = results
        .iter()
        .map(|r| {
            r["sendMessage"]["message"]["id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(ids.len(), 1);
    assert_eq!(server.all_events(&token, &id).await.len(), 4);
}

#[tokio::test]
async fn reject_refuses_while_a_run_is_active_and_stores_nothing() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let id = server.create_conversation(&token).await;
    server.send(&token, &id, "first").await;
    let before = server.all_events(&token, &id).await;

    let err = server
        .gql_error(
            &token,
            SEND,
            json!({ "input": { "conversationId": id, "text": "second", "onActiveRun": "REJECT" } }),
        )
        .await;
    assert_eq!(err["extensions"]["code"], "CONFLICT", "{err}");
    assert_eq!(server.all_events(&token, &id).await, before);
    let data = server
        .gql(
            &token,
            "query($id: ID!) { conversation(id: $id) { messages { id } runs { id } } }",
            json!({ "id": id }),
        )
        .await;
    assert_eq!(
        data["conversation"]["messages"].as_array().unwrap().len(),
        1
    );
    assert_eq!(data["conversation"]["runs"].as_array().unwrap().len(), 1);

    // Without an active run, REJECT sends normally.
    let other = server.create_conversation(&token).await;
    let data = server
        .gql(
            &token,
            SEND,
            json!({ "input": { "conversationId": other, "text": "alone", "onActiveRun": "REJECT" } }),
        )
        .await;
    assert_eq!(data["sendMessage"]["run"]["status"], "QUEUED");
}

#[tokio::test]
async fn queue_keeps_every_run_and_interrupt_cancels_the_waiting_ones() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let id = server.create_conversation(&token).await;
    let (_, first) = server.send(&token, &id, "one").await;
    let (_, second) = server.send(&token, &id, "two").await;
    let data = server
        .gql(
            &token,
            "query($id: ID!) { conversation(id: $id) { activeRun { id } runs { id status } } }",
            json!({ "id": id }),
        )
        .await;
    assert_eq!(data["conversation"]["activeRun"]["id"], first.as_str());
    assert_eq!(data["conversation"]["runs"].as_array().unwrap().len(), 2);

    let data = server
        .gql(
            &token,
            SEND,
            json!({ "input": { "conversationId": id, "text": "three", "onActiveRun": "INTERRUPT" } }),
        )
        .await;
    let third = data["sendMessage"]["run"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let data = server
        .gql(
            &token,
            "query($id: ID!) { conversation(id: $id) { activeRun { id } runs { id status endCause endedAt } } }",
            json!({ "id": id }),
        )
        .await;
    let runs = data["conversation"]["runs"].as_array().unwrap();
    for run in &runs[..2] {
        assert_eq!(run["status"], "CANCELLED");
        assert_eq!(run["endCause"], "INTERRUPTED");
        crate::support::assert_datetime(&run["endedAt"]);
    }
    assert_eq!(runs[2]["status"], "QUEUED");
    assert_eq!(data["conversation"]["activeRun"]["id"], third.as_str());

    let types: Vec<String> = server
        .all_events(&token, &id)
        .await
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        types[4..],
        [
            "run.cancelled",
            "run.cancelled",
            "message.created",
            "run.queued"
        ]
    );
    let _ = second;
}

#[tokio::test]
async fn cancelling_a_queued_run_ends_it_at_once_and_an_ended_run_is_unchanged() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let id = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &id, "never mind").await;
    const CANCEL: &str =
        "mutation($r: ID!) { cancelRun(runId: $r) { id status endCause endedAt cancelRequested } }";
    let data = server.gql(&token, CANCEL, json!({ "r": run })).await;
    assert_eq!(data["cancelRun"]["status"], "CANCELLED");
    assert_eq!(data["cancelRun"]["endCause"], "CANCELLED");
    let ended_at = data["cancelRun"]["endedAt"].clone();
    assert_datetime(&ended_at);

    let events = server.all_events(&token, &id).await;
    assert_eq!(events.last().unwrap()["type"], "run.cancelled");
    let count = events.len();

    let again = server.gql(&token, CANCEL, json!({ "r": run })).await;
    assert_eq!(again["cancelRun"]["status"], "CANCELLED");
    assert_eq!(again["cancelRun"]["endedAt"], ended_at);
    assert_eq!(server.all_events(&token, &id).await.len(), count);

    let data = server
        .gql(
            &token,
            "query($id: ID!) { conversation(id: $id) { activeRun { id } } }",
            json!({ "id": id }),
        )
        .await;
    assert!(data["conversation"]["activeRun"].is_null());
}

#[tokio::test]
async fn conversations_page_newest_first() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let mut created = Vec::new();
    for _ in 0..5 {
        created.push(server.create_conversation(&token).await);
    }
    created.reverse();
    const PAGE: &str = "query($a: String) { conversations(first: 2, after: $a) { nodes { id } endCursor hasMore } }";
    let mut seen = Vec::new();
    let mut after = serde_json::Value::Null;
    loop {
        let data = server.gql(&token, PAGE, json!({ "a": after })).await;
        let page = &data["conversations"];
        for node in page["nodes"].as_array().unwrap() {
            seen.push(node["id"].as_str().unwrap().to_owned());
        }
        if !page["hasMore"].as_bool().unwrap() {
            break;
        }
        after = page["endCursor"].clone();
    }
    assert_eq!(seen, created);

    let err = server
        .gql_error(
            &token,
            "{ conversations(first: 101) { hasMore } }",
            json!({}),
        )
        .await;
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT");
    let err = server
        .gql_error(
            &token,
            "{ conversations(after: \"yesterday\") { hasMore } }",
            json!({}),
        )
        .await;
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT");
}

#[tokio::test]
async fn agents_and_me_describe_the_configuration_and_the_caller() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let data = server
        .gql(
            &token,
            "{ me { tenant principal } agents { name model tools } }",
            json!({}),
        )
        .await;
    assert_eq!(data["me"], json!({ "tenant": "acme", "principal": "ada" }));
    assert_eq!(
        data["agents"],
        json!([
            { "name": "demo", "model": "scripted", "tools": ["ask_questions", "demo_publish"] },
            { "name": "other", "model": "scripted", "tools": [] },
        ])
    );
    let data = server
        .gql(
            &token,
            "mutation { createConversation(input: {agent: \"other\"}) { agent } }",
            json!({}),
        )
        .await;
    assert_eq!(data["createConversation"]["agent"], "other");
    let err = server
        .gql_error(
            &token,
            "mutation { createConversation(input: {agent: \"nobody\"}) { agent } }",
            json!({}),
        )
        .await;
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT");
    assert_eq!(err["extensions"]["key"], "agent");
}
