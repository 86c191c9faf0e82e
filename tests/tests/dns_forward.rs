//! DNS forwarding end to end in dev mode: the agent forwards names outside its zone
//! to an upstream this test runs on 127.0.0.1 (`--dns-upstream`), caches the
//! answers, falls back to TCP on truncation and fails fast when the upstream is gone
//! or silent. Nothing is sent to the system's resolvers or off loopback.

use hickory_proto::{
    op::{Message, MessageType, OpCode, Query, ResponseCode},
    rr::{
        Name, RData, Record, RecordType,
        rdata::{A, SOA},
    },
};
use rune_harness::agent::{Agent, free_port, metric};
use std::{
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpListener, UdpSocket},
    str::FromStr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

const PATIENCE: Duration = Duration::from_secs(20);

/// A tiny upstream on 127.0.0.1 (UDP and TCP on one port) with a fixed zone:
/// `nx.example.` is NXDOMAIN with an SOA, `truncated.example.` is truncated over UDP
/// and answered in full over TCP, any other name has A 192.0.2.1 with TTL 60.
struct Upstream {
    addr: SocketAddr,
    udp_queries: Arc<AtomicUsize>,
    tcp_queries: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

fn answer(query: &Message, over_tcp: bool) -> Message {
    let mut r = Message::new(query.metadata.id, MessageType::Response, OpCode::Query);
    r.metadata.recursion_desired = query.metadata.recursion_desired;
    r.metadata.recursion_available = true;
    let q = query.queries[0].clone();
    let name = q.name().to_ascii().to_lowercase();
    r.add_query(q.clone());
    if name == "nx.example." {
        r.metadata.response_code = ResponseCode::NXDomain;
        r.add_authority(Record::from_rdata(
            Name::from_str("example.").unwrap(),
            3600,
            RData::SOA(SOA::new(
                Name::from_str("ns.example.").unwrap(),
                Name::from_str("admin.example.").unwrap(),
                1,
                3600,
                600,
                86_400,
                60,
            )),
        ));
    } else if name == "truncated.example." && !over_tcp {
        r.metadata.truncation = true;
    } else {
        r.add_answer(Record::from_rdata(
            q.name().clone(),
            60,
            RData::A(A::new(192, 0, 2, 1)),
        ));
    }
    r
}

impl Upstream {
    fn start() -> Upstream {
        // One port for both; TCP first, as busy TCP ports are the likelier clash.
        let (udp, tcp, addr) = (0..20)
            .find_map(|_| {
                let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
                let addr = tcp.local_addr().unwrap();
                UdpSocket::bind(addr).ok().map(|udp| (udp, tcp, addr))
            })
            .expect("a port free for TCP and UDP");
        udp.set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        tcp.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let udp_queries = Arc::new(AtomicUsize::new(0));
        let tcp_queries = Arc::new(AtomicUsize::new(0));
        let udp_thread = {
            let (stop, count) = (stop.clone(), udp_queries.clone());
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while !stop.load(Ordering::SeqCst) {
                    let Ok((n, from)) = udp.recv_from(&mut buf) else {
                        continue;
                    };
                    assert!(from.ip().is_loopback());
                    let q = Message::from_vec(&buf[..n]).unwrap();
                    count.fetch_add(1, Ordering::SeqCst);
                    udp.send_to(&answer(&q, false).to_vec().unwrap(), from)
                        .unwrap();
                }
            })
        };
        let tcp_thread = {
            let (stop, count) = (stop.clone(), tcp_queries.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let Ok((mut s, _)) = tcp.accept() else {
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    };
                    s.set_nonblocking(false).unwrap();
                    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    let mut len = [0u8; 2];
                    s.read_exact(&mut len).unwrap();
                    let mut buf = vec![0u8; u16::from_be_bytes(len) as usize];
                    s.read_exact(&mut buf).unwrap();
                    count.fetch_add(1, Ordering::SeqCst);
                    let r = answer(&Message::from_vec(&buf).unwrap(), true)
                        .to_vec()
                        .unwrap();
                    s.write_all(&(r.len() as u16).to_be_bytes()).unwrap();
                    s.write_all(&r).unwrap();
                }
            })
        };
        Upstream {
            addr,
            udp_queries,
            tcp_queries,
            stop,
            threads: vec![udp_thread, tcp_thread],
        }
    }

    fn udp(&self) -> usize {
        self.udp_queries.load(Ordering::SeqCst)
    }

    fn tcp(&self) -> usize {
        self.tcp_queries.load(Ordering::SeqCst)
    }

    /// Stops answering and closes both sockets.
    fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Asks the agent at `server` over UDP; the reply must carry the query's id.
fn ask(server: SocketAddr, name: &str, id: u16) -> Message {
    assert!(server.ip().is_loopback(), "tests query loopback only");
    let mut q = Message::new(id, MessageType::Query, OpCode::Query);
    q.metadata.recursion_desired = true;
    q.add_query(Query::query(Name::from_str(name).unwrap(), RecordType::A));
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    sock.send_to(&q.to_vec().unwrap(), server).unwrap();
    let mut buf = [0u8; 4096];
    let (n, _) = sock
        .recv_from(&mut buf)
        .unwrap_or_else(|e| panic!("no answer for {name}: {e}"));
    let r = Message::from_vec(&buf[..n]).unwrap();
    assert_eq!(r.metadata.id, id, "the client's id is kept");
    assert_eq!(r.metadata.message_type, MessageType::Response);
    assert!(r.metadata.recursion_desired, "the client's RD flag is kept");
    r
}

