//! The agent's eBPF object, embedded in the binary, and its loading: the load
//! balancer's maps sized and pinned ([`load_lb`]), or the object as it is
//! ([`load_embedded`]). Programs only tests and benches load are in a second object
//! (`agent-ebpf-test`), never embedded here.
//!
//! `build.rs` compiles the `agent-ebpf` crate for the bpf target and this module
//! embeds the object ([`EMBEDDED_OBJECT`]), so one binary carries everything it loads.
//! [`attach`](super::attach) loads and attaches the load balancer's programs.
//!
//! Errors keep their cause: a program the verifier rejects yields
//! [`EbpfError::ProgramLoad`], whose source carries the full verifier log (also
//! reachable through [`EbpfError::verifier_log`]).

use agent_common::{lb, policy};
use aya::{Ebpf, EbpfLoader};
use std::path::Path;

use super::{error::EbpfError, pins, stats::StatsLayout};

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
/// Programs are not loaded yet (aya's `program_mut(..).load()` does that).
/// Needs `CAP_BPF` (root in practice).
pub fn load_embedded(pin_dir: &Path) -> Result<Ebpf, EbpfError> {
    if !programs_embedded() {
        return Err(EbpfError::NotEmbedded);
    }
    pins::ensure_pin_dir(pin_dir)?;
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
    /// Peer prefixes per family and port entries of the network policy maps
    /// (`--policy-max-entries`); the guarded-address map holds `backends` entries
    /// and the policy conntrack `flows`.
    pub policy_entries: u32,
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
    let legacy = pins::prepare_load(pin_dir)?;
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
        .map_max_entries(lb::AFFINITY, sizes.affinity)
        .map_max_entries(policy::ENDPOINTS, sizes.backends)
        .map_max_entries(policy::PEERS_V4, sizes.policy_entries)
        .map_max_entries(policy::PEERS_V6, sizes.policy_entries)
        .map_max_entries(policy::PORTS, sizes.policy_entries)
        .map_max_entries(policy::POLICY_CONNTRACK_V4, sizes.flows)
        .map_max_entries(policy::POLICY_CONNTRACK_V6, sizes.flows);
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

#[cfg(test)]
mod tests;
