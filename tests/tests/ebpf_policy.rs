//! Network policy enforced by the eBPF data plane, end to end: a production agent
//! in the topology's node namespace with the load balancer's tc on the client-facing
//! veth and the policy programs on the backend-facing veths (`--policy-interfaces`),
//! `web`'s endpoints on this node. Needs root.
//!
//! Refusal here is a drop: a refused client's connect times out
//! ([`rune_harness::topology::CLIENT_TIMEOUT`]), so each test probes few times.

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use rune_agent_tests::{
    modes::client_xdp_pass,
    observe::first_event,
    vip::{BACKEND_PORT, PATIENCE, apply},
};
use rune_harness::{
    agent::{Agent, eventually, metric},
    bpffs::PinDir,
    netns::require_root,
    topology::{NODE_CLIENT_IF, Topology, TopologyConfig},
};

/// `web`'s VIP and ports.
const VIP4: &str = "198.18.100.10";
const VIP6: &str = "fd00:100::10";
const HTTP: u16 = 80;
/// `web`'s second TCP port and the backends' port behind it.
const ALT: u16 = 81;
const ALT_TARGET: u16 = 9090;
/// The node's name, written into the agent's identity: `web`'s endpoints are here.
const NODE: &str = "node-a";

/// The topology: two backends serving [`BACKEND_PORT`] and [`ALT_TARGET`].
fn topology() -> Topology {
    Topology::with_config(&TopologyConfig {
        backends: 2,
        tcp_port: Some(BACKEND_PORT),
        udp_port: Some(BACKEND_PORT),
        extra_tcp_ports: vec![ALT_TARGET],
        ..TopologyConfig::default()
    })
    .unwrap()
}

/// One agent with its state and pin directories (kept across restarts).
struct PolicyAgent<'t> {
    topo: &'t Topology,
    agent: Agent,
    state: tempfile::TempDir,
    pins: PinDir,
    extra: Vec<String>,
    /// XDP mode: the test object's pass program on the client's veth (a veth
    /// delivers the frames the node's XDP sends back at once only then).
    _peer_xdp: Option<aya::Ebpf>,
}

impl<'t> PolicyAgent<'t> {
    fn start(topo: &'t Topology, extra: &[&str]) -> Self {
        if let Err(e) = require_root() {
            panic!("{e}");
        }
        let state = tempfile::tempdir().unwrap();
        std::fs::write(
            state.path().join("node-identity.json"),
            format!("{{\"node_id\":\"{:032x}\",\"hostname\":\"{NODE}\"}}\n", 7),
        )
        .unwrap();
        let pins = PinDir::new("ebpf-policy");
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        let agent = start_agent(topo, state.path(), &pins, &extra);
        let peer_xdp = extra
            .iter()
            .any(|a| a == "--xdp-interfaces")
            .then(|| client_xdp_pass(topo));
        Self {
            topo,
            agent,
            state,
            pins,
            extra,
            _peer_xdp: peer_xdp,
        }
    }

    fn restart(&mut self) {
        self.agent = start_agent(self.topo, self.state.path(), &self.pins, &self.extra);
    }
}

fn start_agent(topo: &Topology, state: &Path, pins: &PinDir, extra: &[String]) -> Agent {
    let pin_dir = pins.path().display().to_string();
    let policy_ifs = topo.node_backend_ifs().join(",");
    let mut args = vec![
        "--dataplane",
        "ebpf",
        "--bpf-pin-dir",
        &pin_dir,
        "--maglev-table-size",
        "1021",
        "--cgroup",
        "none",
        "--interfaces",
        topo.node_client_if(),
        "--lb-max-frontends",
        "64",
        "--policy-interfaces",
        &policy_ifs,
    ];
    args.extend(extra.iter().map(String::as_str));
    let mut agent = Agent::start_logged_in(topo.node(), state, &args);
    agent.wait_ready(PATIENCE);
    agent
}

