//! PostgreSQL LISTEN/NOTIFY between processes sharing a database. Writers
//! notify inside their transactions (delivered on commit only); a listener
//! per process turns notifications into the bus's signals. Notifications
//! are hints: while the listener reconnects some are lost, so it then pokes
//! every subscriber and worker, and both also poll.

use std::time::Duration;

use sea_orm::sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::Bus;

/// `origin:conversation_id`: a conversation's log grew.
pub const EVENTS: &str = "tether_events";
/// `origin`: a run was queued.
pub const QUEUED: &str = "tether_queued";
/// `origin:run_id`: a run's cancellation was requested.
pub const CANCEL: &str = "tether_cancel";

/// Relays other processes' notifications to this process's bus until
/// `stop`.
pub fn spawn_listener(
    url: String,
    bus: Bus,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        tokio::select! {
            () = listen(&url, &bus) => {}
            () = stop.cancelled() => {}
        }
    })
}

async fn listen(url: &str, bus: &Bus) {
    loop {
        let mut listener = match PgListener::connect(url).await {
            Ok(listener) => listener,
            Err(err) => {
                tracing::warn!(error = %err, "cannot connect to listen for notifications");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if let Err(err) = listener.listen_all([EVENTS, QUEUED, CANCEL]).await {
            tracing::warn!(error = %err, "LISTEN failed");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        loop {
            match listener.try_recv().await {
                Ok(Some(notification)) => {
                    relay(bus, notification.channel(), notification.payload())
                }
                // The connection dropped: what was sent meanwhile is lost.
                Ok(None) => {
                    bus.poke_all();
                    bus.wake_workers();
                }
                Err(err) => {
                    tracing::warn!(error = %err, "listening for notifications failed");
                    bus.poke_all();
                    bus.wake_workers();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
            }
        }
    }
}

fn relay(bus: &Bus, channel: &str, payload: &str) {
    let (origin, id) = payload.split_once(':').unwrap_or((payload, ""));
    if origin == bus.origin().to_string() {
        return;
    }
    let id = Uuid::try_parse(id).ok();
    match (channel, id) {
        (EVENTS, Some(conversation_id)) => bus.poke(conversation_id),
        (QUEUED, _) => bus.wake_workers(),
        (CANCEL, Some(run_id)) => bus.request_cancel(run_id),
        _ => tracing::debug!(channel, payload, "ignored notification"),
    }
}
