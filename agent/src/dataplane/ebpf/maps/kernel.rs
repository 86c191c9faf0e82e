//! The kernel's maps ([`KernelMaps`]), taken from the loaded object, with the queue
//! that hands backend and frontend writes to the kernel in batches.

use super::{Capacity, LbMaps, maglev_mmap::MaglevArray};
use crate::dataplane::ebpf::{batch, error::MapsError, pins::PinnedBefore, stats};
use agent_common::codec::FrontendKey;
use agent_common::lb::{
    self, AffinityKey, AffinityValue, Backend, CtKeyV4, CtKeyV6, CtReplyV4, CtReplyV6, CtValue,
    DropReason, ServiceKeyV4, ServiceKeyV6, ServiceValue, TrafficStats,
};
use aya::{
    Pod,
    maps::{Array, HashMap, IterableMap as _, Map, MapData, MapError, PerCpuArray},
};
use std::{
    collections::{BTreeMap, HashSet},
    os::fd::AsFd as _,
};

/// Removes the entries of `map` whose value `stale` picks (read first, then
/// deleted; an entry another CPU removed meanwhile is not counted). Returns how
/// many it removed.
fn remove_where<K: Pod, V: Pod>(
    map: &mut HashMap<MapData, K, V>,
    stale: impl Fn(&V) -> bool,
) -> usize {
    let keys: Vec<K> = map
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, v)| stale(v))
        .map(|(k, _)| k)
        .collect();
    keys.iter().filter(|key| map.remove(key).is_ok()).count()
}

/// The kernel's maps, taken from a loaded (or re-opened pinned) object.
pub struct KernelMaps {
    svc_v4: HashMap<MapData, ServiceKeyV4, ServiceValue>,
    svc_v6: HashMap<MapData, ServiceKeyV6, ServiceValue>,
    backends: Array<MapData, Backend>,
    ct_v4: HashMap<MapData, CtKeyV4, CtValue>,
    ct_v6: HashMap<MapData, CtKeyV6, CtValue>,
    replies_v4: HashMap<MapData, CtKeyV4, CtReplyV4>,
    replies_v6: HashMap<MapData, CtKeyV6, CtReplyV6>,
    affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    svc_stats: Array<MapData, TrafficStats>,
    backend_stats: Array<MapData, TrafficStats>,
    drops: PerCpuArray<MapData, u64>,
    vip_filter: Array<MapData, u64>,
    maglev: MaglevArray,
    capacity: Capacity,
    /// Writes queued for one batch call per map.
    pending: Pending,
    /// Whether the kernel takes batch writes (false after it refused one: then one
    /// call per element, as before kernel 5.6).
    batch_ok: bool,
    /// The maps this agent created and has not written yet: reading them back (the
    /// engine adopts what the maps hold on its first sync) finds nothing, so it is
    /// skipped (the backends array is large to copy out).
    unwritten: Unwritten,
}

/// Which maps are known to be empty: created by this agent's load (no earlier
/// agent pinned them) and not written since. The programs never write them.
#[derive(Clone, Copy, Debug, Default)]
struct Unwritten {
    frontends: bool,
    backends: bool,
}

/// Writes to the kernel maps, queued so that a sync makes one `bpf()` call per map
/// instead of one per element.
///
/// Order is kept where it matters: a table slot is only written (through memory)
/// after the queued backends are in the maps, so a table never names a backend the
/// kernel does not have yet; frontends go last in every flush, after their tables;
/// a delete or a conntrack purge first writes everything queued, so no queued write
/// lands after it. Within one map, elements are written in the order they were
/// queued (a later write of the same key wins).
#[derive(Default)]
struct Pending {
    backend_ids: Vec<u32>,
    backends: Vec<Backend>,
    v4_keys: Vec<ServiceKeyV4>,
    v4_values: Vec<ServiceValue>,
    v6_keys: Vec<ServiceKeyV6>,
    v6_values: Vec<ServiceValue>,
}

/// Queued writes per map before they are written anyway, which bounds the queue's
/// memory.
const MAX_PENDING: usize = 16_384;

