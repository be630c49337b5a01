//! Arguments with defaults are nullable, as the contract types them: an
//! explicit `null` (literal or variable) means the default, in what the
//! field returns and in what the query is counted to cost.

use serde_json::{Value, json};

use crate::support::Server;

/// Ids of a list of objects.
fn ids(list: &Value) -> Vec<String> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|item| item["id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn explicit_null_means_the_default() {
    // Complexity 1600: `events(first: 500) { events { cursor } hasMore }`
    // counts 1501, so one page of the default size fits and two do not.
    let server = Server::with_api("max_query_complexity = 1600").await;
    let token = server.token("acme", "ada");

    // conversations(first: null): a page of 20, newest first.
    for _ in 0..21 {
        server.create_conversation(&token).await;
    }
    let absent = server
        .gql(
            &token,
            "{ conversations { nodes { id } hasMore } }",
            json!({}),
        )
        .await;
    assert_eq!(
        absent["conversations"]["nodes"].as_array().unwrap().len(),
        20
    );
    assert_eq!(absent["conversations"]["hasMore"], true);
    for query in [
        "{ conversations(first: null) { nodes { id } hasMore } }",
        "query($n: Int) { conversations(first: $n) { nodes { id } hasMore } }",
    ] {
        let data = server.gql(&token, query, json!({ "n": null })).await;
        assert_eq!(data, absent, "{query}");
    }

    // sendMessage with onActiveRun: null queues behind the active run (no
    // workers run here, so the first run stays active): the first run is
    // neither interrupted nor joined, and no message is rejected.
    let conversation = server.create_conversation(&token).await;
    let send = "mutation($c: ID!, $t: String!, $s: ActiveRunStrategy) { sendMessage(input: {conversationId: $c, text: $t, onActiveRun: $s}) { message { id } run { id status } } }";
    let literal = "mutation($c: ID!, $t: String!) { sendMessage(input: {conversationId: $c, text: $t, onActiveRun: null}) { message { id } run { id status } } }";
    let mut runs = Vec::new();
    let mut messages = Vec::new();
    for i in 0..101 {
        let query = if i % 2 == 0 { send } else { literal };
        let data = server
            .gql(
                &token,
                query,
                json!({ "c": conversation, "t": format!("message {i}"), "s": null }),
            )
            .await;
        let sent = &data["sendMessage"];
        assert_eq!(sent["run"]["status"], "QUEUED", "{data}");
        runs.push(sent["run"]["id"].as_str().unwrap().to_owned());
        messages.push(sent["message"]["id"].as_str().unwrap().to_owned());
    }
    let distinct: std::collections::HashSet<_> = runs.iter().collect();
    assert_eq!(distinct.len(), 101, "every message has a run of its own");
    let first = server
        .gql(
            &token,
            "query($r: ID!) { run(id: $r) { status endCause } }",
            json!({ "r": runs[0] }),
        )
        .await;
    assert_eq!(first["run"]["status"], "QUEUED", "{first}");
    assert_eq!(first["run"]["endCause"], Value::Null, "{first}");

    // messages(last: null) and runs(last: null): the last 100, oldest first.
    let absent = server
        .gql(
            &token,
            "query($c: ID!) { conversation(id: $c) { messages { id } runs { id } } }",
            json!({ "c": conversation }),
        )
        .await;
    assert_eq!(ids(&absent["conversation"]["messages"]), messages[1..]);
    assert_eq!(ids(&absent["conversation"]["runs"]), runs[1..]);
    for query in [
        "query($c: ID!) { conversation(id: $c) { messages(last: null) { id } runs(last: null) { id } } }",
        "query($c: ID!, $n: Int) { conversation(id: $c) { messages(last: $n) { id } runs(last: $n) { id } } }",
    ] {
        let data = server
            .gql(&token, query, json!({ "c": conversation, "n": null }))
            .await;
        assert_eq!(data, absent, "{query}");
    }

    // events(first: null): from the first event, up to 500 of them.
    let absent = server
        .gql(
            &token,
            "query($c: ID!) { events(conversationId: $c) { events { cursor } hasMore } }",
            json!({ "c": conversation }),
        )
        .await;
    let count = absent["events"]["events"].as_array().unwrap().len();
    assert!(count > 200, "two events or more per message: {count}");
    for query in [
        "query($c: ID!) { events(conversationId: $c, first: null) { events { cursor } hasMore } }",
        "query($c: ID!, $n: Int) { events(conversationId: $c, first: $n) { events { cursor } hasMore } }",
    ] {
        let data = server
            .gql(&token, query, json!({ "c": conversation, "n": null }))
            .await;
        assert_eq!(data, absent, "{query}");
    }

    // The cost counts a null as the default too: two event pages of the
    // default size are over the limit, as two of 500 are, and two of 100
    // are not.
    let two_pages = |first: &str| {
        let n = if first == "$n" { ", $n: Int" } else { "" };
        format!(
            "query($c: ID!{n}) {{ a: events(conversationId: $c, first: {first}) {{ events {{ cursor }} }} b: events(conversationId: $c, first: {first}) {{ events {{ cursor }} }} }}"
        )
    };
    for first in ["null", "$n", "500"] {
        let (_, body) = server
            .post(
                Some(&token),
                &two_pages(first),
                json!({ "c": conversation, "n": null }),
            )
            .await;
        let message = body["errors"][0]["message"].as_str().unwrap_or_default();
        assert!(message.contains("complex"), "{first}: {body}");
    }
    server
        .gql(&token, &two_pages("100"), json!({ "c": conversation }))
        .await;
}

