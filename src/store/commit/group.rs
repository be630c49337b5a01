//! Group commit: writers that are ready while another write holds SQLite's
//! one write lock are committed together, in one transaction that carries
//! all their facts and events.
//!
//! Each writer's part is a closure that writes inside the transaction it is
//! given. A group whose transaction fails as a whole (one part refused, the
//! commit failed) is rolled back and each part is then written in a
//! transaction of its own, so one writer's failure never undoes another's
//! facts, and each writer's facts stay all-or-nothing. Within a group, parts
//! are written in the order they arrived; a conversation's events keep their
//! commit order, since the group commits at once. A part that panics is
//! an error of its own, and undoes nothing of the others.
//!
//! A writer that finds the database free and nobody waiting writes at once,
//! in its own task, as an ungrouped write would. Otherwise the group runs in
//! a task of its own: a writer that stops waiting (a dropped request)
//! cancels nothing of the others. Writers hear that they committed before
//! their events go out on the bus, so a writer's response is not behind the
//! work those events wake up.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use tokio::sync::oneshot;

use super::{WriteLane, WriteTx};
use crate::domain::event::Event;
use crate::store::{Error, Result, Store};

/// One writer's part of a group.
trait Part: Send {
    /// Writes the part's facts inside `tx`; may be called again, in a
    /// transaction of its own, after its group was rolled back.
    fn write<'t>(&'t mut self, tx: &'t mut WriteTx) -> BoxFuture<'t, Result<()>>;
    /// Tells the writer how its part ended, with its committed events.
    fn settle(self: Box<Self>, committed: Result<Vec<Event>>);
}

/// A writer's closure, what it returned, and where its answer goes.
struct Writer<T, W> {
    write: W,
    output: Option<T>,
    answer: oneshot::Sender<Result<(T, Vec<Event>)>>,
}

impl<T, W> Part for Writer<T, W>
where
    T: Send,
    W: for<'t> FnMut(&'t mut WriteTx) -> BoxFuture<'t, Result<T>> + Send,
{
    fn write<'t>(&'t mut self, tx: &'t mut WriteTx) -> BoxFuture<'t, Result<()>> {
        Box::pin(async move {
            self.output = None;
            // A part that panics fails alone: its group is written again
            // without it, as after any part's error.
            let written = AssertUnwindSafe((self.write)(tx)).catch_unwind().await;
            let output = written.map_err(|_| Error::WriteFailed("the write panicked"))??;
            self.output = Some(output);
            Ok(())
        })
    }

    fn settle(self: Box<Self>, committed: Result<Vec<Event>>) {
        let Writer { output, answer, .. } = *self;
        let result = committed.and_then(|events| match output {
            Some(output) => Ok((output, events)),
            None => Err(Error::WriteFailed("a committed write has no result")),
        });
        // A writer that stopped waiting needs no answer.
        let _ = answer.send(result);
    }
}

/// The parts waiting for the next group, and whether a leader that will
/// take them is on its way.
#[derive(Default)]
pub(in crate::store) struct Pending {
    parts: Mutex<Vec<Box<dyn Part>>>,
    leader: AtomicBool,
}

impl Pending {
    /// Queues a part; true when the caller must start a leader for it.
    fn push(&self, part: Box<dyn Part>) -> bool {
        self.parts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(part);
        !self.leader.swap(true, Ordering::SeqCst)
    }

    fn is_empty(&self) -> bool {
        self.parts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    }

