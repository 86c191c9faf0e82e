//! The eBPF data plane end to end: a production-mode agent in the node namespace of
//! a [`Topology`] balances VIP traffic from the client namespace (tc on the node's
//! client-facing veth) and from a process in a test cgroup on the node (socket LB).
//!
//! Needs root. Each test builds its own namespaces, cgroup and bpffs pin directory
//! and removes them on drop; traffic goes only to 198.18.0.0/15 and fd00::/8 inside
//! them. Tests run one at a time (they share the CPU with the agent they start).

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::Path,
    process::Command,
    sync::Mutex,
    time::Duration,
};

use rune_agent_tests::{
    agent::{Agent, metric},
    bpf::PinDir,
    cgroup::TestCgroup,
    netns::{join_at, require_root},
    topology::Topology,
    vip::{
        BACKEND_PORT, PATIENCE, apply, assert_balanced, assert_held_flows_stay,
        assert_terminating_gets_no_new_flows, backend_name, hold_one_per_backend, tcp_spread,
        topology, wait_reachable,
    },
};

/// One test at a time: each starts a privileged agent and its own topology.
static SERIAL: Mutex<()> = Mutex::new(());

const VIP4: &str = "198.18.100.10";
const VIP6: &str = "fd00:100::10";
const TCP_PORT: u16 = 80;
const UDP_PORT: u16 = 53;

/// One endpoint line of the Endpoints document.
struct Ep {
    address: IpAddr,
    ready: bool,
    terminating: bool,
}

