//! The shared network of the data-plane end-to-end tests and of the end-to-end
//! benchmarks (`cargo xtask bench e2e | reuse`):
//!
//! ```text
//! client ns ──veth── node ns ──veth── backend-1 ns
//!                            ──veth── backend-2 ns  ... (N backends)
//! ```
//!
//! [`Topology::new`] builds it in namespaces with unique names and removes all of
//! it when the [`Topology`] drops (also on panic): backend servers stop first, then
//! every namespace is deleted, which deletes its veths.
//!
//! # Address plan
//!
//! Everything comes from 198.18.0.0/15 and fd00::/8 and lives only inside these
//! namespaces:
//!
//! | where | interface | IPv4 | IPv6 |
//! |---|---|---|---|
//! | client | [`CLIENT_IF`] | 198.18.1.2/24 and 198.18.1.3/24 | fd00:1::2/64 and fd00:1::3/64 |
//! | node, client side | [`NODE_CLIENT_IF`] | 198.18.1.1/24 | fd00:1::1/64 |
//! | backend i (1-based) | [`BACKEND_IF`] | 198.18.(10+i).2/24 | fd00:(10+i)::2/64 |
//! | node, backend i side | `n-back<i>` | 198.18.(10+i).1/24 | fd00:(10+i)::1/64 |
//!
//! (`10+i` is written in decimal in both families: backend 3 is 198.18.13.2 and
//! fd00:13::2.) The client's second address ([`Topology::client_alt_addr`]) exists for
//! the TIME_WAIT gotcha: direct-to-backend and through-the-VIP runs should connect
//! from different client addresses. Unbound client sockets always get the main
//! address (the second is an IPv4 secondary and a deprecated IPv6 address); bind to
//! the second with the `_from` helpers. VIPs come from [`VIP_V4_NET`] and [`VIP_V6_NET`];
//! the client and the backends reach them through their default routes via the
//! node, and the node has no address for them (the agent's data plane owns them).
//! IPv6 addresses are added with `nodad`, so they are usable at once.
//!
//! The node forwards (net.ipv4.ip_forward=1, net.ipv6.conf.all.forwarding=1, written
//! to /proc/sys from a thread inside the node namespace).
//!
//! # Checksum offload
//!
//! A veth with TX checksum offload on hands the peer packets whose checksum is only
//! partial (CHECKSUM_PARTIAL, to be completed "by the hardware"). An XDP program on
//! the receiving veth sees those packets raw: if it rewrites addresses and
//! redirects or bounces them, nobody completes the checksum and the receiver drops
//! them. So [`Topology::new`] turns TX checksum offload off on the client's veth
//! (traffic towards the node's XDP), and [`TopologyConfig::backend_tx_checksum_off`]
//! does the same on the backends' veths for tests whose data plane also rewrites
//! replies with XDP. [`NetNs::set_tx_checksum`] does it on any interface.
//!
//! # Servers and client helpers
//!
//! Each backend serves, on IPv4 and IPv6, TCP on [`Topology::tcp_port`] (each
//! received line answered with `"<backend-name> <line>\n"`, as long as the
//! connection stays open, or with [`TopologyConfig::tcp_close_after_reply`] only
//! the first, the server then closing) and UDP on [`Topology::udp_port`] (each
//! datagram answered with `"<backend-name> <payload>"`), and TCP on each of
//! [`TopologyConfig::extra_tcp_ports`] answering as `"<backend-name>:<port>"`
//! (several backends on one address, counted with their namespace's), from
//! threads of the test process whose sockets live in the backend's namespace.
//! [`Topology::backend_counts`] tells what each one served. The client helpers
//! ([`Topology::tcp_request`], [`Topology::tcp_open`], [`Topology::udp_request`]
//! and their `_from` forms) open their sockets in the client namespace.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::netns::{NetNs, veth_pair};

mod servers;

pub(crate) use servers::{Servers, connect};