    /// Takes every queued part. A part queued after the flag is cleared
    /// starts a leader of its own, so none is left behind.
    fn take(&self) -> Vec<Box<dyn Part>> {
        self.leader.store(false, Ordering::SeqCst);
        std::mem::take(&mut *self.parts.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl Store {
    /// Writes `write`'s facts and events in a transaction and commits,
    /// returning what it returned and its committed events. On SQLite the
    /// transaction may be shared with other writers ready at the same time
    /// (see the module's notes); elsewhere writers commit side by side.
    pub(in crate::store) async fn write<T, W>(&self, write: W) -> Result<(T, Vec<Event>)>
    where
        T: Send + 'static,
        W: for<'t> FnMut(&'t mut WriteTx) -> BoxFuture<'t, Result<T>> + Send + 'static,
    {
        let Some(pending) = &self.pending else {
            return self.write_alone(self.lane().await, write).await;
        };
        // Nobody writing and nobody waiting: write here and now, in this
        // task, as an ungrouped write would.
        if let Some(lane) = self.lane_if_free()
            && pending.is_empty()
        {
            return self.write_alone(Some(lane), write).await;
        }
        let (answer, answered) = oneshot::channel();
        let part = Box::new(Writer {
            write,
            output: None,
            answer,
        });
        // The leader waits for the lane, then writes every part queued by
        // then in one transaction.
        if pending.push(part) {
            let (store, pending) = (self.clone(), pending.clone());
            tokio::spawn(async move { store.lead(&pending).await });
        }
        answered
            .await
            .unwrap_or_else(|_| Err(Error::WriteFailed("the group commit was stopped")))
    }

    async fn write_alone<T, W>(&self, lane: WriteLane, mut write: W) -> Result<(T, Vec<Event>)>
    where
        W: for<'t> FnMut(&'t mut WriteTx) -> BoxFuture<'t, Result<T>>,
    {
        let mut tx = self.begin_write_in(lane).await?;
        let output = write(&mut tx).await?;
        let events = self.commit(tx).await?;
        Ok((output, events))
    }

    async fn lead(&self, pending: &Arc<Pending>) {
        let lane = self.lane().await;
        let mut parts = pending.take();
        if parts.is_empty() {
            return;
        }
        let grouped = async {
            let mut tx = self.begin_write_in(lane).await?;
            let mut ends = Vec::with_capacity(parts.len());
            for part in &mut parts {
                part.write(&mut tx).await?;
                // A part's deferred inserts go before the next part writes.
                tx.flush_deferred().await?;
                ends.push(tx.events.len());
            }
            Ok::<_, Error>((self.commit_unannounced(tx).await?, ends))
        }
        .await;
        match grouped {
            Ok((committed, ends)) => {
                // Each part's events, then the bus (the lane still held, so
                // that the bus hears commits in their order): a writer hears
                // that it committed before what its events wake up starts.
                let starts = std::iter::once(0).chain(ends.iter().copied());
                for ((part, start), end) in parts.into_iter().zip(starts).zip(ends.iter().copied())
                {
                    part.settle(Ok(committed.events[start..end].to_vec()));
                }
                self.announce(&committed);
            }
            Err(err) if parts.len() == 1 => {
                if let Some(part) = parts.pop() {
                    part.settle(Err(err));
                }
            }
            Err(_) => {
                for mut part in parts {
                    let alone = async {
                        let mut tx = self.begin_write().await?;
                        part.write(&mut tx).await?;
                        self.commit(tx).await
                    }
                    .await;
                    part.settle(alone);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use futures_util::future::join_all;
    use uuid::Uuid;

    use super::*;
    use crate::domain::MessageRole;
    use crate::domain::cursor::Cursor;
    use crate::domain::event::NewEvent;
    use crate::store::reads;
    use crate::store::test_support::{conversation, temp_store};

    /// What a writer does after writing.
    #[derive(Clone, Copy)]
    enum Then {
        Commit,
        Fail,
        Panic,
    }
    use Then::{Commit, Fail, Panic};

    /// A writer that appends `events` events to a conversation of Ada's,
    /// then does `then`.
    async fn append(
        store: &Store,
        conversation_id: Uuid,
        events: usize,
        then: Then,
    ) -> Result<Vec<Event>> {
        let ((), committed) = store
            .write(move |tx| {
                Box::pin(async move {
                    let locked = tx.lock_conversation(conversation_id, "acme").await?;
                    let new = (0..events)
                        .map(|_| NewEvent::message_created(Uuid::now_v7(), MessageRole::User, None))
                        .collect();
                    tx.append(&locked, new).await?;
                    match then {
                        Commit => Ok(()),
                        Fail => Err(Error::Conflict("refused after writing".into())),
                        Panic => panic!("a bug after writing"),
                    }
                })
            })
            .await?;
        Ok(committed)
    }

    /// Starts the writers while another write holds the lane, so that they
    /// all queue, then lets them go.
    async fn queued_behind_a_write(
        store: &Store,
        writers: Vec<(Uuid, usize, Then)>,
    ) -> Vec<Result<Vec<Event>>> {
        let held = store.begin_write().await.unwrap();
        let pending = store.pending.clone().expect("SQLite groups its writes");
        let count = writers.len();
        let store = Arc::new(store.clone());
        let tasks: Vec<_> = writers
            .into_iter()
            .map(|(id, events, then)| {
                let store = store.clone();
                tokio::spawn(async move { append(&store, id, events, then).await })
            })
            .collect();
        while pending.parts.lock().unwrap().len() < count {
            tokio::task::yield_now().await;
        }
        drop(held);
        join_all(tasks)
            .await
            .into_iter()
            .map(|t| t.unwrap())
            .collect()
    }

    async fn log(store: &Store, conversation_id: Uuid) -> Vec<Event> {
        reads::events_after(store.db(), "acme", conversation_id, Cursor::START, 1000)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn writers_ready_at_once_commit_in_one_transaction_each_with_its_own_events() {
        let (store, dir) = temp_store().await;
        let (a, b) = (conversation(&store).await.id, conversation(&store).await.id);
        let before = store.write_transactions();
        let results =
            queued_behind_a_write(&store, vec![(a, 2, Commit), (b, 1, Commit), (a, 3, Commit)])
                .await;
        // The held write, then one group for all three.
        assert_eq!(store.write_transactions() - before, 2);
        let results: Vec<Vec<Event>> = results.into_iter().map(Result::unwrap).collect();
        assert_eq!(results.iter().map(Vec::len).collect::<Vec<_>>(), [2, 1, 3]);
        assert!(results[1].iter().all(|e| e.conversation_id == b));
        // In arrival order, gap-free within each conversation.
        let cursors = |r: &Vec<Event>| r.iter().map(|e| e.cursor.0).collect::<Vec<_>>();
        assert_eq!(cursors(&results[0]), [1, 2]);
        assert_eq!(cursors(&results[1]), [1]);
        assert_eq!(cursors(&results[2]), [3, 4, 5]);
        assert_eq!(log(&store, a).await.len(), 5);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn a_writer_that_fails_in_a_group_undoes_nothing_of_the_others() {
        let (store, dir) = temp_store().await;
        let (a, b) = (conversation(&store).await.id, conversation(&store).await.id);
        let results =
            queued_behind_a_write(&store, vec![(a, 2, Commit), (b, 4, Fail), (a, 1, Commit)]).await;
        assert!(
            matches!(results[1], Err(Error::Conflict(_))),
            "{:?}",
            results[1]
        );
        let first = results[0].as_ref().unwrap();
        let third = results[2].as_ref().unwrap();
        assert_eq!(first.iter().map(|e| e.cursor.0).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(third.iter().map(|e| e.cursor.0).collect::<Vec<_>>(), [3]);
        // Nothing of the failed writer was kept, all of the others was.
        assert!(log(&store, b).await.is_empty());
        let kept: Vec<i64> = log(&store, a).await.iter().map(|e| e.cursor.0).collect();
        assert_eq!(kept, [1, 2, 3]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn a_writer_that_panics_in_a_group_fails_alone() {
        let (store, dir) = temp_store().await;
        let (a, b) = (conversation(&store).await.id, conversation(&store).await.id);
        let results =
            queued_behind_a_write(&store, vec![(a, 1, Commit), (b, 2, Panic), (a, 1, Commit)])
                .await;
        assert!(
            matches!(results[1], Err(Error::WriteFailed(_))),
            "{:?}",
            results[1]
        );
        assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
        assert!(log(&store, b).await.is_empty());
        assert_eq!(log(&store, a).await.len(), 2);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
