//! The production data plane modes the VIP scenarios run over (`tests/tests/vip_modes.rs`),
//! and what each mode does differently where it cannot do what the others do.
//!
//! One [`ModeAgent`] is a production agent in a [`Topology`]'s node namespace, started
//! with the flags of its [`Mode`] and a private bpffs pin directory (a start removes
//! what other modes left there, so never the default one).

use std::{
    future::Future,
    net::{IpAddr, SocketAddr},
    path::Path,
    time::Duration,
};

use crate::vip::{BACKEND_PORT, PATIENCE, apply};
use rune_harness::{
    agent::{Agent, eventually, metric},
    bpffs::PinDir,
    netns::NetNs,
    test_programs,
    topology::{CLIENT_IF, Topology},
};

/// The service every scenario uses: `web` on [`VIP4`] and [`VIP6`].
pub const VIP4: &str = "198.18.100.10";
/// The IPv6 VIP of `web`.
pub const VIP6: &str = "fd00:100::10";
/// `web`'s TCP port.
pub const TCP_PORT: u16 = 80;
/// `web`'s UDP port.
pub const UDP_PORT: u16 = 53;

/// A production data plane mode (and, for eBPF, where it balances north-south
/// traffic).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// eBPF with tc on the node's client-facing veth.
    Ebpf,
    /// eBPF with XDP on that veth (reverse NAT still in tc egress).
    EbpfXdp,
    /// nftables DNAT in table `inet rune`.
    Nftables,
    /// The userspace proxies listening on the VIPs (added to the node's `lo`).
    Userspace,
}

impl Mode {
    /// The `--dataplane` value, as `status` names it too.
    pub fn dataplane(self) -> &'static str {
        match self {
            Mode::Ebpf | Mode::EbpfXdp => "ebpf",
            Mode::Nftables => "nftables",
            Mode::Userspace => "userspace",
        }
    }

    /// Whether the flows through the VIP live in the kernel and so outlive the
    /// agent process. The userspace proxies' connections end with it (documented).
    pub fn flows_outlive_the_agent(self) -> bool {
        self != Mode::Userspace
    }

    /// Whether a service without endpoints refuses in the kernel: a TCP reset and,
    /// for UDP, an ICMP port unreachable. The userspace proxy accepts the
    /// connection and closes it, and drops the datagram (documented).
    pub fn refuses_in_the_kernel(self) -> bool {
        self != Mode::Userspace
    }

    /// New TCP connections to `web` on [`VIP4`]:[`TCP_PORT`] as the agent counts
    /// them: the per-frontend flow counter (eBPF), the service chain's counter
    /// (nftables, shown by `status`), the proxy's accepted connections (userspace).
    pub fn new_tcp_flows(self, agent: &Agent) -> f64 {
        match self {
            Mode::Ebpf | Mode::EbpfXdp => metric(
                &agent.metrics_text(),
                &format!(
                    "rune_dataplane_flows_total{{service=\"default/web\",vip=\"{VIP4}\",port=\"{TCP_PORT}\",protocol=\"TCP\"}}"
                ),
            )
            .unwrap_or(0.0),
            Mode::Nftables => {
                let status = agent.cli(&["status"], None);
                let text = String::from_utf8_lossy(&status.stdout);
                // Only `web` exists and its UDP port sees no traffic while TCP is
                // counted: the largest counter is its TCP port's.
                text.split("flows ")
                    .skip(1)
                    .filter_map(|t| t.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
                    .fold(0.0, f64::max)
            }
            Mode::Userspace => metric(
                &agent.metrics_text(),
                "rune_proxy_connections_total{service=\"default/web\",protocol=\"TCP\",result=\"ok\"}",
            )
            .unwrap_or(0.0),
        }
    }

    /// Connections and datagrams refused for want of endpoints, as the agent counts
    /// them (all services).
    pub fn refusals(self, agent: &Agent, topo: &Topology) -> f64 {
        match self {
            Mode::Ebpf | Mode::EbpfXdp => metric(
                &agent.metrics_text(),
                "rune_dataplane_drops_total{reason=\"no_backend\"}",
            )
            .unwrap_or(0.0),
            Mode::Nftables => nft_reject_counter(topo) as f64,
            Mode::Userspace => metric(
                &agent.metrics_text(),
                "rune_proxy_connections_total{service=\"default/web\",protocol=\"TCP\",result=\"no_backend\"}",
            )
            .unwrap_or(0.0),
        }
    }
}

