//! The embedded DNS server end to end in dev mode: start `rune-agent run --dev
//! --dns-addr 127.0.0.1:PORT`, apply services, and ask the agent with raw DNS
//! messages over UDP and TCP. Every query goes to the agent on loopback, never to
//! the system's resolvers.

use hickory_proto::{
    op::{Message, MessageType, OpCode, Query, ResponseCode},
    rr::{Name, RData, RecordType},
};
use rune_agent_tests::dns::exchange_tcp;
use rune_harness::agent::{Agent, eventually, free_port, metric};
use std::{
    net::{IpAddr, SocketAddr, UdpSocket},
    str::FromStr,
    time::{Duration, Instant},
};

const PATIENCE: Duration = Duration::from_secs(20);
/// How long one query may take before it counts as lost.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

fn query_message(name: &str, rtype: RecordType) -> Message {
    let mut m = Message::new(rand_id(), MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_str(name).unwrap(), rtype));
    m
}

fn rand_id() -> u16 {
    (std::process::id() as u16) ^ (Instant::now().elapsed().subsec_nanos() as u16)
}

/// Asks `server` over UDP; panics on timeout or a mismatched id.
fn ask_udp(server: SocketAddr, name: &str, rtype: RecordType) -> Message {
    assert!(server.ip().is_loopback(), "tests query loopback only");
    let q = query_message(name, rtype);
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.set_read_timeout(Some(QUERY_TIMEOUT)).unwrap();
    sock.send_to(&q.to_vec().unwrap(), server).unwrap();
    let mut buf = [0u8; 4096];
    let (n, _) = sock
        .recv_from(&mut buf)
        .unwrap_or_else(|e| panic!("no UDP answer for {name} {rtype}: {e}"));
    let r = Message::from_vec(&buf[..n]).unwrap();
    assert_eq!(r.metadata.id, q.metadata.id);
    r
}

/// Asks `server` over TCP (two-byte length prefix).
fn ask_tcp(server: SocketAddr, name: &str, rtype: RecordType) -> Message {
    let q = query_message(name, rtype).to_vec().unwrap();
    Message::from_vec(&exchange_tcp(server, &q, QUERY_TIMEOUT)).unwrap()
}

fn addresses(m: &Message) -> Vec<IpAddr> {
    m.answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(IpAddr::V4(a.0)),
            RData::AAAA(a) => Some(IpAddr::V6(a.0)),
            _ => None,
        })
        .collect()
}

fn service(name: &str, vip: &str) -> String {
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
         spec: {{ports: [{{name: http, port: 80}}], discovery: {{vips: [{vip}]}}}}\n"
    )
}

