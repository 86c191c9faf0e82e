//! Keeps the load balancer's maps equal to the endpoint cache, by difference.
//!
//! [`LbSync`] turns each service into frontends (VIP × port × protocol), backends and
//! one Maglev table per frontend, and writes only what differs from what the maps
//! hold: a change to one service touches that service's entries and nothing else.
//! Table slots are compared with the table in the map and only changed slots are
//! stored (as Katran does), so an endpoint change rewrites about `1/N` of a table.
//!
//! Order of writes, so that a packet never meets a half-built service: the
//! backends of every service in the delta first, then each service's table slots
//! and frontend entry, and only then the removal of backends nothing uses any more
//! (with their conntrack and affinity entries). The kernel maps queue backend and
//! frontend writes and hand them over in batches (see [`super::maps::KernelMaps`]),
//! keeping this order: a full sync writes its 100,000 backends in a few dozen
//! `bpf()` calls. A large delta goes a chunk of services at a time (each chunk's
//! backends before its tables and frontends), while another thread builds the
//! Maglev tables of the next chunk (a table depends only on the backend addresses;
//! ids are mapped in when it is stored). A table the maps hold for the same
//! eligible backends already is neither rebuilt nor compared.
//!
//! Replies need nothing from this engine: the programs translate them back through
//! the reply-direction conntrack entry they write for every flow
//! (`agent-ebpf/src/nat/ct.rs`).
//!
//! A full delta first adopts what the maps hold (a previous agent's pinned maps, or
//! the state after a failed write): frontends keep their ids and tables and backends
//! keep their ids, so established flows, whose conntrack entries name backend ids,
//! survive a restart. Maps this agent's load created hold nothing and are not read.

mod uses;

use super::{
    backend_table::{BackendAddr, BackendTable},
    codec::proto_number,
    error::MapsError,
    maps::{Capacity, LbMaps},
    prefilter::VipFilter,
};
use crate::{
    dataplane::{ServicePortStatus, vip},
    endpoints::{Delta, ServiceView},
    maglev::{BackendKey, Maglev, MaglevError},
    model::{ServiceKey, SessionAffinity},
};
use agent_common::{
    codec::{FrontendKey, backend_addr, backend_value, frontend_key},
    lb::{BACKEND_ACTIVE, BACKEND_DRAINING, Backend, ServiceValue},
};
use smallvec::SmallVec;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};
use uses::{Use, Users, Uses};

/// The engine's hash sets, of backend addresses and service keys: a fast seeded
/// hash (std's SipHash took ~5% of a full sync's CPU).
type HashSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// Why a sync could not be completed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// A map write or read failed; the next full sync repairs the maps.
    #[error(transparent)]
    Maps(#[from] MapsError),
    /// The maps are too small for the services (a configuration problem).
    #[error("eBPF map full: {what} (capacity {capacity}); raise {setting}")]
    Full {
        /// What ran out.
        what: &'static str,
        /// The map's capacity.
        capacity: u32,
        /// The setting that sizes it.
        setting: &'static str,
    },
}

/// One frontend as the maps hold it.
#[derive(Clone, Debug)]
struct Frontend {
    value: ServiceValue,
    /// The service it belongs to (`None` for one adopted from the maps and not yet
    /// claimed by a service); the key shared with the service's backends' users.
    service: Option<Arc<ServiceKey>>,
}

/// Everything the engine knows of one backend address, in one record of a
/// [`BackendTable`] (32 B: the table takes ~6 MB at 100,000 backends; a map keyed
/// by socket address adds a 32 B key to every record, spare buckets included).
#[derive(Clone, Debug, Default)]
struct BackendState {
    /// Its slot in the backends map; 0: none (id 0 is never handed out).
    id: u32,
    /// The slot's state as the maps hold it (0 for no slot).
    state: u8,
    /// How many services have it in their tables ([`Use::Active`]): its state is
    /// active exactly when this is not 0. Kept equal to the services' `uses`, so that
    /// one service's change does not rescan every service.
    active: u32,
    /// The services that use it in any way (active or draining).
    users: Users,
}

impl BackendState {
    /// Its slot id, if it has a slot.
    fn slot(&self) -> Option<u32> {
        (self.id != 0).then_some(self.id)
    }

    /// Nothing left to remember: no slot, no use.
    fn is_empty(&self) -> bool {
        self.id == 0 && self.active == 0 && self.users.is_empty()
    }
}

/// A few frontends (one inline).
type Frontends = SmallVec<[FrontendKey; 1]>;

/// What the per-apply scratch sets keep between applies: enough for any change
/// of a few services without growing.
const SCRATCH_CAPACITY: usize = 1024;

/// What the sync engine remembers of a service.
#[derive(Clone, Debug, Default)]
struct ServiceState {
    /// Its frontends, sorted (inline for one; a set per service cost ~280 B).
    frontends: Frontends,
    uses: Uses,
    /// The service as last applied: `status` is derived from it when asked (it
    /// shares the cache's objects; a copy per service would cost ~1.4 KB each).
    view: Option<ServiceView>,
}

