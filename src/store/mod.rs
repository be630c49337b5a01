//! Persistence: the connection, write transactions that append events, and
//! the reads the API and the runtime share. Backend differences live here.

pub mod clock;
pub mod commands;
pub mod commit;
pub mod connections;
pub mod entities;
pub mod interactions;
pub mod operations;
pub mod queue;
pub mod reads;
pub mod runs;
pub mod tool_calls;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use std::time::Duration;
use tokio::sync::Mutex;

use sea_orm::sqlx::sqlite::{SqliteJournalMode, SqliteSynchronous};
use sea_orm::{
    AccessMode, ConnectOptions, ConnectionTrait, Database, DatabaseBackend, DatabaseConnection,
    DatabaseTransaction, DbErr, IsolationLevel, Statement, TransactionOptions, TransactionTrait,
};
use tether_migrations::{Migrator, MigratorTrait};

use crate::bus::Bus;
use crate::config::{ApiConfig, DatabaseConfig};
use crate::domain::retry::RetryPolicy;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("database error: {0}")]
    Database(#[from] DbErr),
    /// The database could not be opened at start-up: where (its URL with
    /// any password removed, or its file) and why, in words.
    #[error("{target}: {cause}")]
    Connect { target: String, cause: String },
    #[error("not found")]
    NotFound,
    #[error("{0}")]
    Conflict(String),
    /// The caller's lease was taken over or the run moved on: nothing was
    /// written, and the caller must stop working on the run.
    #[error("the lease on this run is no longer held")]
    Fenced,
    /// The caller's lease ran out on the database's clock (the database
    /// could not be reached for longer than a lease, or the worker
    /// stalled), though nobody took the run: nothing was written. The
    /// caller renews it (`queue::heartbeat`) before it writes, or stops.
    #[error("the lease on this run ran out")]
    Lapsed,
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
    /// A write failed inside this process (a bug that panicked, a group
    /// commit stopped by shutdown); nothing of it was kept.
    #[error("the write failed: {0}")]
    WriteFailed(&'static str),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Who acts: every write belongs to the caller's tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    pub tenant: String,
    pub principal: String,
    /// May act on other principals' runs of its tenant: decide, answer,
    /// cancel (a token with `auth.delegation_claim`, or an operator's).
    /// Without it, another principal's run and its pauses are `NotFound`.
    pub delegate: bool,
}

impl Actor {
    /// Whether this actor may act on a run of `principal`'s.
    pub fn acts_for(&self, principal: &str) -> bool {
        self.delegate || self.principal == principal
    }
}

/// The database and the live bus that commits are announced on.
#[derive(Clone)]
pub struct Store {
    db: DatabaseConnection,
    /// The API's reads only: snapshots and subscription catch-up.
    reads: DatabaseConnection,
    read_statements: Arc<AtomicU64>,
    /// Queries run on the main pool (writes and the workers' reads).
    statements: Arc<AtomicU64>,
    bus: Bus,
    writes: Arc<AtomicU64>,
    /// SQLite has one writer: writers of this process queue here instead of
    /// spinning in SQLite's busy handler, whose sleeps grow to 100 ms.
    write_lane: Option<Arc<Mutex<()>>>,
    /// SQLite: writes waiting to be committed together (`commit/group.rs`).
    pending: Option<Arc<commit::Pending>>,
}

/// How much of a SQLite file each connection maps (`PRAGMA mmap_size`).
const SQLITE_MMAP_BYTES: u64 = 256 << 20;

/// The PostgreSQL advisory lock migrations hold (a fixed key: "tether" in
/// ASCII).
const MIGRATION_LOCK: i64 = 0x7465_7468_6572;

/// The connection pools' settings (`[database]` and `api.read_connections`).
#[derive(Debug, Clone)]
pub struct Pools {
    /// The pool for writes and the workers' reads; `None`: 8 on SQLite, 16
    /// on PostgreSQL.
    pub connections: Option<u32>,
    /// The API's read pool.
    pub read_connections: u32,
    /// How long a query waits for a free connection.
    pub acquire_timeout: Duration,
    /// PostgreSQL's `statement_timeout` on every pooled connection.
    pub statement_timeout: Option<Duration>,
}

impl Pools {
    /// The pools that `[database]` and `[api]` configure.
    pub fn configured(database: &DatabaseConfig, api: &ApiConfig) -> Pools {
        Pools {
            connections: database.connections,
            read_connections: api.read_connections,
            acquire_timeout: Duration::from_secs_f64(database.acquire_timeout_secs),
            statement_timeout: (database.statement_timeout_secs > 0.0)
                .then(|| Duration::from_secs_f64(database.statement_timeout_secs)),
        }
    }
}

impl Default for Pools {
    /// The configuration's defaults.
    fn default() -> Self {
        Pools::configured(&DatabaseConfig::default(), &ApiConfig::default())
    }
}

/// Whether `url` names an SQLite database in memory: each connection
/// opened on it is a database of its own.
fn in_memory(url: &str) -> bool {
    url.starts_with("sqlite:") && (url.contains(":memory:") || url.contains("mode=memory"))
}

/// On SQLite, WAL, a busy timeout, the file created if missing, foreign
/// keys, a mapped file, and no ping when a connection is taken from the
/// pool; on PostgreSQL, the statement timeout; on every backend, a pool of
/// at most `max` connections.
fn connect_options(url: &str, max: u32, min: u32, pools: &Pools) -> ConnectOptions {
    let mut options = ConnectOptions::new(url.to_owned());
    options
        .sqlx_logging(false)
        .acquire_timeout(pools.acquire_timeout)
        .max_connections(max)
        .min_connections(min);
    if url.starts_with("sqlite:") {
        options.map_sqlx_sqlite_opts(|o| {
            o.journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(10))
                .create_if_missing(true)
                .foreign_keys(true)
                // Pages read from a map of the file, not one read(2) each.
                .pragma("mmap_size", SQLITE_MMAP_BYTES.to_string())
        });
        // A pooled connection to a file does not go stale: no ping (a round
        // trip to its thread) each time one is taken from the pool.
        options.test_before_acquire(false);
    } else if let Some(timeout) = pools.statement_timeout {
        // PostgreSQL keeps sqlx's ping on every acquire: a server restart
        // cuts pooled connections however recently they were used, and a
        // dead one must not be handed to a request.
        let ms = format!("{}ms", timeout.as_millis());
        options.map_sqlx_postgres_opts(move |o| o.options([("statement_timeout", ms.as_str())]));
    }
    options
}

