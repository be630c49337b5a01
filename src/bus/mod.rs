//! Live fan-out of events to subscribers in this process. The bus is a
//! wake-up and a fast path, never the source of truth: a subscriber that lags
//! behind reads the log instead.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::broadcast;
use uuid::Uuid;

use crate::domain::event::Event;

/// Events buffered per conversation for each subscriber before it lags.
pub const CAPACITY: usize = 1024;

#[derive(Clone, Default)]
pub struct Bus {
    channels: Arc<Mutex<HashMap<Uuid, broadcast::Sender<Arc<Event>>>>>,
}

impl Bus {
    pub fn new() -> Bus {
        Bus::default()
    }

    /// Registers for a conversation's live events from now on.
    pub fn subscribe(&self, conversation_id: Uuid) -> broadcast::Receiver<Arc<Event>> {
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        channels.retain(|_, sender| sender.receiver_count() > 0);
        channels
            .entry(conversation_id)
            .or_insert_with(|| broadcast::channel(CAPACITY).0)
            .subscribe()
    }

    /// Sends events to the current subscribers of their conversations, and
    /// forgets conversations nobody listens to any more.
    pub fn publish(&self, events: &[Event]) {
        if events.is_empty() {
            return;
        }
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        for event in events {
            let Some(sender) = channels.get(&event.conversation_id) else {
                continue;
            };
            if sender.send(Arc::new(event.clone())).is_err() {
                channels.remove(&event.conversation_id);
            }
        }
    }
}
