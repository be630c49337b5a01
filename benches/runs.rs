//! Throughput and latency of runs on the scripted model, through the real
//! HTTP and WebSocket surface of a server started in this process.
//!
//! `cargo bench --bench runs` measures SQLite; with
//! `TETHER_BENCH_DATABASE_URL=postgres://…` (a database that may be wiped)
//! it measures PostgreSQL as well. Prints figures; asserts nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tether::api::auth::Authenticator;
use tether::config::{Config, FileConfig};
use tether::server::{self, Role};
use tokio::sync::Notify;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;

/// Defaults; `TETHER_BENCH_CLIENTS` and `TETHER_BENCH_MESSAGES` override.
const CLIENTS: usize = 16;
const MESSAGES: usize = 25;

fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
const SECRET: &str = "bench-secret-of-at-least-32-bytes";

const CONFIG: &str = r#"
[runtime]
concurrency = 32
poll_ms = 1000

[api]
max_query_depth = 16

[[agents]]
name = "demo"
provider = "scripted"
stream_delay_ms = 0
"#;

#[derive(Default)]
struct Seen {
    first_delta: HashMap<String, Instant>,
    completed: HashMap<String, Instant>,
}

struct Sample {
    answered: Duration,
    first_delta: Duration,
    completed: Duration,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let dir = std::env::temp_dir().join(format!("tether-bench-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let sqlite = format!("sqlite://{}?mode=rwc", dir.join("bench.db").display());
    bench("SQLite", &sqlite).await;
    if let Ok(url) = std::env::var("TETHER_BENCH_DATABASE_URL") {
        bench("PostgreSQL", &url).await;
    }
    let _ = std::fs::remove_dir_all(dir);
}

async fn bench(label: &str, url: &str) {
    let config = Config {
        database_url: url.to_owned(),
        listen: "127.0.0.1:0".parse().unwrap(),
        jwt_secret: Some(SECRET.to_owned()),
        encryption_key: None,
        file: FileConfig::from_toml(CONFIG).unwrap(),
    };
    let running = server::start(config, Role::All).await.unwrap();
    let addr = running.addr.to_string();
    let auth = Arc::new(Authenticator::new(SECRET).unwrap());

    // Warm up connections and caches.
    client(&addr, &auth, usize::MAX, 3).await;

    let (clients, messages) = (
        setting("TETHER_BENCH_CLIENTS", CLIENTS),
        setting("TETHER_BENCH_MESSAGES", MESSAGES),
    );
    let writes_before = running.store.write_transactions();
    let started = Instant::now();
    let clients: Vec<_> = (0..clients)
        .map(|i| {
            let (addr, auth) = (addr.clone(), auth.clone());
            tokio::spawn(async move { client(&addr, &auth, i, messages).await })
        })
        .collect();
    let mut samples = Vec::new();
    for c in clients {
        samples.extend(c.await.unwrap());
    }
    let elapsed = started.elapsed();
    let writes = running.store.write_transactions() - writes_before;
    running.shutdown().await;

    let runs = samples.len();
    let mut answered: Vec<Duration> = samples.iter().map(|s| s.answered).collect();
    let mut first: Vec<Duration> = samples.iter().map(|s| s.first_delta).collect();
    let mut done: Vec<Duration> = samples.iter().map(|s| s.completed).collect();
    answered.sort();
    first.sort();
    done.sort();
    println!(
        "{label}: {} clients × {} messages, scripted model, stream_delay_ms = 0",
        setting("TETHER_BENCH_CLIENTS", CLIENTS),
        setting("TETHER_BENCH_MESSAGES", MESSAGES)
    );
    println!("  runs completed           {runs}");
    println!("  wall time                {:.3} s", elapsed.as_secs_f64());
    println!(
        "  runs per second          {:.0}",
        runs as f64 / elapsed.as_secs_f64()
    );
    println!(
        "  sendMessage → its response       p50 {:>8.2} ms   p99 {:>8.2} ms",
        ms(percentile(&answered, 50)),
        ms(percentile(&answered, 99))
    );
    println!(
        "  sendMessage → first part.delta   p50 {:>8.2} ms   p99 {:>8.2} ms",
        ms(percentile(&first, 50)),
        ms(percentile(&first, 99))
    );
    println!(
        "  sendMessage → run.completed      p50 {:>8.2} ms   p99 {:>8.2} ms",
        ms(percentile(&done, 50)),
        ms(percentile(&done, 99))
    );
    println!(
        "  write transactions per run       {:.2} (sendMessage included)",
        writes as f64 / runs as f64
    );
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    let index = ((sorted.len() * p).div_ceil(100)).saturating_sub(1);
    sorted[index.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One client: a conversation, a subscription, and `messages` messages sent
/// one after another, each waited for until its run completed.
async fn client(addr: &str, auth: &Authenticator, index: usize, messages: usize) -> Vec<Sample> {
    let token = auth
        .mint(
            "bench",
            &format!("client-{index}"),
            Duration::from_secs(3600),
        )
        .expect("the bench secret signs");
    let http = {
        tether::providers::http::install_tls();
        reqwest::Client::new()
    };
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
    let subscribe = json!({
        "id": "1",
        "type": "subscribe",
        "payload": {
            "query": "subscription($c: ID!) { conversationEvents(conversationId: $c, after: \"0000000000000000\") { type runId } }",
            "variables": { "c": conversation },
        },
    });
    socket
        .send(Message::Text(subscribe.to_string().into()))
        .await
        .unwrap();

    let seen = Arc::new(Mutex::new(Seen::default()));
    let changed = Arc::new(Notify::new());
    let reader = {
        let (seen, changed) = (seen.clone(), changed.clone());
        tokio::spawn(async move {
            while let Some(Ok(frame)) = socket.next().await {
                let Message::Text(text) = frame else { continue };
                let now = Instant::now();
                let message: Value = serde_json::from_str(&text).unwrap();
                let event = &message["payload"]["data"]["conversationEvents"];
                let Some(run) = event["runId"].as_str() else {
                    continue;
                };
                let mut seen = seen.lock().unwrap();
                match event["type"].as_str() {
                    Some("part.delta") => {
                        seen.first_delta.entry(run.to_owned()).or_insert(now);
                    }
                    Some("run.completed") => {
                        seen.completed.insert(run.to_owned(), now);
                        changed.notify_waiters();
                    }
                    _ => {}
                }
            }
        })
    };

    let mut samples = Vec::new();
    for i in 0..messages {
        let sent = Instant::now();
        let data = gql(
            "mutation($c: ID!, $t: String!) { sendMessage(input: {conversationId: $c, text: $t}) { run { id } } }",
            json!({ "c": conversation, "t": format!("message {i} from client {index}") }),
        )
        .await;
        let answered = sent.elapsed();
        let run = data["sendMessage"]["run"]["id"]
            .as_str()
            .unwrap()
            .to_owned();
        loop {
            let notified = changed.notified();
            {
                let seen = seen.lock().unwrap();
                if let Some(done) = seen.completed.get(&run) {
                    let first = seen.first_delta.get(&run).copied().unwrap_or(*done);
                    samples.push(Sample {
                        answered,
                        first_delta: first.duration_since(sent),
                        completed: done.duration_since(sent),
                    });
                    break;
                }
            }
            tokio::time::timeout(Duration::from_secs(30), notified)
                .await
                .expect("the run completes");
        }
    }
    reader.abort();
    samples
}