/// `web` on [`VIP4`]/[`VIP6`] (http 80 → 8080, alt 81 → 9090), every backend on
/// this node, with `policy` (YAML lines under `networkPolicy:`, indented 4).
fn web_yaml(topo: &Topology, policy: &str) -> String {
    let mut eps = String::new();
    for b in topo.backends() {
        for address in b.addr().both() {
            eps.push_str(&format!(
                "    - {{address: \"{address}\", node: {NODE}, ready: true}}\n"
            ));
        }
    }
    format!(
        "apiVersion: rune/v1
kind: Service
metadata: {{name: web}}
spec:
  ports:
    - {{name: http, port: {HTTP}, protocol: TCP, targetPort: {BACKEND_PORT}}}
    - {{name: alt, port: {ALT}, protocol: TCP, targetPort: {ALT_TARGET}}}
  discovery: {{vips: [\"{VIP4}\", \"{VIP6}\"]}}
  networkPolicy:
{policy}
---
apiVersion: rune/v1
kind: Endpoints
metadata: {{name: web}}
spec:
  endpoints:
{eps}"
    )
}

/// The policy allowing only the client's main addresses, on `ports` (YAML list).
fn allow_client_a(topo: &Topology, mode: &str, ports: &str) -> String {
    let a = topo.client_addr();
    format!(
        "    mode: {mode}
    ingress:
      - from: [{{cidr: \"{}/32\"}}, {{cidr: \"{}/128\"}}]
        ports: {ports}",
        a.v4, a.v6
    )
}

/// Every way to `web`'s `port` (target `target`): both VIPs and each endpoint
/// address directly.
fn destinations(topo: &Topology, port: u16, target: u16) -> Vec<SocketAddr> {
    let mut out: Vec<SocketAddr> = [VIP4, VIP6]
        .iter()
        .map(|v| SocketAddr::new(v.parse().unwrap(), port))
        .collect();
    for b in topo.backends() {
        out.extend(b.addr().both().map(|a| SocketAddr::new(a, target)));
    }
    out
}

/// A request from client A (main address) or B (second address).
fn request(topo: &Topology, from_b: bool, to: SocketAddr) -> anyhow::Result<String> {
    let src: Option<IpAddr> = from_b.then(|| topo.client_alt_addr().like(to.ip()));
    topo.tcp_request_from(src, to, "policy?").map(|r| r.0)
}

fn assert_reaches(topo: &Topology, from_b: bool, to: SocketAddr) {
    eventually(
        PATIENCE,
        &format!("{to} answers (client B: {from_b})"),
        || request(topo, from_b, to).ok(),
    );
}

fn assert_refused(topo: &Topology, from_b: bool, to: SocketAddr) {
    if let Ok(reply) = request(topo, from_b, to) {
        panic!("{to} answered client (B: {from_b}) with {reply:?}; want it refused");
    }
}

#[test]
fn a_cidr_rule_lets_client_a_in_on_every_path_and_refuses_client_b() {
    cidr_rule(&[]);
}

/// The same with the VIP's DNAT in XDP on the client-facing veth: the policy
/// programs see the packets after it all the same.
#[test]
fn a_cidr_rule_holds_with_xdp_load_balancing() {
    cidr_rule(&["--xdp-interfaces", NODE_CLIENT_IF]);
}

fn cidr_rule(extra: &[&str]) {
    let topo = topology();
    let m = PolicyAgent::start(&topo, extra);
    apply(
        &m.agent,
        &web_yaml(&topo, &allow_client_a(&topo, "enforce", "[]")),
    );
    for to in destinations(&topo, HTTP, BACKEND_PORT) {
        assert_reaches(&topo, false, to);
        assert_refused(&topo, true, to);
    }
    let text = m.agent.metrics_text();
    let drops = metric(
        &text,
        "rune_policy_drops_total{namespace=\"default\",service=\"web\",direction=\"ingress\",reason=\"no_matching_rule\"}",
    )
    .unwrap_or(0.0);
    assert!(drops >= 6.0, "drops counted: {drops}\n{text}");
    let status = m.agent.cli(&["status"], None);
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(status.contains("web"), "{status}");
}

#[test]
fn a_port_rule_allows_its_port_and_refuses_another_port_of_the_service() {
    let topo = topology();
    let m = PolicyAgent::start(&topo, &[]);
    apply(
        &m.agent,
        &web_yaml(&topo, &allow_client_a(&topo, "enforce", "[\"http\"]")),
    );
    for to in destinations(&topo, HTTP, BACKEND_PORT) {
        assert_reaches(&topo, false, to);
    }
    for to in destinations(&topo, ALT, ALT_TARGET) {
        assert_refused(&topo, false, to);
    }
}

#[test]
fn audit_mode_refuses_nothing_counts_and_shows_what_it_would_drop() {
    let topo = topology();
    let m = PolicyAgent::start(&topo, &[]);
    apply(
        &m.agent,
        &web_yaml(&topo, &allow_client_a(&topo, "audit", "[]")),
    );
    let to = SocketAddr::new(VIP4.parse().unwrap(), HTTP);
    assert_reaches(&topo, false, to);
    // `observe` streams from the agent while client B connects (a connection a
    // second until the event shows).
    let b = topo.client_alt_addr().v4.to_string();
    let event = first_event(
        m.state.path(),
        &["--verdict", "audit", "--service", "web"],
        20,
        || {
            request(&topo, true, to).expect("audit mode refuses nothing");
        },
    );
    let line = event.to_string();
    assert_eq!(event["verdict"], "audit", "{line}");
    assert_eq!(event["reason"], "no_matching_rule", "{line}");
    assert_eq!(event["service"], "web", "{line}");
    assert_eq!(event["direction"], "ingress", "{line}");
    assert_eq!(event["protocol"], "TCP", "{line}");
    assert!(event["source"].as_str().unwrap().starts_with(&b), "{line}");
    for _ in 0..3 {
        request(&topo, true, to).expect("audit mode refuses nothing");
    }
    let series = "rune_policy_audit_would_drop_total{namespace=\"default\",service=\"web\",direction=\"ingress\"}";
    let would = metric(&m.agent.metrics_text(), series).unwrap_or(0.0);
    assert!(would >= 3.0, "{series} = {would}");
}

#[test]
fn a_policy_too_large_for_its_map_refuses_and_the_agent_names_the_cause() {
    let topo = topology();
    // One peer prefix per family fits; the policy has one per family plus a second
    // IPv4 one.
    let m = PolicyAgent::start(&topo, &["--policy-max-entries", "1"]);
    let a = topo.client_addr();
    let policy = format!(
        "    ingress:
      - from: [{{cidr: \"{}/32\"}}, {{cidr: \"198.19.200.0/24\"}}, {{cidr: \"{}/128\"}}]",
        a.v4, a.v6
    );
    apply(&m.agent, &web_yaml(&topo, &policy));
    eventually(PATIENCE, "the agent names the full policy map", || {
        let log = m.agent.log();
        (log.contains("RUNE_POL_PEER4") && log.contains("--policy-max-entries")).then_some(())
    });
    for to in destinations(&topo, HTTP, BACKEND_PORT) {
        assert_refused(&topo, false, to);
    }
    let series = "rune_policy_drops_total{namespace=\"default\",service=\"web\",direction=\"ingress\",reason=\"policy_unprogrammable\"}";
    let drops = metric(&m.agent.metrics_text(), series).unwrap_or(0.0);
    assert!(drops >= 6.0, "{series} = {drops}");
}

#[test]
fn kill_and_restart_keep_enforcing_with_no_failed_request() {
    let topo = topology();
    let mut m = PolicyAgent::start(&topo, &[]);
    apply(
        &m.agent,
        &web_yaml(&topo, &allow_client_a(&topo, "enforce", "[]")),
    );
    let vip = SocketAddr::new(VIP4.parse().unwrap(), HTTP);
    assert_reaches(&topo, false, vip);
    assert_refused(&topo, true, vip);
    let stop = AtomicBool::new(false);
    let (outcomes, refused_b) = thread::scope(|scope| {
        let looper = scope.spawn(|| {
            let started = Instant::now();
            let mut outcomes = Vec::new();
            // Bounded in count and time.
            for i in 0..5000 {
                if stop.load(Ordering::Relaxed) || started.elapsed() > Duration::from_secs(60) {
                    break;
                }
                outcomes.push(topo.tcp_request(vip, &format!("loop{i}")).is_ok());
                thread::sleep(Duration::from_millis(5));
            }
            outcomes
        });
        thread::sleep(Duration::from_millis(300));
        m.agent.kill();
        // While no agent runs, the pinned programs keep refusing B.
        let refused_b = request(&topo, true, vip).is_err();
        m.restart();
        thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        (looper.join().unwrap(), refused_b)
    });
    let failed = outcomes.iter().filter(|ok| !**ok).count();
    assert!(outcomes.len() > 10, "the loop ran: {}", outcomes.len());
    assert_eq!(failed, 0, "{failed} of {} requests failed", outcomes.len());
    assert!(refused_b, "client B got through while the agent was down");
    assert_refused(&topo, true, vip);
    assert_reaches(&topo, false, vip);
}

/// `api`'s endpoint "is" the client's main address (an endpoint on another node):
/// `web` admits the endpoints of `api`. Moving `api`'s endpoint to the client's
/// second address flips who gets in, without touching `web`.
#[test]
fn a_service_peer_follows_the_peer_services_endpoints() {
    let topo = topology();
    let m = PolicyAgent::start(&topo, &[]);
    let api = |address: IpAddr| {
        format!(
            "apiVersion: rune/v1
kind: Service
metadata: {{name: api}}
spec:
  ports: [{{name: http, port: {HTTP}, protocol: TCP}}]
  discovery: {{vips: [\"198.18.100.20\"]}}
---
apiVersion: rune/v1
kind: Endpoints
metadata: {{name: api}}
spec:
  endpoints: [{{address: \"{address}\", node: node-b, ready: true}}]
"
        )
    };
    apply(&m.agent, &api(topo.client_addr().v4.into()));
    apply(
        &m.agent,
        &web_yaml(&topo, "    ingress:\n      - from: [{service: api}]"),
    );
    let vip = SocketAddr::new(VIP4.parse().unwrap(), HTTP);
    assert_reaches(&topo, false, vip);
    assert_refused(&topo, true, vip);
    apply(&m.agent, &api(topo.client_alt_addr().v4.into()));
    assert_reaches(&topo, true, vip);
    assert_refused(&topo, false, vip);
}

/// `web`'s endpoints may open connections only to the client's main address on
/// one port: a backend reaches a server there, not the same server through the
/// client's second address, nor another port.
#[test]
fn egress_rules_limit_what_an_endpoint_reaches() {
    let topo = topology();
    let m = PolicyAgent::start(&topo, &[]);
    let a = topo.client_addr().v4;
    let policy =
        format!("    egress:\n      - to: [{{cidr: \"{a}/32\"}}]\n        ports: [\"7000/tcp\"]");
    apply(&m.agent, &web_yaml(&topo, &policy));
    let listeners: Vec<std::net::TcpListener> = [7000u16, 7001]
        .iter()
        .map(|port| {
            topo.client()
                .run(|| std::net::TcpListener::bind(("0.0.0.0", *port)))
                .unwrap()
                .unwrap()
        })
        .collect();
    let backend = &topo.backends()[0];
    let connect = |to: SocketAddr| {
        backend
            .ns()
            .run(|| std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2)))
            .unwrap()
    };
    let allowed = SocketAddr::new(a.into(), 7000);
    eventually(PATIENCE, "the endpoint reaches the allowed peer", || {
        connect(allowed).ok()
    });
    let other_addr = SocketAddr::new(topo.client_alt_addr().v4.into(), 7000);
    let other_port = SocketAddr::new(a.into(), 7001);
    for to in [other_addr, other_port] {
        assert!(connect(to).is_err(), "the endpoint reached {to}");
    }
    // Replies to connections into the endpoint are not egress: the client still
    // reaches web.
    assert_reaches(&topo, true, SocketAddr::new(VIP4.parse().unwrap(), HTTP));
    drop(listeners);
}