/// The client's interface (towards the node).
pub const CLIENT_IF: &str = "c-node";
/// The node's interface towards the client.
pub const NODE_CLIENT_IF: &str = "n-client";
/// Each backend's interface (towards the node).
pub const BACKEND_IF: &str = "b-node";
/// The VIP range for IPv4 services: not assigned anywhere in the topology.
pub const VIP_V4_NET: &str = "198.18.100.0/24";
/// The VIP range for IPv6 services: not assigned anywhere in the topology.
pub const VIP_V6_NET: &str = "fd00:100::/64";
/// Most backends a topology can have (their subnets stay below the VIP range).
pub const MAX_BACKENDS: usize = 80;
/// How long the client helpers wait to connect, and then for each reply.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(3);

/// How often server threads look at their stop flag while idle.
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How long dropping the topology waits for server threads to end.
const STOP_PATIENCE: Duration = Duration::from_secs(3);

/// An IPv4 and an IPv6 address of one interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DualStack {
    /// The IPv4 address.
    pub v4: Ipv4Addr,
    /// The IPv6 address.
    pub v6: Ipv6Addr,
}

impl DualStack {
    /// Both addresses, IPv4 first.
    pub fn both(&self) -> [IpAddr; 2] {
        [IpAddr::V4(self.v4), IpAddr::V6(self.v6)]
    }

    /// The address of the same family as `other`.
    pub fn like(&self, other: IpAddr) -> IpAddr {
        match other {
            IpAddr::V4(_) => IpAddr::V4(self.v4),
            IpAddr::V6(_) => IpAddr::V6(self.v6),
        }
    }
}

/// How to build a [`Topology`].
#[derive(Clone, Debug)]
pub struct TopologyConfig {
    /// Number of backends, 1 to [`MAX_BACKENDS`].
    pub backends: usize,
    /// Port of the backends' TCP line servers; `None` for no TCP servers.
    pub tcp_port: Option<u16>,
    /// Port of the backends' UDP servers; `None` for no UDP servers.
    pub udp_port: Option<u16>,
    /// Turn TX checksum offload off on the client's veth (default: yes, see the
    /// module docs).
    pub client_tx_checksum_off: bool,
    /// Turn TX checksum offload off on each backend's veth too (default: no).
    pub backend_tx_checksum_off: bool,
    /// The TCP servers close each connection right after answering its first line
    /// (default: no, they answer until the client closes). The server closes first,
    /// so the backend, not the client, holds the connection's TIME_WAIT. For clients
    /// that send one line: a line still unread at the close would make it a reset.
    pub tcp_close_after_reply: bool,
    /// More TCP ports each backend serves (default none), as on `tcp_port` but
    /// answering as `<backend-name>:<port>`: one namespace holds several backends
    /// (one address, several ports), told apart by their replies (their counts go
    /// to their namespace's [`BackendCounts`]).
    pub extra_tcp_ports: Vec<u16>,
}

impl Default for TopologyConfig {
    fn default() -> Self {
        Self {
            backends: 2,
            tcp_port: Some(8080),
            udp_port: Some(8080),
            client_tx_checksum_off: true,
            backend_tx_checksum_off: false,
            tcp_close_after_reply: false,
            extra_tcp_ports: Vec::new(),
        }
    }
}

/// One backend namespace, wired to the node.
#[derive(Debug)]
pub struct Backend {
    name: String,
    ns: NetNs,
    node_if: String,
    addr: DualStack,
    node_addr: DualStack,
}

impl Backend {
    /// `backend-<i>` (1-based): the prefix of every reply its servers send.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its namespace.
    pub fn ns(&self) -> &NetNs {
        &self.ns
    }

    /// The node's interface towards this backend (`n-back<i>`).
    pub fn node_if(&self) -> &str {
        &self.node_if
    }

    /// Its addresses (on [`BACKEND_IF`]).
    pub fn addr(&self) -> DualStack {
        self.addr
    }

    /// The node's addresses on this backend's link (the backend's gateway).
    pub fn node_addr(&self) -> DualStack {
        self.node_addr
    }
}

/// What one backend's servers have served so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendCounts {
    /// The backend's name.
    pub name: String,
    /// TCP connections accepted (IPv4 and IPv6).
    pub tcp_connections: u64,
    /// TCP lines answered.
    pub tcp_lines: u64,
    /// UDP datagrams answered (IPv4 and IPv6).
    pub udp_datagrams: u64,
}

