//! Subscriptions at scale, measured from outside: this bench spawns the
//! built `tether` binary (`CARGO_BIN_EXE_tether`, or `TETHER_BIN`) as a
//! separate process — scripted model, a fresh SQLite file — and the
//! reference `graphql-ws` server on graphql-js in Node
//! (`benches/reference/server.mjs`, in memory, persisting nothing), drives
//! both with the same client code over real WebSockets
//! (`graphql-transport-ws`) and HTTP, and prints one table with the ratio
//! Tether / reference beside each figure.
//!
//! `cargo bench --bench subscriptions`; `TETHER_BENCH_QUICK=1` for a run of
//! a minute or two with smaller sizes. The reference column needs
//! `npm ci --prefix benches/reference` first; without it, it is skipped.
//!
//! What each figure measures:
//! - **idle KiB per subscription at N**: N WebSockets, each with one
//!   `conversationEvents(conversationId, after: <the latest cursor>)` on one
//!   conversation. Server RSS (`VmRSS` of `/proc/PID/status`) after all N
//!   are subscribed and have each received one message's 2 events, then 2 s
//!   of quiet, minus the RSS before the first was opened, divided by N.
//!   Sockets are opened 200 at a time.
//! - **idle KiB per SSE stream at N**: the same, on Tether only, with N
//!   plain SSE streams (`GET /conversations/{id}/events?after=<the latest
//!   cursor>`, raw HTTP/1.1, one connection each) instead of WebSockets.
//!   Its reference column is Tether's own WebSocket figure of the same
//!   run, so the ratio is SSE / WebSocket. Beside it, what N idle
//!   HTTP/1.1 connections cost by themselves (each had one `GET /healthz`
//!   answered and stays open): the part of an SSE stream that is the
//!   connection hyper keeps (its read and write buffers), which a
//!   WebSocket gives up at its upgrade.
//! - **fan-out from commit**: N subscribers of one conversation (live, no
//!   `after`); `sendMessage` at a fixed rate of half the target events/s.
//!   Tether serves `--role api` (no workers), so each `sendMessage` commits
//!   exactly 2 persisted events (`message.created`, `run.queued`); the
//!   reference publishes the same 2. Latency = receipt by a subscriber −
//!   the instant just before the mutation's HTTP request was sent (so it
//!   includes the mutation's own commit), over every (subscriber, event).
//!   "delivered ev/s" = the events each subscriber received, on average,
//!   divided by the time from the first send to the last receipt.
//! - **deltas, spread after the first receipt**: Tether serves `--role all`
//!   with the scripted model streaming 8-character `part.delta`s one every
//!   `stream_delay_ms` (10 by default: ~100 deltas/s); the reference plays
//!   the same reply at the same pace from memory. One message at a time,
//!   the next sent when its run has completed. The emit time inside a
//!   server is not visible from outside, so this is NOT latency from emit:
//!   for each delta, the time from its first receipt by any subscriber to
//!   its receipt by each subscriber (the first one counts 0). It is the
//!   fan-out's own delay, a lower bound of latency from emit. Tether's
//!   runs also commit their persisted events (run, message and part
//!   events); the reference's plays send only `run.started`, the deltas and
//!   `run.completed`. "X of Y" counts a delta as expected on every socket
//!   once any subscriber received it (deltas are not persisted).
//! - **catch-up**: one conversation with M persisted events (M/2 messages,
//!   `--role api`, sent 16 at a time); one new WebSocket, and the time from
//!   sending `subscribe` with `after: "0000000000000000"` until the M-th
//!   event arrives. The reference keeps no log: n/a.
//! - **server CPU**: utime + stime of the server process
//!   (`/proc/PID/stat`, clock ticks → seconds) over the workload's measured
//!   part (connecting, subscribing and the events for idle; the sends and
//!   their delivery for fan-out; the replay for catch-up). "bench client
//!   CPU" is this process's own (`getrusage`) over the same span: when it
//!   nears the span's length on one core, the client is what limits.
//! - Percentiles are over the events that arrived; each server waits at
//!   most 60 s past the last send, and "delivered" notes "X of Y" when
//!   some had not arrived by then.
//!
//! Sizes (defaults are the issue's; quick mode in brackets):
//! `TETHER_BENCH_IDLE` = "1000,10000" ["100,1000"],
//! `TETHER_BENCH_FANOUT` = "100,1000" ["100,1000"],
//! `TETHER_BENCH_EVENTS_PER_SEC` = 100, `TETHER_BENCH_SECS` = 20 [5]
//! (per fan-out workload), `TETHER_BENCH_STREAM_DELAY_MS` = 10,
//! `TETHER_BENCH_CATCHUP` = 10000 [2000].
//! The bench and the server under test share the machine's cores; the two
//! servers run one after the other, each started fresh for each workload.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::stream::{self, SplitSink};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

