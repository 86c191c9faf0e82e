//! The agent's eBPF object, embedded in the binary, and how it is loaded.
//!
//! `build.rs` compiles the `agent-ebpf` crate for the bpf target and this module
//! embeds the object ([`EMBEDDED_OBJECT`]), so one binary carries everything it loads.
//! [`load_embedded`] parses the object and creates its maps; the helpers below load,
//! attach and read the individual programs. Today that is one program,
//! `rune_xdp_pass`, which counts packets and bytes per CPU and passes every packet:
//! the seed that later load-balancing and policy programs grow from.
//!
//! Errors keep their cause: a program the verifier rejects yields
//! [`EbpfError::ProgramLoad`], whose source carries the full verifier log (also
//! reachable through [`EbpfError::verifier_log`]).

use agent_common::lb;
use agent_common::{PacketStats, XDP_PASS_PROGRAM, XDP_STATS_MAP};
use aya::{
    Ebpf, EbpfLoader,
    maps::PerCpuArray,
    programs::{ProgramError, Xdp, xdp::XdpLinkId},
};
use std::path::Path;

use super::{stats::StatsLayout, upgrade};

/// Re-exported where preflight has always found it.
pub use super::error::EbpfError;
pub use aya::programs::XdpMode;

/// The compiled eBPF object (ELF), 8-byte aligned as aya requires.
///
/// Empty when the agent was built with `AYA_BUILD_SKIP=1`; [`load_embedded`] then
/// returns [`EbpfError::NotEmbedded`].
pub static EMBEDDED_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/agent-ebpf"));

/// Whether this binary carries eBPF programs (false when built with `AYA_BUILD_SKIP=1`).
#[must_use]
pub fn programs_embedded() -> bool {
    !EMBEDDED_OBJECT.is_empty()
}

/// Parses the embedded object and creates its maps in the kernel, pinning the
/// load balancer's maps under `pin_dir` (re-opening them when already pinned there).
///
/// Programs are not loaded yet; use [`attach_xdp_pass`] (or aya directly) for that.
/// Needs `CAP_BPF` (root in practice).
pub fn load_embedded(pin_dir: &Path) -> Result<Ebpf, EbpfError> {
    if !programs_embedded() {
        return Err(EbpfError::NotEmbedded);
    }
    ensure_pin_dir(pin_dir)?;
    EbpfLoader::new()
        .default_map_pin_directory(pin_dir)
        .load(EMBEDDED_OBJECT)
        .map_err(|source| EbpfError::Object {
            size: EMBEDDED_OBJECT.len(),
            source: Box::new(source),
        })
}

/// Capacities of the load balancer's maps (runtime settings, fixed when a map is
/// first created and pinned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    /// Frontends (VIP × port × protocol), each with its own Maglev table.
    pub frontends: u32,
    /// Backends (address × port), shared by the services that list them.
    pub backends: u32,
    /// Slots per Maglev table (a prime).
    pub table_size: u32,
    /// Conntrack entries per family (as many reply entries), and socket-LB reverse
    /// entries.
    pub flows: u32,
    /// ClientIP affinity entries.
    pub affinity: u32,
}

/// bpffs's `f_type`.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Makes sure `pin_dir` can hold pins: mounts bpffs on `/sys/fs/bpf` when nothing is
/// mounted there, then creates the directory.
pub fn ensure_pin_dir(pin_dir: &Path) -> Result<(), EbpfError> {
    let pin_error = |reason: String| EbpfError::Pin {
        path: pin_dir.to_owned(),
        reason,
    };
    let bpffs = Path::new("/sys/fs/bpf");
    if pin_dir.starts_with(bpffs) && fs_type(bpffs) != Some(BPF_FS_MAGIC) {
        let mounted = std::ffi::CString::new("bpf").ok().and_then(|source| {
            let target = std::ffi::CString::new("/sys/fs/bpf").ok()?;
            // SAFETY: valid NUL-terminated strings; mount does not keep the pointers.
            let rc = unsafe {
                libc::mount(
                    source.as_ptr(),
                    target.as_ptr(),
                    source.as_ptr(),
                    0,
                    std::ptr::null(),
                )
            };
            (rc == 0).then_some(())
        });
        if mounted.is_none() {
            return Err(pin_error(format!(
                "mounting bpffs on /sys/fs/bpf failed: {}",
                std::io::Error::last_os_error()
            )));
        }
        tracing::info!("mounted bpffs on /sys/fs/bpf");
    }
    std::fs::create_dir_all(pin_dir).map_err(|e| pin_error(e.to_string()))?;
    if fs_type(pin_dir) != Some(BPF_FS_MAGIC) {
        return Err(pin_error("not on a bpf filesystem (bpffs)".into()));
    }
    Ok(())
}

