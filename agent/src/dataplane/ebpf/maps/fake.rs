//! In-memory maps for unprivileged unit tests: [`FakeMaps`] with the kernel's
//! semantics, and [`FaultyMaps`], which fails writes on demand.

use super::{Capacity, LbMaps};
use crate::dataplane::ebpf::error::MapsError;
use agent_common::{
    codec::FrontendKey,
    filter::VIP_FILTER_WORDS,
    lb::{self, Backend, DropReason, ServiceValue, TrafficStats},
};
use std::collections::{BTreeMap, HashSet};

/// In-memory maps with the kernel's semantics, for unprivileged tests.
#[derive(Clone, Debug)]
pub struct FakeMaps {
    /// Frontends.
    pub frontends: BTreeMap<FrontendKey, ServiceValue>,
    /// Backend slots (index = id).
    pub backends: Vec<Backend>,
    /// All tables, `capacity.frontends × capacity.table_size` slots.
    pub maglev: Vec<u32>,
    /// Backend ids of the "conntrack" entries (one per flow).
    pub flows: Vec<u32>,
    /// Every write made, in order (`put_frontend …`, `table {id}` when slots of that
    /// table change; reads are not writes), so tests can see what changed.
    pub writes: Vec<String>,
    /// The VIP prefilter's words (zeros until written, as a new kernel map).
    pub vip_filter: Vec<u64>,
    /// Filter words written so far (not in `writes`: they follow the frontends).
    pub vip_filter_writes: usize,
    capacity: Capacity,
}

impl FakeMaps {
    /// Empty maps of the given capacity.
    #[must_use]
    pub fn new(capacity: Capacity) -> Self {
        Self {
            frontends: BTreeMap::new(),
            backends: vec![Backend::default(); capacity.backends as usize],
            maglev: vec![0; capacity.frontends as usize * capacity.table_size as usize],
            flows: Vec::new(),
            writes: Vec::new(),
            vip_filter: vec![0; VIP_FILTER_WORDS as usize],
            vip_filter_writes: 0,
            capacity,
        }
    }
}

impl LbMaps for FakeMaps {
    fn capacity(&self) -> Capacity {
        self.capacity
    }

