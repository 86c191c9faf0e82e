//! The eBPF data plane: service VIPs balanced in the kernel.
//!
//! Programs from `agent-ebpf` do the per-packet work: cgroup socket hooks rewrite a
//! local client's `connect`/`sendmsg` to a VIP into the chosen backend, tc and XDP
//! translate traffic crossing the node (DNAT with conntrack, reverse NAT on the way
//! back). This module loads and attaches them ([`loader`], [`attach`]), keeps their
//! maps equal to the endpoint cache ([`sync`] over [`maps`], entries encoded by
//! `agent_common::codec`) and exports their counters (`collector`). Maps and links
//! are pinned under the pin directory ([`pins`]), so an agent restart or upgrade
//! changes nothing for established flows; `rune-agent cleanup` removes them.

pub mod attach;
mod backend_table;
pub mod batch;
pub mod codec;
mod collector;
mod error;
pub mod loader;
pub mod maps;
pub mod pins;
pub mod policy;
pub mod prefilter;
pub mod stats;
pub mod sync;
mod usage;

#[cfg(test)]
mod tests;

pub use attach::{Attachment, Hooks};
pub use collector::LbCollector;
pub use error::{EbpfError, MapsError};
pub use loader::{EMBEDDED_OBJECT, MapSizes, XdpMode, load_embedded, load_lb, programs_embedded};

use super::{DataPlane, DataPlaneError, ServicePortStatus, TrafficCounters};
use crate::{endpoints::Delta, lock::lock, maglev};
use agent_common::{codec::frontend_key, lb};
use async_trait::async_trait;
use maps::{KernelMaps, LbMaps};
use policy::{KernelPolicyMaps, PolicyEngine};
use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use sync::LbSync;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// Where pins live unless configured otherwise.
pub const DEFAULT_PIN_DIR: &str = crate::config::DEFAULT_BPF_PIN_DIR;

/// How often draining backends are checked for the end of their drain.
const DRAIN_CHECK: Duration = Duration::from_secs(1);

/// Settings of the eBPF data plane.
#[derive(Clone, Debug)]
pub struct EbpfConfig {
    /// bpffs directory for map and link pins.
    pub pin_dir: PathBuf,
    /// Where the programs are attached.
    pub hooks: Hooks,
    /// Map capacities.
    pub sizes: MapSizes,
    /// This node's name, for locality preference.
    pub node_name: String,
}

impl Default for EbpfConfig {
    fn default() -> Self {
        Self {
            pin_dir: PathBuf::from(DEFAULT_PIN_DIR),
            hooks: Hooks::default(),
            sizes: MapSizes {
                frontends: 512,
                backends: 65_536,
                table_size: maglev::DEFAULT_TABLE_SIZE,
                flows: 262_144,
                affinity: 65_536,
                policy_entries: crate::config::DEFAULT_POLICY_MAX_ENTRIES,
            },
            node_name: String::new(),
        }
    }
}

/// The policy engine over the kernel's policy maps, shared with the collector.
pub type SharedPolicy = Arc<Mutex<PolicyEngine<KernelPolicyMaps>>>;

/// The eBPF data plane (over the kernel's maps, or a fake in tests).
pub struct EbpfDataPlane<M: LbMaps + 'static = KernelMaps> {
    sync: Arc<Mutex<LbSync<M>>>,
    /// The network policy maps' engine (`None` over fake maps).
    policy: Option<SharedPolicy>,
    attachments: Vec<Attachment>,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

