//! What document admission leaves the rest of the server while clients send
//! it the costliest documents it lets through and ones it refuses:
//! `/healthz`'s latency beside the same probe on the idle server in the
//! same run, and whether a run held meanwhile kept its lease. Prints one
//! table; asserts only that every probe was answered.
//!
//! `cargo bench --bench admission`: on an embedded SQLite file in a scratch
//! folder, or with `TETHER_BENCH_DATABASE_URL=postgres://…/tether_bench` on
//! that database, created when missing and EMPTIED first.
//! `TETHER_BENCH_QUICK=1`: shorter phases.
//!
//! The server runs in this process on a runtime built as the binary's is
//! (multi-threaded, a worker per core); the senders run on a runtime of
//! their own on another thread, and the probe on a third, so that neither
//! the server's threads nor the senders' decoding delay the probe's timer.
//! The documents:
//! - `expanding`: fragments spreading the next one twice, 12 levels deep:
//!   4,096 fields, and about 37,000 selections as admission counts them,
//!   under `max_query_nodes` (50,000): admitted, validated on the blocking
//!   pool (one at a time) and executed;
//! - `bomb`: the same 29 levels deep, refused by admission;
//! - `long`: 213 KiB of fields and fragments, parsed and validated on the
//!   blocking pool, and executed.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sea_orm::EntityTrait;
use serde_json::{Value, json};
use tether::api::auth::Authenticator;
use tether::config::{Config, FileConfig};
use tether::server::{self, Role};
use tether::store::entities::run;

use common::{count, millis, p50_p99, percentile, prepare_postgres};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SECRET: &str = "bench-secret-of-at-least-32-bytes";
/// Clients sending documents at once, each one after another.
const SENDERS: usize = 8;
/// How often the probe asks `/healthz`.
const PROBE_EVERY: Duration = Duration::from_millis(10);

const CONFIG: &str = r#"
default_agent = "demo"

[runtime]
lease_secs = 3
heartbeat_secs = 0.5
max_waiting_runs_per_principal = 0

[api]
messages_per_minute = 0
tenant_messages_per_minute = 0
conversations_per_minute = 0
tenant_conversations_per_minute = 0

[[agents]]
name = "demo"
provider = "scripted"
"#;

/// `{ ...F0 }` and fragments each spreading the next one twice.
fn doubling(levels: usize) -> String {
    let mut query = format!("{{ ...F0 }} fragment F{levels} on Query {{ __typename }}");
    for level in 0..levels {
        query.push_str(&format!(
            " fragment F{level} on Query {{ ...F{next} ...F{next} }}",
            next = level + 1
        ));
    }
    query
}

/// About 213 KiB: fragments of many fields each, all spread.
fn long_document() -> String {
    let fields = "__type(name: \"ConversationEvent\") { name } ".repeat(50);
    let mut query = String::from("{ __typename");
    let mut fragments = String::new();
    for i in 0..100 {
        query.push_str(&format!(" ...L{i}"));
        fragments.push_str(&format!(" fragment L{i} on Query {{ {fields} }}"));
    }
    query.push_str(" }");
    query + &fragments
}

#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
    refused: AtomicU64,
}

struct Load {
    name: &'static str,
    query: String,
    tally: Tally,
}

fn main() {
    let quick = std::env::var("TETHER_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let phase = Duration::from_secs(if quick { 3 } else { 10 });
    let server_runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!(
        "tether-admission-bench-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let database_url = match std::env::var("TETHER_BENCH_DATABASE_URL") {
        Ok(url) => {
            server_runtime.block_on(prepare_postgres(&url));
            url
        }
        Err(_) => format!("sqlite://{}?mode=rwc", dir.join("bench.db").display()),
    };
    let config = Config {
        database_url,
        listen: "127.0.0.1:0".parse().unwrap(),
        jwt_secret: Some(SECRET.to_owned()),
        encryption_key: None,
        file: FileConfig::from_toml(CONFIG).unwrap(),
    };
    let running = server_runtime
        .block_on(server::start(config, Role::All))
        .unwrap();
    tether::providers::http::install_tls();
    let client = Client {
        http: reqwest::Client::new(),
        base: format!("http://{}", running.addr),
        token: Authenticator::new(SECRET)
            .unwrap()
            .mint("bench", "ada", Duration::from_secs(3600))
            .unwrap(),
    };
    let clients = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // The clients' runtime on a thread of its own.
    let on_clients =
        |work: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>>| {
            std::thread::scope(|scope| scope.spawn(|| clients.block_on(work)).join().unwrap())
        };
    let loads = [
        ("expanding", doubling(12)),
        ("bomb", doubling(29)),
        ("long", long_document()),
    ]
    .map(|(name, query)| {
        Arc::new(Load {
            name,
            query,
            tally: Tally::default(),
        })
    });

    let mut held = uuid::Uuid::nil();
    on_clients(Box::pin(async {
        held = hold_a_run(&client, phase.as_secs() * 4 + 10).await;
    }));
    let read_held = || {
        server_runtime.block_on(async {
            run::Entity::find_by_id(held)
                .one(running.store.db())
                .await
                .unwrap()
                .expect("the held run")
        })
    };
    let claimed = read_held();
    let mut report = None;
    on_clients(Box::pin(async {
        report = Some(measure(&client, &loads, phase).await);
    }));
    let report = report.expect("measured");
    print(&report, &loads, phase, &claimed, &read_held());
    server_runtime.block_on(running.shutdown());
    let _ = std::fs::remove_dir_all(dir);
}

struct Report {
    idle: Vec<Duration>,
    loaded: Vec<Duration>,
    /// Each document alone, answered on the idle server.
    alone: Vec<(&'static str, Duration, bool)>,
}

/// Posts GraphQL requests as the bench's principal.
#[derive(Clone)]
struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Client {
    fn post(&self, query: &str, variables: Value) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}/graphql", self.base))
            .bearer_auth(&self.token)
            .json(&json!({ "query": query, "variables": variables }))
    }

    async fn gql(&self, query: &str, variables: Value) -> Value {
        answer(self.post(query, variables)).await
    }

    /// The data of a request that must succeed.
    async fn data(&self, query: &str, variables: Value) -> Value {
        let answer = self.gql(query, variables).await;
        assert!(answer.get("errors").is_none(), "{answer}");
        answer["data"].clone()
    }
}

