//! Workers through the library: two engines sharing one database, and the
//! fence that stops a worker whose lease was taken over.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tether::tools::registry::Registry;

use sea_orm::{ActiveModelTrait, ActiveValue::Set, EntityTrait};
use tether::bus::Bus;
use tether::config::FileConfig;
use tether::domain::ActiveRunStrategy;
use tether::domain::event::EventKind;
use tether::runtime::{Runtime, RuntimeOptions};
use tether::store::Actor;
use tether::store::commands::{self, MaxAttempts, NewConversation, NewMessage};
use tether::store::commit::{Begun, Lease, PartText};
use tether::store::entities::run;
use tether::store::queue::{self, Reclaim};
use tether::store::runs;
use tether::store::{Error, Pools, Store, reads};
use uuid::Uuid;

use crate::support::{PATIENCE, TestDb};

const FAST: &str = r#"
[runtime]
lease_secs = 5
heartbeat_secs = 1
poll_ms = 50
concurrency = 4

[[agents]]
name = "demo"
provider = "scripted"
stream_delay_ms = 0
"#;

/// A configuration whose leases, heartbeats and reaps are far off, so that
/// only what a test does writes, with this poll, concurrency and scripted
/// stream delay.
fn quiet_config(poll_ms: u64, concurrency: usize, stream_delay_ms: u64) -> Arc<FileConfig> {
    let toml = format!(
        r#"
[runtime]
lease_secs = 600
heartbeat_secs = 60
poll_ms = {poll_ms}
concurrency = {concurrency}

[[agents]]
name = "demo"
provider = "scripted"
stream_delay_ms = {stream_delay_ms}
"#
    );
    Arc::new(FileConfig::from_toml(&toml).unwrap())
}

/// An engine of `config` on `store`, as instance `id`.
fn engine(store: &Store, config: Arc<FileConfig>, id: &str) -> Runtime {
    let tools = Arc::new(Registry::from_config(&config).unwrap());
    Runtime::start(
        store.clone(),
        config,
        tools,
        RuntimeOptions {
            instance_id: id.into(),
            sole_owner: false,
        },
    )
}

/// The begun text part with `text` in it.
fn texts(begun: &Begun, text: &str) -> Vec<PartText> {
    vec![PartText {
        part: begun.part().expect("a first claim opens a text part"),
        text: text.to_owned(),
        data: None,
    }]
}

fn actor() -> Actor {
    Actor {
        tenant: "acme".into(),
        principal: "ada".into(),
        delegate: false,
    }
}

async fn store(db: &TestDb) -> Store {
    Store::open(&db.url, Bus::new(), &Pools::default())
        .await
        .unwrap()
}

async fn conversation(store: &Store) -> Uuid {
    commands::create_conversation(
        store,
        &actor(),
        NewConversation {
            agent: "demo".into(),
            title: None,
        },
    )
    .await
    .unwrap()
    .id
}

