//! Several nodes of one cluster on one machine, for the multi-node tests and
//! `cargo xtask run --cluster N`:
//!
//! ```text
//!                       switch ns: bridge rune-br
//!            ┌──────────────┼──────────────┐
//!   node-1 ns (eth0)   node-2 ns (eth0)   node-3 ns (eth0)    198.18.0.(10+i)/24
//!        │ pod0             │ pod0             │ pod0         198.18.(100+i).1/24
//!   pod-1 ns (eth0)    pod-2 ns (eth0)    pod-3 ns (eth0)     198.18.(100+i).2/24
//! ```
//!
//! Each node namespace is a worker node: it forwards, routes every other node's pod
//! network through that node's bridge address, and reaches etcd (running on the
//! host's loopback) through a relay on its own loopback ([`ClusterNode::etcd_addr`]):
//! an agent run inside the node namespace connects to `127.0.0.1:<port>`, which
//! the host's etcd certificate covers. Each pod namespace runs the topology's line
//! server on [`POD_TCP_PORT`] (answering `"pod-<i> <line>"`) and is the node's
//! client too: its default route goes through its node, so a connection from a
//! pod to a VIP meets its node's data plane on `pod0` (tc ingress for the request,
//! tc egress for the replies).
//!
//! Everything is IPv4 from 198.18.0.0/15 inside namespaces with unique names, all
//! deleted on drop (also on panic); the relays stop first. [`running`] starts etcd
//! and an agent per node on it.

pub mod running;

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::{
    etcd::Gate,
    netns::{NetNs, veth_pair},
    topology::{BackendCounts, LongLived, Servers, TopologyConfig, connect, enable_forwarding},
};

/// The TCP port of every pod's line server.
pub const POD_TCP_PORT: u16 = 8080;
/// The node's interface towards its pod (where the data plane attaches).
pub const NODE_POD_IF: &str = "pod0";
/// The node's interface on the bridge.
pub const NODE_BRIDGE_IF: &str = "eth0";
/// The most nodes a cluster has (the address plan's limit).
pub const MAX_NODES: usize = 100;

/// One worker node: its namespace, its pod and its relay to etcd.
#[derive(Debug)]
pub struct ClusterNode {
    index: usize,
    ns: NetNs,
    pod: NetNs,
    relay: Option<Gate>,
}

impl ClusterNode {
    /// `node-<i>` (1-based).
    pub fn name(&self) -> String {
        format!("node-{}", self.index)
    }

    /// The node's namespace (where its agent runs).
    pub fn ns(&self) -> &NetNs {
        &self.ns
    }

    /// The pod's namespace (its server, and a client of the VIPs).
    pub fn pod(&self) -> &NetNs {
        &self.pod
    }

    /// The node's address on the bridge, 198.18.0.(10+i).
    pub fn addr(&self) -> Ipv4Addr {
        bridge_addr(self.index)
    }

    /// The pod's address, 198.18.(100+i).2: an endpoint on this node.
    pub fn pod_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, (100 + self.index) as u8, 2)
    }

    /// Where an agent inside this node reaches etcd (127.0.0.1 of the node).
    pub fn etcd_addr(&self) -> Option<SocketAddr> {
        self.relay.as_ref().map(Gate::addr)
    }

    /// Bytes between this node and etcd so far (through its relay): (sent to
    /// etcd, received from it); TLS records included.
    pub fn etcd_bytes(&self) -> (u64, u64) {
        self.relay.as_ref().map_or((0, 0), Gate::bytes)
    }

    /// Cuts this node off etcd (its relayed connections close, new ones fail)
    /// until [`ClusterNode::reconnect_etcd`]; the other nodes still reach it.
    pub fn cut_etcd(&self) {
        if let Some(r) = &self.relay {
            r.cut();
        }
    }

    /// Undoes [`ClusterNode::cut_etcd`].
    pub fn reconnect_etcd(&self) {
        if let Some(r) = &self.relay {
            r.restore();
        }
    }

    /// From this node's pod: connects to `addr`, sends `line` and returns the reply
    /// line (a pod's starts with its name).
    pub fn request_from_pod(&self, addr: SocketAddr, line: &str) -> anyhow::Result<String> {
        let mut conn = self.open_from_pod(addr)?;
        conn.exchange(line)
    }

    /// From this node's pod: a connection to `addr` that stays open.
    pub fn open_from_pod(&self, addr: SocketAddr) -> anyhow::Result<LongLived> {
        let stream = self
            .pod
            .run(|| connect(None, addr))?
            .with_context(|| format!("TCP connect from pod-{} to {addr}", self.index))?;
        LongLived::new(stream)
    }
}

