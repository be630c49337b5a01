//! GraphQL over Server-Sent Events (`/graphql/stream`, the `graphql-sse`
//! protocol): its own npm client, unchanged, in both modes against the real
//! server (`scripts/sse-clients`), and the protocol's refusals read as a
//! plain HTTP client reads them.

use std::process::Stdio;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::support::{PATIENCE, Server, WORKER_CONFIG, WsClient};

const RUN_EVENTS: &str = "subscription($r: ID!, $after: String) { \
    events: runEvents(runId: $r, after: $after) { \
    cursor type runId ... on PartDelta { partId offset text } } }";

/// What graphql-sse's client received for one operation: its results, and
/// how it ended (`complete`, `taken`, or `error`).
#[derive(Debug, Default)]
struct Received {
    results: Vec<Value>,
    end: String,
    message: Option<String>,
}

/// Runs `operations` with graphql-sse's client (one client, so one
/// connection in single-connection mode) and collects what each received.
async fn graphql_sse_client(
    server: &Server,
    token: &str,
    single_connection: bool,
    operations: Value,
) -> Vec<Received> {
    let dir = crate::support::npm_package("sse-clients", "graphql-sse");
    let count = operations.as_array().unwrap().len();
    let arguments = json!({
        "url": format!("{}/graphql/stream", server.base),
        "token": token,
        "singleConnection": single_connection,
        "operations": operations,
    });
    let mut child = Command::new("node")
        .arg(dir.join("graphql-sse.mjs"))
        .arg(arguments.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("node runs (Node.js 20.19 or later is needed)");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut received: Vec<Received> = (0..count).map(|_| Received::default()).collect();
    while let Some(line) = tokio::time::timeout(PATIENCE, lines.next_line())
        .await
        .expect("the client answers within the patience")
        .unwrap()
    {
        let line: Value = serde_json::from_str(&line).unwrap();
        let op = &mut received[line["op"].as_u64().unwrap() as usize];
        match line.get("result") {
            Some(result) => op.results.push(result.clone()),
            None => {
                op.end = line["end"].as_str().unwrap().to_owned();
                op.message = line["message"].as_str().map(str::to_owned);
            }
        }
    }
    let status = tokio::time::timeout(PATIENCE, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "the client exits cleanly");
    received
}

/// The persisted events among `results`, as `(cursor, type)`, and how many
/// live deltas came between them.
fn persisted(results: &[Value]) -> (Vec<(String, String)>, usize) {
    let (mut seen, mut deltas) = (Vec::new(), 0);
    for result in results {
        assert!(result.get("errors").is_none(), "{result}");
        let event = &result["data"]["events"];
        if event["type"] == "part.delta" {
            assert!(event["offset"].is_number(), "{event}");
            deltas += 1;
            continue;
        }
        seen.push((
            event["cursor"].as_str().unwrap().to_owned(),
            event["type"].as_str().unwrap().to_owned(),
        ));
    }
    (seen, deltas)
}

#[tokio::test]
async fn graphql_sses_own_client_resumes_mid_run_with_every_event_once_in_both_modes() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    for single_connection in [false, true] {
        let conversation = server.create_conversation(&token).await;
        // A run that streams for two seconds: the client leaves and comes
        // back while it goes on.
        let (_, run) = server.send(&token, &conversation, "/hold 2").await;
        let received = graphql_sse_client(
            &server,
            &token,
            single_connection,
            json!([
                { "query": RUN_EVENTS, "variables": { "r": run, "after": "0000000000000000" }, "take": 3 },
                { "query": RUN_EVENTS, "variables": { "r": run }, "resume": true },
                {
                    "query": "query($c: ID!) { conversation(id: $c) { id } }",
                    "variables": { "c": conversation },
                },
                { "query": "mutation { createConversation(input: { title: \"over SSE\" }) { title } }" },
            ]),
        )
        .await;
        let mode = if single_connection {
            "single"
        } else {
            "distinct"
        };
        assert_eq!(received[0].end, "taken", "{mode}: {received:?}");
        assert_eq!(received[1].end, "complete", "{mode}: {received:?}");

        // Every persisted event of the run, exactly once and in order, with
        // no gap at the seam between the two subscriptions.
        let expected: Vec<(String, String)> = server
            .all_events(&token, &conversation)
            .await
            .iter()
            .filter(|e| e["runId"] == run.as_str())
            .map(|e| {
                (
                    e["cursor"].as_str().unwrap().to_owned(),
                    e["type"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        let (before, _) = persisted(&received[0].results);
        let (after, live_deltas) = persisted(&received[1].results);
        assert!(!before.is_empty(), "{mode}: {received:?}");
        let joined: Vec<_> = before.iter().chain(&after).cloned().collect();
        assert_eq!(joined, expected, "{mode}");
        assert_eq!(expected.last().unwrap().1, "run.completed", "{mode}");
        assert!(
            live_deltas > 0,
            "{mode}: the resumed subscription followed the run live"
        );

        // A query and a mutation, one result each.
        assert_eq!(received[2].end, "complete", "{mode}");
        assert_eq!(
            received[2].results,
            [json!({ "data": { "conversation": { "id": conversation } } })],
            "{mode}"
        );
        assert_eq!(
            received[3].results,
            [json!({ "data": { "createConversation": { "title": "over SSE" } } })],
            "{mode}"
        );
    }
}

/// The `event:` and `data:` of each event of a whole (ended) SSE body.
fn events_of(body: &str) -> Vec<(String, String)> {
    body.split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .filter_map(|block| {
            let (mut event, mut data) = (None, String::new());
            for line in block.lines() {
                if let Some(value) = line.strip_prefix("event:") {
                    event = Some(value.trim().to_owned());
                } else if let Some(value) = line.strip_prefix("data:") {
                    data.push_str(value.strip_prefix(' ').unwrap_or(value));
                }
            }
            event.map(|event| (event, data))
        })
        .collect()
}

/// A distinct-connections request: `POST /graphql/stream` with
/// `Accept: text/event-stream`.
async fn distinct(server: &Server, token: Option<&str>, body: Value) -> reqwest::Response {
    let mut request = server
        .http()
        .post(format!("{}/graphql/stream", server.base))
        .header("accept", "text/event-stream")
        .json(&body);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    request.send().await.unwrap()
}

#[tokio::test]
async fn refusals_are_the_same_as_over_graphql() {
    let server = Server::start().await;
    let ada = server.token("acme", "ada");
    let eve = server.token("globex", "eve");
    let conversation = server.create_conversation(&ada).await;
    let (_, run) = server.send(&ada, &conversation, "hello").await;
    let subscription = json!({ "query": RUN_EVENTS, "variables": { "r": run } });

    let anonymous = distinct(&server, None, subscription.clone()).await;
    assert_eq!(anonymous.status(), 401);
    let body: Value = anonymous.json().await.unwrap();
    assert_eq!(body["errors"][0]["extensions"]["code"], "UNAUTHENTICATED");

    // Another tenant's run is as absent as one that never was, and the
    // refusal is the one GraphQL gives, as the protocol's `next`, then
    // `complete`.
    let theirs = distinct(&server, Some(&eve), subscription.clone()).await;
    assert_eq!(theirs.status(), 200);
    assert!(
        theirs.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let theirs = events_of(&theirs.text().await.unwrap());
    let nowhere = distinct(
        &server,
        Some(&eve),
        json!({ "query": RUN_EVENTS, "variables": { "r": uuid::Uuid::now_v7() } }),
    )
    .await;
    let nowhere = events_of(&nowhere.text().await.unwrap());
    assert_eq!(theirs, nowhere);
    let [(next, refusal), (complete, _)] = theirs.as_slice() else {
        panic!("a refusal, then complete: {theirs:?}");
    };
    assert_eq!((next.as_str(), complete.as_str()), ("next", "complete"));
    let refusal: Value = serde_json::from_str(refusal).unwrap();
    assert_eq!(refusal["errors"][0]["extensions"]["code"], "NOT_FOUND");
    // The refusal a WebSocket subscriber gets for the same subscription.
    let mut socket = WsClient::connect(&server, &eve).await;
    socket.subscribe("e", RUN_EVENTS, json!({ "r": run })).await;
    let over_ws = socket.next_json().await.unwrap();
    assert_eq!(over_ws["type"], "next", "{over_ws}");
    for field in ["message", "extensions"] {
        assert_eq!(
            over_ws["payload"]["errors"][0][field], refusal["errors"][0][field],
            "{over_ws}"
        );
    }

    // Single-connection mode: a reservation is its principal's alone.
    let stream = format!("{}/graphql/stream", server.base);
    let put = server.http().put(&stream).send().await.unwrap();
    assert_eq!(put.status(), 401);
    let put = server
        .http()
        .put(&stream)
        .bearer_auth(&ada)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 201);
    let reservation = put.text().await.unwrap();
    let open = |token: &str, reservation: &str| {
        server
            .http()
            .get(&stream)
            .bearer_auth(token)
            .header("accept", "text/event-stream")
            .header("x-graphql-event-stream-token", reservation)
            .send()
    };
    let evesees = open(&eve, &reservation).await.unwrap();
    assert_eq!(evesees.status(), 404);
    let unknown = open(&eve, "no-such-reservation").await.unwrap();
    assert_eq!(unknown.status(), 404);
    assert_eq!(
        evesees.json::<Value>().await.unwrap(),
        unknown.json::<Value>().await.unwrap()
    );
    let opened = open(&ada, &reservation).await.unwrap();
    assert_eq!(opened.status(), 200);
    let again = open(&ada, &reservation).await.unwrap();
    assert_eq!(again.status(), 409, "one stream per reservation");

    let operation = |token: &str, body: Value| {
        server
            .http()
            .post(&stream)
            .bearer_auth(token)
            .header("x-graphql-event-stream-token", &reservation)
            .json(&body)
            .send()
    };
    let eves = operation(
        &eve,
        json!({ "query": "{ __typename }", "extensions": { "operationId": "a" } }),
    )
    .await
    .unwrap();
    assert_eq!(eves.status(), 404);
    let unnamed = operation(&ada, json!({ "query": "{ __typename }" }))
        .await
        .unwrap();
    assert_eq!(unnamed.status(), 400);
    let running = json!({ "query": RUN_EVENTS, "variables": { "r": run }, "extensions": { "operationId": "a" } });
    assert_eq!(
        operation(&ada, running.clone()).await.unwrap().status(),
        202
    );
    assert_eq!(
        operation(&ada, running).await.unwrap().status(),
        409,
        "an operation id in use"
    );
    let delete = server
        .http()
        .delete(&stream)
        .bearer_auth(&ada)
        .header("x-graphql-event-stream-token", &reservation)
        .send()
        .await
        .unwrap();
    assert_eq!(delete.status(), 400, "a stop names its operation");
    drop(opened);
}

#[tokio::test]
async fn a_reservation_holds_a_socket_share_until_its_stream_ends_or_it_lapses() {
    let server = Server::with_api(
        "max_sockets_per_principal = 1\nws_init_timeout_secs = 1\nsse_keepalive_secs = 1",
    )
    .await;
    let ada = server.token("acme", "ada");
    let stream = format!("{}/graphql/stream", server.base);
    let put = || server.http().put(&stream).bearer_auth(&ada).send();

    let first = put().await.unwrap();
    assert_eq!(first.status(), 201);
    let first = first.text().await.unwrap();
    let refused = put().await.unwrap();
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().contains_key("retry-after"));
    // A reservation no stream opens lapses, and gives its share back.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let second = loop {
        let put = put().await.unwrap();
        if put.status() == 201 {
            break put.text().await.unwrap();
        }
        assert_eq!(put.status(), 429);
        assert!(
            tokio::time::Instant::now() < deadline,
            "the share came back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let lapsed = server
        .http()
        .get(&stream)
        .bearer_auth(&ada)
        .header("accept", "text/event-stream")
        .header("x-graphql-event-stream-token", &first)
        .send()
        .await
        .unwrap();
    assert_eq!(lapsed.status(), 404, "a lapsed reservation is gone");

    // An open stream keeps the share until it ends.
    let open = server
        .http()
        .get(format!("{stream}?token={second}"))
        .bearer_auth(&ada)
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    assert_eq!(open.status(), 200);
    assert_eq!(put().await.unwrap().status(), 429);
    drop(open);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while put().await.unwrap().status() != 201 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the share came back with the stream"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A single-connection reservation of the token's principal: its token.
async fn reserve(server: &Server, token: &str) -> String {
    let put = server
        .http()
        .put(format!("{}/graphql/stream", server.base))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 201);
    put.text().await.unwrap()
}

/// An open single-connection stream, read event by event.
struct Stream {
    body: futures_util::stream::BoxStream<'static, reqwest::Result<axum::body::Bytes>>,
    buffer: String,
}

impl Stream {
    /// The next `(event, data)`, past heartbeats.
    async fn next(&mut self) -> (String, Value) {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                if let Some((event, data)) = events_of(&block).pop() {
                    return (event, serde_json::from_str(&data).unwrap());
                }
                continue;
            }
            let chunk =
                tokio::time::timeout(PATIENCE, futures_util::StreamExt::next(&mut self.body))
                    .await
                    .expect("the stream sends within the patience")
                    .expect("the stream stays open")
                    .unwrap();
            self.buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }

    /// Reads until operation `id` completes; what came for each operation
    /// on the way, `next`s only.
    async fn until_complete(&mut self, id: &str) -> Vec<(String, Value)> {
        let mut seen = Vec::new();
        loop {
            let (event, data) = self.next().await;
            let of = data["id"].as_str().unwrap().to_owned();
            if event == "complete" && of == id {
                return seen;
            }
            if event == "next" {
                seen.push((of, data["payload"].clone()));
            }
        }
    }
}

#[tokio::test]
async fn a_stopped_operation_sends_nothing_more_and_the_stream_goes_on() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, run) = server.send(&token, &conversation, "/hold 2").await;
    let url = format!("{}/graphql/stream", server.base);
    let reservation = reserve(&server, &token).await;
    let opened = server
        .http()
        .get(&url)
        .bearer_auth(&token)
        .header("accept", "text/event-stream")
        .header("x-graphql-event-stream-token", &reservation)
        .send()
        .await
        .unwrap();
    assert_eq!(opened.status(), 200);
    let mut stream = Stream {
        body: futures_util::StreamExt::boxed(opened.bytes_stream()),
        buffer: String::new(),
    };
    let start = |id: &str, body: Value| {
        let mut body = body;
        body["extensions"] = json!({ "operationId": id });
        server
            .http()
            .post(&url)
            .bearer_auth(&token)
            .header("x-graphql-event-stream-token", &reservation)
            .json(&body)
            .send()
    };
    let events =
        json!({ "query": RUN_EVENTS, "variables": { "r": run, "after": "0000000000000000" } });
    assert_eq!(start("x", events).await.unwrap().status(), 202);
    let (event, first) = stream.next().await;
    assert_eq!((event.as_str(), first["id"].as_str()), ("next", Some("x")));

    let stopped = server
        .http()
        .delete(format!("{url}?operationId=x"))
        .bearer_auth(&token)
        .header("x-graphql-event-stream-token", &reservation)
        .send()
        .await
        .unwrap();
    assert_eq!(stopped.status(), 200);
    // What x had sent before the stop may still come; once another
    // operation has completed after the run ended, nothing more of x does.
    let typename = json!({ "query": "{ __typename }" });
    assert_eq!(start("y", typename.clone()).await.unwrap().status(), 202);
    stream.until_complete("y").await;
    server.wait_until_ended(&token, &run).await;
    assert_eq!(start("z", typename).await.unwrap().status(), 202);
    let after_the_end = stream.until_complete("z").await;
    assert_eq!(
        after_the_end,
        [("z".to_owned(), json!({ "data": { "__typename": "Query" } }))],
        "nothing of the stopped operation, though its run went on to its end"
    );
    // The id is free again.
    assert_eq!(
        start("x", json!({ "query": "{ __typename }" }))
            .await
            .unwrap()
            .status(),
        202
    );
}

#[tokio::test]
async fn a_mutation_takes_effect_at_its_post_though_no_stream_reads_it() {
    let server = Server::start().await;
    let token = server.token("acme", "ada");
    let url = format!("{}/graphql/stream", server.base);
    let reservation = reserve(&server, &token).await;
    let posted = server
        .http()
        .post(&url)
        .bearer_auth(&token)
        .header("x-graphql-event-stream-token", &reservation)
        .json(&json!({
            "query": "mutation { createConversation(input: { title: \"never read\" }) { id } }",
            "extensions": { "operationId": "m" },
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(posted.status(), 202);
    let listed = server
        .gql(&token, "{ conversations { nodes { title } } }", json!({}))
        .await;
    assert_eq!(
        listed["conversations"]["nodes"],
        json!([{ "title": "never read" }]),
        "the 202 came after the mutation took effect"
    );
}