    fn frontends(&self) -> Result<Vec<(FrontendKey, ServiceValue)>, MapsError> {
        Ok(self.frontends.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn backends(&self) -> Result<Vec<(u32, Backend)>, MapsError> {
        Ok(self
            .backends
            .iter()
            .enumerate()
            .filter(|(_, b)| b.family != 0)
            .map(|(i, b)| (i as u32, *b))
            .collect())
    }

    fn put_frontend(&mut self, key: &FrontendKey, value: &ServiceValue) -> Result<(), MapsError> {
        if !self.frontends.contains_key(key)
            && self.frontends.len() >= self.capacity.frontends as usize
        {
            return Err(MapsError::new(lb::SERVICES_V4, "insert", "map full"));
        }
        self.writes.push(format!("put_frontend {key:?}"));
        self.frontends.insert(*key, *value);
        Ok(())
    }

    fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), MapsError> {
        self.writes.push(format!("delete_frontend {key:?}"));
        self.frontends.remove(key);
        Ok(())
    }

    fn put_vip_filter(&mut self, words: &[(u32, u64)]) -> Result<(), MapsError> {
        for &(index, word) in words {
            *self
                .vip_filter
                .get_mut(index as usize)
                .ok_or_else(|| MapsError::new(lb::VIP_FILTER, "write", "index out of range"))? =
                word;
        }
        self.vip_filter_writes += words.len();
        Ok(())
    }

    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<(), MapsError> {
        let slot = self
            .backends
            .get_mut(id as usize)
            .ok_or_else(|| MapsError::new(lb::BACKENDS, "write", "index out of range"))?;
        self.writes.push(format!("put_backend {id}"));
        *slot = *backend;
        Ok(())
    }

    fn table(&self, id: u32) -> Result<&[u32], MapsError> {
        let size = self.capacity.table_size as usize;
        let start = id as usize * size;
        self.maglev
            .get(start..start + size)
            .ok_or_else(|| MapsError::new(lb::MAGLEV, "read", format!("no table {id}")))
    }

    fn set_slots(&mut self, id: u32, changes: &[(usize, u32)]) -> Result<(), MapsError> {
        let size = self.capacity.table_size as usize;
        if id >= self.capacity.frontends || changes.iter().any(|(slot, _)| *slot >= size) {
            return Err(MapsError::new(
                lb::MAGLEV,
                "write",
                format!("no table {id}"),
            ));
        }
        self.writes.push(format!("table {id}"));
        for &(slot, backend) in changes {
            self.maglev[id as usize * size + slot] = backend;
        }
        Ok(())
    }

    fn purge_flows(&mut self, backend_ids: &HashSet<u32>) -> Result<usize, MapsError> {
        let before = self.flows.len();
        self.flows.retain(|id| !backend_ids.contains(id));
        Ok(before - self.flows.len())
    }

    fn frontend_stats(&self, _id: u32) -> Result<TrafficStats, MapsError> {
        Ok(TrafficStats::default())
    }

    fn backend_stats(&self, _id: u32) -> Result<TrafficStats, MapsError> {
        Ok(TrafficStats::default())
    }

    fn drops(&self) -> Result<Vec<(DropReason, u64)>, MapsError> {
        Ok(DropReason::ALL.iter().map(|r| (*r, 0)).collect())
    }

    fn flows(&self) -> Result<usize, MapsError> {
        Ok(self.flows.len())
    }

    fn flows_by_family(&self) -> Result<(usize, usize), MapsError> {
        let v6 = self
            .flows
            .iter()
            .filter(|id| {
                self.backends
                    .get(**id as usize)
                    .is_some_and(|b| b.family == lb::FAMILY_V6)
            })
            .count();
        Ok((self.flows.len() - v6, v6))
    }
}

/// Wraps maps and fails every write once a countdown reaches zero, to test that a
/// failed sync is reported and a later full sync repairs everything.
pub struct FaultyMaps<M> {
    /// The wrapped maps.
    pub inner: M,
    /// Writes that still succeed; `None` never fails.
    pub writes_left: Option<usize>,
}

impl<M: LbMaps> FaultyMaps<M> {
    fn write(&mut self, map: &'static str) -> Result<(), MapsError> {
        match &mut self.writes_left {
            Some(0) => Err(MapsError::new(map, "write", "injected failure")),
            Some(n) => {
                *n -= 1;
                Ok(())
            }
            None => Ok(()),
        }
    }
}

impl<M: LbMaps> LbMaps for FaultyMaps<M> {
    fn capacity(&self) -> Capacity {
        self.inner.capacity()
    }
    fn frontends(&self) -> Result<Vec<(FrontendKey, ServiceValue)>, MapsError> {
        self.inner.frontends()
    }
    fn backends(&self) -> Result<Vec<(u32, Backend)>, MapsError> {
        self.inner.backends()
    }
    fn put_frontend(&mut self, key: &FrontendKey, value: &ServiceValue) -> Result<(), MapsError> {
        self.write(lb::SERVICES_V4)?;
        self.inner.put_frontend(key, value)
    }
    fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), MapsError> {
        self.write(lb::SERVICES_V4)?;
        self.inner.delete_frontend(key)
    }
    fn put_vip_filter(&mut self, words: &[(u32, u64)]) -> Result<(), MapsError> {
        self.write(lb::VIP_FILTER)?;
        self.inner.put_vip_filter(words)
    }
    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<(), MapsError> {
        self.write(lb::BACKENDS)?;
        self.inner.put_backend(id, backend)
    }
    fn table(&self, id: u32) -> Result<&[u32], MapsError> {
        self.inner.table(id)
    }
    fn set_slots(&mut self, id: u32, changes: &[(usize, u32)]) -> Result<(), MapsError> {
        self.write(lb::MAGLEV)?;
        self.inner.set_slots(id, changes)
    }
    fn purge_flows(&mut self, backend_ids: &HashSet<u32>) -> Result<usize, MapsError> {
        self.write(lb::CONNTRACK_V4)?;
        self.inner.purge_flows(backend_ids)
    }
    fn frontend_stats(&self, id: u32) -> Result<TrafficStats, MapsError> {
        self.inner.frontend_stats(id)
    }
    fn backend_stats(&self, id: u32) -> Result<TrafficStats, MapsError> {
        self.inner.backend_stats(id)
    }
    fn drops(&self) -> Result<Vec<(DropReason, u64)>, MapsError> {
        self.inner.drops()
    }
    fn flows(&self) -> Result<usize, MapsError> {
        self.inner.flows()
    }
    fn flows_by_family(&self) -> Result<(usize, usize), MapsError> {
        self.inner.flows_by_family()
    }
    fn flush(&mut self) -> Result<(), MapsError> {
        self.inner.flush()
    }
    fn release(&mut self) {
        self.inner.release();
    }
}
