//! The watch: etcd's events under the prefix after a revision, as [`Event`]s, over
//! a connection that comes back by itself.
//!
//! The stream remembers the last revision it received. When the connection breaks
//! (etcd restarted, a member went away, the network was cut and the keepalive
//! noticed), it waits (100 ms, doubling to 5 s) and watches again from the revision
//! after that one: events are neither lost nor repeated. It ends with an error only
//! when going on is impossible: the history it needs was compacted
//! ([`LogError::Compacted`]), etcd's revision went back (a store restored from a
//! backup or wiped: [`LogError::FutureRevision`]), or etcd refuses the watch
//! ([`LogError::Refused`]). The consumer takes a new snapshot in every case.

use super::{Shared, error, keys::Parsed, keys::range_end};
use crate::orderedlog::{
    Event, EventStream, LogError, Revision,
    feed::{self, Feed},
};
use async_trait::async_trait;
use etcd_client::{EventType, WatchOptions, WatchResponse, WatchStream};
use std::{collections::VecDeque, sync::Arc, time::Duration};

/// First pause before watching again; doubles up to [`MAX_BACKOFF`].
const INITIAL_BACKOFF: Duration = Duration::from_millis(100);
/// Longest pause between attempts: a node is back on etcd at most a second after
/// etcd is (changes made then are live on every node within ~2 s), for one cheap
/// request a second per node while etcd is away.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Checks that `from` is not ahead of etcd (one request, which also fails fast
/// when etcd cannot be reached), then returns the stream of events after `from`.
pub(super) async fn start(inner: Arc<Shared>, from: Revision) -> Result<EventStream, LogError> {
    let log = super::EtcdLog {
        inner: inner.clone(),
    };
    let current = log.revision().await?;
    if from > current {
        return Err(LogError::FutureRevision {
            requested: from,
            current,
        });
    }
    Ok(feed::events(Cursor {
        inner,
        received: from,
        stream: None,
        backoff: INITIAL_BACKOFF,
        outage: false,
    }))
}

/// A watcher's position and connection.
struct Cursor {
    inner: Arc<Shared>,
    /// The highest revision whose events are delivered or read ahead: the next
    /// watch starts after it.
    received: Revision,
    /// The open watch, if any.
    stream: Option<WatchStream>,
    /// The pause before the next attempt after a failure.
    backoff: Duration,
    /// Whether the connection is broken (logged once per outage, and once when it
    /// comes back).
    outage: bool,
}

/// What a failed step means.
enum Failure {
    /// Try again after the backoff.
    Retry(String),
    /// End the stream with this error.
    End(LogError),
}

