//! Runs end to end on the scripted model, through the real HTTP and
//! WebSocket surface of a server started in this process, and the commit
//! ceiling of the database beside them. One table per backend.
//!
//! `cargo bench --bench runs` measures SQLite (a fresh file); with
//! `TETHER_BENCH_DATABASE_URL=postgres://…/tether_bench` it measures
//! PostgreSQL as well: that database is created when missing and EMPTIED
//! (its `public` schema dropped) first. `TETHER_BENCH_QUICK=1` runs smaller
//! sizes. Prints figures; asserts only that runs do what they should.
//!
//! The scenarios (docs/benchmark.md says more):
//! 1. closed loop at 1, 16 and 64 clients (`TETHER_BENCH_CLIENTS`), each
//!    client its own conversation and subscription, sending its messages
//!    (`TETHER_BENCH_MESSAGES` each) one after another;
//! 2. one run streaming 10,000 tokens (`/stream 10000`);
//! 3. a run in a conversation that already holds 10, 1,000 and 10,000
//!    messages, seeded with rows copied from a real exchange;
//! 4. pause to resume: `decideApproval` and `answerQuestion` to
//!    `run.completed`;
//! 5. the ceiling: one-row insert transactions per second, one writer, on a
//!    scratch SQLite file (WAL, `synchronous = NORMAL`) or a scratch table of
//!    the PostgreSQL database.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::{SinkExt, StreamExt};
use sea_orm::sea_query::Expr;
use sea_orm::sqlx::sqlite::{SqliteJournalMode, SqliteSynchronous};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectOptions, ConnectionTrait, Database, DatabaseConnection,
    EntityTrait, QueryFilter, QueryOrder, SqliteTransactionMode, Statement, TransactionOptions,
    TransactionTrait,
};
use serde_json::{Value, json};
use tether::api::auth::Authenticator;
use tether::config::{Config, FileConfig};
use tether::server::{self, Role, Running};
use tether::store::entities::{conversation, event, message, part, run, run_audit};
use tokio::sync::{Barrier, Notify};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use uuid::Uuid;

use common::{count, millis, ms, p50_p99, percentile, prepare_postgres};

/// The allocator of the `tether` binary, so the server in this process
/// allocates as it does in production.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SECRET: &str = "bench-secret-of-at-least-32-bytes";
const CHECKPOINT_MS: u64 = 250;
const CONCURRENCY: usize = 32;
/// The context budget of the agent the history scenario runs.
const HISTORY_BUDGET_TOKENS: u64 = 20_000;

fn config_toml() -> String {
    format!(
        r#"
[runtime]
concurrency = {CONCURRENCY}
max_waiting_runs_per_principal = 0
poll_ms = 1000
checkpoint_ms = {CHECKPOINT_MS}

[api]
max_query_depth = 16
# The bench's clients send as fast as runs go: no rate limits.
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

# Long histories are compacted, as a real conversation of 10,000 messages
# (far past any model's window) would have been: a budget that the seeded
# 10,000 messages exceed and 1,000 do not.
[[agents]]
name = "long"
provider = "scripted"
stream_delay_ms = 0
context = {{ budget_tokens = {HISTORY_BUDGET_TOKENS} }}

[[agents]]
name = "gated"
provider = "scripted"
stream_delay_ms = 0
tools = ["ask_questions", "demo_publish"]
"#
    )
}

/// The longest wait for one event of a run.
const WAIT: Duration = Duration::from_secs(60);
/// A cursor before every event.
const START: &str = "0000000000000000";

const SUBSCRIBE: &str = "subscription($c: ID!, $a: String) { conversationEvents(conversationId: $c, after: $a) { type runId } }";
const SUBSCRIBE_WITH_TEXT: &str = "subscription($c: ID!, $a: String) { conversationEvents(conversationId: $c, after: $a) { type runId ... on PartDelta { text } } }";
const SEND: &str = "mutation($c: ID!, $t: String!) { sendMessage(input: {conversationId: $c, text: $t}) { run { id } } }";
const APPROVAL_POLL: &str =
    "query($r: ID!) { run(id: $r) { status } pendingApproval(runId: $r) { interactionId } }";
const QUESTION_POLL: &str =
    "query($r: ID!) { run(id: $r) { status } pendingQuestion(runId: $r) { interactionId } }";
const DECIDE: &str = "mutation($i: ID!) { decideApproval(input: {interactionId: $i, decision: ALLOW_ONCE}) { resumed } }";
const ANSWER: &str = "mutation($i: ID!, $a: [QuestionAnswerInput!]!) { answerQuestion(input: {interactionId: $i, answers: $a}) { resumed } }";

/// How much of everything; `TETHER_BENCH_QUICK=1` for the small version.
struct Sizes {
    quick: bool,
    /// (clients, messages each)
    levels: Vec<(usize, usize)>,
    stream_tokens: usize,
    stream_runs: usize,
    histories: Vec<usize>,
    history_runs: usize,
    pauses: usize,
    ceiling_for: Duration,
}

