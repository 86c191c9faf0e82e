//! The node's bounded, in-memory buffer of logs and events on their way to remote
//! sinks. Producers (every subsystem, on hot paths) never block: when the outbox is
//! full a new entry is dropped and counted. One consumer, the forwarder, drains it in
//! order.
//!
//! `rune_outbox_depth` and `rune_outbox_dropped_total` always match [`Outbox::len`]
//! and [`Outbox::dropped`].

use std::{
    collections::VecDeque,
    sync::{
        Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::SystemTime,
};

use prometheus_client::metrics::{counter::Counter, gauge::Gauge};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::metrics::Metrics;

/// What an outbox entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    /// A log line.
    Log,
    /// A structured event (a state change a user would want to see).
    Event,
}

/// One log line or event waiting to be forwarded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxEntry {
    /// Log or event.
    pub kind: EntryKind,
    /// When it happened.
    pub at: SystemTime,
    /// The subsystem that produced it.
    pub subsystem: String,
    /// The text.
    pub message: String,
}

impl OutboxEntry {
    /// A log line from `subsystem`, stamped now.
    pub fn log(subsystem: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(EntryKind::Log, subsystem, message)
    }

    /// An event from `subsystem`, stamped now.
    pub fn event(subsystem: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(EntryKind::Event, subsystem, message)
    }

    fn new(kind: EntryKind, subsystem: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            kind,
            at: SystemTime::now(),
            subsystem: subsystem.into(),
            message: message.into(),
        }
    }
}

/// The bounded outbox. Share it behind an `Arc`.
#[derive(Debug)]
pub struct Outbox {
    queue: Mutex<VecDeque<OutboxEntry>>,
    capacity: usize,
    dropped: AtomicU64,
    notify: Notify,
    depth_gauge: Gauge,
    dropped_counter: Counter,
}

impl Outbox {
    /// An empty outbox holding at most `capacity` entries (0 drops everything),
    /// keeping `depth` and `dropped` current.
    pub fn new(capacity: usize, depth: Gauge, dropped: Counter) -> Self {
        depth.set(0);
        Self {
            queue: Mutex::new(VecDeque::new()),
            capacity,
            dropped: AtomicU64::new(0),
            notify: Notify::new(),
            depth_gauge: depth,
            dropped_counter: dropped,
        }
    }

    /// An empty outbox reporting through the agent's `rune_outbox_*` metrics.
    pub fn from_metrics(capacity: usize, metrics: &Metrics) -> Self {
        Self::new(
            capacity,
            metrics.outbox_depth.clone(),
            metrics.outbox_dropped.clone(),
        )
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<OutboxEntry>> {
        crate::lock::lock(&self.queue)
    }

    fn set_depth(&self, len: usize) {
        self.depth_gauge.set(i64::try_from(len).unwrap_or(i64::MAX));
    }

    /// Queues `entry` without ever waiting; `false` (and one more drop counted) when
    /// the outbox is full.
    pub fn push(&self, entry: OutboxEntry) -> bool {
        let mut queue = self.lock();
        if queue.len() >= self.capacity {
            drop(queue);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            self.dropped_counter.inc();
            return false;
        }
        queue.push_back(entry);
        self.set_depth(queue.len());
        drop(queue);
        self.notify.notify_one();
        true
    }

    /// Entries refused because the outbox was full, since it was created.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Entries waiting.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The most entries the outbox holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Takes up to `max` of the oldest entries, in order, without waiting.
    pub fn drain_batch(&self, max: usize) -> Vec<OutboxEntry> {
        let mut queue = self.lock();
        let n = max.min(queue.len());
        let batch: Vec<OutboxEntry> = queue.drain(..n).collect();
        self.set_depth(queue.len());
        batch
    }

    /// Waits until at least one entry is waiting, then takes up to `max` (at least
    /// one) of the oldest, in order. Cancel-safe: dropping the future loses nothing.
    pub async fn recv_batch(&self, max: usize) -> Vec<OutboxEntry> {
        let max = max.max(1);
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let batch = self.drain_batch(max);
            if !batch.is_empty() {
                return batch;
            }
            notified.await;
        }
    }

