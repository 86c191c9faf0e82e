//! What only the userspace data plane in production does (`run --dataplane
//! userspace`, no `--dev`), end to end; the VIP scenarios every mode shares are in
//! `vip_modes.rs`. The agent in the node namespace of a [`Topology`] adds each VIP to
//! the node's `lo`, marked as its own, and proxies VIP:port to the backends: the
//! backend sees the node's address (the proxy opens its own connection), not the
//! client's; stop and `cleanup` remove exactly the agent's addresses; a restart
//! adopts the addresses a killed agent left.
//!
//! Needs root. Each test builds its own namespaces and removes them on drop; traffic
//! goes only to 198.18.0.0/15 and fd00::/8 inside them. Tests run one at a time.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener},
    sync::Mutex,
};

use rune_agent_tests::{
    modes::{
        Mode, TCP_PORT, VIP4, VIP6, all_ready, block_on_in, marked_addresses, start_agent, web_yaml,
    },
    vip::{PATIENCE, apply, topology, wait_reachable},
};
use rune_harness::{
    bpffs::PinDir,
    netns::{NetNs, require_root},
    topology::CLIENT_TIMEOUT,
};

/// One test at a time: each starts a privileged agent and its own topology.
static SERIAL: Mutex<()> = Mutex::new(());

/// The VIP of the second service, which the test itself puts on `lo` beforehand.
const THEIR_VIP: &str = "198.18.100.30";
/// A server on backend-1 that answers with the peer address it sees.
const PEER_PORT: u16 = 9090;

