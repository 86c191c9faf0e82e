//! Maps pinned by an agent of an earlier layout: recognised before a load, unpinned
//! so that the load creates this agent's layout, and their entries carried over
//! afterwards, so that an upgrade keeps established flows and counts.
//!
//! What is carried over:
//! * conntrack with 8-byte values (backend, frontend) or 16-byte ones (and the
//!   SYN-ACK expected, the UDP time): copied, each flow keeping the client's own
//!   port towards its backend;
//! * conntrack without reply entries (agents before them, whose egress found a
//!   reply's VIP through a per-backend list of frontends): every forward entry gets
//!   its reply entry, made from the backend it names, so that replies of flows
//!   established before the upgrade stay translated;
//! * per-CPU counters arrays (see [`stats`]): their counts summed into the new
//!   arrays;
//! * a drop counters array with fewer reasons than this agent counts.
//!
//! The reverse-NAT index of those earlier agents is unpinned: nothing reads it. A
//! conntrack with per-CPU LRU lists is kept as it is, and only logged.
//! Any other pinned map whose key or value size differs from this agent's stops
//! the load with [`EbpfError::PinnedLayout`], which says how to start afresh.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use agent_common::lb::{self, Backend, CtKeyV4, CtKeyV6, CtReplyV4, CtReplyV6, CtValue};
use aya::{
    Ebpf, Pod,
    maps::{Array, HashMap, Map, MapData, MapError, MapInfo, PerCpuArray},
};

use crate::dataplane::ebpf::{error::EbpfError, stats};

/// The reverse-NAT index of agents before reply entries (`RUNE_REVNAT`).
const OLD_REVNAT: &str = "RUNE_REVNAT";

/// The conntrack value of agents before conntrack entries had a lifetime.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct CtValueV1 {
    backend_id: u32,
    service_id: u32,
}

/// The conntrack value of agents before reply entries (no client port of its own).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct CtValueV2 {
    backend_id: u32,
    service_id: u32,
    syn_ack: u32,
    last_seen: u32,
}

// SAFETY (both): `#[repr(C)]`, `u32`s only, no padding, every bit pattern valid.
unsafe impl Pod for CtValueV1 {}
unsafe impl Pod for CtValueV2 {}

/// An earlier layout of one map, and how its entries come over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Old {
    /// Conntrack with [`CtValueV1`] values.
    ConntrackV1,
    /// Conntrack with [`CtValueV2`] values.
    ConntrackV2,
    /// A per-CPU counters array.
    PerCpuCounters,
    /// A drop counters array with fewer reasons.
    FewerDrops,
}

/// The (key, value) sizes of the map pinned at `path`, if one is (anything else
/// wrong with the pin is the loader's to report).
fn pinned_sizes(path: &Path) -> Option<(u32, u32)> {
    if !path.exists() {
        return None;
    }
    let info = MapInfo::from_pin(path).ok()?;
    Some((info.key_size(), info.value_size()))
}

fn size<T>() -> u32 {
    size_of::<T>() as u32
}

/// The earlier layout of the map `name` pinned at `path`, if it has one this agent
/// carries over.
fn old_layout(name: &str, path: &Path) -> Option<Old> {
    match name {
        lb::CONNTRACK_V4 | lb::CONNTRACK_V6 => match pinned_sizes(path)?.1 {
            v if v == size::<CtValueV1>() => Some(Old::ConntrackV1),
            v if v == size::<CtValueV2>() => Some(Old::ConntrackV2),
            _ => None,
        },
        lb::SERVICE_STATS | lb::BACKEND_STATS => {
            stats::pinned_per_cpu(path).then_some(Old::PerCpuCounters)
        }
        lb::DROPS => MapInfo::from_pin(path)
            .is_ok_and(|info| info.max_entries() < lb::DROP_REASONS)
            .then_some(Old::FewerDrops),
        _ => None,
    }
}

