//! The `node` subsystem: keeps this node's document in etcd under a lease.
//!
//! * **Registration:** a lease of [`RegistrarOptions::ttl`] (30 s) is granted and
//!   the document written under it.
//! * **Heartbeat:** every [`RegistrarOptions::heartbeat`] (10 s) one keep-alive
//!   renews the lease. The document is rewritten only when it changed (facts,
//!   conditions, applied revision; never for its write time alone), so a quiet
//!   node costs etcd one keep-alive per heartbeat and no revision.
//! * **Facts** (and the data plane's degradation) are gathered every
//!   [`RegistrarOptions::facts_interval`] (60 s), the data plane's conntrack maps
//!   counted with them; the fill of the tables the data plane keeps itself
//!   (frontends, backends) is read again at every new applied revision, so
//!   `MapPressure` follows an apply at once; readiness (written at once when
//!   [`FactsSource::ready_changes`] changes) and the applied revision at every step (a new applied
//!   revision is written at once, then at most one per [`APPLIED_COALESCE`]).
//! * **Key deleted** while the lease lives (by hand, `etcdctl del`): after each
//!   renewal one count-only read of the key finds it missing, and the document is
//!   written again in the same step.
//! * **Lease lost** (etcd was unreachable longer than the TTL, or revoked it): a
//!   new lease is granted and the document written again, same node id.
//! * **Stop** revokes the lease, so the key is deleted at once; an agent that dies
//!   leaves it to expire after the TTL.
//!
//! Ready from the start: registration is best-effort and its trouble shows in the
//! `StoreDisconnected` condition and the logs, never in the agent's readiness (on
//! which the `Ready` condition itself depends).

use super::{
    NodeDocument, NodeIdentity, Timestamp,
    conditions::{ConditionSet, Inputs, observe},
    facts::{self, Facts, FactsSource, HostSample, MapFill},
};
use crate::{
    applied::AppliedRevision,
    dataplane::MapCount,
    identity::Identity,
    lock::lock,
    orderedlog::{
        Revision,
        etcd::{EtcdLog, Lease},
    },
    subsystem::{Readiness, ReadySetter, StartContext, Subsystem, SubsystemError},
};
use std::{
    net::IpAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// At most one write of a new applied revision per this interval while revisions
/// stream in; a revision after a quiet interval is written at once (`apply --wait`
/// waits for it).
pub const APPLIED_COALESCE: Duration = Duration::from_millis(25);
/// How long stop waits for etcd to revoke the lease.
const REVOKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The registrar's timing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegistrarOptions {
    /// The lease's time to live: how long the key outlives a dead agent.
    pub ttl: Duration,
    /// The interval of keep-alives (well under the TTL: two may fail).
    pub heartbeat: Duration,
    /// The interval at which facts and host readings are gathered again.
    pub facts_interval: Duration,
}

impl Default for RegistrarOptions {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(30),
            heartbeat: Duration::from_secs(10),
            facts_interval: Duration::from_secs(60),
        }
    }
}

/// The `node` subsystem.
pub struct Registrar {
    log: EtcdLog,
    identity: Identity,
    source: FactsSource,
    applied: AppliedRevision,
    options: RegistrarOptions,
    /// The lease held now, for stop to revoke.
    lease: Arc<Mutex<Option<Lease>>>,
    /// The document last written (tests and `status` read it).
    written: Arc<Mutex<Option<NodeDocument>>>,
    tasks: TaskTracker,
    /// Set once the node's document was first written: a node that `get nodes`
    /// and `apply --wait` do not know yet is not ready. Never unset (etcd going
    /// away later does not take the node out of service).
    registered: ReadySetter,
    readiness: Readiness,
}

impl Registrar {
    /// Keeps `identity`'s document in `log`, from `source`'s facts and `applied`.
    pub fn new(
        log: EtcdLog,
        identity: Identity,
        source: FactsSource,
        applied: AppliedRevision,
        options: RegistrarOptions,
    ) -> Self {
        let (registered, readiness) = Readiness::new();
        Self {
            log,
            identity,
            source,
            applied,
            options,
            lease: Arc::new(Mutex::new(None)),
            written: Arc::new(Mutex::new(None)),
            tasks: TaskTracker::new(),
            registered,
            readiness,
        }
    }

    /// The lease held now, if any.
    pub fn lease(&self) -> Option<Lease> {
        *lock(&self.lease)
    }

    /// The document last written, if any.
    pub fn written(&self) -> Option<NodeDocument> {
        lock(&self.written).clone()
    }
}

#[async_trait::async_trait]
impl Subsystem for Registrar {
    fn name(&self) -> &str {
        "node"
    }

    async fn start(&self, ctx: &StartContext) -> Result<(), SubsystemError> {
        let keeper = Keeper {
            log: self.log.clone(),
            identity: NodeIdentity {
                id: self.identity.node_id.clone(),
                hostname: self.identity.hostname.clone(),
                labels: self.identity.labels.clone(),
            },
            source: self.source.clone(),
            applied: self.applied.clone(),
            options: self.options,
            lease: self.lease.clone(),
            written: self.written.clone(),
            conditions: ConditionSet::default(),
            store_error: None,
            registered: self.registered.clone(),
        };
        self.tasks.spawn(keeper.run(ctx.cancel.clone()));
        Ok(())
    }

