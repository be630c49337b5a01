//! Several `tether` processes on one PostgreSQL database share the work and
//! survive each other's deaths: runs complete exactly once, subscribers on
//! every instance get every persisted event of their conversation once and
//! in order, live deltas cross instances, a killed worker's runs are taken
//! over without repeating a side effect, and a question asked on one
//! instance is answered through another. On SQLite, where the workers of a
//! database belong to one process, these tests return at once.

use std::collections::{HashMap, HashSet};

use sea_orm::{ConnectionTrait, DatabaseBackend, Statement};
use serde_json::{Value, json};

use tether::bus::Bus;
use tether::store::{self, Pools, Store};

use crate::downstream::Downstream;
use crate::support::{Server, TestDb, WsClient, of_type, on_postgres};
use crate::tools::{config, tool_calls};

const EVENTS: &str = "subscription($c: ID!, $a: String) { conversationEvents(conversationId: $c, after: $a) { cursor type runId } }";

/// Short leases, so that a dead instance's runs are taken over within
/// seconds; a scripted model that streams (so that there are deltas).
const CONFIG: &str = r#"
default_agent = "demo"

[runtime]
lease_secs = 3
heartbeat_secs = 0.5
checkpoint_ms = 40
poll_ms = 200
concurrency = 8

[[agents]]
name = "demo"
provider = "scripted"
stream_delay_ms = 1
tools = ["ask_questions"]
"#;

/// Subscribes to each of `conversations` through the instance at `base`,
/// from the start of their logs, and collects what arrives until each has
/// seen `runs` runs complete; returns the events of each, in arrival order.
fn watch(
    base: String,
    token: String,
    conversations: Vec<String>,
    runs: usize,
) -> tokio::task::JoinHandle<Vec<Vec<Value>>> {
    tokio::spawn(async move {
        let mut client = WsClient::connect_at(&base, &token).await;
        for (i, conversation) in conversations.iter().enumerate() {
            client
                .subscribe(
                    &i.to_string(),
                    EVENTS,
                    json!({ "c": conversation, "a": "0000000000000000" }),
                )
                .await;
        }
        let mut seen = vec![Vec::new(); conversations.len()];
        let mut completed = vec![0; conversations.len()];
        while completed.iter().any(|n| *n < runs) {
            let message = client
                .next_json()
                .await
                .expect("the subscriptions stay open");
            assert_eq!(message["type"], "next", "{message}");
            let i: usize = message["id"].as_str().unwrap().parse().unwrap();
            let event = message["payload"]["data"]["conversationEvents"].clone();
            if event["type"] == "run.completed" {
                completed[i] += 1;
            }
            seen[i].push(event);
        }
        seen
    })
}

/// What a subscriber saw of a conversation is its whole log, once and in
/// order, with `runs` runs each completed once (and, when `claimed_once`,
/// started once); returns the live deltas it saw.
async fn saw_the_log_once(
    server: &Server,
    token: &str,
    conversation: &str,
    seen: &[Value],
    runs: usize,
    claimed_once: bool,
) -> usize {
    let log = server.all_events(token, conversation).await;
    let persisted: Vec<&Value> = seen.iter().filter(|e| e["type"] != "part.delta").collect();
    let cursors: Vec<&str> = persisted
        .iter()
        .map(|e| e["cursor"].as_str().unwrap())
        .collect();
    let expected: Vec<String> = (1..=log.len()).map(|n| format!("{n:016}")).collect();
    assert_eq!(cursors, expected, "once and in order: {conversation}");
    for (got, logged) in persisted.iter().zip(&log) {
        assert_eq!(got["type"], logged["type"], "{conversation}");
        assert_eq!(got["runId"], logged["runId"], "{conversation}");
    }
    let completed: HashSet<&str> = of_type(&log, "run.completed")
        .iter()
        .map(|e| e["runId"].as_str().unwrap())
        .collect();
    assert_eq!(completed.len(), runs, "{conversation}: {log:?}");
    assert_eq!(of_type(&log, "run.completed").len(), runs);
    if claimed_once {
        assert_eq!(of_type(&log, "run.started").len(), runs, "claimed once");
    }
    seen.len() - persisted.len()
}

