//! The `drains` subsystem: follows the drain records in etcd (`<prefix>drains/`)
//! and hands the host names of the drained nodes to the endpoint cache
//! ([`EndpointCache::set_drained_nodes`]), which makes their endpoints terminating
//! for the data plane and DNS.
//!
//! It lists the subtree, then watches it from the listing's revision; when the
//! watch breaks (etcd away, compaction) it lists again, 100 ms doubling to 1 s
//! apart. While etcd is away the last set stays (an agent keeps serving what it
//! had). Ready after the first listing; its start waits for the first attempt a
//! moment ([`FIRST_LISTING_WAIT`]) so that the data plane's first delta already
//! leaves the drained nodes out.

use super::drain::DrainRecord;
use crate::{
    endpoints::EndpointCache,
    lock::lock,
    orderedlog::etcd::{DrainChange, DrainEntry, EtcdLog},
    subsystem::{Readiness, ReadySetter, StartContext, Subsystem, SubsystemError},
};
use futures::StreamExt;
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// How long `start` waits at most for the first listing's answer (or failure): a
/// drain known before the data plane's first delta sends no new flow to a drained
/// node, but a slow etcd must not hold the agent's start (and its ready timeout)
/// up for long; the listing goes on in the background.
pub const FIRST_LISTING_WAIT: Duration = Duration::from_millis(500);
/// First pause before listing again; doubles up to [`MAX_BACKOFF`].
const INITIAL_BACKOFF: Duration = Duration::from_millis(100);
/// Longest pause between listings while etcd is away (as the object watch).
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The drain records an agent knows, by node id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DrainSet {
    records: BTreeMap<String, DrainRecord>,
}

impl DrainSet {
    /// The set of a listing; records that are not valid are logged and left out
    /// (their node is not drained on this agent).
    pub fn from_listing(entries: Vec<DrainEntry>) -> DrainSet {
        let mut set = DrainSet::default();
        for e in entries {
            set.put(e);
        }
        set
    }

    /// Takes in a written record.
    pub fn put(&mut self, entry: DrainEntry) {
        match DrainRecord::parse(&entry.id, &entry.value) {
            Ok(record) => {
                self.records.insert(entry.id, record);
            }
            Err(why) => {
                tracing::error!(node_id = %entry.id, error = %why, "drain record skipped");
                self.records.remove(&entry.id);
            }
        }
    }

    /// Takes in a change from the watch.
    pub fn apply(&mut self, change: DrainChange) {
        match change {
            DrainChange::Put(entry) => self.put(entry),
            DrainChange::Delete { id, .. } => {
                self.records.remove(&id);
            }
        }
    }

    /// The drained nodes' host names: what endpoints name their node by.
    pub fn hostnames(&self) -> BTreeSet<String> {
        self.records.values().map(|r| r.hostname.clone()).collect()
    }
}

/// The `drains` subsystem (see the module's doc).
pub struct DrainFollower {
    log: EtcdLog,
    cache: Arc<EndpointCache>,
    synced: ReadySetter,
    readiness: Readiness,
    tasks: TaskTracker,
    /// The set last handed to the cache (for the log lines).
    current: Arc<Mutex<BTreeSet<String>>>,
}

impl DrainFollower {
    /// A follower of `log`'s drain records into `cache`.
    pub fn new(log: EtcdLog, cache: Arc<EndpointCache>) -> Self {
        let (synced, readiness) = Readiness::new();
        Self {
            log,
            cache,
            synced,
            readiness,
            tasks: TaskTracker::new(),
            current: Arc::default(),
        }
    }
}

#[async_trait::async_trait]
impl Subsystem for DrainFollower {
    fn name(&self) -> &str {
        "drains"
    }