/// The JSON answer to a request.
async fn answer(request: reqwest::RequestBuilder) -> Value {
    request.send().await.unwrap().json().await.unwrap()
}

/// A run of `/hold SECONDS`, once it is running under its lease.
async fn hold_a_run(client: &Client, seconds: u64) -> uuid::Uuid {
    let conversation = client
        .data(
            "mutation { createConversation(input: {}) { id } }",
            json!({}),
        )
        .await["createConversation"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let sent = client
        .data(
            "mutation($c: ID!, $t: String!) { sendMessage(input: {conversationId: $c, text: $t}) { run { id } } }",
            json!({ "c": conversation, "t": format!("/hold {seconds}") }),
        )
        .await;
    let held = sent["sendMessage"]["run"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    loop {
        let run = client
            .data(
                "query($r: ID!) { run(id: $r) { status } }",
                json!({ "r": held }),
            )
            .await;
        if run["run"]["status"] == "RUNNING" {
            return held.parse().unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn measure(client: &Client, loads: &[Arc<Load>], phase: Duration) -> Report {
    let mut alone = Vec::new();
    for load in loads {
        let started = Instant::now();
        let answer = client.gql(&load.query, json!({})).await;
        alone.push((load.name, started.elapsed(), answer.get("errors").is_none()));
    }

    let idle = probe_apart(client, phase).await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut senders = Vec::new();
    for i in 0..SENDERS {
        let load = loads[i % loads.len()].clone();
        let request = client.post(&load.query, json!({}));
        let stop = stop.clone();
        senders.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let answer = answer(request.try_clone().unwrap()).await;
                let counter = match answer.get("errors") {
                    None => &load.tally.admitted,
                    Some(_) => &load.tally.refused,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let loaded = probe_apart(client, phase).await;
    stop.store(true, Ordering::Relaxed);
    for sender in senders {
        sender.await.unwrap();
    }
    Report {
        idle,
        loaded,
        alone,
    }
}

/// `probe` on a thread and runtime of its own, apart from the senders', with
/// connections of its own (a connection belongs to the runtime that made it).
async fn probe_apart(client: &Client, phase: Duration) -> Vec<Duration> {
    let client = Client {
        http: reqwest::Client::new(),
        ..client.clone()
    };
    tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(probe(&client, phase))
    })
    .await
    .unwrap()
}

/// `/healthz` every `PROBE_EVERY` for `phase`; each answer's latency.
async fn probe(client: &Client, phase: Duration) -> Vec<Duration> {
    let until = Instant::now() + phase;
    let mut latencies = Vec::new();
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while Instant::now() < until {
        tick.tick().await;
        let started = Instant::now();
        let status = client
            .http
            .get(format!("{}/healthz", client.base))
            .send()
            .await
            .unwrap()
            .status();
        assert!(status.is_success(), "/healthz answered {status}");
        latencies.push(started.elapsed());
    }
    latencies.sort();
    latencies
}

fn print(
    report: &Report,
    loads: &[Arc<Load>],
    phase: Duration,
    claimed: &run::Model,
    held: &run::Model,
) {
    let row = |label: &str, sorted: &[Duration]| {
        println!(
            "| {label} | {} | {} | {} | {} |",
            count(sorted.len() as f64),
            p50_p99(sorted),
            millis(*sorted.last().unwrap_or(&Duration::ZERO)),
            format_args!(
                "{:.2}",
                common::ms(percentile(sorted, 99)) / common::ms(percentile(&report.idle, 99))
            ),
        )
    };
    println!();
    println!(
        "admission: /healthz every {} ms for {} s, idle and then while {SENDERS} clients send documents",
        PROBE_EVERY.as_millis(),
        phase.as_secs()
    );
    println!();
    println!("| /healthz | probes | p50 / p99 | max ms | p99 / idle p99 |");
    println!("|---|---|---|---|---|");
    row("idle", &report.idle);
    row("under load", &report.loaded);
    println!();
    println!("| document | bytes | alone, ms | answered | under load: admitted/s | refused/s |");
    println!("|---|---|---|---|---|---|");
    for (load, (name, took, admitted)) in loads.iter().zip(&report.alone) {
        let per_sec = |n: &AtomicU64| n.load(Ordering::Relaxed) as f64 / phase.as_secs_f64();
        println!(
            "| {name} | {} | {} | {} | {:.1} | {:.1} |",
            count(load.query.len() as f64),
            millis(*took),
            if *admitted { "data" } else { "refused" },
            per_sec(&load.tally.admitted),
            per_sec(&load.tally.refused),
        );
    }
    println!();
    let kept =
        held.status == "RUNNING" && held.recoveries == 0 && held.lease_epoch == claimed.lease_epoch;
    println!(
        "held run (a 3 s lease renewed every 0.5 s): {}, {} recoveries, lease epoch {} → {}: {}",
        held.status,
        held.recoveries,
        claimed.lease_epoch,
        held.lease_epoch,
        if kept {
            "kept its lease"
        } else {
            "LOST its lease"
        }
    );
}
