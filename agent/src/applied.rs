//! The applied revision: the highest ordered-log revision whose effect is in this
//! node's kernel (the data plane's maps or rules written and the DNS zone swapped),
//! not merely received. The node's document publishes it, and `apply --wait`
//! waits for it on every Ready node.
//!
//! Each consumer of the endpoint cache gets an [`Acker`] and acknowledges the
//! revision of every delta once that delta is in effect (the cache hands out a
//! delta for every revision, even one that changes nothing for the consumer, so
//! acknowledgements never stall). The applied revision is the minimum over the
//! consumers. The watch's feed records when it received each batch of events
//! ([`AppliedRevision::received`]), so the time from receipt to effect can be
//! measured (`rune_watch_lag_seconds`).

use crate::{lock::lock, metrics::AppliedMetrics, orderedlog::Revision};
use std::{
    collections::{BTreeMap, VecDeque},
    sync::{Arc, Mutex},
    time::Instant,
};
use tokio::sync::watch;

/// Receipts kept while waiting for their effect: beyond this the oldest go (a
/// consumer stuck for long must not grow memory without bound).
const MAX_RECEIPTS: usize = 10_000;

/// The applied revision of this node. Cheap to clone: clones share one value.
#[derive(Clone, Debug)]
pub struct AppliedRevision {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    tx: watch::Sender<Revision>,
    metrics: Option<AppliedMetrics>,
}

#[derive(Debug, Default)]
struct State {
    /// Each consumer's last acknowledged revision, by slot.
    acks: BTreeMap<u64, (&'static str, Revision)>,
    next_slot: u64,
    /// Batches received and not yet in effect: their last revision, and when.
    receipts: VecDeque<(Revision, Instant)>,
}

/// One consumer's acknowledgements. Cheap to clone (clones share the slot); when
/// the last clone is dropped the consumer no longer holds the applied revision
/// back (e.g. DNS turned off in dev mode).
#[derive(Clone, Debug)]
pub struct Acker {
    slot: Arc<Slot>,
}

#[derive(Debug)]
struct Slot {
    id: u64,
    inner: Arc<Inner>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut st = lock(&self.inner.state);
        st.acks.remove(&self.id);
        self.inner.recompute(&mut st);
    }
}

impl AppliedRevision {
    /// Revision 0, no consumers, no metrics.
    pub fn new() -> Self {
        Self::build(None)
    }

    /// Like [`AppliedRevision::new`], keeping `rune_applied_revision` and
    /// `rune_watch_lag_seconds` current.
    pub fn with_metrics(metrics: &crate::metrics::Metrics) -> Self {
        Self::build(Some(metrics.applied.clone()))
    }

    fn build(metrics: Option<AppliedMetrics>) -> Self {
        let (tx, _) = watch::channel(0);
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                tx,
                metrics,
            }),
        }
    }

    /// Registers a consumer (`dataplane`, `dns`) at revision 0: until it
    /// acknowledges, the applied revision stays 0.
    pub fn consumer(&self, name: &'static str) -> Acker {
        let mut st = lock(&self.inner.state);
        let id = st.next_slot;
        st.next_slot += 1;
        st.acks.insert(id, (name, 0));
        self.inner.recompute(&mut st);
        Acker {
            slot: Arc::new(Slot {
                id,
                inner: self.inner.clone(),
            }),
        }
    }

    /// Records that a batch of events up to `revision` was received at `at`: its
    /// lag is observed once every consumer acknowledged it.
    pub fn received(&self, revision: Revision, at: Instant) {
        let mut st = lock(&self.inner.state);
        if st.receipts.len() >= MAX_RECEIPTS {
            st.receipts.pop_front();
        }
        st.receipts.push_back((revision, at));
        // A batch that arrives after its effect (a consumer acknowledged from a
        // snapshot already) is settled at once.
        self.inner.settle(&mut st, *self.inner.tx.borrow());
    }

    /// The applied revision now.
    pub fn get(&self) -> Revision {
        *self.inner.tx.borrow()
    }

    /// Follows the applied revision.
    pub fn subscribe(&self) -> watch::Receiver<Revision> {
        self.inner.tx.subscribe()
    }

    /// Each consumer's last acknowledged revision, by name (for logs and tests).
    pub fn consumers(&self) -> Vec<(&'static str, Revision)> {
        lock(&self.inner.state).acks.values().copied().collect()
    }
}

impl Default for AppliedRevision {
    fn default() -> Self {
        Self::new()
    }
}

impl Inner {
    /// Sets the applied revision to the minimum over the consumers (kept as is
    /// with none) and settles the receipts it covers.
    fn recompute(&self, st: &mut State) {
        let Some(min) = st.acks.values().map(|(_, r)| *r).min() else {
            return;
        };
        self.tx.send_if_modified(|current| {
            let changed = *current != min;
            *current = min;
            changed
        });
        if let Some(m) = &self.metrics {
            m.applied_revision.set(min as i64);
        }
        self.settle(st, min);
    }

    /// Observes the lag of every receipt at or below `applied`.
    fn settle(&self, st: &mut State, applied: Revision) {
        let now = Instant::now();
        while let Some((revision, at)) = st.receipts.front().copied() {
            if revision > applied {
                break;
            }
            st.receipts.pop_front();
            if let Some(m) = &self.metrics {
                m.watch_lag.observe(now.duration_since(at).as_secs_f64());
            }
        }
    }
}

impl Acker {
    /// Acknowledges that everything up to `revision` is in effect for this
    /// consumer.
    pub fn ack(&self, revision: Revision) {
        let inner = &self.slot.inner;
        let mut st = lock(&inner.state);
        if let Some(slot) = st.acks.get_mut(&self.slot.id) {
            slot.1 = revision;
        }
        inner.recompute(&mut st);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    #[test]
    fn the_applied_revision_is_the_minimum_of_the_consumers() {
        let applied = AppliedRevision::new();
        let plane = applied.consumer("dataplane");
        let dns = applied.consumer("dns");
        let rx = applied.subscribe();
        plane.ack(7);
        assert_eq!(applied.get(), 0, "DNS has not acknowledged anything yet");
        dns.ack(5);
        assert_eq!(applied.get(), 5);
        dns.ack(9);
        assert_eq!(applied.get(), 7);
        assert_eq!(*rx.borrow(), 7);
        assert_eq!(applied.consumers(), vec![("dataplane", 7), ("dns", 9)]);
        // A consumer that goes away holds nothing back.
        drop(plane);
        assert_eq!(applied.get(), 9);
    }

    #[test]
    fn lag_is_observed_once_every_consumer_applied_the_batch() {
        let metrics = Metrics::new();
        let applied = AppliedRevision::with_metrics(&metrics);
        let plane = applied.consumer("dataplane");
        let dns = applied.consumer("dns");
        applied.received(3, Instant::now());
        applied.received(4, Instant::now());
        plane.ack(4);
        dns.ack(3);
        let text = metrics.encode();
        assert!(text.contains("rune_watch_lag_seconds_count 1"), "{text}");
        assert!(text.contains("rune_applied_revision 3"), "{text}");
        dns.ack(4);
        let text = metrics.encode();
        assert!(text.contains("rune_watch_lag_seconds_count 2"), "{text}");
        assert!(text.contains("rune_applied_revision 4"), "{text}");
    }
}
