//! Network policy end to end (`spec.networkPolicy`, docs/policy.md): an agent in the
//! node namespace of a [`Topology`] guards the backends (their endpoints name no
//! node, so they count as this node's) and the test dials from the client's two
//! addresses and from the backends. nftables mode enforces VIP and direct traffic
//! both ways; the userspace proxies check the VIP path only.
//!
//! A dropped connection attempt waits out the client timeout (drop, not reject,
//! as policy drops are silent): the tests keep such probes few.
//!
//! Needs root. Each test builds its own namespaces and removes them on drop;
//! traffic goes only to 198.18.0.0/15 inside them. Tests run one at a time.

use std::{
    net::{IpAddr, SocketAddr, TcpStream},
    sync::Mutex,
    time::Duration,
};

use rune_agent_tests::{
    modes::{Mode, ModeAgent, TCP_PORT, UDP_PORT, VIP4, VIP6, is_refused},
    observe::first_event,
    vip::{BACKEND_PORT, PATIENCE, topology, wait_reachable},
};
use rune_harness::{
    agent::{eventually, metric},
    netns::require_root,
    topology::Topology,
};

/// One test at a time: each starts a privileged agent and its own topology.
static SERIAL: Mutex<()> = Mutex::new(());

/// The VIP of service `db`.
const DB_VIP: &str = "198.18.100.20";

