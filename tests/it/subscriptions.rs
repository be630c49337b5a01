//! Subscriptions over WebSocket: live events, catch-up from a cursor while
//! many writers commit, run streams that complete.

use std::collections::HashSet;

use serde_json::{Value, json};

use crate::support::{Server, WsClient, assert_datetime};

const CONVERSATION_EVENTS: &str = "subscription($c: ID!, $a: String) { conversationEvents(conversationId: $c, after: $a) { cursor type conversationId runId at ... on MessageEvent { messageId role } ... on RunEvent { status } } }";

#[tokio::test]
async fn a_subscriber_sees_the_message_and_its_queued_run() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let mut client = WsClient::connect(&server, &token).await;
    // The reliable start: read lastCursor, subscribe after it.
    let last_cursor = server
        .gql(
            &token,
            "query($c: ID!) { conversation(id: $c) { lastCursor } }",
            json!({ "c": conversation }),
        )
        .await["conversation"]["lastCursor"]
        .clone();
    client
        .subscribe(
            "1",
            CONVERSATION_EVENTS,
            json!({ "c": conversation, "a": last_cursor }),
        )
        .await;
    let (message, run) = server.send(&token, &conversation, "hi").await;

    let first = client.next_event("1").await["data"]["conversationEvents"].clone();
    assert_eq!(first["type"], "message.created");
    assert_eq!(first["messageId"], message.as_str());
    assert_eq!(first["role"], "USER");
    assert_eq!(first["conversationId"], conversation.as_str());
    assert_eq!(first["runId"], run.as_str());
    assert_datetime(&first["at"]);
    let second = client.next_event("1").await["data"]["conversationEvents"].clone();
    assert_eq!(second["type"], "run.queued");
    assert_eq!(second["status"], "QUEUED");
    assert_eq!(second["runId"], run.as_str());
    assert!(first["cursor"].as_str() < second["cursor"].as_str());

    // What the subscriber saw is what the log holds.
    let events = server.all_events(&token, &conversation).await;
    let cursors: Vec<_> = events.iter().map(|e| e["cursor"].clone()).collect();
    assert_eq!(
        cursors,
        vec![first["cursor"].clone(), second["cursor"].clone()]
    );
}

#[tokio::test]
async fn the_legacy_graphql_ws_protocol_streams_too() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    server.send(&token, &conversation, "before").await;
    let mut client = WsClient::open(&server, "graphql-ws").await;
    client.init_with(&token).await;
    client
        .subscribe(
            "1",
            CONVERSATION_EVENTS,
            json!({ "c": conversation, "a": "0000000000000000" }),
        )
        .await;
    let first = client.next_event("1").await;
    assert_eq!(
        first["data"]["conversationEvents"]["type"],
        "message.created"
    );
    let second = client.next_event("1").await;
    assert_eq!(second["data"]["conversationEvents"]["type"], "run.queued");
}

/// Collects `count` events of subscription `id`, returning their cursors.
async fn collect_cursors(client: &mut WsClient, id: &str, until: &str) -> Vec<String> {
    let mut cursors = Vec::new();
    loop {
        let payload = client.next_event(id).await;
        assert!(payload.get("errors").is_none(), "{payload}");
        let cursor = payload["data"]["conversationEvents"]["cursor"]
            .as_str()
            .unwrap()
            .to_owned();
        let done = cursor.as_str() >= until;
        cursors.push(cursor);
        if done {
            return cursors;
        }
    }
}