impl Pending {
    fn is_full(&self) -> bool {
        self.backend_ids.len() >= MAX_PENDING
            || self.v4_keys.len() >= MAX_PENDING
            || self.v6_keys.len() >= MAX_PENDING
    }
}

/// Writes `keys[i] → values[i]` into `map` with one batch call; `Ok(false)` when the
/// kernel has no batch writes (the caller then writes one by one and stops trying).
fn write_batch<K: Pod, V: Pod>(
    batch_ok: &mut bool,
    map: &MapData,
    name: &'static str,
    keys: &[K],
    values: &[V],
) -> Result<bool, MapsError> {
    if keys.is_empty() {
        return Ok(true);
    }
    if !*batch_ok {
        return Ok(false);
    }
    match batch::update(map.fd().as_fd(), keys, values) {
        Ok(()) => Ok(true),
        Err(e) if batch::unsupported(&e) => {
            tracing::info!(map = name, error = %e, "no batch map writes in this kernel: one call per element");
            *batch_ok = false;
            Ok(false)
        }
        Err(e) => Err(MapsError::new(name, "batch write", e)),
    }
}

/// Writes one family's queued frontends into its services map (one batch call, or
/// one call each where the kernel has no batch writes) and empties the queue.
fn flush_frontends<K: Pod>(
    batch_ok: &mut bool,
    map: &mut HashMap<MapData, K, ServiceValue>,
    name: &'static str,
    keys: &mut Vec<K>,
    values: &mut Vec<ServiceValue>,
) -> Result<(), MapsError> {
    if !write_batch(batch_ok, map.map(), name, keys, values)? {
        for (k, v) in keys.iter().zip(values.iter()) {
            map.insert(k, v, 0)
                .map_err(|e| MapsError::new(name, "insert", e))?;
        }
    }
    keys.clear();
    values.clear();
    Ok(())
}

fn take(maps: &mut BTreeMap<String, Map>, name: &'static str) -> Result<Map, MapsError> {
    maps.remove(name)
        .ok_or_else(|| MapsError::new(name, "open", "missing from the eBPF object"))
}

fn map_data(map: Map, name: &'static str) -> Result<MapData, MapsError> {
    match map {
        Map::Array(data) => Ok(data),
        _ => Err(MapsError::new(name, "open", "not an array")),
    }
}

impl KernelMaps {
    /// Takes the load balancer's maps out of `maps` (by name, as `Ebpf::take_map`
    /// gives them) and maps the Maglev array into memory.
    pub fn new(maps: &mut BTreeMap<String, Map>) -> Result<Self, MapsError> {
        fn typed<T: TryFrom<Map, Error = MapError>>(
            maps: &mut BTreeMap<String, Map>,
            name: &'static str,
        ) -> Result<T, MapsError> {
            T::try_from(take(maps, name)?).map_err(|e| MapsError::new(name, "open", e))
        }
        let backends: Array<MapData, Backend> = typed(maps, lb::BACKENDS)?;
        let svc_v4: HashMap<MapData, ServiceKeyV4, ServiceValue> = typed(maps, lb::SERVICES_V4)?;
        let maglev = MaglevArray::new(map_data(take(maps, lb::MAGLEV)?, lb::MAGLEV)?)?;
        let frontends = svc_v4
            .map()
            .info()
            .map_err(|e| MapsError::new(lb::SERVICES_V4, "info", e))?
            .max_entries();
        let table_size = u32::try_from(maglev.len)
            .unwrap_or(u32::MAX)
            .checked_div(frontends)
            .unwrap_or(0);
        let ct_v4: HashMap<MapData, CtKeyV4, CtValue> = typed(maps, lb::CONNTRACK_V4)?;
        let flows = ct_v4
            .map()
            .info()
            .map_err(|e| MapsError::new(lb::CONNTRACK_V4, "info", e))?
            .max_entries();
        let capacity = Capacity {
            frontends,
            backends: backends.len(),
            table_size,
            flows,
        };
        Ok(Self {
            svc_v4,
            svc_v6: typed(maps, lb::SERVICES_V6)?,
            backends,
            ct_v4,
            ct_v6: typed(maps, lb::CONNTRACK_V6)?,
            replies_v4: typed(maps, lb::CONNTRACK_REPLY_V4)?,
            replies_v6: typed(maps, lb::CONNTRACK_REPLY_V6)?,
            affinity: typed(maps, lb::AFFINITY)?,
            svc_stats: typed(maps, lb::SERVICE_STATS)?,
            backend_stats: typed(maps, lb::BACKEND_STATS)?,
            drops: typed(maps, lb::DROPS)?,
            vip_filter: typed(maps, lb::VIP_FILTER)?,
            maglev,
            capacity,
            pending: Pending::default(),
            batch_ok: true,
            unwritten: Unwritten::default(),
        })
    }