    fn ready(&self) -> Readiness {
        self.readiness.clone()
    }

    async fn stop(&self) -> Result<(), SubsystemError> {
        self.tasks.close();
        self.tasks.wait().await;
        let Some(lease) = lock(&self.lease).take() else {
            return Ok(());
        };
        match tokio::time::timeout(REVOKE_TIMEOUT, self.log.revoke_lease(lease)).await {
            Ok(Ok(())) => {
                tracing::info!(node_id = %self.identity.node_id, "node deregistered (lease revoked)");
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, ttl = lease.ttl, "revoking the node's lease failed; its key goes when the lease expires");
            }
            Err(_) => {
                tracing::warn!(
                    ttl = lease.ttl,
                    "etcd did not revoke the node's lease in time; its key goes when the lease expires"
                );
            }
        }
        Ok(())
    }
}

/// The registrar's loop and what it remembers between steps.
struct Keeper {
    log: EtcdLog,
    identity: NodeIdentity,
    source: FactsSource,
    applied: AppliedRevision,
    options: RegistrarOptions,
    lease: Arc<Mutex<Option<Lease>>>,
    written: Arc<Mutex<Option<NodeDocument>>>,
    conditions: ConditionSet,
    /// The last etcd failure, until a request succeeds.
    store_error: Option<String>,
    /// Set at the first write of the document.
    registered: ReadySetter,
}

/// The facts last gathered.
struct Gathered {
    facts: Facts,
    host: HostSample,
    addresses: Vec<IpAddr>,
    /// Why the data plane is degraded, if it is.
    degraded: Option<String>,
    at: Instant,
}

