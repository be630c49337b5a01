//! Bad input gets a typed error and changes nothing.

use serde_json::json;

use crate::support::Server;

#[tokio::test]
async fn bad_messages_are_refused_and_store_nothing() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    const SEND: &str = "mutation($c: ID!, $t: String!, $k: String) { sendMessage(input: {conversationId: $c, text: $t, clientMessageId: $k}) { run { id } } }";

    // The test configuration allows 4,096 bytes.
    let cases = [
        (
            json!({ "c": conversation, "t": "x".repeat(4097) }),
            "BAD_USER_INPUT",
            Some("text"),
        ),
        (
            json!({ "c": conversation, "t": "   " }),
            "BAD_USER_INPUT",
            Some("text"),
        ),
        (
            json!({ "c": conversation, "t": "hi", "k": "" }),
            "BAD_USER_INPUT",
            Some("clientMessageId"),
        ),
        (
            json!({ "c": uuid::Uuid::now_v7().to_string(), "t": "hi" }),
            "NOT_FOUND",
            None,
        ),
        (
            json!({ "c": "01234-not-a-uuid", "t": "hi" }),
            "NOT_FOUND",
            None,
        ),
    ];
    for (variables, code, key) in cases {
        let err = server.gql_error(&token, SEND, variables.clone()).await;
        assert_eq!(err["extensions"]["code"], code, "{variables}: {err}");
        if let Some(key) = key {
            assert_eq!(err["extensions"]["key"], key, "{err}");
        }
    }
    // Exactly at the limit is fine (multi-byte characters count as bytes).
    let at_limit = "é".repeat(2048);
    server
        .gql(&token, SEND, json!({ "c": conversation, "t": at_limit }))
        .await;
    assert_eq!(server.all_events(&token, &conversation).await.len(), 2);
}

#[tokio::test]
async fn oversized_deep_and_malformed_requests_are_refused() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;

    // A body over max_request_bytes (64 KiB in the test configuration).
    let huge = "y".repeat(70_000);
    let response = server
        .http()
        .post(format!("{}/graphql", server.base))
        .bearer_auth(&token)
        .json(&json!({
            "query": "mutation($c: ID!, $t: String!) { sendMessage(input: {conversationId: $c, text: $t}) { run { id } } }",
            "variables": { "c": conversation, "t": huge },
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 413);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["errors"][0]["extensions"]["code"], "BAD_USER_INPUT");

    // Too deep (the test configuration allows depth 10).
    let deep =
        "{ conversations { nodes { runs { usage { inputTokens } } messages { parts { id } } } } }";
    server.gql(&token, deep, json!({})).await;
    let mut too_deep = String::from(
        "{ __schema { types { fields { type { ofType { ofType { ofType { ofType { ofType { ofType { name } } } } } } } } } } }",
    );
    too_deep.shrink_to_fit();
    let err = server.gql_error(&token, &too_deep, json!({})).await;
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{err}");

    // Parse and validation errors.
    let err = server.gql_error(&token, "{ me { ", json!({})).await;
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{err}");
    let err = server
        .gql_error(&token, "{ me { shoeSize } }", json!({}))
        .await;
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{err}");
    let err = server
        .gql_error(
            &token,
            "mutation($c: ID!) { sendMessage(input: {conversationId: $c, text: 5}) { run { id } } }",
            json!({ "c": conversation }),
        )
        .await;
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{err}");

    // Not JSON at all.
    let response = server
        .http()
        .post(format!("{}/graphql", server.base))
        .bearer_auth(&token)
        .header("content-type", "application/json")
        .body("{ not json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["errors"][0]["extensions"]["code"], "BAD_USER_INPUT");

    assert_eq!(server.all_events(&token, &conversation).await.len(), 0);
}

#[tokio::test]
async fn the_graphql_response_media_type_is_honoured() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let response = server
        .http()
        .post(format!("{}/graphql", server.base))
        .bearer_auth(&token)
        .header("accept", "application/graphql-response+json")
        .json(&json!({ "query": "{ me { principal } }" }))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.headers()["content-type"],
        "application/graphql-response+json"
    );
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["data"]["me"]["principal"], "ada");

    let response = server
        .http()
        .get(format!(
            "{}/graphql?query=%7B%20me%20%7B%20tenant%20%7D%20%7D",
            server.base
        ))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["data"]["me"]["tenant"], "acme");

    // Mutations only over POST.
    let response = server
        .http()
        .get(format!(
            "{}/graphql?query=mutation%20%7B%20createConversation(input%3A%20%7B%7D)%20%7B%20id%20%7D%20%7D",
            server.base
        ))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 405);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["errors"][0]["extensions"]["code"], "BAD_USER_INPUT");
    let data = server
        .gql(
            &token,
            "{ conversations { nodes { id } } }",
            serde_json::json!({}),
        )
        .await;
    assert_eq!(data["conversations"]["nodes"], serde_json::json!([]));
}