/// A second service on [`THEIR_VIP`] whose one endpoint (backend-1) answers with the
/// peer address it sees.
fn peer_service_yaml(backend: IpAddr) -> String {
    format!(
        "apiVersion: rune/v1
kind: Service
metadata: {{name: peer}}
spec:
  ports:
    - {{name: peer, port: {TCP_PORT}, protocol: TCP, targetPort: {PEER_PORT}}}
  discovery: {{vips: [\"{THEIR_VIP}\"]}}
---
apiVersion: rune/v1
kind: Endpoints
metadata: {{name: peer}}
spec:
  endpoints:
    - {{address: \"{backend}\", node: node-b, ready: true}}
"
    )
}

/// The addresses on the node's `lo` with their prefix length.
fn lo_addresses(node: &NetNs) -> Vec<(String, u64)> {
    let out = node.ip(&["-j", "addr", "show", "dev", "lo"]).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v[0]["addr_info"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|i| {
                    (
                        i["local"].as_str().unwrap_or_default().to_owned(),
                        i["prefixlen"].as_u64().unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn on_lo(node: &NetNs, ip: &str) -> bool {
    lo_addresses(node).iter().any(|(a, _)| a == ip)
}

/// A one-shot-per-connection server on `addr` in `ns` that answers each connection
/// with the peer address it sees; ends with the test process.
fn peer_server(ns: &NetNs, addr: SocketAddr) {
    let listener = ns.run(|| TcpListener::bind(addr)).unwrap().unwrap();
    std::thread::spawn(move || {
        for mut s in listener.incoming().flatten() {
            let _ = s.set_read_timeout(Some(CLIENT_TIMEOUT));
            let mut line = [0u8; 64];
            let _ = s.read(&mut line);
            let peer = s
                .peer_addr()
                .map(|p| p.ip().to_string())
                .unwrap_or_default();
            let _ = s.write_all(format!("{peer}\n").as_bytes());
        }
    });
}

/// Runs `rune_agent`'s `cleanup` for the VIP addresses inside `node`.
fn cleanup_in(node: &NetNs) -> Vec<IpAddr> {
    block_on_in(node, rune_agent::dataplane::proxy::vip_addrs::cleanup()).unwrap()
}

#[test]
fn vip_addresses_go_on_stop_and_cleanup_and_others_stay() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(1);
    let node = topo.node();
    // An address somebody else configured: the peer service's VIP, and one more.
    let theirs = "198.18.100.31";
    node.ip(&["addr", "add", &format!("{THEIR_VIP}/32"), "dev", "lo"])
        .unwrap();
    node.ip(&["addr", "add", &format!("{theirs}/32"), "dev", "lo"])
        .unwrap();
    let state = tempfile::tempdir().unwrap();
    let pins = PinDir::new("userspace");
    let b1 = &topo.backends()[0];
    peer_server(b1.ns(), SocketAddr::new(b1.addr().v4.into(), PEER_PORT));

    let mut agent = start_agent(Mode::Userspace, &topo, state.path(), &pins);
    apply(&agent, &web_yaml(&all_ready(&topo)));
    apply(&agent, &peer_service_yaml(b1.addr().v4.into()));
    let vip = SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT);
    wait_reachable(&topo, vip);
    // The pre-configured address is used as it is.
    wait_reachable(&topo, SocketAddr::new(THEIR_VIP.parse().unwrap(), TCP_PORT));
    assert!(on_lo(node, VIP4) && on_lo(node, VIP6));

    // A clean stop removes our addresses, and only ours.
    assert_eq!(agent.terminate(PATIENCE), Some(0));
    assert!(!on_lo(node, VIP4), "{:?}", lo_addresses(node));
    assert!(!on_lo(node, VIP6), "{:?}", lo_addresses(node));
    assert!(
        on_lo(node, THEIR_VIP) && on_lo(node, theirs),
        "{:?}",
        lo_addresses(node)
    );

    // After a kill -9 they stay; cleanup removes them, and only them.
    let mut agent = start_agent(Mode::Userspace, &topo, state.path(), &pins);
    wait_reachable(&topo, vip);
    agent.kill();
    assert!(
        on_lo(node, VIP4) && on_lo(node, VIP6),
        "{:?}",
        lo_addresses(node)
    );
    let mut removed = cleanup_in(node);
    removed.sort();
    assert_eq!(
        removed,
        vec![VIP4.parse::<IpAddr>().unwrap(), VIP6.parse().unwrap()]
    );
    assert!(
        !on_lo(node, VIP4) && !on_lo(node, VIP6),
        "{:?}",
        lo_addresses(node)
    );
    assert!(
        on_lo(node, THEIR_VIP) && on_lo(node, theirs),
        "{:?}",
        lo_addresses(node)
    );
    assert!(on_lo(node, "127.0.0.1"), "lo keeps its own address");
}

/// The VIPs are host addresses on the node's `lo` carrying the agent's mark; the
/// backend sees the node's address (the proxy's own connection), not the client's
/// (documented: this mode cannot keep it); a restart after `kill -9` adopts the
/// addresses the killed agent left, each once and still marked.
#[test]
fn vips_are_marked_host_addresses_and_the_backend_sees_the_node() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let state = tempfile::tempdir().unwrap();
    let pins = PinDir::new("userspace");
    let mut agent = start_agent(Mode::Userspace, &topo, state.path(), &pins);
    apply(&agent, &web_yaml(&all_ready(&topo)));
    let vip = SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT);
    wait_reachable(&topo, vip);

    let addrs = lo_addresses(topo.node());
    for (vip, len) in [(VIP4, 32), (VIP6, 128)] {
        assert!(
            addrs.contains(&(vip.to_owned(), len)),
            "{vip}/{len} on lo: {addrs:?}"
        );
    }
    let ours = vec![VIP4.parse::<IpAddr>().unwrap(), VIP6.parse().unwrap()];
    assert_eq!(
        marked_addresses(topo.node()),
        ours,
        "exactly the VIPs carry the agent's mark"
    );

    let b1 = &topo.backends()[0];
    peer_server(b1.ns(), SocketAddr::new(b1.addr().v4.into(), PEER_PORT));
    apply(&agent, &peer_service_yaml(b1.addr().v4.into()));
    let peer_vip = SocketAddr::new(THEIR_VIP.parse().unwrap(), TCP_PORT);
    wait_reachable(&topo, peer_vip);
    let (seen, _, local) = topo.tcp_request(peer_vip, "who").unwrap();
    assert_ne!(
        seen,
        local.ip().to_string(),
        "the client address is not kept"
    );
    assert_eq!(
        seen,
        b1.node_addr().v4.to_string(),
        "the backend sees the node"
    );

    agent.kill();
    assert!(
        on_lo(topo.node(), VIP4),
        "a killed agent leaves its addresses"
    );
    let agent = start_agent(Mode::Userspace, &topo, state.path(), &pins);
    wait_reachable(&topo, vip);
    let addrs = lo_addresses(topo.node());
    for vip in [VIP4, VIP6, THEIR_VIP] {
        assert_eq!(
            addrs.iter().filter(|(a, _)| a == vip).count(),
            1,
            "{vip} once: {addrs:?}"
        );
    }
    let mut marked = ours;
    marked.insert(1, THEIR_VIP.parse().unwrap());
    assert_eq!(marked_addresses(topo.node()), marked);
    let status = String::from_utf8_lossy(&agent.cli(&["status"], None).stdout).into_owned();
    assert!(status.contains("data plane: userspace"), "{status}");
}