/// A service's backends (sorted) with their slot ids, as its upsert left them
/// (ids do not change until the end of the apply): its tables take their ids from
/// here instead of a lookup in the backend table per eligible backend.
struct BackendIds {
    addrs: Vec<BackendAddr>,
    ids: Vec<u32>,
}

impl BackendIds {
    /// The id of `addr`, if it is one of the service's backends.
    fn get(&self, addr: &SocketAddr) -> Option<u32> {
        self.addrs
            .binary_search(&BackendAddr::from(*addr))
            .ok()
            .map(|i| self.ids[i])
    }
}

/// A frontend the cache asks for.
struct DesiredFrontend {
    key: FrontendKey,
    eligible: Vec<SocketAddr>,
    affinity_timeout: u32,
    /// The maps hold its table for `eligible` already: nothing to build or compare.
    keep_table: bool,
}

impl DesiredFrontend {
    /// Whether its Maglev table is to be built.
    fn needs_table(&self) -> bool {
        !self.keep_table && !self.eligible.is_empty()
    }

    /// Its Maglev table: slots hold indexes into `eligible`.
    fn build_table(&self, table_size: u32) -> Result<Maglev, MaglevError> {
        let keys: Vec<BackendKey> = self.eligible.iter().copied().map(BackendKey).collect();
        Maglev::new(&keys, table_size)
    }
}

/// Applies that build at least this many tables build them on another thread
/// ([`LbSync::upsert_with_table_builder`]); smaller ones stay on one (a thread
/// costs tens of microseconds, a table of 1,021 slots about ten).
const PARALLEL_TABLES: usize = 256;

/// Services per chunk of [`LbSync::upsert_with_table_builder`]: their backends
/// go to the kernel in one batch write.
const TABLE_CHUNK: usize = 512;

/// Chunks of tables built ahead of the one being written (at 1,021 slots, a
/// chunk's tables take ~0.5 MB).
const TABLE_CHUNKS_AHEAD: usize = 1;

/// The sync engine: desired state from the cache, written into [`LbMaps`] by diff.
pub struct LbSync<M> {
    maps: M,
    node: String,
    capacity: Capacity,
    frontends: BTreeMap<FrontendKey, Frontend>,
    /// Every backend address with a slot or a use.
    backends: BackendTable<BackendState>,
    /// By key, the one every backend's list of users and every frontend shares (a
    /// copy of the key as well cost ~130 B per service).
    services: BTreeMap<Arc<ServiceKey>, ServiceState>,
    /// Drain deadlines, earliest first; an entry whose use changed since is stale
    /// and skipped when it comes due.
    drains: BTreeSet<(Instant, ServiceKey, BackendAddr)>,
    /// Backends whose last use went away: freed by the next `release_unused`.
    unused: HashSet<BackendAddr>,
    /// Backends whose uses changed: their state is rewritten by `release_unused`.
    touched: HashSet<BackendAddr>,
    free_frontends: BTreeSet<u32>,
    free_backends: BTreeSet<u32>,
    /// Syncs that failed on a full map.
    full_errors: u64,
    /// The maps may differ from what this engine believes (a write failed, or
    /// nothing was adopted yet): the next full delta re-reads them.
    stale: bool,
    /// The VIP prefilter, following `frontends`.
    filter: VipFilter,
}

impl<M: LbMaps> LbSync<M> {
    /// An engine for `maps`, balancing as seen from node `node` (locality).
    pub fn new(maps: M, node: impl Into<String>) -> Self {
        let capacity = maps.capacity();
        Self {
            maps,
            node: node.into(),
            capacity,
            frontends: BTreeMap::new(),
            backends: BackendTable::default(),
            services: BTreeMap::new(),
            drains: BTreeSet::new(),
            unused: HashSet::default(),
            touched: HashSet::default(),
            free_frontends: BTreeSet::new(),
            free_backends: BTreeSet::new(),
            full_errors: 0,
            stale: true,
            filter: VipFilter::default(),
        }
    }

    /// The maps, for reading counters.
    pub fn maps(&self) -> &M {
        &self.maps
    }

    /// The maps, for tests that inject faults or state.
    #[cfg(test)]
    pub(crate) fn maps_mut(&mut self) -> &mut M {
        &mut self.maps
    }

    /// Brings the maps to the state `delta` describes. On error the engine marks
    /// itself stale, so the next full delta re-reads the maps and repairs them.
    pub fn apply(&mut self, delta: &Delta, now: Instant) -> Result<(), SyncError> {
        let mut result = self.apply_inner(delta, now);
        // Queued writes go out even after a failure: they were made before it, as
        // unqueued ones would have been.
        let flushed = self.filter.write(&mut self.maps).and(self.maps.flush());
        if result.is_ok() {
            result = flushed.map_err(SyncError::from);
        }
        self.maps.release();
        self.backends.shrink();
        if let Err(e) = &result {
            self.stale = true;
            if matches!(e, SyncError::Full { .. }) {
                self.full_errors += 1;
            }
        }
        result
    }

