//! The AI SDK's UI message stream (`POST /ai/chat`,
//! `GET /ai/chat/{conversationId}/stream`), read as `useChat` reads it:
//! `data:` chunks, then `data: [DONE]`. The browser side, with the SDK
//! itself, is `web-client-examples/ai-sdk`'s e2e.

use serde_json::{Value, json};

use crate::support::{PATIENCE, Server, WORKER_CONFIG};

fn config() -> String {
    WORKER_CONFIG.replace(
        "stream_delay_ms = 5",
        "stream_delay_ms = 5\ntools = [\"ask_questions\", \"demo_publish\"]",
    )
}

/// `useChat`'s body for a new user message.
fn user_message(conversation: &str, id: &str, text: &str) -> Value {
    json!({
        "id": conversation,
        "messages": [{ "id": id, "role": "user", "parts": [{ "type": "text", "text": text }] }],
        "trigger": "submit-message",
    })
}

async fn post(server: &Server, token: Option<&str>, body: &Value) -> reqwest::Response {
    let mut request = server
        .http()
        .post(format!("{}/ai/chat", server.base))
        .json(body);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    request.send().await.unwrap()
}

async fn resume(server: &Server, token: &str, conversation: &str) -> reqwest::Response {
    server
        .http()
        .get(format!("{}/ai/chat/{conversation}/stream", server.base))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
}

/// Every chunk of a whole stream, checked as the SDK checks the framing:
/// `data:` lines only, the last one `[DONE]`.
async fn chunks(response: reqwest::Response) -> Vec<Value> {
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert_eq!(response.headers()["x-vercel-ai-ui-message-stream"], "v1");
    let body = tokio::time::timeout(PATIENCE, response.text())
        .await
        .expect("the stream ends within the patience")
        .unwrap();
    let data: Vec<&str> = body
        .split("\n\n")
        .filter(|block| !block.is_empty() && !block.starts_with(':'))
        .map(|block| {
            block
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("a data line: {block:?}"))
        })
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{body}");
    data[..data.len() - 1]
        .iter()
        .map(|chunk| serde_json::from_str(chunk).unwrap())
        .collect()
}

fn types(chunks: &[Value]) -> Vec<&str> {
    chunks.iter().map(|c| c["type"].as_str().unwrap()).collect()
}

fn text_of(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter(|c| c["type"] == "text-delta")
        .map(|c| c["delta"].as_str().unwrap())
        .collect()
}

/// The run's assistant message as GraphQL has it: its id and its text.
async fn reply(server: &Server, token: &str, conversation: &str, run: &str) -> (String, String) {
    let data = server
        .gql(
            token,
            "query($c: ID!) { conversation(id: $c) { messages { id role runId parts { kind text } } } }",
            json!({ "c": conversation }),
        )
        .await;
    let message = data["conversation"]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "ASSISTANT" && m["runId"] == run)
        .unwrap()
        .clone();
    let text = message["parts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["kind"] == "TEXT")
        .map(|p| p["text"].as_str().unwrap())
        .collect();
    (message["id"].as_str().unwrap().to_owned(), text)
}

