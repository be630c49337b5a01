//! A WebSocket that floods, bursts or oversends cannot wedge its loop: the
//! init timeout, keepalive and the token-expiry close keep working, every
//! operation is answered, and nothing is left open afterwards. A client
//! that breaks the protocol's order is closed with the protocol's code.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message as WsFrame;

use crate::support::{Ending, PATIENCE, Server, WsClient};

const PING: &str = r#"{"type":"ping"}"#;

#[tokio::test]
async fn a_ping_flood_before_connection_init_is_closed_with_4408_on_time() {
    let server = Server::with_api("ws_init_timeout_secs = 2").await;
    let mut client = WsClient::open(&server, "graphql-transport-ws").await;
    let opened = Instant::now();
    client.flood(PING, 300).await.unwrap();
    assert_eq!(
        client.ending().await,
        Ending::Closed(4408, "Connection initialisation timeout".to_owned())
    );
    // Two seconds are due; anything near the old behaviour (never) fails.
    assert!(
        opened.elapsed() < Duration::from_secs(12),
        "closed after {:?}",
        opened.elapsed()
    );
}

#[tokio::test]
async fn a_ping_flood_after_init_stops_neither_keepalive_nor_the_expiry_close() {
    let server = Server::with_api("ws_keepalive_secs = 1").await;
    let token = server.token_for("acme", "ada", Duration::from_secs(4));
    let mut client = WsClient::connect(&server, &token).await;
    client.flood(PING, 300).await.unwrap();
    let (mut pongs, mut keepalives) = (0, 0);
    let ending = loop {
        match client.next_frame().await {
            Some(WsFrame::Text(text)) => {
                let message: Value = serde_json::from_str(&text).unwrap();
                match message["type"].as_str() {
                    Some("pong") => pongs += 1,
                    Some("ping") => keepalives += 1,
                    other => panic!("unexpected message {other:?}: {message}"),
                }
            }
            Some(WsFrame::Close(Some(frame))) => {
                break Ending::Closed(frame.code.into(), frame.reason.to_string());
            }
            Some(_) => {}
            None => break Ending::Dropped,
        }
    };
    assert_eq!(ending, Ending::Closed(4403, "token expired".to_owned()));
    assert_eq!(pongs, 300, "every ping is answered");
    assert!(keepalives >= 1, "keepalive pings went on during the flood");
}

#[tokio::test]
async fn a_burst_of_100_subscribes_on_one_socket_all_get_answers() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let mut client = WsClient::connect(&server, &token).await;
    let frames: Vec<String> = (0..100)
        .map(|i| {
            json!({
                "id": format!("op-{i}"),
                "type": "subscribe",
                "payload": { "query": "{ me { tenant principal } }" },
            })
            .to_string()
        })
        .collect();
    for frame in &frames {
        client.feed(frame).await.unwrap();
    }
    client.flush().await.unwrap();
    let mut answered = HashSet::new();
    let mut completed = HashSet::new();
    while completed.len() < 100 {
        let message = client.next_json().await.expect("the socket stays open");
        let id = message["id"].as_str().unwrap().to_owned();
        match message["type"].as_str() {
            Some("next") => {
                assert_eq!(
                    message["payload"]["data"]["me"],
                    json!({"tenant": "acme", "principal": "ada"})
                );
                answered.insert(id);
            }
            Some("complete") => {
                assert!(answered.contains(&id), "{id} completed before its answer");
                completed.insert(id);
            }
            _ => panic!("unexpected message {message}"),
        }
    }
    assert_eq!(answered.len(), 100);
}

#[tokio::test]
async fn a_frame_over_the_size_limit_closes_with_1009_and_a_reason() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let mut client = WsClient::connect(&server, &token).await;
    // BASE_CONFIG allows 65536 bytes.
    let query = format!("{{ me {{ tenant }} }} #{}", "x".repeat(70_000));
    let frame = json!({ "id": "big", "type": "subscribe", "payload": { "query": query } });
    client
        .send_frame(WsFrame::Text(frame.to_string().into()))
        .await
        .unwrap();
    match client.ending().await {
        Ending::Closed(code, reason) => {
            assert_eq!(code, 1009);
            assert!(reason.contains("65536"), "{reason}");
        }
        Ending::Dropped => panic!("dropped without a close frame"),
    }
}