/// The built topology; dropping it stops the servers and deletes every namespace.
#[derive(Debug)]
pub struct Topology {
    // Field order is drop order: servers stop before the namespaces go.
    servers: Servers,
    client: NetNs,
    node: NetNs,
    backends: Vec<Backend>,
    tcp_port: Option<u16>,
    udp_port: Option<u16>,
}

impl Topology {
    /// The default topology with `backends` backends (servers on port 8080, TCP and
    /// UDP).
    pub fn new(backends: usize) -> anyhow::Result<Self> {
        Self::with_config(&TopologyConfig {
            backends,
            ..TopologyConfig::default()
        })
    }

    /// Builds the topology `config` describes.
    pub fn with_config(config: &TopologyConfig) -> anyhow::Result<Self> {
        if !(1..=MAX_BACKENDS).contains(&config.backends) {
            bail!(
                "a topology has 1 to {MAX_BACKENDS} backends, not {}",
                config.backends
            );
        }
        // Each namespace deletes itself on drop, so an error half-way through
        // leaves nothing behind.
        let client = NetNs::new("topo-c")?;
        let node = NetNs::new("topo-n")?;
        enable_forwarding(&node)?;

        veth_pair(&client, CLIENT_IF, &node, NODE_CLIENT_IF)?;
        let client_addr = client_addr();
        let client_alt = client_alt_addr();
        let node_client = node_client_addr();
        add_addrs(&client, CLIENT_IF, client_addr)?;
        add_alt_addrs(&client, CLIENT_IF, client_alt)?;
        add_addrs(&node, NODE_CLIENT_IF, node_client)?;
        default_routes(&client, CLIENT_IF, node_client)?;
        if config.client_tx_checksum_off {
            client.set_tx_checksum(CLIENT_IF, false)?;
        }

        let mut backends = Vec::with_capacity(config.backends);
        for i in 1..=config.backends {
            let ns = NetNs::new(&format!("topo-b{i}"))?;
            let node_if = format!("n-back{i}");
            veth_pair(&ns, BACKEND_IF, &node, &node_if)?;
            let net = 10 + i;
            let addr = DualStack {
                v4: Ipv4Addr::new(198, 18, net as u8, 2),
                v6: format!("fd00:{net}::2").parse()?,
            };
            let node_addr = DualStack {
                v4: Ipv4Addr::new(198, 18, net as u8, 1),
                v6: format!("fd00:{net}::1").parse()?,
            };
            add_addrs(&ns, BACKEND_IF, addr)?;
            add_addrs(&node, &node_if, node_addr)?;
            default_routes(&ns, BACKEND_IF, node_addr)?;
            if config.backend_tx_checksum_off {
                ns.set_tx_checksum(BACKEND_IF, false)?;
            }
            backends.push(Backend {
                name: format!("backend-{i}"),
                ns,
                node_if,
                addr,
                node_addr,
            });
        }

        let mut servers = Servers::default();
        for b in &backends {
            servers.start(&b.name, &b.ns, config)?;
        }
        Ok(Self {
            servers,
            client,
            node,
            backends,
            tcp_port: config.tcp_port,
            udp_port: config.udp_port,
        })
    }

    /// The client namespace.
    pub fn client(&self) -> &NetNs {
        &self.client
    }

    /// The node namespace (where the agent runs).
    pub fn node(&self) -> &NetNs {
        &self.node
    }

    /// The backends, `backend-1` first.
    pub fn backends(&self) -> &[Backend] {
        &self.backends
    }

    /// The node's interface towards the client ([`NODE_CLIENT_IF`]).
    pub fn node_client_if(&self) -> &str {
        NODE_CLIENT_IF
    }

    /// The node's interfaces towards the backends, `backend-1`'s first.
    pub fn node_backend_ifs(&self) -> Vec<&str> {
        self.backends.iter().map(|b| b.node_if()).collect()
    }

    /// The client's main address (198.18.1.2, fd00:1::2).
    pub fn client_addr(&self) -> DualStack {
        client_addr()
    }

