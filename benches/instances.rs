//! Several `tether` processes on one PostgreSQL: what `NOTIFY` costs a
//! committing transaction, and runs at 1, 2 and 3 worker instances behind
//! one API instance, beside the database's own commit ceiling measured by
//! pgbench in the same run. Prints one table; asserts only that runs
//! complete.
//!
//! `TETHER_BENCH_DATABASE_URL=postgres://…/tether_bench cargo bench --bench
//! instances`: that database is created when missing and EMPTIED (its
//! `public` schema dropped) first. Without it, the bench says so and stops.
//! `TETHER_BENCH_QUICK=1` runs smaller sizes. Needs `pgbench` on the PATH.
//!
//! 1. NOTIFY: pgbench at 1, 2 and 4 clients, each transaction one
//!    one-row INSERT, then the same with `SELECT pg_notify(…)` before its
//!    COMMIT (as every Tether write transaction does), with one listening
//!    connection per client draining the notifications;
//! 2. runs: an API process (`--role api`) and 1, 2 or 3 worker processes
//!    (`--role worker`), the real release binary, 16 clients each with its
//!    conversation and subscription on the API, sending one message after
//!    another. Every event the clients see crossed processes, so the time
//!    from a run's `run.completed` commit (its `at`) to its delivery is the
//!    fan-out latency between instances.

mod common;

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::{SinkExt, StreamExt};
use sea_orm::sqlx::postgres::PgListener;
use sea_orm::{ConnectionTrait, Database};
use serde_json::{Value, json};
use tether::api::auth::Authenticator;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::Barrier;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use uuid::Uuid;

use common::{count, p50_p99, prepare_postgres};

const SECRET: &str = "bench-secret-of-at-least-32-bytes";
const CLIENTS: usize = 16;

const CONFIG: &str = r#"
[runtime]
concurrency = 32
max_waiting_runs_per_principal = 0
poll_ms = 1000
checkpoint_ms = 250

# The bench's clients send as fast as runs go: no rate limits.
[api]
messages_per_minute = 0
tenant_messages_per_minute = 0
conversations_per_minute = 0
tenant_conversations_per_minute = 0
max_subscriptions_per_principal = 100000
max_subscriptions_per_tenant = 100000
max_sockets_per_principal = 60000
max_sockets_per_tenant = 60000

[[agents]]
name = "demo"
provider = "scripted"
stream_delay_ms = 0
"#;

