//! Persistence: the connection, write transactions that append events, and
//! the reads the API and the runtime share. Backend differences live here.

pub mod commands;
pub mod connections;
pub mod entities;
pub mod interactions;
pub mod queue;
pub mod reads;
pub mod runs;
pub mod tool_calls;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use std::time::Duration;
use tokio::sync::{Mutex, OwnedMutexGuard};

use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::sqlx::sqlite::{SqliteJournalMode, SqliteSynchronous};
use sea_orm::{
    AccessMode, ActiveValue::Set, ColumnTrait, ConnectOptions, ConnectionTrait, Database,
    DatabaseBackend, DatabaseConnection, DatabaseTransaction, DbErr, EntityTrait, IsolationLevel,
    QueryFilter, QuerySelect, SqliteTransactionMode, Statement, TransactionOptions,
    TransactionTrait,
};
use tether_migrations::{Migrator, MigratorTrait};
use uuid::Uuid;

use crate::bus::{Bus, pg};
use crate::domain::cursor::Cursor;
use crate::domain::event::{Event, EventKind, NewEvent};
use crate::domain::time::now_millis;
use entities::{conversation, event};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("database error: {0}")]
    Database(#[from] DbErr),
    #[error("not found")]
    NotFound,
    #[error("{0}")]
    Conflict(String),
    /// The caller's lease was taken over or the run moved on: nothing was
    /// written, and the caller must stop working on the run.
    #[error("the lease on this run is no longer held")]
    Fenced,
    /// Input refused before anything changed, naming the field when there
    /// is one.
    #[error("{message}")]
    Invalid {
        key: Option<String>,
        message: String,
    },
    /// The run's cancellation was requested: a worker must not start an
    /// effect or park it, and ends it `CANCELLED` instead.
    #[error("the run's cancellation was requested")]
    CancelRequested,
    /// A policy refuses it.
    #[error("{0}")]
    Forbidden(String),
    /// A service it needs (an authorization server) could not be reached;
    /// nothing changed, and it may be tried again.
    #[error("{0}")]
    Unavailable(String),
    /// A stored value this build cannot read: refuse rather than guess.
    #[error("corrupt stored data: {0}")]
    Corrupt(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The database and the live bus that commits are announced on.
#[derive(Clone)]
pub struct Store {
    db: DatabaseConnection,
    /// The API's reads only: snapshots and subscription catch-up.
    reads: DatabaseConnection,
    read_statements: Arc<AtomicU64>,
    bus: Bus,
    writes: Arc<AtomicU64>,
    /// SQLite has one writer: writers of this process queue here instead of
    /// spinning in SQLite's busy handler, whose sleeps grow to 100 ms.
    write_lane: Option<Arc<Mutex<()>>>,
}

/// API read connections when the caller does not say.
pub const DEFAULT_READ_CONNECTIONS: u32 = 8;

/// On SQLite, WAL, a busy timeout, the file created if missing, and foreign
/// keys; on every backend, a pool of at most `max` connections.
fn connect_options(url: &str, max: u32, min: u32) -> ConnectOptions {
    let mut options = ConnectOptions::new(url.to_owned());
    options
        .sqlx_logging(false)
        .acquire_timeout(Duration::from_secs(30))
        .max_connections(max)
        .min_connections(min);
    if url.starts_with("sqlite:") {
        options.map_sqlx_sqlite_opts(|o| {
            o.journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(10))
                .create_if_missing(true)
                .foreign_keys(true)
        });
    }
    options
}

/// The right to write, held until a write's commit (SQLite only).
pub(crate) type WriteLane = Option<OwnedMutexGuard<()>>;

impl Store {
    /// Connects with settings fit for concurrent use, and with the default
    /// pool for API reads.
    pub async fn connect(url: &str, bus: Bus) -> Result<Store> {
        Store::connect_with(url, bus, DEFAULT_READ_CONNECTIONS).await
    }

    /// Connects two pools: one for writes and the workers' reads, and one of
    /// `read_connections` for the API's read snapshots, so that expensive
    /// queries wait for connections of their own and never for the workers'.
    /// On SQLite, WAL lets those snapshots read beside the writer.
    pub async fn connect_with(url: &str, bus: Bus, read_connections: u32) -> Result<Store> {
        let sqlite = url.starts_with("sqlite:");
        let main = if sqlite { 8 } else { 16 };
        let db = Database::connect(connect_options(url, main, 1)).await?;
        let read_statements = Arc::new(AtomicU64::new(0));
        // Each pool opened on an in-memory URL is a database of its own: the
        // API reads through the main pool there.
        let in_memory = sqlite && (url.contains(":memory:") || url.contains("mode=memory"));
        let reads = if in_memory {
            db.clone()
        } else {
            // After the main pool, which has created the file and turned WAL on.
            let mut reads = Database::connect(connect_options(url, read_connections, 0)).await?;
            let counter = read_statements.clone();
            reads.set_metric_callback(move |_| {
                counter.fetch_add(1, Ordering::Relaxed);
            });
            reads
        };
        Ok(Store {
            db,
            reads,
            read_statements,
            bus,
            writes: Arc::default(),
            write_lane: sqlite.then(Arc::default),
        })
    }

    pub async fn migrate(&self) -> Result<()> {
        Migrator::up(&self.db, None).await?;
        Ok(())
    }

    pub fn db(&self) -> &DatabaseConnection {
        &self.db
    }

    /// The API's read pool, for its reads outside a snapshot (subscription
    /// catch-up), so that they too leave the workers' connections alone.
    pub fn api_reads(&self) -> &DatabaseConnection {
        &self.reads
    }

    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// Write transactions begun by this store so far (for benchmarks).
    pub fn write_transactions(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Statements run on the API's read pool so far (for tests and
    /// benchmarks).
    pub fn read_statements(&self) -> u64 {
        self.read_statements.load(Ordering::Relaxed)
    }

    /// Waits for this process's turn to write and counts the write. Every
    /// write takes it: transactions through `begin_write`, single statements
    /// directly.
    pub(crate) async fn write_lane(&self) -> WriteLane {
        self.writes.fetch_add(1, Ordering::Relaxed);
        match &self.write_lane {
            Some(lane) => Some(lane.clone().lock_owned().await),
            None => None,
        }
    }

    pub fn backend(&self) -> DatabaseBackend {
        self.db.get_database_backend()
    }

    pub async fn ping(&self) -> Result<()> {
        self.db.ping().await?;
        Ok(())
    }

    /// Begins a write transaction. On SQLite it is `BEGIN IMMEDIATE`, so two
    /// writers never deadlock upgrading a read lock.
    pub async fn begin_write(&self) -> Result<WriteTx> {
        let lane = self.write_lane().await;
        let tx = self
            .db
            .begin_with_options(TransactionOptions {
                sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
                ..Default::default()
            })
            .await?;
        let notify_as = (self.backend() == DatabaseBackend::Postgres).then(|| self.bus.origin());
        Ok(WriteTx {
            tx,
            events: Vec::new(),
            notify_as,
            _lane: lane,
        })
    }

    /// Begins a read-only transaction whose reads all see one snapshot, on
    /// the API's pool.
    pub async fn begin_snapshot(&self) -> Result<DatabaseTransaction> {
        let options = match self.backend() {
            DatabaseBackend::Postgres => TransactionOptions {
                isolation_level: Some(IsolationLevel::RepeatableRead),
                access_mode: Some(AccessMode::ReadOnly),
                ..Default::default()
            },
            // A deferred SQLite transaction in WAL mode reads one snapshot
            // from its first statement on.
            _ => TransactionOptions::default(),
        };
        Ok(self.reads.begin_with_options(options).await?)
    }

    /// Commits, then announces the transaction's events on the bus. This is
    /// the one place persisted events are fanned out.
    pub async fn commit(&self, write: WriteTx) -> Result<Vec<Event>> {
        write.tx.commit().await?;
        self.bus.publish(&write.events);
        Ok(write.events)
    }
}

/// A write transaction that collects the events appended in it, to publish
/// once it has committed. Dropping it rolls back and publishes nothing.
pub struct WriteTx {
    tx: DatabaseTransaction,
    events: Vec<Event>,
    /// On PostgreSQL, this process's origin for NOTIFY payloads.
    notify_as: Option<Uuid>,
    _lane: WriteLane,
}

impl std::ops::Deref for WriteTx {
    type Target = DatabaseTransaction;
    fn deref(&self) -> &DatabaseTransaction {
        &self.tx
    }
}

impl WriteTx {
    /// Locks a conversation of `tenant` for the rest of the transaction, so
    /// that its writers serialize and its event sequence follows commit order.
    pub async fn lock_conversation(&self, id: Uuid, tenant: &str) -> Result<conversation::Model> {
        conversation::Entity::find_by_id(id)
            .filter(conversation::Column::Tenant.eq(tenant))
            .lock_exclusive()
            .one(&self.tx)
            .await?
            .ok_or(Error::NotFound)
    }

    /// Appends events to a conversation's log in this transaction. Sequence
    /// numbers come from the conversation row, whose lock is held until
    /// commit: a later number is always a later commit.
    pub async fn append(
        &mut self,
        conversation: &conversation::Model,
        new_events: Vec<NewEvent>,
    ) -> Result<()> {
        if new_events.is_empty() {
            return Ok(());
        }
        let count = new_events.len() as i64;
        let updated = conversation::Entity::update_many()
            .col_expr(
                conversation::Column::EventSeq,
                Expr::col(conversation::Column::EventSeq).add(count),
            )
            .filter(conversation::Column::Id.eq(conversation.id))
            .exec_with_returning(&self.tx)
            .await?;
        let last = updated.first().ok_or(Error::NotFound)?.event_seq;
        let at = now_millis();
        let mut rows = Vec::with_capacity(new_events.len());
        for (offset, new) in new_events.into_iter().enumerate() {
            let seq = last - count + 1 + offset as i64;
            let payload = serde_json::to_value(&new.body)
                .map_err(|e| Error::Corrupt(format!("event body: {e}")))?;
            rows.push(event::ActiveModel {
                conversation_id: Set(conversation.id),
                seq: Set(seq),
                tenant: Set(conversation.tenant.clone()),
                run_id: Set(new.run_id),
                kind: Set(new.kind.as_str().to_owned()),
                payload: Set(payload),
                created_at: Set(at),
            });
            self.events.push(Event {
                conversation_id: conversation.id,
                cursor: Cursor(seq),
                kind: new.kind,
                run_id: new.run_id,
                at,
                body: new.body,
            });
        }
        event::Entity::insert_many(rows).exec(&self.tx).await?;
        self.notify(pg::EVENTS, Some(conversation.id)).await?;
        if self.events.iter().any(|e| e.kind == EventKind::RunQueued) {
            self.notify(pg::QUEUED, None).await?;
        }
        Ok(())
    }

    /// Tells other processes that a run's cancellation was requested.
    pub async fn notify_cancel(&self, run_id: Uuid) -> Result<()> {
        self.notify(pg::CANCEL, Some(run_id)).await
    }

    /// NOTIFY inside the transaction, so it is delivered on commit only.
    async fn notify(&self, channel: &str, id: Option<Uuid>) -> Result<()> {
        let Some(origin) = self.notify_as else {
            return Ok(());
        };
        let payload = match id {
            Some(id) => format!("{origin}:{id}"),
            None => origin.to_string(),
        };
        self.tx
            .execute_raw(Statement::from_sql_and_values(
                DatabaseBackend::Postgres,
                "SELECT pg_notify($1, $2)",
                [channel.into(), payload.into()],
            ))
            .await?;
        Ok(())
    }
}

/// Whether a database error is a unique-constraint violation.
pub fn is_unique_violation(err: &DbErr) -> bool {
    matches!(
        err.sql_err(),
        Some(sea_orm::SqlErr::UniqueConstraintViolation(_))
    )
}

/// Rows are read back only through these helpers, which fail closed.
pub(crate) fn parse_stored<T: std::str::FromStr>(value: &str, what: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    value
        .parse()
        .map_err(|e: T::Err| Error::Corrupt(format!("{what}: {e}")))
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// A migrated store on a SQLite file of its own; remove the folder after.
    pub async fn temp_store() -> (Store, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("tether-store-{}", Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.join("t.db").display());
        let store = Store::connect(&url, Bus::new()).await.unwrap();
        store.migrate().await.unwrap();
        (store, dir)
    }

    /// Ada of tenant `acme`.
    pub fn ada() -> commands::Actor {
        commands::Actor {
            tenant: "acme".into(),
            principal: "ada".into(),
        }
    }

    /// A new conversation of Ada's with agent `demo`.
    pub async fn conversation(store: &Store) -> entities::conversation::Model {
        let new = commands::NewConversation {
            agent: "demo".into(),
            title: None,
        };
        commands::create_conversation(store, &ada(), new)
            .await
            .unwrap()
    }

    /// Ada's `hi` in the conversation, queued behind any active run; its run.
    pub async fn send_hi(
        store: &Store,
        conversation_id: Uuid,
        max_attempts: i32,
    ) -> entities::run::Model {
        let new = commands::NewMessage {
            conversation_id,
            text: "hi".into(),
            client_message_id: None,
            on_active_run: crate::domain::ActiveRunStrategy::Queue,
            max_attempts,
        };
        commands::send_message(store, &ada(), new).await.unwrap().1
    }

    /// A conversation of tenant `acme` with one queued run.
    pub async fn queued_run(store: &Store) -> entities::run::Model {
        let conversation = conversation(store).await;
        send_hi(store, conversation.id, 3).await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sea_orm::{ConnectionTrait, Statement};

    use super::Store;
    use super::test_support::temp_store;

    async fn pragma<T: sea_orm::TryGetable>(store: &Store, name: &str) -> T {
        let sql = format!("PRAGMA {name}");
        let row = store
            .db()
            .query_one_raw(Statement::from_string(store.backend(), sql))
            .await
            .unwrap()
            .unwrap();
        row.try_get_by_index(0).unwrap()
    }

    /// The API's reads do not queue behind the workers' connections.
    #[tokio::test]
    async fn snapshots_read_beside_a_busy_main_pool() {
        use sea_orm::TransactionTrait;
        let (store, dir) = temp_store().await;
        let mut held = Vec::new();
        for _ in 0..8 {
            held.push(store.db().begin().await.unwrap());
        }
        let snapshot = tokio::time::timeout(Duration::from_secs(10), store.begin_snapshot())
            .await
            .expect("a snapshot must not wait for the main pool")
            .unwrap();
        let row = snapshot
            .query_one_raw(Statement::from_string(store.backend(), "SELECT 1"))
            .await
            .unwrap();
        assert!(row.is_some());
        let read = tokio::time::timeout(
            Duration::from_secs(10),
            store
                .api_reads()
                .query_one_raw(Statement::from_string(store.backend(), "SELECT 1")),
        )
        .await
        .expect("the API's other reads must not wait for the main pool either")
        .unwrap();
        assert!(read.is_some());
        drop(snapshot);
        drop(held);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn sqlite_is_set_up_for_concurrent_use() {
        let (store, dir) = temp_store().await;
        assert_eq!(pragma::<String>(&store, "journal_mode").await, "wal");
        let timeout: i64 = pragma(&store, "busy_timeout").await;
        assert!(timeout >= 1000, "busy_timeout {timeout}");
        assert_eq!(pragma::<i64>(&store, "foreign_keys").await, 1);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
