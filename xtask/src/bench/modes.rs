//! The production data plane modes the end-to-end sections measure through a VIP,
//! and what those sections share: how an agent of each mode is started, the bench
//! service written into a stopped agent's store, and the one-backend topology.

use anyhow::{Context as _, Result, bail};
use rune_harness::topology::{NODE_CLIENT_IF, Topology, TopologyConfig};
use std::path::Path;

/// A production data plane measured through the VIP. Add a mode here (its label,
/// its agent flags, its targets) and to [`Mode::ALL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// eBPF: tc DNAT on the node's client-facing veth.
    Ebpf,
    /// eBPF: XDP DNAT on that veth (reverse NAT still in tc egress). The client's
    /// veth sends full checksums in this mode (`ethtool -K c-node tx off` for its
    /// direct and VIP runs alike), as a NIC delivers them: XDP sees no skb and
    /// cannot fix a partial one.
    EbpfXdp,
    /// nftables DNAT in the node's table `inet rune`.
    Nftables,
    /// Userspace proxies listening on the VIPs themselves (added to the node's lo).
    Userspace,
}

impl Mode {
    /// Every mode, in the order they run.
    pub(crate) const ALL: [Mode; 4] = [Mode::Ebpf, Mode::EbpfXdp, Mode::Nftables, Mode::Userspace];

    /// The modes to run: those named in `RUNE_BENCH_MODES` (comma-separated
    /// [`Mode::name`]s, to iterate on one mode alone), else [`Mode::ALL`].
    pub(crate) fn selected() -> Result<Vec<(usize, Mode)>> {
        let all = Mode::ALL.into_iter().enumerate();
        let Ok(list) = std::env::var("RUNE_BENCH_MODES") else {
            return Ok(all.collect());
        };
        let wanted: Vec<&str> = list.split(',').map(str::trim).collect();
        if let Some(unknown) = wanted
            .iter()
            .find(|w| !Mode::ALL.iter().any(|m| m.name() == **w))
        {
            bail!(
                "RUNE_BENCH_MODES: unknown mode {unknown:?} (ebpf, ebpf-xdp, nftables, userspace)"
            );
        }
        Ok(all.filter(|(_, m)| wanted.contains(&m.name())).collect())
    }

    /// Its name in `RUNE_BENCH_MODES`.
    fn name(self) -> &'static str {
        match self {
            Mode::EbpfXdp => "ebpf-xdp",
            _ => self.dataplane(),
        }
    }

    /// The `--dataplane` value.
    fn dataplane(self) -> &'static str {
        match self {
            Mode::Ebpf | Mode::EbpfXdp => "ebpf",
            Mode::Nftables => "nftables",
            Mode::Userspace => "userspace",
        }
    }

    /// Its name in the report's tables.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Mode::Ebpf => "eBPF (tc)",
            Mode::EbpfXdp => "eBPF (XDP)",
            Mode::Nftables => "nftables DNAT",
            Mode::Userspace => "userspace proxy on the VIP",
        }
    }

    /// `rune-agent run` flags beyond the state dir, metrics and DNS addresses.
    pub(crate) fn flags(self, pins: &Path) -> Vec<String> {
        match self {
            Mode::Ebpf | Mode::EbpfXdp => {
                let mut flags: Vec<String> = vec![
                    "--dataplane".into(),
                    self.dataplane().into(),
                    "--cgroup".into(),
                    "none".into(),
                    "--interfaces".into(),
                    NODE_CLIENT_IF.into(),
                    "--bpf-pin-dir".into(),
                    pins.display().to_string(),
                ];
                if self == Mode::EbpfXdp {
                    flags.extend(["--xdp-interfaces".into(), NODE_CLIENT_IF.into()]);
                }
                flags
            }
            // A start removes what other modes left: the bench's own pin dir, never
            // the default one.
            Mode::Nftables | Mode::Userspace => vec![
                "--dataplane".into(),
                self.dataplane().into(),
                "--bpf-pin-dir".into(),
                pins.display().to_string(),
            ],
        }
    }
}

/// Writes the bench service into the store of a stopped agent (the CLI writes the
/// store directly), so that agent and CLI never race for it.
pub(crate) fn apply_offline(bin: &Path, state: &Path, yaml: &str) -> Result<()> {
    crate::util::rune_apply(bin, state, yaml).context("applying the bench service")
}

/// The bench's network (`rune_harness::topology`): client, node and one backend
/// namespace, no test servers (the bench runs its own), TX checksum offload left on
/// (the XDP mode turns it off on the client's veth for its runs).
pub(crate) fn topology() -> Result<Topology> {
    Topology::with_config(&TopologyConfig {
        backends: 1,
        tcp_port: None,
        udp_port: None,
        client_tx_checksum_off: false,
        ..TopologyConfig::default()
    })
}