const SECRET: &str = "subscriptions-bench-secret-of-32-bytes-or-more";
const TENANT: &str = "bench";
const SUB: &str = "bench-user";
/// Connections opened at once.
const OPEN_CONCURRENCY: usize = 200;
const DOCUMENT: &str = "subscription($c: ID!, $a: String) { conversationEvents(conversationId: $c, after: $a) { cursor type conversationId runId at ... on MessageEvent { messageId role } ... on RunEvent { status } ... on PartDelta { messageId partId offset text } } }";
const SEND: &str = "mutation($c: ID!, $t: String!) { sendMessage(input: {conversationId: $c, text: $t}) { message { id } run { id } } }";

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().replace('_', "").parse().ok())
        .unwrap_or(default)
}

fn sizes(name: &str, default: &[usize]) -> Vec<usize> {
    match std::env::var(name) {
        Ok(v) => v
            .split(',')
            .filter_map(|s| s.trim().replace('_', "").parse().ok())
            .collect(),
        Err(_) => default.to_vec(),
    }
}

// ---------------------------------------------------------------- servers

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Tether,
    Reference,
}

/// A server in its own process, killed when dropped.
struct Server {
    child: Child,
    addr: String,
    dir: PathBuf,
}

impl Server {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident memory in KiB.
    fn rss_kib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("the server is running");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status")
    }

    /// utime + stime, in seconds.
    fn cpu_secs(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))
            .expect("the server is running");
        let after = &stat[stat.rfind(')').expect("(comm)") + 2..];
        let fields: Vec<&str> = after.split_whitespace().collect();
        // Fields 14 and 15 of stat(5); `after` starts at field 3.
        let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        ticks / hz
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn temp_dir(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tether-subs-bench-{label}-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Starts the command and waits for `… listening on http://ADDR` on its
/// first stdout line; its stderr goes to `dir/stderr.log`.
fn launch(mut command: Command, dir: PathBuf) -> Server {
    let log = std::fs::File::create(dir.join("stderr.log")).unwrap();
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .stdin(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {command:?}: {e}"));
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let Some((_, addr)) = line.trim().split_once("listening on http://") else {
        let _ = child.kill();
        let log = std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default();
        panic!("{command:?} did not start: {line:?}\n{log}");
    };
    let addr = addr.to_owned();
    // Keep draining stdout so that the server never blocks on it.
    std::thread::spawn(move || for _ in out.lines() {});
    Server { child, addr, dir }
}

fn tether_bin() -> PathBuf {
    std::env::var_os("TETHER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tether")))
}

fn reference_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/reference")
}

/// `workers`: `--role all` with the scripted model streaming one chunk
/// every `stream_delay_ms`; otherwise `--role api`.
fn start(kind: Kind, workers: bool, stream_delay_ms: usize) -> Server {
    let dir = temp_dir(match kind {
        Kind::Tether => "tether",
        Kind::Reference => "reference",
    });
    let command = match kind {
        Kind::Tether => {
            let config = format!(
                "default_agent = \"demo\"\n\
                 [runtime]\nconcurrency = 8\nmax_waiting_runs_per_principal = 0\n\
                 [api]\nmax_connections = 60000\n\
                 messages_per_minute = 0\ntenant_messages_per_minute = 0\n\
                 conversations_per_minute = 0\ntenant_conversations_per_minute = 0\n\
                 max_subscriptions_per_principal = 100000\nmax_subscriptions_per_tenant = 100000\n\
                 max_sockets_per_principal = 60000\nmax_sockets_per_tenant = 60000\n\
                 max_requests_per_principal = 100000\nmax_requests_per_tenant = 100000\n\
                 [[agents]]\nname = \"demo\"\nprovider = \"scripted\"\nstream_delay_ms = {stream_delay_ms}\n"
            );
            std::fs::write(dir.join("tether.toml"), config).unwrap();
            let mut c = Command::new(tether_bin());
            c.args(["serve", "--role", if workers { "all" } else { "api" }])
                .current_dir(&dir)
                .env("TETHER_CONFIG", dir.join("tether.toml"))
                .env(
                    "TETHER_DATABASE_URL",
                    format!("sqlite://{}?mode=rwc", dir.join("bench.db").display()),
                )
                .env("TETHER_LISTEN", "127.0.0.1:0")
                .env("TETHER_JWT_SECRET", SECRET)
                .env("RUST_LOG", "warn");
            c
        }
        Kind::Reference => {
            let mut c = Command::new("node");
            c.arg(reference_dir().join("server.mjs"))
                .current_dir(reference_dir())
                .env("PORT", "0")
                .env(
                    "REFERENCE_STREAM_DELAY_MS",
                    if workers {
                        stream_delay_ms.to_string()
                    } else {
                        "0".into()
                    },
                );
            c
        }
    };
    launch(command, dir)
}

// ---------------------------------------------------------------- clients

/// HTTP GraphQL and WebSocket access to one server.
#[derive(Clone)]
struct Client {
    addr: String,
    token: String,
    http: reqwest::Client,
}

impl Client {
    fn new(addr: &str) -> Client {
        let auth = tether::api::auth::Authenticator::new(SECRET).unwrap();
        let token = auth
            .mint(TENANT, SUB, Duration::from_secs(24 * 3600))
            .unwrap();
        Client {
            addr: addr.to_owned(),
            token,
            http: reqwest::Client::new(),
        }
    }

