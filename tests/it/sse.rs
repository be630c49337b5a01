//! Plain Server-Sent Events (`GET /conversations/{id}/events`,
//! `GET /runs/{id}/events`), read as an SSE client reads them: from the
//! first persisted event, then live; resumed with `Last-Event-ID` or
//! `?after=` exactly as `after` resumes; refusals as over GraphQL.

use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use serde_json::{Value, json};

use crate::support::{PATIENCE, Server, WORKER_CONFIG};

/// One thing an SSE stream sent.
#[derive(Debug)]
enum Item {
    Event {
        event: String,
        id: Option<String>,
        data: Value,
    },
    /// A comment line (a heartbeat).
    Comment,
}

/// An open SSE response, parsed block by block.
struct SseReader {
    body: BoxStream<'static, Result<Vec<u8>, String>>,
    buffer: String,
}

impl SseReader {
    /// The next item, or `None` when the server ended the stream.
    async fn next(&mut self) -> Option<Item> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                return Some(parse(&block));
            }
            let chunk = tokio::time::timeout(PATIENCE, self.body.next())
                .await
                .expect("the stream sends within the patience")?;
            self.buffer
                .push_str(std::str::from_utf8(&chunk.expect("the stream reads")).unwrap());
        }
    }

    /// The next event, past heartbeats.
    async fn event(&mut self) -> Option<(String, Option<String>, Value)> {
        loop {
            match self.next().await? {
                Item::Event { event, id, data } => return Some((event, id, data)),
                Item::Comment => {}
            }
        }
    }
}

fn parse(block: &str) -> Item {
    let (mut event, mut id, mut data) = (None, None, Vec::new());
    for line in block.lines() {
        if line.is_empty() || line.starts_with(':') {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => event = Some(value.to_owned()),
            "id" => id = Some(value.to_owned()),
            "data" => data.push(value),
            other => panic!("unexpected field {other:?} in {block:?}"),
        }
    }
    match event {
        Some(event) => Item::Event {
            event,
            id,
            data: serde_json::from_str(&data.join("\n")).unwrap(),
        },
        None => {
            assert!(data.is_empty(), "data without an event: {block:?}");
            Item::Comment
        }
    }
}

/// `GET path` with the token and, when given, `Last-Event-ID`.
async fn get(
    server: &Server,
    token: Option<&str>,
    path: &str,
    last_event_id: Option<&str>,
) -> reqwest::Response {
    // As `EventSource` asks: such a request is served outside hyper
    // (`api::listener::streaming`).
    let mut request = server
        .http()
        .get(format!("{}{path}", server.base))
        .header("accept", "text/event-stream");
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(id) = last_event_id {
        request = request.header("last-event-id", id);
    }
    request.send().await.unwrap()
}

async fn open(server: &Server, token: &str, path: &str, last_event_id: Option<&str>) -> SseReader {
    let response = get(server, Some(token), path, last_event_id).await;
    assert_eq!(response.status(), 200, "{path}");
    assert_eq!(
        response.headers()["content-type"],
        "text/event-stream",
        "{path}"
    );
    SseReader {
        body: response
            .bytes_stream()
            .map(|chunk| chunk.map(|bytes| bytes.to_vec()).map_err(|e| e.to_string()))
            .boxed(),
        buffer: String::new(),
    }
}

/// `open`, over a socket whose receive buffer is 4 KiB, read as raw
/// HTTP/1.1: a reader that stops reading stalls the server's writes after
/// a few events, instead of the kernel absorbing them all.
async fn open_slow(server: &Server, token: &str, path: &str) -> SseReader {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(server.addr.parse().unwrap()).await.unwrap();
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {}\r\nAccept: text/event-stream\r\nAuthorization: Bearer {token}\r\n\r\n",
        server.addr
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut reader = BufReader::new(stream);
    let mut head = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).await.unwrap();
        if line == "\r\n" {
            break;
        }
        head.push(line.trim_end().to_ascii_lowercase());
    }
    assert_eq!(head[0], "http/1.1 200 ok", "{head:?}");
    assert!(
        head.contains(&"transfer-encoding: chunked".to_owned()),
        "{head:?}"
    );
    // Written outside hyper (`api::listener::streaming`), which never
    // closes a kept-alive connection after one answer.
    assert!(head.contains(&"connection: close".to_owned()), "{head:?}");
    // The chunked body, one chunk an item.
    let body = futures_util::stream::unfold(reader, |mut reader| async move {
        let mut size = String::new();
        if reader.read_line(&mut size).await.ok()? == 0 {
            return None;
        }
        let size = usize::from_str_radix(size.trim(), 16).ok()?;
        if size == 0 {
            return None;
        }
        let mut chunk = vec![0; size + 2];
        reader.read_exact(&mut chunk).await.ok()?;
        chunk.truncate(size);
        Some((Ok(chunk), reader))
    });
    SseReader {
        body: body.boxed(),
        buffer: String::new(),
    }
}

