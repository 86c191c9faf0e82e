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
mod tests;