    async fn gql(&self, query: &str, variables: Value) -> Value {
        let body: Value = self
            .http
            .post(format!("http://{}/graphql", self.addr))
            .bearer_auth(&self.token)
            .json(&json!({ "query": query, "variables": variables }))
            .send()
            .await
            .expect("the server answers")
            .json()
            .await
            .expect("a JSON answer");
        assert!(body.get("errors").is_none(), "{body}");
        body["data"].clone()
    }

    async fn conversation(&self) -> String {
        self.gql(
            "mutation { createConversation(input: {}) { id } }",
            json!({}),
        )
        .await["createConversation"]["id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// Sends a message; the ids of its message and its run.
    async fn send(&self, conversation: &str, text: &str) -> (u128, u128) {
        let data = self
            .gql(SEND, json!({ "c": conversation, "t": text }))
            .await;
        let id = |v: &Value| {
            uuid::Uuid::parse_str(v["id"].as_str().unwrap())
                .unwrap()
                .as_u128()
        };
        (
            id(&data["sendMessage"]["message"]),
            id(&data["sendMessage"]["run"]),
        )
    }

    /// A WebSocket past `connection_ack`, with small client buffers so that
    /// the bench's own memory stays modest.
    async fn connect(&self) -> Ws {
        let mut request = format!("ws://{}/graphql", self.addr)
            .into_client_request()
            .unwrap();
        request.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            HeaderValue::from_static("graphql-transport-ws"),
        );
        let config = WebSocketConfig::default()
            .read_buffer_size(16 * 1024)
            .write_buffer_size(0);
        let mut tries = 0;
        let (mut ws, _) = loop {
            match tokio_tungstenite::connect_async_with_config(request.clone(), Some(config), true)
                .await
            {
                Ok(ok) => break ok,
                Err(e) if tries < 5 => {
                    tries += 1;
                    eprintln!("  (connect failed, retrying: {e})");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("cannot connect: {e}"),
            }
        };
        let init = json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {}", self.token) } });
        ws.send(Message::Text(init.to_string().into()))
            .await
            .unwrap();
        loop {
            match ws.next().await {
                Some(Ok(Message::Text(t))) if t.contains("connection_ack") => break,
                Some(Ok(_)) => {}
                other => panic!("no connection_ack: {other:?}"),
            }
        }
        ws
    }
}

async fn subscribe(ws: &mut Ws, conversation: &str, after: Option<&str>) {
    let subscribe = json!({
        "id": "1",
        "type": "subscribe",
        "payload": { "query": DOCUMENT, "variables": { "c": conversation, "a": after } },
    });
    ws.send(Message::Text(subscribe.to_string().into()))
        .await
        .unwrap();
}

/// The string value of `"name":"…"` in a frame, without parsing the JSON.
fn field<'a>(text: &'a str, pattern: &str) -> Option<&'a str> {
    let start = text.find(pattern)? + pattern.len();
    let len = text[start..].find('"')?;
    Some(&text[start..start + len])
}

fn uuid_of(text: &str, pattern: &str) -> Option<u128> {
    uuid::Uuid::parse_str(field(text, pattern)?)
        .ok()
        .map(|u| u.as_u128())
}

fn offset_of(text: &str) -> Option<u64> {
    let pattern = "\"offset\":";
    let start = text.find(pattern)? + pattern.len();
    let digits: String = text[start..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

/// One received event, as the readers keep it.
#[derive(Clone, Copy)]
enum Seen {
    /// `message.created` (its message id) or `run.queued` (its run id).
    Committed(u128),
    /// A `part.delta`: its part and offset.
    Delta(u128, u64),
    RunCompleted(u128),
    Other,
}

fn classify(text: &str) -> Option<Seen> {
    if !text.contains("\"type\":\"next\"") {
        return None;
    }
    Some(match field(text, "\"type\":\"")? {
        "next" => {
            // The first "type" is the frame's; the event's follows.
            let rest = &text[text.find("conversationEvents")?..];
            match field(rest, "\"type\":\"")? {
                "message.created" => Seen::Committed(uuid_of(rest, "\"messageId\":\"")?),
                "run.queued" => Seen::Committed(uuid_of(rest, "\"runId\":\"")?),
                "part.delta" => Seen::Delta(uuid_of(rest, "\"partId\":\"")?, offset_of(rest)?),
                "run.completed" => Seen::RunCompleted(uuid_of(rest, "\"runId\":\"")?),
                _ => Seen::Other,
            }
        }
        _ => Seen::Other,
    })
}

/// What every reader counts, shared.
#[derive(Default)]
struct Counters {
    events: AtomicUsize,
    completed: AtomicUsize,
}

/// Reads one socket until `stop`, answering pings, recording what `keep`
/// selects with its arrival time; returns the records.
async fn read(
    ws: Ws,
    counters: Arc<Counters>,
    mut stop: watch::Receiver<bool>,
    keep: fn(&Seen) -> bool,
) -> Vec<(Seen, Instant)> {
    let (mut sink, mut frames): (SplitSink<Ws, Message>, _) = ws.split();
    let mut kept = Vec::new();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            frame = frames.next() => {
                let Some(Ok(frame)) = frame else { break };
                let now = Instant::now();
                let Message::Text(text) = frame else { continue };
                if text.contains("\"type\":\"ping\"") {
                    let _ = sink.send(Message::Text("{\"type\":\"pong\"}".into())).await;
                    continue;
                }
                if let Some(seen) = classify(&text) {
                    counters.events.fetch_add(1, Ordering::Relaxed);
                    if matches!(seen, Seen::RunCompleted(_)) {
                        counters.completed.fetch_add(1, Ordering::Relaxed);
                    }
                    if keep(&seen) {
                        kept.push((seen, now));
                    }
                }
            }
        }
    }
    let _ = sink.close().await;
    kept
}