/// Brings the schema at `url` up to date, through a connection of its own
/// and without the pools' statement timeout (a migration may take longer
/// than any query should). On PostgreSQL the connection holds an advisory
/// lock meanwhile, so that instances started together migrate one after
/// another (the later ones find nothing to do). Not for an SQLite database
/// in memory, which is the connection's own: `Store::open` migrates that
/// one through its pool.
pub async fn migrate(url: &str) -> Result<()> {
    if in_memory(url) {
        return Err(Error::Conflict(
            "an SQLite database in memory is migrated by Store::open, through its pool".into(),
        ));
    }
    let unlimited = Pools {
        statement_timeout: None,
        ..Pools::default()
    };
    let db = Database::connect(connect_options(url, 1, 1, &unlimited)).await?;
    let postgres = db.get_database_backend() == DatabaseBackend::Postgres;
    let lock = |sql: &str| {
        Statement::from_sql_and_values(DatabaseBackend::Postgres, sql, [MIGRATION_LOCK.into()])
    };
    if postgres {
        db.execute_raw(lock("SELECT pg_advisory_lock($1)")).await?;
    }
    let migrated = Migrator::up(&db, None).await;
    let unlocked = match postgres {
        true => db
            .execute_raw(lock("SELECT pg_advisory_unlock($1)"))
            .await
            .map(drop),
        false => Ok(()),
    };
    db.close().await?;
    migrated?;
    unlocked?;
    Ok(())
}

