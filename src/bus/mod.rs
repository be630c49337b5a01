//! Live fan-out in this process: committed events to subscribers, and two
//! signals to workers (a run was queued; a run's cancellation was requested).
//! The bus is a wake-up and a fast path, never the source of truth: a
//! subscriber that lags behind reads the log instead, and workers also poll.
//! On PostgreSQL, `pg` relays the same signals between processes.

pub mod pg;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use tokio::sync::{Notify, broadcast, mpsc};
use uuid::Uuid;

use crate::domain::event::{Event, EventKind};

/// Events buffered per conversation for each subscriber before it lags.
pub const CAPACITY: usize = 1024;

/// What a subscriber hears on a conversation's channel.
#[derive(Debug, Clone)]
pub enum Signal {
    /// An event committed (or a live delta) in this process.
    Event(Arc<Event>),
    /// The log has grown elsewhere (another process): read it.
    Stale,
}

/// A conversation's live channel, and the newest persisted cursor its
/// subscribers have heard of (an event sent, or a poke up to a head the
/// watcher read): what the head watcher compares the log's head with.
struct Channel {
    sender: broadcast::Sender<Signal>,
    announced: i64,
}

#[derive(Clone)]
pub struct Bus {
    channels: Arc<Mutex<HashMap<Uuid, Channel>>>,
    queued: Arc<Notify>,
    cancels: broadcast::Sender<Uuid>,
    /// Names this process in notifications, to skip its own.
    origin: Uuid,
    /// Where live deltas go for other processes (PostgreSQL only).
    delta_relay: Arc<OnceLock<mpsc::Sender<Event>>>,
    listener: Arc<ListenerState>,
}

/// The PostgreSQL listener's state (`pg::listen`).
#[derive(Default)]
struct ListenerState {
    /// Lost since it was last up (or never up yet): logged once.
    lost: AtomicBool,
    /// Listening now.
    up: AtomicBool,
    /// Woken when it starts listening.
    came_up: Notify,
    reconnects: AtomicU64,
}

impl Default for Bus {
    fn default() -> Self {
        Bus {
            channels: Arc::default(),
            queued: Arc::default(),
            cancels: broadcast::channel(256).0,
            origin: Uuid::now_v7(),
            delta_relay: Arc::default(),
            listener: Arc::default(),
        }
    }
}

impl Bus {
    pub fn new() -> Bus {
        Bus::default()
    }

    pub fn origin(&self) -> Uuid {
        self.origin
    }

    /// Registers for a conversation's live events from now on. Channels
    /// nobody listens to any more are dropped by `watched`, not here, so a
    /// subscribe costs the same however many conversations are watched.
    pub fn subscribe(&self, conversation_id: Uuid) -> broadcast::Receiver<Signal> {
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        channels
            .entry(conversation_id)
            .or_insert_with(|| Channel {
                sender: broadcast::channel(CAPACITY).0,
                announced: 0,
            })
            .sender
            .subscribe()
    }

    /// The conversations someone listens to; channels without listeners
    /// are dropped.
    pub fn watched(&self) -> Vec<Uuid> {
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        channels.retain(|_, channel| channel.sender.receiver_count() > 0);
        channels.keys().copied().collect()
    }

    /// The log of a conversation reaches `head`: its subscribers are told
    /// to read it, unless they have heard of that far already.
    pub fn head_is(&self, conversation_id: Uuid, head: i64) {
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(channel) = channels.get_mut(&conversation_id)
            && head > channel.announced
        {
            channel.announced = head;
            let _ = channel.sender.send(Signal::Stale);
        }
    }

    /// Sends events to the current subscribers of their conversations, and
    /// wakes a worker when a run was queued. Live deltas also go to other
    /// processes where a relay is set (best effort: dropped when it is busy).
    pub fn publish(&self, events: &[Event]) {
        if let Some(relay) = self.delta_relay.get() {
            for event in events.iter().filter(|e| !e.kind.is_persisted()) {
                let _ = relay.try_send(event.clone());
            }
        }
        self.deliver(events);
    }

    /// Sends events to this process's subscribers only.
    pub fn deliver(&self, events: &[Event]) {
        if events.is_empty() {
            return;
        }
        if events.iter().any(|e| e.kind == EventKind::RunQueued) {
            self.queued.notify_one();
        }
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        for event in events {
            let Some(channel) = channels.get_mut(&event.conversation_id) else {
                continue;
            };
            if event.kind.is_persisted() {
                channel.announced = channel.announced.max(event.cursor.0);
            }
            if channel
                .sender
                .send(Signal::Event(Arc::new(event.clone())))
                .is_err()
            {
                channels.remove(&event.conversation_id);
            }
        }
    }

    /// Sets where live deltas go for other processes; once.
    pub fn relay_deltas(&self, relay: mpsc::Sender<Event>) {
        let _ = self.delta_relay.set(relay);
    }

    /// Tells a conversation's subscribers that its log grew elsewhere.
    pub fn poke(&self, conversation_id: Uuid) {
        let channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(channel) = channels.get(&conversation_id) {
            let _ = channel.sender.send(Signal::Stale);
        }
    }

    /// Tells every subscriber to check the log (notifications were lost).
    pub fn poke_all(&self) {
        let channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        for channel in channels.values() {
            let _ = channel.sender.send(Signal::Stale);
        }
    }

    /// Wakes a worker of this process: a run may be ready to claim.
    pub fn wake_workers(&self) {
        self.queued.notify_one();
    }

    /// Resolves when a run may have been queued since the last call.
    pub async fn run_queued(&self) {
        self.queued.notified().await;
    }

    /// Tells this process's workers that a run's cancellation was requested.
    pub fn request_cancel(&self, run_id: Uuid) {
        let _ = self.cancels.send(run_id);
    }

    pub fn cancel_requests(&self) -> broadcast::Receiver<Uuid> {
        self.cancels.subscribe()
    }

    /// The PostgreSQL listener is listening (after a loss: it is back).
    fn listener_up(&self) {
        self.listener.up.store(true, Ordering::Relaxed);
        self.listener.came_up.notify_waiters();
        if self.listener.lost.swap(false, Ordering::Relaxed) {
            self.listener.reconnects.fetch_add(1, Ordering::Relaxed);
            tracing::info!("listening for notifications again");
        }
    }

    /// The PostgreSQL listener is not listening; said once until it is back.
    fn listener_lost(&self, cause: &str) {
        self.listener.up.store(false, Ordering::Relaxed);
        if !self.listener.lost.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                cause,
                "not listening for notifications: until it is back, subscribers and workers \
                 read the log on their timers (about a second)"
            );
        }
    }

    /// Whether the PostgreSQL listener is listening now (never, before it
    /// first connects, and never on SQLite, which has none).
    pub fn listening(&self) -> bool {
        self.listener.up.load(Ordering::Relaxed)
    }

    /// Returns once the PostgreSQL listener is listening.
    pub async fn until_listening(&self) {
        loop {
            let came_up = self.listener.came_up.notified();
            if self.listening() {
                return;
            }
            came_up.await;
        }
    }

    /// How many times the PostgreSQL listener came back after a loss.
    pub fn listener_reconnects(&self) -> u64 {
        self.listener.reconnects.load(Ordering::Relaxed)
    }
}