fn apply(agent: &Agent, yaml: &str) {
    let out = agent.cli(&["apply", "-f", "-"], Some(yaml));
    assert!(
        out.status.success(),
        "apply failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn dev_mode_dns_answers_services_and_follows_changes() {
    let dir = tempfile::tempdir().unwrap();
    let dns: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let dns_arg = dns.to_string();
    // No upstreams: an empty resolv.conf instead of the system's.
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(&resolv, "").unwrap();
    let resolv_arg = resolv.to_str().unwrap();
    let mut agent = Agent::start(
        dir.path(),
        &[
            "--dev",
            "--dev-port-offset",
            "10000",
            "--dns-addr",
            &dns_arg,
            "--dns-resolv-conf",
            resolv_arg,
        ],
    );
    agent.wait_ready(PATIENCE);
    let status = agent.cli(&["status"], None);
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains(&format!(
            "dns:        serving on {dns}; no upstream, other names refused"
        )),
        "{status}"
    );

    apply(&agent, &service("web", "198.18.100.10"));
    let a = eventually(PATIENCE, "web.default.rune resolves", || {
        let r = ask_udp(dns, "web.default.rune.", RecordType::A);
        (r.metadata.response_code == ResponseCode::NoError && !r.answers.is_empty()).then_some(r)
    });
    // Dev mode: where the dev proxies listen, not the VIP.
    assert_eq!(addresses(&a), ["127.0.0.1".parse::<IpAddr>().unwrap()]);
    assert!(a.metadata.authoritative);
    assert_eq!(a.answers[0].ttl, 5);

    // Case-insensitive; no AAAA in dev mode (empty NOERROR with the SOA).
    let upper = ask_udp(dns, "WEB.Default.RUNE.", RecordType::A);
    assert_eq!(addresses(&upper), addresses(&a));
    let aaaa = ask_udp(dns, "web.default.rune.", RecordType::AAAA);
    assert_eq!(aaaa.metadata.response_code, ResponseCode::NoError);
    assert!(aaaa.answers.is_empty());
    assert_eq!(aaaa.authorities[0].record_type(), RecordType::SOA);

    // SRV over TCP, with the dev port.
    let srv = ask_tcp(dns, "_http._tcp.web.default.rune.", RecordType::SRV);
    match &srv.answers[..] {
        [r] => match &r.data {
            RData::SRV(s) => {
                assert_eq!(s.port, 10080);
                assert_eq!(s.target, Name::from_str("web.default.rune.").unwrap());
            }
            other => panic!("{other:?}"),
        },
        other => panic!("expected one SRV record, got {other:?}"),
    }

    let nx = ask_udp(dns, "nope.default.rune.", RecordType::A);
    assert_eq!(nx.metadata.response_code, ResponseCode::NXDomain);
    assert_eq!(nx.authorities[0].record_type(), RecordType::SOA);
    // Outside the zone with no upstream: refused.
    let out = ask_udp(dns, "example.com.", RecordType::A);
    assert_eq!(out.metadata.response_code, ResponseCode::Refused);
    // The zone holds IN data only: a CHAOS-class question for a service is refused,
    // not answered with its IN address.
    let mut chaos = query_message("web.default.rune.", RecordType::A);
    chaos.queries[0].set_query_class(hickory_proto::rr::DNSClass::CH);
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.set_read_timeout(Some(QUERY_TIMEOUT)).unwrap();
    sock.send_to(&chaos.to_vec().unwrap(), dns).unwrap();
    let mut buf = [0u8; 4096];
    let (n, _) = sock.recv_from(&mut buf).expect("an answer to a CH query");
    let r = Message::from_vec(&buf[..n]).unwrap();
    assert_eq!(r.metadata.response_code, ResponseCode::Refused);
    assert!(r.answers.is_empty(), "{r:?}");

    // A new service resolves soon after `apply` returns. The issue's 100 ms figure
    // is a performance target for `cargo xtask bench`; a timed assertion here would
    // fail on a loaded CI machine (docs/testing.md), so the bound is loose.
    let before = ask_udp(dns, "api.default.rune.", RecordType::A);
    assert_eq!(before.metadata.response_code, ResponseCode::NXDomain);
    apply(&agent, &service("api", "198.18.100.11"));
    let applied = Instant::now();
    let bound = Duration::from_secs(2);
    loop {
        let r = ask_udp(dns, "api.default.rune.", RecordType::A);
        if r.metadata.response_code == ResponseCode::NoError && !r.answers.is_empty() {
            break;
        }
        assert!(
            applied.elapsed() < bound,
            "api.default.rune did not resolve within {bound:?} of apply: {:?}",
            r.metadata.response_code
        );
        std::thread::sleep(Duration::from_millis(2));
    }

    // Deleting it makes the name go away again.
    let out = agent.cli(&["delete", "service", "api"], None);
    assert!(out.status.success());
    eventually(
        PATIENCE,
        "api.default.rune is NXDOMAIN after delete",
        || {
            let r = ask_udp(dns, "api.default.rune.", RecordType::A);
            (r.metadata.response_code == ResponseCode::NXDomain).then_some(())
        },
    );

    let text = agent.metrics_text();
    let ok = metric(
        &text,
        r#"rune_dns_queries_total{type="A",rcode="NOERROR",zone="rune"}"#,
    )
    .unwrap_or(0.0);
    assert!(ok >= 3.0, "{text}");
    let refused = metric(
        &text,
        r#"rune_dns_queries_total{type="A",rcode="REFUSED",zone="other"}"#,
    );
    assert_eq!(refused, Some(1.0), "{text}");
    assert_eq!(agent.terminate(PATIENCE), Some(0));
}

#[test]
fn dev_mode_runs_without_dns_when_the_address_is_taken() {
    let dir = tempfile::tempdir().unwrap();
    let taken = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let mut agent = Agent::start(dir.path(), &["--dev", "--dns-addr", &addr]);
    agent.wait_ready(PATIENCE);
    let status = agent.cli(&["status"], None);
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains(&format!("dns:        off: bind udp {addr}:")),
        "{status}"
    );
    assert_eq!(agent.terminate(PATIENCE), Some(0));
}
