//! The end-to-end VIP scenarios, run over every production data plane mode (eBPF
//! with tc and with XDP, nftables, the userspace proxies): a production agent in
//! the node namespace of a [`Topology`] carries service `web` from the client
//! namespace to three backends in their own namespaces (in
//! [`backends_sharing_an_address`], two of them in one namespace on two ports).
//!
//! Where a mode cannot do what the others do, the scenario checks the documented
//! behaviour instead (see [`Mode`]): the userspace proxy accepts and closes the
//! connections of a service without endpoints (no reset, no ICMP), and its
//! proxied connections end with the agent process. What only one mode has lives in
//! that mode's file: `ebpf_vip.rs` (socket LB, pins), `nftables.rs` (the table's
//! exact content, affinity), `userspace_vip.rs` (VIP addresses, the backend's view).
//!
//! Needs root. Each test builds its own namespaces (and pin directory) and removes
//! them on drop; traffic goes only to 198.18.0.0/15 and fd00::/8 inside them. Tests
//! run one at a time (they share the CPU with the agent they start).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    sync::Mutex,
    time::{Duration, Instant},
};

use rune_agent_tests::{
    modes::{
        Ep, Mode, ModeAgent, TCP_PORT, UDP_PORT, VIP4, VIP6, all_ready,
        assert_empty_service_refuses, web_yaml,
    },
    vip::{
        BACKEND_PORT, PATIENCE, assert_balanced, assert_held_flows_stay,
        assert_terminating_gets_no_new_flows, backend_name, hold_one_per_backend, tcp_spread,
        topology, wait_reachable,
    },
};
use rune_harness::{
    agent::{eventually, metric},
    netns::require_root,
    topology::{Topology, TopologyConfig},
};

/// One test at a time: each starts a privileged agent and its own topology.
static SERIAL: Mutex<()> = Mutex::new(());

/// Instantiates `scenario(mode)` as one test per mode, in a module named after it.
macro_rules! per_mode {
    ($scenario:ident: $($test:ident => $mode:expr),+ $(,)?) => {
        mod $scenario {
            $(
                #[test]
                fn $test() {
                    super::$scenario($mode);
                }
            )+
        }
    };
}

per_mode!(balanced_for_tcp_udp_and_ipv6:
    ebpf_tc => super::Mode::Ebpf,
    ebpf_xdp => super::Mode::EbpfXdp,
    nftables => super::Mode::Nftables,
    userspace => super::Mode::Userspace,
);
per_mode!(direct_after_vip_from_the_same_port:
    ebpf_tc => super::Mode::Ebpf,
    ebpf_xdp => super::Mode::EbpfXdp,
);
per_mode!(terminating_then_deleted_then_empty:
    ebpf => super::Mode::Ebpf,
    nftables => super::Mode::Nftables,
    userspace => super::Mode::Userspace,
);
per_mode!(backends_sharing_an_address:
    ebpf_tc => super::Mode::Ebpf,
    ebpf_xdp => super::Mode::EbpfXdp,
    nftables => super::Mode::Nftables,
    userspace => super::Mode::Userspace,
);
per_mode!(kill_and_restart_during_a_request_loop:
    ebpf => super::Mode::Ebpf,
    nftables => super::Mode::Nftables,
    userspace => super::Mode::Userspace,
);