    fn apply_inner(&mut self, delta: &Delta, now: Instant) -> Result<(), SyncError> {
        if delta.full {
            if self.stale {
                self.adopt()?;
            }
            let keep: HashSet<ServiceKey> = delta.upserted.iter().map(ServiceView::key).collect();
            let gone: Vec<ServiceKey> = self
                .services
                .keys()
                .filter(|k| !keep.contains(&***k))
                .map(|k| (**k).clone())
                .collect();
            for key in gone {
                self.remove_service(&key, now)?;
            }
        }
        for key in &delta.removed {
            self.remove_service(key, now)?;
        }
        let desired: Vec<Vec<DesiredFrontend>> = delta
            .upserted
            .iter()
            .map(|view| self.desired(view))
            .collect();
        // Room for the backends at once (growing by doubling rehashed the index
        // and copied the records ~17 times in a sync of 100,000 backends); a
        // service's largest frontend counts (its others often list the same
        // backends: never more room than needed).
        let backends: usize = desired
            .iter()
            .map(|d| d.iter().map(|f| f.eligible.len()).max().unwrap_or(0))
            .sum();
        self.backends.reserve(backends);
        let tables = desired.iter().flatten().filter(|f| f.needs_table()).count();
        if tables >= PARALLEL_TABLES
            && std::thread::available_parallelism().is_ok_and(|n| n.get() > 1)
        {
            self.upsert_with_table_builder(&delta.upserted, &desired, now)?;
        } else {
            // Every service's backends first, then every service's tables and
            // frontends: the backends reach the kernel in one batch write before
            // the first table names them.
            let mut ids = Vec::with_capacity(desired.len());
            for (view, desired) in delta.upserted.iter().zip(&desired) {
                ids.push(self.prepare_backends(view, desired, now)?);
            }
            for ((view, desired), ids) in delta.upserted.iter().zip(&desired).zip(&ids) {
                self.program_frontends(view, desired, ids, &mut std::iter::empty())?;
            }
        }
        if delta.full {
            // Backends adopted from the maps that no service claimed are freed. Every
            // other one has a user, so some service of this delta took it up and
            // brought its entry and state up to date (or left it touched).
            let unclaimed = self
                .backends
                .iter()
                .filter(|(_, b)| b.id != 0 && b.users.is_empty())
                .map(|(a, _)| *a);
            self.unused.extend(unclaimed.clone());
            self.touched.extend(unclaimed);
            // Frontends adopted from the maps that no service claimed.
            let orphans: Vec<FrontendKey> = self
                .frontends
                .iter()
                .filter(|(_, f)| f.service.is_none())
                .map(|(k, _)| *k)
                .collect();
            for key in orphans {
                self.delete_frontend(&key)?;
            }
        }
        self.release_unused(now)?;
        self.stale = false;
        Ok(())
    }

    /// Upserts `views` (with their `desired` frontends) a chunk of services at a
    /// time, each chunk's backends before its tables and frontends, while another
    /// thread builds the Maglev tables of the chunks ahead: a table depends only on
    /// the backend addresses (its slots hold indexes into them, mapped to ids when
    /// stored), so the second core builds them while this one writes backends. At
    /// most [`TABLE_CHUNKS_AHEAD`] chunks of tables wait (bounded memory).
    fn upsert_with_table_builder(
        &mut self,
        views: &[ServiceView],
        desired: &[Vec<DesiredFrontend>],
        now: Instant,
    ) -> Result<(), SyncError> {
        let table_size = self.capacity.table_size;
        std::thread::scope(|scope| {
            let (send, receive) = std::sync::mpsc::sync_channel(TABLE_CHUNKS_AHEAD);
            let builder = scope.spawn(move || {
                for chunk in desired.chunks(TABLE_CHUNK) {
                    let tables: Vec<Option<Result<Maglev, MaglevError>>> = chunk
                        .iter()
                        .flatten()
                        .map(|f| f.needs_table().then(|| f.build_table(table_size)))
                        .collect();
                    // The receiver is gone when the apply failed: stop.
                    if send.send(tables).is_err() {
                        return;
                    }
                }
            });
            let mut upsert = || {
                for (views, desired) in views.chunks(TABLE_CHUNK).zip(desired.chunks(TABLE_CHUNK)) {
                    let mut ids = Vec::with_capacity(desired.len());
                    for (view, desired) in views.iter().zip(desired) {
                        ids.push(self.prepare_backends(view, desired, now)?);
                    }
                    // Without the builder (it panicked), tables are built here.
                    let mut tables = receive.recv().unwrap_or_default().into_iter();
                    for ((view, desired), ids) in views.iter().zip(desired).zip(&ids) {
                        self.program_frontends(view, desired, ids, &mut tables)?;
                    }
                }
                Ok(())
            };
            let result = upsert();
            // The builder stops at its next send, and is joined here by hand: a
            // panic of its own was made up for above, and `scope` would repeat it
            // for a thread nobody joined.
            drop(receive);
            let _ = builder.join();
            result
        })
    }

