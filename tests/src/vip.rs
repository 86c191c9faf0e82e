//! What the VIP tests of every production data plane mode share (`ebpf_vip.rs`,
//! `nftables.rs`, `userspace_vip.rs`): the topology they use, applying objects, and
//! measuring how new connections spread over the backends.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use rune_harness::{
    agent::{Agent, eventually},
    topology::{LongLived, Topology, TopologyConfig},
};

/// The backends' servers (TCP and UDP) listen here.
pub const BACKEND_PORT: u16 = 8080;

/// How long a VIP may take to answer after a start or an apply.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// A topology with `backends` backends serving TCP and UDP on [`BACKEND_PORT`].
pub fn topology(backends: usize) -> Topology {
    Topology::with_config(&TopologyConfig {
        backends,
        tcp_port: Some(BACKEND_PORT),
        udp_port: Some(BACKEND_PORT),
        ..TopologyConfig::default()
    })
    .unwrap()
}

/// `rune-agent apply -f -` of `yaml` against `agent`; panics with its stderr when
/// it fails.
pub fn apply(agent: &Agent, yaml: &str) {
    let out = agent.cli(&["apply", "-f", "-"], Some(yaml));
    assert!(
        out.status.success(),
        "apply failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The backend that answered: the first word of a backend server's reply.
pub fn backend_name(reply: &str) -> String {
    reply
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// Waits until a TCP request to `vip` from the client namespace gets an answer.
pub fn wait_reachable(topo: &Topology, vip: SocketAddr) {
    eventually(PATIENCE, &format!("{vip} answers"), || {
        topo.tcp_request(vip, "ping").ok().map(drop)
    });
}

/// `n` new TCP connections to `vip`; every one must succeed and see `vip` as its
/// peer. Returns connections per backend name.
pub fn tcp_spread(topo: &Topology, vip: SocketAddr, n: usize) -> BTreeMap<String, usize> {
    let mut per = BTreeMap::new();
    for i in 0..n {
        let (reply, peer, _) = topo
            .tcp_request(vip, &format!("req{i}"))
            .unwrap_or_else(|e| panic!("connection {i} to {vip}: {e:#}"));
        assert_eq!(peer, vip, "the client must see the VIP as its peer");
        *per.entry(backend_name(&reply)).or_insert(0) += 1;
    }
    per
}

/// Every one of `backends` backends got 20–47 % of the `n` connections in `per`.
pub fn assert_balanced(per: &BTreeMap<String, usize>, n: usize, backends: usize) {
    assert_eq!(per.len(), backends, "every backend gets flows: {per:?}");
    for (name, count) in per {
        let share = *count as f64 / n as f64;
        assert!(
            (0.20..=0.47).contains(&share),
            "{name} got {count} of {n} ({share:.2}): {per:?}"
        );
    }
}

/// Long-lived connections to `vip`, opened until each of `backends` backends holds
/// at least one (at most 60), each with the name of the backend it landed on.
pub fn hold_one_per_backend(
    topo: &Topology,
    vip: SocketAddr,
    backends: usize,
) -> Vec<(String, LongLived)> {
    let mut long = Vec::new();
    let mut held = BTreeMap::new();
    for i in 0..60 {
        let mut c = topo.tcp_open(vip).unwrap();
        let name = backend_name(&c.exchange(&format!("open{i}")).unwrap());
        *held.entry(name.clone()).or_insert(0) += 1;
        long.push((name, c));
        if held.len() == backends && i >= 5 {
            break;
        }
    }
    assert_eq!(
        held.len(),
        backends,
        "every backend holds a long-lived connection"
    );
    long
}

/// Every connection in `held` still exchanges `line` with the backend it started on.
pub fn assert_held_flows_stay<'a>(
    held: impl IntoIterator<Item = &'a mut (String, LongLived)>,
    line: &str,
) {
    for (name, c) in held {
        let reply = c.exchange(line).unwrap();
        assert_eq!(
            &backend_name(&reply),
            name,
            "an established flow never moves"
        );
    }
}

/// After backend `victim` was marked terminating: new connections to `vip` stop
/// reaching it (within [`PATIENCE`], then 60 in a row), while every connection in
/// `held` keeps working on its backend.
pub fn assert_terminating_gets_no_new_flows(
    topo: &Topology,
    vip: SocketAddr,
    victim: &str,
    held: &mut [(String, LongLived)],
) {
    eventually(
        PATIENCE,
        "the terminating backend gets no new flows",
        || {
            let per = tcp_spread(topo, vip, 30);
            (!per.contains_key(victim)).then_some(())
        },
    );
    let per = tcp_spread(topo, vip, 60);
    assert!(
        !per.contains_key(victim),
        "no new flow to {victim}: {per:?}"
    );
    assert_held_flows_stay(held.iter_mut(), "still-there");
}
