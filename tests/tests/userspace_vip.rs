//! The userspace data plane in production (`run --dataplane userspace`, no `--dev`)
//! end to end: the agent in the node namespace of a [`Topology`] adds each VIP to the
//! node's `lo` and proxies VIP:port from the client namespace to the backends.
//!
//! Where this mode cannot do what the eBPF one does, the tests check the documented
//! behaviour instead: the backend sees the node's address (the proxy opens its own
//! connection), not the client's; and a `kill -9` of the agent ends the proxied
//! connections (they live in the agent process), while a restarted agent adopts the
//! VIP addresses the killed one left and serves again.
//!
//! Needs root. Each test builds its own namespaces and removes them on drop; traffic
//! goes only to 198.18.0.0/15 and fd00::/8 inside them. Tests run one at a time.

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener},
    path::Path,
    sync::Mutex,
    time::{Duration, Instant},
};

use rune_agent_tests::{
    agent::{Agent, eventually, metric},
    netns::{NetNs, require_root},
    topology::{CLIENT_TIMEOUT, Topology},
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
/// The VIP of the second service, which the test itself puts on `lo` beforehand.
const THEIR_VIP: &str = "198.18.100.30";
const TCP_PORT: u16 = 80;
const UDP_PORT: u16 = 53;
/// A server on backend-1 that answers with the peer address it sees.
const PEER_PORT: u16 = 9090;

/// One endpoint line of the Endpoints document.
struct Ep {
    address: IpAddr,
    terminating: bool,
}

fn service_yaml(endpoints: &[Ep]) -> String {
    let mut eps = String::new();
    for e in endpoints {
        eps.push_str(&format!(
            "    - {{address: \"{}\", node: node-b, ready: true, terminating: {}}}\n",
            e.address, e.terminating
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
  drainSeconds: 30
---
apiVersion: rune/v1
kind: Endpoints
metadata: {{name: web}}
spec:
  endpoints:
{eps}"
    )
}

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

fn all_ready(topo: &Topology) -> Vec<Ep> {
    topo.backends()
        .iter()
        .flat_map(|b| b.addr().both())
        .map(|address| Ep {
            address,
            terminating: false,
        })
        .collect()
}

/// A production agent in the userspace mode in the node namespace.
fn start_agent(topo: &Topology, state: &Path) -> Agent {
    let mut agent = Agent::start_in(
        topo.node(),
        state,
        &[
            "--dataplane",
            "userspace",
            "--maglev-table-size",
            "1021",
            // A start removes what other modes left: never the default pin dir.
            "--bpf-pin-dir",
            &format!("/sys/fs/bpf/rune-test-{}-unused", std::process::id()),
        ],
    );
    agent.wait_ready(PATIENCE);
    agent
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

/// Runs `f` (a future of the agent's library) on a runtime inside `node`.
fn block_on_in<T: Send>(node: &NetNs, f: impl Future<Output = T> + Send) -> T {
    node.run(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    })
    .unwrap()
}

/// The addresses on the node's `lo` that carry the agent's mark (iproute2 6.1
/// cannot show `IFA_PROTO` of addresses; the agent's own netlink code reads it).
fn marked_addresses(node: &NetNs) -> Vec<IpAddr> {
    use rune_agent::dataplane::proxy::vip_addrs::{AddressOps as _, NetlinkAddressOps};
    let mut v = block_on_in(node, async { NetlinkAddressOps.list_ours().await }).unwrap();
    v.sort();
    v
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

#[test]
fn vip_traffic_is_proxied_for_tcp_udp_and_ipv6() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let state = tempfile::tempdir().unwrap();
    let agent = start_agent(&topo, state.path());
    apply(&agent, &service_yaml(&all_ready(&topo)));

    let vip4 = SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT);
    wait_reachable(&topo, vip4);
    let series =
        "rune_proxy_connections_total{service=\"default/web\",protocol=\"TCP\",result=\"ok\"}";
    let before = metric(&agent.metrics_text(), series).unwrap_or(0.0);
    let per = tcp_spread(&topo, vip4, 300);
    assert_balanced(&per, 300, 3);
    assert_eq!(
        metric(&agent.metrics_text(), series),
        Some(before + 300.0),
        "the proxy counts exactly the VIP connections"
    );

    // Non-VIP traffic between the same namespaces is untouched (and not counted).
    for b in topo.backends() {
        let direct = SocketAddr::new(b.addr().v4.into(), BACKEND_PORT);
        let (reply, peer, _) = topo.tcp_request(direct, "direct").unwrap();
        assert_eq!(backend_name(&reply), b.name());
        assert_eq!(peer, direct);
    }
    assert_eq!(metric(&agent.metrics_text(), series), Some(before + 300.0));

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

    // The VIPs are host addresses on the node's lo, marked as ours.
    let addrs = lo_addresses(topo.node());
    for (vip, len) in [(VIP4, 32), (VIP6, 128)] {
        assert!(
            addrs.contains(&(vip.to_owned(), len)),
            "{vip}/{len} on lo: {addrs:?}"
        );
    }
    assert_eq!(
        marked_addresses(topo.node()),
        vec![VIP4.parse::<IpAddr>().unwrap(), VIP6.parse().unwrap()],
        "exactly the VIPs carry the agent's mark"
    );

    // Documented difference from the eBPF mode: the backend sees the node's
    // address (the proxy's own connection), not the client's.
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

    let status = agent.cli(&["status"], None);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("data plane: userspace"), "{text}");
}

#[test]
fn terminating_backend_gets_no_new_flows_and_established_flows_stay() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let state = tempfile::tempdir().unwrap();
    let agent = start_agent(&topo, state.path());
    apply(&agent, &service_yaml(&all_ready(&topo)));
    let vip = SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT);
    wait_reachable(&topo, vip);

    // Long-lived connections until every backend holds at least one.
    let mut long = hold_one_per_backend(&topo, vip, 3);

    // backend-1 terminates: no new flows, its established ones keep exchanging.
    let victim = topo.backends()[0].name().to_owned();
    let victim_addrs = topo.backends()[0].addr().both();
    let mut eps = all_ready(&topo);
    for e in &mut eps {
        e.terminating = victim_addrs.contains(&e.address);
    }
    apply(&agent, &service_yaml(&eps));
    assert_terminating_gets_no_new_flows(&topo, vip, &victim, &mut long);

    // backend-1 is deleted: traffic continues on the rest; flows on the others stay.
    let rest: Vec<Ep> = all_ready(&topo)
        .into_iter()
        .filter(|e| !victim_addrs.contains(&e.address))
        .collect();
    apply(&agent, &service_yaml(&rest));
    eventually(PATIENCE, "the deleted backend gets no new flows", || {
        let per = tcp_spread(&topo, vip, 30);
        (!per.contains_key(&victim)).then_some(())
    });
    let per = tcp_spread(&topo, vip, 60);
    assert_eq!(per.len(), 2, "{per:?}");
    assert_held_flows_stay(
        long.iter_mut().filter(|(n, _)| *n != victim),
        "after-delete",
    );

    // An empty endpoint list refuses new connections (accepted, then closed), counted.
    apply(&agent, &service_yaml(&[]));
    let series = "rune_proxy_connections_total{service=\"default/web\",protocol=\"TCP\",result=\"no_backend\"}";
    let before = metric(&agent.metrics_text(), series).unwrap_or(0.0);
    eventually(PATIENCE, "connections to the VIP are refused", || {
        topo.tcp_request(vip, "refused?").is_err().then_some(())
    });
    let after = metric(&agent.metrics_text(), series).unwrap_or(0.0);
    assert!(after > before, "refusals are counted");
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
    let b1 = &topo.backends()[0];
    peer_server(b1.ns(), SocketAddr::new(b1.addr().v4.into(), PEER_PORT));

    let mut agent = start_agent(&topo, state.path());
    apply(&agent, &service_yaml(&all_ready(&topo)));
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
    let mut agent = start_agent(&topo, state.path());
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

