//! Migrations over a database that already holds data: what a new column
//! is given for the rows already there.

use sea_orm::{ColumnTrait, ConnectOptions, Database, EntityTrait, QueryFilter, QueryOrder};
use tether::bus::Bus;
use tether::domain::ActiveRunStrategy;
use tether::store::commands::{self, NewConversation, NewMessage};
use tether::store::entities::{conversation, message, run};
use tether::store::{Actor, Store};
use tether_migrations::{Migrator, MigratorTrait};
use uuid::Uuid;

use crate::support::TestDb;

fn ada() -> Actor {
    Actor {
        tenant: "acme".into(),
        principal: "ada".into(),
    }
}

async fn send(store: &Store, conversation: Uuid) -> run::Model {
    let new = NewMessage {
        conversation_id: conversation,
        text: "hi".into(),
        client_message_id: None,
        on_active_run: ActiveRunStrategy::Queue,
        max_attempts: 1,
    };
    commands::send_message(store, &ada(), new).await.unwrap().1
}

/// `m0008_run_order` numbers the runs already stored in their id order,
/// per conversation, and gives their messages and conversations the
/// numbers to go on from.
#[tokio::test]
async fn runs_already_stored_are_numbered_in_their_order() {
    let db = TestDb::new().await;
    let store = Store::connect(&db.url, Bus::new()).await.unwrap();
    store.migrate().await.unwrap();
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
    let mut options = ConnectOptions::new(db.url.clone());
    options.max_connections(1).sqlx_logging(false);
    let alone = Database::connect(options).await.unwrap();
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