/// `n` subscribed sockets, opened `OPEN_CONCURRENCY` at a time, each with
/// a reader task.
async fn subscribers(
    client: &Client,
    conversation: &str,
    after: Option<&str>,
    n: usize,
    counters: &Arc<Counters>,
    stop: &watch::Receiver<bool>,
    keep: fn(&Seen) -> bool,
) -> Vec<tokio::task::JoinHandle<Vec<(Seen, Instant)>>> {
    let sockets: Vec<Ws> = stream::iter(0..n)
        .map(|_| async {
            let mut ws = client.connect().await;
            subscribe(&mut ws, conversation, after).await;
            ws
        })
        .buffer_unordered(OPEN_CONCURRENCY)
        .collect()
        .await;
    sockets
        .into_iter()
        .map(|ws| tokio::spawn(read(ws, counters.clone(), stop.clone(), keep)))
        .collect()
}

async fn wait_until(what: &str, deadline: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while !done() {
        if start.elapsed() > deadline {
            eprintln!("  (gave up waiting for {what} after {deadline:?})");
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

async fn finish(
    stop: watch::Sender<bool>,
    readers: Vec<tokio::task::JoinHandle<Vec<(Seen, Instant)>>>,
) -> Vec<Vec<(Seen, Instant)>> {
    let _ = stop.send(true);
    let mut all = Vec::with_capacity(readers.len());
    for r in readers {
        all.push(r.await.unwrap());
    }
    all
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() as f64 * p / 100.0).ceil() as usize).saturating_sub(1);
    sorted[index.min(sorted.len() - 1)]
}

// ---------------------------------------------------------------- workloads

struct Idle {
    kib_per_sub: f64,
    open_secs: f64,
    cpu: f64,
    client_cpu: f64,
}

async fn idle(kind: Kind, n: usize) -> Idle {
    let server = start(kind, false, 0);
    let client = Client::new(&server.addr);
    let conversation = client.conversation().await;
    // A probe, live, to learn the latest cursor from one message's events.
    let mut probe = client.connect().await;
    subscribe(&mut probe, &conversation, None).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    client.send(&conversation, "warm-up").await;
    let mut cursor = None;
    for _ in 0..2 {
        while let Some(Ok(frame)) = probe.next().await {
            if let Message::Text(t) = frame
                && classify(&t).is_some()
            {
                cursor = field(&t, "\"cursor\":\"").map(str::to_owned);
                break;
            }
        }
    }
    drop(probe);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss0, cpu0, own0) = (server.rss_kib(), server.cpu_secs(), own_cpu());

    let counters = Arc::new(Counters::default());
    let (stop, stopped) = watch::channel(false);
    let started = Instant::now();
    let readers = subscribers(
        &client,
        &conversation,
        cursor.as_deref(),
        n,
        &counters,
        &stopped,
        |_| false,
    )
    .await;
    let open_secs = started.elapsed().as_secs_f64();
    // Every subscription is live once each has this message's 2 events.
    tokio::time::sleep(Duration::from_millis(500)).await;
    client.send(&conversation, "are you there?").await;
    wait_until(
        "every subscriber's 2 events",
        Duration::from_secs(120),
        || counters.events.load(Ordering::Relaxed) >= 2 * n,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (rss1, cpu1, own1) = (server.rss_kib(), server.cpu_secs(), own_cpu());
    finish(stop, readers).await;
    Idle {
        kib_per_sub: (rss1 - rss0) / n as f64,
        open_secs,
        cpu: cpu1 - cpu0,
        client_cpu: own1 - own0,
    }
}

/// `idle`, with plain SSE streams (`GET /conversations/{id}/events`)
/// instead of WebSocket subscriptions, on Tether: the same conversation,
/// cursor, message and quiet. Each stream is a raw HTTP/1.1 request on its
/// own connection with a small read buffer, as `connect` keeps its sockets'.
async fn idle_sse(n: usize) -> Idle {
    let server = start(Kind::Tether, false, 0);
    let client = Client::new(&server.addr);
    let conversation = client.conversation().await;
    client.send(&conversation, "warm-up").await;
    let cursor = client
        .gql(
            "query($c: ID!) { events(conversationId: $c) { endCursor } }",
            json!({ "c": conversation }),
        )
        .await["events"]["endCursor"]
        .as_str()
        .expect("the warm-up's events")
        .to_owned();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss0, cpu0, own0) = (server.rss_kib(), server.cpu_secs(), own_cpu());

    let counters = Arc::new(Counters::default());
    let (stop, stopped) = watch::channel(false);
    let started = Instant::now();
    let request = format!(
        "GET /conversations/{conversation}/events?after={cursor} HTTP/1.1\r\nHost: {}\r\n\
         Authorization: Bearer {}\r\nAccept: text/event-stream\r\n\r\n",
        client.addr, client.token
    );
    let streams: Vec<TcpStream> = stream::iter(0..n)
        .map(|_| async {
            let mut stream = TcpStream::connect(&client.addr)
                .await
                .expect("the server accepts");
            stream
                .write_all(request.as_bytes())
                .await
                .expect("the request goes out");
            stream
        })
        .buffer_unordered(OPEN_CONCURRENCY)
        .collect()
        .await;
    let readers: Vec<_> = streams
        .into_iter()
        .map(|stream| tokio::spawn(read_sse(stream, counters.clone(), stopped.clone())))
        .collect();
    wait_until("every stream's response", Duration::from_secs(120), || {
        counters.completed.load(Ordering::Relaxed) >= n
    })
    .await;
    let open_secs = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(500)).await;
    client.send(&conversation, "are you there?").await;
    wait_until("every stream's 2 events", Duration::from_secs(120), || {
        counters.events.load(Ordering::Relaxed) >= 2 * n
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (rss1, cpu1, own1) = (server.rss_kib(), server.cpu_secs(), own_cpu());
    let _ = stop.send(true);
    for reader in readers {
        let _ = reader.await;
    }
    Idle {
        kib_per_sub: (rss1 - rss0) / n as f64,
        open_secs,
        cpu: cpu1 - cpu0,
        client_cpu: own1 - own0,
    }
}

/// What an idle HTTP/1.1 connection costs the server by itself: N
/// connections that each had one `GET /healthz` answered and stay open
/// (keep-alive). A plain SSE stream is such a connection with its response
/// still going; a WebSocket leaves this behind at its upgrade.
async fn idle_keepalive(n: usize) -> f64 {
    let server = start(Kind::Tether, false, 0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss0 = server.rss_kib();
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {}\r\n\r\n", server.addr);
    let streams: Vec<TcpStream> = stream::iter(0..n)
        .map(|_| async {
            let mut stream = TcpStream::connect(&server.addr)
                .await
                .expect("the server accepts");
            stream
                .write_all(request.as_bytes())
                .await
                .expect("the request goes out");
            let mut answer = Vec::new();
            let mut buffer = [0u8; 512];
            while !answer.ends_with(b"ok") {
                let read = stream.read(&mut buffer).await.expect("the answer comes");
                assert!(read > 0, "the connection stays open");
                answer.extend_from_slice(&buffer[..read]);
            }
            stream
        })
        .buffer_unordered(OPEN_CONCURRENCY)
        .collect()
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss1 = server.rss_kib();
    drop(streams);
    (rss1 - rss0) / n as f64
}

/// Reads one SSE response until `stop`: counts the response (in
/// `completed`, once its first bytes come) and each persisted event (a line
/// starting `id:`) in `events`.
async fn read_sse(mut stream: TcpStream, counters: Arc<Counters>, mut stop: watch::Receiver<bool>) {
    const ID_LINE: &[u8] = b"\nid:";
    let mut buffer = [0u8; 2048];
    // The end of the previous read, for a line split between two reads.
    let mut carry: Vec<u8> = Vec::new();
    let mut answered = false;
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            read = stream.read(&mut buffer) => {
                let Ok(read) = read else { break };
                if read == 0 {
                    break;
                }
                if !answered {
                    answered = true;
                    counters.completed.fetch_add(1, Ordering::Relaxed);
                }
                carry.extend_from_slice(&buffer[..read]);
                let ids = carry.windows(ID_LINE.len()).filter(|w| *w == ID_LINE).count();
                counters.events.fetch_add(ids, Ordering::Relaxed);
                let keep = carry.len().min(ID_LINE.len() - 1);
                carry.drain(..carry.len() - keep);
            }
        }
    }
}

