//! The subscription feed: register on the bus, catch up from the log, then
//! follow live events, deduplicated by cursor. A lag or a gap on the bus is
//! repaired from the log, never skipped.

use std::sync::Arc;

use futures_util::Stream;
use tokio::sync::broadcast::error::RecvError;
use uuid::Uuid;

use crate::bus::Signal;
use crate::domain::cursor::Cursor;
use crate::domain::event::Event;
use crate::store::{Result, Store, reads};

/// Events read from the log per query while catching up.
const PAGE: u64 = 500;

/// How often a subscription looks at the log's head itself.
const POLL: std::time::Duration = std::time::Duration::from_secs(1);

pub struct FeedRequest {
    pub tenant: String,
    pub conversation_id: Uuid,
    /// Deliver persisted events after this cursor first; `None` starts live.
    pub after: Option<Cursor>,
    /// Only this run's events, ending after its final one.
    pub run_id: Option<Uuid>,
}

pub fn follow(store: Store, request: FeedRequest) -> impl Stream<Item = Result<Arc<Event>>> {
    async_stream::try_stream! {
        let FeedRequest { tenant, conversation_id, after, run_id } = request;
        let mut live = store.bus().subscribe(conversation_id);
        // Read after registering on the bus: a run that ends later is seen
        // live; one that has already ended has its whole story in the log.
        let catch_up_only = match run_id {
            Some(id) => match reads::run(store.api_reads(), &tenant, id).await? {
                Some(run) => reads::run_status(&run)?.is_ended(),
                None => true,
            },
            None => false,
        };
        let mut last = match after {
            Some(cursor) => cursor,
            None => {
                let row = reads::conversation(store.api_reads(), &tenant, conversation_id).await?;
                Cursor(row.map_or(0, |c| c.event_seq))
            }
        };
        let wanted = |event: &Event| run_id.is_none() || event.run_id == run_id;
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        poll.reset();
        let mut behind = after.is_some();
        loop {
            if behind {
                let page = reads::events_after(store.api_reads(), &tenant, conversation_id, last, PAGE).await?;
                behind = page.len() as u64 == PAGE;
                for event in page {
                    last = event.cursor;
                    if wanted(&event) {
                        let is_final = event.kind.is_final();
                        yield Arc::new(event);
                        if is_final && run_id.is_some() {
                            return;
                        }
                    }
                }
                continue;
            }
            if catch_up_only {
                return;
            }
            let signal = tokio::select! {
                signal = live.recv() => Some(signal),
                _ = poll.tick() => None,
            };
            let Some(signal) = signal else {
                // The bus only hears this process; another one (a worker of
                // a split deployment, or any instance on SQLite) may have
                // written. A cheap look at the log's head now and then.
                let head = reads::conversation(store.api_reads(), &tenant, conversation_id).await?;
                behind = head.is_some_and(|c| c.event_seq > last.0);
                continue;
            };
            let event = match signal {
                Ok(Signal::Event(event)) => event,
                Ok(Signal::Stale) | Err(RecvError::Lagged(_)) => {
                    behind = true;
                    continue;
                }
                Err(RecvError::Closed) => return,
            };
            if event.kind.is_persisted() {
                if event.cursor <= last {
                    continue;
                }
                if event.cursor != last.next() {
                    // Published out of commit order: the log has the gap.
                    behind = true;
                    continue;
                }
                last = event.cursor;
            } else if event.cursor > last {
                // A delta ahead of the events we have sent: best effort, so
                // drop it and catch up with what is persisted.
                behind = true;
                continue;
            }
            if wanted(&event) {
                let is_final = event.kind.is_final();
                yield event;
                if is_final && run_id.is_some() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;

    use super::*;
    use crate::bus::CAPACITY;
    use crate::store::test_support::{conversation, send_hi, temp_store};

    #[tokio::test]
    async fn a_subscriber_that_lags_on_the_bus_reads_the_log_and_misses_nothing() {
        let (store, dir) = temp_store().await;
        let conversation = conversation(&store).await;
        send_hi(&store, conversation.id, 1).await;
        let mut feed = Box::pin(follow(
            store.clone(),
            FeedRequest {
                tenant: "acme".into(),
                conversation_id: conversation.id,
                after: Some(Cursor::START),
                run_id: None,
            },
        ));
        // Once the first event arrives the feed is registered on the bus.
        assert_eq!(feed.next().await.unwrap().unwrap().cursor, Cursor(1));

        // More events than the bus holds, while nobody reads.
        let sends = CAPACITY / 2 + 10;
        for _ in 0..sends {
            send_hi(&store, conversation.id, 1).await;
        }
        let total = 2 + 2 * sends as i64;
        let mut expected = 2;
        while expected <= total {
            let event = feed.next().await.unwrap().unwrap();
            assert_eq!(event.cursor, Cursor(expected), "gap or repeat after a lag");
            expected += 1;
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}