/// What a `kill -9` and a restart do to the traffic: the proxied connections end
/// with the process (documented), new connections fail only between the kill and
/// the restarted agent being ready, and the restarted agent adopts the addresses.
#[test]
fn agent_kill_breaks_open_connections_and_restart_adopts_the_vips() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let state = tempfile::tempdir().unwrap();
    let mut agent = start_agent(&topo, state.path());
    apply(&agent, &service_yaml(&all_ready(&topo)));
    let vip = SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT);
    wait_reachable(&topo, vip);
    let mut long = topo.tcp_open(vip).unwrap();
    long.exchange("before").unwrap();

    // A request loop, bounded in count and time, runs across the kill and restart.
    const MAX_REQUESTS: usize = 20_000;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (outcomes, killed_at, ready_at) = std::thread::scope(|scope| {
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
        agent.kill();
        assert!(
            on_lo(topo.node(), VIP4),
            "a killed agent leaves its addresses"
        );
        agent = start_agent(&topo, state.path());
        let ready_at = Instant::now();
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        (looper.join().unwrap(), killed_at, ready_at)
    });
    let failed: Vec<_> = outcomes.iter().filter(|(_, _, ok)| !ok).collect();
    let after_ready = outcomes.iter().filter(|(s, _, _)| *s > ready_at).count();
    eprintln!(
        "restart: {} requests, {} failed, window kill→ready {:?}, {} requests after ready",
        outcomes.len(),
        failed.len(),
        ready_at - killed_at,
        after_ready
    );
    assert!(after_ready > 0, "the loop ran past the restart");
    for (start, end, _) in &failed {
        assert!(
            *end >= killed_at && *start <= ready_at,
            "a failure outside the restart window [kill, ready] = [0, {:?}]: from {:?} to {:?}",
            ready_at - killed_at,
            signed_ms(*start, killed_at),
            signed_ms(*end, killed_at),
        );
    }
    // Documented: the proxied connection ended with the killed process.
    assert!(
        long.exchange("after").is_err(),
        "a proxied connection survived kill -9"
    );
    // The restarted agent adopted the addresses: each once, still marked.
    let addrs = lo_addresses(topo.node());
    assert_eq!(
        addrs.iter().filter(|(a, _)| a == VIP4).count(),
        1,
        "{addrs:?}"
    );
    assert_eq!(
        marked_addresses(topo.node()),
        vec![VIP4.parse::<IpAddr>().unwrap(), VIP6.parse().unwrap()]
    );
    tcp_spread(&topo, vip, 30);
    let status = String::from_utf8_lossy(&agent.cli(&["status"], None).stdout).into_owned();
    assert!(!status.contains("failed"), "{status}");
}

/// `t - origin` in milliseconds (negative when before).
fn signed_ms(t: Instant, origin: Instant) -> f64 {
    match t.checked_duration_since(origin) {
        Some(d) => d.as_secs_f64() * 1e3,
        None => -(origin - t).as_secs_f64() * 1e3,
    }
}