fn service_yaml(endpoints: &[Ep], drain_seconds: u32) -> String {
    let mut eps = String::new();
    for e in endpoints {
        eps.push_str(&format!(
            "    - {{address: \"{}\", node: node-b, ready: {}, terminating: {}}}\n",
            e.address, e.ready, e.terminating
        ));
    }
    if endpoints.is_empty() {
        eps.push_str("    []\n");
    }
    format!(
        "apiVersion: rune/v1
kind: Service
metadata: {{name: web}}
spec:
  ports:
    - {{name: http, port: {TCP_PORT}, protocol: TCP, targetPort: {BACKEND_PORT}}}
    - {{name: dns, port: {UDP_PORT}, protocol: UDP, targetPort: {BACKEND_PORT}}}
  discovery: {{vips: [\"{VIP4}\", \"{VIP6}\"]}}
  drainSeconds: {drain_seconds}
---
apiVersion: rune/v1
kind: Endpoints
metadata: {{name: web}}
spec:
  endpoints:
{eps}"
    )
}

/// Every backend of the topology (both families), ready.
fn all_ready(topo: &Topology) -> Vec<Ep> {
    topo.backends()
        .iter()
        .flat_map(|b| b.addr().both())
        .map(|address| Ep {
            address,
            ready: true,
            terminating: false,
        })
        .collect()
}

/// A production agent in the node namespace with tc on the client-facing veth and
/// socket LB on `cgroup` (or off).
fn start_agent(topo: &Topology, state: &Path, pins: &PinDir, cgroup: Option<&Path>) -> Agent {
    start_agent_with(topo, state, pins, cgroup, &[])
}

/// [`start_agent`] with extra flags.
fn start_agent_with(
    topo: &Topology,
    state: &Path,
    pins: &PinDir,
    cgroup: Option<&Path>,
    extra: &[&str],
) -> Agent {
    let pin_dir = pins.path().display().to_string();
    let cgroup = cgroup.map_or("none".to_owned(), |c| c.display().to_string());
    let mut args = vec![
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
    args.extend_from_slice(extra);
    let mut agent = Agent::start_in(topo.node(), state, &args);
    agent.wait_ready(PATIENCE);
    agent
}

/// Whether `e` is a refused connect (the RST of a service without backends), as
/// opposed to a timeout or anything else.
fn is_refused(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}

/// Empties the service's endpoint list and checks that connects to both VIPs are
/// refused at once (ECONNREFUSED: a RST came back, no timeout) and counted. The
/// probes come from the client's second address: a reused source port of the
/// first could match a flow that still drains to its old backend (and rightly
/// gets through).
fn assert_empty_service_refuses(agent: &Agent, topo: &Topology) {
    apply(agent, &service_yaml(&[], 30));
    let series = "rune_dataplane_drops_total{reason=\"no_backend\"}";
    let drops_before = metric(&agent.metrics_text(), series).unwrap_or(0.0);
    for vip in [VIP4, VIP6] {
        let vip = SocketAddr::new(vip.parse().unwrap(), TCP_PORT);
        // The apply reaches the maps shortly after it returns.
        rune_agent_tests::agent::eventually(PATIENCE, "connects to the VIP are refused", || {
            let src = topo.client_alt_addr().like(vip.ip());
            let r = topo.tcp_request_from(Some(src), vip, "refused?");
            r.err().filter(is_refused).map(|_| ())
        });
        for i in 0..5 {
            let src = topo.client_alt_addr().like(vip.ip());
            match topo.tcp_request_from(Some(src), vip, "refused?") {
                Err(e) if is_refused(&e) => {}
                other => panic!("connect {i} to {vip}: want ECONNREFUSED, got {other:?}"),
            }
        }
    }
    // UDP: a connected socket's receive fails with ECONNREFUSED (the ICMP port
    // unreachable came back) instead of timing out.
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
        rune_agent_tests::agent::eventually(PATIENCE, "UDP to the VIP is refused", || {
            exchange()
                .err()
                .filter(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
                .map(|_| ())
        });
        for i in 0..5 {
            match exchange() {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
                other => panic!("UDP exchange {i} with {vip}: want ECONNREFUSED, got {other:?}"),
            }
        }
    }
    let drops_after = metric(&agent.metrics_text(), series).unwrap_or(0.0);
    assert!(
        drops_after >= drops_before + 24.0,
        "every refusal is counted: {drops_before} → {drops_after}"
    );
}

#[test]
fn vip_traffic_is_balanced_in_the_kernel_for_tcp_udp_and_ipv6() {
    balanced_for_tcp_udp_and_ipv6(false);
}

/// The same through XDP on the node's client-facing veth (DNAT in XDP, reverse NAT
/// still in tc egress). The client's veth sends full checksums (the topology turns
/// its TX checksum offload off), as a NIC delivers them.
#[test]
fn vip_traffic_is_balanced_in_xdp_too() {
    balanced_for_tcp_udp_and_ipv6(true);
}

fn balanced_for_tcp_udp_and_ipv6(xdp: bool) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let state = tempfile::tempdir().unwrap();
    let pins = PinDir::new("vip");
    let node_if = topo.node_client_if().to_owned();
    let extra: Vec<&str> = if xdp {
        vec!["--xdp-interfaces", &node_if]
    } else {
        Vec::new()
    };
    let agent = start_agent_with(&topo, state.path(), &pins, None, &extra);
    // A veth delivers XDP_TX frames to its peer at once only when the peer runs an
    // XDP program itself (otherwise they wait in the peer's ring for its next
    // packet, and a refusal's RST arrives after the connect gave up): the client's
    // veth gets the counting pass program, as a NIC needs nothing of the kind.
    let peer_pins = PinDir::new("vip-peer");
    let _peer_xdp = xdp.then(|| {
        let mut bpf = rune_agent::dataplane::ebpf::load_embedded(peer_pins.path())
            .unwrap_or_else(|e| panic!("{e}"));
        topo.client()
            .run(|| {
                rune_agent::dataplane::ebpf::attach_xdp_pass(
                    &mut bpf,
                    rune_agent_tests::topology::CLIENT_IF,
                    rune_agent::dataplane::ebpf::XdpMode::Driver,
                )
            })
            .unwrap()
            .unwrap_or_else(|e| panic!("{:#}", anyhow::Error::from(e)));
        bpf
    });
    apply(&agent, &service_yaml(&all_ready(&topo), 30));

    let vip4 = SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT);
    wait_reachable(&topo, vip4);
    let before = agent.metrics_text();
    let series = format!(
        "rune_dataplane_flows_total{{service=\"default/web\",vip=\"{VIP4}\",port=\"{TCP_PORT}\",protocol=\"TCP\"}}"
    );
    let flows_before = metric(&before, &series).expect("per-frontend flow counter");

    let per = tcp_spread(&topo, vip4, 300);
    assert_balanced(&per, 300, 3);

    // Non-VIP traffic between the same namespaces is untouched (and not counted).
    for b in topo.backends() {
        let direct = SocketAddr::new(b.addr().v4.into(), BACKEND_PORT);
        let (reply, peer, _) = topo.tcp_request(direct, "direct").unwrap();
        assert_eq!(backend_name(&reply), b.name());
        assert_eq!(peer, direct);
    }
    let after = agent.metrics_text();
    assert_eq!(
        metric(&after, &series),
        Some(flows_before + 300.0),
        "the flow counter counts exactly the VIP connections"
    );

    // UDP: each request from a fresh socket is a new flow; replies come from the VIP.
    let udp_vip = SocketAddr::new(VIP4.parse().unwrap(), UDP_PORT);
    let mut per_udp = BTreeMap::new();
    for i in 0..300 {
        let (reply, from) = topo
            .udp_request(udp_vip, format!("q{i}").as_bytes())
            .unwrap_or_else(|e| panic!("UDP request {i}: {e:#}"));
        assert_eq!(from, udp_vip, "the reply must come from the VIP");
        let reply = String::from_utf8_lossy(&reply).into_owned();
        *per_udp.entry(backend_name(&reply)).or_insert(0) += 1;
    }
    assert_balanced(&per_udp, 300, 3);

    // IPv6 VIP, IPv6 backends.
    let vip6 = SocketAddr::new(VIP6.parse().unwrap(), TCP_PORT);
    let per6 = tcp_spread(&topo, vip6, 300);
    assert_balanced(&per6, 300, 3);

    let status = agent.cli(&["status"], None);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("data plane: ebpf"), "{text}");
    assert!(
        text.contains("rune_tc_ingress on tc-ingress n-client"),
        "{text}"
    );
    assert!(
        text.contains("rune_tc_egress on tc-egress n-client"),
        "{text}"
    );
    assert_eq!(text.contains("rune_xdp_lb on xdp n-client"), xdp, "{text}");

    // Without endpoints, connects are refused by a RST (and UDP by an ICMP port
    // unreachable) from the same hook that balanced them.
    assert_empty_service_refuses(&agent, &topo);
}

#[test]
fn terminating_backend_gets_no_new_flows_and_established_flows_stay() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let state = tempfile::tempdir().unwrap();
    let pins = PinDir::new("term");
    let agent = start_agent(&topo, state.path(), &pins, None);
    apply(&agent, &service_yaml(&all_ready(&topo), 30));
    let vip = SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT);
    wait_reachable(&topo, vip);

    // Long-lived connections until every backend holds at least one.
    let mut long = hold_one_per_backend(&topo, vip, 3);

    // backend-0 terminates: no new flows, its established ones keep working.
    let victim = topo.backends()[0].name().to_owned();
    let mut eps = all_ready(&topo);
    for e in &mut eps {
        if topo.backends()[0].addr().both().contains(&e.address) {
            e.terminating = true;
        }
    }
    apply(&agent, &service_yaml(&eps, 30));
    assert_terminating_gets_no_new_flows(&topo, vip, &victim, &mut long);

    // backend-0 is deleted: traffic continues on the rest; flows on the others stay.
    let rest: Vec<Ep> = all_ready(&topo)
        .into_iter()
        .filter(|e| !topo.backends()[0].addr().both().contains(&e.address))
        .collect();
    apply(&agent, &service_yaml(&rest, 30));
    let per = tcp_spread(&topo, vip, 60);
    assert!(!per.contains_key(&victim), "{per:?}");
    assert_eq!(per.len(), 2, "{per:?}");
    assert_held_flows_stay(
        long.iter_mut().filter(|(n, _)| *n != victim),
        "after-delete",
    );

    // An empty endpoint list refuses new flows, and the refusal is counted.
    assert_empty_service_refuses(&agent, &topo);
}