const SUBSCRIBE: &str = "subscription($c: ID!, $a: String) { conversationEvents(conversationId: $c, after: $a) { type runId ... on RunEvent { at } } }";
const SEND: &str = "mutation($c: ID!, $t: String!) { sendMessage(input: {conversationId: $c, text: $t}) { run { id } } }";

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let Ok(url) = std::env::var("TETHER_BENCH_DATABASE_URL") else {
        println!("instances: set TETHER_BENCH_DATABASE_URL to a scratch PostgreSQL database");
        return;
    };
    let quick = std::env::var("TETHER_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let period = Duration::from_secs(if quick { 2 } else { 5 });
    let messages = if quick { 8 } else { 25 };
    prepare_postgres(&url).await;
    let dir = std::env::temp_dir().join(format!("tether-instances-{}", Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).unwrap();

    eprintln!("NOTIFY: pgbench at 1, 2 and 4 clients");
    let notify = notify_cost(&url, &dir, period).await;

    let mut levels = Vec::new();
    for workers in 1..=3 {
        eprintln!("runs: {workers} worker instance(s), {CLIENTS} clients × {messages}");
        levels.push(runs(&url, &dir, workers, messages).await);
    }
    let _ = std::fs::remove_dir_all(dir);

    let ceiling = notify[0].plain;
    println!();
    println!(
        "## Several instances on PostgreSQL: {} run",
        if quick { "quick" } else { "full" }
    );
    println!();
    println!("| figure | measured | of ceiling |");
    println!("|---|---|---|");
    println!(
        "| ceiling: pgbench, one-row INSERT transactions/s, 1 client | {} | 1.00 |",
        count(ceiling)
    );
    for n in &notify {
        println!(
            "| transactions/s at {} client{}: without / with NOTIFY | {} / {} ({:.2}×) | {:.2} / {:.2} |",
            n.clients,
            if n.clients == 1 { "" } else { "s" },
            count(n.plain),
            count(n.notified),
            n.notified / n.plain,
            n.plain / ceiling,
            n.notified / ceiling
        );
    }
    for level in &levels {
        let rps = level.runs as f64 / level.elapsed.as_secs_f64();
        println!(
            "| runs/s, {} worker instance{} ({} runs) | {} | {:.2} |",
            level.workers,
            if level.workers == 1 { "" } else { "s" },
            level.runs,
            count(rps),
            rps / ceiling
        );
        println!(
            "|   run.completed p50 / p99 after sendMessage | {} | |",
            p50_p99(&level.completed)
        );
        println!(
            "|   fan-out: run.completed committed (`at`) → delivered on the API instance, p50 / p99 | {} | |",
            p50_p99(&level.fan_out)
        );
    }
    println!();
    println!(
        "pgbench -n -T {} (-c/-j as the clients); runs: scripted model, stream_delay_ms = 0, \
         runtime.concurrency = 32 per worker instance; the clients, the API instance, the \
         workers and PostgreSQL share this machine's cores. Fan-out is measured against \
         the event's `at` (milliseconds, set just before its commit).",
        period.as_secs()
    );
}

// ---------------------------------------------------------------- NOTIFY

struct NotifyCost {
    clients: usize,
    plain: f64,
    notified: f64,
}

async fn notify_cost(url: &str, dir: &std::path::Path, period: Duration) -> Vec<NotifyCost> {
    let db = Database::connect(url).await.unwrap();
    db.execute_unprepared(
        "DROP TABLE IF EXISTS bench_notify; \
         CREATE TABLE bench_notify (id BIGSERIAL PRIMARY KEY, at BIGINT NOT NULL)",
    )
    .await
    .unwrap();
    let plain = dir.join("plain.sql");
    let notified = dir.join("notify.sql");
    std::fs::write(
        &plain,
        "BEGIN;\nINSERT INTO bench_notify (at) VALUES (1);\nCOMMIT;\n",
    )
    .unwrap();
    std::fs::write(
        &notified,
        "BEGIN;\nINSERT INTO bench_notify (at) VALUES (1);\n\
         SELECT pg_notify('tether_bench', 'origin:conversation');\nCOMMIT;\n",
    )
    .unwrap();
    let mut costs = Vec::new();
    for clients in [1, 2, 4] {
        let without = pgbench(url, &plain, clients, period).await;
        // One listener per client, as each instance has one.
        let mut listeners = Vec::new();
        for _ in 0..clients {
            let mut listener = PgListener::connect(url).await.unwrap();
            listener.listen("tether_bench").await.unwrap();
            listeners.push(tokio::spawn(async move {
                while listener.recv().await.is_ok() {}
            }));
        }
        let with = pgbench(url, &notified, clients, period).await;
        for listener in listeners {
            listener.abort();
        }
        costs.push(NotifyCost {
            clients,
            plain: without,
            notified: with,
        });
    }
    db.execute_unprepared("DROP TABLE bench_notify")
        .await
        .unwrap();
    costs
}

/// Transactions per second pgbench reports for `script`.
async fn pgbench(url: &str, script: &std::path::Path, clients: usize, period: Duration) -> f64 {
    let output = Command::new("pgbench")
        .args(["-n", "-T", &period.as_secs().to_string()])
        .args(["-c", &clients.to_string(), "-j", &clients.to_string()])
        .arg("-f")
        .arg(script)
        .arg(url)
        .output()
        .await
        .expect("pgbench runs (it comes with PostgreSQL's client programs)");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "pgbench failed: {text}");
    text.lines()
        .find_map(|line| line.strip_prefix("tps = "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|tps| tps.parse().ok())
        .unwrap_or_else(|| panic!("no tps in pgbench's output: {text}"))
}

// ---------------------------------------------------------------- runs

struct Level {
    workers: usize,
    runs: usize,
    elapsed: Duration,
    completed: Vec<Duration>,
    fan_out: Vec<Duration>,
}

/// Starts `tether serve --role ROLE` on the database; returns it and its
/// address.
async fn start(url: &str, config: &std::path::Path, role: &str) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(["serve", "--role", role])
        .env("TETHER_DATABASE_URL", url)
        .env("TETHER_CONFIG", config)
        .env("TETHER_LISTEN", "127.0.0.1:0")
        .env("TETHER_JWT_SECRET", SECRET)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines.next_line().await.unwrap().expect("tether starts");
    let addr = line
        .strip_prefix("tether listening on http://")
        .unwrap_or_else(|| panic!("unexpected first line: {line}"))
        .to_owned();
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, addr)
}

