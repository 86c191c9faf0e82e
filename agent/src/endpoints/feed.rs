//! The `watch` subsystem ([`CacheFeed`]): the ordered log into the endpoint cache,
//! a snapshot then the watch, resyncing after a compaction or a broken stream.

use super::EndpointCache;
use crate::{
    applied::AppliedRevision,
    lock::lock,
    metrics::{KindLabels, Metrics},
    orderedlog::{LogError, OrderedLog, Revision},
    subsystem::{Readiness, ReadySetter, StartContext, Subsystem, SubsystemError},
};
use futures::{FutureExt, StreamExt};
use std::{
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// The `watch` subsystem: follows the ordered log into the cache. Ready once the
/// first snapshot is in; after a compaction or a broken stream it resyncs from a new
/// snapshot; other errors are retried with a capped backoff.
pub struct CacheFeed {
    log: Arc<dyn OrderedLog>,
    cache: Arc<EndpointCache>,
    metrics: Arc<Metrics>,
    synced: ReadySetter,
    readiness: Readiness,
    tasks: TaskTracker,
    /// The first snapshot, when its read was started before this subsystem (see
    /// [`CacheFeed::with_first_snapshot`]).
    first: Mutex<Option<FirstSnapshot>>,
    /// Told when each batch of events was received ([`CacheFeed::with_applied`]).
    applied: Option<AppliedRevision>,
}

/// A first snapshot being read into the cache already ([`read_first_snapshot`]).
pub type FirstSnapshot = tokio::task::JoinHandle<Result<TakenSnapshot, LogError>>;

/// A snapshot the cache holds already: what the feed goes on from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TakenSnapshot {
    /// Its revision: the feed watches from there.
    pub revision: Revision,
    /// Its object count (for the log line).
    pub objects: usize,
}

/// Reads `log`'s snapshot into `cache` in the background: the agent's first one,
/// while preflight and the data plane's load run, so that the cache is loaded (and
/// its subscribers' first delta ready) when the subsystems start: a start does not
/// wait for the read on top of the data plane's load. Hand the result to
/// [`CacheFeed::with_first_snapshot`].
pub fn read_first_snapshot(log: Arc<dyn OrderedLog>, cache: Arc<EndpointCache>) -> FirstSnapshot {
    tokio::spawn(async move {
        let snapshot = log.snapshot().await?;
        let taken = TakenSnapshot {
            revision: snapshot.revision,
            objects: snapshot.objects.len(),
        };
        // CPU work: off the runtime's workers. A panic there ends this task too, and
        // the feed reads the snapshot again.
        if let Err(e) = tokio::task::spawn_blocking(move || cache.take_snapshot(snapshot)).await {
            std::panic::resume_unwind(e.into_panic());
        }
        Ok(taken)
    })
}

impl CacheFeed {
    /// A feed from `log` into `cache`, keeping `rune_objects` and
    /// `rune_revision_applied` current.
    pub fn new(log: Arc<dyn OrderedLog>, cache: Arc<EndpointCache>, metrics: Arc<Metrics>) -> Self {
        let (synced, readiness) = Readiness::new();
        Self {
            log,
            cache,
            metrics,
            synced,
            readiness,
            tasks: TaskTracker::new(),
            first: Mutex::new(None),
            applied: None,
        }
    }

    /// Records when each batch of events was received in `applied`, for
    /// `rune_watch_lag_seconds` (receipt to effect in the kernel).
    #[must_use]
    pub fn with_applied(mut self, applied: AppliedRevision) -> Self {
        self.applied = Some(applied);
        self
    }

    /// Goes on from `first` (`log`'s snapshot read into the cache earlier, e.g. while
    /// preflight and the data plane load run); should it fail, the feed reads one
    /// itself as usual.
    #[must_use]
    pub fn with_first_snapshot(self, first: FirstSnapshot) -> Self {
        *lock(&self.first) = Some(first);
        self
    }
}

#[async_trait::async_trait]
impl Subsystem for CacheFeed {
    fn name(&self) -> &str {
        "watch"
    }

    async fn start(&self, ctx: &StartContext) -> Result<(), SubsystemError> {
        self.tasks.spawn(follow(
            self.log.clone(),
            self.cache.clone(),
            self.metrics.clone(),
            self.synced.clone(),
            ctx.cancel.clone(),
            lock(&self.first).take(),
            self.applied.clone(),
        ));
        Ok(())
    }

