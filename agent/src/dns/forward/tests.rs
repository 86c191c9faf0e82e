use super::*;
use hickory_proto::rr::{Name, RData, Record, RecordType, rdata::A};
use std::{
    str::FromStr,
    sync::atomic::{AtomicUsize, Ordering},
};

/// A UDP upstream on 127.0.0.1 answering A 192.0.2.7 (TTL 60) after `delay`;
/// counts the queries it saw.
async fn upstream(delay: Duration) -> (SocketAddr, Arc<AtomicUsize>) {
    let socket = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let addr = socket.local_addr().unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let count = seen.clone();
    tokio::spawn(async move {
        let mut buf = [0u8; 4096];
        loop {
            let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                return;
            };
            count.fetch_add(1, Ordering::SeqCst);
            let q = Message::from_vec(&buf[..n]).unwrap();
            let socket = socket.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let mut r = Message::new(q.metadata.id, MessageType::Response, OpCode::Query);
                r.add_query(q.queries[0].clone());
                r.add_answer(Record::from_rdata(
                    q.queries[0].name().clone(),
                    60,
                    RData::A(A::new(192, 0, 2, 7)),
                ));
                socket.send_to(&r.to_vec().unwrap(), from).await.unwrap();
            });
        }
    });
    (addr, seen)
}

fn question(name: &str) -> Query {
    Query::query(Name::from_str(name).unwrap(), RecordType::A)
}

#[tokio::test]
async fn concurrent_identical_misses_share_one_upstream_query() {
    let (addr, seen) = upstream(Duration::from_millis(100)).await;
    let metrics = Arc::new(Metrics::new());
    let forwarder = Forwarder::new(vec![addr], Duration::from_secs(2), 100, metrics.clone());
    let q = question("shared.example.");
    let answers = futures::future::join_all((0..5).map(|_| forwarder.resolve(&q))).await;
    for answer in answers {
        assert_eq!(answer.unwrap().answers.len(), 1);
    }
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    // And then from the cache.
    forwarder.resolve(&q).await.unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    assert_eq!(metrics.dns_cache_hits.get(), 1);
    assert_eq!(metrics.dns_cache_misses.get(), 5);
}

#[tokio::test]
async fn questions_beyond_the_in_flight_bound_fail_at_once() {
    let (addr, seen) = upstream(Duration::from_millis(300)).await;
    let metrics = Arc::new(Metrics::new());
    let forwarder = Forwarder::new(vec![addr], Duration::from_secs(2), 100, metrics.clone())
        .with_max_in_flight(1);
    let (a, b) = (question("a.example."), question("b.example."));
    let (first, second) = tokio::join!(forwarder.resolve(&a), forwarder.resolve(&b));
    assert_eq!(first.unwrap().answers.len(), 1);
    assert_eq!(second.unwrap_err().reason(), "overloaded");
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    let overloaded = metrics
        .dns_upstream_errors
        .get_or_create(&DnsUpstreamErrorLabels {
            reason: "overloaded",
        })
        .get();
    assert_eq!(overloaded, 1);
    // The permit is back once the first is answered.
    assert!(forwarder.resolve(&b).await.is_ok());
}

#[tokio::test]
async fn a_silent_upstream_is_retried_on_the_next_within_the_timeout() {
    let silent = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let (good, seen) = upstream(Duration::ZERO).await;
    let metrics = Arc::new(Metrics::new());
    let forwarder = Forwarder::new(
        vec![silent.local_addr().unwrap(), good],
        Duration::from_millis(400),
        0,
        metrics.clone(),
    );
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        forwarder.resolve(&question("retry.example.")),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(answer.answers.len(), 1);
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    let timeouts = metrics
        .dns_upstream_errors
        .get_or_create(&DnsUpstreamErrorLabels { reason: "timeout" })
        .get();
    assert_eq!(timeouts, 1);
    // Both silent: an error, not a hang.
    let forwarder = Forwarder::new(
        vec![silent.local_addr().unwrap()],
        Duration::from_millis(200),
        0,
        metrics,
    );
    let error = tokio::time::timeout(
        Duration::from_secs(5),
        forwarder.resolve(&question("retry.example.")),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert_eq!(error.reason(), "timeout");
}

#[test]
fn resolv_conf_nameservers_without_our_own_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("resolv.conf");
    std::fs::write(
        &path,
        "# generated\nsearch example.internal\n\
         nameserver 127.0.0.123\n\
         nameserver 192.0.2.53\n\
         ; a comment\n\
         nameserver   2001:db8::53  \n\
         nameserver fe80::1%eth0\n\
         nameserver not-an-address\n\
         nameserver 192.0.2.53\n\
         nameserver 127.0.0.1\n\
         options ndots:5\n",
    )
    .unwrap();
    let own: Vec<SocketAddr> = vec![
        "127.0.0.123:53".parse().unwrap(),
        "127.0.0.1:15353".parse().unwrap(),
    ];
    let found = upstreams_from_resolv_conf(&path, &own).unwrap();
    let expected: Vec<SocketAddr> = ["192.0.2.53:53", "[2001:db8::53]:53", "127.0.0.1:53"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    assert_eq!(found, expected);
    // A wildcard listener on port 53 covers loopback resolvers of its family.
    let wildcard: Vec<SocketAddr> = vec!["0.0.0.0:53".parse().unwrap()];
    let found = upstreams_from_resolv_conf(&path, &wildcard).unwrap();
    assert!(!found.iter().any(|a| a.ip().is_loopback()), "{found:?}");
    // `[::]` is dual-stack: it covers IPv4 loopback too; an address that is not
    // this host's is never "own".
    let dual: Vec<SocketAddr> = vec!["[::]:53".parse().unwrap()];
    assert!(is_own("127.0.0.1:53".parse().unwrap(), &dual));
    assert!(is_own("[::1]:53".parse().unwrap(), &dual));
    assert!(!is_own("192.0.2.53:53".parse().unwrap(), &dual));
    assert!(!is_own("127.0.0.1:5353".parse().unwrap(), &dual));
    assert!(found.contains(&"192.0.2.53:53".parse().unwrap()));
    // No file: no upstreams, not an error.
    assert_eq!(
        upstreams_from_resolv_conf(&dir.path().join("missing"), &own).unwrap(),
        []
    );
}