impl EbpfDataPlane<KernelMaps> {
    /// Loads the programs, creates or re-opens the pinned maps, attaches the programs
    /// where `config.hooks` says, and starts the drain timer. Needs root (CAP_BPF,
    /// CAP_NET_ADMIN, CAP_SYS_ADMIN for cgroups) and a tokio runtime.
    pub fn new(config: &EbpfConfig) -> Result<Self, DataPlaneError> {
        if !maglev::is_prime(config.sizes.table_size)
            || config.sizes.table_size > maglev::MAX_TABLE_SIZE
        {
            return Err(DataPlaneError::InvalidConfig {
                field: "maglevTableSize",
                reason: format!(
                    "{} is not a prime up to {}",
                    config.sizes.table_size,
                    maglev::MAX_TABLE_SIZE
                ),
            });
        }
        check_hook_targets(&config.hooks)?;
        // A start that fails leaves nothing it created: a pin directory that was
        // not there before goes again (one that was belongs to an earlier agent,
        // whose programs keep running on it).
        let created = !config.pin_dir.exists();
        let pinned = pins::PinnedBefore::probe(&config.pin_dir);
        let loaded = load_lb(&config.pin_dir, &config.sizes).and_then(|mut ebpf| {
            let attachments = attach::attach_all(&mut ebpf, &config.pin_dir, &config.hooks)?;
            Ok((ebpf, attachments))
        });
        let (mut ebpf, attachments) = match loaded {
            Ok(loaded) => loaded,
            Err(e) => {
                if created && let Err(removal) = pins::remove_pins(&config.pin_dir) {
                    tracing::warn!(error = %removal, "removing the pins of the failed start failed");
                }
                return Err(e.into());
            }
        };
        let mut taken = std::collections::BTreeMap::new();
        for name in [
            lb::SERVICES_V4,
            lb::SERVICES_V6,
            lb::BACKENDS,
            lb::MAGLEV,
            lb::CONNTRACK_V4,
            lb::CONNTRACK_V6,
            lb::CONNTRACK_REPLY_V4,
            lb::CONNTRACK_REPLY_V6,
            lb::AFFINITY,
            lb::SERVICE_STATS,
            lb::BACKEND_STATS,
            lb::DROPS,
            lb::VIP_FILTER,
        ] {
            if let Some(map) = ebpf.take_map(name) {
                taken.insert(name.to_owned(), map);
            }
        }
        for name in policy::POLICY_MAPS {
            if let Some(map) = ebpf.take_map(name) {
                taken.insert(name.to_owned(), map);
            }
        }
        let policy_maps = KernelPolicyMaps::new(&mut taken).map_err(EbpfError::from)?;
        let events = ebpf
            .take_map(agent_common::policy::EVENTS)
            .and_then(|map| aya::maps::RingBuf::try_from(map).ok());
        let maps = KernelMaps::new(&mut taken)
            .map_err(EbpfError::from)?
            .pinned_before(pinned);
        let capacity = maps.capacity();
        if capacity.table_size != config.sizes.table_size
            || capacity.frontends != config.sizes.frontends
        {
            tracing::warn!(
                pinned_frontends = capacity.frontends,
                pinned_table_size = capacity.table_size,
                configured_frontends = config.sizes.frontends,
                configured_table_size = config.sizes.table_size,
                "pinned maps from an earlier agent have other sizes; using them (run `rune-agent cleanup` while stopped to apply the configured sizes)"
            );
        }
        for a in &attachments {
            tracing::info!(program = a.program, hook = a.hook, target = %a.target, "eBPF program attached");
        }
        let plane = Self::with_maps(maps, &config.node_name);
        let policy = Arc::new(Mutex::new(PolicyEngine::new(
            &config.node_name,
            policy_maps,
            !config.hooks.policy.is_empty(),
        )));
        if let Some(ring) = events {
            plane.tasks.spawn(policy::events::read(
                ring,
                policy.clone(),
                plane.cancel.clone(),
            ));
        }
        Ok(Self {
            attachments,
            policy: Some(policy),
            ..plane
        })
    }
}

impl<M: LbMaps + 'static> EbpfDataPlane<M> {
    /// A data plane over `maps` with nothing attached (for tests with fake maps; the
    /// kernel constructor builds on it). Starts the drain timer when a tokio runtime
    /// is running.
    pub fn with_maps(maps: M, node_name: &str) -> Self {
        let plane = Self {
            sync: Arc::new(Mutex::new(LbSync::new(maps, node_name))),
            policy: None,
            attachments: Vec::new(),
            cancel: CancellationToken::new(),
            tasks: TaskTracker::new(),
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            let sync = plane.sync.clone();
            let cancel = plane.cancel.clone();
            plane.tasks.spawn(async move {
                let mut tick = tokio::time::interval(DRAIN_CHECK);
                loop {
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        _ = tick.tick() => {}
                    }
                    if let Err(e) = lock(&sync).expire(Instant::now()) {
                        tracing::error!(error = %e, "ending backend drains failed; the next sync retries");
                    }
                }
            });
        }
        plane
    }

    /// What is attached where.
    pub fn attachments(&self) -> &[Attachment] {
        &self.attachments
    }

    /// A Prometheus collector reading the programs' counters at scrape time.
    pub fn collector(&self) -> LbCollector<M> {
        LbCollector {
            sync: self.sync.clone(),
            policy: self.policy.clone(),
        }
    }

    /// Runs `f` on the sync engine (tests inspect the maps through it).
    pub fn with_sync<T>(&self, f: impl FnOnce(&LbSync<M>) -> T) -> T {
        f(&lock(&self.sync))
    }
}