async fn runs(url: &str, dir: &std::path::Path, workers: usize, messages: usize) -> Level {
    let config = dir.join("tether.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let (_api, addr) = start(url, &config, "api").await;
    let mut instances = Vec::new();
    for _ in 0..workers {
        instances.push(start(url, &config, "worker").await.0);
    }
    let auth = Arc::new(Authenticator::new(SECRET).unwrap());
    // Warm up: connections, prepared statements, the listeners.
    closed_loop(&addr, &auth, 4, 3).await;
    let (elapsed, samples) = closed_loop(&addr, &auth, CLIENTS, messages).await;
    let mut completed: Vec<Duration> = samples.iter().map(|s| s.0).collect();
    let mut fan_out: Vec<Duration> = samples.iter().map(|s| s.1).collect();
    completed.sort();
    fan_out.sort();
    Level {
        workers,
        runs: samples.len(),
        elapsed,
        completed,
        fan_out,
    }
}

/// Milliseconds since the Unix epoch, by this machine's clock (the one the
/// instances stamp events with).
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// `clients` clients send `messages` messages each, one after another;
/// returns the time it took and, per run, sendMessage → run.completed and
/// the run.completed commit → its delivery.
async fn closed_loop(
    addr: &str,
    auth: &Arc<Authenticator>,
    clients: usize,
    messages: usize,
) -> (Duration, Vec<(Duration, Duration)>) {
    let ready = Arc::new(Barrier::new(clients + 1));
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let (addr, auth, ready) = (addr.to_owned(), auth.clone(), ready.clone());
            tokio::spawn(async move {
                tether::providers::http::install_tls();
                let token = auth
                    .mint("bench", &format!("client-{i}"), Duration::from_secs(3600))
                    .unwrap();
                let http = reqwest::Client::new();
                let gql = |query: &'static str, variables: Value| {
                    let request = http
                        .post(format!("http://{addr}/graphql"))
                        .bearer_auth(&token)
                        .json(&json!({ "query": query, "variables": variables }));
                    async move {
                        let body: Value = request.send().await.unwrap().json().await.unwrap();
                        assert!(body.get("errors").is_none(), "{body}");
                        body["data"].clone()
                    }
                };
                let conversation = gql(
                    "mutation { createConversation(input: {}) { id } }",
                    json!({}),
                )
                .await["createConversation"]["id"]
                    .as_str()
                    .unwrap()
                    .to_owned();
                let mut socket = subscribe(&addr, &token, &conversation).await;
                ready.wait().await;
                let mut samples = Vec::with_capacity(messages);
                for m in 0..messages {
                    let sent = Instant::now();
                    let data = gql(
                        SEND,
                        json!({ "c": conversation, "t": format!("message {m}") }),
                    )
                    .await;
                    let run = data["sendMessage"]["run"]["id"]
                        .as_str()
                        .unwrap()
                        .to_owned();
                    loop {
                        let frame = tokio::time::timeout(Duration::from_secs(60), socket.next())
                            .await
                            .expect("an event within a minute")
                            .expect("the subscription stays open")
                            .unwrap();
                        let Message::Text(text) = frame else { continue };
                        let received = now_ms();
                        let message: Value = serde_json::from_str(&text).unwrap();
                        let event = &message["payload"]["data"]["conversationEvents"];
                        if event["runId"] != run.as_str() {
                            continue;
                        }
                        match event["type"].as_str() {
                            Some("run.completed") => {
                                let at = chrono::DateTime::parse_from_rfc3339(
                                    event["at"].as_str().unwrap(),
                                )
                                .unwrap()
                                .timestamp_millis();
                                let fan_out = Duration::from_millis((received - at).max(0) as u64);
                                samples.push((sent.elapsed(), fan_out));
                                break;
                            }
                            Some("run.failed" | "run.cancelled") => {
                                panic!("run {run} did not complete: {event}")
                            }
                            _ => {}
                        }
                    }
                }
                samples
            })
        })
        .collect();
    ready.wait().await;
    let started = Instant::now();
    let mut samples = Vec::new();
    for task in tasks {
        samples.extend(task.await.unwrap());
    }
    (started.elapsed(), samples)
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A `graphql-transport-ws` subscription to the conversation's events from
/// its first (so that none is missed however soon the first run ends),
/// acknowledged and started.
async fn subscribe(addr: &str, token: &str, conversation: &str) -> Socket {
    let mut request = format!("ws://{addr}/graphql")
        .into_client_request()
        .unwrap();
    request.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        HeaderValue::from_static("graphql-transport-ws"),
    );
    let (mut socket, _) = tokio_tungstenite::connect_async(request).await.unwrap();
    let init = json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {token}") } });
    socket
        .send(Message::Text(init.to_string().into()))
        .await
        .unwrap();
    while let Some(Ok(frame)) = socket.next().await {
        if let Message::Text(text) = frame
            && serde_json::from_str::<Value>(&text).unwrap()["type"] == "connection_ack"
        {
            break;
        }
    }
    let subscribe = json!({ "id": "1", "type": "subscribe", "payload": { "query": SUBSCRIBE, "variables": { "c": conversation, "a": "0000000000000000" } } });
    socket
        .send(Message::Text(subscribe.to_string().into()))
        .await
        .unwrap();
    socket
}