/// 300 TCP connections, 300 UDP requests and 300 IPv6 connections through the VIPs
/// all succeed, see the VIP as their peer and spread 20–47 % per backend; the agent
/// counts exactly the VIP connections; non-VIP traffic between the same namespaces
/// is untouched; `status` names the mode; without endpoints the service refuses.
fn balanced_for_tcp_udp_and_ipv6(mode: Mode) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let m = ModeAgent::start(mode, &topo);
    m.apply(&web_yaml(&all_ready(&topo)));
    let vip4 = SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT);
    wait_reachable(&topo, vip4);

    let flows_before = mode.new_tcp_flows(m.agent());
    let per = tcp_spread(&topo, vip4, 300);
    assert_balanced(&per, 300, 3);

    // From the client's address the VIP flows came from (their ports may be reused:
    // see `direct_after_vip_from_the_same_port`).
    for b in topo.backends() {
        let direct = SocketAddr::new(b.addr().v4.into(), BACKEND_PORT);
        let (reply, peer, _) = topo.tcp_request(direct, "direct").unwrap();
        assert_eq!(
            backend_name(&reply),
            b.name(),
            "non-VIP traffic is not translated"
        );
        assert_eq!(peer, direct);
    }
    assert_eq!(
        mode.new_tcp_flows(m.agent()),
        flows_before + 300.0,
        "the agent counts exactly the VIP connections"
    );

    // UDP: each request from a fresh socket is a new flow; replies come from the VIP.
    let udp_vip = SocketAddr::new(VIP4.parse().unwrap(), UDP_PORT);
    let mut per_udp = BTreeMap::new();
    for i in 0..300 {
        let (reply, from) = topo
            .udp_request(udp_vip, format!("q{i}").as_bytes())
            .unwrap_or_else(|e| panic!("UDP request {i}: {e:#}"));
        assert_eq!(from, udp_vip, "the reply must come from the VIP");
        *per_udp
            .entry(backend_name(&String::from_utf8_lossy(&reply)))
            .or_insert(0) += 1;
    }
    assert_balanced(&per_udp, 300, 3);

    let vip6 = SocketAddr::new(VIP6.parse().unwrap(), TCP_PORT);
    assert_balanced(&tcp_spread(&topo, vip6, 300), 300, 3);

    let status = m.agent().cli(&["status"], None);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains(&format!("data plane: {}", mode.dataplane())),
        "{text}"
    );
    if matches!(mode, Mode::Ebpf | Mode::EbpfXdp) {
        for program in [
            "rune_tc_ingress on tc-ingress",
            "rune_tc_egress on tc-egress",
        ] {
            let line = format!("{program} {}", topo.node_client_if());
            assert!(text.contains(&line), "{line}: {text}");
        }
        let xdp = format!("rune_xdp_lb on xdp {}", topo.node_client_if());
        assert_eq!(text.contains(&xdp), mode == Mode::EbpfXdp, "{text}");
    }

    assert_empty_service_refuses(&m);
}

/// The second port backend-1 serves in [`backends_sharing_an_address`].
const SECOND_PORT: u16 = 8081;

/// Two backends in one namespace on two ports (backend-1 on [`BACKEND_PORT`] and
/// [`SECOND_PORT`], its second endpoint overriding `http`) and a third in another
/// (backend-2): TCP over both VIPs spreads 20–47 % over all three; UDP, where the
/// two meet on one port, reaches both namespaces; eBPF counts each in its own
/// `backend` series; the second one terminating gets no new flows while its
/// neighbour on the same address still does, and every held flow stays.
fn backends_sharing_an_address(mode: Mode) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = Topology::with_config(&TopologyConfig {
        backends: 2,
        tcp_port: Some(BACKEND_PORT),
        udp_port: Some(BACKEND_PORT),
        extra_tcp_ports: vec![SECOND_PORT],
        ..TopologyConfig::default()
    })
    .unwrap();
    let m = ModeAgent::start(mode, &topo);
    let endpoints = |second_terminating: bool| -> Vec<Ep> {
        let mut eps = all_ready(&topo);
        for address in topo.backends()[0].addr().both() {
            eps.push(Ep {
                address,
                terminating: second_terminating,
                http_port: Some(SECOND_PORT),
            });
        }
        eps
    };
    m.apply(&web_yaml(&endpoints(false)));
    let first = topo.backends()[0].name().to_owned();
    let second = format!("{first}:{SECOND_PORT}");
    for vip in [VIP4, VIP6] {
        let vip = SocketAddr::new(vip.parse().unwrap(), TCP_PORT);
        wait_reachable(&topo, vip);
        let per = tcp_spread(&topo, vip, 300);
        assert_balanced(&per, 300, 3);
        assert!(per.contains_key(&second), "{per:?}");
    }
    let udp_vip = SocketAddr::new(VIP4.parse().unwrap(), UDP_PORT);
    let mut udp_served = BTreeSet::new();
    for i in 0..60 {
        let (reply, _) = topo
            .udp_request(udp_vip, format!("q{i}").as_bytes())
            .unwrap_or_else(|e| panic!("UDP request {i}: {e:#}"));
        udp_served.insert(backend_name(&String::from_utf8_lossy(&reply)));
    }
    let namespaces: BTreeSet<String> = topo.backends().iter().map(|b| b.name().into()).collect();
    assert_eq!(udp_served, namespaces);
    if matches!(mode, Mode::Ebpf | Mode::EbpfXdp) {
        let text = m.agent().metrics_text();
        for port in [BACKEND_PORT, SECOND_PORT] {
            let series = format!(
                "rune_dataplane_backend_flows_total{{backend=\"{}:{port}\"}}",
                topo.backends()[0].addr().v4
            );
            let flows = metric(&text, &series).unwrap_or(0.0);
            assert!(flows >= 1.0, "{series} = {flows}: {text}");
        }
    }

    let vip = SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT);
    let mut long = hold_one_per_backend(&topo, vip, 3);
    m.apply(&web_yaml(&endpoints(true)));
    assert_terminating_gets_no_new_flows(&topo, vip, &second, &mut long);
    let per = tcp_spread(&topo, vip, 60);
    assert!(
        per.contains_key(&first),
        "its neighbour on the same address still gets new flows: {per:?}"
    );
}