#[tokio::test]
async fn two_hundred_abusive_sockets_leave_no_descriptor_open() {
    let server = Server::with_api("ws_init_timeout_secs = 30").await;
    // Warm up whatever the server opens once (pools, files).
    for _ in 0..3 {
        let mut client = WsClient::open(&server, "graphql-transport-ws").await;
        client.flood(PING, 300).await.unwrap();
        drop(client);
    }
    let settle = Instant::now() + PATIENCE;
    let mut baseline = server.open_fds();
    while Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = server.open_fds();
        if now == baseline {
            break;
        }
        baseline = now;
    }
    for _ in 0..200 {
        let mut client = WsClient::open(&server, "graphql-transport-ws").await;
        // Pongs pile up unread while the client floods, then it goes away.
        let _ = client.flood(PING, 300).await;
        drop(client);
    }
    let deadline = Instant::now() + PATIENCE;
    loop {
        let open = server.open_fds();
        if open <= baseline {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{open} descriptors open, {baseline} before the sockets"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_client_that_stops_reading_is_dropped_after_the_send_timeout() {
    let server = Server::with_api("ws_send_timeout_secs = 1\nws_max_operations = 5000").await;
    let token = server.token("acme", "ada");
    let before = server.open_fds();
    let mut client = WsClient::connect(&server, &token).await;
    // About 2,000 answers of some 20 KB each: far more than the socket
    // buffers of both sides hold, with a client that reads none of them.
    let query = "{ __schema { types { name description fields { name description type { name kind } } } } }";
    for i in 0..2000 {
        let frame =
            json!({ "id": format!("s{i}"), "type": "subscribe", "payload": { "query": query } });
        client.feed(&frame.to_string()).await.unwrap();
    }
    client.flush().await.unwrap();
    let deadline = Instant::now() + PATIENCE;
    loop {
        let open = server.open_fds();
        if open <= before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the server still holds the stalled socket ({open} descriptors, {before} before)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(client);
}

#[tokio::test]
async fn a_subscribe_before_init_and_a_second_init_close_with_the_protocols_codes() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;

    let mut early = WsClient::open(&server, "graphql-transport-ws").await;
    early.subscribe("a", "{ me { tenant } }", json!({})).await;
    assert_eq!(
        early.ending().await,
        Ending::Closed(4401, "Unauthorized".to_owned())
    );

    let mut twice = WsClient::connect(&server, &token).await;
    twice
        .init(json!({ "Authorization": format!("Bearer {token}") }))
        .await;
    assert_eq!(
        twice.ending().await,
        Ending::Closed(4429, "Too many initialisation requests.".to_owned())
    );

    // Pings are answered before and after the init, and a feed and a query
    // share one socket.
    let mut client = WsClient::open(&server, "graphql-transport-ws").await;
    client.send_json(json!({ "type": "ping" })).await;
    assert_eq!(client.next_json().await.unwrap(), json!({ "type": "pong" }));
    client.init_with(&token).await;
    client
        .subscribe(
            "feed",
            "subscription($c: ID!) { conversationEvents(conversationId: $c, after: \"0000000000000000\") { type } }",
            json!({ "c": conversation }),
        )
        .await;
    client.subscribe("me", "{ me { tenant } }", json!({})).await;
    client.send_json(json!({ "type": "ping" })).await;
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let message = client.next_json().await.expect("the socket stays open");
        seen.push(message);
    }
    assert!(seen.contains(&json!({ "type": "pong" })), "{seen:?}");
    assert!(
        seen.iter()
            .any(|m| m["id"] == "me" && m["payload"]["data"]["me"]["tenant"] == "acme"),
        "{seen:?}"
    );
    assert!(
        seen.iter().all(|m| m["type"] != "connection_ack"),
        "one acknowledgement only: {seen:?}"
    );
}