    /// Tells which maps were pinned before the load that created these (see
    /// [`PinnedBefore::probe`]): the others hold nothing to adopt yet.
    #[must_use]
    pub fn pinned_before(mut self, pinned: PinnedBefore) -> Self {
        self.unwritten = Unwritten {
            frontends: !pinned.frontends,
            backends: !pinned.backends,
        };
        self
    }

    /// Writes the queued backends (what tables depend on).
    fn flush_backends(&mut self) -> Result<(), MapsError> {
        let p = &mut self.pending;
        if !write_batch(
            &mut self.batch_ok,
            self.backends.map(),
            lb::BACKENDS,
            &p.backend_ids,
            &p.backends,
        )? {
            for (id, b) in p.backend_ids.iter().zip(&p.backends) {
                self.backends
                    .set(*id, b, 0)
                    .map_err(|e| MapsError::new(lb::BACKENDS, "write", e))?;
            }
        }
        p.backend_ids.clear();
        p.backends.clear();
        Ok(())
    }

    /// Writes everything queued: backends, then frontends.
    fn flush_all(&mut self) -> Result<(), MapsError> {
        self.flush_backends()?;
        let p = &mut self.pending;
        flush_frontends(
            &mut self.batch_ok,
            &mut self.svc_v4,
            lb::SERVICES_V4,
            &mut p.v4_keys,
            &mut p.v4_values,
        )?;
        flush_frontends(
            &mut self.batch_ok,
            &mut self.svc_v6,
            lb::SERVICES_V6,
            &mut p.v6_keys,
            &mut p.v6_values,
        )
    }

    /// Writes everything queued once a queue is long (bounded memory).
    fn flush_if_full(&mut self) -> Result<(), MapsError> {
        if self.pending.is_full() {
            self.flush_all()?;
        }
        Ok(())
    }
}

impl LbMaps for KernelMaps {
    fn capacity(&self) -> Capacity {
        self.capacity
    }

    fn frontends(&self) -> Result<Vec<(FrontendKey, ServiceValue)>, MapsError> {
        if self.unwritten.frontends {
            return Ok(Vec::new());
        }
        let capacity = self.capacity.frontends;
        let v4 = batch::lookup_all::<ServiceKeyV4, ServiceValue>(
            self.svc_v4.map().fd().as_fd(),
            capacity,
        );
        let v6 = batch::lookup_all::<ServiceKeyV6, ServiceValue>(
            self.svc_v6.map().fd().as_fd(),
            capacity,
        );
        match (v4, v6) {
            (Ok((k4, v4)), Ok((k6, v6))) => {
                return Ok(k4
                    .into_iter()
                    .map(FrontendKey::V4)
                    .zip(v4)
                    .chain(k6.into_iter().map(FrontendKey::V6).zip(v6))
                    .collect());
            }
            (Err(e), _) | (_, Err(e)) if !batch::unsupported(&e) => {
                return Err(MapsError::new(lb::SERVICES_V4, "batch read", e));
            }
            _ => {}
        }
        let mut out = Vec::new();
        for entry in self.svc_v4.iter() {
            let (k, v) = entry.map_err(|e| MapsError::new(lb::SERVICES_V4, "read", e))?;
            out.push((FrontendKey::V4(k), v));
        }
        for entry in self.svc_v6.iter() {
            let (k, v) = entry.map_err(|e| MapsError::new(lb::SERVICES_V6, "read", e))?;
            out.push((FrontendKey::V6(k), v));
        }
        Ok(out)
    }