/// The built cluster; dropping it stops the servers and relays and deletes every
/// namespace.
#[derive(Debug)]
pub struct Cluster {
    // Field order is drop order: servers and relays stop before the namespaces go.
    servers: Servers,
    nodes: Vec<ClusterNode>,
    switch: NetNs,
}

impl Cluster {
    /// `nodes` node namespaces with a pod each, joined by a bridge; with
    /// `etcd: Some(addr)` each node gets a relay to that address on the host.
    pub fn new(nodes: usize, etcd: Option<SocketAddr>) -> anyhow::Result<Cluster> {
        if !(1..=MAX_NODES).contains(&nodes) {
            bail!("a cluster has 1 to {MAX_NODES} nodes, not {nodes}");
        }
        let switch = NetNs::new("cl-sw")?;
        switch.ip(&["link", "add", "rune-br", "type", "bridge"])?;
        switch.ip(&["link", "set", "rune-br", "up"])?;
        let mut built = Vec::with_capacity(nodes);
        for i in 1..=nodes {
            let ns = NetNs::new(&format!("cl-n{i}"))?;
            let pod = NetNs::new(&format!("cl-p{i}"))?;
            enable_forwarding(&ns)?;
            let port = format!("n{i}");
            veth_pair(&ns, NODE_BRIDGE_IF, &switch, &port)?;
            switch.ip(&["link", "set", &port, "master", "rune-br"])?;
            switch.ip(&["link", "set", &port, "up"])?;
            ns.ip(&[
                "addr",
                "add",
                &format!("{}/24", bridge_addr(i)),
                "dev",
                NODE_BRIDGE_IF,
            ])?;
            veth_pair(&pod, "eth0", &ns, NODE_POD_IF)?;
            let node = ClusterNode {
                index: i,
                ns,
                pod,
                relay: None,
            };
            node.ns.ip(&[
                "addr",
                "add",
                &format!("198.18.{}.1/24", 100 + i),
                "dev",
                NODE_POD_IF,
            ])?;
            node.pod.ip(&[
                "addr",
                "add",
                &format!("{}/24", node.pod_addr()),
                "dev",
                "eth0",
            ])?;
            node.pod.ip(&[
                "route",
                "add",
                "default",
                "via",
                &format!("198.18.{}.1", 100 + i),
            ])?;
            // XDP or tc on pod0 rewrites packets the pod sent: full checksums.
            node.pod.set_tx_checksum("eth0", false)?;
            built.push(node);
        }
        // Every node routes every other node's pod network through that node.
        for node in &built {
            for other in built.iter().filter(|o| o.index != node.index) {
                node.ns.ip(&[
                    "route",
                    "add",
                    &format!("198.18.{}.0/24", 100 + other.index),
                    "via",
                    &other.addr().to_string(),
                ])?;
            }
        }
        let mut servers = Servers::default();
        let config = TopologyConfig {
            tcp_port: Some(POD_TCP_PORT),
            udp_port: None,
            ..TopologyConfig::default()
        };
        for node in &mut built {
            servers.start(&format!("pod-{}", node.index), &node.pod, &config)?;
            if let Some(etcd) = etcd {
                node.relay = Some(Gate::in_netns(&node.ns, etcd)?);
            }
        }
        Ok(Cluster {
            servers,
            nodes: built,
            switch,
        })
    }

    /// The nodes, `node-1` first.
    pub fn nodes(&self) -> &[ClusterNode] {
        &self.nodes
    }

    /// The switch namespace (holding the bridge).
    pub fn switch(&self) -> &NetNs {
        &self.switch
    }

    /// What each pod served so far, `pod-1` first.
    pub fn pod_counts(&self) -> Vec<BackendCounts> {
        self.servers.counts()
    }

    /// Waits until every node reaches every other node's pod (the bridge learned
    /// its ports), at most `patience`.
    pub fn wait_connected(&self, patience: Duration) -> anyhow::Result<()> {
        let deadline = std::time::Instant::now() + patience;
        for node in &self.nodes {
            for other in &self.nodes {
                let target = SocketAddr::new(IpAddr::V4(other.pod_addr()), POD_TCP_PORT);
                loop {
                    match node.request_from_pod(target, "ping") {
                        Ok(_) => break,
                        Err(e) if std::time::Instant::now() > deadline => {
                            return Err(e).context(format!(
                                "{} cannot reach pod-{} within {patience:?}",
                                node.name(),
                                other.index
                            ));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(50)),
                    }
                }
            }
        }
        Ok(())
    }
}

/// Node `i`'s address on the bridge.
fn bridge_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, (10 + i) as u8)
}
