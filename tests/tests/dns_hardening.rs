//! The embedded DNS server against hostile and unusual input: malformed datagrams,
//! mixed-case names, answers too large for plain UDP.
//!
//! The malformed and mixed-case checks run against the agent binary in dev mode
//! (`rune-agent run --dev --dns-addr 127.0.0.1:PORT`). Large answers need a headless
//! service answering its endpoints' addresses, which only production mode does, and
//! the binary has no production mode yet; so the truncation checks start the same
//! [`DnsServer`] in-process with a production zone. Every datagram and connection
//! goes to loopback only.

use hickory_proto::{
    op::{Edns, Message, MessageType, OpCode, Query, ResponseCode},
    rr::{Name, RData, RecordType},
};
use rune_agent::{
    config::Mode,
    dns::{DnsConfig, DnsServer, DnsState, ForwardConfig, ZoneConfig},
    endpoints::EndpointCache,
    metrics::Metrics,
    model::parse_documents,
    orderedlog::Snapshot,
    subsystem::{StartContext, Subsystem},
};
use rune_agent_tests::dns::exchange_tcp;
use rune_harness::agent::{Agent, eventually, free_port};
use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    str::FromStr,
    sync::Arc,
    time::Duration,
};
use tokio_util::sync::CancellationToken;

const PATIENCE: Duration = Duration::from_secs(20);
/// How long to wait for an answer that may legitimately never come.
const SILENCE: Duration = Duration::from_millis(700);
/// How long a good query may take.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);
const FORMERR: u8 = 1;
const NOTIMP: u8 = 4;

fn query(id: u16, name: &str, rtype: RecordType, edns: Option<u16>) -> Vec<u8> {
    let mut m = Message::new(id, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_str(name).unwrap(), rtype));
    if let Some(size) = edns {
        let mut e = Edns::new();
        e.set_max_payload(size);
        m.edns = Some(e);
    }
    m.to_vec().unwrap()
}

/// Sends one datagram to `server` and returns the reply, if one comes within `wait`.
fn exchange_udp(server: SocketAddr, datagram: &[u8], wait: Duration) -> Option<Vec<u8>> {
    assert!(server.ip().is_loopback(), "tests query loopback only");
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.set_read_timeout(Some(wait)).unwrap();
    sock.send_to(datagram, server).unwrap();
    let mut buf = vec![0u8; 65_535];
    match sock.recv_from(&mut buf) {
        Ok((n, _)) => Some(buf[..n].to_vec()),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            None
        }
        Err(e) => panic!("recv from {server}: {e}"),
    }
}

/// Asks over UDP; panics without an answer.
fn ask_udp(server: SocketAddr, name: &str, rtype: RecordType, edns: Option<u16>) -> Message {
    let q = query(0x4242, name, rtype, edns);
    let r = exchange_udp(server, &q, QUERY_TIMEOUT)
        .unwrap_or_else(|| panic!("no UDP answer for {name} {rtype}"));
    let m = Message::from_vec(&r).unwrap();
    assert_eq!(m.metadata.id, 0x4242);
    m
}

/// Asks over TCP (two-byte length prefix).
fn ask_tcp(server: SocketAddr, name: &str, rtype: RecordType) -> Message {
    let q = query(0x4343, name, rtype, None);
    let m = Message::from_vec(&exchange_tcp(server, &q, QUERY_TIMEOUT)).unwrap();
    assert_eq!(m.metadata.id, 0x4343);
    m
}

