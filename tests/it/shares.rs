//! What one principal may hold of the server at once: its sockets and
//! subscriptions up to their caps leave another tenant served; WebSockets
//! leave connections for HTTP and the probes; a connection that sends
//! nothing and a socket that runs nothing are closed on time.

use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::AsyncReadExt;

use crate::support::{Ending, Server, WsClient};

const EVENTS: &str = "subscription($c: ID!, $a: String) { conversationEvents(conversationId: $c, after: $a) { type } }";

async fn cursor(server: &Server, token: &str, conversation: &str) -> serde_json::Value {
    server
        .gql(
            token,
            "query($c: ID!) { conversation(id: $c) { lastCursor } }",
            json!({ "c": conversation }),
        )
        .await["conversation"]["lastCursor"]
        .clone()
}

#[tokio::test]
async fn one_principal_at_its_caps_leaves_another_tenant_served() {
    // The process serves one socket and one subscription more than Ada's
    // caps: without them, hers would take the last of each and Eve would be
    // refused (503, UNAVAILABLE).
    let server = Server::with_api(
        "max_sockets_per_principal = 2\nmax_subscriptions_per_principal = 2\n\
         max_connections = 32\nmax_websockets = 3\nmax_subscriptions = 3",
    )
    .await;
    let ada = server.token("acme", "ada");
    let conversation = server.create_conversation(&ada).await;
    let mut first = WsClient::connect(&server, &ada).await;
    let mut second = WsClient::connect(&server, &ada).await;
    let mut third = WsClient::open(&server, "graphql-transport-ws").await;
    third
        .init(json!({ "Authorization": format!("Bearer {ada}") }))
        .await;
    match third.ending().await {
        Ending::Closed(code, reason) => {
            assert_eq!(code, 1013, "{reason}");
            assert!(reason.contains("WebSockets"), "{reason}");
        }
        Ending::Dropped => panic!("a socket over the cap is closed with a code"),
    }

    let at = cursor(&server, &ada, &conversation).await;
    for id in ["a", "b"] {
        first
            .subscribe(id, EVENTS, json!({ "c": conversation, "a": at }))
            .await;
    }
    // Both are served (each sees a message) before the third is asked.
    server.send(&ada, &conversation, "hello").await;
    for id in ["a", "b"] {
        first.next_event(id).await;
    }
    let at = cursor(&server, &ada, &conversation).await;
    second
        .subscribe("c", EVENTS, json!({ "c": conversation, "a": at }))
        .await;
    let refused = second.next_json().await.expect("an answer");
    assert_eq!(refused["id"], "c", "{refused}");
    assert!(refused.to_string().contains("RATE_LIMITED"), "{refused}");

    // Another tenant subscribes, queries, and the probe answers.
    let eve = server.token("globex", "eve");
    let theirs = server.create_conversation(&eve).await;
    let mut eves = WsClient::connect(&server, &eve).await;
    let at_theirs = cursor(&server, &eve, &theirs).await;
    eves.subscribe("e", EVENTS, json!({ "c": theirs, "a": at_theirs }))
        .await;
    server.send(&eve, &theirs, "hello").await;
    let event = eves.next_event("e").await;
    assert_eq!(
        event["data"]["conversationEvents"]["type"],
        "message.created"
    );
    assert_eq!(server.get("/healthz").await.status(), 200);

    // Ending a subscription gives its share back.
    first
        .send_json(json!({ "type": "complete", "id": "a" }))
        .await;
    let deadline = Instant::now() + crate::support::PATIENCE;
    loop {
        second
            .subscribe("d", EVENTS, json!({ "c": conversation, "a": at }))
            .await;
        server.send(&ada, &conversation, "again").await;
        let answer = second.next_json().await.expect("an answer");
        if answer["type"] == "next" && answer["payload"]["data"].is_object() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the share never came back: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn websockets_leave_connections_for_http_and_the_probes() {
    let server = Server::with_api("max_connections = 8\nmax_websockets = 2").await;
    let ada = server.token("acme", "ada");
    let _one = WsClient::connect(&server, &ada).await;
    let _two = WsClient::connect(&server, &ada).await;
    let refused = server
        .http()
        .get(format!("{}/graphql", server.base))
        .header("connection", "upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
        .header("sec-websocket-protocol", "graphql-transport-ws")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(server.get("/healthz").await.status(), 200);
    let me = server.gql(&ada, "{ me { tenant } }", json!({})).await;
    assert_eq!(me["me"]["tenant"], "acme");
}

#[tokio::test]
async fn a_silent_connection_and_an_idle_socket_are_closed_on_time() {
    let server = Server::with_api(
        "first_byte_timeout_ms = 300\nws_idle_timeout_secs = 2\nws_keepalive_secs = 1",
    )
    .await;
    // A connection that sends nothing is closed long before the header
    // timeout (10 s).
    let started = Instant::now();
    let mut silent = tokio::net::TcpStream::connect(&server.addr).await.unwrap();
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(crate::support::PATIENCE, silent.read(&mut buf))
        .await
        .expect("the server closes it");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    // A socket with a subscription stays; one with none is closed as idle.
    let ada = server.token("acme", "ada");
    let conversation = server.create_conversation(&ada).await;
    let mut busy = WsClient::connect(&server, &ada).await;
    let at = cursor(&server, &ada, &conversation).await;
    busy.subscribe("s", EVENTS, json!({ "c": conversation, "a": at }))
        .await;
    let mut idle = WsClient::connect(&server, &ada).await;
    match idle.ending().await {
        Ending::Closed(code, reason) => {
            assert_eq!(code, 1000, "{reason}");
            assert!(reason.starts_with("idle"), "{reason}");
        }
        Ending::Dropped => panic!("an idle socket is closed with a code"),
    }
    // By now the busy one has been as long without a new operation.
    server.send(&ada, &conversation, "still here").await;
    let event = busy.next_event("s").await;
    assert_eq!(
        event["data"]["conversationEvents"]["type"],
        "message.created"
    );
}