/// A client connects to the VIP from a fixed address and port and closes; then
/// connects from the same address and port directly to the backend that served it:
/// the direct connection works and sees the backend as its peer (the VIP flow's
/// conntrack entry must not translate the backend's SYN-ACK). IPv4 and IPv6.
fn direct_after_vip_from_the_same_port(mode: Mode) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let m = ModeAgent::start(mode, &topo);
    m.apply(&web_yaml(&all_ready(&topo)));
    for (vip, port) in [(VIP4, 41234), (VIP6, 41235)] {
        let vip = SocketAddr::new(vip.parse().unwrap(), TCP_PORT);
        wait_reachable(&topo, vip);
        let src = SocketAddr::new(topo.client_addr().like(vip.ip()), port);
        let exchange = |to: SocketAddr, what: &str| {
            let mut conn = topo
                .tcp_open_from_port(Some(src), to)
                .unwrap_or_else(|e| panic!("{what}: {e:#}"));
            let reply = conn
                .exchange(what)
                .unwrap_or_else(|e| panic!("{what}: {e:#}"));
            (backend_name(&reply), conn.peer_addr)
        };
        let (served, peer) = exchange(vip, "through the VIP");
        assert_eq!(peer, vip);
        let backend = topo
            .backends()
            .iter()
            .find(|b| b.name() == served)
            .unwrap_or_else(|| panic!("served by {served}"));
        let direct = SocketAddr::new(backend.addr().like(vip.ip()), BACKEND_PORT);
        let (name, peer) = exchange(direct, "direct");
        assert_eq!((name.as_str(), peer), (served.as_str(), direct), "{mode:?}");
    }
}

/// A backend marked terminating gets no new flows while established connections
/// (one at least on every backend) keep exchanging data; once it is deleted,
/// traffic continues on the other two and their flows stay; an empty endpoint list
/// refuses.
fn terminating_then_deleted_then_empty(mode: Mode) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let m = ModeAgent::start(mode, &topo);
    m.apply(&web_yaml(&all_ready(&topo)));
    let vip = SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT);
    wait_reachable(&topo, vip);

    let mut long = hold_one_per_backend(&topo, vip, 3);

    let victim = topo.backends()[0].name().to_owned();
    let victim_addrs = topo.backends()[0].addr().both();
    let mut eps = all_ready(&topo);
    for e in &mut eps {
        e.terminating = victim_addrs.contains(&e.address);
    }
    m.apply(&web_yaml(&eps));
    assert_terminating_gets_no_new_flows(&topo, vip, &victim, &mut long);

    let rest: Vec<Ep> = all_ready(&topo)
        .into_iter()
        .filter(|e| !victim_addrs.contains(&e.address))
        .collect();
    m.apply(&web_yaml(&rest));
    eventually(PATIENCE, "the deleted backend gets no new flows", || {
        (!tcp_spread(&topo, vip, 30).contains_key(&victim)).then_some(())
    });
    let per = tcp_spread(&topo, vip, 60);
    assert_eq!(per.len(), 2, "{per:?}");
    assert_held_flows_stay(
        long.iter_mut().filter(|(n, _)| *n != victim),
        "after-delete",
    );

    assert_empty_service_refuses(&m);
}