impl Store {
    /// Brings the schema up to date (`migrate`), then connects the pools
    /// (`connect_with`): the way to open a store that serves.
    ///
    /// In that order because an SQLite connection loads the schema when it
    /// opens and compiles its statements against it: one opened before a
    /// migration compiles a quoted column name it does not know yet as a
    /// string (SQLite's double-quoted strings). The statement still runs
    /// against the new schema, but sqlx keeps the result's column names
    /// from that first compile, so that a `RETURNING "steering"` reads
    /// back no `steering`. A pool opened after the migration has no such
    /// connection.
    pub async fn open(url: &str, bus: Bus, pools: &Pools) -> Result<Store> {
        probe(url, pools).await?;
        if in_memory(url) {
            let store = Store::pools(url, bus, pools).await?;
            Migrator::up(&store.db, None).await?;
            return Ok(store);
        }
        migrate(url).await?;
        Store::pools(url, bus, pools).await
    }

    /// Connects with settings fit for concurrent use, and with the default
    /// pools.
    pub async fn connect(url: &str, bus: Bus) -> Result<Store> {
        Store::connect_with(url, bus, &Pools::default()).await
    }

    /// Connects to a database whose schema is up to date (see `open`).
    pub async fn connect_with(url: &str, bus: Bus, pools: &Pools) -> Result<Store> {
        probe(url, pools).await?;
        Store::pools(url, bus, pools).await
    }

    /// Connects two pools: one for writes and the workers' reads, and one of
    /// `read_connections` for the API's read snapshots, so that expensive
    /// queries wait for connections of their own and never for the workers'.
    /// On SQLite, WAL lets those snapshots read beside the writer.
    async fn pools(url: &str, bus: Bus, pools: &Pools) -> Result<Store> {
        let sqlite = url.starts_with("sqlite:");
        let main = pools.connections.unwrap_or(if sqlite { 8 } else { 16 });
        let mut db = Database::connect(connect_options(url, main, 1, pools)).await?;
        let statements = Arc::new(AtomicU64::new(0));
        let counter = statements.clone();
        db.set_metric_callback(move |_| {
            counter.fetch_add(1, Ordering::Relaxed);
        });
        let read_statements = Arc::new(AtomicU64::new(0));
        // Each pool opened on an in-memory URL is a database of its own: the
        // API reads through the main pool there.
        let reads = if in_memory(url) {
            db.clone()
        } else {
            // After the main pool, which has created the file and turned WAL on.
            let mut reads =
                Database::connect(connect_options(url, pools.read_connections, 0, pools)).await?;
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
            statements,
            bus,
            writes: Arc::default(),
            write_lane: sqlite.then(Arc::default),
            pending: sqlite.then(Arc::default),
        })
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

    /// Queries run on the main pool so far, in and out of transactions,
    /// without `BEGIN` and `COMMIT`; a query of several statements (one
    /// hand-over to a SQLite connection's thread) counts once. For
    /// benchmarks.
    pub fn statements(&self) -> u64 {
        self.statements.load(Ordering::Relaxed)
    }

    /// Statements run on the API's read pool so far (for tests and
    /// benchmarks).
    pub fn read_statements(&self) -> u64 {
        self.read_statements.load(Ordering::Relaxed)
    }

    /// Each pool's connections, for the metrics: the pool for writes and
    /// the workers' reads, then the API's read pool.
    pub fn pool_usage(&self) -> Vec<crate::telemetry::Pool> {
        [("write", &self.db), ("read", &self.reads)]
            .into_iter()
            .map(|(name, db)| {
                let (size, idle, max) = match db.get_database_backend() {
                    DatabaseBackend::Postgres => {
                        let pool = db.get_postgres_connection_pool();
                        (
                            pool.size(),
                            pool.num_idle(),
                            pool.options().get_max_connections(),
                        )
                    }
                    _ => {
                        let pool = db.get_sqlite_connection_pool();
                        (
                            pool.size(),
                            pool.num_idle(),
                            pool.options().get_max_connections(),
                        )
                    }
                };
                let idle = u32::try_from(idle).unwrap_or(u32::MAX).min(size);
                crate::telemetry::Pool {
                    name,
                    in_use: size - idle,
                    idle,
                    max,
                }
            })
            .collect()
    }

    pub fn backend(&self) -> DatabaseBackend {
        self.db.get_database_backend()
    }

