//! Switching the data plane mode across a restart leaves nothing of the old mode
//! behind: an agent started in one mode removes what the others left (eBPF pins and
//! the programs they hold attached, the userspace mode's VIP addresses on `lo`, the
//! nftables mode's table), and serves the same VIP in the new mode.
//!
//! Needs root. The test builds its own namespaces and pin directory and removes them
//! on drop; traffic goes only to 198.18.0.0/15 inside them. It looks only at what it
//! made: its pins, and the programs that use its pinned maps (another agent on the
//! machine, with another pin directory, changes nothing here).

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use rune_agent_tests::{
    modes::{Mode, marked_addresses, start_agent},
    vip::{BACKEND_PORT, PATIENCE, apply, wait_reachable},
};
use rune_harness::{
    agent::eventually,
    bpffs::PinDir,
    netns::{NetNs, require_root},
    topology::{Topology, TopologyConfig},
};

const VIP: &str = "198.18.100.10";
const PORT: u16 = 80;

fn service_yaml(topo: &Topology) -> String {
    let eps: Vec<String> = topo
        .backends()
        .iter()
        .map(|b| format!("{{address: \"{}\"}}", b.addr().both()[0]))
        .collect();
    format!(
        "apiVersion: rune/v1
kind: Service
metadata: {{name: web}}
spec:
  ports: [{{port: {PORT}, targetPort: {BACKEND_PORT}}}]
  discovery: {{vips: [\"{VIP}\"]}}
---
apiVersion: rune/v1
kind: Endpoints
metadata: {{name: web}}
spec:
  endpoints: [{}]
",
        eps.join(", ")
    )
}

fn vip() -> SocketAddr {
    SocketAddr::new(VIP.parse().unwrap(), PORT)
}

fn pins_left(pins: &PinDir) -> Vec<PathBuf> {
    pins.pins()
}

/// The ids of the programs the kernel holds that use a map pinned in `pins`: this
/// test's agent's programs, and no other agent's (another pin directory's) on the
/// machine.
fn programs_of(pins: &PinDir) -> BTreeSet<u32> {
    let maps: BTreeSet<u32> = pins
        .pins()
        .iter()
        .filter_map(|p| aya::maps::MapInfo::from_pin(p).ok())
        .map(|m| m.id())
        .collect();
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter(|p| {
            p.map_ids()
                .ok()
                .flatten()
                .is_some_and(|ids| ids.iter().any(|id| maps.contains(id)))
        })
        .map(|p| p.id())
        .collect()
}

/// Which of the programs `ids` the kernel still holds.
fn still_loaded(ids: &BTreeSet<u32>) -> BTreeSet<u32> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .map(|p| p.id())
        .filter(|id| ids.contains(id))
        .collect()
}

/// Whether the nftables mode's table exists in `node`.
fn nft_table_exists(node: &NetNs) -> bool {
    node.command("nft")
        .unwrap()
        .args(["list", "table", "inet", "rune"])
        .output()
        .unwrap()
        .status
        .success()
}

#[test]
fn switching_modes_leaves_nothing_of_the_old_mode() {
    require_root().unwrap();
    let topo = Topology::with_config(&TopologyConfig {
        backends: 2,
        tcp_port: Some(BACKEND_PORT),
        ..TopologyConfig::default()
    })
    .unwrap();
    let state = tempfile::tempdir().unwrap();
    let pins = PinDir::new("mode-switch");
    let node = topo.node();

    // eBPF first; a clean stop leaves the programs attached and pinned (as Cilium
    // does, so a restart drops no flow).
    let mut agent = start_agent(Mode::Ebpf, &topo, state.path(), &pins);
    apply(&agent, &service_yaml(&topo));
    wait_reachable(&topo, vip());
    assert_eq!(agent.terminate(PATIENCE), Some(0));
    assert!(
        !pins_left(&pins).is_empty(),
        "a stopped eBPF agent keeps its pins"
    );
    let programs = programs_of(&pins);
    assert!(!programs.is_empty(), "and its programs");

    // eBPF → nftables: the pins go, and with them the programs.
    let mut agent = start_agent(Mode::Nftables, &topo, state.path(), &pins);
    assert_eq!(
        pins_left(&pins),
        Vec::<PathBuf>::new(),
        "no eBPF pins remain"
    );
    eventually(PATIENCE, "the eBPF agent's programs to be freed", || {
        still_loaded(&programs).is_empty().then_some(())
    });
    wait_reachable(&topo, vip());
    assert!(nft_table_exists(node));

    // A crashed nftables agent leaves its table; nftables → userspace removes it.
    agent.kill();
    assert!(nft_table_exists(node), "kill -9 leaves the table");
    let mut agent = start_agent(Mode::Userspace, &topo, state.path(), &pins);
    assert!(!nft_table_exists(node), "no nftables table remains");
    wait_reachable(&topo, vip());
    assert_eq!(marked_addresses(node), vec![VIP.parse::<IpAddr>().unwrap()]);

    // A crashed userspace agent leaves its VIP addresses on lo; userspace → eBPF
    // removes them.
    agent.kill();
    assert_eq!(
        marked_addresses(node).len(),
        1,
        "kill -9 leaves the address"
    );
    let mut agent = start_agent(Mode::Ebpf, &topo, state.path(), &pins);
    assert_eq!(
        marked_addresses(node),
        Vec::<IpAddr>::new(),
        "no VIP address remains"
    );
    assert!(!nft_table_exists(node));
    wait_reachable(&topo, vip());
    assert!(!pins_left(&pins).is_empty());

    // `cleanup` removes everything of every mode.
    assert_eq!(agent.terminate(PATIENCE), Some(0));
    let out = agent.cli(
        &[
            "cleanup",
            "--bpf-pin-dir",
            &pins.path().display().to_string(),
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(pins_left(&pins), Vec::<PathBuf>::new());
}