pub(crate) fn fs_type(path: &Path) -> Option<i64> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs fills the zeroed struct; the path is NUL-terminated.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c.as_ptr(), &raw mut buf) };
    (rc == 0).then_some(buf.f_type)
}

/// Parses the embedded object and creates (or re-opens, when pinned by an earlier
/// agent) the load balancer's maps under `pin_dir`, sized by `sizes`.
///
/// Maps that are already pinned keep the size they were created with; the agent
/// reads the real capacities back (see `KernelMaps::new`).
pub fn load_lb(pin_dir: &Path, sizes: &MapSizes) -> Result<Ebpf, EbpfError> {
    if !programs_embedded() {
        return Err(EbpfError::NotEmbedded);
    }
    ensure_pin_dir(pin_dir)?;
    upgrade::check_pinned_layouts(pin_dir)?;
    note_per_cpu_lru_conntrack(pin_dir);
    unpin_vip_filter(pin_dir)?;
    let legacy = upgrade::Legacy::unpin(pin_dir)?;
    let layout = match StatsLayout::new(pin_dir, sizes.frontends, sizes.backends) {
        Ok(layout) => layout,
        Err(e) => {
            legacy.restore();
            return Err(e);
        }
    };
    let slots = sizes.frontends.saturating_mul(sizes.table_size);
    let mut loader = EbpfLoader::new();
    layout.configure(&mut loader);
    loader
        .default_map_pin_directory(pin_dir)
        .map_max_entries(lb::SERVICES_V4, sizes.frontends)
        .map_max_entries(lb::SERVICES_V6, sizes.frontends)
        .map_max_entries(lb::MAGLEV, slots.div_ceil(lb::MAGLEV_SLOTS_PER_ENTRY))
        .map_max_entries(lb::BACKENDS, sizes.backends)
        .map_max_entries(lb::CONNTRACK_V4, sizes.flows)
        .map_max_entries(lb::CONNTRACK_V6, sizes.flows)
        .map_max_entries(lb::CONNTRACK_REPLY_V4, sizes.flows)
        .map_max_entries(lb::CONNTRACK_REPLY_V6, sizes.flows)
        .map_max_entries(lb::SOCK_REVERSE, sizes.flows)
        .map_max_entries(lb::AFFINITY, sizes.affinity);
    let mut ebpf = match loader.load(EMBEDDED_OBJECT) {
        Ok(ebpf) => ebpf,
        Err(source) => {
            legacy.restore();
            return Err(EbpfError::Object {
                size: EMBEDDED_OBJECT.len(),
                source: Box::new(source),
            });
        }
    };
    legacy.carry_over(&mut ebpf);
    Ok(ebpf)
}

/// Which of the maps a sync adopts from were pinned under `pin_dir` before a load:
/// the others are created empty by it, and reading them back would find nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedBefore {
    /// The IPv4 or IPv6 services map.
    pub frontends: bool,
    /// The backends array.
    pub backends: bool,
}

impl PinnedBefore {
    /// Looks under `pin_dir` (call it before [`load_lb`], which pins what it creates).
    #[must_use]
    pub fn probe(pin_dir: &Path) -> Self {
        let pinned = |name: &str| pin_dir.join(name).exists();
        Self {
            frontends: pinned(lb::SERVICES_V4) || pinned(lb::SERVICES_V6),
            backends: pinned(lb::BACKENDS),
        }
    }
}

