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
//! commit order, since the group commits at once.
//!
//! The group runs in a task of its own: a writer that stops waiting (a
//! dropped request) cancels nothing of the others.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::future::BoxFuture;
use tokio::sync::oneshot;

use super::WriteTx;
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
            self.output = Some((self.write)(tx).await?);
            Ok(())
        })
    }

    fn settle(self: Box<Self>, committed: Result<Vec<Event>>) {
        let Writer { output, answer, .. } = *self;
        let result = committed.and_then(|events| match output {
            Some(output) => Ok((output, events)),
            None => Err(Error::Conflict("a committed write has no result".into())),
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
    pub(in crate::store) async fn write<T, W>(&self, mut write: W) -> Result<(T, Vec<Event>)>
    where
        T: Send + 'static,
        W: for<'t> FnMut(&'t mut WriteTx) -> BoxFuture<'t, Result<T>> + Send + 'static,
    {
        let Some(pending) = &self.pending else {
            let mut tx = self.begin_write().await?;
            let output = write(&mut tx).await?;
            let events = self.commit(tx).await?;
            return Ok((output, events));
        };
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
            .unwrap_or_else(|_| Err(Error::Conflict("the group commit was stopped".into())))
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
                ends.push(tx.events.len());
            }
            Ok::<_, Error>((self.commit(tx).await?, ends))
        }
        .await;
        match grouped {
            Ok((mut events, ends)) => {
                // Each part's events, from the last part back.
                for (part, start) in parts
                    .into_iter()
                    .rev()
                    .zip(ends.iter().rev().skip(1).copied().chain([0]))
                {
                    let own = events.split_off(start);
                    part.settle(Ok(own));
                }
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