/// Reads persisted events until `count` of them have come; each is
/// `(cursor, type)`.
async fn persisted(reader: &mut SseReader, count: usize) -> Vec<(String, String)> {
    persisted_and_deltas(reader, count).await.0
}

/// `persisted`, and how many deltas came between them (each checked).
async fn persisted_and_deltas(
    reader: &mut SseReader,
    count: usize,
) -> (Vec<(String, String)>, usize) {
    let (mut seen, mut deltas) = (Vec::new(), 0);
    while seen.len() < count {
        let (event, id, data) = reader.event().await.expect("more events");
        assert_eq!(data["type"], event.as_str(), "{data}");
        if event == "part.delta" {
            assert_eq!(id, None, "a delta is not persisted: {data}");
            assert!(
                data["partId"].is_string() && data["offset"].is_number(),
                "{data}"
            );
            deltas += 1;
            continue;
        }
        let id = id.unwrap_or_else(|| panic!("a persisted event has its cursor: {data}"));
        assert_eq!(data["cursor"], id.as_str(), "{data}");
        assert!(data["conversationId"].is_string(), "{data}");
        seen.push((id, event));
    }
    (seen, deltas)
}

fn cursors_and_types(events: &[Value]) -> Vec<(String, String)> {
    events
        .iter()
        .map(|e| {
            (
                e["cursor"].as_str().unwrap().to_owned(),
                e["type"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_conversation_streams_from_its_first_event_then_live_and_resumes_where_it_was_left() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, first) = server.send(&token, &conversation, "hello").await;
    server.wait_until_ended(&token, &first).await;
    let before = cursors_and_types(&server.all_events(&token, &conversation).await);

    // From the first persisted event, in the log's order.
    let path = format!("/conversations/{conversation}/events");
    let mut reader = open(&server, &token, &path, None).await;
    assert_eq!(persisted(&mut reader, before.len()).await, before);

    // Then live: a second run's events as they are committed, and its
    // streamed text as deltas without an id.
    let (_, second) = server.send(&token, &conversation, "/stream 40").await;
    server.wait_until_ended(&token, &second).await;
    let all = cursors_and_types(&server.all_events(&token, &conversation).await);
    let (live, deltas) = persisted_and_deltas(&mut reader, all.len() - before.len()).await;
    assert_eq!(live, all[before.len()..], "live, with no gap at the seam");
    assert!(deltas > 0, "the streamed text came as deltas");
    drop(reader);

    // A reconnect with `Last-Event-ID` gets every event after it, exactly
    // once and in order; `?after=` resumes the same.
    let (seam, _) = &all[before.len() - 1];
    let mut resumed = open(&server, &token, &path, Some(seam)).await;
    assert_eq!(
        persisted(&mut resumed, all.len() - before.len()).await,
        all[before.len()..]
    );
    let mut after = open(&server, &token, &format!("{path}?after={seam}"), None).await;
    assert_eq!(
        persisted(&mut after, all.len() - before.len()).await,
        all[before.len()..]
    );
}

#[tokio::test]
async fn a_runs_stream_replays_the_ended_run_and_ends() {
    let server = Server::start_workers(WORKER_CONFIG).await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let (_, first) = server.send(&token, &conversation, "one").await;
    server.wait_until_ended(&token, &first).await;
    let (_, second) = server.send(&token, &conversation, "two").await;
    server.wait_until_ended(&token, &second).await;
    let expected: Vec<(String, String)> = server
        .all_events(&token, &conversation)
        .await
        .iter()
        .filter(|e| e["runId"] == second.as_str())
        .map(|e| {
            (
                e["cursor"].as_str().unwrap().to_owned(),
                e["type"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(expected.last().unwrap().1, "run.completed");

    let path = format!("/runs/{second}/events");
    let mut reader = open(&server, &token, &path, None).await;
    assert_eq!(persisted(&mut reader, expected.len()).await, expected);
    assert!(
        reader.event().await.is_none(),
        "the stream ends with the run"
    );

    // `EventSource` reconnects with the final event's id: nothing follows
    // it, and 204 tells it to stop.
    let (last, _) = expected.last().unwrap();
    let after_the_end = get(&server, Some(&token), &path, Some(last)).await;
    assert_eq!(after_the_end.status(), 204);
    // `Last-Event-ID` wins over `?after=`.
    let (third, _) = &expected[2];
    let mut resumed = open(
        &server,
        &token,
        &format!("{path}?after=0000000000000000"),
        Some(third),
    )
    .await;
    assert_eq!(
        persisted(&mut resumed, expected.len() - 3).await,
        expected[3..]
    );
}

#[tokio::test]
async fn refusals_are_the_same_as_over_graphql() {
    let server = Server::start().await;
    let ada = server.token("acme", "ada");
    let conversation = server.create_conversation(&ada).await;
    let path = format!("/conversations/{conversation}/events");

    let anonymous = get(&server, None, &path, None).await;
    assert_eq!(anonymous.status(), 401);
    let body: Value = anonymous.json().await.unwrap();
    assert_eq!(body["errors"][0]["extensions"]["code"], "UNAUTHENTICATED");

    // Another tenant's conversation is as absent as one that never was.
    let eve = server.token("globex", "eve");
    let theirs = get(&server, Some(&eve), &path, None).await;
    assert_eq!(theirs.status(), 404);
    let theirs: Value = theirs.json().await.unwrap();
    let nowhere = get(
        &server,
        Some(&eve),
        &format!("/conversations/{}/events", uuid::Uuid::now_v7()),
        None,
    )
    .await;
    assert_eq!(nowhere.status(), 404);
    assert_eq!(theirs, nowhere.json::<Value>().await.unwrap());
    assert_eq!(theirs["errors"][0]["extensions"]["code"], "NOT_FOUND");
    assert!(theirs["errors"][0].get("locations").is_none(), "{theirs}");
    let graphql = server
        .gql_error(
            &eve,
            "query($c: ID!) { events(conversationId: $c) { endCursor } }",
            json!({ "c": conversation }),
        )
        .await;
    assert_eq!(theirs["errors"][0]["message"], graphql["message"]);
    let (_, adas_run) = server.send(&ada, &conversation, "hello").await;
    let theirs = get(
        &server,
        Some(&eve),
        &format!("/runs/{adas_run}/events"),
        None,
    )
    .await;
    assert_eq!(theirs.status(), 404);
    let nowhere = get(
        &server,
        Some(&eve),
        &format!("/runs/{}/events", uuid::Uuid::now_v7()),
        None,
    )
    .await;
    assert_eq!(nowhere.status(), 404);
    assert_eq!(
        theirs.json::<Value>().await.unwrap(),
        nowhere.json::<Value>().await.unwrap()
    );

    let unreadable = get(
        &server,
        Some(&ada),
        &format!("{path}?after=a&after=b"),
        None,
    )
    .await;
    assert_eq!(
        unreadable.status(),
        400,
        "a query string that cannot be read"
    );
    let body: Value = unreadable.json().await.unwrap();
    assert_eq!(body["errors"][0]["extensions"]["code"], "BAD_USER_INPUT");

    let malformed = get(&server, Some(&ada), &path, Some("not a cursor")).await;
    assert_eq!(malformed.status(), 400);
    let body: Value = malformed.json().await.unwrap();
    assert_eq!(body["errors"][0]["extensions"]["code"], "BAD_USER_INPUT");
    assert_eq!(body["errors"][0]["extensions"]["key"], "after");
}

#[tokio::test]
async fn an_idle_stream_gets_heartbeats() {
    let server = Server::with_api("sse_keepalive_secs = 1").await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let mut reader = open(
        &server,
        &token,
        &format!("/conversations/{conversation}/events"),
        None,
    )
    .await;
    // A new conversation has no event yet: the first thing sent is a
    // heartbeat comment.
    assert!(matches!(reader.next().await, Some(Item::Comment)));
    assert!(matches!(reader.next().await, Some(Item::Comment)));
}

#[tokio::test]
async fn a_url_may_carry_a_short_lived_token_and_only_that() {
    let server = Server::start().await;
    let ada = server.token("acme", "ada");
    let conversation = server.create_conversation(&ada).await;
    let path = |token: &str| format!("/conversations/{conversation}/events?access_token={token}");

    let short = server.token_for("acme", "ada", Duration::from_secs(60));
    let served = get(&server, None, &path(&short), None).await;
    assert_eq!(served.status(), 200);
    assert_eq!(served.headers()["content-type"], "text/event-stream");

    let long = server.token_for("acme", "ada", Duration::from_secs(3600));
    let refused = get(&server, None, &path(&long), None).await;
    assert_eq!(refused.status(), 401);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["errors"][0]["extensions"]["code"], "UNAUTHENTICATED");
    assert_eq!(
        body["errors"][0]["extensions"]["reason"],
        "a token in the URL must expire within 300 s"
    );
    // Another tenant's short token gets what another tenant gets.
    let eve = server.token_for("globex", "eve", Duration::from_secs(60));
    assert_eq!(get(&server, None, &path(&eve), None).await.status(), 404);
}

#[tokio::test]
async fn a_stream_holds_a_share_of_the_principals_streams_until_the_client_goes() {
    let server = Server::with_api(
        "max_sockets_per_principal = 1\nsse_keepalive_secs = 1\nsse_url_token_max_secs = 0",
    )
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let path = format!("/conversations/{conversation}/events");
    let first = open(&server, &token, &path, None).await;

    let second = get(&server, Some(&token), &path, None).await;
    assert_eq!(second.status(), 429);
    assert!(second.headers().contains_key("retry-after"));
    let body: Value = second.json().await.unwrap();
    assert_eq!(body["errors"][0]["extensions"]["code"], "RATE_LIMITED");
    // Another principal has a share of their own.
    let bob = server.token("acme", "bob");
    let _bobs = open(&server, &bob, &path, None).await;

    // The client goes: its share comes back once the server notices (at
    // the next heartbeat at the latest).
    drop(first);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let again = get(&server, Some(&token), &path, None).await;
        if again.status() == 200 {
            break;
        }
        assert_eq!(again.status(), 429);
        assert!(
            tokio::time::Instant::now() < deadline,
            "the share never came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // With `sse_url_token_max_secs = 0` no token is taken from a URL.
    let short = server.token_for("acme", "ada", Duration::from_secs(60));
    let url = get(&server, None, &format!("{path}?access_token={short}"), None).await;
    assert_eq!(url.status(), 401);
}

#[tokio::test]
async fn a_stream_from_an_api_process_goes_on_when_its_worker_is_killed_mid_run() {
    let api = Server::api_only(WORKER_CONFIG).await;
    let mut worker = api.companion_with("worker", WORKER_CONFIG, &[]).await;
    let token = api.token("acme", "ada");
    let conversation = api.create_conversation(&token).await;
    let mut reader = open(
        &api,
        &token,
        &format!("/conversations/{conversation}/events"),
        None,
    )
    .await;
    let (_, run) = api.send(&token, &conversation, "/hold 3").await;

    // The worker dies (SIGKILL) once the reply's text is being committed.
    let mut seen = Vec::new();
    while seen.last().is_none_or(|(_, kind)| kind != "part.updated") {
        seen.extend(persisted(&mut reader, 1).await);
    }
    worker.child.kill().await.unwrap();
    // Another takes the run over once its lease runs out; the stream,
    // served by the API all along, goes on.
    let _successor = api.companion_with("worker", WORKER_CONFIG, &[]).await;
    while seen.last().is_none_or(|(_, kind)| kind != "run.completed") {
        seen.extend(persisted(&mut reader, 1).await);
    }
    assert!(api.recoveries(&run).await > 0, "the run was taken over");
    // Nothing lost, nothing repeated: exactly the log, in order.
    let log = cursors_and_types(&api.all_events(&token, &conversation).await);
    assert_eq!(seen, log);
}

/// A reader that stops reading while thousands of events commit holds
/// nobody up: a fast reader of the same conversation gets every event
/// while the slow one reads nothing, and the slow one, once it reads
/// again, gets every event too, once each and in order.
#[tokio::test]
async fn a_slow_reader_loses_nothing_and_holds_no_one_up() {
    const SENDS: usize = 700; // 1,400 events: more than the bus's 1,024
    // No worker starts the runs, and one person may send them all.
    let server = Server::start_with(crate::support::ServerOptions {
        config: format!(
            "{}\n[runtime]\nmax_waiting_runs_per_principal = 0\n",
            crate::support::base_config_with_api("messages_per_minute = 0")
        ),
        ..Default::default()
    })
    .await;
    let token = server.token("acme", "ada");
    let conversation = server.create_conversation(&token).await;
    let path = format!("/conversations/{conversation}/events");
    let mut slow = open_slow(&server, &token, &path).await;
    let mut fast = open(&server, &token, &path, None).await;
    let total = SENDS * 2;

    let writes = async {
        for i in 0..SENDS {
            server
                .send(&token, &conversation, &format!("message {i}"))
                .await;
        }
    };
    let (_, fast_seen) = tokio::join!(writes, persisted(&mut fast, total));
    let log = cursors_and_types(&server.all_events(&token, &conversation).await);
    assert_eq!(log.len(), total);
    assert_eq!(fast_seen, log, "fast reader: gap, repeat or disorder");
    assert_eq!(
        persisted(&mut slow, total).await,
        log,
        "slow reader: gap, repeat or disorder"
    );
}