/// The maps whose layout changed between releases: name and this agent's (key,
/// value) sizes.
fn layouts() -> [(&'static str, (u32, u32)); 4] {
    [
        (lb::CONNTRACK_V4, (size::<CtKeyV4>(), size::<CtValue>())),
        (lb::CONNTRACK_V6, (size::<CtKeyV6>(), size::<CtValue>())),
        (
            lb::CONNTRACK_REPLY_V4,
            (size::<CtKeyV4>(), size::<CtReplyV4>()),
        ),
        (
            lb::CONNTRACK_REPLY_V6,
            (size::<CtKeyV6>(), size::<CtReplyV6>()),
        ),
    ]
}

/// Fails with [`EbpfError::PinnedLayout`] when a pinned map whose layout changed
/// between releases has other key or value sizes than this agent's and is not one
/// it carries over, instead of a verifier error at load.
pub(super) fn check_pinned_layouts(pin_dir: &Path) -> Result<(), EbpfError> {
    for (name, want) in layouts() {
        let path = pin_dir.join(name);
        let Some(found) = pinned_sizes(&path) else {
            continue;
        };
        if found != want && old_layout(name, &path).is_none() {
            return Err(EbpfError::PinnedLayout {
                name,
                dir: pin_dir.display().to_string(),
                found,
                want,
            });
        }
    }
    Ok(())
}

/// Maps pinned by an agent of an earlier layout, held open across the load: their
/// pins are removed first, so the loader creates maps of this agent's layout, and
/// their entries are copied into those afterwards. Established flows keep their
/// backends (the old programs keep using the old maps until the new ones are
/// attached; flows that start in that short window are not carried over).
pub(in crate::dataplane::ebpf) struct Legacy {
    /// (map name, pin path, its layout, the open map).
    maps: Vec<(&'static str, PathBuf, Old, MapData)>,
    /// Conntrack was pinned without reply entries: they are made after the load.
    replies_missing: bool,
}

impl Legacy {
    /// Opens and unpins the maps of an earlier layout under `pin_dir` (those
    /// already unpinned are pinned back should a later one fail), and unpins the
    /// reverse-NAT index nothing reads any more.
    pub(super) fn unpin(pin_dir: &Path) -> Result<Self, EbpfError> {
        let pinned = |name: &str| pin_dir.join(name).exists();
        let mut legacy = Self {
            maps: Vec::new(),
            replies_missing: (pinned(lb::CONNTRACK_V4) || pinned(lb::CONNTRACK_V6))
                && !pinned(lb::CONNTRACK_REPLY_V4)
                && !pinned(lb::CONNTRACK_REPLY_V6),
        };
        for name in [
            lb::CONNTRACK_V4,
            lb::CONNTRACK_V6,
            lb::SERVICE_STATS,
            lb::BACKEND_STATS,
            lb::DROPS,
        ] {
            let path = pin_dir.join(name);
            if !path.exists() {
                continue;
            }
            let Some(old) = old_layout(name, &path) else {
                continue;
            };
            let pin_error = |e: String| EbpfError::Pin {
                path: path.clone(),
                reason: e,
            };
            let map = match MapData::from_pin(&path).map_err(|e| pin_error(e.to_string())) {
                Ok(map) => map,
                Err(e) => {
                    legacy.restore();
                    return Err(e);
                }
            };
            if let Err(e) = std::fs::remove_file(&path) {
                legacy.restore();
                return Err(pin_error(e.to_string()));
            }
            legacy.maps.push((name, path, old, map));
        }
        let revnat = pin_dir.join(OLD_REVNAT);
        if let Err(e) = std::fs::remove_file(&revnat)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            legacy.restore();
            return Err(EbpfError::Pin {
                path: revnat,
                reason: e.to_string(),
            });
        }
        Ok(legacy)
    }

    /// Pins the old maps back after a failed load, so the next start still finds
    /// the flows (the old programs keep using them meanwhile); a pin the failed
    /// load left at the same path is replaced. Failures are logged: the load's
    /// error is the one to report.
    pub(in crate::dataplane::ebpf) fn restore(self) {
        for (_, path, _, map) in self.maps {
            if path.exists() {
                let _ = std::fs::remove_file(&path);
            }
            if let Err(e) = map.pin(&path) {
                tracing::warn!(path = %path.display(), error = %e, "pinning a map of the previous layout back failed: its flows or counts are lost at the next start");
            }
        }
    }

    /// Copies the old entries into `ebpf`'s maps, then makes the reply entries of
    /// conntrack that had none. A copy that fails is logged, not fatal: the flows
    /// it misses are re-picked (same backend while its Maglev slot is unchanged),
    /// counts restart.
    pub(in crate::dataplane::ebpf) fn carry_over(self, ebpf: &mut Ebpf) {
        let now = lb::ct_now(monotonic_ns());
        for (name, _, old, map) in self.maps {
            let copied = match (old, name) {
                (Old::ConntrackV1 | Old::ConntrackV2, lb::CONNTRACK_V4) => {
                    copy_conntrack::<CtKeyV4>(map, old, ebpf, name, now, |k| k.sport)
                }
                (Old::ConntrackV1 | Old::ConntrackV2, _) => {
                    copy_conntrack::<CtKeyV6>(map, old, ebpf, name, now, |k| k.sport)
                }
                (Old::PerCpuCounters, _) => stats::carry_over(map, ebpf, name).map(|carried| {
                    tracing::info!(
                        map = name,
                        carried,
                        "counters pinned by an earlier agent were a per-CPU array: \
                         recreated as one array with a region per CPU, counts carried over"
                    );
                }),
                (Old::FewerDrops, _) => copy_drops(map, ebpf),
            };
            if let Err(e) = copied {
                tracing::warn!(map = name, error = %e, "map of the previous layout not carried over");
            }
        }
        if self.replies_missing {
            let made = make_replies(ebpf);
            match made {
                Ok(made) => tracing::info!(
                    made,
                    "conntrack pinned by an earlier agent had no reply entries: made one per flow"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "reply entries of the pinned conntrack not made: replies of flows established before this start are not translated")
                }
            }
        }
    }
}