#[tokio::test]
async fn a_message_streams_as_the_sdk_reads_it_until_its_run_ends() {
    let server = Server::start_workers(&config()).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let body = user_message(&conversation, "client-1", "/stream 30");
    let chunks = chunks(post(&server, Some(&token), &body).await).await;

    let start = &chunks[0];
    assert_eq!(start["type"], "start");
    let run = start["messageMetadata"]["runId"]
        .as_str()
        .unwrap()
        .to_owned();
    let (message, text) = reply(&server, &token, &conversation, &run).await;
    assert_eq!(
        start["messageId"],
        message.as_str(),
        "the assistant message's id"
    );
    assert_eq!(
        types(&chunks)[1..3],
        ["start-step", "text-start"],
        "{chunks:?}"
    );
    assert_eq!(
        types(&chunks)[chunks.len() - 3..],
        ["text-end", "finish-step", "finish"]
    );
    assert_eq!(chunks.last().unwrap()["finishReason"], "stop");
    assert_eq!(
        chunks.last().unwrap()["messageMetadata"]["runStatus"],
        "COMPLETED"
    );
    assert_eq!(text_of(&chunks), text, "every character once, in order");
    assert!(text.contains("one two six ten"), "{text}");

    // The message's id is its clientMessageId: the same POST again is the
    // same message and run, streamed again.
    let again = self::chunks(post(&server, Some(&token), &body).await).await;
    assert_eq!(again[0]["messageId"], message.as_str());
    assert_eq!(text_of(&again), text);
    let runs = server
        .gql(
            &token,
            "query($c: ID!) { conversation(id: $c) { runs { id } } }",
            json!({ "c": conversation }),
        )
        .await;
    assert_eq!(runs["conversation"]["runs"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn refusals_are_the_same_as_over_graphql() {
    let server = Server::start().await;
    let ada = server.token("acme", "ada");
    let eve = server.token("globex", "eve");
    let conversation = server.create_conversation(&ada).await;
    let body = user_message(&conversation, "m", "hello");

    let anonymous = post(&server, None, &body).await;
    assert_eq!(anonymous.status(), 401);
    let anonymous: Value = anonymous.json().await.unwrap();
    assert_eq!(
        anonymous["errors"][0]["extensions"]["code"],
        "UNAUTHENTICATED"
    );

    // Another tenant's conversation is as absent as one that never was,
    // and nothing is stored.
    let theirs = post(&server, Some(&eve), &body).await;
    assert_eq!(theirs.status(), 404);
    let nowhere = post(
        &server,
        Some(&eve),
        &user_message(&uuid::Uuid::now_v7().to_string(), "m", "hello"),
    )
    .await;
    assert_eq!(nowhere.status(), 404);
    let theirs: Value = theirs.json().await.unwrap();
    assert_eq!(theirs, nowhere.json::<Value>().await.unwrap());
    assert_eq!(theirs["errors"][0]["extensions"]["code"], "NOT_FOUND");
    // What sendMessage over GraphQL answers.
    let graphql = server
        .gql_error(
            &eve,
            "mutation($c: ID!) { sendMessage(input: { conversationId: $c, text: \"hello\" }) { run { id } } }",
            json!({ "c": conversation }),
        )
        .await;
    assert_eq!(theirs["errors"][0]["message"], graphql["message"]);
    let stored = server
        .gql(
            &ada,
            "query($c: ID!) { conversation(id: $c) { messages { id } } }",
            json!({ "c": conversation }),
        )
        .await;
    assert_eq!(stored["conversation"]["messages"], json!([]));
    let theirs = resume(&server, &eve, &conversation).await;
    assert_eq!(theirs.status(), 404);
    let nowhere = resume(&server, &eve, &uuid::Uuid::now_v7().to_string()).await;
    assert_eq!(nowhere.status(), 404);
    assert_eq!(
        theirs.json::<Value>().await.unwrap(),
        nowhere.json::<Value>().await.unwrap()
    );

    let unreadable = server
        .http()
        .get(format!(
            "{}/ai/chat/{conversation}/stream?access_token=a&access_token=b",
            server.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(unreadable.status(), 400);
    let unreadable: Value = unreadable.json().await.unwrap();
    assert_eq!(
        unreadable["errors"][0]["extensions"]["code"],
        "BAD_USER_INPUT"
    );

    // Nothing active: 204, which useChat takes as nothing to resume.
    assert_eq!(resume(&server, &ada, &conversation).await.status(), 204);

    for (bad, why) in [
        (json!({ "id": conversation, "messages": [] }), "no message"),
        (
            json!({ "id": conversation, "messages": [{ "id": "m", "role": "user", "parts": [] }], "trigger": "regenerate-message", "messageId": "m" }),
            "regenerate",
        ),
        (json!({ "messages": "no" }), "not useChat's body"),
        (
            json!({ "id": conversation, "messages": [{ "id": "a", "role": "assistant", "parts": [{ "type": "text", "text": "hi" }] }] }),
            "an assistant message without an approval response",
        ),
    ] {
        let refused = post(&server, Some(&ada), &bad).await;
        assert_eq!(refused.status(), 400, "{why}");
        let refused: Value = refused.json().await.unwrap();
        assert_eq!(
            refused["errors"][0]["extensions"]["code"], "BAD_USER_INPUT",
            "{why}"
        );
    }
}

#[tokio::test]
async fn a_reload_mid_run_replays_from_start_and_a_disconnect_cancels_nothing() {
    let server = Server::start_workers(&config()).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let body = user_message(&conversation, "c1", "/hold 2");
    let mut response = post(&server, Some(&token), &body).await.bytes_stream();
    // Some of the reply, then the client goes (a reload, stop()).
    let mut seen = String::new();
    while !seen.contains("text-delta") {
        let chunk = tokio::time::timeout(PATIENCE, futures_util::StreamExt::next(&mut response))
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        seen.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    drop(response);

    let active = server
        .gql(
            &token,
            "query($c: ID!) { conversation(id: $c) { activeRun { id cancelRequested } } }",
            json!({ "c": conversation }),
        )
        .await;
    let run = active["conversation"]["activeRun"].clone();
    assert_eq!(run["cancelRequested"], false, "a disconnect is no cancel");
    let run = run["id"].as_str().unwrap().to_owned();

    // The reload: the whole message from `start`, then live, to the end.
    let replayed = chunks(resume(&server, &token, &conversation).await).await;
    let (message, text) = reply(&server, &token, &conversation, &run).await;
    assert_eq!(replayed[0]["type"], "start");
    assert_eq!(replayed[0]["messageId"], message.as_str());
    assert_eq!(text_of(&replayed), text, "nothing lost or doubled");
    assert!(text.contains("You said"), "the run went to its end: {text}");
    assert_eq!(
        replayed.last().unwrap()["messageMetadata"]["runStatus"],
        "COMPLETED"
    );
    assert_eq!(resume(&server, &token, &conversation).await.status(), 204);
}

#[tokio::test]
async fn an_approval_ends_the_stream_and_the_answer_continues_the_same_message() {
    let server = Server::start_workers(&config()).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let body = user_message(&conversation, "c1", "/tool demo_publish {\"text\": \"x\"}");
    let parked = chunks(post(&server, Some(&token), &body).await).await;
    let run = parked[0]["messageMetadata"]["runId"]
        .as_str()
        .unwrap()
        .to_owned();
    let message = parked[0]["messageId"].as_str().unwrap().to_owned();
    let pending = server
        .gql(
            &token,
            "query($r: ID!) { pendingApproval(runId: $r) { interactionId toolCallId } }",
            json!({ "r": run }),
        )
        .await["pendingApproval"]
        .clone();
    let request = parked
        .iter()
        .find(|c| c["type"] == "tool-approval-request")
        .unwrap_or_else(|| panic!("an approval request: {parked:?}"));
    assert_eq!(request["approvalId"], pending["interactionId"]);
    assert_eq!(request["toolCallId"], pending["toolCallId"]);
    let input = parked
        .iter()
        .find(|c| c["type"] == "tool-input-available")
        .unwrap();
    assert_eq!(input["toolCallId"], pending["toolCallId"]);
    assert_eq!(input["input"], json!({ "text": "x" }));
    let last = parked.last().unwrap();
    assert_eq!(last["type"], "finish");
    assert_eq!(last["finishReason"], "tool-calls");
    assert_eq!(last["messageMetadata"]["runStatus"], "WAITING_FOR_APPROVAL");

    // A reload while it waits shows the request again, and ends.
    let replayed = chunks(resume(&server, &token, &conversation).await).await;
    let but_deltas = |chunks: &[Value]| -> Vec<String> {
        types(chunks)
            .into_iter()
            .filter(|t| *t != "text-delta")
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(but_deltas(&replayed), but_deltas(&parked));
    assert_eq!(text_of(&replayed), text_of(&parked));

    // The approval response, as useChat re-POSTs it.
    let decided = json!({
        "id": conversation,
        "trigger": "submit-message",
        "messageId": message,
        "messages": [
            { "id": "c1", "role": "user", "parts": [{ "type": "text", "text": "/tool demo_publish {\"text\": \"x\"}" }] },
            { "id": message, "role": "assistant", "parts": [
                { "type": "step-start" },
                { "type": "dynamic-tool", "toolName": "demo_publish", "toolCallId": pending["toolCallId"],
                  "state": "approval-responded", "input": { "text": "x" },
                  "approval": { "id": pending["interactionId"], "approved": true } },
            ] },
        ],
    });
    // An approval of another message, or a decision sent for another
    // conversation, is not found, and decides nothing.
    let mut elsewhere = decided.clone();
    elsewhere["id"] = json!(server.create_conversation(&token).await);
    assert_eq!(post(&server, Some(&token), &elsewhere).await.status(), 404);
    let mut unknown = decided.clone();
    unknown["messages"][1]["parts"][1]["approval"]["id"] = json!(uuid::Uuid::now_v7());
    assert_eq!(post(&server, Some(&token), &unknown).await.status(), 404);
    let still = server
        .gql(
            &token,
            "query($r: ID!) { pendingApproval(runId: $r) { interactionId } }",
            json!({ "r": run }),
        )
        .await;
    assert_eq!(
        still["pendingApproval"]["interactionId"],
        pending["interactionId"]
    );

    let continued = chunks(post(&server, Some(&token), &decided).await).await;
    assert_eq!(continued[0]["type"], "start");
    assert_eq!(
        continued[0]["messageId"],
        message.as_str(),
        "the same message"
    );
    let kinds = types(&continued);
    assert_eq!(kinds[1], "tool-output-available", "{continued:?}");
    assert_eq!(continued[1]["toolCallId"], pending["toolCallId"]);
    assert!(
        !kinds.contains(&"tool-input-start")
            && !kinds.contains(&"tool-input-available")
            && !kinds.contains(&"tool-approval-request"),
        "nothing the client has is sent again: {kinds:?}"
    );
    assert_eq!(continued.last().unwrap()["finishReason"], "stop");
    let (_, text) = reply(&server, &token, &conversation, &run).await;
    let new_text = text_of(&continued);
    assert!(!new_text.is_empty(), "the next step's text: {continued:?}");
    assert!(text.ends_with(&new_text), "{text:?}");
    assert!(
        !new_text.contains("Calling"),
        "the first step is not sent again"
    );
    let outcome = server
        .gql(
            &token,
            "query($r: ID!) { run(id: $r) { status toolCalls { outcome } } }",
            json!({ "r": run }),
        )
        .await;
    assert_eq!(outcome["run"]["status"], "COMPLETED");
    assert_eq!(outcome["run"]["toolCalls"][0]["outcome"], "SUCCEEDED");
}