async fn send(store: &Store, conversation_id: Uuid, text: &str) -> run::Model {
    commands::send_message(
        store,
        &actor(),
        NewMessage {
            conversation_id,
            text: text.into(),
            client_message_id: None,
            on_active_run: ActiveRunStrategy::Queue,
            max_attempts: MaxAttempts::Fixed(1),
        },
    )
    .await
    .unwrap()
    .1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_complete_200_runs_each_exactly_once_in_conversation_order() {
    let db = TestDb::new().await;
    let config = Arc::new(FileConfig::from_toml(FAST).unwrap());
    let tools = Arc::new(Registry::from_config(&config).unwrap());
    // Two instances: separate connections and separate buses, one database.
    let (a, b) = (store(&db).await, store(&db).await);
    let mut conversations = Vec::new();
    for _ in 0..20 {
        conversations.push(conversation(&a).await);
    }
    let mut runs: HashMap<Uuid, Vec<Uuid>> = HashMap::new();
    for i in 0..10 {
        for c in &conversations {
            let run = send(&a, *c, &format!("message {i}")).await;
            runs.entry(*c).or_default().push(run.id);
        }
    }
    let engines: Vec<Runtime> = [(&a, "engine-a"), (&b, "engine-b")]
        .into_iter()
        .map(|(store, id)| {
            Runtime::start(
                store.clone(),
                config.clone(),
                tools.clone(),
                RuntimeOptions {
                    instance_id: id.into(),
                    sole_owner: false,
                },
            )
        })
        .collect();

    let deadline = tokio::time::Instant::now() + PATIENCE * 3;
    for c in &conversations {
        loop {
            let unended = reads::unended_runs(a.db(), "acme", *c).await.unwrap();
            if unended.is_empty() {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "runs left: {}",
                unended.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for engine in engines {
        engine.shutdown().await;
    }

    for c in &conversations {
        let events = reads::events_after(a.db(), "acme", *c, Default::default(), 10_000)
            .await
            .unwrap();
        let position = |kind: EventKind, run: Uuid| -> Vec<usize> {
            events
                .iter()
                .enumerate()
                .filter(|(_, e)| e.kind == kind && e.run_id == Some(run))
                .map(|(i, _)| i)
                .collect()
        };
        let ids = &runs[c];
        for (i, run_id) in ids.iter().enumerate() {
            let started = position(EventKind::RunStarted, *run_id);
            let completed = position(EventKind::RunCompleted, *run_id);
            assert_eq!(started.len(), 1, "claimed once");
            assert_eq!(completed.len(), 1, "completed once");
            if i > 0 {
                let before = position(EventKind::RunCompleted, ids[i - 1])[0];
                assert!(before < started[0], "conversation order kept");
            }
            let row = run_row(&a, *run_id).await;
            assert_eq!(row.status, "COMPLETED");
        }
    }
    assert_eq!(runs.values().map(Vec::len).sum::<usize>(), 200);
}

#[tokio::test]
async fn a_worker_whose_lease_was_taken_over_commits_nothing() {
    let db = TestDb::new().await;
    let store = store(&db).await;
    let conversation_id = conversation(&store).await;
    send(&store, conversation_id, "hello").await;

    let first = claim_one(&store, "worker-a").await;
    let lease_a = Lease::of(&first);
    let begun_a = runs::begin(&store, &lease_a).await.unwrap();
    runs::checkpoint(&store, &lease_a, &texts(&begun_a, "from a"))
        .await
        .unwrap();

    // Worker A stalls; its lease runs out and the reaper re-queues the run.
    expire_lease(&store, first.id, 0).await;
    assert_eq!(
        queue::reclaim(&store, Reclaim::Expired { executing: &[] }, 3)
            .await
            .unwrap(),
        1
    );
    let second = claim_one(&store, "worker-b").await;
    assert_eq!(second.id, first.id);
    assert!(second.lease_epoch > first.lease_epoch);
    let lease_b = Lease::of(&second);
    let begun_b = runs::begin(&store, &lease_b).await.unwrap();

    let events_before = reads::events_after(
        store.db(),
        "acme",
        conversation_id,
        Default::default(),
        1000,
    )
    .await
    .unwrap();
    // A wakes up: every commit it tries is refused, and nothing changes.
    let refused = runs::checkpoint(&store, &lease_a, &texts(&begun_a, "from a, later")).await;
    assert!(matches!(refused, Err(Error::Fenced)), "{refused:?}");
    let refused = runs::release(&store, &lease_a, &texts(&begun_a, "late")).await;
    assert!(matches!(refused, Err(Error::Fenced)), "{refused:?}");
    assert_eq!(
        queue::heartbeat(&store, &lease_a, 60_000).await.unwrap(),
        queue::Heartbeat::Lost
    );
    let events_after = reads::events_after(
        store.db(),
        "acme",
        conversation_id,
        Default::default(),
        1000,
    )
    .await
    .unwrap();
    assert_eq!(events_before, events_after);
    let part_a = reads::part(store.db(), "acme", begun_a.part().unwrap().id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(part_a.text.as_deref(), Some("from a"));
    assert_eq!(part_a.state, "DONE", "closed when B took over");

    // B goes on.
    runs::checkpoint(&store, &lease_b, &texts(&begun_b, "from b"))
        .await
        .unwrap();
}

/// A lease that ran out while nobody took the run (the database was
/// away longer than a lease): no commit goes through under it, its own
/// worker's heartbeat renews it, and its own process's sweep leaves it.
#[tokio::test]
async fn a_lapsed_lease_writes_nothing_until_its_heartbeat_renews_it() {
    let db = TestDb::new().await;
    let store = store(&db).await;
    let conversation_id = conversation(&store).await;
    send(&store, conversation_id, "hello").await;
    let claimed = claim_one(&store, "worker-a").await;
    let lease = Lease::of(&claimed);
    let begun = runs::begin(&store, &lease).await.unwrap();

    expire_lease(&store, claimed.id, 0).await;
    let before = reads::events_after(
        store.db(),
        "acme",
        conversation_id,
        Default::default(),
        1000,
    )
    .await
    .unwrap();
    let refused = runs::checkpoint(&store, &lease, &texts(&begun, "under a lapsed lease")).await;
    assert!(matches!(refused, Err(Error::Lapsed)), "{refused:?}");
    let after = reads::events_after(
        store.db(),
        "acme",
        conversation_id,
        Default::default(),
        1000,
    )
    .await
    .unwrap();
    assert_eq!(before, after, "nothing written");
    // The process that executes it does not sweep it.
    let executing = [claimed.id];
    assert_eq!(
        queue::reclaim(
            &store,
            Reclaim::Expired {
                executing: &executing
            },
            3
        )
        .await
        .unwrap(),
        0
    );
    assert!(matches!(
        queue::heartbeat(&store, &lease, 60_000).await.unwrap(),
        queue::Heartbeat::Renewed { .. }
    ));
    runs::checkpoint(&store, &lease, &texts(&begun, "renewed"))
        .await
        .unwrap();
    let row = run_row(&store, claimed.id).await;
    assert_eq!((row.status.as_str(), row.recoveries), ("RUNNING", 0));
    assert_eq!(row.lease_epoch, claimed.lease_epoch);
}

#[tokio::test]
async fn a_run_that_keeps_losing_its_worker_ends_with_recovery_limit() {
    let db = TestDb::new().await;
    let store = store(&db).await;
    let conversation_id = conversation(&store).await;
    let queued = send(&store, conversation_id, "hello").await;
    let budget = 2;
    for round in 0..=budget {
        let claimed = claim_one(&store, "doomed").await;
        runs::begin(&store, &Lease::of(&claimed)).await.unwrap();
        // The worker dies: nothing renews its lease.
        expire_lease(&store, claimed.id, 0).await;
        assert_eq!(
            queue::reclaim(&store, Reclaim::Expired { executing: &[] }, budget)
                .await
                .unwrap(),
            1
        );
        let row = run_row(&store, queued.id).await;
        if round < budget {
            assert_eq!(row.status, "QUEUED", "round {round}");
            assert_eq!(row.recoveries, round as i32 + 1);
        } else {
            assert_eq!(row.status, "FAILED");
            assert_eq!(row.end_cause.as_deref(), Some("RECOVERY_LIMIT"));
            let error = row.error.unwrap();
            assert_eq!(error["code"], "RECOVERY_LIMIT");
        }
    }
    assert!(
        queue::claim(&store, "doomed", 60_000, 1)
            .await
            .unwrap()
            .is_empty()
    );
}

/// The run `worker` claims (there must be one), leased for a minute.
async fn claim_one(store: &Store, worker: &str) -> run::Model {
    queue::claim(store, worker, 60_000, 1)
        .await
        .unwrap()
        .remove(0)
}

/// The run's row as it is committed.
async fn run_row(store: &Store, run_id: Uuid) -> run::Model {
    reads::run(store.db(), "acme", run_id)
        .await
        .unwrap()
        .unwrap()
}

/// Sets the run's lease to have run out at `at` (milliseconds), as if its
/// worker stopped renewing it.
async fn expire_lease(store: &Store, run_id: Uuid, at: i64) {
    let mut expired: run::ActiveModel = run::Entity::find_by_id(run_id)
        .one(store.db())
        .await
        .unwrap()
        .unwrap()
        .into();
    expired.lease_expires_at = Set(Some(at));
    expired.update(store.db()).await.unwrap();
}

#[tokio::test]
async fn a_restart_reclaims_only_the_leases_nobody_renewed_since_it_listed_them() {
    let db = TestDb::new().await;
    let store = store(&db).await;
    let conversation_id = conversation(&store).await;
    let queued = send(&store, conversation_id, "hello").await;
    let claimed = claim_one(&store, "instance-1").await;
    // A process with the same instance id starts while the first still
    // runs: it lists the leases under its id, and the first renews them.
    let held = queue::held_by(&store, "instance-1").await.unwrap();
    assert_eq!(held.len(), 1);
    assert!(matches!(
        queue::heartbeat(&store, &Lease::of(&claimed), 61_000)
            .await
            .unwrap(),
        queue::Heartbeat::Renewed { .. }
    ));
    assert_eq!(
        queue::reclaim(&store, Reclaim::Unrenewed(&held), 3)
            .await
            .unwrap(),
        0
    );
    let row = run_row(&store, queued.id).await;
    assert_eq!(row.status, "RUNNING");
    assert_eq!(row.lease_epoch, claimed.lease_epoch);

    // The first process is gone: nothing renews the lease between the
    // listing and the reclaim, which takes it at once.
    let held = queue::held_by(&store, "instance-1").await.unwrap();
    assert_eq!(
        queue::reclaim(&store, Reclaim::Unrenewed(&held), 3)
            .await
            .unwrap(),
        1
    );
    let row = run_row(&store, queued.id).await;
    assert_eq!(row.status, "QUEUED");
    assert_eq!(row.recoveries, 1);
}

/// The dispatcher's claim is each claimed run's first commit, on either
/// backend: the run is claimed and started (`run.started`) in one write
/// transaction.
#[tokio::test]
async fn a_claim_starts_its_runs_in_the_same_commit() {
    let db = TestDb::new().await;
    let store = store(&db).await;
    let conversation_id = conversation(&store).await;
    let queued = send(&store, conversation_id, "hello").await;
    let before = store.write_transactions();
    let taken = queue::take(&store, "instance-1", 60_000, 4).await.unwrap();
    assert_eq!(store.write_transactions() - before, 1, "one commit");
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].run.id, queued.id);
    assert_eq!(taken[0].run.status, "RUNNING");
    let begun = taken[0].begun.as_ref().expect("started with the claim");
    assert!(begun.part().is_some(), "its text part is open");
    let events = reads::events_after(store.db(), "acme", conversation_id, Default::default(), 100)
        .await
        .unwrap();
    let started = events
        .iter()
        .filter(|e| e.kind == EventKind::RunStarted && e.run_id == Some(queued.id))
        .count();
    assert_eq!(started, 1);
}

/// On PostgreSQL a claim that starts its runs also locks their
/// conversations, and skips a run whose conversation another transaction
/// holds instead of waiting for it (every other write locks a conversation
/// before its runs: a claim that waited, holding the run, could deadlock
/// with one of them). The run is taken by the claim after that
/// transaction ends.
#[tokio::test]
async fn a_claim_skips_a_run_whose_conversation_another_transaction_holds() {
    if !crate::support::on_postgres() {
        return;
    }
    let db = TestDb::new().await;
    let store = store(&db).await;
    let held = conversation(&store).await;
    let free = conversation(&store).await;
    let behind = send(&store, held, "hello").await;
    let ready = send(&store, free, "hello").await;
    let tx = store.begin_write().await.unwrap();
    tx.lock_conversation(held, "acme").await.unwrap();

    let taken = tokio::time::timeout(PATIENCE, queue::take(&store, "instance-1", 60_000, 4))
        .await
        .expect("the claim does not wait for the conversation's lock")
        .unwrap();
    let ids: Vec<Uuid> = taken.iter().map(|c| c.run.id).collect();
    assert_eq!(ids, [ready.id]);
    assert_eq!(run_row(&store, behind.id).await.status, "QUEUED");

    store.commit(tx).await.unwrap();
    let taken = queue::take(&store, "instance-1", 60_000, 4).await.unwrap();
    let ids: Vec<Uuid> = taken.iter().map(|c| c.run.id).collect();
    assert_eq!(ids, [behind.id]);
    assert!(taken[0].begun.is_some());
}

/// An append is one query on either backend (on PostgreSQL the sequence's
/// move, the rows and the NOTIFY in one statement), and numbers its events
/// on from the conversation's last, in the order given.
#[tokio::test]
async fn an_append_is_one_query_and_numbers_its_events_on() {
    use tether::domain::MessageRole;
    use tether::domain::event::NewEvent;
    use tether::domain::run::RunStatus;
    use tether::store::commit::Log;

    let db = TestDb::new().await;
    let store = store(&db).await;
    let conversation_id = conversation(&store).await;
    send(&store, conversation_id, "hello").await;
    let earlier = reads::events_after(store.db(), "acme", conversation_id, Default::default(), 100)
        .await
        .unwrap();
    let head = earlier.last().unwrap().cursor.0;

    let run = Uuid::now_v7();
    let new = vec![
        NewEvent::message_created(Uuid::now_v7(), MessageRole::User, None),
        NewEvent::run_status(run, RunStatus::Queued).unwrap(),
        NewEvent::message_created(Uuid::now_v7(), MessageRole::Assistant, Some(run)),
    ];
    let kinds: Vec<EventKind> = new.iter().map(|e| e.kind).collect();
    let log = Log {
        id: conversation_id,
        tenant: "acme",
    };
    let mut tx = store.begin_write().await.unwrap();
    let before = store.statements();
    tx.append(log, new).await.unwrap();
    assert_eq!(store.statements() - before, 1, "one query");
    let committed = store.commit(tx).await.unwrap();

    let cursors: Vec<i64> = committed.iter().map(|e| e.cursor.0).collect();
    assert_eq!(cursors, [head + 1, head + 2, head + 3]);
    let stored = reads::events_after(
        store.db(),
        "acme",
        conversation_id,
        earlier.last().unwrap().cursor,
        100,
    )
    .await
    .unwrap();
    let stored: Vec<(i64, EventKind, Option<Uuid>)> = stored
        .iter()
        .map(|e| (e.cursor.0, e.kind, e.run_id))
        .collect();
    let sent: Vec<(i64, EventKind, Option<Uuid>)> = committed
        .iter()
        .map(|e| (e.cursor.0, e.kind, e.run_id))
        .collect();
    assert_eq!(stored, sent);
    assert_eq!(sent.iter().map(|e| e.1).collect::<Vec<_>>(), kinds);
}

/// A run's last commit (`runs::finish`) asks whether the run has a tool
/// call without a result or a pending question in its fence's query, and
/// its parts' final texts go with the append, as its audit row does: the
/// fence, the run and the append: three queries on SQLite, and four on
/// PostgreSQL, where the conversation is locked first, in a statement of
/// its own (what the fence asks beside the run must be read once the lock
/// is held). A lease that moved on writes nothing; the text is saved, and
/// said.
#[tokio::test]
async fn a_run_s_last_commit_asks_what_is_open_with_its_fence() {
    use tether::domain::run::{EndCause, Usage};
    use tether::store::commit::Ending;

    let db = TestDb::new().await;
    let store = store(&db).await;
    let conversation_id = conversation(&store).await;
    let queued = send(&store, conversation_id, "hello").await;
    let taken = queue::take(&store, "instance-1", 60_000, 4).await.unwrap();
    let begun = taken[0].begun.as_ref().expect("started with the claim");
    let lease = Lease::of(&taken[0].run);
    let ending = Ending {
        cause: EndCause::Natural,
        error: None,
        reason: None,
        usage: Usage::default(),
        steps: 1,
    };
    let parts = texts(begun, "Hello!");

    let stale = Lease {
        epoch: lease.epoch - 1,
        ..lease.clone()
    };
    let refused = runs::finish(&store, &stale, &parts, ending.clone()).await;
    assert!(matches!(refused, Err(Error::Fenced)), "{refused:?}");
    assert_eq!(run_row(&store, queued.id).await.status, "RUNNING");

    let before = store.statements();
    runs::finish(&store, &lease, &parts, ending).await.unwrap();
    let queries = if crate::support::on_postgres() { 4 } else { 3 };
    assert_eq!(store.statements() - before, queries);
    let ended = run_row(&store, queued.id).await;
    assert_eq!((ended.status.as_str(), ended.steps), ("COMPLETED", 1));
    let events = reads::events_after(store.db(), "acme", conversation_id, Default::default(), 100)
        .await
        .unwrap();
    assert_eq!(events.last().unwrap().kind, EventKind::RunCompleted);
    let part = begun.part().unwrap();
    let saved = tether::store::entities::part::Entity::find_by_id(part.id)
        .one(store.db())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (saved.text.as_deref(), saved.state.as_str()),
        (Some("Hello!"), "DONE")
    );
    let said = events
        .iter()
        .find(|e| e.kind == EventKind::PartUpdated)
        .expect("part.updated");
    let said = serde_json::to_value(&said.body).unwrap();
    assert_eq!(said["partId"], part.id.to_string(), "{said}");
    assert_eq!(said["textLength"], 6, "{said}");
}

/// A run's end claims nothing when no run waits behind it: a message sent
/// after the run before it completed costs three write transactions
/// (`sendMessage`, the claim that starts it, its end), with no claim that
/// finds nothing after its end. A run queued behind another in its
/// conversation is claimed as soon as that one ends (its end wakes the
/// workers), not at the next poll, which this configuration puts a minute
/// away.
#[tokio::test]
async fn a_run_s_end_claims_only_when_a_run_waits_behind_it() {
    let db = TestDb::new().await;
    let store = store(&db).await;
    let conversation_id = conversation(&store).await;
    let engine = engine(&store, quiet_config(60_000, 4, 0), "engine");
    let completed = |run_id: Uuid| {
        let store = store.clone();
        async move {
            let deadline = tokio::time::Instant::now() + PATIENCE;
            loop {
                if run_row(&store, run_id).await.status == "COMPLETED" {
                    return;
                }
                assert!(tokio::time::Instant::now() < deadline, "run {run_id}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    completed(send(&store, conversation_id, "first").await.id).await;
    let before = store.write_transactions();
    for i in 0..10 {
        completed(
            send(&store, conversation_id, &format!("message {i}"))
                .await
                .id,
        )
        .await;
    }
    // The engine's start-up sweep (its first lease reap, at once) may come
    // after the first run and claim once more; a claim after each run's
    // end would make it 39 at least.
    let writes = store.write_transactions() - before;
    assert!((30..=31).contains(&writes), "{writes} write transactions");

    let ahead = send(&store, conversation_id, "ahead").await;
    let behind = send(&store, conversation_id, "behind").await;
    completed(ahead.id).await;
    completed(behind.id).await;
    engine.shutdown().await;
}

/// A run queued where no wake-up reaches this process (another process's
/// store, with a bus of its own) is claimed at the next poll, even while
/// this process's own runs keep ending more often than that: wake-ups that
/// claim nothing do not put the poll off.
#[tokio::test]
async fn the_poll_claims_a_run_nobody_woke_for_while_other_runs_end() {
    let db = TestDb::new().await;
    let (here, elsewhere) = (store(&db).await, store(&db).await);
    let engine = engine(&here, quiet_config(300, 32, 10), "engine");
    // Twelve runs ending about 150 ms apart, from about 0.2 s to 1.9 s.
    let mut busy = Vec::new();
    for i in 0..12 {
        let conversation_id = conversation(&here).await;
        let text = format!("/stream {}", 20 + 15 * i);
        busy.push(send(&here, conversation_id, &text).await.id);
    }
    let deadline = tokio::time::Instant::now() + PATIENCE;
    for run_id in &busy {
        while run_row(&here, *run_id).await.status == "QUEUED" {
            assert!(tokio::time::Instant::now() < deadline, "a busy run waits");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let quiet = conversation(&elsewhere).await;
    let unwoken = send(&elsewhere, quiet, "nobody here hears of me").await;
    loop {
        let mut still_running = 0;
        for run_id in &busy {
            if run_row(&here, *run_id).await.status != "COMPLETED" {
                still_running += 1;
            }
        }
        if run_row(&here, unwoken.id).await.status != "QUEUED" {
            assert!(still_running > 0, "claimed only once the busy runs ended");
            break;
        }
        assert!(
            still_running > 0,
            "every busy run ended and the run nobody woke for still waits"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    engine.shutdown().await;
}

/// 200 conversations, each with a run that failed `RECOVERY_LIMIT` and a
/// run queued behind it, requeued all at once while three engines claim
/// every 10 ms: no two runs of a conversation ever run at once (a claim
/// that read the queue before a requeue committed takes nothing), and
/// every run ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeues_racing_claims_never_run_two_runs_of_a_conversation_at_once() {
    let db = TestDb::new().await;
    let store = store(&db).await;
    let mut conversations = Vec::new();
    let mut failed = Vec::new();
    for _ in 0..200 {
        let c = conversation(&store).await;
        let first = send(&store, c, "the one that keeps failing").await;
        let claimed = claim_one(&store, "doomed").await;
        assert_eq!(claimed.id, first.id);
        expire_lease(&store, first.id, 0).await;
        queue::reclaim(&store, Reclaim::Expired { executing: &[] }, 0)
            .await
            .unwrap();
        assert_eq!(
            run_row(&store, first.id).await.end_cause.as_deref(),
            Some("RECOVERY_LIMIT")
        );
        conversations.push(c);
        failed.push(first.id);
    }
    for c in &conversations {
        send(&store, *c, "the one behind it").await;
    }
    let operator = tether::store::commit::Operator {
        principal: "ops",
        issuer: None,
    };
    let requeue = |run_id: Uuid| queue::requeue(&store, operator, run_id, "try again");
    // Half are requeued before the engines start: each is then queued ahead
    // of the run behind it, which must wait for it.
    let (before, racing) = failed.split_at(failed.len() / 2);
    for run_id in before {
        requeue(*run_id).await.expect("nothing has started yet");
    }
    let config = quiet_config(10, 8, 1);
    let stores = [
        store.clone(),
        self::store(&db).await,
        self::store(&db).await,
    ];
    let engines: Vec<Runtime> = stores
        .iter()
        .enumerate()
        .map(|(i, s)| engine(s, config.clone(), &format!("engine-{i}")))
        .collect();
    // The other half race the engines' claims: refused when the run behind
    // started first; either is fine, and nothing else is.
    for run_id in racing {
        match requeue(*run_id).await {
            Ok(_) => {}
            Err(Error::Conflict(message)) => {
                assert!(message.contains("a later run"), "{message}")
            }
            Err(err) => panic!("requeue failed: {err:?}"),
        }
    }
    let deadline = tokio::time::Instant::now() + PATIENCE * 3;
    for c in &conversations {
        while !reads::unended_runs(store.db(), "acme", *c)
            .await
            .unwrap()
            .is_empty()
        {
            assert!(tokio::time::Instant::now() < deadline, "runs left");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for engine in engines {
        engine.shutdown().await;
    }
    for c in &conversations {
        let events = reads::events_after(store.db(), "acme", *c, Default::default(), 10_000)
            .await
            .unwrap();
        // In commit order: a run starts only when no other is running.
        let mut running: Option<Uuid> = None;
        for event in &events {
            match event.kind {
                EventKind::RunStarted => {
                    assert!(running.is_none(), "two runs at once in {c}: {events:?}");
                    running = event.run_id;
                }
                EventKind::RunCompleted | EventKind::RunFailed | EventKind::RunCancelled
                    if event.run_id == running =>
                {
                    running = None;
                }
                _ => {}
            }
        }
    }
}