    /// Waits for the oldest entry and takes it. Cancel-safe.
    pub async fn recv(&self) -> OutboxEntry {
        loop {
            if let Some(entry) = self.recv_batch(1).await.pop() {
                return entry;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use super::*;

    fn outbox(capacity: usize) -> (Outbox, Gauge, Counter) {
        let depth = Gauge::default();
        let dropped = Counter::default();
        (
            Outbox::new(capacity, depth.clone(), dropped.clone()),
            depth,
            dropped,
        )
    }

    #[test]
    fn entries_come_out_in_push_order() {
        let (outbox, _, _) = outbox(10);
        for i in 0..5 {
            assert!(outbox.push(OutboxEntry::log("dns", format!("m{i}"))));
        }
        let first = outbox.drain_batch(2);
        let rest = outbox.drain_batch(100);
        let messages: Vec<String> = first.into_iter().chain(rest).map(|e| e.message).collect();
        assert_eq!(messages, ["m0", "m1", "m2", "m3", "m4"]);
        assert!(outbox.is_empty());
    }

    #[test]
    fn drops_are_counted_at_capacity_and_metrics_match() {
        let (outbox, depth, dropped) = outbox(3);
        let accepted: Vec<bool> = (0..5)
            .map(|i| outbox.push(OutboxEntry::event("dataplane", format!("e{i}"))))
            .collect();
        assert_eq!(accepted, [true, true, true, false, false]);
        assert_eq!(outbox.len(), 3);
        assert_eq!(outbox.dropped(), 2);
        assert_eq!(depth.get(), 3);
        assert_eq!(dropped.get(), 2);
        // The oldest entries were kept, the newest dropped.
        let kept: Vec<String> = outbox
            .drain_batch(10)
            .into_iter()
            .map(|e| e.message)
            .collect();
        assert_eq!(kept, ["e0", "e1", "e2"]);
        assert_eq!(depth.get(), 0);
        // Room again after draining.
        assert!(outbox.push(OutboxEntry::log("dns", "again")));
        assert_eq!(depth.get(), 1);
        assert_eq!(dropped.get(), 2);
    }

    #[test]
    fn metrics_struct_handles_follow_the_outbox() {
        let metrics = Metrics::new();
        let outbox = Outbox::from_metrics(1, &metrics);
        outbox.push(OutboxEntry::log("a", "1"));
        outbox.push(OutboxEntry::log("a", "2"));
        assert_eq!(metrics.outbox_depth.get(), 1);
        assert_eq!(metrics.outbox_dropped.get(), 1);
        let text = metrics.encode();
        assert!(text.contains("rune_outbox_depth 1"), "{text}");
        assert!(text.contains("rune_outbox_dropped_total 1"), "{text}");
    }

    #[test]
    fn zero_capacity_drops_everything() {
        let (outbox, _, dropped) = outbox(0);
        assert!(!outbox.push(OutboxEntry::log("a", "1")));
        assert_eq!(dropped.get(), 1);
        assert!(outbox.is_empty());
    }

    #[tokio::test]
    async fn producers_never_block_while_nobody_consumes() {
        let (outbox, _, _) = outbox(100);
        let outbox = Arc::new(outbox);
        let producers: Vec<_> = (0..4)
            .map(|p| {
                let outbox = outbox.clone();
                tokio::spawn(async move {
                    for i in 0..1000 {
                        outbox.push(OutboxEntry::log(format!("p{p}"), format!("{i}")));
                    }
                })
            })
            .collect();
        tokio::time::timeout(Duration::from_secs(2), futures::future::join_all(producers))
            .await
            .expect("producers blocked on a full outbox");
        assert_eq!(outbox.len(), 100);
        assert_eq!(outbox.dropped(), 3900);
    }

    #[tokio::test]
    async fn recv_waits_for_a_push_and_keeps_order() {
        use futures::FutureExt;

        let (outbox, depth, _) = outbox(10);
        let first = outbox.recv();
        tokio::pin!(first);
        // Nothing queued yet: the consumer is waiting.
        assert!(first.as_mut().now_or_never().is_none());
        for m in ["a", "b", "c"] {
            assert!(outbox.push(OutboxEntry::log("x", m)));
        }
        let first = tokio::time::timeout(Duration::from_secs(2), first)
            .await
            .expect("waiting consumer was not woken by a push");
        assert_eq!(first.message, "a");
        assert_eq!(outbox.recv().await.message, "b");
        assert_eq!(outbox.recv().await.message, "c");
        assert_eq!(depth.get(), 0);
    }

    #[tokio::test]
    async fn recv_batch_returns_what_is_waiting_up_to_max() {
        let (outbox, _, _) = outbox(10);
        for m in ["a", "b", "c"] {
            outbox.push(OutboxEntry::log("x", m));
        }
        let batch = outbox.recv_batch(2).await;
        assert_eq!(batch.len(), 2);
        assert_eq!(outbox.recv_batch(10).await.len(), 1);
        // Nothing waiting: recv_batch waits.
        let waited = tokio::time::timeout(Duration::from_millis(50), outbox.recv_batch(10)).await;
        assert!(waited.is_err());
    }
}