    /// Ends the drain of backends whose deadline passed (their flows are removed).
    pub fn expire(&mut self, now: Instant) -> Result<(), SyncError> {
        let mut result = self.release_unused(now);
        let flushed = self.maps.flush();
        if result.is_ok() {
            result = flushed.map_err(SyncError::from);
        }
        if result.is_err() {
            self.stale = true;
        }
        result
    }

    /// Every service port programmed, for `status`.
    pub fn status(&self) -> Vec<ServicePortStatus> {
        self.services
            .values()
            .filter_map(|s| s.view.as_ref())
            .flat_map(vip::port_status)
            .collect()
    }

    /// The frontends of `service` with their ids, for counters.
    pub fn frontend_ids(&self, service: &ServiceKey) -> Vec<(FrontendKey, u32)> {
        self.services
            .get(service)
            .map(|s| {
                s.frontends
                    .iter()
                    .filter_map(|k| self.frontends.get(k).map(|f| (*k, f.value.id)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The id of frontend `key`, if programmed.
    pub fn frontend_id(&self, key: &FrontendKey) -> Option<u32> {
        self.frontends.get(key).map(|f| f.value.id)
    }

    /// Every programmed frontend with its id and service.
    pub fn frontends(&self) -> Vec<(FrontendKey, u32, ServiceKey)> {
        self.frontends
            .iter()
            .filter_map(|(k, f)| f.service.as_ref().map(|s| (*k, f.value.id, (**s).clone())))
            .collect()
    }

    /// Every programmed backend with its id, sorted by address.
    pub fn backends(&self) -> Vec<(SocketAddr, u32)> {
        let mut out: Vec<_> = self
            .backends
            .iter()
            .filter_map(|(a, b)| b.slot().map(|id| (a.socket_addr(), id)))
            .collect();
        out.sort_unstable();
        out
    }

    /// How many syncs failed because a map was full.
    pub fn full_errors(&self) -> u64 {
        self.full_errors
    }

    /// The backend id of `addr`, if it has one.
    pub fn backend_id(&self, addr: &SocketAddr) -> Option<u32> {
        self.slot_of(&BackendAddr::from(*addr))
    }

    /// The backend id of `addr`, if it has one.
    fn slot_of(&self, addr: &BackendAddr) -> Option<u32> {
        self.backends.get(addr).and_then(BackendState::slot)
    }

    /// How many frontends and backends are programmed, and the capacities.
    pub fn usage(&self) -> (usize, usize, Capacity) {
        let slots = self.backends.values().filter(|b| b.id != 0).count();
        (self.frontends.len(), slots, self.capacity)
    }

    /// Re-reads the maps: what they hold becomes the engine's "current" state.
    fn adopt(&mut self) -> Result<(), SyncError> {
        self.maps.flush()?;
        self.frontends.clear();
        // Slots are re-read; uses stay (they are the services' own).
        for b in self.backends.values_mut() {
            b.id = 0;
            b.state = 0;
        }
        self.backends.retain(|_, b| !b.is_empty());
        for state in self.services.values_mut() {
            state.frontends.clear();
        }
        for (key, value) in self.maps.frontends()? {
            if value.id < self.capacity.frontends {
                self.frontends.insert(
                    key,
                    Frontend {
                        value,
                        service: None,
                    },
                );
            } else {
                // From an agent with larger maps: unusable here.
                self.maps.delete_frontend(&key)?;
            }
        }
        for (id, backend) in self.maps.backends()? {
            let addr = backend_addr(&backend).map(BackendAddr::from);
            match addr {
                Some(addr) if self.slot_of(&addr).is_none() => {
                    let b = self.backends.get_or_default(addr);
                    b.id = id;
                    b.state = backend.state;
                }
                _ => self.maps.put_backend(id, &Backend::default())?,
            }
        }
        self.filter.reset(self.frontends.keys());
        let used_f: HashSet<u32> = self.frontends.values().map(|f| f.value.id).collect();
        self.free_frontends = (0..self.capacity.frontends)
            .filter(|id| !used_f.contains(id))
            .collect();
        let used_b: HashSet<u32> = self
            .backends
            .values()
            .filter_map(BackendState::slot)
            .collect();
        self.free_backends = (1..self.capacity.backends)
            .filter(|id| !used_b.contains(id))
            .collect();
        Ok(())
    }

    fn remove_service(&mut self, key: &ServiceKey, now: Instant) -> Result<(), SyncError> {
        let Some(state) = self.services.get(key) else {
            return Ok(());
        };
        for fk in state.frontends.clone() {
            self.delete_owned_frontend(key, &fk)?;
        }
        self.set_uses(key, Uses::default());
        self.services.remove(key);
        self.release_unused(now)
    }

    /// Deletes frontend `key` if `service` still owns it: a frontend another service
    /// claimed since (a VIP that moved in the same delta) is not this one's to delete.
    fn delete_owned_frontend(
        &mut self,
        service: &ServiceKey,
        key: &FrontendKey,
    ) -> Result<(), SyncError> {
        match self.frontends.get(key).and_then(|f| f.service.as_ref()) {
            Some(owner) if **owner != *service => Ok(()),
            _ => self.delete_frontend(key),
        }
    }

    fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), SyncError> {
        if let Some(frontend) = self.frontends.get(key) {
            let id = frontend.value.id;
            self.maps.delete_frontend(key)?;
            self.frontends.remove(key);
            self.filter.remove(key);
            self.free_frontends.insert(id);
        }
        Ok(())
    }

    /// First half of a service's upsert: its backend uses and backends, before any
    /// table names them. Returns its backends' ids, for
    /// [`Self::program_frontends`].
    fn prepare_backends(
        &mut self,
        view: &ServiceView,
        desired: &[DesiredFrontend],
        now: Instant,
    ) -> Result<BackendIds, SyncError> {
        let key = view.key();
        let spec = &view.service.spec;
        let drain = Duration::from_secs(u64::from(spec.drain_seconds));

        // Backend uses: eligible ones are active; ones that were in use (by this
        // service before, or in the maps after a restart) and no longer are drain.
        let previous = self
            .services
            .get(&key)
            .map(|s| s.uses.clone())
            .unwrap_or_default();
        let mut uses = Uses::default();
        uses.reserve_active(desired.iter().map(|f| f.eligible.len()).sum());
        for f in desired {
            for addr in &f.eligible {
                uses.insert(BackendAddr::from(*addr), Use::Active);
            }
        }
        for (addr, old) in previous.iter() {
            if !uses.contains_key(addr) {
                let until = match old {
                    Use::Active => now + drain,
                    Use::Draining { until } => *until,
                };
                if until > now {
                    uses.insert(*addr, Use::Draining { until });
                }
            }
        }
        // (An address listed twice is in `uses` after its first time.)
        for addr in listed_backends(view) {
            let adopted = self
                .backends
                .get(&addr)
                .is_some_and(|b| b.id != 0 && b.state != 0);
            if adopted && !uses.contains_key(&addr) && !previous.contains_key(&addr) {
                // In the maps from before a restart: let its flows drain.
                uses.insert(addr, Use::Draining { until: now + drain });
            }
        }

        // Backends, before any table names them. In address order (`uses` is
        // sorted): ids must not depend on hash order (same maps for the same input,
        // on every run).
        let addrs: Vec<BackendAddr> = uses.keys().copied().collect();
        if !self.services.contains_key(&key) {
            self.services
                .insert(Arc::new(key.clone()), ServiceState::default());
        }
        self.set_uses(&key, uses);
        if let Some(state) = self.services.get_mut(&key) {
            state.view = Some(view.clone());
        }
        let mut ids = Vec::with_capacity(addrs.len());
        for addr in &addrs {
            ids.push(self.ensure_backend(*addr)?);
        }
        // Only this service's backends can have changed state (the rest are brought
        // up to date by `release_unused` at the end of every apply).
        self.refresh_backend_states_of(addrs.iter().chain(previous.keys()))?;
        // Their states are now what their uses ask for: no second look at the end
        // of the apply (a later change to their uses touches them again).
        for addr in addrs.iter().chain(previous.keys()) {
            self.touched.remove(addr);
        }
        Ok(BackendIds { addrs, ids })
    }

    /// Second half of a service's upsert: its tables and frontends (after
    /// [`Self::prepare_backends`] put their backends in the maps), and the removal
    /// of frontends it no longer has. `ids` is what the first half returned;
    /// `tables` holds, one per desired frontend, the table built elsewhere, if it
    /// was (else it is built here).
    fn program_frontends(
        &mut self,
        view: &ServiceView,
        desired: &[DesiredFrontend],
        ids: &BackendIds,
        tables: &mut impl Iterator<Item = Option<Result<Maglev, MaglevError>>>,
    ) -> Result<(), SyncError> {
        let key = view.key();
        let mut keep = BTreeSet::new();
        for f in desired {
            self.write_frontend(&key, f, ids, tables.next().flatten())?;
            keep.insert(f.key);
        }
        let old_frontends = self
            .services
            .get(&key)
            .map(|s| s.frontends.clone())
            .unwrap_or_default();
        for fk in old_frontends.iter().filter(|k| !keep.contains(*k)) {
            self.delete_owned_frontend(&key, fk)?;
        }
        if let Some(state) = self.services.get_mut(&key) {
            state.frontends = keep.into_iter().collect();
            state.view = Some(view.clone());
        }
        Ok(())
    }

    /// The frontends `view` asks for, each with its eligible backends (sorted), and
    /// whether the maps hold its table for exactly those backends already: the
    /// service owned the frontend and had the same eligible backends when last
    /// applied (their ids cannot have changed: a backend keeps its slot while a
    /// service has it in a table), and no write failed since. After a failed apply
    /// the next one must be a full delta (the reconciler asks for one), whose
    /// adoption leaves no frontend owned: a partial delta would clear `stale` with
    /// a table the failed apply left behind still trusted.
    fn desired(&self, view: &ServiceView) -> Vec<DesiredFrontend> {
        let mut out = self.frontends_of(view);
        let key = view.key();
        let before = self
            .services
            .get(&key)
            .and_then(|s| s.view.as_ref())
            .map(|old| self.frontends_of(old));
        let (Some(before), false) = (before, self.stale) else {
            return out;
        };
        let table_size = self.capacity.table_size;
        for f in &mut out {
            let owned = self.frontends.get(&f.key).filter(|existing| {
                existing.service.as_deref() == Some(&key)
                    && existing.value.maglev_size
                        == if f.eligible.is_empty() { 0 } else { table_size }
            });
            f.keep_table = owned.is_some()
                && before
                    .iter()
                    .any(|old| old.key == f.key && old.eligible == f.eligible);
        }
        out
    }

    /// The frontends `view` asks for, each with its eligible backends (sorted).
    fn frontends_of(&self, view: &ServiceView) -> Vec<DesiredFrontend> {
        let spec = &view.service.spec;
        if spec.discovery.headless {
            return Vec::new();
        }
        let affinity_timeout = match spec.session_affinity {
            SessionAffinity::None => 0,
            SessionAffinity::ClientIp { timeout_seconds } => timeout_seconds.max(1),
        };
        let mut out = Vec::new();
        for port in &spec.ports {
            let proto = proto_number(port.protocol);
            for vip in &spec.discovery.vips {
                let eligible = vip::eligible(view, port, *vip, &self.node);
                out.push(DesiredFrontend {
                    key: frontend_key(*vip, port.port, proto),
                    eligible,
                    affinity_timeout,
                    keep_table: false,
                });
            }
        }
        out
    }

    /// Gives backend `addr` a slot unless it has one; returns the slot's id.
    fn ensure_backend(&mut self, addr: BackendAddr) -> Result<u32, SyncError> {
        if let Some(id) = self.slot_of(&addr) {
            return Ok(id);
        }
        let id = self.free_backends.pop_first().ok_or(SyncError::Full {
            what: "backends",
            capacity: self.capacity.backends,
            setting: "--lb-max-backends",
        })?;
        let backend = backend_value(addr.socket_addr(), BACKEND_ACTIVE);
        if let Err(e) = self.maps.put_backend(id, &backend) {
            self.free_backends.insert(id);
            return Err(e.into());
        }
        let b = self.backends.get_or_default(addr);
        b.id = id;
        b.state = BACKEND_ACTIVE;
        Ok(id)
    }

    /// Writes the state of the backends at `addrs` (active when some service has
    /// it in a table, else draining) where it differs from the maps.
    fn refresh_backend_states_of<'a>(
        &mut self,
        addrs: impl IntoIterator<Item = &'a BackendAddr>,
    ) -> Result<(), SyncError> {
        for addr in addrs {
            if let Some(b) = self.backends.get_mut(addr).filter(|b| b.id != 0) {
                refresh_backend_state(&mut self.maps, addr, b)?;
            }
        }
        Ok(())
    }

    /// Writes frontend `f` of `service` and its table (`built`, when built
    /// elsewhere; else built here unless the maps hold it already), its backends'
    /// ids taken from `known` (the service's, as its upsert left them).
    fn write_frontend(
        &mut self,
        service: &ServiceKey,
        f: &DesiredFrontend,
        known: &BackendIds,
        built: Option<Result<Maglev, MaglevError>>,
    ) -> Result<(), SyncError> {
        let existing = self.frontends.get(&f.key).cloned();
        if let Some(Frontend {
            service: Some(owner),
            ..
        }) = &existing
            && **owner != *service
        {
            // Validation keeps VIPs unique; a clash means the other service was not
            // removed yet in this delta. The newer claim wins.
            tracing::warn!(frontend = ?f.key, %owner, %service, "frontend moves to another service");
        }
        let id = match &existing {
            Some(e) => e.value.id,
            None => self.free_frontends.pop_first().ok_or(SyncError::Full {
                what: "frontends",
                capacity: self.capacity.frontends,
                setting: "--lb-max-frontends",
            })?,
        };
        let table_size = self.capacity.table_size;
        // Still this service's table (another service of this delta may have
        // claimed the frontend since `desired` looked).
        let keep_table = f.keep_table
            && existing
                .as_ref()
                .is_some_and(|e| e.service.as_deref() == Some(service));
        let ids: Vec<u32> = if keep_table {
            Vec::new()
        } else {
            f.eligible
                .iter()
                .filter_map(|a| known.get(a).or_else(|| self.backend_id(a)))
                .collect()
        };
        let maglev_size = if let (true, Some(e)) = (keep_table, &existing) {
            e.value.maglev_size
        } else if ids.is_empty() {
            0
        } else {
            match built.unwrap_or_else(|| f.build_table(table_size)) {
                Ok(maglev) => {
                    // Only the slots that differ are stored.
                    if let Err(e) = self.maps.write_table(id, &maglev.map_slots(&ids)) {
                        if existing.is_none() {
                            self.free_frontends.insert(id);
                        }
                        return Err(e.into());
                    }
                    table_size
                }
                Err(e) => {
                    tracing::error!(frontend = ?f.key, error = %e, "cannot build the maglev table: refusing new flows");
                    0
                }
            }
        };
        let value = ServiceValue {
            id,
            maglev_base: id * table_size,
            maglev_size,
            affinity_timeout: f.affinity_timeout,
        };
        if existing.as_ref().map(|e| e.value) != Some(value)
            && let Err(e) = self.maps.put_frontend(&f.key, &value)
        {
            if existing.is_none() {
                self.free_frontends.insert(id);
            }
            return Err(e.into());
        }
        if existing.is_none() {
            self.filter.add(&f.key);
        }
        self.frontends.insert(
            f.key,
            Frontend {
                value,
                service: Some(
                    self.services
                        .get_key_value(service)
                        .map(|(k, _)| k.clone())
                        .unwrap_or_else(|| Arc::new(service.clone())),
                ),
            },
        );
        Ok(())
    }

    /// Frees backends no service uses any more (drain over, or never claimed after
    /// a full sync), removing the flows that still lead to them.
    fn release_unused(&mut self, now: Instant) -> Result<(), SyncError> {
        // Drains that are over end the use (only the due ones are looked at).
        while let Some((until, key, addr)) = self.drains.first().cloned() {
            if until > now {
                break;
            }
            self.drains.pop_first();
            let current = self.services.get(&key).and_then(|s| s.uses.get(&addr));
            if current == Some(&Use::Draining { until }) {
                let mut uses = self
                    .services
                    .get(&key)
                    .map(|s| s.uses.clone())
                    .unwrap_or_default();
                uses.remove(&addr);
                self.set_uses(&key, uses);
            }
        }
        let unused: Vec<BackendAddr> = self
            .unused
            .iter()
            .filter(|a| {
                self.backends
                    .get(a)
                    .is_some_and(|b| b.users.is_empty() && b.id != 0)
            })
            .copied()
            .collect();
        if !unused.is_empty() {
            // Flows first, then the slots: if a write fails in between, no flow is
            // left naming a free id that a new backend may get (the next sync retries).
            let ids: std::collections::HashSet<u32> =
                unused.iter().filter_map(|a| self.slot_of(a)).collect();
            let purged = self.maps.purge_flows(&ids)?;
            for addr in &unused {
                if let Some(b) = self.backends.get_mut(addr).filter(|b| b.id != 0) {
                    let id = b.id;
                    self.maps.put_backend(id, &Backend::default())?;
                    b.id = 0;
                    b.state = 0;
                    self.free_backends.insert(id);
                }
                prune(&mut self.backends, addr);
            }
            tracing::debug!(backends = ids.len(), flows = purged, "backends released");
        }
        self.unused.clear();
        let mut touched: Vec<BackendAddr> = self.touched.drain().collect();
        // A full sync fills these with every backend: give that memory back (a few
        // MB at 100,000 backends) instead of keeping it for the next full sync.
        self.unused.shrink_to(SCRATCH_CAPACITY);
        self.touched.shrink_to(SCRATCH_CAPACITY);
        touched.sort_unstable();
        self.refresh_backend_states_of(touched.iter())
    }

    /// Replaces service `key`'s backend uses, keeping every count and index equal
    /// to the services' uses.
    fn set_uses(&mut self, key: &ServiceKey, mut uses: Uses) {
        uses.shrink_to_fit();
        let Some(shared) = self.services.get_key_value(key).map(|(k, _)| k.clone()) else {
            return;
        };
        let Some(state) = self.services.get_mut(key) else {
            return;
        };
        let old = std::mem::take(&mut state.uses);
        count_active(&mut self.backends, &old, false);
        count_active(&mut self.backends, &uses, true);
        for addr in old.keys() {
            self.touched.insert(*addr);
            if let Some(b) = self.backends.get_mut(addr) {
                let had_users = !b.users.is_empty();
                b.users.retain(|k| **k != *key);
                if had_users && b.users.is_empty() {
                    self.unused.insert(*addr);
                }
            }
        }
        for (addr, u) in uses.iter() {
            self.touched.insert(*addr);
            let users = &mut self.backends.get_or_default(*addr).users;
            if !users.iter().any(|k| **k == *key) {
                users.push(shared.clone());
            }
            if let Use::Draining { until } = u
                && old.get(addr) != Some(u)
            {
                self.drains.insert((*until, key.clone(), *addr));
            }
        }
        for addr in old.keys() {
            prune(&mut self.backends, addr);
        }
        state.uses = uses;
    }
}

/// Forgets backend `addr` once nothing is left to remember of it.
fn prune(backends: &mut BackendTable<BackendState>, addr: &BackendAddr) {
    if backends.get(addr).is_some_and(BackendState::is_empty) {
        backends.remove(addr);
    }
}

/// Adds (`add`) or removes the [`Use::Active`] entries of `uses` to or from the
/// backends' active counts.
fn count_active(backends: &mut BackendTable<BackendState>, uses: &Uses, add: bool) {
    for (addr, u) in uses.iter() {
        if *u != Use::Active {
            continue;
        }
        if add {
            backends.get_or_default(*addr).active += 1;
        } else if let Some(b) = backends.get_mut(addr) {
            b.active = b.active.saturating_sub(1);
        }
    }
}

/// Writes backend `addr`'s state when it differs from what its active count asks
/// for.
fn refresh_backend_state<M: LbMaps>(
    maps: &mut M,
    addr: &BackendAddr,
    slot: &mut BackendState,
) -> Result<(), SyncError> {
    let want = if slot.active != 0 {
        BACKEND_ACTIVE
    } else {
        BACKEND_DRAINING
    };
    if slot.state != want {
        maps.put_backend(slot.id, &backend_value(addr.socket_addr(), want))?;
        slot.state = want;
    }
    Ok(())
}

/// Every endpoint address × port of `view` (any state; an address may come twice).
fn listed_backends(view: &ServiceView) -> impl Iterator<Item = BackendAddr> + '_ {
    let endpoints = view
        .endpoints
        .as_ref()
        .map(|e| &e.spec.endpoints[..])
        .unwrap_or_default();
    view.service.spec.ports.iter().flat_map(move |p| {
        endpoints
            .iter()
            .map(move |e| SocketAddr::new(e.address, vip::endpoint_port(e, p)).into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        dataplane::ebpf::maps::FakeMaps,
        model::{Object, parse_documents},
    };
    use std::sync::Arc;

    fn view(name: &str, vip: &str, endpoints: &[&str]) -> ServiceView {
        let eps: Vec<String> = endpoints
            .iter()
            .map(|a| format!("{{address: {a}}}"))
            .collect();
        let yaml = format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: 80, targetPort: 8080}}], discovery: {{vips: [{vip}]}}}}\n---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\nspec: {{endpoints: [{}]}}\n",
            eps.join(", ")
        );
        let mut objects = parse_documents(&yaml).expect("valid objects").into_iter();
        let (Some(Object::Service(s)), Some(Object::Endpoints(e))) =
            (objects.next(), objects.next())
        else {
            panic!("a service and its endpoints");
        };
        ServiceView {
            service: Arc::new(s),
            endpoints: Some(Arc::new(e)),
        }
    }

    fn delta(full: bool, upserted: Vec<ServiceView>, removed: Vec<ServiceKey>) -> Delta {
        Delta {
            revision: 1,
            full,
            upserted,
            removed,
        }
    }

    fn state(sync: &LbSync<FakeMaps>, addr: &str) -> u8 {
        let addr: SocketAddr = addr.parse().expect("socket address");
        let id = sync.backend_id(&addr).expect("a backend id");
        sync.maps().backends[id as usize].state
    }

    /// The per-backend record stays compact: at 100,000 backends every 8 bytes
    /// are 0.8 MB.
    #[test]
    fn backend_records_stay_compact() {
        assert_eq!(size_of::<Users>(), 16);
        assert!(
            size_of::<BackendState>() <= 32,
            "{}",
            size_of::<BackendState>()
        );
    }

    /// A backend shared by two services stays active while either has it in a table,
    /// and drains once neither has (the per-backend reference counts).
    #[test]
    fn shared_backend_state_follows_every_service() {
        let mut sync = LbSync::new(
            FakeMaps::new(Capacity {
                frontends: 4,
                backends: 16,
                table_size: 7,
                flows: 16,
            }),
            "node",
        );
        let now = Instant::now();
        let a = view("a", "198.18.0.10", &["10.0.0.1", "10.0.0.2"]);
        let b = view("b", "198.18.0.11", &["10.0.0.1"]);
        sync.apply(&delta(true, vec![a, b.clone()], vec![]), now)
            .expect("sync");
        assert_eq!(state(&sync, "10.0.0.1:8080"), BACKEND_ACTIVE);

        // `a` drops the shared backend: `b` still uses it.
        let a = view("a", "198.18.0.10", &["10.0.0.2"]);
        sync.apply(&delta(false, vec![a.clone()], vec![]), now)
            .expect("sync");
        assert_eq!(state(&sync, "10.0.0.1:8080"), BACKEND_ACTIVE);

        // `b` goes too: the backend drains (a's drain deadline keeps it).
        sync.apply(&delta(false, vec![], vec![b.key()]), now)
            .expect("sync");
        assert_eq!(state(&sync, "10.0.0.1:8080"), BACKEND_DRAINING);

        // `a` takes it back: active again.
        let a = view("a", "198.18.0.10", &["10.0.0.1", "10.0.0.2"]);
        sync.apply(&delta(false, vec![a], vec![]), now)
            .expect("sync");
        assert_eq!(state(&sync, "10.0.0.1:8080"), BACKEND_ACTIVE);
        assert_eq!(state(&sync, "10.0.0.2:8080"), BACKEND_ACTIVE);
    }
}
