//! The endpoint cache: the agent's in-memory copy of the desired state, fed by the
//! ordered log, from which every reconciler reads.
//!
//! Reconcilers [`subscribe`](EndpointCache::subscribe) and receive [`Delta`]s: first
//! every service, then only the services that changed, each as a consistent
//! [`ServiceView`] (the service with its endpoints at one revision). Changes are
//! coalesced per service while a reconciler is busy, so a slow reconciler never
//! queues unbounded work: it catches up with the newest state in one step.
//!
//! Endpoints on a drained node ([`EndpointCache::set_drained_nodes`]) are handed
//! out as terminating ([`drained`]).

use crate::{
    lock::lock,
    model::{Endpoint, Endpoints, Kind, Object, ObjectKey, Service, ServiceKey, ServicePort},
    orderedlog::{Event, Revision, Snapshot},
};
use std::{
    collections::{BTreeMap, BTreeSet, HashMap, hash_map::Entry as Slot},
    net::SocketAddr,
    sync::{Arc, Mutex, Weak},
};
use tokio::sync::Notify;

/// A service as the data planes see it: the service and its endpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceView {
    /// The service.
    pub service: Arc<Service>,
    /// Its endpoints: `None` when no Endpoints object exists ("unknown"), an empty
    /// list when it exists with no backends ("refuse").
    pub endpoints: Option<Arc<Endpoints>>,
}

/// One backend of a service port: where connections go, and the endpoint behind it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PortBackend<'v> {
    /// The endpoint's address and its port for the service port.
    pub addr: SocketAddr,
    /// The endpoint (its state and node).
    pub endpoint: &'v Endpoint,
}

impl ServiceView {
    /// The service's key.
    pub fn key(&self) -> ServiceKey {
        self.service.key()
    }

    /// The endpoints listed, none when the Endpoints object is missing.
    pub fn endpoint_list(&self) -> &[Endpoint] {
        self.endpoints
            .as_ref()
            .map(|e| &e.spec.endpoints[..])
            .unwrap_or_default()
    }

    /// The backends of service port `port`, in list order: each endpoint at its
    /// address and its port for `port` ([`Endpoint::port_for`]). A backend is a
    /// socket address: endpoints sharing an address are separate backends when
    /// their ports differ, and endpoints resolving to the same one count once, as
    /// the first of them that takes new connections (else the first). Validation
    /// refuses such a pair within one object, but two endpoints that differ on
    /// another port meet on this one, and a later Service change can make two meet.
    pub fn port_backends(&self, port: &ServicePort) -> Vec<PortBackend<'_>> {
        let list = self.endpoint_list();
        let mut out: Vec<PortBackend<'_>> = Vec::with_capacity(list.len());
        let mut at: HashMap<SocketAddr, usize> = HashMap::with_capacity(list.len());
        for endpoint in list {
            let addr = SocketAddr::new(endpoint.address, endpoint.port_for(port));
            match at.entry(addr) {
                Slot::Vacant(v) => {
                    v.insert(out.len());
                    out.push(PortBackend { addr, endpoint });
                }
                Slot::Occupied(o) => {
                    let first = &mut out[*o.get()];
                    if !first.endpoint.accepts_new() && endpoint.accepts_new() {
                        first.endpoint = endpoint;
                    }
                }
            }
        }
        out
    }
}

/// The whole cache at one revision, for `status`.
#[derive(Clone, Debug, Default)]
pub struct CacheSummary {
    /// The revision.
    pub revision: Revision,
    /// Objects by kind.
    pub counts: BTreeMap<Kind, usize>,
    /// Every service with its endpoints, ordered by key.
    pub views: Vec<ServiceView>,
    /// Endpoints objects without a service.
    pub orphans: Vec<ObjectKey>,
}

/// What changed for one subscriber since its previous [`Delta`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Delta {
    /// The cache revision this delta brings the subscriber to.
    pub revision: Revision,
    /// True for the first delta (and when the subscriber asked for one with
    /// [`Subscription::request_full`]): `upserted` holds every service and anything
    /// the subscriber holds that is not in it must go.
    pub full: bool,
    /// Services created or changed, with their endpoints.
    pub upserted: Vec<ServiceView>,
    /// Services that no longer exist.
    pub removed: Vec<ServiceKey>,
}

impl Delta {
    /// Whether the delta only moves the revision: the cache moved on (events of
    /// other kinds of change, a snapshot that changed nothing) and what the
    /// subscriber holds is already right at `revision`; it acknowledges it
    /// ([`crate::applied`]) without work.
    pub fn only_revision(&self) -> bool {
        !self.full && self.upserted.is_empty() && self.removed.is_empty()
    }
}

/// The objects the cache holds under one service key; never both missing.
#[derive(Clone, Debug, Default, PartialEq)]
struct Entry {
    service: Option<Arc<Service>>,
    endpoints: Option<Arc<Endpoints>>,
}

impl Entry {
    fn put(&mut self, object: Object) {
        match object {
            Object::Service(s) => self.service = Some(Arc::new(s)),
            Object::Endpoints(e) => self.endpoints = Some(Arc::new(e)),
        }
    }