    fn backends(&self) -> Result<Vec<(u32, Backend)>, MapsError> {
        if self.unwritten.backends {
            return Ok(Vec::new());
        }
        // A few calls for the whole array, not one per entry.
        match batch::lookup_all::<u32, Backend>(
            self.backends.map().fd().as_fd(),
            self.backends.len(),
        ) {
            Ok((ids, all)) => {
                return Ok(ids
                    .into_iter()
                    .zip(all)
                    .filter(|(_, b)| b.family != 0)
                    .collect());
            }
            Err(e) if batch::unsupported(&e) => {}
            Err(e) => return Err(MapsError::new(lb::BACKENDS, "batch read", e)),
        }
        let mut out = Vec::new();
        for (id, entry) in self.backends.iter().enumerate() {
            let backend = entry.map_err(|e| MapsError::new(lb::BACKENDS, "read", e))?;
            if backend.family != 0 {
                out.push((id as u32, backend));
            }
        }
        Ok(out)
    }

    fn put_frontend(&mut self, key: &FrontendKey, value: &ServiceValue) -> Result<(), MapsError> {
        self.unwritten.frontends = false;
        match key {
            FrontendKey::V4(k) => {
                self.pending.v4_keys.push(*k);
                self.pending.v4_values.push(*value);
            }
            FrontendKey::V6(k) => {
                self.pending.v6_keys.push(*k);
                self.pending.v6_values.push(*value);
            }
        }
        self.flush_if_full()
    }

    fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), MapsError> {
        self.unwritten.frontends = false;
        self.flush_all()?;
        let (result, name) = match key {
            FrontendKey::V4(k) => (self.svc_v4.remove(k), lb::SERVICES_V4),
            FrontendKey::V6(k) => (self.svc_v6.remove(k), lb::SERVICES_V6),
        };
        match result {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(())
            }
            Err(e) => Err(MapsError::new(name, "delete", e)),
        }
    }

    fn put_vip_filter(&mut self, words: &[(u32, u64)]) -> Result<(), MapsError> {
        let (indexes, values): (Vec<u32>, Vec<u64>) = words.iter().copied().unzip();
        if write_batch(
            &mut self.batch_ok,
            self.vip_filter.map(),
            lb::VIP_FILTER,
            &indexes,
            &values,
        )? {
            return Ok(());
        }
        for (index, word) in words {
            self.vip_filter
                .set(*index, word, 0)
                .map_err(|e| MapsError::new(lb::VIP_FILTER, "write", e))?;
        }
        Ok(())
    }

    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<(), MapsError> {
        if id >= self.capacity.backends {
            return Err(MapsError::new(lb::BACKENDS, "write", "index out of range"));
        }
        self.unwritten.backends = false;
        self.pending.backend_ids.push(id);
        self.pending.backends.push(*backend);
        self.flush_if_full()
    }

    fn table(&self, id: u32) -> Result<&[u32], MapsError> {
        let size = self.capacity.table_size as usize;
        let start = id as usize * size;
        self.maglev.table(start, size)
    }

    fn set_slots(&mut self, id: u32, changes: &[(usize, u32)]) -> Result<(), MapsError> {
        // The backends the slots name must be in the maps first.
        self.flush_backends()?;
        let size = self.capacity.table_size as usize;
        let start = id as usize * size;
        let table = self.maglev.table_mut(start, size)?;
        for &(slot, backend) in changes {
            *table
                .get_mut(slot)
                .ok_or_else(|| MapsError::new(lb::MAGLEV, "write", format!("no slot {slot}")))? =
                backend;
        }
        Ok(())
    }

    fn write_table(&mut self, id: u32, want: &[u32]) -> Result<bool, MapsError> {
        let size = self.capacity.table_size as usize;
        if want.len() != size {
            return Err(MapsError::new(
                lb::MAGLEV,
                "write",
                format!("{} slots for a table of {size}", want.len()),
            ));
        }
        let start = id as usize * size;
        // Compared in place (a fresh table differs everywhere, an unchanged one
        // nowhere): no list of changed slots.
        if self.maglev.table(start, size)? == want {
            return Ok(false);
        }
        // The backends the slots name must be in the maps first.
        self.flush_backends()?;
        let table = self.maglev.table_mut(start, size)?;
        for (have, want) in table.iter_mut().zip(want) {
            if *have != *want {
                *have = *want;
            }
        }
        Ok(true)
    }

    fn purge_flows(&mut self, backend_ids: &HashSet<u32>) -> Result<usize, MapsError> {
        if backend_ids.is_empty() {
            return Ok(0);
        }
        self.flush_all()?;
        let mut removed = 0;
        removed += remove_where(&mut self.ct_v4, |v| backend_ids.contains(&v.backend_id));
        removed += remove_where(&mut self.ct_v6, |v| backend_ids.contains(&v.backend_id));
        // Their reply entries too: a later flow may claim their tuples at once.
        removed += remove_where(&mut self.replies_v4, |v| {
            backend_ids.contains(&v.backend_id)
        });
        removed += remove_where(&mut self.replies_v6, |v| {
            backend_ids.contains(&v.backend_id)
        });
        removed += remove_where(&mut self.affinity, |v| backend_ids.contains(&v.backend_id));
        Ok(removed)
    }

    fn frontend_stats(&self, id: u32) -> Result<TrafficStats, MapsError> {
        stats::read(&self.svc_stats, id).map_err(|e| MapsError::new(lb::SERVICE_STATS, "read", e))
    }

    fn backend_stats(&self, id: u32) -> Result<TrafficStats, MapsError> {
        stats::read(&self.backend_stats, id)
            .map_err(|e| MapsError::new(lb::BACKEND_STATS, "read", e))
    }

    fn frontend_stats_of(&self, ids: &[u32]) -> Result<Vec<TrafficStats>, MapsError> {
        stats::read_many(&self.svc_stats, ids)
            .map_err(|e| MapsError::new(lb::SERVICE_STATS, "batch read", e))
    }

    fn backend_stats_of(&self, ids: &[u32]) -> Result<Vec<TrafficStats>, MapsError> {
        stats::read_many(&self.backend_stats, ids)
            .map_err(|e| MapsError::new(lb::BACKEND_STATS, "batch read", e))
    }

    fn drops(&self) -> Result<Vec<(DropReason, u64)>, MapsError> {
        DropReason::ALL
            .iter()
            .map(|reason| {
                let values = self
                    .drops
                    .get(&(*reason as u32), 0)
                    .map_err(|e| MapsError::new(lb::DROPS, "read", e))?;
                Ok((*reason, values.iter().fold(0u64, |a, b| a.wrapping_add(*b))))
            })
            .collect()
    }

    fn flows(&self) -> Result<usize, MapsError> {
        Ok(self.ct_v4.keys().count() + self.ct_v6.keys().count())
    }

    fn flows_by_family(&self) -> Result<(usize, usize), MapsError> {
        Ok((self.ct_v4.keys().count(), self.ct_v6.keys().count()))
    }

    fn flush(&mut self) -> Result<(), MapsError> {
        let flushed = self.flush_all();
        if flushed.is_err() {
            // What was not written is left to the next full sync (the engine marks
            // itself stale), not retried by the next unrelated flush.
            self.pending = Pending::default();
        }
        flushed
    }

    fn release(&mut self) {
        self.maglev.unmap_all();
        // A full sync's queues are large; keep only a small change's worth.
        let p = &mut self.pending;
        p.backend_ids.shrink_to(64);
        p.backends.shrink_to(64);
        p.v4_keys.shrink_to(64);
        p.v4_values.shrink_to(64);
        p.v6_keys.shrink_to(64);
        p.v6_values.shrink_to(64);
    }
}
