//! What only the eBPF data plane does, end to end (the VIP scenarios every mode
//! shares, tc and XDP included, are in `vip_modes.rs`): socket LB for a process in
//! a test cgroup on the node, and pinned programs that outlive a stop until
//! `cleanup`.
//!
//! Needs root. Each test builds its own namespaces, cgroup and bpffs pin directory
//! and removes them on drop; traffic goes only to 198.18.0.0/15 and fd00::/8 inside
//! them. Tests run one at a time (they share the CPU with the agent they start).

use std::{path::Path, process::Command, sync::Mutex};

use rune_agent_tests::{
    modes::{TCP_PORT, UDP_PORT, VIP4, VIP6, all_ready, web_yaml},
    vip::{PATIENCE, apply, topology},
};
use rune_harness::{
    agent::Agent,
    bpffs::PinDir,
    cgroup::TestCgroup,
    netns::{join_at, require_root},
    topology::Topology,
};

/// One test at a time: each starts a privileged agent and its own topology.
static SERIAL: Mutex<()> = Mutex::new(());

/// A production agent in the node namespace with tc on the client-facing veth and
/// socket LB on `cgroup` (or off).
fn start_agent(topo: &Topology, state: &Path, pins: &PinDir, cgroup: Option<&Path>) -> Agent {
    let pin_dir = pins.path().display().to_string();
    let cgroup = cgroup.map_or("none".to_owned(), |c| c.display().to_string());
    let args = [
        "--dataplane",
        "ebpf",
        "--bpf-pin-dir",
        &pin_dir,
        "--cgroup",
        &cgroup,
        "--interfaces",
        topo.node_client_if(),
        "--lb-max-frontends",
        "64",
        "--maglev-table-size",
        "1021",
    ];
    let mut agent = Agent::start_in(topo.node(), state, &args);
    agent.wait_ready(PATIENCE);
    agent
}

#[test]
fn socket_lb_rewrites_connects_of_a_local_client() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(2);
    let cgroup = TestCgroup::new("socklb").unwrap();
    let state = tempfile::tempdir().unwrap();
    let pins = PinDir::new("socklb");
    let agent = start_agent(&topo, state.path(), &pins, Some(cgroup.path()));
    apply(&agent, &web_yaml(&all_ready(&topo)));

    // The test client, in the test cgroup and the node namespace.
    let run_client = |mode: &str, addr: &str| -> std::process::Output {
        let mut cmd: Command = cgroup.command(env!("CARGO_BIN_EXE_rune-test-client"));
        join_at(&mut cmd, &topo.node().path()).unwrap();
        cmd.args([mode, addr]).output().unwrap()
    };
    let client = |mode: &str, addr: &str| -> serde_json::Value {
        let out = run_client(mode, addr);
        assert!(
            out.status.success(),
            "{mode} {addr}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let vip_tcp = format!("{VIP4}:{TCP_PORT}");
    // The maps are written shortly after the apply returns.
    rune_harness::agent::eventually(PATIENCE, "the VIP answers", || {
        run_client("tcp", &vip_tcp).status.success().then_some(())
    });
    let tcp = client("tcp", &vip_tcp);
    assert_eq!(
        tcp["peer"],
        vip_tcp.as_str(),
        "getpeername returns the VIP: {tcp}"
    );
    assert!(
        tcp["reply"].as_str().unwrap_or("").starts_with("backend-"),
        "{tcp}"
    );

    let vip_udp = format!("{VIP4}:{UDP_PORT}");
    let udp = client("udp-unconnected", &vip_udp);
    assert_eq!(
        udp["peer"],
        vip_udp.as_str(),
        "replies come from the VIP: {udp}"
    );
    let vip6_tcp = format!("[{VIP6}]:{TCP_PORT}");
    let tcp6 = client("tcp", &vip6_tcp);
    assert_eq!(tcp6["peer"], vip6_tcp.as_str(), "{tcp6}");

    let status = String::from_utf8_lossy(&agent.cli(&["status"], None).stdout).into_owned();
    assert!(status.contains("rune_connect4 on cgroup"), "{status}");
    // Status reads the counters: the TCP port's connects (at least the two above)
    // and, summed, as many on its backends' lines.
    let flows = |line: &str| -> u64 {
        line.split("(flows ")
            .nth(1)
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let tcp_port = format!("on {VIP4}:{TCP_PORT}");
    let port_flows: u64 = status
        .lines()
        .filter(|l| l.contains(&tcp_port))
        .map(flows)
        .sum();
    assert!(port_flows >= 2, "{status}");
    let backend_flows: u64 = status
        .lines()
        .filter(|l| l.trim_start().starts_with("backend "))
        .map(flows)
        .sum();
    assert!(backend_flows >= port_flows, "{status}");
}

#[test]
fn programs_stay_after_stop_and_cleanup_removes_them() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = Topology::new(1).unwrap();
    let state = tempfile::tempdir().unwrap();
    let pins = PinDir::new("cleanup");
    let mut agent = start_agent(&topo, state.path(), &pins, None);
    let pin_dir = pins.path().display().to_string();

    // Refused while the agent runs: it would re-create what is removed.
    let out = agent.cli(&["cleanup", "--bpf-pin-dir", &pin_dir], None);
    assert!(
        !out.status.success(),
        "cleanup must refuse while the agent runs"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("an agent is running"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A clean stop leaves the programs attached and the maps pinned.
    assert_eq!(agent.terminate(PATIENCE), Some(0));
    let links = pins.path().join("links");
    let pinned = std::fs::read_dir(&links).unwrap().count();
    assert_eq!(
        pinned, 2,
        "tc ingress and egress stay attached after a stop"
    );
    assert!(pins.path().join("RUNE_SVC_V4").exists());
    // The agent wrote the VIP prefilter: a set bit in every word without a
    // frontend (a map never written would be all zeros and filter nothing).
    let filter = aya::maps::MapData::from_pin(pins.path().join(agent_common::lb::VIP_FILTER))
        .expect("the VIP prefilter is pinned");
    let filter: aya::maps::Array<_, u64> =
        aya::maps::Array::try_from(aya::maps::Map::Array(filter)).unwrap();
    let full = filter.iter().filter(|w| matches!(w, Ok(u64::MAX))).count();
    assert!(
        full >= agent_common::filter::VIP_FILTER_WORDS as usize - 16,
        "only {full} prefilter words written"
    );

    let out = rune_harness::agent::cli_in(
        topo.node(),
        state.path(),
        &["cleanup", "--bpf-pin-dir", &pin_dir],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!pins.path().exists(), "cleanup removes every pin");
}