#[tokio::test]
async fn three_instances_share_the_work_and_every_subscriber_sees_every_event_once() {
    if !on_postgres() {
        return;
    }
    const CONVERSATIONS: usize = 30;
    const RUNS_EACH: usize = 10;
    // One instance takes the messages and runs them; clients watch through
    // the other two, so every delta they see crossed instances.
    let a = Server::start_workers(CONFIG).await;
    let b = a.companion_with("api", CONFIG, &[]).await;
    let c = a.companion_with("api", CONFIG, &[]).await;
    let token = a.token("acme", "ada");
    let mut conversations = Vec::new();
    for _ in 0..CONVERSATIONS {
        conversations.push(a.create_conversation(&token).await);
    }
    let (on_b, on_c): (Vec<_>, Vec<_>) = conversations
        .iter()
        .cloned()
        .enumerate()
        .partition(|(i, _)| i % 2 == 0);
    let on_b: Vec<String> = on_b.into_iter().map(|(_, c)| c).collect();
    let on_c: Vec<String> = on_c.into_iter().map(|(_, c)| c).collect();
    let watching_b = watch(b.base.clone(), token.clone(), on_b.clone(), RUNS_EACH);
    let watching_c = watch(c.base.clone(), token.clone(), on_c.clone(), RUNS_EACH);

    for round in 0..RUNS_EACH {
        for conversation in &conversations {
            a.send(&token, conversation, &format!("message {round}"))
                .await;
        }
    }
    let seen_b = watching_b.await.unwrap();
    let seen_c = watching_c.await.unwrap();

    let mut deltas = 0;
    for (conversations, seen) in [(on_b, seen_b), (on_c, seen_c)] {
        for (conversation, seen) in conversations.iter().zip(&seen) {
            deltas += saw_the_log_once(&a, &token, conversation, seen, RUNS_EACH, true).await;
        }
    }
    assert!(deltas > 0, "live deltas crossed instances");
}

/// The run ids that hold a lease of `instance` now.
async fn leased_by(db: &sea_orm::DatabaseConnection, instance: &str) -> Vec<String> {
    db.query_all_raw(Statement::from_sql_and_values(
        DatabaseBackend::Postgres,
        "SELECT id::text AS id FROM runs WHERE status = 'RUNNING' AND lease_owner = $1",
        [instance.into()],
    ))
    .await
    .unwrap()
    .iter()
    .map(|row| row.try_get::<String>("", "id").unwrap())
    .collect()
}

#[tokio::test]
async fn a_killed_worker_instance_loses_no_run_and_repeats_no_effect() {
    if !on_postgres() {
        return;
    }
    let downstream = Downstream::start().await;
    let config = config(&downstream, "concurrency = 4", &[("tools", "")]);
    let api = Server::api_only(&config).await;
    let mut first = api.companion_with("worker", &config, &[]).await;
    let token = api.token("acme", "ada");
    // The first worker holds this run's call at the service when it dies.
    let held_in = api.conversation_with(&token, "tools").await;
    let (_, held) = api
        .send(&token, &held_in, "/tool held {\"text\": \"held\"}")
        .await;
    downstream
        .wait_for("the held request", |d| !d.requests_to("/held").is_empty())
        .await;
    let second = api.companion_with("worker", &config, &[]).await;

    let mut runs = vec![(held_in.clone(), held.clone())];
    for i in 0..10 {
        let conversation = api.conversation_with(&token, "tools").await;
        for j in 0..3 {
            let text = format!("/tool effect {{\"text\": \"{i}-{j}\"}}");
            let (_, run) = api.send(&token, &conversation, &text).await;
            runs.push((conversation.clone(), run));
        }
    }
    let db = sea_orm::Database::connect(api.database_url())
        .await
        .unwrap();
    assert!(
        leased_by(&db, &first.instance).await.contains(&held),
        "the first worker holds the held run"
    );
    first.child.kill().await.unwrap();

    let mut keys = HashSet::new();
    for (conversation, run) in &runs {
        let ended = api.wait_until_ended(&token, run).await;
        assert_eq!(ended["status"], "COMPLETED", "{ended}");
        let events = api.all_events(&token, conversation).await;
        let completed: Vec<_> = of_type(&events, "run.completed")
            .into_iter()
            .filter(|e| e["runId"] == run.as_str())
            .collect();
        assert_eq!(completed.len(), 1, "{events:?}");
        let calls = tool_calls(&api, &token, run).await;
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert_eq!(calls[0]["outcome"], "SUCCEEDED", "{calls:?}");
        keys.insert(calls[0]["idempotencyKey"].as_str().unwrap().to_owned());
    }
    // The held run was taken over: claimed again, its call sent again with
    // its key, and its effect done once.
    let events = api.all_events(&token, &held_in).await;
    assert_eq!(of_type(&events, "run.started").len(), 2, "{events:?}");
    let requests = downstream.requests();
    let sent: HashSet<String> = requests.iter().filter_map(|r| r.key.clone()).collect();
    assert_eq!(sent, keys, "every request carried its call's key");
    assert_eq!(downstream.effects(), runs.len(), "one effect per call");
    assert!(requests.len() > runs.len(), "the held call was sent again");
    drop(second);
}