#[async_trait]
impl Feed for Cursor {
    /// The events of etcd's next response, through any reconnections.
    async fn fill(&mut self, pending: &mut VecDeque<Event>) -> Result<(), LogError> {
        loop {
            let step = match self.stream.as_mut() {
                None => self.open(pending).await,
                Some(stream) => match stream.message().await {
                    Ok(Some(response)) => self.take(response, pending),
                    Ok(None) => Err(Failure::Retry("etcd closed the watch".to_owned())),
                    Err(e) => Err(self.classify(&e)),
                },
            };
            match step {
                Ok(()) => return Ok(()),
                Err(Failure::End(e)) => {
                    self.stream = None;
                    return Err(e);
                }
                Err(Failure::Retry(message)) => {
                    self.stream = None;
                    if !self.outage {
                        tracing::warn!(
                            endpoints = %self.inner.endpoints,
                            error = %message,
                            after = self.received,
                            "etcd watch broken; reconnecting"
                        );
                        self.outage = true;
                    } else {
                        tracing::debug!(error = %message, "etcd watch still broken");
                    }
                    tokio::time::sleep(self.backoff).await;
                    self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }
}

impl Cursor {
    /// Opens a watch from the revision after [`Cursor::received`] and waits for
    /// etcd to confirm it.
    async fn open(&mut self, pending: &mut VecDeque<Event>) -> Result<(), Failure> {
        let prefix = self.inner.layout.prefix().as_bytes().to_vec();
        let options = WatchOptions::new()
            .with_range(range_end(&prefix))
            .with_start_revision(self.received as i64 + 1);
        let mut watch = self.inner.watch.clone();
        let mut stream = watch
            .watch(prefix, Some(options))
            .await
            .map_err(|e| self.classify(&e))?;
        let created = match stream.message().await {
            Ok(Some(r)) => r,
            Ok(None) => return Err(Failure::Retry("etcd closed the new watch".to_owned())),
            Err(e) => return Err(self.classify(&e)),
        };
        if let Some(current) = created.header().map(|h| h.revision().max(0) as Revision)
            && current < self.received
        {
            // The store went back in time: restored from a backup, or a new cluster.
            return Err(Failure::End(LogError::FutureRevision {
                requested: self.received,
                current,
            }));
        }
        self.take(created, pending)?;
        self.stream = Some(stream);
        if self.outage {
            tracing::info!(endpoints = %self.inner.endpoints, after = self.received, "etcd watch resumed");
            self.outage = false;
        }
        self.backoff = INITIAL_BACKOFF;
        Ok(())
    }

    /// Queues a response's events; a cancelled watch ends the stream.
    fn take(
        &mut self,
        response: WatchResponse,
        pending: &mut VecDeque<Event>,
    ) -> Result<(), Failure> {
        if response.canceled() {
            let compacted = response.compact_revision();
            if compacted > 0 {
                return Err(Failure::End(LogError::Compacted {
                    requested: self.received,
                    oldest: compacted as Revision,
                }));
            }
            let reason = response.cancel_reason();
            let message = if reason.is_empty() {
                "etcd cancelled the watch".to_owned()
            } else {
                format!("etcd cancelled the watch: {reason}")
            };
            if reason.contains("permission denied") {
                return Err(Failure::End(LogError::Refused {
                    endpoints: self.inner.endpoints.clone(),
                    message,
                }));
            }
            return Err(Failure::Retry(message));
        }
        let floor = self.received;
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            let revision = kv.mod_revision().max(0) as Revision;
            if revision <= floor {
                continue;
            }
            self.received = self.received.max(revision);
            match event.event_type() {
                EventType::Put => match self.inner.layout.parse(kv.key()) {
                    // `decode` logs and counts a value that is not a valid object.
                    Parsed::Object(_) => match self.inner.decode(kv.clone()) {
                        Some(object) => pending.push_back(Event::Put { revision, object }),
                        None => pending.push_back(skipped(kv.key(), revision)),
                    },
                    // Bookkeeping, node documents and drain records: not objects.
                    Parsed::Internal | Parsed::Node(_) | Parsed::Drain(_) => {}
                    Parsed::Unknown(reason) => {
                        self.inner.skip(kv.key(), revision, reason);
                        pending.push_back(skipped(kv.key(), revision));
                    }
                },
                EventType::Delete => match self.inner.layout.parse(kv.key()) {
                    Parsed::Object(key) => pending.push_back(Event::Delete { revision, key }),
                    // Bookkeeping, node documents (a lease expiring deletes
                    // one) and drain records (an undrain): not objects.
                    Parsed::Internal | Parsed::Node(_) | Parsed::Drain(_) => {}
                    Parsed::Unknown(reason) => {
                        self.inner.skip(kv.key(), revision, reason);
                        pending.push_back(skipped(kv.key(), revision));
                    }
                },
            }
        }
        Ok(())
    }

    /// A failed request: try again when it may pass, else end the stream.
    fn classify(&self, e: &etcd_client::Error) -> Failure {
        if error::is_compacted(e) {
            return Failure::End(LogError::Compacted {
                requested: self.received,
                oldest: self.received + 1,
            });
        }
        if error::is_transient(e) {
            Failure::Retry(error::describe(e))
        } else {
            Failure::End(self.inner.error(e))
        }
    }
}

/// The event of a value at `revision` that was skipped (see [`Event::Skipped`]).
fn skipped(key: &[u8], revision: Revision) -> Event {
    Event::Skipped {
        revision,
        key: String::from_utf8_lossy(key).into_owned(),
    }
}