/// Service `name` on `vip` (http 80→8080/TCP, dns 53→8080/UDP) with `policy` (flow
/// YAML; empty for none) and endpoints at `addrs` naming no node.
fn service(name: &str, vip: &str, policy: &str, addrs: &[IpAddr]) -> String {
    let policy = if policy.is_empty() {
        String::new()
    } else {
        format!("  networkPolicy: {policy}\n")
    };
    let eps: Vec<String> = addrs
        .iter()
        .map(|a| format!("{{address: \"{a}\"}}"))
        .collect();
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\nspec:\n  ports:\n    \
         - {{name: http, port: {TCP_PORT}, protocol: TCP, targetPort: {BACKEND_PORT}}}\n    \
         - {{name: dns, port: {UDP_PORT}, protocol: UDP, targetPort: {BACKEND_PORT}}}\n  \
         discovery: {{vips: [\"{vip}\"]}}\n{policy}---\napiVersion: rune/v1\nkind: Endpoints\n\
         metadata: {{name: {name}}}\nspec: {{endpoints: [{}]}}\n",
        eps.join(", ")
    )
}

fn v4(topo: &Topology, i: usize) -> IpAddr {
    IpAddr::V4(topo.backends()[i].addr().v4)
}

fn vip() -> SocketAddr {
    SocketAddr::new(VIP4.parse().unwrap(), TCP_PORT)
}

/// Whether a TCP request from client address `src` to `to` gets an answer.
fn tcp_ok(topo: &Topology, src: IpAddr, to: SocketAddr) -> bool {
    topo.tcp_request_from(Some(src), to, "ping").is_ok()
}

/// Asserts that a TCP request from `src` to `to` is dropped: no answer and no
/// reset (a reset would be the kernel's refusal, not policy).
fn assert_dropped(topo: &Topology, src: IpAddr, to: SocketAddr) {
    match topo.tcp_request_from(Some(src), to, "ping") {
        Ok(reply) => panic!("{src} → {to} was answered: {reply:?}"),
        Err(e) => assert!(
            !is_refused(&e),
            "{src} → {to} was reset, not dropped: {e:#}"
        ),
    }
}

/// The value of policy series `series` (without `rune_`), 0 when absent.
fn policy_metric(m: &ModeAgent<'_>, series: &str) -> f64 {
    metric(&m.agent().metrics_text(), &format!("rune_{series}")).unwrap_or(0.0)
}

/// `rune-agent status` output.
fn status(m: &ModeAgent<'_>) -> String {
    let out = m.agent().cli(&["status"], None);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until `src` reaches `to`.
fn wait_ok(topo: &Topology, src: IpAddr, to: SocketAddr) {
    eventually(PATIENCE, &format!("{src} reaches {to}"), || {
        tcp_ok(topo, src, to).then_some(())
    });
}

/// The [`SERIAL`] guard: held for the whole test.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The two client addresses the tests tell apart: A (the client's own) and B.
fn clients(topo: &Topology) -> (IpAddr, IpAddr) {
    (
        IpAddr::V4(topo.client_addr().v4),
        IpAddr::V4(topo.client_alt_addr().v4),
    )
}

#[test]
fn nftables_a_cidr_rule_admits_one_client_on_the_vip_and_direct_paths() {
    require_root().unwrap();
    let _serial = serial();
    let topo = topology(2);
    let m = ModeAgent::start(Mode::Nftables, &topo);
    let (a, b) = clients(&topo);
    let backends = [v4(&topo, 0), v4(&topo, 1)];
    m.apply(&service(
        "web",
        VIP4,
        &format!("{{ingress: [{{from: [{{cidr: {a}/32}}]}}]}}"),
        &backends,
    ));
    wait_ok(&topo, a, vip());
    for backend in backends {
        assert!(
            tcp_ok(&topo, a, SocketAddr::new(backend, BACKEND_PORT)),
            "A → {backend} direct"
        );
        assert_dropped(&topo, b, SocketAddr::new(backend, BACKEND_PORT));
    }
    assert_dropped(&topo, b, vip());
    let drops = "policy_drops_total{namespace=\"default\",service=\"web\",direction=\"ingress\",reason=\"no_matching_rule\"}";
    assert!(
        policy_metric(&m, drops) >= 3.0,
        "{}",
        m.agent().metrics_text()
    );
    let allows = "policy_allows_total{namespace=\"default\",service=\"web\",direction=\"ingress\"}";
    assert!(policy_metric(&m, allows) >= 3.0);
    assert_eq!(
        policy_metric(&m, "policy_rules{namespace=\"default\",service=\"web\"}"),
        1.0
    );
    let text = status(&m);
    assert!(
        text.contains("default/web") && text.contains("programmed"),
        "{text}"
    );

    // Port rules: only the dns port (UDP) is allowed now; TCP from A is refused
    // with the reason that a rule names A but not the port.
    m.apply(&service(
        "web",
        VIP4,
        &format!("{{ingress: [{{from: [{{cidr: {a}/32}}], ports: [dns]}}]}}"),
        &backends,
    ));
    // A's UDP passed under the old rules too: wait for TCP to stop passing (the
    // new rules are in), then check UDP still passes and TCP is dropped.
    eventually(PATIENCE, "A's TCP stops passing", || {
        (!tcp_ok(&topo, a, vip())).then_some(())
    });
    let dns = SocketAddr::new(VIP4.parse().unwrap(), UDP_PORT);
    eventually(PATIENCE, "A's UDP passes", || {
        topo.udp_request_from(Some(a), dns, b"q").ok().map(drop)
    });
    assert_dropped(&topo, a, vip());
    let port = "policy_drops_total{namespace=\"default\",service=\"web\",direction=\"ingress\",reason=\"port_not_allowed\"}";
    assert!(
        policy_metric(&m, port) >= 1.0,
        "{}",
        m.agent().metrics_text()
    );

    // Without the policy, B gets through again.
    m.apply(&service("web", VIP4, "", &backends));
    wait_ok(&topo, b, vip());
}

#[test]
fn nftables_ipv6_clients_are_told_apart_too() {
    require_root().unwrap();
    let _serial = serial();
    let topo = topology(1);
    let m = ModeAgent::start(Mode::Nftables, &topo);
    let (a, b) = (
        IpAddr::V6(topo.client_addr().v6),
        IpAddr::V6(topo.client_alt_addr().v6),
    );
    let backend = IpAddr::V6(topo.backends()[0].addr().v6);
    let policy = format!("{{ingress: [{{from: [{{cidr: \"{a}/128\"}}], ports: [http]}}]}}");
    m.apply(&service("web", VIP6, &policy, &[backend]));
    let vip6 = SocketAddr::new(VIP6.parse().unwrap(), TCP_PORT);
    wait_ok(&topo, a, vip6);
    assert!(tcp_ok(&topo, a, SocketAddr::new(backend, BACKEND_PORT)));
    assert_dropped(&topo, b, vip6);
}

#[test]
fn nftables_a_restarted_agent_keeps_the_policy() {
    require_root().unwrap();
    let _serial = serial();
    let topo = topology(1);
    let mut m = ModeAgent::start(Mode::Nftables, &topo);
    let (a, b) = clients(&topo);
    let policy = format!("{{ingress: [{{from: [{{cidr: {a}/32}}], ports: [http]}}]}}");
    m.apply(&service("web", VIP4, &policy, &[v4(&topo, 0)]));
    wait_ok(&topo, a, vip());
    // A killed agent leaves its table; the restart adopts it in one transaction.
    m.kill();
    assert!(tcp_ok(&topo, a, vip()), "the table outlives the agent");
    assert_dropped(&topo, b, vip());
    m.restart();
    assert!(tcp_ok(&topo, a, vip()));
    assert_dropped(&topo, b, vip());
    let text = status(&m);
    assert!(
        text.lines()
            .any(|l| l.contains("default/web  enforce") && l.contains("programmed")),
        "{text}"
    );
}

#[test]
fn nftables_a_service_peer_follows_its_endpoints() {
    require_root().unwrap();
    let _serial = serial();
    let topo = topology(1);
    let m = ModeAgent::start(Mode::Nftables, &topo);
    let (a, b) = clients(&topo);
    let backend = SocketAddr::new(v4(&topo, 0), BACKEND_PORT);
    m.apply(&service("api", "198.18.100.30", "", &[a]));
    m.apply(&service("other", "198.18.100.31", "", &[b]));
    m.apply(&service(
        "web",
        VIP4,
        "{ingress: [{from: [{service: api}]}]}",
        &[backend.ip()],
    ));
    wait_ok(&topo, a, vip());
    assert!(tcp_ok(&topo, a, backend));
    assert_dropped(&topo, b, vip());
    // `api`'s endpoint moves to B; web's policy is not touched.
    m.apply(&service("api", "198.18.100.30", "", &[b]));
    wait_ok(&topo, b, vip());
    assert!(tcp_ok(&topo, b, backend));
    assert_dropped(&topo, a, backend);
}

#[test]
fn nftables_a_namespace_peer_admits_its_services_endpoints() {
    require_root().unwrap();
    let _serial = serial();
    let topo = topology(1);
    let m = ModeAgent::start(Mode::Nftables, &topo);
    let (a, b) = clients(&topo);
    // Service `api` in namespace `ops` has client A as its endpoint; B is in no
    // service of `ops`.
    let api = service("api", "198.18.100.30", "", &[a]).replace(
        "metadata: {name: api}",
        "metadata: {namespace: ops, name: api}",
    );
    m.apply(&api);
    m.apply(&service(
        "web",
        VIP4,
        "{ingress: [{from: [{namespace: ops}]}]}",
        &[v4(&topo, 0)],
    ));
    wait_ok(&topo, a, vip());
    assert_dropped(&topo, b, vip());
}

/// A TCP request from backend `from`'s namespace to `to`: whether it was answered.
fn backend_dial(topo: &Topology, from: usize, to: SocketAddr) -> bool {
    topo.backends()[from]
        .ns()
        .run(move || {
            let Ok(mut s) = TcpStream::connect_timeout(&to, Duration::from_secs(2)) else {
                return false;
            };
            use std::io::{Read as _, Write as _};
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let mut buf = [0u8; 64];
            s.write_all(b"ping\n").is_ok() && s.read(&mut buf).is_ok_and(|n| n > 0)
        })
        .unwrap()
}

#[test]
fn nftables_egress_reaches_db_through_its_vip_and_directly_and_nothing_else() {
    require_root().unwrap();
    let _serial = serial();
    let topo = topology(3);
    let m = ModeAgent::start(Mode::Nftables, &topo);
    let (web, db, other) = (v4(&topo, 0), v4(&topo, 1), v4(&topo, 2));
    m.apply(&service("db", DB_VIP, "", &[db]));
    m.apply(&service("other", "198.18.100.31", "", &[other]));
    let db_vip = SocketAddr::new(DB_VIP.parse().unwrap(), TCP_PORT);
    let other_direct = SocketAddr::new(other, BACKEND_PORT);
    eventually(PATIENCE, "web reaches db before the policy", || {
        backend_dial(&topo, 0, db_vip).then_some(())
    });
    assert!(backend_dial(&topo, 0, other_direct));
    m.apply(&service(
        "web",
        VIP4,
        &format!("{{egress: [{{to: [{{service: db}}], ports: [\"{TCP_PORT}\"]}}]}}"),
        &[web],
    ));
    eventually(PATIENCE, "web's egress is guarded", || {
        (!backend_dial(&topo, 0, other_direct)).then_some(())
    });
    assert!(backend_dial(&topo, 0, db_vip), "web → db VIP");
    assert!(
        backend_dial(&topo, 0, SocketAddr::new(db, BACKEND_PORT)),
        "web → db endpoint"
    );
    let egress = "policy_drops_total{namespace=\"default\",service=\"web\",direction=\"egress\",reason=\"no_matching_rule\"}";
    assert!(
        policy_metric(&m, egress) >= 1.0,
        "{}",
        m.agent().metrics_text()
    );
    // Clients still reach web (no ingress rules) and its replies pass.
    wait_ok(&topo, IpAddr::V4(topo.client_addr().v4), vip());
}

#[test]
fn nftables_audit_mode_refuses_nothing_and_counts() {
    require_root().unwrap();
    let _serial = serial();
    let topo = topology(1);
    let m = ModeAgent::start(Mode::Nftables, &topo);
    let (a, b) = clients(&topo);
    m.apply(&service(
        "web",
        VIP4,
        &format!("{{mode: audit, ingress: [{{from: [{{cidr: {a}/32}}]}}]}}"),
        &[v4(&topo, 0)],
    ));
    wait_reachable(&topo, vip());
    let series = "policy_audit_would_drop_total{namespace=\"default\",service=\"web\",direction=\"ingress\"}";
    eventually(PATIENCE, "B's connections pass and are counted", || {
        (tcp_ok(&topo, b, vip()) && policy_metric(&m, series) >= 1.0).then_some(())
    });
    let text = status(&m);
    assert!(
        text.lines().any(|l| l.contains("default/web  audit")),
        "{text}"
    );
}

#[test]
fn nftables_observe_shows_refused_flows_and_audit_would_drops_through_nflog() {
    require_root().unwrap();
    let _serial = serial();
    let topo = topology(1);
    let m = ModeAgent::start(Mode::Nftables, &topo);
    let (a, b) = clients(&topo);
    let backend = v4(&topo, 0);
    let only_a = |mode: &str| {
        format!("{{mode: {mode}, ingress: [{{from: [{{cidr: {a}/32}}], ports: [http]}}]}}")
    };
    m.apply(&service("web", VIP4, &only_a("enforce"), &[backend]));
    wait_ok(&topo, a, vip());
    // B's SYNs from a known port: refused, logged, observed.
    let from = SocketAddr::new(b, 47_001);
    let event = first_event(
        m.state_dir(),
        &["--verdict", "denied", "--service", "web"],
        10,
        || {
            assert!(
                topo.tcp_open_from_port(Some(from), vip()).is_err(),
                "B got through"
            );
        },
    );
    let line = event.to_string();
    assert_eq!(event["verdict"], "denied", "{line}");
    assert_eq!(event["reason"], "no_matching_rule", "{line}");
    assert_eq!(event["direction"], "ingress", "{line}");
    assert_eq!(event["protocol"], "TCP", "{line}");
    assert_eq!(event["namespace"], "default", "{line}");
    assert_eq!(event["service"], "web", "{line}");
    assert_eq!(event["source"], from.to_string(), "{line}");
    // Checked after DNAT: the chosen endpoint, not the VIP.
    assert_eq!(
        event["destination"],
        SocketAddr::new(backend, BACKEND_PORT).to_string(),
        "{line}"
    );
    // A's UDP is a port the rule does not name.
    let dns = SocketAddr::new(VIP4.parse().unwrap(), UDP_PORT);
    let event = first_event(m.state_dir(), &["--verdict", "denied"], 10, || {
        let _ = topo.udp_request_from(Some(a), dns, b"q");
    });
    assert_eq!(event["reason"], "port_not_allowed", "{event}");
    assert_eq!(event["protocol"], "UDP", "{event}");

    // Audit: B passes, and observe shows what would have been dropped.
    m.apply(&service("web", VIP4, &only_a("audit"), &[backend]));
    wait_ok(&topo, b, vip());
    let event = first_event(m.state_dir(), &["--verdict", "audit"], 10, || {
        assert!(tcp_ok(&topo, b, vip()), "audit mode refused B");
    });
    assert_eq!(event["verdict"], "audit", "{event}");
    assert_eq!(event["reason"], "no_matching_rule", "{event}");
    assert!(
        event["source"]
            .as_str()
            .unwrap()
            .starts_with(&b.to_string()),
        "{event}"
    );
    // The overrun counter exists, and a few refusals overran nothing.
    let text = m.agent().metrics_text();
    let lost = metric(
        &text,
        "rune_policy_events_dropped_total{reason=\"buffer_full\"}",
    );
    assert_eq!(lost, Some(0.0), "{text}");
}

#[test]
fn nftables_a_policy_the_kernel_refuses_fails_closed() {
    require_root().unwrap();
    let _serial = serial();
    let topo = topology(1);
    let m = ModeAgent::start_with(Mode::Nftables, &topo, &["--nft-policy-set-size", "1"]);
    let a = IpAddr::V4(topo.client_addr().v4);
    m.apply(&service("web", VIP4, "", &[v4(&topo, 0)]));
    wait_ok(&topo, a, vip());
    // Two prefixes that do not merge: two elements in a set that holds one.
    let policy = format!("{{ingress: [{{from: [{{cidr: {a}/32}}, {{cidr: 198.18.50.0/24}}]}}]}}");
    m.apply(&service("web", VIP4, &policy, &[v4(&topo, 0)]));
    eventually(PATIENCE, "status names the failure", || {
        status(&m).contains("failed").then_some(())
    });
    assert_dropped(&topo, a, vip());
    let series = "policy_drops_total{namespace=\"default\",service=\"web\",direction=\"ingress\",reason=\"policy_unprogrammable\"}";
    assert!(
        policy_metric(&m, series) >= 1.0,
        "{}",
        m.agent().metrics_text()
    );
    // A policy that fits is programmed again.
    let policy = format!("{{ingress: [{{from: [{{cidr: {a}/32}}]}}]}}");
    m.apply(&service("web", VIP4, &policy, &[v4(&topo, 0)]));
    wait_ok(&topo, a, vip());
    let text = status(&m);
    assert!(
        text.lines()
            .any(|l| l.contains("default/web  enforce") && l.contains("programmed")),
        "{text}"
    );
}

#[test]
fn apply_refuses_bad_policies_naming_field_and_value() {
    require_root().unwrap();
    let _serial = serial();
    let topo = topology(1);
    let m = ModeAgent::start(Mode::Nftables, &topo);
    let backend = [v4(&topo, 0)];
    for (policy, expect) in [
        (
            "{ingress: [{from: [{cidr: 198.18.1.2/24}]}]}",
            "spec.networkPolicy.ingress[0].from[0].cidr: 198.18.1.2/24 has host bits set: write 198.18.1.0/24",
        ),
        (
            "{ingress: [{from: [{}]}]}",
            "spec.networkPolicy.ingress[0].from[0]: a peer needs one of",
        ),
        (
            "{ingress: [{ports: [grpc]}]}",
            "spec.networkPolicy.ingress[0].ports[0]: \"grpc\" is neither",
        ),
        (
            "{egress: [{ports: [\"70000\"]}]}",
            "spec.networkPolicy.egress[0].ports[0]: \"70000\": port 70000 is out of range",
        ),
    ] {
        let out = m.agent().cli(
            &["apply", "-f", "-"],
            Some(&service("web", VIP4, policy, &backend)),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{policy} was applied");
        assert!(
            stderr.contains("Service default/web") && stderr.contains(expect),
            "{policy}: {stderr}"
        );
    }
}

#[test]
fn userspace_the_proxy_admits_one_client_through_the_vip() {
    require_root().unwrap();
    let _serial = serial();
    let topo = topology(1);
    let m = ModeAgent::start(Mode::Userspace, &topo);
    let (a, b) = clients(&topo);
    let backend = SocketAddr::new(v4(&topo, 0), BACKEND_PORT);
    m.apply(&service(
        "web",
        VIP4,
        &format!("{{ingress: [{{from: [{{cidr: {a}/32}}]}}]}}"),
        &[backend.ip()],
    ));
    wait_ok(&topo, a, vip());
    // The proxy has accepted B's connection before it can check it: it resets it
    // (the client sees a reset or an unconnected socket, depending on timing).
    assert!(
        topo.tcp_request_from(Some(b), vip(), "ping").is_err(),
        "B got through the VIP"
    );
    let drops = "policy_drops_total{namespace=\"default\",service=\"web\",direction=\"ingress\",reason=\"no_matching_rule\"}";
    assert!(
        policy_metric(&m, drops) >= 1.0,
        "{}",
        m.agent().metrics_text()
    );
    // What the mode does not cover, as status says: B straight to the endpoint.
    assert!(tcp_ok(&topo, b, backend));
    let text = status(&m);
    assert!(
        text.lines().any(|l| l.contains("default/web  enforce")
            && l.contains("partial: userspace mode checks ingress through the VIPs only")),
        "{text}"
    );
}
