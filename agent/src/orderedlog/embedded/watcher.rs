//! Watching the embedded log: a watcher reads the `log` table's rows after its
//! position, a batch at a time, whenever the commit signal moves.

use super::{EmbeddedLog, Inner, LOG, META, META_OLDEST, META_REVISION, StoredEvent, read_meta};
use crate::{
    model::{ObjectKey, parse_stored},
    orderedlog::{
        Event, EventStream, LogError, OrderedLog, Revision, Snapshot,
        feed::{self, Feed},
    },
};
use async_trait::async_trait;
use redb::ReadableDatabase;
use std::{
    collections::VecDeque,
    sync::{Arc, Weak},
};
use tokio::sync::watch;

/// Most events a watcher reads in one transaction.
const WATCH_BATCH: usize = 256;

impl Inner {
    /// (current revision, oldest watchable revision).
    fn bounds(&self) -> Result<(Revision, Revision), LogError> {
        let txn = self.db.begin_read().map_err(|e| self.storage(e))?;
        let meta = txn.open_table(META).map_err(|e| self.storage(e))?;
        Ok((
            read_meta(&meta, META_REVISION, &self.path)?,
            read_meta(&meta, META_OLDEST, &self.path)?,
        ))
    }

    /// Up to `limit` events after `after`, which must follow it without a gap;
    /// [`LogError::Compacted`] when they are gone.
    fn read_events(&self, after: Revision, limit: usize) -> Result<Vec<Event>, LogError> {
        let txn = self.db.begin_read().map_err(|e| self.storage(e))?;
        let meta = txn.open_table(META).map_err(|e| self.storage(e))?;
        let log = txn.open_table(LOG).map_err(|e| self.storage(e))?;
        let current = read_meta(&meta, META_REVISION, &self.path)?;
        let oldest = read_meta(&meta, META_OLDEST, &self.path)?;
        if after < oldest {
            return Err(LogError::Compacted {
                requested: after,
                oldest,
            });
        }
        let mut out = Vec::new();
        let mut expected = after + 1;
        for row in log
            .range(expected..)
            .map_err(|e| self.storage(e))?
            .take(limit)
        {
            let (k, v) = row.map_err(|e| self.storage(e))?;
            let revision = k.value();
            if revision != expected {
                return Err(LogError::Corrupt {
                    what: format!("revision {expected}"),
                    message: format!("missing from the log (next stored is {revision})"),
                });
            }
            out.push(parse_event(revision, v.value())?);
            expected += 1;
        }
        if out.is_empty() && current > after {
            return Err(LogError::Corrupt {
                what: format!("revision {expected}"),
                message: format!("missing from the log (the log is at {current})"),
            });
        }
        Ok(out)
    }
}

fn parse_event(revision: Revision, text: &str) -> Result<Event, LogError> {
    let corrupt = |message: String| LogError::Corrupt {
        what: format!("revision {revision}"),
        message,
    };
    match serde_json::from_str(text).map_err(|e| corrupt(e.to_string()))? {
        StoredEvent::Put { object } => Ok(Event::Put {
            revision,
            object: parse_stored(&object.to_string()).map_err(|e| corrupt(e.to_string()))?,
        }),
        StoredEvent::Delete { key } => Ok(Event::Delete {
            revision,
            key: ObjectKey::new(key.kind, key.namespace, key.name),
        }),
    }
}

/// Runs blocking store work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, LogError> + Send + 'static,
) -> Result<T, LogError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        // A panic in the store layer becomes an error the caller can report and retry
        // (the watch loop resyncs), instead of silently ending the caller's task.
        Err(e) if e.is_panic() => Err(LogError::Storage {
            path: "store task".into(),
            message: format!("panicked: {e}"),
        }),
        // Cancelled: the runtime is shutting down.
        Err(_) => Err(LogError::Closed),
    }
}

/// A watcher's position: the last revision it read (delivered, or waiting in the
/// read-ahead).
struct Cursor {
    inner: Weak<Inner>,
    committed: watch::Receiver<Revision>,
    last: Revision,
}

#[async_trait]
impl Feed for Cursor {
    async fn fill(&mut self, pending: &mut VecDeque<Event>) -> Result<(), LogError> {
        while *self.committed.borrow_and_update() <= self.last {
            self.committed
                .changed()
                .await
                .map_err(|_| LogError::Closed)?;
        }
        let inner = self.inner.upgrade().ok_or(LogError::Closed)?;
        let after = self.last;
        let events = blocking(move || inner.read_events(after, WATCH_BATCH)).await?;
        if let Some(last) = events.last() {
            self.last = last.revision();
        }
        pending.extend(events);
        Ok(())
    }
}

#[async_trait]
impl OrderedLog for EmbeddedLog {
    async fn snapshot(&self) -> Result<Snapshot, LogError> {
        let inner = self.inner.clone();
        let (revision, objects) = blocking(move || inner.read_all()).await?;
        Ok(Snapshot { revision, objects })
    }

    async fn watch(&self, from: Revision) -> Result<EventStream, LogError> {
        // Subscribe first, so no commit after the bounds check goes unnoticed.
        let committed = self.inner.committed.subscribe();
        let inner = self.inner.clone();
        let (current, oldest) = blocking(move || inner.bounds()).await?;
        if from > current {
            return Err(LogError::FutureRevision {
                requested: from,
                current,
            });
        }
        if from < oldest {
            return Err(LogError::Compacted {
                requested: from,
                oldest,
            });
        }
        Ok(feed::events(Cursor {
            inner: Arc::downgrade(&self.inner),
            committed,
            last: from,
        }))
    }
}
