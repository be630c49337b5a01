//! Rates per principal and per tenant: `sendMessage` and
//! `createConversation` past their rate are refused `RATE_LIMITED` with
//! when to try again (HTTP 429, `Retry-After`), and change nothing.

use serde_json::{Value, json};

use crate::support::Server;

const SEND: &str = "mutation($c: ID!, $t: String!) { sendMessage(input: {conversationId: $c, text: $t}) { run { id } } }";
const CREATE: &str = "mutation { createConversation(input: {}) { id } }";

/// Posts `query` and returns the status, `Retry-After` and body.
async fn post(
    server: &Server,
    token: &str,
    query: &str,
    variables: Value,
) -> (u16, Option<String>, Value) {
    let response = server
        .http()
        .post(format!("{}/graphql", server.base))
        .bearer_auth(token)
        .json(&json!({ "query": query, "variables": variables }))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, retry_after, response.json().await.unwrap())
}

fn assert_limited(status: u16, retry_after: Option<String>, body: &Value) {
    assert_eq!(status, 429, "{body}");
    let err = &body["errors"][0];
    assert_eq!(err["extensions"]["code"], "RATE_LIMITED", "{body}");
    let secs = err["extensions"]["retryAfter"]
        .as_u64()
        .expect("retryAfter in seconds");
    assert!((1..=60).contains(&secs), "{body}");
    assert_eq!(retry_after, Some(secs.to_string()));
}

/// A `sendMessage` that must be refused `RATE_LIMITED`; its message.
async fn refused_send(server: &Server, token: &str, conversation: &str, text: &str) -> String {
    let (status, retry_after, body) =
        post(server, token, SEND, json!({ "c": conversation, "t": text })).await;
    assert_limited(status, retry_after, &body);
    body["errors"][0]["message"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_principal_past_its_rate_is_told_when_to_come_back_and_nothing_is_written() {
    let server = Server::with_api(
        "messages_per_minute = 3\ntenant_messages_per_minute = 5\nconversations_per_minute = 2",
    )
    .await;
    let ada = server.token("acme", "ada");
    let conversation = server.create_conversation(&ada).await;
    for i in 0..3 {
        server
            .send(&ada, &conversation, &format!("message {i}"))
            .await;
    }
    refused_send(&server, &ada, &conversation, "one too many").await;
    let messages = server
        .gql(
            &ada,
            "query($c: ID!) { conversation(id: $c) { messages(last: 100) { id } } }",
            json!({ "c": conversation }),
        )
        .await;
    assert_eq!(
        messages["conversation"]["messages"]
            .as_array()
            .unwrap()
            .len(),
        3,
        "the refused message was not stored"
    );

    // Another person of the tenant has a rate of their own, up to the
    // tenant's.
    let bob = server.token("acme", "bob");
    server.send(&bob, &conversation, "bob's").await;
    server.send(&bob, &conversation, "bob's again").await;
    let message = refused_send(&server, &bob, &conversation, "past the tenant's").await;
    assert!(message.contains("one tenant"), "{message}");
    // Another tenant is not held back by acme's.
    let eve = server.token("globex", "eve");
    let theirs = server.create_conversation(&eve).await;
    server.send(&eve, &theirs, "hello").await;

    // Conversations too (ada made one above).
    let (status, _, body) = post(&server, &ada, CREATE, json!({})).await;
    assert_eq!(status, 200, "{body}");
    let (status, retry_after, body) = post(&server, &ada, CREATE, json!({})).await;
    assert_limited(status, retry_after, &body);
}

#[tokio::test]
async fn a_principal_or_tenant_with_as_many_runs_waiting_as_allowed_is_told_to_wait() {
    // No workers here: every run stays queued.
    let server = Server::start_with(crate::support::ServerOptions {
        config: format!(
            "{}\n[runtime]\nmax_waiting_runs_per_principal = 2\nmax_waiting_runs_per_tenant = 3\n",
            crate::support::BASE_CONFIG
        ),
        ..Default::default()
    })
    .await;
    let ada = server.token("acme", "ada");
    let conversation = server.create_conversation(&ada).await;
    server.send(&ada, &conversation, "one").await;
    server.send(&ada, &conversation, "two").await;
    let message = refused_send(&server, &ada, &conversation, "three").await;
    assert!(message.contains("of yours are waiting"), "{message}");
    // Bob's runs are his own count, within the tenant's.
    let bob = server.token("acme", "bob");
    server.send(&bob, &conversation, "bob's").await;
    let message = refused_send(&server, &bob, &conversation, "bob's second").await;
    assert!(message.contains("of your tenant's"), "{message}");
    // Another tenant's count is its own.
    let eve = server.token("globex", "eve");
    let elsewhere = server.create_conversation(&eve).await;
    server.send(&eve, &elsewhere, "eve's").await;
}
