//! The lease sweep: runs whose leases ran out on the database's clock go
//! back to the queue (`queue::reclaim`), and what the sweep knows of the
//! database's absence.
//!
//! A lease also runs out while the database is away, for every live worker
//! at once; each worker's heartbeat renews its own once the database is back
//! (`queue::heartbeat`). So after a sweep could not reach the database, the
//! next sweep waits until the database has answered for as long as those
//! heartbeats need: an outage does not hand another process's live run to
//! this one, to be sent again and counted as a recovery.

use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use crate::store::Store;
use crate::store::queue::{self, Reclaim};
use crate::telemetry;

pub(super) struct Sweeper {
    /// How long live workers need to renew their leases: two heartbeats,
    /// at most a lease.
    renewal: Duration,
    /// A database that takes longer than this to answer a ping counts as
    /// away: a statement sent during an outage runs when the database is
    /// back, before the heartbeats.
    patience: Duration,
    budget: u32,
    away: bool,
    /// No sweep before this, once the database is back.
    after: Option<Instant>,
}

impl Sweeper {
    pub(super) fn new(renewal: Duration, patience: Duration, budget: u32) -> Sweeper {
        Sweeper {
            renewal,
            patience,
            budget,
            away: false,
            after: None,
        }
    }

    /// One sweep, never of a run in `executing` (this process's heartbeats
    /// renew them), unless the database is away or just came back.
    pub(super) async fn sweep(&mut self, store: &Store, executing: &[Uuid]) {
        let answered = tokio::time::timeout(self.patience, store.db().ping()).await;
        match answered {
            Ok(Ok(())) if self.away => {
                self.away = false;
                self.after = Some(Instant::now() + self.renewal);
                tracing::info!(
                    wait_ms = self.renewal.as_millis() as u64,
                    "the database answers again; sweeping leases once live workers renewed theirs"
                );
                return;
            }
            Ok(Ok(())) => {}
            Ok(Err(err)) => return self.lost(&err.to_string()),
            Err(_) => return self.lost("no answer to a ping in time"),
        }
        if self.after.is_some_and(|after| Instant::now() < after) {
            return;
        }
        self.after = None;
        match queue::reclaim(store, Reclaim::Expired { executing }, self.budget).await {
            Ok(_) => telemetry::swept(),
            Err(err) => self.lost(&err.to_string()),
        }
    }

    fn lost(&mut self, error: &str) {
        if !self.away {
            tracing::warn!(
                error,
                "recovering expired leases failed; the next sweep waits until the database has answered for a while"
            );
        }
        self.away = true;
    }
}
