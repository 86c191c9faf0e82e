//! The embedded eBPF object loads and carries no test-only program; the test
//! object's `rune_xdp_pass` attached (native XDP) to a veth counts the packets
//! crossing it while they still reach their destination.
//!
//! Needs root. Everything happens in two namespaces the test creates and removes:
//! `client` (veth `rune-c`, 198.18.0.1/30) and `server` (veth `rune-s`, 198.18.0.2/30,
//! with the program). Two namespaces, because traffic between two addresses of one
//! namespace is delivered over `lo` and never crosses the veth.

use std::{net::UdpSocket, time::Duration};

use aya::programs::XdpMode;
use rune_agent::dataplane::ebpf;
use rune_harness::{
    bpffs::PinDir,
    netns::{NetNs, require_root, veth_pair},
    test_programs::{self, XDP_PASS},
};

/// Datagrams sent client → server; each must be counted and delivered.
const DATAGRAMS: u64 = 20;
const PAYLOAD: &[u8] = b"rune-xdp-pass-test";
const SERVER_PORT: u16 = 40_000;

/// The agent's object loads (its maps created, pinned in a private directory) and
/// holds none of the programs or maps only tests and benches use: those are in the
/// test object.
#[test]
fn the_agent_object_loads_without_test_programs() {
    if let Err(e) = require_root() {
        panic!("{e}");
    }
    let pins = PinDir::new("agent-object");
    let bpf = ebpf::load_embedded(pins.path()).unwrap_or_else(|e| panic!("{e}"));
    let programs: Vec<&str> = bpf.programs().map(|(name, _)| name).collect();
    assert!(
        programs.contains(&agent_common::lb::PROG_XDP_LB),
        "{programs:?}"
    );
    let test_only: Vec<&str> = programs
        .iter()
        .copied()
        .filter(|p| *p == XDP_PASS || p.starts_with("rune_bench"))
        .chain(
            bpf.maps()
                .map(|(name, _)| name)
                .filter(|m| *m == test_programs::XDP_STATS || m.starts_with("RUNE_BENCH")),
        )
        .collect();
    assert!(
        test_only.is_empty(),
        "test-only programs or maps in the agent's object: {test_only:?}"
    );
}

#[test]
fn xdp_pass_counts_packets_and_passes_them() {
    if let Err(e) = require_root() {
        panic!("{e}");
    }
    let client = NetNs::new("xdp-c").unwrap();
    let server = NetNs::new("xdp-s").unwrap();
    veth_pair(&client, "rune-c", &server, "rune-s").unwrap();
    client
        .ip(&["addr", "add", "198.18.0.1/30", "dev", "rune-c"])
        .unwrap();
    server
        .ip(&["addr", "add", "198.18.0.2/30", "dev", "rune-s"])
        .unwrap();

    let mut bpf = test_programs::load().unwrap_or_else(|e| panic!("{e:#}"));
    server
        .run(|| test_programs::attach_xdp_pass(&mut bpf, "rune-s", XdpMode::Driver))
        .unwrap()
        .unwrap_or_else(|e| panic!("{e:#}"));
    let before = test_programs::xdp_pass_stats(&bpf).unwrap();

    // Sockets keep the namespace they were created in.
    let receiver = server
        .run(|| UdpSocket::bind(("198.18.0.2", SERVER_PORT)))
        .unwrap()
        .unwrap();
    receiver
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let sender = client
        .run(|| UdpSocket::bind(("198.18.0.1", 0)))
        .unwrap()
        .unwrap();
    for _ in 0..DATAGRAMS {
        sender
            .send_to(PAYLOAD, ("198.18.0.2", SERVER_PORT))
            .unwrap();
    }

    // XDP_PASS: every datagram reaches the socket.
    let mut buf = [0u8; 64];
    for i in 0..DATAGRAMS {
        let (len, from) = receiver
            .recv_from(&mut buf)
            .unwrap_or_else(|e| panic!("datagram {i} of {DATAGRAMS} did not arrive: {e}"));
        assert_eq!(&buf[..len], PAYLOAD);
        assert_eq!(from.ip().to_string(), "198.18.0.1");
    }

    // Each datagram is one frame: Ethernet (14) + IPv4 (20) + UDP (8) + payload.
    let frame = (14 + 20 + 8 + PAYLOAD.len()) as u64;
    let after = test_programs::xdp_pass_stats(&bpf).unwrap();
    let packets = after.packets - before.packets;
    let bytes = after.bytes - before.bytes;
    eprintln!("rune_xdp_pass counted {packets} packets, {bytes} bytes");
    assert!(
        packets >= DATAGRAMS,
        "counted {packets} packets, sent {DATAGRAMS}"
    );
    assert!(
        bytes >= DATAGRAMS * frame,
        "counted {bytes} bytes, expected at least {}",
        DATAGRAMS * frame
    );

    // Detach before the namespaces (and their interfaces) go away.
    drop(bpf);
}
