//! The traffic counters' layout: `RUNE_SVC_STATS` and `RUNE_BACKEND_STATS` are plain
//! arrays with one region per possible CPU (CPU-major), not per-CPU arrays.
//!
//! A per-CPU array costs the kernel one per-CPU allocation per entry when it is
//! created, which slows every start with large maps. A plain
//! array of `entries × possible CPUs` is one allocation with the same memory, and
//! each CPU still writes only its own contiguous region (no shared cache lines
//! between CPUs but at the regions' edges). The programs learn a region's length
//! from a global the loader sets ([`StatsLayout::configure`]); readers sum the
//! regions ([`read`]).
//!
//! Counters pinned by an agent with per-CPU arrays are carried over at start, summed
//! into CPU 0's region ([`carry_over`]): the metrics are monotonic counters, and
//! keeping them avoids a reset in every dashboard on upgrade.

use std::{borrow::Borrow, os::fd::AsFd as _, path::Path};

use agent_common::lb::{self, TrafficStats};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, IterableMap as _, Map, MapData, MapError, MapInfo, MapType, PerCpuArray},
};

use super::{batch, error::EbpfError};

/// The number of regions in a counters array: the highest possible CPU id + 1 (as
/// the kernel's per-CPU maps, sized by possible, not online, CPUs). The programs
/// index regions by `bpf_get_smp_processor_id`, so on a sparse possible mask
/// (`0,2-3`) the count of CPUs (3) would leave the highest CPU (3) uncounted.
pub fn possible_cpus() -> Result<u32, EbpfError> {
    cpus().map_err(|e| EbpfError::Pin {
        path: POSSIBLE_CPUS.into(),
        reason: e.to_string(),
    })
}

/// Where the kernel lists the possible CPUs.
const POSSIBLE_CPUS: &str = "/sys/devices/system/cpu/possible";

fn cpus() -> std::io::Result<u32> {
    static REGIONS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    if let Some(n) = REGIONS.get() {
        return Ok(*n);
    }
    let n = regions_of(&std::fs::read_to_string(POSSIBLE_CPUS)?)?;
    Ok(*REGIONS.get_or_init(|| n))
}

/// The highest CPU id + 1 of a kernel CPU list (`0-3`, `0,2-5`).
fn regions_of(list: &str) -> std::io::Result<u32> {
    list.trim()
        .rsplit([',', '-'])
        .next()
        .and_then(|last| last.parse::<u32>().ok())
        .and_then(|highest| highest.checked_add(1))
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{POSSIBLE_CPUS}: not a CPU list: {list:?}"),
            )
        })
}

/// Entries per CPU of the two counters arrays, set on the loader before a load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatsLayout {
    /// Entries per CPU of [`lb::SERVICE_STATS`] (one per frontend id).
    pub frontends: u32,
    /// Entries per CPU of [`lb::BACKEND_STATS`] (one per backend id).
    pub backends: u32,
    /// Possible CPUs: regions per array.
    pub cpus: u32,
}

impl StatsLayout {
    /// `frontends` and `backends` entries per CPU, unless arrays of this layout are
    /// pinned under `pin_dir` already: those keep the size they were created with.
    /// Without such arrays (a first start, or over per-CPU arrays of an earlier
    /// agent), a region has one entry per id of the pinned map that hands out the ids
    /// (`lb::SERVICES_V4`, `lb::BACKENDS`), which keeps its size, else of the sizes
    /// asked for.
    pub fn new(pin_dir: &Path, frontends: u32, backends: u32) -> Result<Self, EbpfError> {
        let cpus = possible_cpus()?;
        let per_cpu = |name: &str, ids: &str, wanted: u32| {
            match MapInfo::from_pin(pin_dir.join(name)) {
                Ok(info) if info.map_type().is_ok_and(|t| t == MapType::Array) => {
                    return info.max_entries() / cpus;
                }
                _ => {}
            }
            MapInfo::from_pin(pin_dir.join(ids)).map_or(wanted, |info| info.max_entries())
        };
        Ok(Self {
            frontends: per_cpu(lb::SERVICE_STATS, lb::SERVICES_V4, frontends),
            backends: per_cpu(lb::BACKEND_STATS, lb::BACKENDS, backends),
            cpus,
        })
    }

    /// Sizes the two arrays and sets the programs' globals on `loader`.
    pub fn configure<'a>(&'a self, loader: &mut EbpfLoader<'a>) {
        loader
            .map_max_entries(lb::SERVICE_STATS, self.frontends.saturating_mul(self.cpus))
            .map_max_entries(lb::BACKEND_STATS, self.backends.saturating_mul(self.cpus))
            .override_global(lb::SERVICE_STATS_PER_CPU, &self.frontends, true)
            .override_global(lb::BACKEND_STATS_PER_CPU, &self.backends, true);
    }
}

