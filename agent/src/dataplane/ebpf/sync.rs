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
//! keeping this order: a full sync writes its backends in a few `bpf()` calls. A large delta goes a chunk of services at a time (each chunk's
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
//!
//! Here: the engine's state, an apply and adoption. Its parts: `upsert` (a
//! service's backends, tables and frontends), `remove` (services that go, backends
//! freed), `builder` (tables built on a second thread), `state` and `uses` (what
//! it keeps per frontend, backend and service).

mod builder;
mod remove;
mod state;
mod upsert;
mod uses;

use super::{
    backend_table::{BackendAddr, BackendTable},
    error::MapsError,
    maps::{Capacity, LbMaps},
    prefilter::VipFilter,
};
use crate::{
    dataplane::{ServicePortStatus, vip},
    endpoints::{Delta, ServiceView},
    model::ServiceKey,
};
use agent_common::{
    codec::{FrontendKey, backend_addr},
    lb::Backend,
};
use builder::PARALLEL_TABLES;
use state::{BackendState, DesiredFrontend, Frontend, ServiceState};
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::SocketAddr,
    sync::Arc,
    time::Instant,
};
use uses::{Use, Uses};

/// The engine's hash sets, of backend addresses and service keys: a fast seeded
/// hash, as std's SipHash is a visible share of a full sync's CPU.
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

/// The sync engine: desired state from the cache, written into [`LbMaps`] by diff.
pub struct LbSync<M> {
    maps: M,
    node: String,
    capacity: Capacity,
    frontends: BTreeMap<FrontendKey, Frontend>,
    /// Every backend address with a slot or a use.
    backends: BackendTable<BackendState>,
    /// By key, the one every backend's list of users and every frontend shares, so
    /// that a service's key is stored once.
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
    /// During a full delta after an adoption: the adopted backends (by slot) that
    /// no service of the delta lists. A service whose adopted table still leads to
    /// one lets its flows drain, as if the agent had seen the endpoint go.
    orphans: HashMap<u32, BackendAddr>,
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
            orphans: HashMap::new(),
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
        let result = self.apply_delta(delta, now);
        self.orphans.clear();
        result
    }

    fn apply_delta(&mut self, delta: &Delta, now: Instant) -> Result<(), SyncError> {
        let mut adopted = false;
        if delta.full {
            if self.stale {
                self.adopt()?;
                adopted = true;
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
        if adopted {
            self.find_orphans(&desired);
        }
        // Room for the backends at once, as growing by doubling would rehash the
        // index and copy the records again and again; a service's largest frontend
        // counts (its others often list the same backends: never more room than
        // needed).
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

    /// After an adoption: the adopted backends no desired frontend lists (endpoints
    /// removed while no agent ran), by slot, for [`Self::prepare_backends`].
    fn find_orphans(&mut self, desired: &[Vec<DesiredFrontend>]) {
        let listed: HashSet<BackendAddr> = desired
            .iter()
            .flatten()
            .flat_map(|f| f.eligible.iter().map(|a| BackendAddr::from(*a)))
            .collect();
        self.orphans = self
            .backends
            .iter()
            .filter(|(addr, b)| b.id != 0 && b.users.is_empty() && !listed.contains(*addr))
            .map(|(addr, b)| (b.id, *addr))
            .collect();
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

#[cfg(test)]
mod tests;
