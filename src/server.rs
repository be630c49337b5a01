//! `tether serve`: migrate, bind, serve until SIGTERM or Ctrl-C.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;

use crate::api::{self, auth::Authenticator, auth::secret_file, context::Services};
use crate::bus::{self, Bus};
use crate::config::{Config, SecretSource};
use crate::connections::Connections;
use crate::runtime::{Runtime, RuntimeOptions};
use crate::store::{self, Pools, Store};
use crate::telemetry;
use crate::tools;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// The API and the workers.
    All,
    /// Only the API.
    Api,
    /// Only the workers.
    Worker,
}

pub async fn open_store(config: &Config) -> anyhow::Result<Store> {
    let pools = Pools::configured(&config.file.database, &config.file.api);
    Store::open(&config.database_url, Bus::new(), &pools)
        .await
        .map_err(|err| {
            let what = match err {
                store::Error::Connect { .. } => "cannot connect to the database",
                _ => "cannot migrate or open the database",
            };
            anyhow::Error::new(err).context(what)
        })
}

/// The verifier for `serve` and the signer for `tether token`: both find
/// the same secrets.
pub fn authenticator(config: &Config) -> anyhow::Result<Authenticator> {
    let secrets = match config.secret_source()? {
        SecretSource::Configured(secrets) => secrets,
        SecretSource::Generated(path) => {
            let secret = secret_file::load_or_create(&path)?;
            tracing::info!(
                file = %path.display(),
                "TETHER_JWT_SECRET is not set: using the generated secret kept in this file"
            );
            vec![secret]
        }
        SecretSource::None => Vec::new(),
    };
    let auth = &config.file.auth;
    if auth.jwks_url.is_some() && auth.audience.is_none() {
        tracing::warn!(
            "auth.jwks_url is set without auth.audience: tokens the identity provider issued \
             for any of its applications are accepted"
        );
    }
    Ok(Authenticator::from_config(auth, secrets)?)
}

/// How long start-up waits for the PostgreSQL listener's first connection.
const LISTENER_START: Duration = Duration::from_secs(5);

/// A server started in this process: the API (unless `Role::Worker`) on a
/// bound address, and the workers (unless `Role::Api`).
pub struct Running {
    pub addr: std::net::SocketAddr,
    pub store: Store,
    /// Stops the background tasks (the PostgreSQL listener).
    stopping: CancellationToken,
    /// Stops accepting connections.
    serving: CancellationToken,
    server: tokio::task::JoinHandle<()>,
    /// `/readyz` answers not-ready once it is set.
    draining: Arc<AtomicBool>,
    runtime: Option<Runtime>,
    /// Held for the process's life: dropping the file releases the lock.
    _worker_lock: Option<std::fs::File>,
}

impl Running {
    /// Stops serving, lets in-flight runs reach a commit point and gives
    /// them back, then returns.
    ///
    /// While in-flight runs drain, the API goes on serving and `/readyz`
    /// answers not-ready, so that a load balancer sends new work elsewhere
    /// before the listener closes.
    pub async fn shutdown(self) {
        self.draining.store(true, Ordering::Relaxed);
        if let Some(runtime) = self.runtime {
            runtime.shutdown().await;
        }
        self.serving.cancel();
        // Open WebSockets do not end by themselves; do not wait on them long.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), self.server).await;
        self.stopping.cancel();
    }
}