    /// The client's second address (198.18.1.3, fd00:1::3), for runs that must not
    /// share 4-tuples with runs from [`Topology::client_addr`].
    pub fn client_alt_addr(&self) -> DualStack {
        client_alt_addr()
    }

    /// The node's address on the client link (198.18.1.1, fd00:1::1).
    pub fn node_client_addr(&self) -> DualStack {
        node_client_addr()
    }

    /// The backends' TCP server port, if they run one.
    pub fn tcp_port(&self) -> Option<u16> {
        self.tcp_port
    }

    /// The backends' UDP server port, if they run one.
    pub fn udp_port(&self) -> Option<u16> {
        self.udp_port
    }

    /// What each backend served so far, `backend-1` first.
    pub fn backend_counts(&self) -> Vec<BackendCounts> {
        self.servers.counts()
    }

    /// From the client's main address: connects to `addr` (TCP, within
    /// [`CLIENT_TIMEOUT`]), sends `line`, and returns the reply line (without its
    /// newline; a backend's starts with its name), the peer and the local address.
    pub fn tcp_request(
        &self,
        addr: SocketAddr,
        line: &str,
    ) -> anyhow::Result<(String, SocketAddr, SocketAddr)> {
        self.tcp_request_from(None, addr, line)
    }

    /// [`Topology::tcp_request`] from the client address `src` (any port), or the
    /// kernel's choice when `None`.
    pub fn tcp_request_from(
        &self,
        src: Option<IpAddr>,
        addr: SocketAddr,
        line: &str,
    ) -> anyhow::Result<(String, SocketAddr, SocketAddr)> {
        let mut conn = self.tcp_open_from(src, addr)?;
        let reply = conn.exchange(line)?;
        Ok((reply, conn.peer_addr, conn.local_addr))
    }

    /// Opens a TCP connection from the client to `addr` that stays open for
    /// [`LongLived::exchange`].
    pub fn tcp_open(&self, addr: SocketAddr) -> anyhow::Result<LongLived> {
        self.tcp_open_from(None, addr)
    }

    /// [`Topology::tcp_open`] from the client address `src`, or the kernel's choice
    /// when `None`.
    pub fn tcp_open_from(
        &self,
        src: Option<IpAddr>,
        addr: SocketAddr,
    ) -> anyhow::Result<LongLived> {
        self.tcp_open_from_port(src.map(|ip| SocketAddr::new(ip, 0)), addr)
    }

    /// [`Topology::tcp_open`] from the client address and port `src` (port 0: the
    /// kernel's choice), or the kernel's choice of both when `None`.
    pub fn tcp_open_from_port(
        &self,
        src: Option<SocketAddr>,
        addr: SocketAddr,
    ) -> anyhow::Result<LongLived> {
        let stream = self
            .client
            .run(|| connect(src, addr))?
            .with_context(|| format!("TCP connect from {src:?} to {addr}"))?;
        LongLived::new(stream)
    }

    /// From the client (an unconnected UDP socket): sends `payload` to `addr` and
    /// waits up to [`CLIENT_TIMEOUT`] for one datagram; returns it and its sender.
    pub fn udp_request(
        &self,
        addr: SocketAddr,
        payload: &[u8],
    ) -> anyhow::Result<(Vec<u8>, SocketAddr)> {
        self.udp_request_from(None, addr, payload)
    }

    /// [`Topology::udp_request`] from the client address `src`, or the kernel's
    /// choice when `None`.
    pub fn udp_request_from(
        &self,
        src: Option<IpAddr>,
        addr: SocketAddr,
        payload: &[u8],
    ) -> anyhow::Result<(Vec<u8>, SocketAddr)> {
        let socket = self
            .client
            .run(|| {
                let local = src.unwrap_or(match addr {
                    SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
                    SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
                });
                UdpSocket::bind((local, 0))
            })?
            .with_context(|| format!("binding a UDP socket on {src:?}"))?;
        socket.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        socket
            .send_to(payload, addr)
            .with_context(|| format!("UDP send to {addr}"))?;
        let mut buf = vec![0u8; 65536];
        let (n, from) = socket
            .recv_from(&mut buf)
            .with_context(|| format!("UDP reply from {addr} within {CLIENT_TIMEOUT:?}"))?;
        buf.truncate(n);
        Ok((buf, from))
    }
}

