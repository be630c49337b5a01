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
/// Live `part.delta` events as JSON (`RelayedDeltas`: every delta waiting
/// to be relayed, in one notification), sent outside any transaction.
pub const DELTAS: &str = "tether_deltas";

/// NOTIFY payloads must stay under 8000 bytes: a batch is cut there, and a
/// delta larger than that alone is not relayed (the text arrives with the
/// next checkpoint).
const MAX_PAYLOAD: usize = 7900;
/// Deltas waiting to be relayed before new ones are dropped.
const RELAY_BUFFER: usize = 1024;

/// The deltas of one notification, from one process.
#[derive(Deserialize)]
struct RelayedDeltas {
    origin: Uuid,
    deltas: Vec<RelayedDelta>,
}

#[derive(Serialize, Deserialize)]
struct RelayedDelta {
    conversation_id: Uuid,
    cursor: i64,
    run_id: Option<Uuid>,
    at: i64,
    body: EventBody,
}

impl RelayedDelta {
    fn of(event: Event) -> RelayedDelta {
        RelayedDelta {
            conversation_id: event.conversation_id,
            cursor: event.cursor.0,
            run_id: event.run_id,
            at: event.at,
            body: event.body,
        }
    }

    fn into_event(self) -> Event {
        Event {
            conversation_id: self.conversation_id,
            cursor: Cursor(self.cursor),
            kind: EventKind::PartDelta,
            run_id: self.run_id,
            at: self.at,
            body: self.body,
        }
    }
}

/// Payloads of `DELTAS` notifications: the deltas in order, as many to a
/// payload as fit under `MAX_PAYLOAD`.
struct Batches {
    head: String,
    payloads: Vec<String>,
    current: String,
}

impl Batches {
    fn new(origin: Uuid) -> Batches {
        let head = format!("{{\"origin\":\"{origin}\",\"deltas\":[");
        Batches {
            current: head.clone(),
            head,
            payloads: Vec::new(),
        }
    }

    fn push(&mut self, delta: RelayedDelta) {
        let Ok(json) = serde_json::to_string(&delta) else {
            return;
        };
        // The head, this delta and the closing "]}" must fit on their own.
        if self.head.len() + json.len() + 2 > MAX_PAYLOAD {
            return;
        }
        if self.current.len() + json.len() + 3 > MAX_PAYLOAD {
            self.finish();
        }
        if self.current.len() > self.head.len() {
            self.current.push(',');
        }
        self.current.push_str(&json);
    }

    fn finish(&mut self) {
        if self.current.len() > self.head.len() {
            let mut payload = std::mem::replace(&mut self.current, self.head.clone());
            payload.push_str("]}");
            self.payloads.push(payload);
        }
    }

    fn into_payloads(mut self) -> Vec<String> {
        self.finish();
        self.payloads
    }
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
    // One notification for every delta waiting, not one each: a NOTIFY
    // serializes at commit behind every other one in the database.
    while let Some(first) = deltas.recv().await {
        let mut batches = Batches::new(origin);
        batches.push(RelayedDelta::of(first));
        while let Ok(next) = deltas.try_recv() {
            batches.push(RelayedDelta::of(next));
        }
        for payload in batches.into_payloads() {
            if let Err(err) = sqlx::query("SELECT pg_notify($1, $2)")
                .bind(DELTAS)
                .bind(payload)
                .execute(&pool)
                .await
            {
                tracing::debug!(error = %err, "relaying deltas failed");
            }
        }
    }
}

/// Waits between attempts to connect the listener again: from 100 ms,
/// doubling up to 5 s, jittered.
const RECONNECT: RetryPolicy =
    RetryPolicy::unbounded(Duration::from_millis(100), Duration::from_secs(5));

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
        if let Ok(relayed) = serde_json::from_str::<RelayedDeltas>(payload)
            && relayed.origin != bus.origin()
        {
            let events: Vec<Event> = relayed
                .deltas
                .into_iter()
                .map(RelayedDelta::into_event)
                .collect();
            bus.deliver(&events);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(n: usize, text: &str) -> RelayedDelta {
        let body = EventBody::Delta {
            message_id: Uuid::nil(),
            part_id: Uuid::nil(),
            offset: 0,
            text: text.to_owned(),
        };
        RelayedDelta {
            conversation_id: Uuid::nil(),
            cursor: n as i64,
            run_id: None,
            at: 0,
            body,
        }
    }

    #[test]
    fn deltas_go_in_as_few_payloads_as_fit_in_order_and_none_too_large() {
        let origin = Uuid::now_v7();
        let mut batches = Batches::new(origin);
        for n in 0..200 {
            batches.push(delta(n, &"x".repeat(100)));
        }
        // Alone too large for any payload: left out.
        batches.push(delta(999, &"y".repeat(MAX_PAYLOAD)));
        let payloads = batches.into_payloads();
        assert!(
            payloads.len() > 1 && payloads.len() < 10,
            "{}",
            payloads.len()
        );
        let mut cursors = Vec::new();
        for payload in &payloads {
            assert!(payload.len() <= MAX_PAYLOAD, "{}", payload.len());
            let relayed: RelayedDeltas = serde_json::from_str(payload).unwrap();
            assert_eq!(relayed.origin, origin);
            cursors.extend(relayed.deltas.iter().map(|d| d.cursor));
        }
        assert_eq!(cursors, (0..200).collect::<Vec<i64>>());
        assert!(Batches::new(origin).into_payloads().is_empty());
    }
}
