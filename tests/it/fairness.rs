//! Tenants take turns for the workers: one tenant's flood of runs does not
//! keep another's waiting behind it, and a tenant cap holds a tenant to its
//! share. On SQLite and PostgreSQL alike.

use serde_json::json;
use tether::bus::Bus;
use tether::domain::ActiveRunStrategy;
use tether::store::commands::{self, MaxAttempts, NewConversation, NewMessage};
use tether::store::queue::{self, Slots};
use tether::store::{Actor, Pools, Store};
use uuid::Uuid;

use crate::support::{Server, TestDb};

fn of(tenant: &str) -> Actor {
    Actor {
        tenant: tenant.into(),
        principal: "someone".into(),
        delegate: false,
    }
}

/// A run of `tenant`'s queued in a conversation of its own.
async fn queued(store: &Store, tenant: &str) -> Uuid {
    let actor = of(tenant);
    let conversation = commands::create_conversation(
        store,
        &actor,
        NewConversation {
            agent: "demo".into(),
            title: None,
        },
    )
    .await
    .unwrap();
    commands::send_message(
        store,
        &actor,
        NewMessage {
            conversation_id: conversation.id,
            text: "hello".into(),
            client_message_id: None,
            on_active_run: ActiveRunStrategy::Queue,
            max_attempts: MaxAttempts::Fixed(1),
        },
    )
    .await
    .unwrap()
    .1
    .id
}

async fn claim(store: &Store, slots: impl Into<Slots>) -> Vec<Uuid> {
    queue::claim(store, "w", 60_000, slots)
        .await
        .unwrap()
        .into_iter()
        .map(|run| run.id)
        .collect()
}

#[tokio::test]
async fn a_claim_takes_tenants_in_turn_whatever_one_has_queued_or_running() {
    let db = TestDb::new().await;
    let store = Store::open(&db.url, Bus::new(), &Pools::default())
        .await
        .unwrap();
    let mut flood = Vec::new();
    for _ in 0..6 {
        flood.push(queued(&store, "flood").await);
    }
    let quiet = queued(&store, "quiet").await;

    // The quiet tenant's run was queued last, yet it is in the first pair.
    let first = claim(&store, 2).await;
    assert_eq!(first.len(), 2);
    assert!(first.contains(&flood[0]), "{first:?}");
    assert!(first.contains(&quiet), "{first:?}");

    // With one run each under way, the flood's next is next.
    assert_eq!(claim(&store, 1).await, vec![flood[1]]);
    // The flood has two running, the quiet one one: a run the quiet tenant
    // queues now goes before the flood's third, queued long before it.
    let later = queued(&store, "quiet").await;
    assert_eq!(claim(&store, 1).await, vec![later]);
    assert_eq!(claim(&store, 1).await, vec![flood[2]]);
}

#[tokio::test]
async fn a_tenant_cap_leaves_the_tenants_other_runs_queued() {
    let db = TestDb::new().await;
    let store = Store::open(&db.url, Bus::new(), &Pools::default())
        .await
        .unwrap();
    for _ in 0..4 {
        queued(&store, "flood").await;
    }
    let quiet = queued(&store, "quiet").await;
    let capped = Slots {
        free: 10,
        per_tenant: Some(2),
    };
    let taken = claim(&store, capped).await;
    assert_eq!(taken.len(), 3, "two of the flood's and the quiet one's");
    assert!(taken.contains(&quiet));
    assert!(
        claim(&store, capped).await.is_empty(),
        "the cap is over every claim"
    );
    assert_eq!(claim(&store, 10).await.len(), 2, "without it the rest go");
}

/// Milliseconds from `from` to `to`, two of a run's timestamps.
fn millis_between(run: &serde_json::Value, from: &str, to: &str) -> i64 {
    let at = |field: &str| {
        chrono::DateTime::parse_from_rfc3339(run[field].as_str().unwrap_or_else(|| {
            panic!("{run} has no {field}");
        }))
        .unwrap()
    };
    (at(to) - at(from)).num_milliseconds()
}

const RUN_TIMES: &str = "query($r: ID!) { run(id: $r) { status createdAt startedAt endedAt } }";

#[tokio::test]
async fn another_tenants_short_run_goes_before_a_floods_queued_runs() {
    let config = r#"
default_agent = "demo"

[runtime]
lease_secs = 3
heartbeat_secs = 0.5
checkpoint_ms = 40
poll_ms = 200
concurrency = 4

[[agents]]
name = "demo"
provider = "scripted"
stream_delay_ms = 5
"#;
    let server = Server::start_workers(config).await;
    let flood = server.token("flood", "fred");
    let mut runs = Vec::new();
    for _ in 0..20 {
        let conversation = server.create_conversation(&flood).await;
        runs.push(server.send(&flood, &conversation, "/hold 2").await.1);
    }
    // Every slot is taken by the flood, and the rest of its runs (sixteen,
    // less any that a slot freed meanwhile) wait.
    for run in &runs[..4] {
        server
            .wait_for_run(&flood, run, |r| r["status"] != "QUEUED")
            .await;
    }
    let status = |run: &str| {
        let run = run.to_owned();
        let server = &server;
        let flood = &flood;
        async move { server.gql(flood, RUN_TIMES, json!({ "r": run })).await["run"].clone() }
    };
    let mut waiting = Vec::new();
    for run in &runs[4..] {
        if status(run).await["status"] == "QUEUED" {
            waiting.push(run.clone());
        }
    }
    assert!(
        waiting.len() >= 12,
        "the flood has runs queued: {waiting:?}"
    );

    let quiet = server.token("quiet", "quinn");
    let conversation = server.create_conversation(&quiet).await;
    let (_, short) = server.send(&quiet, &conversation, "hello").await;
    let done = server.wait_until_ended(&quiet, &short).await;
    assert_eq!(done["status"], "COMPLETED", "{done}");
    let short_run = server.gql(&quiet, RUN_TIMES, json!({ "r": short })).await["run"].clone();
    let short_started = short_run["startedAt"].as_str().unwrap().to_owned();
    // It took the first slot that came free: every flood run that was
    // queued when it was sent started after it, if at all yet.
    for run in &waiting {
        let run = status(run).await;
        if let Some(started) = run["startedAt"].as_str() {
            assert!(
                started >= short_started.as_str(),
                "{run} started before {short_started}"
            );
        }
    }
    let mut longest = 0;
    for run in &runs {
        let ended = server.wait_until_ended(&flood, run).await;
        assert_eq!(ended["status"], "COMPLETED", "{ended}");
        longest = longest.max(millis_between(&status(run).await, "startedAt", "endedAt"));
    }
    // So it waited no longer than one flood run lasts before it started
    // (in line it would have waited for four: sixteen runs ahead of it over
    // four slots), and completed within one run's time plus its own.
    let waited = millis_between(&short_run, "createdAt", "startedAt");
    assert!(
        waited <= longest,
        "waited {waited} ms, a flood run lasts {longest} ms"
    );
}