/// Entry `id`'s counters in `array` (a counters array of the layout above), summed
/// over CPUs; zero for an id outside a region.
pub fn read<T: Borrow<MapData>>(
    array: &Array<T, TrafficStats>,
    id: u32,
) -> Result<TrafficStats, MapError> {
    let cpus = cpus_for_read()?;
    let per_cpu = array.len() / cpus;
    if id >= per_cpu {
        return Ok(TrafficStats::default());
    }
    (0..cpus).try_fold(TrafficStats::default(), |sum, cpu| {
        Ok(sum.add(array.get(&lb::stats_slot(cpu, per_cpu, id), 0)?))
    })
}

/// The counters of entries `ids` of `array`, summed over CPUs, in the order of
/// `ids`: the whole array in a few `BPF_MAP_LOOKUP_BATCH` calls, one chunk in memory
/// at a time. A scrape reads every frontend and backend, and one lookup per id and
/// CPU would cost it a syscall each, with the sync's lock held.
/// Falls back to [`read`] per id on a kernel without batch lookups of arrays.
pub fn read_many<T: Borrow<MapData>>(
    array: &Array<T, TrafficStats>,
    ids: &[u32],
) -> Result<Vec<TrafficStats>, MapError> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let per_cpu = (array.len() / cpus_for_read()?).max(1) as usize;
    // Sums for the ids up to the largest asked for, one batch at a time.
    let wanted = ids
        .iter()
        .max()
        .map_or(0, |id| *id as usize + 1)
        .min(per_cpu);
    let mut sums = vec![TrafficStats::default(); wanted];
    let result = batch::lookup_each::<u32, TrafficStats>(
        array.map().fd().as_fd(),
        array.len(),
        |slots, values| {
            for (slot, value) in slots.iter().zip(values) {
                if let Some(sum) = sums.get_mut(*slot as usize % per_cpu) {
                    *sum = sum.add(*value);
                }
            }
        },
    );
    match result {
        Ok(()) => {}
        Err(e) if batch::unsupported(&e) => {
            return ids.iter().map(|id| read(array, *id)).collect();
        }
        Err(io_error) => {
            return Err(MapError::SyscallError(aya::sys::SyscallError {
                call: "bpf_map_lookup_batch",
                io_error,
            }));
        }
    }
    Ok(ids
        .iter()
        .map(|id| sums.get(*id as usize).copied().unwrap_or_default())
        .collect())
}

/// [`cpus`] as a map read's error.
fn cpus_for_read() -> Result<u32, MapError> {
    cpus().map_err(|io_error| {
        MapError::SyscallError(aya::sys::SyscallError {
            call: "reading /sys/devices/system/cpu/possible",
            io_error,
        })
    })
}

/// Whether the map pinned at `path` is a counters array of the per-CPU layout.
pub fn pinned_per_cpu(path: &Path) -> bool {
    MapInfo::from_pin(path)
        .and_then(|info| info.map_type())
        .is_ok_and(|t| t == MapType::PerCpuArray)
}

/// Writes every entry of `old`, a per-CPU counters array pinned by an earlier
/// agent, summed over CPUs, into CPU 0's region of `name` in `ebpf` (just created,
/// so empty; entries beyond its regions are dropped). Returns how many entries had
/// counts.
pub fn carry_over(old: MapData, ebpf: &mut Ebpf, name: &'static str) -> Result<usize, EbpfError> {
    let map_err = |e: MapError| EbpfError::CarryOver {
        name,
        reason: e.to_string(),
    };
    let old: PerCpuArray<MapData, TrafficStats> =
        PerCpuArray::try_from(Map::from_map_data(old).map_err(map_err)?).map_err(map_err)?;
    let mut new: Array<&mut MapData, TrafficStats> =
        Array::try_from(ebpf.map_mut(name).ok_or(EbpfError::MapNotFound { name })?)
            .map_err(map_err)?;
    let per_cpu = new.len() / possible_cpus()?;
    let mut carried = 0;
    for id in 0..old.len().min(per_cpu) {
        let sum = old
            .get(&id, 0)
            .map_err(map_err)?
            .iter()
            .fold(TrafficStats::default(), |sum, cpu| sum.add(*cpu));
        if sum != TrafficStats::default() {
            new.set(id, sum, 0).map_err(map_err)?;
            carried += 1;
        }
    }
    Ok(carried)
}

#[cfg(test)]
mod tests;