/// Removes the VIP prefilter's pin, so this load creates the map afresh: all zeros,
/// which filters nothing (`agent_common::filter`), until the first sync writes
/// every word. A pinned filter may not match the pinned frontends (an older agent
/// added services without it, or this one died between a frontend write and the
/// filter's), and the new programs run before the first sync, which waits for the
/// store: a stale set bit there would stop translating an established flow. The
/// programs still attached keep the old map until they are replaced.
fn unpin_vip_filter(pin_dir: &Path) -> Result<(), EbpfError> {
    let path = pin_dir.join(lb::VIP_FILTER);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(EbpfError::Pin {
            path,
            reason: e.to_string(),
        }),
        _ => Ok(()),
    }
}

/// `BPF_F_NO_COMMON_LRU` (uapi/linux/bpf.h).
const BPF_F_NO_COMMON_LRU: u32 = 1 << 1;

/// Logs a pinned conntrack with per-CPU LRU lists (agents before 2026-12-01
/// evening created them so). It is reused as it is, so that no flow is lost; only a
/// new map, after `rune-agent cleanup`, gets the common LRU.
fn note_per_cpu_lru_conntrack(pin_dir: &Path) {
    for name in [lb::CONNTRACK_V4, lb::CONNTRACK_V6] {
        let path = pin_dir.join(name);
        if !path.exists() {
            continue;
        }
        if let Ok(info) = aya::maps::MapInfo::from_pin(&path)
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

/// Loads `rune_xdp_pass` (once) and attaches it to `interface` in `mode`.
///
/// The interface name is resolved in the calling thread's network namespace. The
/// attachment lives as long as `ebpf` (dropping it detaches), or until detached
/// through the returned id.
///
/// # Minimum kernel version
///
/// 5.9 for link-based attachment (aya falls back to netlink on older kernels);
/// native XDP on veth needs 4.19.
#[doc(alias = "BPF_PROG_TYPE_XDP")]
pub fn attach_xdp_pass(
    ebpf: &mut Ebpf,
    interface: &str,
    mode: XdpMode,
) -> Result<XdpLinkId, EbpfError> {
    let name = XDP_PASS_PROGRAM;
    let program: &mut Xdp = ebpf
        .program_mut(name)
        .ok_or(EbpfError::ProgramNotFound { name })?
        .try_into()
        .map_err(|source| EbpfError::ProgramType {
            name,
            source: Box::new(source),
        })?;
    match program.load() {
        Ok(()) | Err(ProgramError::AlreadyLoaded) => {}
        Err(source) => {
            return Err(EbpfError::ProgramLoad {
                name,
                source: Box::new(source),
            });
        }
    }
    program
        .attach(interface, mode)
        .map_err(|source| EbpfError::Attach {
            name,
            interface: interface.to_owned(),
            mode,
            source: Box::new(source),
        })
}

/// Reads `rune_xdp_pass`'s counters, summed over all CPUs.
#[doc(alias = "BPF_MAP_TYPE_PERCPU_ARRAY")]
pub fn xdp_pass_stats(ebpf: &Ebpf) -> Result<PacketStats, EbpfError> {
    let name = XDP_STATS_MAP;
    let map = ebpf.map(name).ok_or(EbpfError::MapNotFound { name })?;
    let array: PerCpuArray<_, PacketStats> =
        PerCpuArray::try_from(map).map_err(|source| EbpfError::Map { name, source })?;
    let per_cpu = array
        .get(&0, 0)
        .map_err(|source| EbpfError::Map { name, source })?;
    Ok(per_cpu
        .iter()
        .fold(PacketStats::default(), |sum, cpu| sum.add(*cpu)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_object_matches_build_mode() {
        // Either a real ELF object or, with AYA_BUILD_SKIP=1, nothing at all.
        if programs_embedded() {
            assert_eq!(&EMBEDDED_OBJECT[..4], b"\x7fELF");
        } else {
            assert!(matches!(
                load_embedded(Path::new("/nonexistent")),
                Err(EbpfError::NotEmbedded)
            ));
        }
    }
}