fn addresses(m: &Message) -> Vec<IpAddr> {
    m.answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(IpAddr::V4(a.0)),
            _ => None,
        })
        .collect()
}

fn start_agent(
    dir: &std::path::Path,
    upstream: SocketAddr,
    timeout_ms: &str,
) -> (Agent, SocketAddr) {
    assert!(upstream.ip().is_loopback());
    let dns: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let (dns_arg, up_arg) = (dns.to_string(), upstream.to_string());
    let mut agent = Agent::start(
        dir,
        &[
            "--dev",
            "--dns-addr",
            &dns_arg,
            "--dns-upstream",
            &up_arg,
            "--dns-upstream-timeout-ms",
            timeout_ms,
        ],
    );
    agent.wait_ready(PATIENCE);
    (agent, dns)
}

#[test]
fn forwards_caches_falls_back_to_tcp_and_fails_fast_when_the_upstream_stops() {
    let dir = tempfile::tempdir().unwrap();
    let mut upstream = Upstream::start();
    let (mut agent, dns) = start_agent(dir.path(), upstream.addr, "1000");
    let status = agent.cli(&["status"], None);
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains(&format!("forwarding to {}", upstream.addr)),
        "{status}"
    );

    let first = ask(dns, "www.example.", 0x1234);
    assert_eq!(first.metadata.response_code, ResponseCode::NoError);
    assert_eq!(addresses(&first), ["192.0.2.1".parse::<IpAddr>().unwrap()]);
    assert!(first.metadata.recursion_available);
    assert!(!first.metadata.authoritative);
    assert_eq!(upstream.udp(), 1);

    // Within the TTL: from the cache, case-insensitively; the upstream saw one query.
    let second = ask(dns, "WWW.Example.", 0x4321);
    assert_eq!(addresses(&second), addresses(&first));
    assert!(second.answers[0].ttl <= 60);
    assert_eq!(upstream.udp(), 1, "the second lookup was not cached");

    // Negative answers are cached too.
    for id in [1, 2] {
        let nx = ask(dns, "nx.example.", id);
        assert_eq!(nx.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(nx.authorities[0].record_type(), RecordType::SOA);
    }
    assert_eq!(upstream.udp(), 2);

    // Names in the zone are answered by the agent, never forwarded.
    let own = ask(dns, "nope.default.rune.", 3);
    assert_eq!(own.metadata.response_code, ResponseCode::NXDomain);
    assert!(own.metadata.authoritative);
    assert_eq!(upstream.udp(), 2);

    // A truncated UDP answer is asked again over TCP.
    let big = ask(dns, "truncated.example.", 4);
    assert_eq!(big.metadata.response_code, ResponseCode::NoError);
    assert_eq!(addresses(&big), ["192.0.2.1".parse::<IpAddr>().unwrap()]);
    assert_eq!((upstream.udp(), upstream.tcp()), (3, 1));

    // The upstream goes away: SERVFAIL, within the timeout (loose bound), no hang.
    upstream.stop();
    let asked = Instant::now();
    let failed = ask(dns, "gone.example.", 5);
    assert_eq!(failed.metadata.response_code, ResponseCode::ServFail);
    assert!(
        asked.elapsed() < Duration::from_secs(4),
        "SERVFAIL took {:?}",
        asked.elapsed()
    );
    // Still cached after the upstream is gone.
    assert_eq!(
        ask(dns, "www.example.", 6).metadata.response_code,
        ResponseCode::NoError
    );

    let text = agent.metrics_text();
    assert_eq!(
        metric(&text, "rune_dns_cache_hits_total"),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "rune_dns_cache_misses_total"),
        Some(4.0),
        "{text}"
    );
    let errors = metric(&text, r#"rune_dns_upstream_errors_total{reason="io"}"#).unwrap_or(0.0)
        + metric(&text, r#"rune_dns_upstream_errors_total{reason="timeout"}"#).unwrap_or(0.0);
    assert_eq!(errors, 2.0, "one try and one retry: {text}");
    assert_eq!(
        metric(
            &text,
            r#"rune_dns_queries_total{type="A",rcode="NOERROR",zone="other"}"#
        ),
        Some(4.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"rune_dns_queries_total{type="A",rcode="SERVFAIL",zone="other"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"rune_dns_query_duration_seconds_count{zone="other"}"#
        ),
        Some(7.0),
        "{text}"
    );
    assert_eq!(agent.terminate(PATIENCE), Some(0));
}

#[test]
fn a_silent_upstream_gives_servfail_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    // Bound but never read: queries go unanswered.
    let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
    let (mut agent, dns) = start_agent(dir.path(), silent.local_addr().unwrap(), "400");
    let asked = Instant::now();
    let failed = ask(dns, "slow.example.", 7);
    assert_eq!(failed.metadata.response_code, ResponseCode::ServFail);
    assert!(
        asked.elapsed() < Duration::from_secs(4),
        "SERVFAIL took {:?}",
        asked.elapsed()
    );
    let text = agent.metrics_text();
    assert_eq!(
        metric(&text, r#"rune_dns_upstream_errors_total{reason="timeout"}"#),
        Some(2.0),
        "{text}"
    );
    assert_eq!(agent.terminate(PATIENCE), Some(0));
}
