//! The subscription feed: register on the bus, catch up from the log, then
//! follow live events, deduplicated by cursor. A lag or a gap on the bus is
//! repaired from the log, never skipped.

use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;
use uuid::Uuid;

use crate::bus::Signal;
use crate::domain::cursor::Cursor;
use crate::domain::event::Event;
use crate::domain::retry::RetryPolicy;
use crate::store::{Error, Result, Store, reads, retry_within};
use crate::telemetry;

/// Events read from the log per query while catching up.
const PAGE: u64 = 500;

/// How often the head watcher looks at the logs of watched conversations.
const WATCH_EVERY: Duration = Duration::from_secs(1);

/// Conversations whose heads one query reads.
const HEADS_PER_QUERY: usize = 500;

/// The bus only hears this process; another one (a worker of a split
/// deployment, any process on SQLite, a lost PostgreSQL notification) may
/// have written. One task per process reads the heads of every watched
/// conversation each second, in a few queries, and wakes the subscribers of
/// those that grew: no subscription keeps a timer of its own.
pub async fn watch_heads(store: Store, stop: tokio_util::sync::CancellationToken) {
    let mut tick = tokio::time::interval(WATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        let watched = store.bus().watched();
        for ids in watched.chunks(HEADS_PER_QUERY) {
            match reads::heads(store.api_reads(), ids).await {
                Ok(heads) => {
                    for (id, head) in heads {
                        store.bus().head_is(id, head);
                    }
                }
                Err(err) => tracing::warn!(error = %err, "could not read the logs' heads"),
            }
        }
    }
}

pub struct FeedRequest {
    pub tenant: String,
    pub conversation_id: Uuid,
    /// Deliver persisted events after this cursor first; `None` starts live.
    pub after: Option<Cursor>,
    /// Only this run's events, ending after its final one.
    pub run_id: Option<Uuid>,
}

pub fn follow(store: Store, request: FeedRequest) -> impl Stream<Item = Result<Arc<Event>>> {
    follow_with(store, request, std::future::ready(()))
}

/// `follow`, with `between_reads` awaited between the read of the log's
/// head and the read of the run's status (a test commits there).
///
/// A feed waits on the bus most of its life, so it is small while it waits:
/// a plain struct stepped by `try_unfold`, its start and its reads of the log
/// boxed rather than carried inline.
fn follow_with(
    store: Store,
    request: FeedRequest,
    between_reads: impl Future<Output = ()> + Send + 'static,
) -> impl Stream<Item = Result<Arc<Event>>> {
    let mut start = Some(Box::pin(Feed::start(store, request, between_reads)));
    // Boxed: `try_unfold` holds the state twice, in its slot and in the
    // step's future.
    futures_util::stream::try_unfold(None, move |feed: Option<Box<Feed>>| {
        let start = start.take();
        async move {
            let mut feed = match (feed, start) {
                (Some(feed), _) => feed,
                (None, Some(start)) => Box::new(start.await?),
                (None, None) => return Ok(None),
            };
            Ok(feed.next().await?.map(|event| (event, Some(feed))))
        }
    })
}

/// What reading a conversation's log takes, apart from where to start.
#[derive(Clone)]
struct Reader {
    store: Store,
    tenant: String,
    conversation_id: Uuid,
}

/// How long a feed keeps reading the log again while the database cannot
/// be reached (a restart, a cut connection) before it gives up; the client
/// then subscribes again from its last cursor.
const READ_PATIENCE: Duration = Duration::from_secs(60);

/// The waits between those reads: from 100 ms, doubling up to 2 s.
const READ_AGAIN: RetryPolicy =
    RetryPolicy::unbounded(Duration::from_millis(100), Duration::from_secs(2));

/// The page of the log after `after`. A read the database failed is tried
/// again, for up to `READ_PATIENCE`: a subscription outlives a database
/// restart without losing its place.
async fn read_page(reader: Reader, after: Cursor) -> Result<Vec<Event>> {
    let read = || {
        reads::events_after(
            reader.store.api_reads(),
            &reader.tenant,
            reader.conversation_id,
            after,
            PAGE,
        )
    };
    retry_within(&READ_AGAIN, READ_PATIENCE, read, |err| {
        matches!(err, Error::Database(_))
    })
    .await
}

impl Drop for Feed {
    fn drop(&mut self) {
        if let Some(read) = self.read_ahead.take() {
            read.abort();
        }
    }
}

/// One subscriber's place in a conversation's events.
struct Feed {
    reader: Reader,
    /// Only this run's events, ending after its final one.
    run_id: Option<Uuid>,
    live: broadcast::Receiver<Signal>,
    /// The newest persisted event passed (sent, or skipped as not wanted).
    last: Cursor,
    /// The log holds events after `last` that the bus may not have sent.
    behind: bool,
    /// The run had ended at the start: the log has the rest of its story.
    catch_up_only: bool,
    /// Events read from the log, not yet passed.
    page: std::vec::IntoIter<Event>,
    /// The log's next page, being read while `page` is sent.
    read_ahead: Option<tokio::task::JoinHandle<Result<Vec<Event>>>>,
    /// The run's final event was sent.
    ended: bool,
}