/// A client TCP connection that stays open; closed on drop.
#[derive(Debug)]
pub struct LongLived {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    /// The address connected to.
    pub peer_addr: SocketAddr,
    /// The client's end.
    pub local_addr: SocketAddr,
}

impl LongLived {
    pub(crate) fn new(stream: TcpStream) -> anyhow::Result<Self> {
        stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
        stream.set_nodelay(true)?;
        Ok(Self {
            peer_addr: stream.peer_addr()?,
            local_addr: stream.local_addr()?,
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
        })
    }

    /// Sends `line` (a newline is added) and returns the reply line without its
    /// newline, waiting up to [`CLIENT_TIMEOUT`].
    pub fn exchange(&mut self, line: &str) -> anyhow::Result<String> {
        self.writer
            .write_all(format!("{line}\n").as_bytes())
            .with_context(|| format!("TCP send to {}", self.peer_addr))?;
        let mut reply = String::new();
        let n = self
            .reader
            .read_line(&mut reply)
            .with_context(|| format!("TCP reply from {}", self.peer_addr))?;
        if n == 0 || !reply.ends_with('\n') {
            bail!("{} closed the connection before replying", self.peer_addr);
        }
        reply.pop();
        Ok(reply)
    }
}

fn client_addr() -> DualStack {
    DualStack {
        v4: Ipv4Addr::new(198, 18, 1, 2),
        v6: Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 0, 2),
    }
}

fn client_alt_addr() -> DualStack {
    DualStack {
        v4: Ipv4Addr::new(198, 18, 1, 3),
        v6: Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 0, 3),
    }
}

fn node_client_addr() -> DualStack {
    DualStack {
        v4: Ipv4Addr::new(198, 18, 1, 1),
        v6: Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 0, 1),
    }
}

fn add_addrs(ns: &NetNs, ifname: &str, addr: DualStack) -> anyhow::Result<()> {
    add_addrs_with(ns, ifname, addr, &[])
}

/// A second pair of addresses that the kernel never picks as a source by itself:
/// IPv4 secondary (added after the primary of the same subnet), IPv6 deprecated
/// (`preferred_lft 0`; without it the newest IPv6 address would win). Sockets bound
/// to them work as usual.
fn add_alt_addrs(ns: &NetNs, ifname: &str, addr: DualStack) -> anyhow::Result<()> {
    add_addrs_with(ns, ifname, addr, &["preferred_lft", "0"])
}

/// `addr` on `ifname` (/24 and /64, IPv6 without duplicate detection), the IPv6
/// one with `v6_extra` options.
fn add_addrs_with(
    ns: &NetNs,
    ifname: &str,
    addr: DualStack,
    v6_extra: &[&str],
) -> anyhow::Result<()> {
    ns.ip(&["addr", "add", &format!("{}/24", addr.v4), "dev", ifname])?;
    let v6 = format!("{}/64", addr.v6);
    let mut args = vec!["-6", "addr", "add", &v6, "dev", ifname, "nodad"];
    args.extend_from_slice(v6_extra);
    ns.ip(&args)?;
    Ok(())
}

fn default_routes(ns: &NetNs, ifname: &str, via: DualStack) -> anyhow::Result<()> {
    ns.ip(&[
        "route",
        "add",
        "default",
        "via",
        &via.v4.to_string(),
        "dev",
        ifname,
    ])?;
    ns.ip(&[
        "-6",
        "route",
        "add",
        "default",
        "via",
        &via.v6.to_string(),
        "dev",
        ifname,
    ])?;
    Ok(())
}

/// Turns on IPv4 and IPv6 forwarding in `ns`.
pub(crate) fn enable_forwarding(ns: &NetNs) -> anyhow::Result<()> {
    ns.sysctl("net/ipv4/ip_forward", "1")?;
    ns.sysctl("net/ipv6/conf/all/forwarding", "1")
}
