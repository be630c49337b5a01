//! `tether serve`: migrate, bind, serve until SIGTERM or Ctrl-C.

use std::sync::Arc;

use anyhow::Context as _;
use axum::serve::ListenerExt;
use tokio::net::TcpListener;

use crate::api::{self, auth::Authenticator, auth::DEVELOPMENT_SECRET, context::Services};
use crate::bus::{self, Bus};
use crate::config::Config;
use crate::runtime::{Runtime, RuntimeOptions};
use crate::store::Store;
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
    let store = Store::connect_with(
        &config.database_url,
        Bus::new(),
        config.file.api.read_connections,
    )
    .await
    .context("cannot connect to the database")?;
    store.migrate().await.context("migrations failed")?;
    Ok(store)
}

pub fn authenticator(config: &Config) -> anyhow::Result<Authenticator> {
    let secret = config.jwt_secret.as_deref().unwrap_or(DEVELOPMENT_SECRET);
    Authenticator::new(secret).context("TETHER_JWT_SECRET is not a usable HS256 secret")
}

/// A server started in this process: the API (unless `Role::Worker`) on a
/// bound address, and the workers (unless `Role::Api`).
pub struct Running {
    pub addr: std::net::SocketAddr,
    pub store: Store,
    stopping: CancellationToken,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    runtime: Option<Runtime>,
}

impl Running {
    /// Stops serving, lets in-flight runs reach a commit point and gives
    /// them back, then returns.
    pub async fn shutdown(self) {
        self.stopping.cancel();
        if let Some(runtime) = self.runtime {
            runtime.shutdown().await;
        }
        // Open WebSockets do not end by themselves; do not wait on them long.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), self.server).await;
    }
}

pub async fn start(config: Config, role: Role) -> anyhow::Result<Running> {
    if config.jwt_secret.is_none() {
        tracing::warn!(
            "TETHER_JWT_SECRET is not set: using the development secret (loopback only)"
        );
    }
    let store = open_store(&config).await?;
    let auth = authenticator(&config)?;
    let stopping = CancellationToken::new();
    if config.database_url.starts_with("postgres") {
        bus::pg::spawn(
            config.database_url.clone(),
            store.bus().clone(),
            stopping.clone(),
        );
    }
    let file = Arc::new(config.file.clone());
    let tools = Arc::new(tools::registry::Registry::from_config(&config.file)?);
    let runtime = (role != Role::Api).then(|| {
        Runtime::start(
            store.clone(),
            file.clone(),
            tools,
            RuntimeOptions {
                instance_id: instance_id(),
                sole_owner: config.database_url.starts_with("sqlite:"),
            },
        )
    });
    let services = Services {
        store: store.clone(),
        config: file,
    };
    let app = match role {
        Role::Worker => api::health_router(services),
        Role::All | Role::Api => api::router(services, auth),
    };
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, ?role, "serving");
    // Events are small frames: without TCP_NODELAY, Nagle's algorithm and a
    // client's delayed ACK hold them back by tens of milliseconds.
    let listener = listener.tap_io(|tcp| {
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::debug!(error = %err, "cannot set TCP_NODELAY");
        }
    });
    let stopping = CancellationToken::new();
    let server =
        axum::serve(listener, app).with_graceful_shutdown(stopping.clone().cancelled_owned());
    let server = tokio::spawn(async move { server.await });
    Ok(Running {
        addr,
        store,
        stopping,
        server,
        runtime,
    })
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