#[tokio::test]
async fn a_question_asked_on_one_instance_is_answered_through_another() {
    if !on_postgres() {
        return;
    }
    let a = Server::start_workers(CONFIG).await;
    let b = a.companion_with("api", CONFIG, &[]).await;
    let token = a.token("acme", "ada");
    let conversation = a.create_conversation(&token).await;
    let (_, run) = a.send(&token, &conversation, "/ask").await;
    a.wait_for_run(&token, &run, |r| r["status"] == "WAITING_FOR_QUESTION")
        .await;

    let (status, body) = a
        .post_at(
            &b.base,
            Some(&token),
            "query($r: ID!) { pendingQuestion(runId: $r) { interactionId } }",
            json!({ "r": run }),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let interaction = body["data"]["pendingQuestion"]["interactionId"]
        .as_str()
        .unwrap_or_else(|| panic!("the other instance shows the question: {body}"))
        .to_owned();
    let answers = json!([
        { "key": "color", "values": ["blue"] },
        { "key": "days", "values": ["mon"] },
        { "key": "name", "values": [], "other": "Across" }
    ]);
    let (status, body) = a
        .post_at(
            &b.base,
            Some(&token),
            "mutation($i: ID!, $a: [QuestionAnswerInput!]!) { answerQuestion(input: {interactionId: $i, answers: $a}) { resumed } }",
            json!({ "i": interaction, "a": answers }),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["answerQuestion"]["resumed"], true, "{body}");

    let ended = a.wait_until_ended(&token, &run).await;
    assert_eq!(ended["status"], "COMPLETED", "{ended}");
    let events = a.all_events(&token, &conversation).await;
    let kinds: HashMap<&str, usize> = events.iter().fold(HashMap::new(), |mut n, e| {
        *n.entry(e["type"].as_str().unwrap()).or_default() += 1;
        n
    });
    assert_eq!(kinds.get("run.completed"), Some(&1), "{events:?}");
}

/// Every client connection of the test's database is cut while runs are in
/// flight, as a PostgreSQL restart would: in-flight commits fail, the runs
/// are recovered from what was committed and complete once, subscriptions
/// carry on without losing or repeating an event, and no process exits.
#[tokio::test]
async fn cut_database_connections_lose_nothing() {
    if !on_postgres() {
        return;
    }
    const CONVERSATIONS: usize = 8;
    const RUNS_EACH: usize = 6;
    let mut a = Server::start_workers(CONFIG).await;
    let mut b = a.companion_with("api", CONFIG, &[]).await;
    let token = a.token("acme", "ada");
    let mut conversations = Vec::new();
    for _ in 0..CONVERSATIONS {
        conversations.push(a.create_conversation(&token).await);
    }
    let watching = watch(
        b.base.clone(),
        token.clone(),
        conversations.clone(),
        RUNS_EACH,
    );
    let mut runs = Vec::new();
    for round in 0..RUNS_EACH {
        for conversation in &conversations {
            let (_, run) = a
                .send(&token, conversation, &format!("/stream 200\nround {round}"))
                .await;
            runs.push(run);
        }
    }
    a.wait_for_run(&token, &runs[0], |r| r["status"] != "QUEUED")
        .await;

    // Cut several times while the runs stream and commit, so that some
    // commits are cut half-way.
    let admin = sea_orm::Database::connect(a.database_url()).await.unwrap();
    for i in 0..5 {
        let cut = admin
            .execute_unprepared(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .await
            .unwrap();
        if i == 0 {
            assert!(
                cut.rows_affected() > 2,
                "the processes' connections: {cut:?}"
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    }

    for run in &runs {
        let ended = a.wait_until_ended(&token, run).await;
        assert_eq!(ended["status"], "COMPLETED", "{ended}");
    }
    let seen = watching.await.unwrap();
    for (conversation, seen) in conversations.iter().zip(&seen) {
        saw_the_log_once(&a, &token, conversation, seen, RUNS_EACH, false).await;
    }
    assert!(a.is_running(), "the first process carried on");
    assert!(
        b.child.try_wait().unwrap().is_none(),
        "the second process carried on"
    );
}

/// Instances started at the same moment on a new database migrate one
/// after another (an advisory lock): none fails, the schema is made once.
#[tokio::test]
async fn instances_started_together_migrate_one_after_another() {
    if !on_postgres() {
        return;
    }
    let db = TestDb::new().await;
    let migrated = futures_util::future::join_all((0..4).map(|_| store::migrate(&db.url))).await;
    for result in migrated {
        result.expect("every instance's migration succeeds");
    }
    let store = Store::connect(&db.url, Bus::new()).await.unwrap();
    let applied = store
        .db()
        .query_one_raw(Statement::from_string(
            DatabaseBackend::Postgres,
            "SELECT count(*) AS n, count(DISTINCT version) AS d FROM seaql_migrations",
        ))
        .await
        .unwrap()
        .unwrap();
    let (n, distinct): (i64, i64) = (
        applied.try_get("", "n").unwrap(),
        applied.try_get("", "d").unwrap(),
    );
    assert_eq!(n, distinct, "each migration applied once");
}

/// `database.statement_timeout_secs` bounds the pools' statements, and a
/// migration, which may take longer, runs without it.
#[tokio::test]
async fn the_statement_timeout_bounds_queries_but_not_migrations() {
    if !on_postgres() {
        return;
    }
    let db = TestDb::new().await;
    let pools = Pools {
        statement_timeout: Some(std::time::Duration::from_millis(200)),
        ..Pools::default()
    };
    let store = Store::open(&db.url, Bus::new(), &pools).await.unwrap();
    let slow = Statement::from_string(DatabaseBackend::Postgres, "SELECT pg_sleep(1)");
    let err = store.db().execute_raw(slow).await.unwrap_err();
    assert!(err.to_string().contains("statement timeout"), "{err}");
    let quick = Statement::from_string(DatabaseBackend::Postgres, "SELECT 1");
    store.db().execute_raw(quick).await.unwrap();
}