/// Copies one conntrack map of an earlier layout into `name` of `ebpf`: flows
/// keep their backend and the client's own port (`sport` of the key); 8-byte
/// entries become flows picked up mid-stream (no SYN-ACK expected), UDP ones seen
/// now.
fn copy_conntrack<K: Pod>(
    old: MapData,
    layout: Old,
    ebpf: &mut Ebpf,
    name: &'static str,
    now: u32,
    sport: fn(&K) -> u16,
) -> Result<(), EbpfError> {
    let map_err = |e: MapError| EbpfError::CarryOver {
        name,
        reason: e.to_string(),
    };
    let old = Map::from_map_data(old).map_err(map_err)?;
    let entries: Vec<(K, CtValue)> = if layout == Old::ConntrackV1 {
        let old: HashMap<MapData, K, CtValueV1> = HashMap::try_from(old).map_err(map_err)?;
        old.iter()
            .filter_map(Result::ok)
            .map(|(key, v)| {
                // `last_seen` is what UDP needs; a TCP flow's first packet resets it
                // to 0 (one write, as for any entry whose time changes).
                let value = CtValue {
                    backend_id: v.backend_id,
                    service_id: v.service_id,
                    syn_ack: 0,
                    last_seen: now,
                    nat_port: sport(&key),
                    pad: 0,
                };
                (key, value)
            })
            .collect()
    } else {
        let old: HashMap<MapData, K, CtValueV2> = HashMap::try_from(old).map_err(map_err)?;
        old.iter()
            .filter_map(Result::ok)
            .map(|(key, v)| {
                let value = CtValue {
                    backend_id: v.backend_id,
                    service_id: v.service_id,
                    syn_ack: v.syn_ack,
                    last_seen: v.last_seen,
                    nat_port: sport(&key),
                    pad: 0,
                };
                (key, value)
            })
            .collect()
    };
    let mut new: HashMap<&mut MapData, K, CtValue> =
        HashMap::try_from(ebpf.map_mut(name).ok_or(EbpfError::MapNotFound { name })?)
            .map_err(map_err)?;
    let (mut copied, mut failed) = (0usize, 0usize);
    for (key, value) in entries {
        match new.insert(key, value, 0) {
            Ok(()) => copied += 1,
            Err(_) => failed += 1,
        }
    }
    tracing::warn!(
        map = name,
        copied,
        failed,
        "conntrack pinned by an earlier agent had an earlier layout: recreated with \
         this agent's and its flows copied over"
    );
    Ok(())
}

/// Copies the drop counts of an array with fewer reasons into the new one.
fn copy_drops(old: MapData, ebpf: &mut Ebpf) -> Result<(), EbpfError> {
    let name = lb::DROPS;
    let map_err = |e: MapError| EbpfError::CarryOver {
        name,
        reason: e.to_string(),
    };
    let old: PerCpuArray<MapData, u64> =
        PerCpuArray::try_from(Map::from_map_data(old).map_err(map_err)?).map_err(map_err)?;
    let mut new: PerCpuArray<&mut MapData, u64> =
        PerCpuArray::try_from(ebpf.map_mut(name).ok_or(EbpfError::MapNotFound { name })?)
            .map_err(map_err)?;
    for reason in 0..old.len().min(new.len()) {
        let counts = old.get(&reason, 0).map_err(map_err)?;
        new.set(reason, counts, 0).map_err(map_err)?;
    }
    Ok(())
}