pub async fn start(config: Config, role: Role) -> anyhow::Result<Running> {
    // Before the database: a deployment without a usable secret stops at
    // once, with the variable to set.
    let auth = authenticator(&config)?;
    let worker_lock = match role {
        Role::Api => None,
        Role::All | Role::Worker => lock_sqlite_for_workers(&config)?,
    };
    let store = open_store(&config).await?;
    let stopping = CancellationToken::new();
    if config.file.metrics.enabled {
        if telemetry::install().is_none() {
            tracing::warn!("another metrics recorder is installed: /metrics answers 404");
        }
        tokio::spawn(telemetry::keep_up(stopping.clone()));
    }
    if config.database_url.starts_with("postgres") {
        bus::pg::spawn(
            config.database_url.clone(),
            store.bus().clone(),
            stopping.clone(),
        );
        // Ready means listening: serve once the listener is up, unless it
        // takes long (then `/readyz` says so until it is).
        if tokio::time::timeout(LISTENER_START, store.bus().until_listening())
            .await
            .is_err()
        {
            tracing::warn!("not listening for notifications yet; serving anyway");
        }
    }
    let file = Arc::new(config.file.clone());
    let connections = Arc::new(Connections::new(
        &config.file,
        config.encryption_key.as_ref(),
    ));
    let tools = Arc::new(
        tools::registry::Registry::from_config(&config.file)?.with_connections(connections.clone()),
    );
    let runtime = (role != Role::Api).then(|| {
        Runtime::start(
            store.clone(),
            file.clone(),
            tools,
            RuntimeOptions {
                instance_id: instance_id(),
                sole_owner: worker_lock.is_some(),
            },
        )
    });
    let services = Services::new(store.clone(), file, connections);
    let draining = services.draining.clone();
    let limits = api::listener::ConnectionLimits::of(&config.file.api);
    let serving = CancellationToken::new();
    if let Some(address) = config
        .file
        .metrics
        .listen
        .filter(|_| config.file.metrics.enabled)
    {
        let listener = TcpListener::bind(address)
            .await
            .with_context(|| format!("cannot listen on {address} (metrics.listen)"))?;
        tracing::info!(addr = %listener.local_addr()?, "serving /metrics");
        let app = api::metrics_router(services.clone());
        // Until the process ends: metrics are read through a drain too.
        tokio::spawn(api::listener::serve(
            listener,
            app,
            limits,
            stopping.clone(),
        ));
    }
    let app = match role {
        Role::Worker => api::health_router(services),
        Role::All | Role::Api => {
            tokio::spawn(api::feed::watch_heads(store.clone(), stopping.clone()));
            api::router(services, auth)
        }
    };
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, ?role, "serving");
    let server = tokio::spawn(api::listener::serve(listener, app, limits, serving.clone()));
    Ok(Running {
        addr,
        store,
        stopping,
        serving,
        server,
        draining,
        runtime,
        _worker_lock: worker_lock,
    })
}

/// On SQLite, the workers of one process alone may use the database: they
/// reclaim every lease at start-up, so a second worker process (an
/// overlapping deploy) would take runs from a live one. An exclusive lock
/// on `<database>.lock`, which the OS drops with the process, makes that
/// true; a second worker is refused. API-only processes take no lock.
/// `None` on PostgreSQL and for an in-memory SQLite database.
fn lock_sqlite_for_workers(config: &Config) -> anyhow::Result<Option<std::fs::File>> {
    let Some(database) = config.sqlite_file() else {
        return Ok(None);
    };
    if let Some(missing) = crate::store::missing_folder(&database) {
        anyhow::bail!(missing);
    }
    let mut path = database.into_os_string();
    path.push(".lock");
    let path = std::path::PathBuf::from(path);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open the worker lock file {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "another tether process runs workers on this SQLite database (it holds {}); \
             only one may, since it owns every run lease. Stop it first, or start this one \
             with --role api",
            path.display()
        ),
        Err(std::fs::TryLockError::Error(err)) => {
            Err(err).with_context(|| format!("cannot lock the worker lock file {}", path.display()))
        }
    }
}

/// `tether serve`: start, announce the address, run until SIGTERM or Ctrl-C.
pub async fn serve(config: Config, role: Role) -> anyhow::Result<()> {
    let running = start(config, role).await?;
    // Tests and scripts read this line to find a port chosen by the system.
    println!("tether listening on http://{}", running.addr);
    shutdown_signal().await;
    running.shutdown().await;
    Ok(())
}

/// `TETHER_INSTANCE_ID` names this process's leases, so that a restart
/// with the same id reclaims them at once; otherwise a fresh id.
fn instance_id() -> String {
    std::env::var("TETHER_INSTANCE_ID")
        .ok()
        .filter(|id| !id.is_empty())
        .unwrap_or_else(|| format!("tether-{}", uuid::Uuid::now_v7()))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutting down");
}
