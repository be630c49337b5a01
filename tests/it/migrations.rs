//! Migrations over a database that already holds data: what a new column
//! is given for the rows already there.

use sea_orm::{
    ColumnTrait, ConnectOptions, ConnectionTrait, Database, DatabaseConnection, EntityTrait,
    QueryFilter, QueryOrder, Statement, TransactionTrait,
};
use tether::bus::Bus;
use tether::domain::ActiveRunStrategy;
use tether::store::commands::{self, MaxAttempts, NewConversation, NewMessage};
use tether::store::entities::{conversation, message, run};
use tether::store::{Actor, Pools, Store};
use tether_migrations::{Migrator, MigratorTrait};
use uuid::Uuid;

use crate::support::TestDb;

/// One connection to the database, outside any store's pools.
async fn alone(url: &str) -> DatabaseConnection {
    let mut options = ConnectOptions::new(url.to_owned());
    options.max_connections(1).sqlx_logging(false);
    Database::connect(options).await.unwrap()
}

fn ada() -> Actor {
    Actor {
        tenant: "acme".into(),
        principal: "ada".into(),
        delegate: false,
    }
}

async fn send(store: &Store, conversation: Uuid) -> run::Model {
    let new = NewMessage {
        conversation_id: conversation,
        text: "hi".into(),
        client_message_id: None,
        on_active_run: ActiveRunStrategy::Queue,
        max_attempts: MaxAttempts::Fixed(1),
    };
    commands::send_message(store, &ada(), new).await.unwrap().1
}

/// `m0008_run_order` numbers the runs already stored in their id order,
/// per conversation, and gives their messages and conversations the
/// numbers to go on from.
#[tokio::test]
async fn runs_already_stored_are_numbered_in_their_order() {
    let db = TestDb::new().await;
    let store = Store::open(&db.url, Bus::new(), &Pools::default())
        .await
        .unwrap();
    let mut conversations = Vec::new();
    for runs in [3, 2] {
        let new = NewConversation {
            agent: "demo".into(),
            title: None,
        };
        let id = commands::create_conversation(&store, &ada(), new)
            .await
            .unwrap()
            .id;
        for _ in 0..runs {
            send(&store, id).await;
        }
        conversations.push((id, runs));
    }
    // Back to the schema before the numbers (m0008, the eighth migration:
    // every later one is undone too), and forward again, as a deployment
    // migrates: on a connection of its own, the server's pool closed.
    // Through the pool, under load, `up` failed now and then with
    // "duplicate column name", most likely on a pooled SQLite connection
    // that still had the schema from before `down` cached.
    store.db().clone().close().await.unwrap();
    drop(store);
    let alone = alone(&db.url).await;
    let after_the_seventh = u32::try_from(Migrator::migrations().len() - 7).unwrap();
    Migrator::down(&alone, Some(after_the_seventh))
        .await
        .unwrap();
    Migrator::up(&alone, None).await.unwrap();
    alone.close().await.unwrap();
    let store = Store::connect(&db.url, Bus::new()).await.unwrap();

    for (id, runs) in &conversations {
        let rows = run::Entity::find()
            .filter(run::Column::ConversationId.eq(*id))
            .order_by_asc(run::Column::Id)
            .all(store.db())
            .await
            .unwrap();
        let numbers: Vec<i64> = rows.iter().map(|r| r.seq).collect();
        assert_eq!(numbers, (1..=*runs as i64).collect::<Vec<_>>());
        for row in &rows {
            let messages = message::Entity::find()
                .filter(message::Column::RunId.eq(row.id))
                .all(store.db())
                .await
                .unwrap();
            assert!(!messages.is_empty());
            assert!(
                messages.iter().all(|m| m.run_seq == row.seq),
                "{messages:?}"
            );
        }
        let conversation = conversation::Entity::find_by_id(*id)
            .one(store.db())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(conversation.run_seq, *runs as i64);
        assert_eq!(send(&store, *id).await.seq, *runs as i64 + 1);
    }
}

/// A store opened on a database that an earlier version left compiles its
/// statements, on every connection of both pools, against the migrated
/// schema. An SQLite connection opened before the migration would compile
/// a quoted column it did not know yet as a string, and its result would
/// name that column `"steering"`, quotes and all: a model read back from
/// it (`UPDATE … RETURNING "steering"`, as sea-orm writes it) misses the
/// column. On PostgreSQL, which resolves names on the server, it passes
/// either way: the test is SQLite's.
#[tokio::test]
async fn every_pooled_connection_sees_the_migrated_schema() {
    let db = TestDb::new().await;
    // The schema as it was before m0010, the tenth migration, which added
    // `runs.steering`.
    let earlier = alone(&db.url).await;
    Migrator::up(&earlier, Some(9)).await.unwrap();
    earlier.close().await.unwrap();

    let pools = Pools::default();
    let store = Store::open(&db.url, Bus::new(), &pools).await.unwrap();
    let backend = store.backend();
    let main = match backend {
        sea_orm::DatabaseBackend::Postgres => 16,
        _ => 8,
    };
    let probe = Statement::from_string(
        backend,
        r#"SELECT "steering" FROM (SELECT 1 AS one) AS one LEFT JOIN runs ON 1 = 0"#,
    );
    for (pool, size) in [
        (store.db(), main),
        (store.api_reads(), pools.read_connections),
    ] {
        // Each open transaction holds a connection of its own: all of the
        // pool's at once.
        let mut held = Vec::new();
        for _ in 0..size {
            held.push(pool.begin().await.unwrap());
        }
        for tx in &held {
            let row = tx.query_one_raw(probe.clone()).await.unwrap().unwrap();
            assert_eq!(row.column_names(), ["steering"]);
        }
    }
}
