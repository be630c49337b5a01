//! PostgreSQL LISTEN/NOTIFY between processes sharing a database. Writers
//! notify inside their transactions (delivered on commit only); a listener
//! per process turns notifications into the bus's signals. Notifications
//! are hints: while the listener reconnects some are lost, so it then pokes
//! every subscriber and worker, and both also poll.

use std::time::Duration;

use sea_orm::sqlx::{
    self,
    postgres::{PgListener, PgPoolOptions},
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::Bus;
use crate::domain::cursor::Cursor;
use crate::domain::event::{Event, EventBody, EventKind};
use crate::domain::retry::RetryPolicy;

/// `origin:conversation_id`: a conversation's log grew.
pub const EVENTS: &str = "tether_events";
/// `origin`: a run was queued.
pub const QUEUED: &str = "tether_queued";
/// `origin:run_id`: a run's cancellation was requested.
pub const CANCEL: &str = "tether_cancel";
/// A live `part.delta` as JSON (`RelayedDelta`), sent outside any
/// transaction.
pub const DELTAS: &str = "tether_deltas";

/// NOTIFY payloads must stay under 8000 bytes; larger deltas are not
/// relayed (the text arrives with the next checkpoint).
const MAX_PAYLOAD: usize = 7900;
/// Deltas waiting to be relayed before new ones are dropped.
const RELAY_BUFFER: usize = 1024;

#[derive(Serialize, Deserialize)]
struct RelayedDelta {
    origin: Uuid,
    conversation_id: Uuid,
    cursor: i64,
    run_id: Option<Uuid>,
    at: i64,
    body: EventBody,
}

/// Relays other processes' notifications to this process's bus, and this
/// process's live deltas to the others, until `stop`.
pub fn spawn(url: String, bus: Bus, stop: CancellationToken) {
    let (relay, deltas) = mpsc::channel(RELAY_BUFFER);
    bus.relay_deltas(relay);
    let (listen_url, listen_bus, listen_stop) = (url.clone(), bus.clone(), stop.clone());
    tokio::spawn(async move {
        tokio::select! {
            () = listen(&listen_url, &listen_bus) => {}
            () = listen_stop.cancelled() => {}
        }
    });
    tokio::spawn(async move {
        tokio::select! {
            () = send_deltas(&url, bus.origin(), deltas) => {}
            () = stop.cancelled() => {}
        }
    });
}

async fn send_deltas(url: &str, origin: Uuid, mut deltas: mpsc::Receiver<Event>) {
    let pool = match PgPoolOptions::new().max_connections(1).connect_lazy(url) {
        Ok(pool) => pool,
        Err(err) => {
            tracing::warn!(error = %err, "live deltas will not reach other processes");
            return;
        }
    };
    while let Some(event) = deltas.recv().await {
        let relayed = RelayedDelta {
            origin,
            conversation_id: event.conversation_id,
            cursor: event.cursor.0,
            run_id: event.run_id,
            at: event.at,
            body: event.body,
        };
        let Ok(payload) = serde_json::to_string(&relayed) else {
            continue;
        };
        if payload.len() > MAX_PAYLOAD {
            continue;
        }
        if let Err(err) = sqlx::query("SELECT pg_notify($1, $2)")
            .bind(DELTAS)
            .bind(payload)
            .execute(&pool)
            .await
        {
            tracing::debug!(error = %err, "relaying a delta failed");
        }
    }
}

/// Waits between attempts to connect the listener again: from 100 ms,
/// doubling up to 5 s, jittered.
const RECONNECT: RetryPolicy = RetryPolicy {
    max_attempts: u32::MAX,
    initial_delay: Duration::from_millis(100),
    max_delay: Duration::from_secs(5),
};

/// Listens until stopped, reconnecting with backoff whenever the connection
/// drops. Whatever was notified while nobody listened is lost, so each time
/// the listener (re)connects it pokes every subscriber and wakes the
/// workers; while it is down both read the log on their own timers (the
/// head watcher, the workers' poll and their look for cancellations), so
/// nothing waits for a notification that will not come. A loss is logged
/// once, its end once, and each one counted (`Bus::listener_reconnects`).
async fn listen(url: &str, bus: &Bus) {
    let mut failures = 0u32;
    loop {
        match connect(url).await {
            Ok(mut listener) => {
                bus.listener_up();
                failures = 0;
                bus.poke_all();
                bus.wake_workers();
                let cause = loop {
                    match listener.try_recv().await {
                        Ok(Some(notification)) => {
                            relay(bus, notification.channel(), notification.payload())
                        }
                        Ok(None) => break "the connection closed".to_owned(),
                        Err(err) => break err.to_string(),
                    }
                };
                bus.listener_lost(&cause);
            }
            Err(err) => bus.listener_lost(&err.to_string()),
        }
        failures = failures.saturating_add(1);
        tokio::time::sleep(RECONNECT.delay(failures, None, fastrand::f64())).await;
    }
}

async fn connect(url: &str) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect(url).await?;
    listener
        .listen_all([EVENTS, QUEUED, CANCEL, DELTAS])
        .await?;
    Ok(listener)
}

fn relay(bus: &Bus, channel: &str, payload: &str) {
    if channel == DELTAS {
        if let Ok(delta) = serde_json::from_str::<RelayedDelta>(payload)
            && delta.origin != bus.origin()
        {
            bus.deliver(&[Event {
                conversation_id: delta.conversation_id,
                cursor: Cursor(delta.cursor),
                kind: EventKind::PartDelta,
                run_id: delta.run_id,
                at: delta.at,
                body: delta.body,
            }]);
        }
        return;
    }
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