/// An enum value written as a string literal is refused, as the GraphQL
/// specification requires, in arguments, input objects, lists and variable
/// defaults; the same value without quotes, or as a variable's JSON string,
/// is accepted.
#[tokio::test]
async fn enum_values_given_as_string_literals_are_refused() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let send = |strategy: &str| {
        format!(
            "mutation($c: ID!) {{ sendMessage(input: {{conversationId: $c, text: \"hi\", onActiveRun: {strategy}}}) {{ run {{ id }} }} }}"
        )
    };
    let quoted = [
        (send("\"QUEUE\""), "sendMessage.input.onActiveRun"),
        (
            "mutation { decideApproval(input: {interactionId: \"x\", decision: \"ALLOW_ONCE\"}) { resumed } }".to_owned(),
            "decideApproval.input.decision",
        ),
        (
            "mutation($c: ID!, $s: ActiveRunStrategy = \"QUEUE\") { sendMessage(input: {conversationId: $c, text: \"hi\", onActiveRun: $s}) { run { id } } }".to_owned(),
            "$s",
        ),
        // Inside a fragment, on a value that is no member either.
        (
            "mutation($c: ID!) { ...send } fragment send on Mutation { sendMessage(input: {conversationId: $c, text: \"hi\", onActiveRun: \"LATER\"}) { run { id } } }".to_owned(),
            "sendMessage.input.onActiveRun",
        ),
    ];
    for (query, path) in &quoted {
        let (status, body) = server
            .post(Some(&token), query, json!({ "c": conversation }))
            .await;
        let error = &body["errors"][0];
        assert_eq!(
            error["extensions"]["code"], "BAD_USER_INPUT",
            "{query}: {body}"
        );
        let message = error["message"].as_str().unwrap();
        assert!(message.starts_with(path), "{query}: {message}");
        assert!(message.contains("without quotes"), "{message}");
        assert!(body["data"].is_null(), "{query}: {body}");
        assert!(status == 200 || status == 400, "{status}");
    }
    // Nothing of them was stored.
    let data = server
        .gql(
            &token,
            "query($c: ID!) { conversation(id: $c) { messages { id } } }",
            json!({ "c": conversation }),
        )
        .await;
    assert_eq!(data["conversation"]["messages"], json!([]));

    // Without quotes, and from a variable's JSON string, it is accepted.
    server
        .gql(&token, &send("QUEUE"), json!({ "c": conversation }))
        .await;
    let variable = "mutation($c: ID!, $s: ActiveRunStrategy) { sendMessage(input: {conversationId: $c, text: \"hi\", onActiveRun: $s}) { run { id } } }";
    server
        .gql(&token, variable, json!({ "c": conversation, "s": "QUEUE" }))
        .await;
    // A string where a string belongs is not touched.
    server
        .gql(
            &token,
            &send("QUEUE").replace("\"hi\"", "\"QUEUE\""),
            json!({ "c": conversation }),
        )
        .await;
}
