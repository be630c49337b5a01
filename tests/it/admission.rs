//! Every document is admitted in time linear in its length, before
//! async-graphql's own walks (which follow fragment spreads without
//! remembering them): a fragment bomb is refused at once on every
//! transport, and neither the probes nor a running run notice it.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::{Server, WORKER_CONFIG, WsClient};

/// `{ ...F0 }`, each fragment spreading the next one twice, `levels` deep,
/// on `root`, ending in `leaf`: 2^levels leaves once expanded, in about a
/// kilobyte.
fn bomb(operation: &str, root: &str, levels: usize, leaf: &str) -> String {
    let mut query = format!("{operation} {{ ...F0 }} fragment F{levels} on {root} {{ {leaf} }}");
    for level in 0..levels {
        query.push_str(&format!(
            " fragment F{level} on {root} {{ ...F{next} ...F{next} }}",
            next = level + 1
        ));
    }
    query
}

fn query_bomb(levels: usize) -> String {
    bomb("query", "Query", levels, "me { tenant }")
}

fn assert_refused_for_its_size(body: &Value) {
    assert!(body.get("data").is_none_or(Value::is_null), "{body}");
    let err = &body["errors"][0];
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{body}");
    assert_eq!(
        err["message"], "the query selects more than 50000 fields once its fragments are expanded",
        "{body}"
    );
}

/// The longest `/healthz` answer while `busy` runs.
async fn slowest_probe_while<F: std::future::Future>(
    server: &Server,
    busy: F,
) -> (Duration, F::Output) {
    let probing = async {
        let mut slowest = Duration::ZERO;
        for _ in 0..20 {
            let started = Instant::now();
            let answer = server.get("/healthz").await;
            assert_eq!(answer.status(), 200);
            slowest = slowest.max(started.elapsed());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        slowest
    };
    tokio::join!(probing, busy)
}

#[tokio::test]
async fn a_fragment_bomb_is_refused_at_once_while_probes_and_runs_go_on() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    // A run that outlasts its lease (3 s) unless its heartbeats keep it.
    let (_, run) = server.send(&token, &conversation, "/hold 5").await;
    server
        .wait_for_run(&token, &run, |r| r["status"] == "RUNNING")
        .await;

    let bombs = async {
        let mut slowest = Duration::ZERO;
        for _ in 0..3 {
            // Two at once, as the report froze the server with.
            let one = async {
                let started = Instant::now();
                let (status, body) = server.post(Some(&token), &query_bomb(29), json!({})).await;
                (started.elapsed(), status, body)
            };
            let (a, b) = tokio::join!(one, async {
                let started = Instant::now();
                let (status, body) = server.post(Some(&token), &query_bomb(29), json!({})).await;
                (started.elapsed(), status, body)
            });
            for (took, status, body) in [a, b] {
                assert_eq!(status, 200, "{body}");
                assert_refused_for_its_size(&body);
                slowest = slowest.max(took);
            }
        }
        slowest
    };
    let (probe, bomb) = slowest_probe_while(&server, bombs).await;
    assert!(bomb < Duration::from_millis(50), "refused in {bomb:?}");
    assert!(
        probe < Duration::from_millis(100),
        "/healthz took {probe:?}"
    );

    // Over GET too.
    let started = Instant::now();
    let url = reqwest::Url::parse_with_params(
        &format!("{}/graphql", server.base),
        [("query", query_bomb(29))],
    )
    .unwrap();
    let answer = server
        .http()
        .get(url)
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(answer.status(), 200);
    assert_refused_for_its_size(&answer.json().await.unwrap());
    assert!(took < Duration::from_millis(50), "refused in {took:?}");

    let ended = server.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let recoveries = server.recoveries(&run).await;
    assert_eq!(recoveries, 0, "the run kept its lease throughout");
}

#[tokio::test]
async fn a_subscription_bomb_is_refused_over_websocket_and_the_socket_serves_on() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let mut socket = WsClient::connect(&server, &token).await;
    let leaf = format!("conversationEvents(conversationId: \"{conversation}\") {{ cursor }}");
    let started = Instant::now();
    socket
        .subscribe(
            "bomb",
            &bomb("subscription", "Subscription", 29, &leaf),
            json!({}),
        )
        .await;
    let answer = socket.next_json().await.expect("an answer");
    let took = started.elapsed();
    // As async-graphql's engine answers any refused document: one `next`
    // with the errors and no data.
    assert_eq!(answer["id"], "bomb", "{answer}");
    assert_refused_for_its_size(&answer["payload"]);
    assert!(took < Duration::from_millis(50), "refused in {took:?}");

    // The same socket still serves a subscription, from the cursor the
    // conversation is at.
    let at = server
        .gql(
            &token,
            "query($c: ID!) { conversation(id: $c) { lastCursor } }",
            json!({ "c": conversation }),
        )
        .await;
    socket
        .subscribe(
            "events",
            "subscription($c: ID!, $a: String) { conversationEvents(conversationId: $c, after: $a) { type } }",
            json!({ "c": conversation, "a": at["conversation"]["lastCursor"] }),
        )
        .await;
    server.send(&token, &conversation, "hello").await;
    let first = socket.next_event("events").await;
    assert_eq!(
        first["data"]["conversationEvents"]["type"], "message.created",
        "{first}"
    );
}

#[tokio::test]
async fn long_documents_and_large_expansions_are_admitted_off_the_runtime_and_answered() {
    let server = Server::with_api("max_document_bytes = 49152").await;
    let token = server.token("acme", "ada");
    // Longer than what is admitted inline: its comment pads it to 40 KiB.
    let long = format!("{{ me {{ tenant }} }}\n#{}", "x".repeat(40 * 1024));
    let data = server.gql(&token, &long, json!({})).await;
    assert_eq!(data["me"]["tenant"], "acme");
    // 4,096 fields once expanded: validated on the blocking pool.
    let wide = query_bomb(12);
    let data = server.gql(&token, &wide, json!({})).await;
    assert_eq!(data["me"]["tenant"], "acme");
    // And past the configured length, refused with the limit named.
    let too_long = format!("{{ me {{ tenant }} }}\n#{}", "x".repeat(50 * 1024));
    let (status, body) = server.post(Some(&token), &too_long, json!({})).await;
    assert_eq!(status, 200, "{body}");
    let err = &body["errors"][0];
    assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{body}");
    assert_eq!(
        err["message"], "the document is longer than 49152 bytes",
        "{body}"
    );
}
