//! The shared data-plane test topology itself (`rune_harness::topology`): the
//! client reaches every backend directly over TCP and UDP, IPv4 and IPv6, from
//! either client address; the backends count what they served; a long-lived
//! connection keeps working; dropping the topology removes every namespace. And an
//! agent started inside the node namespace answers /healthz there.
//!
//! Needs root. All traffic stays inside namespaces the tests create.

use std::{
    net::{IpAddr, SocketAddr},
    process::Command,
    time::Duration,
};

use rune_harness::{
    agent::{Agent, http_get_in},
    netns::require_root,
    topology::{CLIENT_IF, NODE_CLIENT_IF, Topology},
};

const BACKENDS: usize = 3;

fn netns_list() -> String {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `sysctl -n KEY` as a process inside the node namespace sees it.
fn sysctl_in(topo: &Topology, key: &str) -> String {
    let out = topo
        .node()
        .command("sysctl")
        .unwrap()
        .args(["-n", key])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn topology_reaches_every_backend_and_cleans_up() {
    if let Err(e) = require_root() {
        panic!("{e}");
    }
    let topo = Topology::new(BACKENDS).unwrap_or_else(|e| panic!("{e:#}"));
    let names: Vec<String> = [topo.client(), topo.node()]
        .into_iter()
        .chain(topo.backends().iter().map(|b| b.ns()))
        .map(|ns| ns.name().to_owned())
        .collect();
    let listed = netns_list();
    for n in &names {
        assert!(listed.contains(n.as_str()), "{n} missing from {listed}");
    }
    assert_eq!(topo.node_client_if(), NODE_CLIENT_IF);
    assert_eq!(topo.node_backend_ifs(), ["n-back1", "n-back2", "n-back3"]);
    assert_eq!(sysctl_in(&topo, "net.ipv4.ip_forward"), "1");
    assert_eq!(sysctl_in(&topo, "net.ipv6.conf.all.forwarding"), "1");
    let offload = topo
        .client()
        .command("ethtool")
        .unwrap()
        .args(["-k", CLIENT_IF])
        .output()
        .unwrap();
    let offload = String::from_utf8_lossy(&offload.stdout);
    assert!(
        offload.contains("tx-checksumming: off"),
        "client veth keeps TX checksum offload: {offload}"
    );

    let tcp = topo.tcp_port().unwrap();
    let udp = topo.udp_port().unwrap();
    let client = topo.client_addr();
    let alt = topo.client_alt_addr();
    for (i, b) in topo.backends().iter().enumerate() {
        assert_eq!(b.name(), format!("backend-{}", i + 1));
        for ip in b.addr().both() {
            // TCP from the kernel's choice of source: the main address.
            let to = SocketAddr::new(ip, tcp);
            let (reply, peer, local) = topo
                .tcp_request(to, "hello")
                .unwrap_or_else(|e| panic!("{e:#}"));
            assert_eq!(reply, format!("{} hello", b.name()));
            assert_eq!(peer, to);
            assert_eq!(local.ip(), client.like(ip), "{local}");

            // TCP from the second client address.
            let src = alt.like(ip);
            let (reply, _, local) = topo
                .tcp_request_from(Some(src), to, "again")
                .unwrap_or_else(|e| panic!("{e:#}"));
            assert_eq!(reply, format!("{} again", b.name()));
            assert_eq!(local.ip(), src);

            // UDP, one datagram from each client address.
            let to = SocketAddr::new(ip, udp);
            for src in [None, Some(alt.like(ip))] {
                let (reply, from) = topo
                    .udp_request_from(src, to, b"ping")
                    .unwrap_or_else(|e| panic!("{e:#}"));
                assert_eq!(reply, format!("{} ping", b.name()).as_bytes());
                assert_eq!(from, to);
            }
        }
    }

    // A long-lived connection (IPv6, to backend-2) exchanges data twice.
    let b2 = &topo.backends()[1];
    let to = SocketAddr::new(IpAddr::V6(b2.addr().v6), tcp);
    let mut conn = topo.tcp_open(to).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(conn.exchange("one").unwrap(), "backend-2 one");
    std::thread::sleep(Duration::from_millis(300)); // longer than the server's poll
    assert_eq!(conn.exchange("two").unwrap(), "backend-2 two");
    assert_eq!(conn.peer_addr, to);
    drop(conn);

    // No address of the VIP range exists anywhere (the client routes it to the
    // node, which has none): a datagram to a VIP goes unanswered.
    assert!(
        topo.udp_request("198.18.100.10:8080".parse().unwrap(), b"x")
            .is_err()
    );

    let counts = topo.backend_counts();
    assert_eq!(counts.len(), BACKENDS);
    for (i, c) in counts.iter().enumerate() {
        assert_eq!(c.name, format!("backend-{}", i + 1));
        let extra = u64::from(i == 1);
        // Per family: two TCP connections of one line each, two datagrams.
        assert_eq!(c.tcp_connections, 4 + extra, "{counts:?}");
        assert_eq!(c.tcp_lines, 4 + 2 * extra, "{counts:?}");
        assert_eq!(c.udp_datagrams, 4, "{counts:?}");
    }

    drop(topo);
    let listed = netns_list();
    for n in &names {
        assert!(!listed.contains(n.as_str()), "{n} still in {listed}");
    }
}

#[test]
fn agent_runs_inside_the_node_namespace() {
    if let Err(e) = require_root() {
        panic!("{e}");
    }
    let topo = Topology::new(1).unwrap_or_else(|e| panic!("{e:#}"));
    let state = tempfile::tempdir().unwrap();
    let mut agent = Agent::start_in(topo.node(), state.path(), &["--dev"]);
    assert_eq!(agent.netns.as_deref(), Some(topo.node().path().as_path()));
    agent.wait_ready(Duration::from_secs(20));

    let (code, body) = http_get_in(topo.node(), agent.metrics, "/healthz").unwrap();
    assert_eq!(code, 200, "{body}");
    // Its listener is the node namespace's 127.0.0.1, not the test process's.
    assert!(agent.metrics_text().contains("rune_"));
    let (code, _) =
        http_get_in(topo.client(), agent.metrics, "/healthz").map_or((0, String::new()), |r| r);
    assert_ne!(code, 200, "the client namespace must not reach it");

    assert_eq!(
        agent.terminate(Duration::from_secs(20)),
        Some(0),
        "clean exit on SIGTERM"
    );
}

/// The cluster topology (`rune_harness::cluster`): every pod reaches every pod,
/// across the bridge; each node reaches a server on the host's loopback through
/// its relay; dropping it removes every namespace.
#[test]
fn cluster_pods_reach_each_other_and_nodes_reach_the_host_relay() {
    require_root().unwrap();
    // A stand-in for etcd on the host's loopback: answers each line with "host".
    let host = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let host_addr = host.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in host.incoming().take(3) {
            let mut conn = conn.unwrap();
            let mut line = String::new();
            let _ = std::io::BufRead::read_line(
                &mut std::io::BufReader::new(conn.try_clone().unwrap()),
                &mut line,
            );
            let _ = std::io::Write::write_all(&mut conn, b"host\n");
        }
    });
    let cluster = rune_harness::cluster::Cluster::new(3, Some(host_addr)).unwrap();
    let names: Vec<String> = cluster
        .nodes()
        .iter()
        .map(|n| n.ns().name().to_owned())
        .collect();
    cluster.wait_connected(Duration::from_secs(10)).unwrap();
    for node in cluster.nodes() {
        let target = SocketAddr::new(
            IpAddr::V4(cluster.nodes()[0].pod_addr()),
            rune_harness::cluster::POD_TCP_PORT,
        );
        let reply = node.request_from_pod(target, "hi").unwrap();
        assert_eq!(reply, "pod-1 hi");
        let relay = node.etcd_addr().unwrap();
        let reply = node
            .ns()
            .run(|| {
                let mut s = std::net::TcpStream::connect(relay).unwrap();
                std::io::Write::write_all(&mut s, b"x\n").unwrap();
                let mut line = String::new();
                std::io::BufRead::read_line(&mut std::io::BufReader::new(s), &mut line).unwrap();
                line
            })
            .unwrap();
        assert_eq!(reply, "host\n", "{} through its relay", node.name());
    }
    drop(cluster);
    let left = netns_list();
    for name in names {
        assert!(!left.contains(&name), "{name} left behind: {left}");
    }
}