impl Feed {
    async fn start(
        store: Store,
        request: FeedRequest,
        between_reads: impl Future<Output = ()>,
    ) -> Result<Feed> {
        let FeedRequest {
            tenant,
            conversation_id,
            after,
            run_id,
        } = request;
        let live = store.bus().subscribe(conversation_id);
        // The head first, then the run: whatever commits after the head was
        // read comes after `last`, live or from the log. (Read the other way
        // round, a run that ended between the two reads had its final event
        // counted as seen, and the subscription never completed.)
        let last = match after {
            Some(cursor) => cursor,
            None => {
                let row = reads::conversation(store.api_reads(), &tenant, conversation_id).await?;
                Cursor(row.map_or(0, |c| c.event_seq))
            }
        };
        between_reads.await;
        // A run that has ended has the rest of its story in the log after
        // `last` (nothing, when it ended before): read it, then stop.
        let catch_up_only = match run_id {
            Some(id) => match reads::run(store.api_reads(), &tenant, id).await? {
                Some(run) => reads::run_status(&run)?.is_ended(),
                None => true,
            },
            None => false,
        };
        Ok(Feed {
            reader: Reader {
                store,
                tenant,
                conversation_id,
            },
            run_id,
            live,
            last,
            behind: after.is_some() || catch_up_only,
            catch_up_only,
            page: Vec::new().into_iter(),
            read_ahead: None,
            ended: false,
        })
    }

    fn wanted(&self, event: &Event) -> bool {
        self.run_id.is_none() || event.run_id == self.run_id
    }

    /// The next event to send; `None` when the feed has ended.
    async fn next(&mut self) -> Result<Option<Arc<Event>>> {
        loop {
            if self.ended {
                return Ok(None);
            }
            if let Some(event) = self.page.next() {
                self.last = event.cursor;
                if self.wanted(&event) {
                    return Ok(Some(self.sent(Arc::new(event))));
                }
                continue;
            }
            if self.behind {
                let page = match self.read_ahead.take() {
                    // The task's failure is logged, not shown: a panic's
                    // message is the server's own business.
                    Some(read) => read.await.map_err(|err| {
                        tracing::error!(error = %err, "reading the log ahead failed");
                        Error::Unavailable(
                            "the log could not be read; subscribe again from the last cursor"
                                .into(),
                        )
                    })??,
                    None => Box::pin(read_page(self.reader.clone(), self.last)).await?,
                };
                self.behind = page.len() as u64 == PAGE;
                // A full page has more behind it: read the next one while
                // this one is sent.
                if self.behind
                    && let Some(newest) = page.last()
                {
                    self.read_ahead =
                        Some(tokio::spawn(read_page(self.reader.clone(), newest.cursor)));
                }
                self.page = page.into_iter();
                continue;
            }
            if self.catch_up_only {
                return Ok(None);
            }
            // Woken by this process's commits, or by the head watcher when
            // the log grew elsewhere.
            let event = match self.live.recv().await {
                Ok(Signal::Event(event)) => event,
                Ok(Signal::Stale) | Err(RecvError::Lagged(_)) => {
                    telemetry::subscriber_fell_behind();
                    self.behind = true;
                    continue;
                }
                Err(RecvError::Closed) => return Ok(None),
            };
            if event.kind.is_persisted() {
                if event.cursor <= self.last {
                    continue;
                }
                if event.cursor != self.last.next() {
                    // Published out of commit order: the log has the gap.
                    self.behind = true;
                    continue;
                }
                self.last = event.cursor;
            } else if event.cursor > self.last {
                // A delta ahead of the events we have sent: best effort, so
                // drop it and catch up with what is persisted.
                self.behind = true;
                continue;
            }
            if self.wanted(&event) {
                telemetry::delivered(event.at);
                return Ok(Some(self.sent(event)));
            }
        }
    }

    /// Notes an event on its way out: a run feed ends after the run's final
    /// event.
    fn sent(&mut self, event: Arc<Event>) -> Arc<Event> {
        if event.kind.is_final() && self.run_id.is_some() {
            self.ended = true;
        }
        event
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;

    use super::*;
    use crate::bus::CAPACITY;
    use crate::domain::event::EventKind;
    use crate::store::commands;
    use crate::store::test_support::{ada, conversation, queued_run, send_hi, temp_store};

    #[tokio::test]
    async fn a_run_that_ends_between_the_subscriptions_reads_still_completes_it() {
        let (store, dir) = temp_store().await;
        let run = queued_run(&store).await;
        // The run ends after the log's head is read and before its status
        // is: its final event is after the head, and must be delivered.
        let ends = {
            let store = store.clone();
            async move {
                commands::cancel_run(&store, &ada(), run.id, None)
                    .await
                    .unwrap();
            }
        };
        let feed = follow_with(
            store.clone(),
            FeedRequest {
                tenant: "acme".into(),
                conversation_id: run.conversation_id,
                after: None,
                run_id: Some(run.id),
            },
            ends,
        );
        let events: Vec<_> =
            tokio::time::timeout(std::time::Duration::from_secs(10), feed.collect())
                .await
                .expect("the subscription completes");
        let kinds: Vec<EventKind> = events.into_iter().map(|e| e.unwrap().kind).collect();
        assert_eq!(kinds.last(), Some(&EventKind::RunCancelled), "{kinds:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }

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