/// Makes the reply entry of every flow in `ebpf`'s conntrack (both families) from
/// the backend it names. Returns how many were made.
fn make_replies(ebpf: &mut Ebpf) -> Result<usize, EbpfError> {
    let v4 = make_family_replies(
        ebpf,
        lb::CONNTRACK_V4,
        lb::CONNTRACK_REPLY_V4,
        |k: &CtKeyV4, v, b| {
            let rkey = CtKeyV4 {
                saddr: b.addr[0],
                daddr: k.saddr,
                sport: b.port,
                dport: v.nat_port,
                proto: k.proto,
                pad: [0; 3],
            };
            let reply = CtReplyV4 {
                vip: k.daddr,
                vport: k.dport,
                cport: k.sport,
                backend_id: v.backend_id,
            };
            (b.family == lb::FAMILY_V4).then_some((rkey, reply))
        },
    )?;
    let v6 = make_family_replies(
        ebpf,
        lb::CONNTRACK_V6,
        lb::CONNTRACK_REPLY_V6,
        |k: &CtKeyV6, v, b| {
            let rkey = CtKeyV6 {
                saddr: b.addr,
                daddr: k.saddr,
                sport: b.port,
                dport: v.nat_port,
                proto: k.proto,
                pad: [0; 3],
            };
            let reply = CtReplyV6 {
                vip: k.daddr,
                vport: k.dport,
                cport: k.sport,
                backend_id: v.backend_id,
            };
            (b.family == lb::FAMILY_V6).then_some((rkey, reply))
        },
    )?;
    Ok(v4 + v6)
}

/// [`make_replies`] for one family: `reply` gives a flow's reply key and value
/// from its forward key and value and its backend (`None` for a backend of the
/// other family).
fn make_family_replies<K: Pod, R: Pod>(
    ebpf: &mut Ebpf,
    forward: &'static str,
    replies: &'static str,
    reply: impl Fn(&K, &CtValue, &Backend) -> Option<(K, R)>,
) -> Result<usize, EbpfError> {
    let map_err = |name: &'static str| {
        move |e: MapError| EbpfError::CarryOver {
            name,
            reason: e.to_string(),
        }
    };
    let flows: Vec<(K, CtValue)> = {
        let ct: HashMap<&MapData, K, CtValue> = HashMap::try_from(
            ebpf.map(forward)
                .ok_or(EbpfError::MapNotFound { name: forward })?,
        )
        .map_err(map_err(forward))?;
        ct.iter().filter_map(Result::ok).collect()
    };
    if flows.is_empty() {
        return Ok(0);
    }
    let mut backends = BTreeMap::new();
    {
        let array: Array<&MapData, Backend> = Array::try_from(
            ebpf.map(lb::BACKENDS)
                .ok_or(EbpfError::MapNotFound { name: lb::BACKENDS })?,
        )
        .map_err(map_err(lb::BACKENDS))?;
        for (_, value) in &flows {
            if let std::collections::btree_map::Entry::Vacant(slot) =
                backends.entry(value.backend_id)
                && let Ok(backend) = array.get(&value.backend_id, 0)
            {
                slot.insert(backend);
            }
        }
    }
    let mut map: HashMap<&mut MapData, K, R> = HashMap::try_from(
        ebpf.map_mut(replies)
            .ok_or(EbpfError::MapNotFound { name: replies })?,
    )
    .map_err(map_err(replies))?;
    let mut made = 0;
    for (key, value) in &flows {
        let Some((rkey, rvalue)) = backends
            .get(&value.backend_id)
            .and_then(|backend| reply(key, value, backend))
        else {
            continue;
        };
        if map.insert(rkey, rvalue, 0).is_ok() {
            made += 1;
        }
    }
    Ok(made)
}

/// `BPF_F_NO_COMMON_LRU` (uapi/linux/bpf.h).
const BPF_F_NO_COMMON_LRU: u32 = 1 << 1;

/// Logs a pinned conntrack with per-CPU LRU lists (earlier agents created them so).
/// It is reused as it is, so that no flow is lost; only a new map, after
/// `rune-agent cleanup`, gets the common LRU.
pub(super) fn note_per_cpu_lru_conntrack(pin_dir: &Path) {
    for name in [lb::CONNTRACK_V4, lb::CONNTRACK_V6] {
        let path = pin_dir.join(name);
        if !path.exists() {
            continue;
        }
        if let Ok(info) = MapInfo::from_pin(&path)
            && info.map_flags() & BPF_F_NO_COMMON_LRU != 0
        {
            tracing::info!(
                map = name,
                "the pinned conntrack keeps its per-CPU LRU lists (an earlier agent's layout; \
                 its flows are kept); `rune-agent cleanup` and a restart give it one common LRU"
            );
        }
    }
}

/// CLOCK_MONOTONIC in ns: the clock of `bpf_ktime_get_ns()`.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