#[async_trait]
impl<M: LbMaps + 'static> DataPlane for EbpfDataPlane<M> {
    fn mode(&self) -> &'static str {
        "ebpf"
    }

    async fn apply(&self, delta: &Delta) -> Result<(), DataPlaneError> {
        if self.cancel.is_cancelled() {
            return Err(DataPlaneError::ShutDown { mode: "ebpf" });
        }
        let started = Instant::now();
        // Policy first: a new endpoint is guarded before a VIP leads to it.
        if let Some(policy) = &self.policy {
            lock(policy)
                .apply(delta)
                .map_err(|e| DataPlaneError::Apply {
                    mode: "ebpf",
                    reason: e.to_string(),
                })?;
        }
        lock(&self.sync)
            .apply(delta, started)
            .map_err(|e| DataPlaneError::Apply {
                mode: "ebpf",
                reason: e.to_string(),
            })?;
        tracing::debug!(
            elapsed_us = started.elapsed().as_micros() as u64,
            "eBPF maps updated"
        );
        Ok(())
    }

    fn status(&self) -> Vec<ServicePortStatus> {
        let sync = lock(&self.sync);
        let mut ports = sync.status();
        // The ids first, then one batch read per counters array.
        let frontend_ids: Vec<Option<u32>> = ports
            .iter()
            .map(|port| {
                let listen = port.listen?;
                let proto = codec::proto_number(port.protocol);
                sync.frontend_id(&frontend_key(listen.ip(), port.port, proto))
            })
            .collect();
        let backend_ids: Vec<Option<u32>> = ports
            .iter()
            .filter(|port| port.listen.is_some())
            .flat_map(|port| &port.backends)
            .map(|b| sync.backend_id(&std::net::SocketAddr::new(b.address, b.port)))
            .collect();
        let frontend_counters =
            counters_of(&frontend_ids, |ids| sync.maps().frontend_stats_of(ids));
        let mut backend_counters =
            counters_of(&backend_ids, |ids| sync.maps().backend_stats_of(ids)).into_iter();
        for (port, counters) in ports.iter_mut().zip(frontend_counters) {
            if port.listen.is_none() {
                continue;
            }
            port.counters = counters;
            for b in &mut port.backends {
                b.counters = backend_counters.next().flatten();
            }
        }
        ports
    }

    fn maps(&self, count: super::MapCount) -> Option<Vec<super::MapUsage>> {
        Some(self.map_usage(count))
    }

    fn policy(&self) -> Vec<crate::policy::ServicePolicyStatus> {
        self.policy
            .as_ref()
            .map(|p| lock(p).statuses())
            .unwrap_or_default()
    }

    fn programs(&self) -> Vec<String> {
        self.attachments
            .iter()
            .map(|a| format!("{} on {} {}", a.program, a.hook, a.target))
            .collect()
    }

    async fn shutdown(&self) {
        // Programs and maps stay pinned: traffic keeps flowing while the agent is
        // away, and the next agent adopts them. `rune-agent cleanup` removes them.
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// The counters of `ids` in order, read in one batch: `None` where the id is
/// unknown or the read failed.
fn counters_of(
    ids: &[Option<u32>],
    read: impl FnOnce(&[u32]) -> Result<Vec<lb::TrafficStats>, MapsError>,
) -> Vec<Option<TrafficCounters>> {
    let known: Vec<u32> = ids.iter().flatten().copied().collect();
    let mut stats = read(&known).ok().map(Vec::into_iter);
    ids.iter()
        .map(|id| {
            id.as_ref()?;
            stats.as_mut()?.next().map(TrafficCounters::from)
        })
        .collect()
}

impl From<lb::TrafficStats> for TrafficCounters {
    fn from(s: lb::TrafficStats) -> Self {
        Self {
            flows: s.flows,
            packets: s.packets,
            bytes: s.bytes,
        }
    }
}

/// Fails with the first configured hook target that does not exist (an interface
/// of `--interfaces` / `--xdp-interfaces` not in this network namespace, a
/// `--cgroup` path that is not a directory): a typo in the configuration stops the
/// start, in `auto` too, instead of reading as a kernel that cannot attach (which
/// `auto` answers with another data plane).
fn check_hook_targets(hooks: &Hooks) -> Result<(), DataPlaneError> {
    let interfaces = [
        ("interfaces", &hooks.tc),
        ("xdpInterfaces", &hooks.xdp),
        ("policyInterfaces", &hooks.policy),
    ];
    for (field, names) in interfaces {
        for name in names {
            let exists = std::ffi::CString::new(name.as_str())
                // SAFETY: a NUL-terminated string that outlives the call.
                .is_ok_and(|c| unsafe { libc::if_nametoindex(c.as_ptr()) } != 0);
            if !exists {
                return Err(DataPlaneError::InvalidConfig {
                    field,
                    reason: format!("no interface {name:?} in this network namespace"),
                });
            }
        }
    }
    if let Some(cgroup) = &hooks.cgroup
        && !cgroup.is_dir()
    {
        return Err(DataPlaneError::InvalidConfig {
            field: "cgroup",
            reason: format!("{} is not a directory", cgroup.display()),
        });
    }
    Ok(())
}