impl Keeper {
    async fn run(mut self, cancel: CancellationToken) {
        let mut heartbeat = tokio::time::interval(self.options.heartbeat);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut applied = self.applied.subscribe();
        let mut ready_changes = self.source.ready_changes.clone();
        let mut gathered: Option<Gathered> = None;
        // When the last applied revision was taken up for writing.
        let mut last_applied: Option<Instant> = None;
        loop {
            let readiness_changed = async {
                match ready_changes.as_mut() {
                    Some(r) => r.changed().await,
                    None => std::future::pending().await,
                }
            };
            let mut applied_moved = false;
            let beat = tokio::select! {
                () = cancel.cancelled() => return,
                _ = heartbeat.tick() => true,
                alive = readiness_changed => {
                    if !alive {
                        // Its setter is gone: it will not change again.
                        ready_changes = None;
                    }
                    false
                }
                changed = applied.changed() => {
                    if changed.is_err() {
                        // Cannot happen while `self.applied` lives; never spin.
                        std::future::pending::<()>().await;
                    }
                    let wait = last_applied.map_or(Duration::ZERO, |t| {
                        (t + APPLIED_COALESCE).saturating_duration_since(Instant::now())
                    });
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        () = tokio::time::sleep(wait) => {}
                    }
                    last_applied = Some(Instant::now());
                    applied_moved = true;
                    false
                }
            };
            // Read before the maps: the document then never claims a revision
            // whose effect on the maps' fill it does not show.
            let revision = *applied.borrow_and_update();
            let stale = gathered
                .as_ref()
                .is_none_or(|g| g.at.elapsed() >= self.options.facts_interval);
            if stale {
                let source = self.source.clone();
                let read = tokio::task::spawn_blocking(move || {
                    let (facts, host) = facts::gather(&source);
                    (facts, host, facts::addresses(), (source.degraded)())
                })
                .await;
                if let Ok((facts, host, addresses, degraded)) = read {
                    gathered = Some(Gathered {
                        facts,
                        host,
                        addresses,
                        degraded,
                        at: Instant::now(),
                    });
                }
            } else if applied_moved && let Some(g) = &mut gathered {
                let maps = self.source.maps.clone();
                let read = tokio::task::spawn_blocking(move || maps(MapCount::Tables)).await;
                if let (Ok(Some(fresh)), Some(known)) = (read, g.facts.maps.as_mut()) {
                    refresh_maps(known, fresh);
                }
            }
            let Some(g) = &gathered else { continue };
            tokio::select! {
                () = cancel.cancelled() => return,
                () = self.step(beat, g, revision) => {}
            }
        }
    }

    /// One step: renew the lease on a heartbeat, and write the document when it
    /// changed or the lease is new.
    async fn step(&mut self, beat: bool, g: &Gathered, revision: Revision) {
        let mut lease = *lock(&self.lease);
        if beat && let Some(held) = lease {
            match self.bounded(self.log.keep_alive(held)).await {
                Ok(true) => {
                    self.connected();
                    self.check_key().await;
                }
                Ok(false) => {
                    tracing::warn!(
                        lease = held.id,
                        "the node's lease expired (etcd unreachable longer than its TTL, or revoked); registering again"
                    );
                    self.connected();
                    lease = None;
                }
                Err(e) => self.failed("renewing the node's lease", &e),
            }
        }
        // Up to three writes: a lease that vanished between the keep-alive and the
        // write gets one more grant, and a document written while it still said
        // StoreDisconnected is written again at once, saying the store is back.
        for _ in 0..3 {
            let held = match lease {
                Some(l) => l,
                None => match self.bounded(self.log.grant_lease(self.options.ttl)).await {
                    Ok(l) => {
                        self.connected();
                        *lock(&self.written) = None;
                        *lock(&self.lease) = Some(l);
                        lease = Some(l);
                        l
                    }
                    Err(e) => {
                        *lock(&self.lease) = None;
                        return self.failed("granting the node's lease", &e);
                    }
                },
            };
            let was_disconnected = self.store_error.is_some();
            let doc = self.document(g, revision);
            let unchanged = lock(&self.written)
                .as_ref()
                .is_some_and(|w| !doc.differs_from(w));
            if unchanged {
                return;
            }
            let bytes = match serde_json::to_vec(&doc) {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(error = %e, "the node document does not serialize");
                    return;
                }
            };
            match self
                .bounded(self.log.put_node(&self.identity.id, bytes, held))
                .await
            {
                Ok(Some(revision)) => {
                    tracing::debug!(
                        revision,
                        applied = doc.applied_revision,
                        "node document written"
                    );
                    self.connected();
                    *lock(&self.written) = Some(doc);
                    self.registered.set_ready();
                    if !was_disconnected {
                        return;
                    }
                }
                Ok(None) => {
                    tracing::warn!(
                        lease = held.id,
                        "the node's lease is gone; registering again"
                    );
                    *lock(&self.lease) = None;
                    lease = None;
                }
                Err(e) => return self.failed("writing the node document", &e),
            }
        }
    }

    /// After a renewal: when the key is gone while the lease lives (someone
    /// deleted it), forgets what was written, so that this step writes it again.
    async fn check_key(&mut self) {
        if lock(&self.written).is_none() {
            return;
        }
        match self.bounded(self.log.node_exists(&self.identity.id)).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(
                    node_id = %self.identity.id,
                    "the node's key was deleted while its lease lives; writing it again"
                );
                *lock(&self.written) = None;
            }
            Err(e) => self.failed("reading the node's key", &e),
        }
    }

    /// The document now, at applied `revision`, its conditions brought up to
    /// date.
    fn document(&mut self, g: &Gathered, revision: Revision) -> NodeDocument {
        let now = Timestamp::now();
        let inputs = Inputs {
            ready: (self.source.ready)(),
            degraded: g.degraded.clone(),
            store_error: self.store_error.clone(),
            maps: g.facts.maps.as_deref(),
            host: g.host,
        };
        self.conditions.update(observe(&inputs), now);
        NodeDocument {
            identity: self.identity.clone(),
            addresses: g.addresses.clone(),
            facts: g.facts.clone(),
            conditions: self.conditions.conditions().to_vec(),
            applied_revision: revision,
            heartbeat_time: now,
        }
    }

    /// `call`, or an error once a heartbeat passed without its answer: an etcd
    /// that accepts a request and never answers (a member without quorum) must not
    /// stall the registrar past its lease.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, crate::orderedlog::LogError>>,
    ) -> Result<T, crate::orderedlog::LogError> {
        let limit = self.options.heartbeat.max(Duration::from_secs(1));
        tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
            Err(crate::orderedlog::LogError::Unavailable {
                endpoints: self.log.endpoints().to_owned(),
                message: format!("no answer within {limit:?}"),
            })
        })
    }

    fn connected(&mut self) {
        if self.store_error.take().is_some() {
            tracing::info!("etcd answers the node registrar again");
        }
    }

    fn failed(&mut self, what: &str, e: &crate::orderedlog::LogError) {
        if self.store_error.is_none() {
            tracing::warn!(error = %e, "{what} failed; retrying at the next heartbeat");
        }
        self.store_error = Some(format!("{what}: {e}"));
    }
}

/// Takes the maps of `fresh` into `known` by name (a count of some maps replaces
/// theirs and keeps the others' last count).
fn refresh_maps(known: &mut Vec<MapFill>, fresh: Vec<MapFill>) {
    for m in fresh {
        match known.iter_mut().find(|k| k.name == m.name) {
            Some(k) => *k = m,
            None => known.push(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_count_replaces_only_its_maps() {
        let fill = |name: &str, used| MapFill {
            name: name.to_owned(),
            capacity: 10,
            used: Some(used),
        };
        let mut known = vec![fill("frontends", 1), fill("conntrack_v4", 5)];
        refresh_maps(&mut known, vec![fill("frontends", 9)]);
        assert_eq!(known, [fill("frontends", 9), fill("conntrack_v4", 5)]);
    }
}