    pub async fn ping(&self) -> Result<()> {
        self.db.ping().await?;
        Ok(())
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
}

/// Opens one connection directly, before the pools: a pool retries a
/// failed connect until its acquire timeout and then reports only that it
/// timed out, so a wrong address, a stopped server or a missing folder would
/// be reported late and without its cause.
///
/// A new SQLite file is created first, readable by its owner only (0600),
/// as the generated secret beside it is: SQLite gives the WAL and
/// shared-memory files it makes the database file's permissions.
async fn probe(url: &str, pools: &Pools) -> Result<()> {
    use sea_orm::sqlx::{ConnectOptions as _, Connection as _};
    use sea_orm::sqlx::{postgres::PgConnectOptions, sqlite::SqliteConnectOptions};
    let target = crate::redact::url(url);
    let failed = |cause: String| Error::Connect {
        target: target.clone(),
        cause,
    };
    let within = pools.acquire_timeout;
    if url.starts_with("sqlite:") {
        let options = url
            .parse::<SqliteConnectOptions>()
            .map_err(|err| failed(crate::redact::message(&err.to_string())))?
            .create_if_missing(true);
        let file = options.get_filename().to_owned();
        if !in_memory(url)
            && let Err(err) = create_private(&file)
        {
            // SQLite's own open below fails the same way, and says why.
            tracing::debug!(error = %err, "cannot create the database file ahead of SQLite");
        }
        let opened = tokio::time::timeout(within, options.connect()).await;
        return match opened {
            Ok(Ok(connection)) => {
                let _ = connection.close().await;
                Ok(())
            }
            Ok(Err(err)) => Err(failed(sqlite_failure(&err, &file))),
            Err(_) => Err(failed(format!("no answer within {within:?}"))),
        };
    }
    let options = url
        .parse::<PgConnectOptions>()
        .map_err(|err| failed(crate::redact::message(&err.to_string())))?;
    let address = match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    match tokio::time::timeout(within, options.connect()).await {
        Ok(Ok(connection)) => {
            let _ = connection.close().await;
            Ok(())
        }
        Ok(Err(err)) => Err(failed(postgres_failure(&err, &address))),
        Err(_) => Err(failed(format!(
            "no answer from {address} within {}s",
            within.as_secs_f64()
        ))),
    }
}

/// Why a PostgreSQL connection failed, in words, with the address it went to.
fn postgres_failure(err: &sea_orm::sqlx::Error, address: &str) -> String {
    use sea_orm::sqlx::Error as Sqlx;
    use std::io::ErrorKind;
    match err {
        Sqlx::Io(io) => {
            let what = match io.kind() {
                ErrorKind::ConnectionRefused => "connection refused".to_owned(),
                ErrorKind::TimedOut => "connection timed out".to_owned(),
                ErrorKind::ConnectionReset => "connection reset".to_owned(),
                ErrorKind::NotFound => "no such host or socket".to_owned(),
                _ => io.to_string(),
            };
            format!("{what} at {address}")
        }
        Sqlx::Database(db) => format!("{} (at {address})", crate::redact::message(db.message())),
        other => format!(
            "{} (at {address})",
            crate::redact::message(&other.to_string())
        ),
    }
}

/// Why an SQLite database could not be opened, naming its file (and its
/// folder when that is what is missing).
fn sqlite_failure(err: &sea_orm::sqlx::Error, file: &std::path::Path) -> String {
    let why = match err {
        sea_orm::sqlx::Error::Database(db) => db.message().to_owned(),
        other => other.to_string(),
    };
    missing_folder(file).unwrap_or_else(|| format!("cannot open {}: {why}", file.display()))
}

/// Why an SQLite database file cannot be opened when its folder is missing
/// (SQLite itself says only "unable to open database file").
pub fn missing_folder(file: &std::path::Path) -> Option<String> {
    let folder = file.parent()?;
    (!folder.as_os_str().is_empty() && !folder.exists()).then(|| {
        format!(
            "cannot open {}: the folder {} does not exist",
            file.display(),
            folder.display()
        )
    })
}

/// Whether a database error is a unique-constraint violation.
/// Calls `op` until it succeeds, fails with an error `again` refuses, or
/// `within` has passed, waiting between calls as `policy` says: for what
/// must outlast a database restart (a subscription's read of the log, a
/// worker giving a run back).
pub async fn retry_within<T, F, Fut>(
    policy: &RetryPolicy,
    within: Duration,
    mut op: F,
    again: impl Fn(&Error) -> bool,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let started = tokio::time::Instant::now();
    let mut failures = 0;
    loop {
        match op().await {
            Err(err) if again(&err) && started.elapsed() < within => {
                failures += 1;
                tracing::debug!(error = %err, "the database failed; trying again");
                tokio::time::sleep(policy.delay(failures, None, fastrand::f64())).await;
            }
            result => return result,
        }
    }
}

impl Error {
    /// The database could not be reached, or dropped the connection (a
    /// restart, a cut connection, no free connection in the pool): nothing
    /// is wrong with what was asked, and it may be tried again later.
    pub fn is_unreachable(&self) -> bool {
        use sea_orm::sqlx::Error as Sqlx;
        let runtime = match self {
            Error::Database(DbErr::ConnectionAcquire(_)) => return true,
            Error::Database(DbErr::Conn(e) | DbErr::Exec(e) | DbErr::Query(e)) => e,
            _ => return false,
        };
        let sea_orm::RuntimeErr::SqlxError(err) = runtime else {
            return false;
        };
        match err.as_ref() {
            Sqlx::Io(_) | Sqlx::PoolTimedOut | Sqlx::PoolClosed | Sqlx::WorkerCrashed => true,
            // PostgreSQL's connection exceptions (class 08) and its
            // shutdowns (57P01 to 57P03: an administrator's command, a
            // crash, not accepting connections yet).
            Sqlx::Database(db) => db
                .code()
                .is_some_and(|code| code.starts_with("08") || code.starts_with("57P0")),
            _ => false,
        }
    }
}

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
    use uuid::Uuid;