    async fn start(&self, ctx: &StartContext) -> Result<(), SubsystemError> {
        let (attempted, first_attempt) = Readiness::new();
        let follower = Follower {
            log: self.log.clone(),
            cache: self.cache.clone(),
            synced: self.synced.clone(),
            attempted,
            current: self.current.clone(),
        };
        self.tasks.spawn(follower.run(ctx.cancel.clone()));
        let _ = tokio::time::timeout(FIRST_LISTING_WAIT, first_attempt.wait()).await;
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

/// The task's share of the subsystem.
struct Follower {
    log: EtcdLog,
    cache: Arc<EndpointCache>,
    synced: ReadySetter,
    /// Set once a listing was answered or failed (what `start` waits for).
    attempted: ReadySetter,
    current: Arc<Mutex<BTreeSet<String>>>,
}

impl Follower {
    /// List, then watch, until `cancel`.
    async fn run(self, cancel: CancellationToken) {
        let mut backoff = INITIAL_BACKOFF;
        let mut outage = false;
        loop {
            let failure = tokio::select! {
                () = cancel.cancelled() => return,
                e = self.list_and_watch(&mut backoff, &mut outage) => e,
            };
            if !outage {
                tracing::warn!(error = %failure, "following the drain records failed; listing again");
                outage = true;
            } else {
                tracing::debug!(error = %failure, "following the drain records still fails");
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One listing and the watch after it; returns why it stopped.
    async fn list_and_watch(&self, backoff: &mut Duration, outage: &mut bool) -> String {
        let (revision, entries) = match self.log.list_drains().await {
            Ok(listed) => listed,
            Err(e) => {
                self.attempted.set_ready();
                return e.to_string();
            }
        };
        let mut set = DrainSet::from_listing(entries);
        publish(&self.cache, &self.current, &set);
        self.synced.set_ready();
        self.attempted.set_ready();
        let mut changes = match self.log.watch_drains(revision).await {
            Ok(s) => s,
            Err(e) => return e.to_string(),
        };
        if *outage {
            tracing::info!("following the drain records again");
            *outage = false;
        }
        *backoff = INITIAL_BACKOFF;
        loop {
            match changes.next().await {
                Some(Ok(change)) => {
                    set.apply(change);
                    publish(&self.cache, &self.current, &set);
                }
                Some(Err(e)) => return e.to_string(),
                None => return "the drains' watch ended".to_owned(),
            }
        }
    }
}

/// Hands the drained host names of `set` to `cache` (which does nothing when they
/// did not change), logging what changed since `current`, the set handed last.
fn publish(cache: &EndpointCache, current: &Mutex<BTreeSet<String>>, set: &DrainSet) {
    let hostnames = set.hostnames();
    let mut current = lock(current);
    if *current == hostnames {
        return;
    }
    for added in hostnames.difference(&current) {
        tracing::info!(node = %added, "node drained: its endpoints are terminating");
    }
    for removed in current.difference(&hostnames) {
        tracing::info!(node = %removed, "node undrained: its endpoints take new flows again");
    }
    current.clone_from(&hostnames);
    drop(current);
    cache.set_drained_nodes(hostnames);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::Timestamp;

    fn entry(id: &str, hostname: &str) -> DrainEntry {
        let record = DrainRecord {
            node_id: id.to_owned(),
            hostname: hostname.to_owned(),
            since: Timestamp(1_796_000_000),
            by: String::new(),
        };
        DrainEntry {
            id: id.to_owned(),
            value: record.to_json(),
            mod_revision: 5,
        }
    }

    #[test]
    fn the_set_follows_puts_and_deletes_and_skips_broken_records() {
        let mut set = DrainSet::from_listing(vec![
            entry("a", "node-1"),
            DrainEntry {
                id: "b".into(),
                value: b"not json".to_vec(),
                mod_revision: 6,
            },
        ]);
        assert_eq!(set.hostnames(), BTreeSet::from(["node-1".to_owned()]));
        set.apply(DrainChange::Put(entry("c", "node-3")));
        assert_eq!(
            set.hostnames(),
            BTreeSet::from(["node-1".to_owned(), "node-3".to_owned()])
        );
        set.apply(DrainChange::Delete {
            id: "a".into(),
            revision: 8,
        });
        assert_eq!(set.hostnames(), BTreeSet::from(["node-3".to_owned()]));
        // A record overwritten with garbage undrains its node here (and says so).
        set.apply(DrainChange::Put(DrainEntry {
            id: "c".into(),
            value: b"{}".to_vec(),
            mod_revision: 9,
        }));
        assert!(set.hostnames().is_empty());
    }

    #[test]
    fn publishing_hands_the_cache_the_host_names() {
        let cache = EndpointCache::loaded();
        let current = Mutex::default();
        publish(
            &cache,
            &current,
            &DrainSet::from_listing(vec![entry("a", "node-1")]),
        );
        assert_eq!(cache.drained_nodes(), BTreeSet::from(["node-1".to_owned()]));
        assert_eq!(*lock(&current), cache.drained_nodes());
        publish(&cache, &current, &DrainSet::default());
        assert!(cache.drained_nodes().is_empty());
    }
}