struct Fanout {
    p50: f64,
    p99: f64,
    rate: f64,
    delivered: usize,
    expected: usize,
    cpu: f64,
    client_cpu: f64,
}

async fn fanout(kind: Kind, n: usize, events_per_sec: usize, secs: usize) -> Fanout {
    let server = start(kind, false, 0);
    let client = Client::new(&server.addr);
    let conversation = client.conversation().await;
    let counters = Arc::new(Counters::default());
    let (stop, stopped) = watch::channel(false);
    let readers = subscribers(&client, &conversation, None, n, &counters, &stopped, |s| {
        matches!(s, Seen::Committed(_))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    client.send(&conversation, "warm-up").await;
    wait_until("the warm-up events", Duration::from_secs(60), || {
        counters.events.load(Ordering::Relaxed) >= 2 * n
    })
    .await;
    let base = counters.events.load(Ordering::Relaxed);

    let messages = (events_per_sec * secs / 2).max(1);
    let sent: Arc<Mutex<HashMap<u128, Instant>>> = Arc::default();
    let (cpu0, own0) = (server.cpu_secs(), own_cpu());
    let first_send = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(2.0 / events_per_sec as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut sends = Vec::with_capacity(messages);
    for i in 0..messages {
        tick.tick().await;
        let (client, conversation, sent) = (client.clone(), conversation.clone(), sent.clone());
        sends.push(tokio::spawn(async move {
            let at = Instant::now();
            let (message, run) = client.send(&conversation, &format!("message {i}")).await;
            let mut sent = sent.lock().unwrap();
            sent.insert(message, at);
            sent.insert(run, at);
        }));
    }
    for s in sends {
        s.await.unwrap();
    }
    let expected = 2 * messages * n;
    wait_until("every event's delivery", Duration::from_secs(60), || {
        counters.events.load(Ordering::Relaxed) >= base + expected
    })
    .await;
    let (cpu1, own1) = (server.cpu_secs(), own_cpu());
    let kept = finish(stop, readers).await;
    let sent = sent.lock().unwrap();
    let mut latencies = Vec::with_capacity(expected);
    let mut last = first_send;
    for (seen, at) in kept.iter().flatten() {
        if let Seen::Committed(id) = seen
            && let Some(t0) = sent.get(id)
        {
            latencies.push(at.duration_since(*t0).as_secs_f64() * 1000.0);
            last = last.max(*at);
        }
    }
    latencies.sort_by(f64::total_cmp);
    let delivered = latencies.len();
    Fanout {
        p50: percentile(&latencies, 50.0),
        p99: percentile(&latencies, 99.0),
        rate: delivered as f64 / n as f64 / last.duration_since(first_send).as_secs_f64(),
        delivered,
        expected,
        cpu: cpu1 - cpu0,
        client_cpu: own1 - own0,
    }
}

async fn deltas(kind: Kind, n: usize, stream_delay_ms: usize, secs: usize) -> Fanout {
    let server = start(kind, true, stream_delay_ms);
    let client = Client::new(&server.addr);
    let conversation = client.conversation().await;
    let counters = Arc::new(Counters::default());
    let (stop, stopped) = watch::channel(false);
    let readers = subscribers(&client, &conversation, None, n, &counters, &stopped, |s| {
        matches!(s, Seen::Delta(..))
    })
    .await;
    // The driver's own socket, to send each message once the last ran.
    let mut driver = client.connect().await;
    subscribe(&mut driver, &conversation, None).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let run_completed = async |driver: &mut Ws, run: u128| {
        while let Some(Ok(frame)) = driver.next().await {
            if let Message::Text(t) = frame
                && let Some(Seen::RunCompleted(id)) = classify(&t)
                && id == run
            {
                return;
            }
        }
        panic!("the driver's socket closed");
    };
    let (_, run) = client.send(&conversation, "warm-up").await;
    run_completed(&mut driver, run).await;
    wait_until("the warm-up run", Duration::from_secs(60), || {
        counters.completed.load(Ordering::Relaxed) >= n
    })
    .await;
    let (cpu0, own0) = (server.cpu_secs(), own_cpu());
    let started = Instant::now();
    let mut runs = 0;
    while started.elapsed() < Duration::from_secs(secs as u64) {
        let (_, run) = client.send(&conversation, &format!("stream {runs}")).await;
        run_completed(&mut driver, run).await;
        runs += 1;
    }
    wait_until(
        "the last run on every socket",
        Duration::from_secs(60),
        || counters.completed.load(Ordering::Relaxed) >= n * (runs + 1),
    )
    .await;
    let (cpu1, own1) = (server.cpu_secs(), own_cpu());
    let kept = finish(stop, readers).await;
    // First receipt of each delta, by any subscriber.
    let mut first: HashMap<(u128, u64), Instant> = HashMap::new();
    let mut last = started;
    for (seen, at) in kept.iter().flatten() {
        if let Seen::Delta(part, offset) = seen
            && *at >= started
        {
            let e = first.entry((*part, *offset)).or_insert(*at);
            *e = (*e).min(*at);
            last = last.max(*at);
        }
    }
    let mut spread = Vec::new();
    for (seen, at) in kept.iter().flatten() {
        if let Seen::Delta(part, offset) = seen
            && let Some(t0) = first.get(&(*part, *offset))
        {
            spread.push(at.duration_since(*t0).as_secs_f64() * 1000.0);
        }
    }
    spread.sort_by(f64::total_cmp);
    let delivered = spread.len();
    Fanout {
        p50: percentile(&spread, 50.0),
        p99: percentile(&spread, 99.0),
        rate: delivered as f64 / n as f64 / last.duration_since(started).as_secs_f64(),
        delivered,
        expected: first.len() * n,
        cpu: cpu1 - cpu0,
        client_cpu: own1 - own0,
    }
}

struct CatchUp {
    ms: f64,
    received: usize,
    fill_secs: f64,
    cpu: f64,
}

async fn catch_up(events: usize) -> CatchUp {
    let server = start(Kind::Tether, false, 0);
    let client = Client::new(&server.addr);
    let conversation = client.conversation().await;
    let filling = Instant::now();
    stream::iter(0..events.div_ceil(2))
        .map(|i| {
            let (client, conversation) = (&client, &conversation);
            async move {
                client.send(conversation, &format!("message {i}")).await;
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<()>>()
        .await;
    let fill_secs = filling.elapsed().as_secs_f64();
    let mut ws = client.connect().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let cpu0 = server.cpu_secs();
    let started = Instant::now();
    subscribe(&mut ws, &conversation, Some("0000000000000000")).await;
    let mut received = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while received < events {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => {
                if classify(&t).is_some() {
                    received += 1;
                }
            }
            Ok(Some(Ok(_))) => {}
            _ => break,
        }
    }
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    let cpu = server.cpu_secs() - cpu0;
    CatchUp {
        ms,
        received,
        fill_secs,
        cpu,
    }
}

// ---------------------------------------------------------------- table

struct Row {
    label: String,
    tether: f64,
    reference: Option<f64>,
    unit: &'static str,
    note: String,
}

fn row(label: String, tether: f64, reference: Option<f64>, unit: &'static str) -> Row {
    Row {
        label,
        tether,
        reference,
        unit,
        note: String::new(),
    }
}

fn print_table(rows: &[Row], reference: bool) {
    let fmt = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else if v.abs() >= 100.0 {
            format!("{v:.0}")
        } else if v.abs() >= 10.0 {
            format!("{v:.1}")
        } else {
            format!("{v:.2}")
        }
    };
    println!();
    println!(
        "{:<58} {:>12} {:>12} {:>8}  unit",
        "figure",
        "Tether",
        if reference { "reference" } else { "reference*" },
        "ratio"
    );
    println!("{}", "-".repeat(100));
    for r in rows {
        let (reference, ratio) = match r.reference {
            Some(v) => (
                fmt(v),
                if v != 0.0 && !v.is_nan() {
                    format!("{:.2}", r.tether / v)
                } else {
                    "-".into()
                },
            ),
            None => ("n/a".into(), "-".into()),
        };
        println!(
            "{:<58} {:>12} {:>12} {:>8}  {}{}",
            r.label,
            fmt(r.tether),
            reference,
            ratio,
            r.unit,
            if r.note.is_empty() {
                String::new()
            } else {
                format!("  ({})", r.note)
            }
        );
    }
    if !reference {
        println!(
            "* reference skipped: benches/reference/node_modules is missing; run npm ci --prefix benches/reference"
        );
    }
}

/// CPU seconds used by this process (the client side), user + system.
fn own_cpu() -> f64 {
    // SAFETY: getrusage with a valid pointer to a local.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

fn raise_fd_limit() -> u64 {
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local.
    unsafe {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        }
        limit.rlim_cur
    }
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    // `cargo bench` passes `--bench`; a filter is not supported.
    tether::providers::http::install_tls();
    let quick = std::env::var("TETHER_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let idle_sizes = sizes(
        "TETHER_BENCH_IDLE",
        if quick { &[100, 1000] } else { &[1000, 10_000] },
    );
    let fanout_sizes = sizes("TETHER_BENCH_FANOUT", &[100, 1000]);
    let events_per_sec = setting("TETHER_BENCH_EVENTS_PER_SEC", 100).max(2);
    let secs = setting("TETHER_BENCH_SECS", if quick { 5 } else { 20 });
    let stream_delay_ms = setting("TETHER_BENCH_STREAM_DELAY_MS", 10);
    let catchup = setting("TETHER_BENCH_CATCHUP", if quick { 2000 } else { 10_000 });

    let fds = raise_fd_limit();
    let most = idle_sizes
        .iter()
        .chain(&fanout_sizes)
        .copied()
        .max()
        .unwrap_or(0);
    if (fds as usize) < most + 1000 {
        eprintln!(
            "warning: the open-file limit is {fds}; {most} connections need more (ulimit -n)"
        );
    }
    let reference = reference_dir().join("node_modules/graphql-ws").is_dir();
    if !reference {
        eprintln!(
            "reference skipped: benches/reference/node_modules is missing; run npm ci --prefix benches/reference"
        );
    }
    let kinds: &[Kind] = if reference {
        &[Kind::Tether, Kind::Reference]
    } else {
        &[Kind::Tether]
    };
    let bench_start = Instant::now();
    let mut rows = Vec::new();

    for &n in &idle_sizes {
        let mut results = Vec::new();
        for &kind in kinds {
            eprintln!("idle: {n} subscriptions on {}", name(kind));
            results.push(idle(kind, n).await);
        }
        let r = results.get(1);
        rows.push(row(
            format!("idle: resident per subscription, {n} WebSockets"),
            results[0].kib_per_sub,
            r.map(|r| r.kib_per_sub),
            "KiB",
        ));
        rows.push(row(
            format!("idle: open + subscribe {n}, 200 at a time"),
            results[0].open_secs,
            r.map(|r| r.open_secs),
            "s",
        ));
        rows.push(row(
            format!("idle: server CPU, {n} (open, subscribe, 2 events)"),
            results[0].cpu,
            r.map(|r| r.cpu),
            "s",
        ));
        rows.push(row(
            format!("idle: bench client CPU, {n}"),
            results[0].client_cpu,
            r.map(|r| r.client_cpu),
            "s",
        ));
        eprintln!("idle: {n} plain SSE streams on tether");
        let sse = idle_sse(n).await;
        let mut sse_row = row(
            format!("idle: resident per SSE stream, {n} streams"),
            sse.kib_per_sub,
            Some(results[0].kib_per_sub),
            "KiB",
        );
        sse_row.note = "reference column: Tether's own WebSocket subscription".into();
        rows.push(sse_row);
        eprintln!("idle: {n} keep-alive HTTP/1.1 connections on tether");
        let mut keepalive = row(
            format!("idle: resident per kept-alive HTTP/1.1 connection, {n}"),
            idle_keepalive(n).await,
            Some(sse.kib_per_sub),
            "KiB",
        );
        keepalive.note = "reference column: the SSE stream's".into();
        rows.push(keepalive);
        rows.push(row(
            format!("idle: open {n} SSE streams, 200 at a time"),
            sse.open_secs,
            Some(results[0].open_secs),
            "s",
        ));
        rows.push(row(
            format!("idle: server CPU, {n} SSE (open, 2 events)"),
            sse.cpu,
            Some(results[0].cpu),
            "s",
        ));
    }

    for &n in &fanout_sizes {
        let mut results = Vec::new();
        for &kind in kinds {
            eprintln!(
                "fan-out from commit: {n} subscribers, {events_per_sec} events/s, {secs} s on {}",
                name(kind)
            );
            results.push(fanout(kind, n, events_per_sec, secs).await);
        }
        push_fanout(
            &mut rows,
            &format!("commit→receipt, {n} subs, {events_per_sec} ev/s"),
            "ev/s",
            &results,
        );
    }

    for &n in &fanout_sizes {
        let mut results = Vec::new();
        for &kind in kinds {
            eprintln!(
                "deltas: {n} subscribers, one chunk every {stream_delay_ms} ms, {secs} s on {}",
                name(kind)
            );
            results.push(deltas(kind, n, stream_delay_ms, secs).await);
        }
        push_fanout(
            &mut rows,
            &format!("delta spread after 1st receipt, {n} subs"),
            "deltas/s",
            &results,
        );
    }

    eprintln!("catch-up: {catchup} persisted events on Tether");
    let c = catch_up(catchup).await;
    let mut r = row(
        format!("catch-up: subscribe → {catchup}th persisted event"),
        c.ms,
        None,
        "ms",
    );
    if c.received < catchup {
        r.note = format!("only {} arrived", c.received);
    }
    r.note = [r.note, format!("filled in {:.1} s", c.fill_secs)]
        .iter()
        .filter(|s| !s.is_empty())
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    rows.push(r);
    rows.push(row(
        format!("catch-up: server CPU, {catchup} events"),
        c.cpu,
        None,
        "s",
    ));

    println!(
        "\nsubscriptions bench{}: {} cores, both servers and this client on one machine, {:.0} s",
        if quick { " (quick)" } else { "" },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        bench_start.elapsed().as_secs_f64()
    );
    print_table(&rows, reference);
}

fn name(kind: Kind) -> &'static str {
    match kind {
        Kind::Tether => "Tether",
        Kind::Reference => "the reference",
    }
}

fn push_fanout(rows: &mut Vec<Row>, what: &str, rate_unit: &'static str, results: &[Fanout]) {
    let r = results.get(1);
    rows.push(row(
        format!("{what}: p50"),
        results[0].p50,
        r.map(|r| r.p50),
        "ms",
    ));
    rows.push(row(
        format!("{what}: p99"),
        results[0].p99,
        r.map(|r| r.p99),
        "ms",
    ));
    let mut delivered = row(
        format!("{what}: delivered"),
        results[0].rate,
        r.map(|r| r.rate),
        rate_unit,
    );
    let lost = |f: &Fanout| {
        if f.delivered < f.expected {
            format!("{} of {}", f.delivered, f.expected)
        } else {
            "all".to_owned()
        }
    };
    delivered.note = match r {
        Some(r) => format!("Tether {}, reference {}", lost(&results[0]), lost(r)),
        None => format!("Tether {}", lost(&results[0])),
    };
    rows.push(delivered);
    rows.push(row(
        format!("{what}: server CPU"),
        results[0].cpu,
        r.map(|r| r.cpu),
        "s",
    ));
    rows.push(row(
        format!("{what}: bench client CPU"),
        results[0].client_cpu,
        r.map(|r| r.client_cpu),
        "s",
    ));
}