    use super::*;

    /// A migrated store on a SQLite file of its own; remove the folder after.
    pub async fn temp_store() -> (Store, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("tether-store-{}", Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}?mode=rwc", dir.join("t.db").display());
        let store = Store::open(&url, Bus::new(), &Pools::default())
            .await
            .unwrap();
        (store, dir)
    }

    /// Ada of tenant `acme`.
    pub fn ada() -> Actor {
        Actor {
            tenant: "acme".into(),
            principal: "ada".into(),
            delegate: false,
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
            max_attempts: commands::MaxAttempts::Fixed(max_attempts),
        };
        commands::send_message(store, &ada(), new).await.unwrap().1
    }

    /// A conversation of tenant `acme` with one queued run.
    pub async fn queued_run(store: &Store) -> entities::run::Model {
        let conversation = conversation(store).await;
        send_hi(store, conversation.id, 3).await
    }

    /// A claimed, begun run of Ada's whose model asked for one call of
    /// `tool`, committed `REQUESTED`: the run's lease and the call.
    pub async fn requested_call(
        store: &Store,
        tool: &str,
    ) -> (commit::Lease, entities::tool_call::Model) {
        use serde_json::json;
        use tool_calls::{NewToolCall, Verdict};
        queued_run(store).await;
        let claimed = queue::claim(store, "w", 60_000, 1).await.unwrap();
        let lease = commit::Lease::of(&claimed[0]);
        let begun = runs::begin(store, &lease).await.unwrap();
        let parts: Vec<commit::PartText> = begun
            .part()
            .into_iter()
            .map(|part| commit::PartText {
                part,
                text: "ok".into(),
                data: None,
            })
            .collect();
        let call = NewToolCall {
            provider_call_id: "c1".into(),
            name: tool.into(),
            model_input: json!({ "text": "x" }),
            verdict: Verdict::Run(json!({ "text": "x" })),
        };
        let (mut calls, _) = tool_calls::request(store, &lease, &parts, vec![call], 16384, None)
            .await
            .unwrap();
        (lease, calls.remove(0))
    }