/// While a request loop runs (bounded in count and time) and a long-lived
/// connection stays open, the agent is killed with SIGKILL and started again.
/// Kernel modes: no request fails and the long-lived connection survives on its
/// backend. Userspace (documented): requests fail only between the kill and the
/// restarted agent being ready, and the proxied connection ends with the process.
/// Afterwards the restarted agent balances as before.
fn kill_and_restart_during_a_request_loop(mode: Mode) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let mut m = ModeAgent::start(mode, &topo);
    m.apply(&web_yaml(&all_ready(&topo)));
    let vip = SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT);
    wait_reachable(&topo, vip);
    let mut long = topo.tcp_open(vip).unwrap();
    let owner = backend_name(&long.exchange("before").unwrap());

    let run = run_loop_across_restart(&topo, vip, &mut m);
    eprintln!(
        "{mode:?} restart: {} requests, {} failed, kill→ready {:?}, {} after ready",
        run.outcomes.len(),
        run.failures().count(),
        run.ready_at - run.killed_at,
        run.outcomes.iter().filter(|o| o.0 > run.ready_at).count(),
    );
    assert!(
        run.outcomes.iter().any(|o| o.0 > run.ready_at),
        "the loop ran past the restart"
    );
    if mode.flows_outlive_the_agent() {
        let failures: Vec<_> = run.failures().collect();
        assert!(
            failures.is_empty(),
            "{} failed: {failures:?}",
            failures.len()
        );
        let reply = long.exchange("after").unwrap();
        assert_eq!(
            backend_name(&reply),
            owner,
            "the long-lived connection survived"
        );
    } else {
        for (start, end, _) in run.failures() {
            assert!(
                *end >= run.killed_at && *start <= run.ready_at,
                "a failure outside the restart window [kill, ready] = [0, {:?}]: {:?} → {:?} after the kill",
                run.ready_at - run.killed_at,
                start.checked_duration_since(run.killed_at),
                end.checked_duration_since(run.killed_at),
            );
        }
        assert!(
            long.exchange("after").is_err(),
            "a proxied connection survived kill -9"
        );
    }
    assert_balanced(&tcp_spread(&topo, vip, 300), 300, 3);
}

/// The requests of [`run_loop_across_restart`]: (started, ended, succeeded).
struct LoopRun {
    outcomes: Vec<(Instant, Instant, bool)>,
    killed_at: Instant,
    ready_at: Instant,
}

impl LoopRun {
    fn failures(&self) -> impl Iterator<Item = &(Instant, Instant, bool)> {
        self.outcomes.iter().filter(|o| !o.2)
    }
}

/// Sequential requests to `vip` (at most 20,000, at most 60 s) while `m`'s agent
/// is killed after 300 ms and started again; the loop stops 500 ms after the
/// restarted agent is ready.
fn run_loop_across_restart(topo: &Topology, vip: SocketAddr, m: &mut ModeAgent<'_>) -> LoopRun {
    const MAX_REQUESTS: usize = 20_000;
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let looper = scope.spawn(|| {
            let mut outcomes = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(60);
            for i in 0..MAX_REQUESTS {
                if stop.load(std::sync::atomic::Ordering::SeqCst) || Instant::now() > deadline {
                    break;
                }
                let started = Instant::now();
                let ok = topo.tcp_request(vip, &format!("loop{i}")).is_ok();
                outcomes.push((started, Instant::now(), ok));
                if !ok {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            outcomes
        });
        std::thread::sleep(Duration::from_millis(300));
        let killed_at = Instant::now();
        m.kill();
        std::thread::sleep(Duration::from_millis(300));
        m.restart();
        let ready_at = Instant::now();
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        LoopRun {
            outcomes: looper.join().unwrap(),
            killed_at,
            ready_at,
        }
    })
}