    fn remove(&mut self, kind: Kind) {
        match kind {
            Kind::Service => self.service = None,
            Kind::Endpoints => self.endpoints = None,
        }
    }

    fn is_empty(&self) -> bool {
        self.service.is_none() && self.endpoints.is_none()
    }
}

#[derive(Default)]
struct State {
    /// The revision of the last event (or snapshot) applied.
    revision: Revision,
    /// The revision of the last snapshot applied: events up to it are in it. Events
    /// of one transaction share a revision (etcd), so a later event with the same
    /// revision as the last applied one is new, but one a snapshot covers is not.
    snapshot: Revision,
    /// Services and Endpoints objects in one map, so each key is held once.
    objects: BTreeMap<ServiceKey, Entry>,
    subscribers: Vec<Weak<Pending>>,
    /// Host names of the drained nodes: their endpoints are terminating in every
    /// view ([`drained`]).
    drained: BTreeSet<String>,
    /// Whether a snapshot was applied: before that the cache's emptiness means
    /// "not loaded yet", not "no services", and no delta is handed out.
    synced: bool,
}

#[derive(Default)]
struct Pending {
    dirty: Mutex<Dirty>,
    notify: Notify,
}

#[derive(Default)]
struct Dirty {
    full: bool,
    keys: BTreeSet<ServiceKey>,
    /// The revision of the last delta handed out: a later cache revision is a
    /// delta of its own even when no key changed (see [`Delta::only_revision`]).
    delivered: Revision,
}

/// The cache. Cheap to share behind an `Arc`; every method takes `&self`.
#[derive(Default)]
pub struct EndpointCache {
    state: Mutex<State>,
}

impl EndpointCache {
    /// An empty cache at revision 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty cache that counts as loaded (an empty snapshot applied), for tests
    /// that feed it events directly.
    #[cfg(test)]
    pub(crate) fn loaded() -> Self {
        let cache = Self::new();
        cache.apply_snapshot(&Snapshot::default());
        cache
    }

    /// Replaces the whole content with a snapshot (start and resync). Subscribers
    /// are told about every service whose view changed, and about removed ones.
    pub fn apply_snapshot(&self, snapshot: &Snapshot) {
        self.take_snapshot(snapshot.clone());
    }

    /// [`apply_snapshot`](Self::apply_snapshot), taking the snapshot's objects
    /// instead of copying them (the agent's own path: a large cluster's snapshot is
    /// big, and nothing else needs it afterwards).
    pub fn take_snapshot(&self, snapshot: Snapshot) {
        let mut objects: BTreeMap<ServiceKey, Entry> = BTreeMap::new();
        for obj in snapshot.objects {
            objects.entry(obj.key().service()).or_default().put(obj);
        }
        let mut st = lock(&self.state);
        let changed: BTreeSet<ServiceKey> = st
            .objects
            .keys()
            .chain(objects.keys())
            .filter(|key| st.objects.get(*key) != objects.get(*key))
            .cloned()
            .collect();
        st.objects = objects;
        st.revision = snapshot.revision;
        st.snapshot = snapshot.revision;
        let first = !st.synced;
        st.synced = true;
        Self::mark(&mut st, changed);
        if first {
            // Subscribers wait for the first snapshot even when it is empty.
            for sub in st.subscribers.iter().filter_map(Weak::upgrade) {
                sub.notify.notify_one();
            }
        }
    }

    /// Applies one event from the ordered log. Events at or below the cache's
    /// revision are ignored (already applied), so replays are harmless.
    pub fn apply_event(&self, event: &Event) {
        self.apply_events(std::slice::from_ref(event));
    }

    /// Applies events in order as one step: subscribers see either none or all of
    /// them, so a Service and its Endpoints written by one `apply` never reach a data
    /// plane as "service without endpoints" in between.
    pub fn apply_events(&self, events: &[Event]) {
        let mut st = lock(&self.state);
        let mut changed = BTreeSet::new();
        for event in events {
            if event.revision() <= st.snapshot || event.revision() < st.revision {
                continue;
            }
            st.revision = event.revision();
            let key = match event {
                Event::Put { object, .. } => {
                    let key = object.key().service();
                    st.objects
                        .entry(key.clone())
                        .or_default()
                        .put(object.clone());
                    key
                }
                Event::Delete { key, .. } => {
                    let skey = key.service();
                    if let Some(entry) = st.objects.get_mut(&skey) {
                        entry.remove(key.kind);
                        if entry.is_empty() {
                            st.objects.remove(&skey);
                        }
                    }
                    skey
                }
                // Not an object: only the revision moves (consumers acknowledge it).
                Event::Skipped { .. } => continue,
            };
            changed.insert(key);
        }
        Self::mark(&mut st, changed);
    }

    fn mark(st: &mut State, keys: BTreeSet<ServiceKey>) {
        // Drop subscribers that went away while we are here.
        st.subscribers.retain(|w| w.strong_count() > 0);
        for sub in st.subscribers.iter().filter_map(Weak::upgrade) {
            let mut dirty = lock(&sub.dirty);
            // Woken for a new revision too, changed keys or not.
            if keys.is_empty() && dirty.delivered == st.revision {
                continue;
            }
            dirty.keys.extend(keys.iter().cloned());
            drop(dirty);
            sub.notify.notify_one();
        }
    }

