//! `tether serve`: migrate, bind, serve until SIGTERM or Ctrl-C.

use std::sync::Arc;

use anyhow::Context as _;
use tokio::net::TcpListener;

use crate::api::{self, auth::Authenticator, auth::DEVELOPMENT_SECRET, context::Services};
use crate::bus::Bus;
use crate::config::Config;
use crate::store::Store;

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
    let store = Store::connect(&config.database_url, Bus::new())
        .await
        .context("cannot connect to the database")?;
    store.migrate().await.context("migrations failed")?;
    Ok(store)
}

pub fn authenticator(config: &Config) -> anyhow::Result<Authenticator> {
    let secret = config.jwt_secret.as_deref().unwrap_or(DEVELOPMENT_SECRET);
    Authenticator::new(secret).context("TETHER_JWT_SECRET is not a usable HS256 secret")
}

pub async fn serve(config: Config, role: Role) -> anyhow::Result<()> {
    if config.jwt_secret.is_none() {
        tracing::warn!(
            "TETHER_JWT_SECRET is not set: using the development secret (loopback only)"
        );
    }
    let store = open_store(&config).await?;
    let auth = authenticator(&config)?;
    let services = Services {
        store,
        config: Arc::new(config.file.clone()),
    };
    if role == Role::Worker {
        tracing::info!("worker role: no workers exist yet in this build; serving health only");
    }
    let app = api::router(services, auth);
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let addr = listener.local_addr()?;
    // Tests and scripts read this line to find a port chosen by the system.
    println!("tether listening on http://{addr}");
    tracing::info!(%addr, ?role, "serving");
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    Ok(())
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