    fn ready(&self) -> Readiness {
        self.readiness.clone()
    }

    async fn stop(&self) -> Result<(), SubsystemError> {
        self.tasks.close();
        self.tasks.wait().await;
        Ok(())
    }
}

/// First pause before retrying the ordered log; doubles up to [`MAX_BACKOFF`].
const INITIAL_BACKOFF: Duration = Duration::from_millis(100);
/// Longest pause between retries.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Most events applied to the cache as one step.
const MAX_BATCH: usize = 4096;

fn publish(cache: &EndpointCache, metrics: &Metrics) {
    for (kind, n) in cache.counts() {
        metrics
            .objects
            .get_or_create(&KindLabels {
                kind: kind.to_string(),
            })
            .set(n as i64);
    }
    metrics.revision_applied.set(cache.revision() as i64);
}

/// Snapshot, then watch, forever (until `cancel`).
async fn follow(
    log: Arc<dyn OrderedLog>,
    cache: Arc<EndpointCache>,
    metrics: Arc<Metrics>,
    synced: ReadySetter,
    cancel: CancellationToken,
    mut first: Option<FirstSnapshot>,
    applied: Option<AppliedRevision>,
) {
    let mut backoff = INITIAL_BACKOFF;
    let pause = |d: Duration| {
        let cancel = cancel.clone();
        async move {
            tokio::select! {
                () = cancel.cancelled() => false,
                () = tokio::time::sleep(d) => true,
            }
        }
    };
    loop {
        let early = match first.take() {
            Some(mut read) => tokio::select! {
                () = cancel.cancelled() => {
                    // Not left to fill the cache after this feed is gone.
                    read.abort();
                    return;
                }
                // A read task that panicked or was cancelled: read again below.
                r = &mut read => r.ok(),
            },
            None => None,
        };
        let taken = match early {
            // Already in the cache.
            Some(Ok(taken)) => Ok(taken),
            Some(Err(e)) => Err(e),
            None => tokio::select! {
                () = cancel.cancelled() => return,
                s = log.snapshot() => s.map(|snapshot| {
                    let taken = TakenSnapshot {
                        revision: snapshot.revision,
                        objects: snapshot.objects.len(),
                    };
                    cache.take_snapshot(snapshot);
                    taken
                }),
            },
        };
        let TakenSnapshot { revision, objects } = match taken {
            Ok(taken) => taken,
            Err(e) => {
                tracing::warn!(error = %e, "ordered log snapshot failed; retrying");
                if !pause(backoff).await {
                    return;
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        publish(&cache, &metrics);
        synced.set_ready();
        tracing::info!(revision, objects, "cache synced");
        let mut stream = match log.watch(revision).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "ordered log watch failed; resyncing");
                if !pause(backoff).await {
                    return;
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        loop {
            let item = tokio::select! {
                () = cancel.cancelled() => return,
                item = stream.next() => item,
            };
            match item {
                Some(Ok(event)) => {
                    let received = std::time::Instant::now();
                    // Take every event already waiting (one `apply` writes several)
                    // and apply them as one step.
                    let mut batch = vec![event];
                    let mut ended = None;
                    while batch.len() < MAX_BATCH {
                        match stream.next().now_or_never() {
                            Some(Some(Ok(e))) => batch.push(e),
                            Some(other) => {
                                ended = Some(other);
                                break;
                            }
                            None => break,
                        }
                    }
                    if let (Some(applied), Some(last)) = (&applied, batch.last()) {
                        applied.received(last.revision(), received);
                    }
                    cache.apply_events(&batch);
                    publish(&cache, &metrics);
                    // Only a stream that delivers counts as healthy.
                    backoff = INITIAL_BACKOFF;
                    match ended {
                        Some(Some(Err(e))) => {
                            tracing::warn!(error = %e, resync = e.needs_resync(), "watch ended; taking a new snapshot");
                            break;
                        }
                        Some(None) => {
                            tracing::warn!("watch stream closed; taking a new snapshot");
                            break;
                        }
                        _ => {}
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, resync = e.needs_resync(), "watch ended; taking a new snapshot");
                    break;
                }
                None => {
                    tracing::warn!("watch stream closed; taking a new snapshot");
                    break;
                }
            }
        }
        if !pause(backoff).await {
            return;
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}