    /// The cache's revision: the last ordered-log revision applied.
    pub fn revision(&self) -> Revision {
        lock(&self.state).revision
    }

    /// The view of one service, if the service exists.
    pub fn view(&self, key: &ServiceKey) -> Option<ServiceView> {
        Self::view_locked(&lock(&self.state), key)
    }

    fn view_locked(st: &State, key: &ServiceKey) -> Option<ServiceView> {
        let entry = st.objects.get(key)?;
        entry.service.as_ref().map(|s| ServiceView {
            service: s.clone(),
            endpoints: entry
                .endpoints
                .as_ref()
                .map(|e| drained::terminating_on(e, &st.drained)),
        })
    }

    /// Every service's view, ordered by key.
    pub fn views(&self) -> Vec<ServiceView> {
        self.summary().views
    }

    /// Objects held, by kind (for metrics and status).
    pub fn counts(&self) -> BTreeMap<Kind, usize> {
        Self::counts_locked(&lock(&self.state))
    }

    fn counts_locked(st: &State) -> BTreeMap<Kind, usize> {
        let count = |has: fn(&Entry) -> bool| st.objects.values().filter(|e| has(e)).count();
        BTreeMap::from([
            (Kind::Service, count(|e| e.service.is_some())),
            (Kind::Endpoints, count(|e| e.endpoints.is_some())),
        ])
    }

    /// Endpoints objects whose service does not exist (visible in `status`).
    pub fn orphan_endpoints(&self) -> Vec<ObjectKey> {
        Self::orphans_locked(&lock(&self.state))
    }

    fn orphans_locked(st: &State) -> Vec<ObjectKey> {
        st.objects
            .iter()
            .filter(|(_, e)| e.service.is_none())
            .map(|(k, _)| ObjectKey::new(Kind::Endpoints, &k.namespace, &k.name))
            .collect()
    }

    /// Everything `status` shows, read at one revision.
    pub fn summary(&self) -> CacheSummary {
        let st = lock(&self.state);
        CacheSummary {
            revision: st.revision,
            counts: Self::counts_locked(&st),
            views: st
                .objects
                .keys()
                .filter_map(|k| Self::view_locked(&st, k))
                .collect(),
            orphans: Self::orphans_locked(&st),
        }
    }

    /// Subscribes a reconciler. Its first [`Subscription::next`] returns a full
    /// delta, once the cache holds its first snapshot: a reconciler never mistakes a
    /// cache that is still loading for one without services (which would, for a
    /// moment, remove every service a restarted agent's kernel state still carries).
    pub fn subscribe(self: &Arc<Self>) -> Subscription {
        let pending = Arc::new(Pending {
            dirty: Mutex::new(Dirty {
                full: true,
                keys: BTreeSet::new(),
                delivered: 0,
            }),
            notify: Notify::new(),
        });
        pending.notify.notify_one();
        lock(&self.state).subscribers.push(Arc::downgrade(&pending));
        Subscription {
            cache: self.clone(),
            pending,
        }
    }
}

/// One reconciler's feed of changes; dropping it unsubscribes.
pub struct Subscription {
    cache: Arc<EndpointCache>,
    pending: Arc<Pending>,
}

impl Subscription {
    /// Waits until something changed, then returns the coalesced delta, read from
    /// the cache at one revision.
    pub async fn next(&mut self) -> Delta {
        loop {
            if let Some(delta) = self.try_next() {
                return delta;
            }
            self.pending.notify.notified().await;
        }
    }

    /// The pending delta, if anything changed since the last one.
    pub fn try_next(&mut self) -> Option<Delta> {
        // Lock order: cache state, then the subscriber's dirty set (as in `mark`).
        let st = lock(&self.cache.state);
        if !st.synced {
            return None;
        }
        let mut dirty = lock(&self.pending.dirty);
        if !dirty.full && dirty.keys.is_empty() && dirty.delivered == st.revision {
            return None;
        }
        dirty.delivered = st.revision;
        let full = std::mem::take(&mut dirty.full);
        let keys = std::mem::take(&mut dirty.keys);
        drop(dirty);
        let mut delta = Delta {
            revision: st.revision,
            full,
            ..Delta::default()
        };
        if full {
            delta.upserted = st
                .objects
                .keys()
                .filter_map(|k| EndpointCache::view_locked(&st, k))
                .collect();
        } else {
            for key in keys {
                match EndpointCache::view_locked(&st, &key) {
                    Some(v) => delta.upserted.push(v),
                    None => delta.removed.push(key),
                }
            }
        }
        Some(delta)
    }

    /// Asks for a full delta next time (e.g. after the reconciler lost its state).
    pub fn request_full(&mut self) {
        lock(&self.pending.dirty).full = true;
        self.pending.notify.notify_one();
    }
}

mod drained;
mod feed;
#[cfg(test)]
mod tests;

pub use feed::*;
