//! The load balancer's maps behind one trait, [`LbMaps`]: the kernel's
//! ([`KernelMaps`]) in the agent, in-memory fakes (`FakeMaps`, `FaultyMaps`) in
//! unit tests.
//!
//! The sync engine ([`super::sync`]) only talks to [`LbMaps`], so everything it
//! decides (ids, tables, which entries change) is tested without privileges, and a
//! map write that fails is tested without a broken kernel.

#[cfg(test)]
mod fake;
mod kernel;
mod maglev_mmap;

#[cfg(test)]
pub use fake::{FakeMaps, FaultyMaps};
pub use kernel::KernelMaps;

use super::error::MapsError;
use agent_common::{
    codec::FrontendKey,
    lb::{Backend, DropReason, ServiceValue, TrafficStats},
};
use std::collections::HashSet;

/// How many entries the maps hold, as created (a pinned map keeps the size it was
/// created with, whatever the configuration now says).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Frontends (ids `0..frontends`; each owns one Maglev table).
    pub frontends: u32,
    /// Backend ids (`1..backends`; id 0 means "none").
    pub backends: u32,
    /// Slots per Maglev table.
    pub table_size: u32,
    /// Conntrack entries per family.
    pub flows: u32,
}

/// What the sync engine needs from the load balancer's maps.
pub trait LbMaps: Send {
    /// The maps' sizes.
    fn capacity(&self) -> Capacity;
    /// Every frontend in the maps (read back at start to adopt a previous agent's state).
    fn frontends(&self) -> Result<Vec<(FrontendKey, ServiceValue)>, MapsError>;
    /// Every used backend slot (family ≠ 0), by id.
    fn backends(&self) -> Result<Vec<(u32, Backend)>, MapsError>;
    /// Inserts or replaces a frontend.
    fn put_frontend(&mut self, key: &FrontendKey, value: &ServiceValue) -> Result<(), MapsError>;
    /// Removes a frontend (absent is fine).
    fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), MapsError>;
    /// Writes backend slot `id` (a zeroed backend frees it).
    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<(), MapsError>;
    /// Writes words of the VIP prefilter (`agent_common::filter`): (index, word).
    fn put_vip_filter(&mut self, words: &[(u32, u64)]) -> Result<(), MapsError>;
    /// Frontend `id`'s Maglev table, for reading.
    fn table(&self, id: u32) -> Result<&[u32], MapsError>;
    /// Stores `(slot, backend id)` pairs into frontend `id`'s table (only the slots
    /// that change, so a read-only comparison is never counted as a write).
    fn set_slots(&mut self, id: u32, changes: &[(usize, u32)]) -> Result<(), MapsError>;
    /// Makes frontend `id`'s table equal to `want` (a backend id per slot), storing
    /// only the slots that differ; returns whether any did.
    fn write_table(&mut self, id: u32, want: &[u32]) -> Result<bool, MapsError> {
        let changes: Vec<(usize, u32)> = self
            .table(id)?
            .iter()
            .zip(want)
            .enumerate()
            .filter(|(_, (have, want))| have != want)
            .map(|(slot, (_, want))| (slot, *want))
            .collect();
        if changes.is_empty() {
            return Ok(false);
        }
        self.set_slots(id, &changes)?;
        Ok(true)
    }
    /// Removes conntrack and affinity entries that lead to any of `backend_ids`;
    /// returns how many were removed.
    fn purge_flows(&mut self, backend_ids: &HashSet<u32>) -> Result<usize, MapsError>;
    /// Frontend `id`'s counters, summed over CPUs.
    fn frontend_stats(&self, id: u32) -> Result<TrafficStats, MapsError>;
    /// Backend `id`'s counters, summed over CPUs.
    fn backend_stats(&self, id: u32) -> Result<TrafficStats, MapsError>;
    /// The counters of frontends `ids`, in order (a scrape reads them all at once).
    fn frontend_stats_of(&self, ids: &[u32]) -> Result<Vec<TrafficStats>, MapsError> {
        ids.iter().map(|id| self.frontend_stats(*id)).collect()
    }
    /// The counters of backends `ids`, in order (a scrape reads them all at once).
    fn backend_stats_of(&self, ids: &[u32]) -> Result<Vec<TrafficStats>, MapsError> {
        ids.iter().map(|id| self.backend_stats(*id)).collect()
    }
    /// Drop counters by reason, summed over CPUs.
    fn drops(&self) -> Result<Vec<(DropReason, u64)>, MapsError>;
    /// Conntrack entries in use (both families), for map-pressure metrics.
    fn flows(&self) -> Result<usize, MapsError>;
    /// Conntrack entries in use per family (IPv4, IPv6): each family's map has its
    /// own capacity, so one can fill while the other is empty.
    fn flows_by_family(&self) -> Result<(usize, usize), MapsError>;
    /// Writes what earlier calls queued (the kernel maps batch backend and frontend
    /// writes, see [`KernelMaps`]); called at the end of every sync and before the
    /// maps are read back.
    fn flush(&mut self) -> Result<(), MapsError> {
        Ok(())
    }
    /// Lets go of what reading and writing tables held on to (the kernel maps'
    /// windows into the Maglev array); called at the end of every sync.
    fn release(&mut self) {}
}