#[test]
fn agent_restart_drops_no_flow() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let state = tempfile::tempdir().unwrap();
    let pins = PinDir::new("restart");
    let mut agent = start_agent(&topo, state.path(), &pins, None);
    apply(&agent, &service_yaml(&all_ready(&topo), 30));
    let vip = SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT);
    wait_reachable(&topo, vip);
    let mut long = topo.tcp_open(vip).unwrap();
    let owner = backend_name(&long.exchange("before").unwrap());

    // A bounded request loop runs while the agent is killed and started again.
    const REQUESTS: usize = 2000;
    let failures = std::thread::scope(|scope| {
        let looper = scope.spawn(|| {
            let mut failures = Vec::new();
            for i in 0..REQUESTS {
                if let Err(e) = topo.tcp_request(vip, &format!("loop{i}")) {
                    failures.push(format!("request {i}: {e:#}"));
                }
            }
            failures
        });
        std::thread::sleep(Duration::from_millis(300));
        // SIGKILL: the agent gets no chance to clean up or hand over.
        agent.kill();
        std::thread::sleep(Duration::from_millis(300));
        agent = start_agent(&topo, state.path(), &pins, None);
        looper.join().unwrap()
    });
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    let reply = long.exchange("after").unwrap();
    assert_eq!(
        backend_name(&reply),
        owner,
        "the long-lived connection survived"
    );
    // The restarted agent still carries the service.
    tcp_spread(&topo, vip, 20);
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
    apply(&agent, &service_yaml(&all_ready(&topo), 30));

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
    rune_agent_tests::agent::eventually(PATIENCE, "the VIP answers", || {
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

    let out = rune_agent_tests::agent::cli_in(
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