/// The A addresses in an answer.
fn a_records(m: &Message) -> Vec<Ipv4Addr> {
    m.answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

/// A 12-byte header: `id`, RD set, one question, no other records.
fn header(id: u16) -> Vec<u8> {
    let mut h = id.to_be_bytes().to_vec();
    h.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    h
}

/// Type A, class IN.
const A_IN: [u8; 4] = [0, 1, 0, 1];

/// A reply to malformed input is acceptable when there is none, or when it is a
/// response with the query's id (when it had one) and FORMERR, or NOTIMP for a
/// datagram whose opcode is not QUERY.
fn assert_formerr_or_silent(what: &str, sent: &[u8], reply: Option<Vec<u8>>) {
    let Some(r) = reply else { return };
    assert!(r.len() >= 12, "{what}: a {}-byte reply", r.len());
    if sent.len() >= 2 {
        assert_eq!(r[..2], sent[..2], "{what}: reply with another id");
    }
    assert!(r[2] & 0x80 != 0, "{what}: the reply is not a response");
    let rcode = r[3] & 0x0f;
    let opcode = sent.get(2).map_or(0, |b| (b >> 3) & 0x0f);
    let ok = rcode == FORMERR || (opcode != 0 && rcode == NOTIMP);
    assert!(
        ok,
        "{what}: rcode {rcode} (opcode {opcode}), reply {r:02x?}"
    );
    let answers = u16::from_be_bytes([r[6], r[7]]);
    assert_eq!(answers, 0, "{what}: a malformed query got answers");
}

/// Deterministic pseudo-random bytes (xorshift64), so a failure reproduces.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

#[test]
fn malformed_queries_get_formerr_or_nothing_and_the_server_keeps_answering() {
    let dir = tempfile::tempdir().unwrap();
    let dns: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let dns_arg = dns.to_string();
    let mut agent = Agent::start(dir.path(), &["--dev", "--dns-addr", &dns_arg]);
    agent.wait_ready(PATIENCE);
    let out = agent.cli(
        &["apply", "-f", "-"],
        Some(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {name: web}\n\
             spec: {ports: [{port: 80}], discovery: {vips: [198.18.100.10]}}\n",
        ),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eventually(PATIENCE, "web.default.rune resolves", || {
        let r = ask_udp(dns, "web.default.rune.", RecordType::A, None);
        (r.metadata.response_code == ResponseCode::NoError && !r.answers.is_empty()).then_some(())
    });
    let still_answers = |after: &str| {
        let r = ask_udp(dns, "web.default.rune.", RecordType::A, None);
        assert_eq!(
            (r.metadata.response_code, a_records(&r)),
            (ResponseCode::NoError, vec![Ipv4Addr::LOCALHOST]),
            "after {after}"
        );
    };

    let mut cases: Vec<(String, Vec<u8>)> = Vec::new();
    for seed in 1..=16u64 {
        let mut bytes = noise(seed, 12 + (seed as usize * 37) % 300);
        // A query, not a response: responses are ignored, which proves nothing.
        bytes[2] &= 0x7f;
        cases.push((format!("random bytes (seed {seed})"), bytes));
    }
    cases.push(("a truncated header".into(), header(0x1111)[..7].to_vec()));
    let mut question_cut = header(0x1112);
    question_cut.extend_from_slice(b"\x03web\x07def");
    cases.push(("a question cut mid-label".into(), question_cut));
    let mut long_label = header(0x2222);
    long_label.push(64);
    long_label.extend_from_slice(&[b'a'; 64]);
    long_label.extend_from_slice(b"\x04rune\x00");
    long_label.extend_from_slice(&A_IN);
    cases.push(("a 64-byte label".into(), long_label));
    let mut self_loop = header(0x3333);
    self_loop.extend_from_slice(&[0xc0, 12]);
    self_loop.extend_from_slice(&A_IN);
    cases.push(("a compression pointer to itself".into(), self_loop));
    let mut two_loop = header(0x3334);
    // 12: label "a", then a pointer back to 12.
    two_loop.extend_from_slice(&[1, b'a', 0xc0, 12]);
    two_loop.extend_from_slice(&A_IN);
    cases.push(("a two-step compression loop".into(), two_loop));
    let mut forward = header(0x3335);
    forward.extend_from_slice(&[0xc0, 200]);
    forward.extend_from_slice(&A_IN);
    cases.push(("a pointer past the end".into(), forward));
    let mut oversized = header(0x4444);
    oversized[5] = 200; // 200 questions claimed
    oversized.extend_from_slice(&noise(99, 65_000));
    cases.push(("a 65,012-byte datagram".into(), oversized));

    for (what, bytes) in &cases {
        let reply = exchange_udp(dns, bytes, SILENCE);
        assert_formerr_or_silent(what, bytes, reply);
        still_answers(what);
    }
    assert_eq!(agent.terminate(PATIENCE), Some(0));
}

#[test]
fn mixed_case_names_answer_and_keep_the_question_as_asked() {
    let dir = tempfile::tempdir().unwrap();
    let dns: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let dns_arg = dns.to_string();
    let mut agent = Agent::start(dir.path(), &["--dev", "--dns-addr", &dns_arg]);
    agent.wait_ready(PATIENCE);
    let out = agent.cli(
        &["apply", "-f", "-"],
        Some(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {name: web, namespace: shop}\n\
             spec: {ports: [{port: 80}], discovery: {vips: [198.18.100.10]}}\n",
        ),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eventually(PATIENCE, "web.shop.rune resolves", || {
        let r = ask_udp(dns, "web.shop.rune.", RecordType::A, None);
        (!r.answers.is_empty()).then_some(())
    });
    for asked in ["WEB.SHOP.RUNE.", "wEb.ShOp.rUnE.", "Web.Shop.Rune."] {
        let q = query(0x6161, asked, RecordType::A, None);
        let raw = exchange_udp(dns, &q, QUERY_TIMEOUT).expect("no UDP answer");
        // Resolvers using 0x20 case randomization compare the question byte for
        // byte: it comes back exactly as sent (header aside).
        assert_eq!(
            raw.get(12..q.len()),
            Some(&q[12..]),
            "{asked}: question changed"
        );
        let r = Message::from_vec(&raw).unwrap();
        assert_eq!(r.metadata.response_code, ResponseCode::NoError, "{asked}");
        assert_eq!(a_records(&r), [Ipv4Addr::LOCALHOST], "{asked}");
        let tcp = ask_tcp(dns, asked, RecordType::A);
        assert_eq!(a_records(&tcp), [Ipv4Addr::LOCALHOST], "{asked} over TCP");
    }
    let nx = ask_udp(dns, "NOPE.Shop.RUNE.", RecordType::A, None);
    assert_eq!(nx.metadata.response_code, ResponseCode::NXDomain);
    assert_eq!(agent.terminate(PATIENCE), Some(0));
}

/// Ready endpoints of the headless service in [`large_answers_truncate_over_udp_and_come_whole_over_tcp`]:
/// 100 A records (1,600 bytes of RDATA and more with owner names) cannot fit 512 bytes.
const ENDPOINTS: u8 = 100;

#[test]
fn large_answers_truncate_over_udp_and_come_whole_over_tcp() {
    let mut endpoints = String::from(
        "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: db}\nspec:\n  endpoints:\n",
    );
    for i in 1..=ENDPOINTS {
        endpoints.push_str(&format!("    - {{address: 198.18.2.{i}, ready: true}}\n"));
    }
    let yaml = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: db}}\n\
         spec: {{discovery: {{headless: true}}}}\n---\n{endpoints}"
    );
    let cache = Arc::new(EndpointCache::new());
    cache.apply_snapshot(&Snapshot {
        revision: 1,
        objects: parse_documents(&yaml).unwrap(),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = DnsServer::new(
        DnsConfig {
            addrs: vec!["127.0.0.1:0".parse().unwrap()],
            zone: ZoneConfig {
                domain: "rune.".into(),
                ttl: 5,
                mode: Mode::Production,
                dev_port_offset: 0,
            },
            // No upstreams: nothing is ever forwarded from this test.
            forward: ForwardConfig::default(),
        },
        cache,
        Arc::new(Metrics::new()),
    )
    .unwrap();
    let cancel = CancellationToken::new();
    rt.block_on(async {
        server
            .start(&StartContext::new(cancel.clone(), Mode::Production))
            .await
            .unwrap();
        tokio::time::timeout(PATIENCE, server.ready().wait())
            .await
            .unwrap();
    });
    let DnsState::Serving { addrs, .. } = server.state() else {
        panic!("{:?}", server.state())
    };
    let dns = addrs[0];
    let name = "db.default.rune.";
    let expected: Vec<Ipv4Addr> = (1..=ENDPOINTS)
        .map(|i| Ipv4Addr::new(198, 18, 2, i))
        .collect();
    let sorted = |mut v: Vec<Ipv4Addr>| {
        v.sort();
        v
    };

    // Plain UDP: at most 512 bytes, TC set, so the client retries over TCP.
    let q = query(0x5151, name, RecordType::A, None);
    let raw = exchange_udp(dns, &q, QUERY_TIMEOUT).expect("no UDP answer");
    assert!(
        raw.len() <= 512,
        "{}-byte UDP answer without EDNS",
        raw.len()
    );
    let udp = Message::from_vec(&raw).unwrap();
    assert_eq!(udp.metadata.response_code, ResponseCode::NoError);
    assert!(udp.metadata.truncation, "TC not set on a truncated answer");
    assert!(udp.answers.len() < usize::from(ENDPOINTS));

    // TCP: the whole answer.
    let tcp = ask_tcp(dns, name, RecordType::A);
    assert!(!tcp.metadata.truncation);
    assert_eq!(sorted(a_records(&tcp)), expected);

    // EDNS(0) with room for it: the whole answer over UDP.
    let edns = ask_udp(dns, name, RecordType::A, Some(4096));
    assert!(!edns.metadata.truncation, "truncated despite EDNS 4096");
    assert_eq!(sorted(a_records(&edns)), expected);
    assert!(edns.edns.is_some(), "an EDNS query gets an EDNS answer");

    // EDNS(0) with a small payload size: truncated to fit it.
    let q = query(0x5252, name, RecordType::A, Some(600));
    let raw = exchange_udp(dns, &q, QUERY_TIMEOUT).expect("no UDP answer");
    assert!(raw.len() <= 600, "{}-byte answer for EDNS 600", raw.len());
    assert!(Message::from_vec(&raw).unwrap().metadata.truncation);

    cancel.cancel();
    rt.block_on(async {
        tokio::time::timeout(PATIENCE, server.stop())
            .await
            .unwrap()
            .unwrap();
    });
}