impl Sizes {
    fn from_env() -> Sizes {
        let quick = std::env::var("TETHER_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
        let clients: Vec<usize> = std::env::var("TETHER_BENCH_CLIENTS")
            .ok()
            .map(|v| v.split(',').filter_map(|c| c.trim().parse().ok()).collect())
            .filter(|c: &Vec<usize>| !c.is_empty() && !c.contains(&0))
            .unwrap_or_else(|| vec![1, 16, 64]);
        let messages = std::env::var("TETHER_BENCH_MESSAGES")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|m| *m > 0);
        let levels = clients
            .into_iter()
            .map(|c| {
                let each = messages.unwrap_or(if quick {
                    (240 / c).clamp(4, 100)
                } else {
                    // 25 each at 16 and 64 clients, the size the figures
                    // of earlier sessions were measured at.
                    (400 / c).clamp(25, 200)
                });
                (c, each)
            })
            .collect();
        Sizes {
            quick,
            levels,
            stream_tokens: 10_000,
            stream_runs: if quick { 2 } else { 5 },
            histories: vec![10, 1_000, 10_000],
            history_runs: if quick { 5 } else { 20 },
            pauses: if quick { 15 } else { 50 },
            ceiling_for: Duration::from_secs(if quick { 1 } else { 3 }),
        }
    }
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let sizes = Sizes::from_env();
    let dir = std::env::temp_dir().join(format!("tether-bench-{}", Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let sqlite = format!("sqlite://{}?mode=rwc", dir.join("bench.db").display());
    let scratch = format!("sqlite://{}?mode=rwc", dir.join("ceiling.db").display());
    bench("SQLite", &sqlite, &scratch, &sizes).await;
    if let Ok(url) = std::env::var("TETHER_BENCH_DATABASE_URL") {
        prepare_postgres(&url).await;
        bench("PostgreSQL", &url, &url, &sizes).await;
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Everything measured on one backend.
struct Figures {
    ceiling: f64,
    levels: Vec<Level>,
    streams: Vec<StreamSample>,
    histories: Vec<HistoryResult>,
    approvals: PauseResult,
    questions: PauseResult,
    settings: String,
    took: Duration,
}

async fn bench(label: &str, url: &str, scratch: &str, sizes: &Sizes) {
    let began = Instant::now();
    eprintln!("{label}: commit ceiling");
    let (ceiling, settings) = ceiling(scratch, sizes.ceiling_for).await;

    let config = Config {
        database_url: url.to_owned(),
        listen: "127.0.0.1:0".parse().unwrap(),
        jwt_secret: Some(SECRET.to_owned()),
        encryption_key: None,
        file: FileConfig::from_toml(&config_toml()).unwrap(),
    };
    let running = server::start(config, Role::All).await.unwrap();
    let auth = Arc::new(Authenticator::new(SECRET).unwrap());

    // Warm up connections and caches.
    closed_loop(&running, &auth, 4, 5).await;

    let mut levels = Vec::new();
    for &(clients, messages) in &sizes.levels {
        eprintln!("{label}: {clients} clients × {messages} messages");
        levels.push(closed_loop(&running, &auth, clients, messages).await);
    }

    eprintln!(
        "{label}: {} runs of /stream {}",
        sizes.stream_runs, sizes.stream_tokens
    );
    let mut streams = Vec::new();
    for _ in 0..sizes.stream_runs {
        streams.push(long_stream(&running, &auth, sizes.stream_tokens).await);
    }

    let template = template(&running, &auth).await;
    let mut histories = Vec::new();
    for &messages in &sizes.histories {
        eprintln!("{label}: {messages} messages of history");
        histories.push(history(&running, &auth, &template, messages, sizes.history_runs).await);
    }

    eprintln!(
        "{label}: {} approvals, {} questions",
        sizes.pauses, sizes.pauses
    );
    let approvals = pauses(&running, &auth, Pause::Approval, sizes.pauses).await;
    let questions = pauses(&running, &auth, Pause::Question, sizes.pauses).await;
    running.shutdown().await;

    let figures = Figures {
        ceiling,
        levels,
        streams,
        histories,
        approvals,
        questions,
        settings,
        took: began.elapsed(),
    };
    print(label, sizes, &figures);
}

// ---------------------------------------------------------------- clients

/// What a subscriber saw of one run.
#[derive(Debug, Clone, Default)]
struct RunSeen {
    first_delta: Option<Instant>,
    last_delta: Option<Instant>,
    deltas: usize,
    delta_chars: usize,
    part_updated: usize,
    /// `approval.requested` or `question.requested`.
    paused: Option<Instant>,
    /// The final event and its type.
    ended: Option<(Instant, String)>,
}

#[derive(Default)]
struct Seen {
    runs: HashMap<String, RunSeen>,
    compactions: usize,
}

/// A `conversationEvents` subscription on a WebSocket of its own.
struct Feed {
    seen: Arc<Mutex<Seen>>,
    changed: Arc<Notify>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Feed {
    /// Waits until `done` holds for what was seen of `run`. A run that ends
    /// other than completed stops the bench.
    async fn wait(&self, run: &str, done: impl Fn(&RunSeen) -> bool) -> RunSeen {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let notified = self.changed.notified();
            {
                let seen = self.seen.lock().unwrap();
                if let Some(seen) = seen.runs.get(run) {
                    if let Some((_, kind)) = &seen.ended {
                        assert_eq!(kind, "run.completed", "run {run} did not complete");
                    }
                    if done(seen) {
                        return seen.clone();
                    }
                }
            }
            tokio::time::timeout_at(deadline, notified)
                .await
                .unwrap_or_else(|_| panic!("run {run}: nothing for {WAIT:?}"));
        }
    }

    async fn ended(&self, run: &str) -> RunSeen {
        self.wait(run, |r| r.ended.is_some()).await
    }

    fn compactions(&self) -> usize {
        self.seen.lock().unwrap().compactions
    }
}

/// A principal of tenant `bench` with its HTTP client.
struct Client {
    url: String,
    ws: String,
    token: String,
    http: reqwest::Client,
}

impl Client {
    fn new(addr: &str, auth: &Authenticator, name: &str) -> Client {
        tether::providers::http::install_tls();
        Client {
            url: format!("http://{addr}/graphql"),
            ws: format!("ws://{addr}/graphql"),
            token: auth
                .mint("bench", name, Duration::from_secs(3600))
                .expect("the bench secret signs"),
            http: reqwest::Client::new(),
        }
    }

    async fn gql(&self, query: &str, variables: Value) -> Value {
        let body: Value = self
            .http
            .post(&self.url)
            .bearer_auth(&self.token)
            .json(&json!({ "query": query, "variables": variables }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert!(body.get("errors").is_none(), "{body}");
        body["data"].clone()
    }

    async fn conversation(&self, agent: &str) -> String {
        self.gql(
            "mutation($a: String) { createConversation(input: {agent: $a}) { id } }",
            json!({ "a": agent }),
        )
        .await["createConversation"]["id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    async fn last_cursor(&self, conversation: &str) -> String {
        self.gql(
            "query($c: ID!) { conversation(id: $c) { lastCursor } }",
            json!({ "c": conversation }),
        )
        .await["conversation"]["lastCursor"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// Sends `text`: the run, the instant just before the request, and the
    /// time to the response.
    async fn send(&self, conversation: &str, text: &str) -> (String, Instant, Duration) {
        let sent = Instant::now();
        let data = self
            .gql(SEND, json!({ "c": conversation, "t": text }))
            .await;
        let answered = sent.elapsed();
        let run = data["sendMessage"]["run"]["id"]
            .as_str()
            .unwrap()
            .to_owned();
        (run, sent, answered)
    }

    /// Subscribes to the conversation's events after `after`, once the
    /// connection is acknowledged; `with_text` selects the deltas' text.
    async fn subscribe(&self, conversation: &str, after: &str, with_text: bool) -> Feed {
        let mut request = self.ws.as_str().into_client_request().unwrap();
        request.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            HeaderValue::from_static("graphql-transport-ws"),
        );
        let (mut socket, _) = tokio_tungstenite::connect_async(request).await.unwrap();
        let init = json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {}", self.token) } });
        socket
            .send(Message::Text(init.to_string().into()))
            .await
            .unwrap();
        loop {
            let Some(Ok(Message::Text(text))) = socket.next().await else {
                panic!("the socket closed before connection_ack");
            };
            if serde_json::from_str::<Value>(&text).unwrap()["type"] == "connection_ack" {
                break;
            }
        }
        let subscribe = json!({
            "id": "1",
            "type": "subscribe",
            "payload": {
                "query": if with_text { SUBSCRIBE_WITH_TEXT } else { SUBSCRIBE },
                "variables": { "c": conversation, "a": after },
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
                    if message["type"] == "error" {
                        eprintln!("  subscription error: {message}");
                        continue;
                    }
                    let event = &message["payload"]["data"]["conversationEvents"];
                    let kind = event["type"].as_str().unwrap_or_default();
                    let mut seen = seen.lock().unwrap();
                    if kind == "context.compacted" {
                        seen.compactions += 1;
                    }
                    let Some(run) = event["runId"].as_str() else {
                        continue;
                    };
                    let of_run = seen.runs.entry(run.to_owned()).or_default();
                    match kind {
                        "part.delta" => {
                            of_run.first_delta.get_or_insert(now);
                            of_run.last_delta = Some(now);
                            of_run.deltas += 1;
                            of_run.delta_chars += event["text"].as_str().map_or(0, str::len);
                            continue;
                        }
                        "part.updated" => of_run.part_updated += 1,
                        "approval.requested" | "question.requested" => {
                            of_run.paused.get_or_insert(now);
                        }
                        "run.completed" | "run.failed" | "run.cancelled" => {
                            of_run.ended = Some((now, kind.to_owned()));
                        }
                        _ => continue,
                    }
                    drop(seen);
                    changed.notify_waiters();
                }
            })
        };
        Feed {
            seen,
            changed,
            reader,
        }
    }
}

// ---------------------------------------------------------------- 1. closed loop

struct Level {
    clients: usize,
    messages: usize,
    runs: usize,
    elapsed: Duration,
    answered: Vec<Duration>,
    first_delta: Vec<Duration>,
    completed: Vec<Duration>,
    writes: u64,
    /// Queries on the main pool, and on the API's read pool.
    queries: (u64, u64),
}

impl Level {
    fn runs_per_sec(&self) -> f64 {
        self.runs as f64 / self.elapsed.as_secs_f64()
    }

    fn writes_per_run(&self) -> f64 {
        self.writes as f64 / self.runs as f64
    }
}

/// `clients` clients, each with its own conversation and subscription, set
/// up first; then, timed, each sends `messages` messages one after another,
/// each once the run of the one before completed.
async fn closed_loop(
    running: &Running,
    auth: &Arc<Authenticator>,
    clients: usize,
    messages: usize,
) -> Level {
    let addr = running.addr.to_string();
    let ready = Arc::new(Barrier::new(clients + 1));
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let (addr, auth, ready) = (addr.clone(), auth.clone(), ready.clone());
            tokio::spawn(async move {
                let client = Client::new(&addr, &auth, &format!("client-{i}"));
                let conversation = client.conversation("demo").await;
                let feed = client.subscribe(&conversation, START, false).await;
                ready.wait().await;
                let mut samples = Vec::with_capacity(messages);
                for m in 0..messages {
                    let text = format!("message {m} from client {i}");
                    let (run, sent, answered) = client.send(&conversation, &text).await;
                    let seen = feed.ended(&run).await;
                    let done = seen.ended.as_ref().unwrap().0;
                    let first = seen.first_delta.unwrap_or(done);
                    samples.push((answered, first - sent, done - sent));
                }
                samples
            })
        })
        .collect();
    ready.wait().await;
    let writes_before = running.store.write_transactions();
    let queries_before = (running.store.statements(), running.store.read_statements());
    let started = Instant::now();
    let mut samples = Vec::new();
    for task in tasks {
        samples.extend(task.await.unwrap());
    }
    let elapsed = started.elapsed();
    let writes = running.store.write_transactions() - writes_before;
    let queries = (
        running.store.statements() - queries_before.0,
        running.store.read_statements() - queries_before.1,
    );
    let mut answered: Vec<Duration> = samples.iter().map(|s| s.0).collect();
    let mut first_delta: Vec<Duration> = samples.iter().map(|s| s.1).collect();
    let mut completed: Vec<Duration> = samples.iter().map(|s| s.2).collect();
    answered.sort();
    first_delta.sort();
    completed.sort();
    Level {
        clients,
        messages,
        runs: samples.len(),
        elapsed,
        answered,
        first_delta,
        completed,
        writes,
        queries,
    }
}

// ---------------------------------------------------------------- 2. long stream

struct StreamSample {
    first_delta: Duration,
    completed: Duration,
    /// From the first delta's receipt to the last's.
    span: Duration,
    deltas: usize,
    chars: usize,
    part_updated: usize,
    writes: u64,
}

/// One `/stream N` run in a conversation of its own, its deltas' text
/// selected.
async fn long_stream(running: &Running, auth: &Authenticator, tokens: usize) -> StreamSample {
    let client = Client::new(&running.addr.to_string(), auth, "stream");
    let conversation = client.conversation("demo").await;
    let feed = client.subscribe(&conversation, START, true).await;
    let writes_before = running.store.write_transactions();
    let (run, sent, _) = client
        .send(&conversation, &format!("/stream {tokens}"))
        .await;
    let seen = feed.ended(&run).await;
    let writes = running.store.write_transactions() - writes_before;
    let done = seen.ended.as_ref().unwrap().0;
    let first = seen.first_delta.unwrap_or(done);
    StreamSample {
        first_delta: first - sent,
        completed: done - sent,
        span: seen.last_delta.unwrap_or(done) - first,
        deltas: seen.deltas,
        chars: seen.delta_chars,
        part_updated: seen.part_updated,
        writes,
    }
}

// ---------------------------------------------------------------- 3. long histories

/// The rows of one real exchange (a user message, its completed run and
/// the reply), copied to seed long histories.
struct Template {
    messages: Vec<message::Model>,
    parts: Vec<part::Model>,
    run: run::Model,
    audit: run_audit::Model,
    events: Vec<event::Model>,
}

/// One exchange through the API, read back as the server wrote it.
async fn template(running: &Running, auth: &Authenticator) -> Template {
    let client = Client::new(&running.addr.to_string(), auth, "template");
    let conversation = client.conversation("demo").await;
    let feed = client.subscribe(&conversation, START, false).await;
    let (run, _, _) = client
        .send(&conversation, "Question 0: is the harbour open?")
        .await;
    feed.ended(&run).await;
    let id = Uuid::parse_str(&conversation).unwrap();
    let db = running.store.db();
    let messages = message::Entity::find()
        .filter(message::Column::ConversationId.eq(id))
        .order_by_asc(message::Column::Id)
        .all(db)
        .await
        .unwrap();
    let parts = part::Entity::find()
        .filter(part::Column::ConversationId.eq(id))
        .order_by_asc(part::Column::Id)
        .all(db)
        .await
        .unwrap();
    let mut runs = run::Entity::find()
        .filter(run::Column::ConversationId.eq(id))
        .all(db)
        .await
        .unwrap();
    let mut audits = run_audit::Entity::find()
        .filter(run_audit::Column::ConversationId.eq(id))
        .all(db)
        .await
        .unwrap();
    let events = event::Entity::find()
        .filter(event::Column::ConversationId.eq(id))
        .order_by_asc(event::Column::Seq)
        .all(db)
        .await
        .unwrap();
    assert_eq!(
        (messages.len(), parts.len(), runs.len(), audits.len()),
        (2, 2, 1, 1),
        "a simple exchange is two messages with a text part each, a run and its audit row"
    );
    assert!(parts.iter().all(|p| p.kind == "TEXT"), "{parts:?}");
    assert_eq!(runs[0].status, "COMPLETED");
    Template {
        messages,
        parts,
        run: runs.pop().unwrap(),
        audit: audits.pop().unwrap(),
        events,
    }
}

const SEED_EXCHANGES_PER_TRANSACTION: usize = 1_000;
const SEED_ROWS_PER_INSERT: usize = 250;

fn user_text(n: usize) -> String {
    format!("Question {n}: is the harbour open?")
}

fn reply_text(n: usize) -> String {
    format!("Answer {n}: yes, until six.")
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

fn utf16_len(text: &str) -> i64 {
    text.encode_utf16().count() as i64
}

macro_rules! insert_chunks {
    ($tx:expr, $entity:ty, $rows:expr) => {
        let mut rows = $rows.into_iter().peekable();
        while rows.peek().is_some() {
            let chunk: Vec<_> = rows.by_ref().take(SEED_ROWS_PER_INSERT).collect();
            <$entity>::insert_many(chunk)
                .exec_without_returning($tx)
                .await
                .unwrap();
        }
    };
}

/// Adds `exchanges` copies of the template's exchange to the conversation,
/// each with new ids (in the template's order), its own short texts and
/// its events renumbered after the conversation's, in transactions of
/// `SEED_EXCHANGES_PER_TRANSACTION` exchanges. Returns the estimated tokens
/// of the seeded messages.
async fn seed(
    db: &DatabaseConnection,
    template: &Template,
    conversation: Uuid,
    exchanges: usize,
) -> u64 {
    let row = conversation::Entity::find_by_id(conversation)
        .one(db)
        .await
        .unwrap()
        .unwrap();
    let (mut seq, runs_before) = (row.event_seq, row.run_seq);
    let shift = now_ms() - template.run.created_at;
    let mut ids: Vec<Uuid> = template
        .messages
        .iter()
        .map(|m| m.id)
        .chain(template.parts.iter().map(|p| p.id))
        .chain([template.run.id])
        .collect();
    ids.sort();
    let mut tokens = 0;
    let mut from = 0;
    while from < exchanges {
        let to = (from + SEED_EXCHANGES_PER_TRANSACTION).min(exchanges);
        let mut messages = Vec::new();
        let mut parts = Vec::new();
        let mut runs = Vec::new();
        let mut audits = Vec::new();
        let mut events = Vec::new();
        for n in from + 1..=to {
            let map: HashMap<Uuid, Uuid> = ids.iter().map(|old| (*old, Uuid::now_v7())).collect();
            for m in &template.messages {
                let mut m = m.clone();
                m.id = map[&m.id];
                m.conversation_id = conversation;
                m.run_id = m.run_id.map(|r| map[&r]);
                m.run_seq = runs_before + n as i64;
                m.created_at += shift;
                messages.push(message::ActiveModel::from(m).reset_all());
            }
            // Part events whose length was the template's text get the new one.
            let mut lengths = HashMap::new();
            for p in &template.parts {
                let mut p = p.clone();
                let text = if p.run_id.is_none() {
                    user_text(n)
                } else {
                    reply_text(n)
                };
                tokens += (text.chars().count() as u64).div_ceil(4);
                let old = p.text.as_deref().map_or(0, utf16_len);
                p.id = map[&p.id];
                lengths.insert(p.id.to_string(), (old, utf16_len(&text)));
                p.text = Some(text);
                p.message_id = map[&p.message_id];
                p.conversation_id = conversation;
                p.run_id = p.run_id.map(|r| map[&r]);
                p.created_at += shift;
                p.updated_at += shift;
                parts.push(part::ActiveModel::from(p).reset_all());
            }
            let mut r = template.run.clone();
            r.id = map[&r.id];
            r.conversation_id = conversation;
            r.trigger_message_id = map[&r.trigger_message_id];
            r.seq = runs_before + n as i64;
            r.created_at += shift;
            r.started_at = r.started_at.map(|t| t + shift);
            r.ended_at = r.ended_at.map(|t| t + shift);
            r.claimed_at = r.claimed_at.map(|t| t + shift);
            r.next_attempt_at = r.next_attempt_at.map(|t| t + shift);
            runs.push(run::ActiveModel::from(r).reset_all());
            let mut a = template.audit.clone();
            a.run_id = map[&a.run_id];
            a.conversation_id = conversation;
            a.ended_at += shift;
            audits.push(run_audit::ActiveModel::from(a).reset_all());
            for e in &template.events {
                let mut e = e.clone();
                seq += 1;
                e.seq = seq;
                e.conversation_id = conversation;
                e.run_id = e.run_id.map(|r| map[&r]);
                e.created_at += shift;
                let mut payload = e.payload.to_string();
                for (old, new) in &map {
                    payload = payload.replace(&old.to_string(), &new.to_string());
                }
                let mut payload: Value = serde_json::from_str(&payload).unwrap();
                if let Some((old, new)) = payload["partId"]
                    .as_str()
                    .and_then(|id| lengths.get(id))
                    .copied()
                    && payload["textLength"] == old
                {
                    payload["textLength"] = new.into();
                }
                e.payload = payload;
                events.push(event::ActiveModel::from(e).reset_all());
            }
        }
        let tx = db.begin().await.unwrap();
        insert_chunks!(&tx, message::Entity, messages);
        insert_chunks!(&tx, part::Entity, parts);
        insert_chunks!(&tx, run::Entity, runs);
        insert_chunks!(&tx, run_audit::Entity, audits);
        insert_chunks!(&tx, event::Entity, events);
        conversation::Entity::update_many()
            .col_expr(conversation::Column::EventSeq, Expr::value(seq))
            .col_expr(
                conversation::Column::RunSeq,
                Expr::value(runs_before + to as i64),
            )
            .filter(conversation::Column::Id.eq(conversation))
            .exec(&tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        from = to;
    }
    tokens
}

struct HistoryResult {
    messages: usize,
    seeded_in: Duration,
    seed_tokens: u64,
    first_delta: Vec<Duration>,
    completed: Vec<Duration>,
    compactions: usize,
}

/// A conversation seeded with `messages` messages, then `runs` messages
/// sent one after another, each measured.
async fn history(
    running: &Running,
    auth: &Authenticator,
    template: &Template,
    messages: usize,
    runs: usize,
) -> HistoryResult {
    let client = Client::new(
        &running.addr.to_string(),
        auth,
        &format!("history-{messages}"),
    );
    let conversation = client.conversation("long").await;
    let started = Instant::now();
    let seed_tokens = seed(
        running.store.db(),
        template,
        Uuid::parse_str(&conversation).unwrap(),
        messages / 2,
    )
    .await;
    let seeded_in = started.elapsed();
    let cursor = client.last_cursor(&conversation).await;
    let feed = client.subscribe(&conversation, &cursor, false).await;
    let mut first_delta = Vec::new();
    let mut completed = Vec::new();
    for i in 0..runs {
        let text = format!("Question {i} after the history: what now?");
        let (run, sent, _) = client.send(&conversation, &text).await;
        let seen = feed.ended(&run).await;
        let done = seen.ended.as_ref().unwrap().0;
        first_delta.push(seen.first_delta.unwrap_or(done) - sent);
        completed.push(done - sent);
    }
    first_delta.sort();
    completed.sort();
    HistoryResult {
        messages,
        seeded_in,
        seed_tokens,
        first_delta,
        completed,
        compactions: feed.compactions(),
    }
}

// ---------------------------------------------------------------- 4. pauses

#[derive(Clone, Copy, PartialEq)]
enum Pause {
    Approval,
    Question,
}

struct PauseResult {
    samples: usize,
    /// From just before the mutation to the receipt of `run.completed`.
    resumed: Vec<Duration>,
    /// The mutation's own response time.
    response: Vec<Duration>,
    /// Write transactions and main-pool queries from just before the
    /// mutation to the receipt of `run.completed`, all samples together
    /// (the mutation's own included).
    writes: u64,
    queries: u64,
}

/// `samples` runs, one after another in one conversation of the agent with
/// tools, each parked on an approval (`/tool demo_publish`) or questions
/// (`/ask`), then resolved once the run shows it waits.
async fn pauses(
    running: &Running,
    auth: &Authenticator,
    pause: Pause,
    samples: usize,
) -> PauseResult {
    let addr = running.addr.to_string();
    let client = Client::new(&addr, auth, "pauses");
    let conversation = client.conversation("gated").await;
    let feed = client.subscribe(&conversation, START, false).await;
    let (text, poll, pending, waiting) = match pause {
        Pause::Approval => (
            "/tool demo_publish {\"text\":\"hi\"}",
            APPROVAL_POLL,
            "pendingApproval",
            "WAITING_FOR_APPROVAL",
        ),
        Pause::Question => (
            "/ask",
            QUESTION_POLL,
            "pendingQuestion",
            "WAITING_FOR_QUESTION",
        ),
    };
    let mut resumed = Vec::new();
    let mut response = Vec::new();
    let (mut writes, mut queries) = (0, 0);
    for _ in 0..samples {
        let (run, _, _) = client.send(&conversation, text).await;
        let seen = feed
            .wait(&run, |r| r.paused.is_some() || r.ended.is_some())
            .await;
        assert!(seen.ended.is_none(), "run {run} ended without pausing");
        // The run parks in its own commit after the request's.
        let polling = Instant::now();
        let interaction = loop {
            let data = client.gql(poll, json!({ "r": run })).await;
            if data["run"]["status"] == waiting
                && let Some(id) = data[pending]["interactionId"].as_str()
            {
                break id.to_owned();
            }
            assert!(polling.elapsed() < WAIT, "run {run} never waited: {data}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        let counts = (
            running.store.write_transactions(),
            running.store.statements(),
        );
        let before = Instant::now();
        let data = match pause {
            Pause::Approval => client.gql(DECIDE, json!({ "i": interaction })).await,
            Pause::Question => {
                let answers = json!([
                    { "key": "color", "values": ["blue"] },
                    { "key": "days", "values": ["mon", "wed"] },
                    { "key": "name", "values": [], "other": "Spring sale" }
                ]);
                client
                    .gql(ANSWER, json!({ "i": interaction, "a": answers }))
                    .await
            }
        };
        response.push(before.elapsed());
        let field = match pause {
            Pause::Approval => "decideApproval",
            Pause::Question => "answerQuestion",
        };
        assert_eq!(data[field]["resumed"], true, "{data}");
        let seen = feed.ended(&run).await;
        resumed.push(seen.ended.unwrap().0 - before);
        writes += running.store.write_transactions() - counts.0;
        queries += running.store.statements() - counts.1;
    }
    resumed.sort();
    response.sort();
    PauseResult {
        samples,
        resumed,
        response,
        writes,
        queries,
    }
}

// ---------------------------------------------------------------- 5. ceiling

/// One-row insert transactions per second, one writer on one connection,
/// for `period`: on SQLite a scratch file with the server's settings (WAL,
/// `synchronous = NORMAL`, `BEGIN IMMEDIATE`), on PostgreSQL a scratch
/// table. Returns the rate and the settings in words.
async fn ceiling(url: &str, period: Duration) -> (f64, String) {
    let sqlite = url.starts_with("sqlite:");
    let mut options = ConnectOptions::new(url.to_owned());
    options
        .sqlx_logging(false)
        .max_connections(1)
        .min_connections(1);
    if sqlite {
        options.map_sqlx_sqlite_opts(|o| {
            o.journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(10))
                .create_if_missing(true)
        });
    }
    let db = Database::connect(options).await.unwrap();
    let backend = db.get_database_backend();
    let (create, insert, settings) = if sqlite {
        (
            "CREATE TABLE bench_ceiling (id INTEGER PRIMARY KEY, at INTEGER NOT NULL, note TEXT NOT NULL)",
            "INSERT INTO bench_ceiling (at, note) VALUES (?, ?)",
            vec!["journal_mode", "synchronous"],
        )
    } else {
        (
            "CREATE TABLE bench_ceiling (id BIGSERIAL PRIMARY KEY, at BIGINT NOT NULL, note TEXT NOT NULL)",
            "INSERT INTO bench_ceiling (at, note) VALUES ($1, $2)",
            vec!["synchronous_commit", "fsync", "wal_sync_method"],
        )
    };
    db.execute_unprepared("DROP TABLE IF EXISTS bench_ceiling")
        .await
        .unwrap();
    db.execute_unprepared(create).await.unwrap();
    let mut said = Vec::new();
    for name in settings {
        let sql = if sqlite {
            format!("PRAGMA {name}")
        } else {
            format!("SHOW {name}")
        };
        let row = db
            .query_one_raw(Statement::from_string(backend, sql))
            .await
            .unwrap()
            .unwrap();
        let value = row
            .try_get_by_index::<String>(0)
            .or_else(|_| {
                // PRAGMA synchronous answers a number.
                row.try_get_by_index::<i64>(0).map(|v| match v {
                    0 => "OFF".to_owned(),
                    1 => "NORMAL".to_owned(),
                    2 => "FULL".to_owned(),
                    3 => "EXTRA".to_owned(),
                    v => v.to_string(),
                })
            })
            .unwrap_or_else(|_| "?".into());
        said.push(format!("{name} = {value}"));
    }
    let started = Instant::now();
    let mut commits = 0u64;
    while started.elapsed() < period {
        let options = TransactionOptions {
            sqlite_transaction_mode: sqlite.then_some(SqliteTransactionMode::Immediate),
            ..Default::default()
        };
        let tx = db.begin_with_options(options).await.unwrap();
        tx.execute_raw(Statement::from_sql_and_values(
            backend,
            insert,
            [now_ms().into(), "a row of about this size".into()],
        ))
        .await
        .unwrap();
        tx.commit().await.unwrap();
        commits += 1;
    }
    let rate = commits as f64 / started.elapsed().as_secs_f64();
    db.execute_unprepared("DROP TABLE bench_ceiling")
        .await
        .unwrap();
    db.close().await.unwrap();
    (rate, said.join(", "))
}

// ---------------------------------------------------------------- the table

fn median_by<T>(items: &[T], f: impl Fn(&T) -> f64) -> f64 {
    let mut values: Vec<f64> = items.iter().map(f).collect();
    values.sort_by(f64::total_cmp);
    values
        .get(values.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(0.0)
}

fn share(v: f64, ceiling: f64) -> String {
    format!("{:.2}", v / ceiling)
}

fn verdict(met: bool) -> String {
    if met { "met" } else { "not met" }.to_owned()
}

struct Table {
    rows: Vec<[String; 5]>,
}

impl Table {
    fn row(&mut self, figure: impl Into<String>, measured: impl Into<String>) -> &mut [String; 5] {
        self.rows.push([
            figure.into(),
            measured.into(),
            String::new(),
            String::new(),
            String::new(),
        ]);
        self.rows.last_mut().unwrap()
    }

    fn print(&self) {
        let header = ["figure", "measured", "of ceiling", "goal", ""].map(str::to_owned);
        let mut widths = [0usize; 5];
        for row in std::iter::once(&header).chain(&self.rows) {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |row: &[String; 5]| {
            let cells: Vec<String> = row
                .iter()
                .zip(widths)
                .map(|(cell, w)| format!("{cell:<w$}"))
                .collect();
            println!("| {} |", cells.join(" | "));
        };
        line(&header);
        println!(
            "|{}|",
            widths
                .iter()
                .map(|w| "-".repeat(w + 2))
                .collect::<Vec<_>>()
                .join("|")
        );
        for row in &self.rows {
            line(row);
        }
    }
}

fn print(label: &str, sizes: &Sizes, f: &Figures) {
    let postgres = label == "PostgreSQL";
    let mut t = Table { rows: Vec::new() };
    let c = f.ceiling;
    {
        let r = t.row(
            "ceiling: one-row insert transactions/s, one writer",
            count(c),
        );
        r[2] = "1.00".into();
    }
    for level in &f.levels {
        let n = level.clients;
        let at16 = n == 16;
        let rps = level.runs_per_sec();
        let r = t.row(
            format!(
                "runs/s, {n} client{} × {} messages ({} runs)",
                if n == 1 { "" } else { "s" },
                level.messages,
                level.runs
            ),
            count(rps),
        );
        r[2] = share(rps, c);
        if at16 {
            let goal = if postgres { 600.0 } else { 1000.0 };
            r[3] = format!("≥ {}", count(goal));
            r[4] = verdict(rps >= goal);
        }
        let wpr = level.writes_per_run();
        let r = t.row(
            format!("  write transactions per run, {n}"),
            format!("{wpr:.2}"),
        );
        r[3] = "≤ 4".into();
        r[4] = verdict(wpr <= 4.0);
        let runs = level.runs as f64;
        t.row(
            format!("  queries per run, {n}: main pool / API read pool"),
            format!(
                "{:.1} / {:.1}",
                level.queries.0 as f64 / runs,
                level.queries.1 as f64 / runs
            ),
        );
        let r = t.row(
            format!("  commits/s as run transactions, {n} (runs/s × writes per run)"),
            count(rps * wpr),
        );
        r[2] = share(rps * wpr, c);
        t.row(
            format!("  sendMessage response p50 / p99, {n}"),
            p50_p99(&level.answered),
        );
        let r = t.row(
            format!("  first part.delta p50 / p99, {n}"),
            p50_p99(&level.first_delta),
        );
        if at16 {
            r[3] = "p50 < 5 ms".into();
            r[4] = verdict(percentile(&level.first_delta, 50) < Duration::from_millis(5));
        }
        let r = t.row(
            format!("  run.completed p50 / p99, {n}"),
            p50_p99(&level.completed),
        );
        if at16 {
            r[3] = "p99 < 50 ms".into();
            r[4] = verdict(percentile(&level.completed, 99) < Duration::from_millis(50));
        }
    }

    if !f.streams.is_empty() {
        let s = &f.streams;
        let tokens = sizes.stream_tokens;
        // Four characters a token (see `/stream`).
        let expected = tokens * 4;
        let deltas = median_by(s, |x| x.deltas as f64);
        let chars = median_by(s, |x| x.chars as f64);
        let dps = median_by(s, |x| x.deltas as f64 / x.span.as_secs_f64().max(1e-6));
        let tps = median_by(s, |x| tokens as f64 / x.completed.as_secs_f64());
        t.row(
            format!(
                "{} tokens streamed (median of {} runs): deltas received",
                count(tokens as f64),
                s.len()
            ),
            format!(
                "{} ({} of {} characters)",
                count(deltas),
                count(chars),
                count(expected as f64)
            ),
        );
        t.row(
            "  sendMessage → first delta / last delta / run.completed",
            format!(
                "{} / {} / {} ms",
                millis(Duration::from_secs_f64(median_by(s, |x| x
                    .first_delta
                    .as_secs_f64()))),
                millis(Duration::from_secs_f64(median_by(s, |x| (x.first_delta
                    + x.span)
                    .as_secs_f64()))),
                millis(Duration::from_secs_f64(median_by(s, |x| x
                    .completed
                    .as_secs_f64())))
            ),
        );
        let r = t.row("  deltas/s received, first → last delta", count(dps));
        r[2] = share(dps, c);
        t.row(
            "  tokens/s end to end, sendMessage → run.completed",
            count(tps),
        );
        t.row(
            "  part.updated events of the run (checkpoints + the final one)",
            format!("{:.0}", median_by(s, |x| x.part_updated as f64)),
        );
        t.row(
            "  write transactions, sendMessage → run.completed",
            format!("{:.0}", median_by(s, |x| x.writes as f64)),
        );
    }

    for h in &f.histories {
        t.row(
            format!(
                "{} messages of history: first delta / run.completed p50 ({} runs)",
                count(h.messages as f64),
                h.first_delta.len()
            ),
            format!(
                "{} / {} ms (slowest first delta {} ms)",
                millis(percentile(&h.first_delta, 50)),
                millis(percentile(&h.completed, 50)),
                millis(percentile(&h.first_delta, 100))
            ),
        );
    }
    if let (Some(small), Some(large)) = (f.histories.first(), f.histories.last())
        && f.histories.len() > 1
    {
        let ratio = ms(percentile(&large.first_delta, 50)) / ms(percentile(&small.first_delta, 50));
        let r = t.row(
            format!(
                "  first delta p50 at {} ÷ at {}",
                count(large.messages as f64),
                count(small.messages as f64)
            ),
            format!("{ratio:.2}×"),
        );
        r[3] = "≤ 1.5×".into();
        r[4] = verdict(ratio <= 1.5);
    }

    for (name, p) in [
        ("decideApproval", &f.approvals),
        ("answerQuestion", &f.questions),
    ] {
        let r = t.row(
            format!("{name} → run.completed p50 / p99 ({} runs)", p.samples),
            p50_p99(&p.resumed),
        );
        r[3] = "p50 < 10 ms".into();
        r[4] = verdict(percentile(&p.resumed, 50) < Duration::from_millis(10));
        t.row(format!("  {name} response p50 / p99"), p50_p99(&p.response));
        t.row(
            format!("  write transactions / queries, {name} → run.completed"),
            format!(
                "{:.2} / {:.1}",
                p.writes as f64 / p.samples as f64,
                p.queries as f64 / p.samples as f64
            ),
        );
    }

    println!();
    println!(
        "## {label}: {} run, {:.0} s",
        if sizes.quick { "quick" } else { "full" },
        f.took.as_secs_f64()
    );
    println!();
    t.print();
    println!();
    println!(
        "Scripted model, stream_delay_ms = 0; runtime.concurrency = {CONCURRENCY}, \
         checkpoint_ms = {CHECKPOINT_MS}. Ceiling: BEGIN{}, one INSERT, COMMIT on one \
         connection for {:.0} s ({}).",
        if postgres { "" } else { " IMMEDIATE" },
        sizes.ceiling_for.as_secs_f64(),
        f.settings
    );
    if let Some(h) = f.histories.last() {
        println!(
            "History seed: user/assistant pairs copied from one real exchange (messages, \
             text parts, a COMPLETED run, its audit row and events), texts like \"{}\" / \"{}\"; \
             {} messages ≈ {} estimated tokens; the history's agent has a context budget of \
             {} tokens, so the first run after the longest seed compacts it (its slowest first delta), \
             as a real conversation that long would have been; seeded in {:.1} s; context \
             compactions seen: {}.",
            user_text(1),
            reply_text(1),
            count(h.messages as f64),
            count(h.seed_tokens as f64),
            count(HISTORY_BUDGET_TOKENS as f64),
            h.seeded_in.as_secs_f64(),
            f.histories.iter().map(|h| h.compactions).sum::<usize>()
        );
    }
}