    /// The conversation's last event number.
    pub async fn event_seq(store: &Store, conversation_id: Uuid) -> i64 {
        use sea_orm::EntityTrait;
        entities::conversation::Entity::find_by_id(conversation_id)
            .one(store.db())
            .await
            .unwrap()
            .unwrap()
            .event_seq
    }

    /// The kinds of the conversation's events after `seq`, in order.
    pub async fn kinds_after(store: &Store, conversation_id: Uuid, seq: i64) -> Vec<String> {
        use entities::event;
        use sea_orm::{ColumnTrait, EntityTrait, QueryFilter, QueryOrder};
        event::Entity::find()
            .filter(event::Column::ConversationId.eq(conversation_id))
            .filter(event::Column::Seq.gt(seq))
            .order_by_asc(event::Column::Seq)
            .all(store.db())
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.kind)
            .collect()
    }
}

/// Creates `file`, empty and private to its owner, unless it exists; an
/// existing one that others may read or write is made private.
fn create_private(file: &std::path::Path) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    match options.open(file) {
        Ok(_) => Ok(()),
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {
            #[cfg(unix)]
            make_private(file);
            Ok(())
        }
        Err(err) => Err(err),
    }
}

/// Makes an existing database file, and its WAL and shared-memory files,
/// its owner's only if others may read or write them (their group's and
/// others' bits cleared, the owner's kept): files an earlier version
/// created 0644 are 0600 when the server next opens them, with a warning.
#[cfg(unix)]
fn make_private(file: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    for suffix in ["", "-wal", "-shm"] {
        let mut name = file.as_os_str().to_owned();
        name.push(suffix);
        let path = std::path::PathBuf::from(name);
        // A link is left as it is: its target may be anything.
        let Ok(metadata) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let mode = metadata.permissions().mode();
        if !metadata.is_file() || mode & 0o077 == 0 {
            continue;
        }
        match std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode & !0o077)) {
            Ok(()) => tracing::warn!(
                file = %path.display(),
                "the database file was open to other users; it is now its owner's only"
            ),
            Err(err) => tracing::warn!(
                file = %path.display(),
                error = %err,
                "the database file is open to other users and could not be made private"
            ),
        }
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
        let mapped: i64 = pragma(&store, "mmap_size").await;
        assert_eq!(mapped as u64, super::SQLITE_MMAP_BYTES);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// The database, its WAL and its shared memory are the owner's alone,
    /// as the generated secret beside them is.
    #[cfg(unix)]
    #[tokio::test]
    async fn sqlite_files_are_created_private_to_their_owner() {
        use std::os::unix::fs::PermissionsExt;
        let (store, dir) = temp_store().await;
        super::test_support::conversation(&store).await;
        let mut seen = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            seen.push((
                path.file_name().unwrap().to_string_lossy().into_owned(),
                mode,
            ));
        }
        for suffix in ["", "-wal", "-shm"] {
            assert!(
                seen.iter()
                    .any(|(name, _)| name.ends_with(&format!(".db{suffix}"))),
                "no {suffix} file: {seen:?}"
            );
        }
        assert!(seen.iter().all(|(_, mode)| *mode == 0o600), "{seen:?}");
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A database an earlier version created 0644 is made private when it
    /// is next opened, its WAL and shared-memory files too.
    #[cfg(unix)]
    #[tokio::test]
    async fn sqlite_files_open_to_others_are_made_private_when_opened() {
        use std::os::unix::fs::PermissionsExt;
        let (store, dir) = temp_store().await;
        super::test_support::conversation(&store).await;
        let files: Vec<_> = ["t.db", "t.db-wal", "t.db-shm"]
            .map(|name| dir.join(name))
            .into_iter()
            .filter(|path| path.exists())
            .collect();
        assert_eq!(files.len(), 3, "{files:?}");
        for file in &files {
            std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        let url = format!("sqlite://{}?mode=rwc", dir.join("t.db").display());
        let again = Store::open(&url, crate::bus::Bus::new(), &super::Pools::default())
            .await
            .unwrap();
        for file in &files {
            let mode = std::fs::metadata(file).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", file.display());
        }
        drop((store, again));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