/// The packets counted by the `reject-service` chain of table `inet rune` in the
/// node namespace.
fn nft_reject_counter(topo: &Topology) -> u64 {
    let out = topo
        .node()
        .command("nft")
        .unwrap()
        .args(["-j", "list", "chain", "inet", "rune", "reject-service"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "nft list chain: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o.get("rule"))
        .flat_map(|r| r["expr"].as_array().cloned().unwrap_or_default())
        .find_map(|e| e["counter"]["packets"].as_u64())
        .unwrap_or(0)
}

/// One endpoint of `web` (always ready).
pub struct Ep {
    /// Its address (either family).
    pub address: IpAddr,
    /// Whether it is terminating (no new flows; established ones drain for 30 s).
    pub terminating: bool,
    /// Its port for `http` ([`TCP_PORT`]), overriding the target port
    /// [`BACKEND_PORT`]; `None`: the target port.
    pub http_port: Option<u16>,
}

/// Every backend of `topo`, both families, ready and not terminating.
pub fn all_ready(topo: &Topology) -> Vec<Ep> {
    topo.backends()
        .iter()
        .flat_map(|b| b.addr().both())
        .map(|address| Ep {
            address,
            terminating: false,
            http_port: None,
        })
        .collect()
}

/// Service `name` on `vips` (TCP [`TCP_PORT`] and UDP [`UDP_PORT`] to the
/// backends' [`BACKEND_PORT`] unless an endpoint overrides `http`, 30 s drain) with
/// `endpoints`.
pub fn service_yaml(name: &str, vips: &[&str], endpoints: &[Ep]) -> String {
    let mut eps = String::new();
    for e in endpoints {
        let ports = e
            .http_port
            .map_or(String::new(), |p| format!(", ports: {{http: {p}}}"));
        eps.push_str(&format!(
            "    - {{address: \"{}\", node: node-b, ready: true, terminating: {}{ports}}}\n",
            e.address, e.terminating
        ));
    }
    if endpoints.is_empty() {
        eps.push_str("    []\n");
    }
    let vips: Vec<String> = vips.iter().map(|v| format!("\"{v}\"")).collect();
    let vips = vips.join(", ");
    format!(
        "apiVersion: rune/v1
kind: Service
metadata: {{name: {name}}}
spec:
  ports:
    - {{name: http, port: {TCP_PORT}, protocol: TCP, targetPort: {BACKEND_PORT}}}
    - {{name: dns, port: {UDP_PORT}, protocol: UDP, targetPort: {BACKEND_PORT}}}
  discovery: {{vips: [{vips}]}}
  drainSeconds: 30
---
apiVersion: rune/v1
kind: Endpoints
metadata: {{name: {name}}}
spec:
  endpoints:
{eps}"
    )
}

/// Service `web` on [`VIP4`] and [`VIP6`] with `endpoints` (see [`service_yaml`]).
pub fn web_yaml(endpoints: &[Ep]) -> String {
    service_yaml("web", &[VIP4, VIP6], endpoints)
}

/// A production agent of one [`Mode`] in `topo`'s node namespace, with its state
/// directory and private pin directory (kept across restarts). Its log is kept
/// ([`ModeAgent::log`]).
pub struct ModeAgent<'t> {
    mode: Mode,
    topo: &'t Topology,
    /// Flags after the mode's, for every start.
    extra: Vec<String>,
    agent: Agent,
    state: tempfile::TempDir,
    pins: PinDir,
    /// XDP only: the test object's pass program on the client's veth (see
    /// [`ModeAgent::start`]).
    _peer_xdp: Option<aya::Ebpf>,
}

impl<'t> ModeAgent<'t> {
    /// Starts an agent of `mode` in `topo` and waits until it is ready.
    ///
    /// For [`Mode::EbpfXdp`] the client's veth gets a counting pass program: a veth
    /// delivers XDP_TX frames (refusals) to its peer at once only when the peer runs
    /// an XDP program itself; otherwise they wait in the peer's ring for its next
    /// packet. A NIC needs nothing of the kind.
    pub fn start(mode: Mode, topo: &'t Topology) -> Self {
        Self::start_with(mode, topo, &[])
    }

    /// [`ModeAgent::start`] with `extra` flags after the mode's (see
    /// [`start_agent_with`]), also on every restart.
    pub fn start_with(mode: Mode, topo: &'t Topology, extra: &[&str]) -> Self {
        let state = tempfile::tempdir().unwrap();
        let pins = PinDir::new(mode.dataplane());
        let extra: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
        let agent = start_logged_agent(mode, topo, state.path(), &pins, &extra);
        let peer_xdp = (mode == Mode::EbpfXdp).then(|| client_xdp_pass(topo));
        Self {
            mode,
            topo,
            extra,
            agent,
            state,
            pins,
            _peer_xdp: peer_xdp,
        }
    }

    /// The running agent.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The agent's state directory (for CLI commands such as `observe`).
    pub fn state_dir(&self) -> &Path {
        self.state.path()
    }

    /// What the running agent logged so far (stderr).
    pub fn log(&self) -> String {
        self.agent.log()
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// `rune-agent apply -f -` of `yaml`.
    pub fn apply(&self, yaml: &str) {
        apply(&self.agent, yaml);
    }

    /// `kill -9` of the agent (no chance to clean up or hand over).
    pub fn kill(&mut self) {
        self.agent.kill();
    }

    /// Starts the agent again on the same state and pin directories, and waits until
    /// it is ready.
    pub fn restart(&mut self) {
        self.agent = start_logged_agent(
            self.mode,
            self.topo,
            self.state.path(),
            &self.pins,
            &self.extra,
        );
    }
}

/// A production agent of `mode` in `topo`'s node namespace on `state` and `pins`
/// (eBPF: tc, or XDP too, on the client-facing veth, no socket LB), once ready.
pub fn start_agent(mode: Mode, topo: &Topology, state: &Path, pins: &PinDir) -> Agent {
    start_agent_with(mode, topo, state, pins, &[])
}

/// [`start_agent`] with `extra` flags after the mode's (e.g.
/// `--keep-rules-on-stop`). An `--lb-max-frontends` in `extra` replaces the
/// mode's (64).
pub fn start_agent_with(
    mode: Mode,
    topo: &Topology,
    state: &Path,
    pins: &PinDir,
    extra: &[&str],
) -> Agent {
    let args = agent_args(mode, topo, pins, extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut agent = Agent::start_in(topo.node(), state, &args);
    agent.wait_ready(PATIENCE);
    agent
}

/// [`start_agent_with`], keeping the agent's log ([`Agent::start_logged_in`]).
fn start_logged_agent(
    mode: Mode,
    topo: &Topology,
    state: &Path,
    pins: &PinDir,
    extra: &[String],
) -> Agent {
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let args = agent_args(mode, topo, pins, &extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut agent = Agent::start_logged_in(topo.node(), state, &args);
    agent.wait_ready(PATIENCE);
    agent
}

/// The flags of [`start_agent_with`].
fn agent_args(mode: Mode, topo: &Topology, pins: &PinDir, extra: &[&str]) -> Vec<String> {
    let pin_dir = pins.path().display().to_string();
    let mut args = vec![
        "--dataplane",
        mode.dataplane(),
        "--bpf-pin-dir",
        &pin_dir,
        "--maglev-table-size",
        "1021",
    ];
    if matches!(mode, Mode::Ebpf | Mode::EbpfXdp) {
        args.extend(["--cgroup", "none", "--interfaces", topo.node_client_if()]);
        if !extra.contains(&"--lb-max-frontends") {
            args.extend(["--lb-max-frontends", "64"]);
        }
    }
    if mode == Mode::EbpfXdp {
        args.extend(["--xdp-interfaces", topo.node_client_if()]);
    }
    args.extend_from_slice(extra);
    args.into_iter().map(str::to_owned).collect()
}

/// Whether `e` is a refused connect (the RST of a service without backends), as
/// opposed to a timeout or anything else.
pub fn is_refused(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}

/// Empties `web`'s endpoint list and checks that it refuses as `mode` documents,
/// and that the refusals are counted.
///
/// In the kernel modes, connects to both VIPs are refused at once (ECONNREFUSED: a
/// RST came back, no timeout) and a connected UDP socket's receive fails with
/// ECONNREFUSED (an ICMP port unreachable came back). The userspace proxy accepts
/// and closes. The probes come from the client's second address: a reused source
/// port of the first could match a flow that still drains to its old backend (and
/// rightly gets through).
pub fn assert_empty_service_refuses(m: &ModeAgent<'_>) {
    let (topo, mode) = (m.topo, m.mode);
    m.apply(&web_yaml(&[]));
    let before = mode.refusals(m.agent(), topo);
    let mut probes = 0.0;
    for vip in [VIP4, VIP6] {
        let vip = SocketAddr::new(vip.parse().unwrap(), TCP_PORT);
        let request = || {
            let src = topo.client_alt_addr().like(vip.ip());
            topo.tcp_request_from(Some(src), vip, "refused?")
        };
        // The apply reaches the kernel (or the proxy) shortly after it returns.
        eventually(PATIENCE, "connections to the VIP are refused", || {
            request()
                .err()
                .filter(|e| !mode.refuses_in_the_kernel() || is_refused(e))
        });
        for i in 0..5 {
            match request() {
                Err(e) if !mode.refuses_in_the_kernel() || is_refused(&e) => probes += 1.0,
                other => panic!("connect {i} to {vip}: want it refused, got {other:?}"),
            }
        }
    }
    if mode.refuses_in_the_kernel() {
        for vip in [VIP4, VIP6] {
            let vip = SocketAddr::new(vip.parse().unwrap(), UDP_PORT);
            let exchange = || -> std::io::Result<usize> {
                topo.client()
                    .run(|| {
                        let src = topo.client_alt_addr().like(vip.ip());
                        let socket = std::net::UdpSocket::bind((src, 0))?;
                        socket.set_read_timeout(Some(Duration::from_secs(2)))?;
                        socket.connect(vip)?;
                        socket.send(b"refused?")?;
                        socket.recv(&mut [0u8; 64])
                    })
                    .unwrap()
            };
            let refused = |r: std::io::Result<usize>| {
                r.is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
            };
            eventually(PATIENCE, "UDP to the VIP is refused", || {
                refused(exchange()).then_some(())
            });
            for i in 0..5 {
                assert!(
                    refused(exchange()),
                    "UDP exchange {i} with {vip}: want ECONNREFUSED"
                );
                probes += 1.0;
            }
        }
    }
    let after = mode.refusals(m.agent(), topo);
    assert!(
        after >= before + probes,
        "every refusal is counted: {before} → {after} after {probes} refused probes"
    );
}

/// Runs `f` to completion on a current-thread runtime inside `node`.
pub fn block_on_in<T: Send>(node: &NetNs, f: impl Future<Output = T> + Send) -> T {
    node.run(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    })
    .unwrap()
}

/// The addresses on `node`'s interfaces that carry the userspace mode's mark,
/// sorted (iproute2 6.1 cannot show `IFA_PROTO`; the agent's own netlink code
/// reads it).
pub fn marked_addresses(node: &NetNs) -> Vec<IpAddr> {
    use rune_agent::dataplane::proxy::vip_addrs::{AddressOps as _, NetlinkAddressOps};
    let mut v = block_on_in(node, async { NetlinkAddressOps.list_ours().await }).unwrap();
    v.sort();
    v
}

/// A counting pass program on the client's veth, kept loaded while the value
/// lives: a veth delivers XDP_TX frames (refusals) to its peer at once only when
/// the peer runs an XDP program itself.
pub fn client_xdp_pass(topo: &Topology) -> aya::Ebpf {
    let mut bpf = test_programs::load().unwrap_or_else(|e| panic!("{e:#}"));
    topo.client()
        .run(|| test_programs::attach_xdp_pass(&mut bpf, CLIENT_IF, aya::programs::XdpMode::Driver))
        .unwrap()
        .unwrap_or_else(|e| panic!("{e:#}"));
    bpf
}