#[tokio::test]
async fn catch_up_delivers_every_event_after_the_cursor_once_in_order_under_concurrent_writers() {
    const WRITERS: usize = 8;
    const SENDS_PER_WRITER: usize = 63; // 8 × 63 × 2 = 1,008 events
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    for i in 0..5 {
        server
            .send(&token, &conversation, &format!("warm-up {i}"))
            .await;
    }
    let resume_from = server
        .gql(
            &token,
            "query($c: ID!) { conversation(id: $c) { lastCursor } }",
            json!({ "c": conversation }),
        )
        .await["conversation"]["lastCursor"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(resume_from, "0000000000000010");

    // One subscriber resumes before the writers start, one while they write.
    let mut early = WsClient::connect(&server, &token).await;
    early
        .subscribe(
            "early",
            CONVERSATION_EVENTS,
            json!({ "c": conversation, "a": resume_from }),
        )
        .await;
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let server_base = server.base.clone();
            let token = token.clone();
            let conversation = conversation.clone();
            tokio::spawn(async move {
                let http = {
        tether::providers::http::install_tls();
        reqwest::Client::new()
    };
                for i in 0..SENDS_PER_WRITER {
                    let body: Value = http
                        .post(format!("{server_base}/graphql"))
                        .bearer_auth(&token)
                        .json(&json!({
                            "query": "mutation($c: ID!, $t: String!) { sendMessage(input: {conversationId: $c, text: $t}) { run { id } } }",
                            "variables": { "c": conversation, "t": format!("writer {w} message {i}") },
                        }))
                        .send()
                        .await
                        .unwrap()
                        .json()
                        .await
                        .unwrap();
                    assert!(body.get("errors").is_none(), "{body}");
                }
            })
        })
        .collect();

    // Wait until the writers are well under way, then resume mid-stream.
    loop {
        let events = server.all_events(&token, &conversation).await;
        if events.len() > 300 {
            break;
        }
        tokio::task::yield_now().await;
    }
    let mut late = WsClient::connect(&server, &token).await;
    late.subscribe(
        "late",
        CONVERSATION_EVENTS,
        json!({ "c": conversation, "a": resume_from }),
    )
    .await;

    for writer in writers {
        writer.await.unwrap();
    }
    let total = 10 + WRITERS * SENDS_PER_WRITER * 2;
    let last = format!("{total:016}");
    let expected: Vec<String> = (11..=total).map(|n| format!("{n:016}")).collect();

    let early_seen = collect_cursors(&mut early, "early", &last).await;
    let late_seen = collect_cursors(&mut late, "late", &last).await;
    assert_eq!(
        early_seen, expected,
        "early subscriber: gap, repeat or disorder"
    );
    assert_eq!(
        late_seen, expected,
        "late subscriber: gap, repeat or disorder"
    );

    // The log agrees, page by page.
    let logged = server.all_events(&token, &conversation).await;
    let logged: Vec<String> = logged[10..]
        .iter()
        .map(|e| e["cursor"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(logged, expected);
    let distinct: HashSet<_> = logged.iter().collect();
    assert_eq!(distinct.len(), logged.len());
}

#[tokio::test]
async fn run_events_complete_after_the_final_event() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, first_run) = server.send(&token, &conversation, "one").await;
    let (_, run) = server.send(&token, &conversation, "two").await;
    let mut client = WsClient::connect(&server, &token).await;
    const RUN_EVENTS: &str = "subscription($r: ID!, $a: String) { runEvents(runId: $r, after: $a) { cursor type runId } }";
    client
        .subscribe(
            "1",
            RUN_EVENTS,
            json!({ "r": run, "a": "0000000000000000" }),
        )
        .await;
    let event = client.next_event("1").await["data"]["runEvents"].clone();
    assert_eq!(event["type"], "message.created");
    assert_eq!(event["runId"], run.as_str());
    let event = client.next_event("1").await["data"]["runEvents"].clone();
    assert_eq!(event["type"], "run.queued");

    server
        .gql(
            &token,
            "mutation($r: ID!) { cancelRun(runId: $r) { status } }",
            json!({ "r": first_run }),
        )
        .await;
    server
        .gql(
            &token,
            "mutation($r: ID!) { cancelRun(runId: $r) { status } }",
            json!({ "r": run }),
        )
        .await;
    // The other run's cancellation is filtered out; ours ends the stream.
    let event = client.next_event("1").await["data"]["runEvents"].clone();
    assert_eq!(event["type"], "run.cancelled");
    assert_eq!(event["runId"], run.as_str());
    let complete = client.next_json().await.unwrap();
    assert_eq!(complete, json!({ "type": "complete", "id": "1" }));

    // An ended run replays its story from a cursor, then completes; from
    // its end it completes at once.
    client
        .subscribe(
            "2",
            RUN_EVENTS,
            json!({ "r": run, "a": "0000000000000000" }),
        )
        .await;
    let mut types = Vec::new();
    loop {
        let message = client.next_json().await.unwrap();
        if message["type"] == "complete" {
            break;
        }
        types.push(
            message["payload"]["data"]["runEvents"]["type"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    assert_eq!(types, ["message.created", "run.queued", "run.cancelled"]);
    client.subscribe("3", RUN_EVENTS, json!({ "r": run })).await;
    assert_eq!(
        client.next_json().await.unwrap(),
        json!({ "type": "complete", "id": "3" })
    );
}

#[tokio::test]
async fn a_malformed_cursor_is_bad_user_input() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let err = server
        .gql_error(
            &token,
            "query($c: ID!) { events(conversationId: $c, after: \"12\") { hasMore } }",
            json!({ "c": conversation }),
        )
        .await;
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT");
    let mut client = WsClient::connect(&server, &token).await;
    client
        .subscribe(
            "1",
            CONVERSATION_EVENTS,
            json!({ "c": conversation, "a": "yesterday" }),
        )
        .await;
    let message = client.next_json().await.unwrap();
    assert!(message.to_string().contains("BAD_USER_INPUT"), "{message}");
}

#[tokio::test]
async fn the_server_pings_idle_connections() {
    let server = Server::with_api("ws_keepalive_secs = 1").await;
    let token = server.token("acme", "ada");
    let mut modern = WsClient::connect(&server, &token).await;
    assert_eq!(modern.wait_for_keepalive().await, json!({ "type": "ping" }));
    let mut legacy = WsClient::open(&server, "graphql-ws").await;
    legacy.init_with(&token).await;
    assert_eq!(legacy.wait_for_keepalive().await, json!({ "type": "ka" }));
}

#[tokio::test]
async fn a_connection_runs_a_bounded_number_of_operations() {
    let server = Server::with_api("ws_max_operations = 2").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let mut client = WsClient::connect(&server, &token).await;
    for id in ["a", "b"] {
        client
            .subscribe(id, CONVERSATION_EVENTS, json!({ "c": conversation }))
            .await;
    }
    client
        .subscribe("c", CONVERSATION_EVENTS, json!({ "c": conversation }))
        .await;
    let refusal = client.next_json().await.unwrap();
    assert_eq!(refusal["type"], "error", "{refusal}");
    assert_eq!(refusal["id"], "c");
    assert_eq!(
        refusal["payload"][0]["extensions"]["code"],
        "BAD_USER_INPUT"
    );

    // Ending one makes room for another.
    client
        .send_json(json!({ "type": "complete", "id": "a" }))
        .await;
    client.subscribe("d", "{ me { tenant } }", json!({})).await;
    let answer = client.next_event("d").await;
    assert_eq!(answer["data"]["me"]["tenant"], "acme");
}

/// A query over WebSocket reads one snapshot, as over HTTP: its
/// `lastCursor` matches the messages it returned while writers commit.
#[tokio::test]
async fn a_websocket_query_reads_one_snapshot_while_writers_commit() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let server = std::sync::Arc::new(server);
    let mut writers = Vec::new();
    for w in 0..4 {
        let (server, token, conversation) = (server.clone(), token.clone(), conversation.clone());
        writers.push(tokio::spawn(async move {
            for i in 0..20 {
                server
                    .send(&token, &conversation, &format!("writer {w} message {i}"))
                    .await;
            }
        }));
    }
    let mut client = WsClient::connect(&server, &token).await;
    let query = "query($c: ID!) { conversation(id: $c) { before: lastCursor messages(last: 100) { id } after: lastCursor } }";
    let mut reads = Vec::new();
    let mut n = 0;
    while !writers.iter().all(|w| w.is_finished()) || reads.is_empty() {
        let id = format!("q{n}");
        n += 1;
        client
            .subscribe(&id, query, json!({ "c": conversation }))
            .await;
        let payload = client.next_event(&id).await;
        let read = payload["data"]["conversation"].clone();
        assert_eq!(read["before"], read["after"], "one snapshot: {read}");
        reads.push(read);
    }
    for writer in writers {
        writer.await.unwrap();
    }
    let events = server
        .gql(
            &token,
            "query($c: ID!) { events(conversationId: $c, first: 1000) { hasMore events { cursor type ... on MessageEvent { messageId } } } }",
            json!({ "c": conversation }),
        )
        .await["events"]
        .clone();
    assert_eq!(events["hasMore"], false);
    let events = events["events"].as_array().unwrap();
    for read in &reads {
        let cursor = read["before"].as_str().unwrap();
        let created: HashSet<&str> = events
            .iter()
            .filter(|e| e["type"] == "message.created" && e["cursor"].as_str().unwrap() <= cursor)
            .map(|e| e["messageId"].as_str().unwrap())
            .collect();
        let returned: HashSet<&str> = read["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap())
            .collect();
        assert_eq!(created, returned, "messages as of {cursor}");
    }
}

/// A subscriber that stops reading while thousands of events commit (far
/// more than the bus buffers for it) holds nobody up: a fast subscriber of
/// the same conversation gets every event while the slow one still reads
/// nothing, and the slow one, once it reads again, gets every event too,
/// once each and in order (it repairs its lag from the log).
#[tokio::test]
async fn a_slow_subscriber_neither_loses_events_nor_delays_a_fast_one() {
    const SENDS: usize = 700; // 1,400 events: more than the bus's 1,024
    // 700 messages at once, and no worker to start their runs: more than
    // one person's rate and waiting runs allow.
    let server = Server::start_with(crate::support::ServerOptions {
        config: format!(
            "{}\n[runtime]\nmax_waiting_runs_per_principal = 0\n",
            crate::support::base_config_with_api(
                "ws_send_timeout_secs = 300\nmessages_per_minute = 0"
            )
        ),
        ..Default::default()
    })
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let start = "0000000000000000";
    let mut slow = WsClient::connect_slow(&server, &token).await;
    slow.subscribe(
        "slow",
        CONVERSATION_EVENTS,
        json!({ "c": conversation, "a": start }),
    )
    .await;
    let mut fast = WsClient::connect(&server, &token).await;
    fast.subscribe(
        "fast",
        CONVERSATION_EVENTS,
        json!({ "c": conversation, "a": start }),
    )
    .await;
    let total = SENDS * 2;
    let last = format!("{total:016}");
    let expected: Vec<String> = (1..=total).map(|n| format!("{n:016}")).collect();

    // The writes and the fast reader run together; the slow socket is not
    // read at all meanwhile.
    let writes = async {
        for i in 0..SENDS {
            server
                .send(&token, &conversation, &format!("message {i}"))
                .await;
        }
    };
    let (_, fast_seen) = tokio::join!(writes, collect_cursors(&mut fast, "fast", &last));
    assert_eq!(
        fast_seen, expected,
        "fast subscriber: gap, repeat or disorder"
    );

    let slow_seen = collect_cursors(&mut slow, "slow", &last).await;
    assert_eq!(
        slow_seen, expected,
        "slow subscriber: gap, repeat or disorder"
    );
}

/// The server as a whole serves at most `max_subscriptions`, across
/// sockets; the next is refused with `UNAVAILABLE`, and an ended one makes
/// room.
#[tokio::test]
async fn the_server_serves_a_bounded_number_of_subscriptions() {
    let server = Server::with_api("max_subscriptions = 2").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let mut first = WsClient::connect(&server, &token).await;
    let mut second = WsClient::connect(&server, &token).await;
    // From the conversation's start: a live subscription (no `after`) is
    // live only once the server has registered it, which no frame tells.
    let start = json!({ "c": conversation, "a": "0000000000000000" });
    first
        .subscribe("a", CONVERSATION_EVENTS, start.clone())
        .await;
    second
        .subscribe("b", CONVERSATION_EVENTS, start.clone())
        .await;
    // Both are being served: the next event reaches them.
    server.send(&token, &conversation, "hello").await;
    first.next_event("a").await;
    second.next_event("b").await;

    second
        .subscribe("c", CONVERSATION_EVENTS, json!({ "c": conversation }))
        .await;
    let refusal = answer_to(&mut second, "c").await;
    assert_eq!(
        refusal["errors"][0]["extensions"]["code"], "UNAVAILABLE",
        "{refusal}"
    );

    drop(first);
    // The first socket's subscription ends with it; then there is room,
    // and the new subscription gets the next event.
    let deadline = tokio::time::Instant::now() + crate::support::PATIENCE;
    loop {
        second
            .subscribe(
                "d",
                CONVERSATION_EVENTS,
                json!({ "c": conversation, "a": "0000000000000000" }),
            )
            .await;
        let answer = answer_to(&mut second, "d").await;
        if answer.get("errors").is_none() {
            assert!(answer["data"]["conversationEvents"].is_object(), "{answer}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no room: {answer}");
        tokio::task::yield_now().await;
    }
}

/// The payload of the next `next` message for `id` (a refused subscription
/// is one `next` with `errors`, then `complete`), skipping `complete`s.
async fn answer_to(client: &mut WsClient, id: &str) -> Value {
    loop {
        let message = client.next_json().await.expect("the socket stays open");
        if message["id"] == id && message["type"] == "next" {
            return message["payload"].clone();
        }
    }
}

/// Subscribers that send one document share its rendering, and nothing
/// else: each gets its own feed from its own cursor, the same bytes for the
/// same event; another tenant's subscriber with the very same document is
/// refused; another document gets its own shape.
#[tokio::test]
async fn subscribers_sharing_a_document_each_get_their_own_feed() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    server.send(&token, &conversation, "one").await; // cursors 1 and 2
    let from = |cursor: &str| json!({ "c": conversation, "a": cursor });

    let mut early = WsClient::connect(&server, &token).await;
    early
        .subscribe("e", CONVERSATION_EVENTS, from("0000000000000000"))
        .await;
    let mut late = WsClient::connect(&server, &token).await;
    late.subscribe("l", CONVERSATION_EVENTS, from("0000000000000002"))
        .await;
    let mut other = WsClient::connect(&server, &token).await;
    other
        .subscribe(
            "o",
            "subscription($c: ID!, $a: String) { feed: conversationEvents(conversationId: $c, after: $a) { type } }",
            from("0000000000000002"),
        )
        .await;
    let stranger_token = server.token("globex", "eve");
    let mut stranger = WsClient::connect(&server, &stranger_token).await;
    stranger
        .subscribe("s", CONVERSATION_EVENTS, from("0000000000000000"))
        .await;
    let refusal = stranger.next_json().await.unwrap();
    assert_eq!(refusal["type"], "next", "{refusal}");
    assert_eq!(
        refusal["payload"]["errors"][0]["extensions"]["code"],
        "NOT_FOUND"
    );
    assert_eq!(
        stranger.next_json().await.unwrap(),
        json!({ "type": "complete", "id": "s" })
    );

    server.send(&token, &conversation, "two").await; // cursors 3 and 4
    let early_seen = payloads(&mut early, "e", 4).await;
    let late_seen = payloads(&mut late, "l", 2).await;
    let cursors = |seen: &[Value]| -> Vec<String> {
        seen.iter()
            .map(|p| {
                p["data"]["conversationEvents"]["cursor"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    };
    assert_eq!(
        cursors(&early_seen),
        [
            "0000000000000001",
            "0000000000000002",
            "0000000000000003",
            "0000000000000004"
        ]
    );
    assert_eq!(
        cursors(&late_seen),
        ["0000000000000003", "0000000000000004"]
    );
    assert_eq!(
        &early_seen[2..],
        &late_seen[..],
        "the same event, the same payload"
    );
    let other_seen = payloads(&mut other, "o", 2).await;
    assert_eq!(
        other_seen,
        [
            json!({ "data": { "feed": { "type": "message.created" } } }),
            json!({ "data": { "feed": { "type": "run.queued" } } }),
        ]
    );
}

/// The next `count` payloads of subscription `id`.
async fn payloads(client: &mut WsClient, id: &str, count: usize) -> Vec<Value> {
    let mut seen = Vec::new();
    for _ in 0..count {
        seen.push(client.next_event(id).await);
    }
    seen
}
