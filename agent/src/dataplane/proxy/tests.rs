use super::*;
use crate::{
    dataplane::BackendState,
    endpoints::ServiceView,
    metrics::ConnectionLabels,
    model::{
        Discovery, Endpoint, Endpoints, EndpointsSpec, LocalityPreference, Metadata, Service,
        ServiceSpec, SessionAffinity,
    },
};
use std::{collections::BTreeMap, net::Ipv4Addr, time::Duration};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream, UdpSocket},
    time::timeout,
};

const PATIENCE: Duration = Duration::from_secs(5);

fn meta(name: &str) -> Metadata {
    Metadata {
        namespace: "default".into(),
        name: name.into(),
        labels: BTreeMap::new(),
    }
}

fn service(name: &str, port: u16, protocol: Protocol) -> Service {
    Service {
        metadata: meta(name),
        spec: ServiceSpec {
            ports: vec![ServicePort {
                name: "p".into(),
                port,
                protocol,
                target_port: None,
            }],
            discovery: Discovery::default(),
            session_affinity: SessionAffinity::None,
            drain_seconds: 30,
            network_policy: None,
        },
    }
}

/// An endpoint at `ip` whose port `p` is overridden to `port`.
fn ep(ip: [u8; 4], port: u16) -> Endpoint {
    Endpoint {
        address: IpAddr::from(ip),
        node: "node-a".into(),
        ready: true,
        serving: None,
        terminating: false,
        ports: BTreeMap::from([("p".to_owned(), port)]).into(),
    }
}

fn view(svc: &Service, eps: Option<Vec<Endpoint>>) -> ServiceView {
    ServiceView {
        service: Arc::new(svc.clone()),
        endpoints: eps.map(|endpoints| {
            Arc::new(Endpoints {
                metadata: svc.metadata.clone(),
                spec: EndpointsSpec { endpoints },
            })
        }),
    }
}

fn upsert(views: Vec<ServiceView>) -> Delta {
    Delta {
        upserted: views,
        ..Delta::default()
    }
}

fn proxy() -> (UserspaceProxy, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let config = ProxyConfig {
        node_name: "node-a".into(),
        udp_idle_timeout: Duration::from_secs(5),
        bind_retry_interval: Duration::from_millis(100),
        ..ProxyConfig::default()
    };
    (
        UserspaceProxy::new(config, metrics.clone()).unwrap(),
        metrics,
    )
}

fn conns(m: &Metrics, name: &str, protocol: &str, result: &str) -> u64 {
    m.proxy_connections
        .get_or_create(&ConnectionLabels {
            service: format!("default/{name}"),
            protocol: protocol.into(),
            result: result.into(),
        })
        .get()
}

/// A port free on 127.0.0.1 for TCP and UDP right now.
fn free_port() -> u16 {
    loop {
        let t = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = t.local_addr().unwrap().port();
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A TCP backend on `ip` that sends `id`, then echoes; returns its port.
async fn tcp_backend(ip: [u8; 4], id: u8) -> u16 {
    let l = TcpListener::bind((Ipv4Addr::from(ip), 0)).await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                s.write_all(&[id]).await.ok();
                let (mut r, mut w) = s.split();
                tokio::io::copy(&mut r, &mut w).await.ok();
            });
        }
    });
    port
}

/// Connects through the proxy and returns the stream and the backend's id.
async fn connect(port: u16) -> (TcpStream, u8) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut id = [0u8];
    s.read_exact(&mut id).await.unwrap();
    (s, id[0])
}

async fn echo(s: &mut TcpStream, msg: &[u8]) {
    s.write_all(msg).await.unwrap();
    let mut buf = vec![0; msg.len()];
    timeout(PATIENCE, s.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(buf, msg);
}

#[tokio::test]
async fn tcp_spreads_over_three_backends() {
    let (p, metrics) = proxy();
    let port = free_port();
    let mut eps = Vec::new();
    for (i, last) in [2u8, 3, 4].into_iter().enumerate() {
        eps.push(ep(
            [127, 0, 0, last],
            tcp_backend([127, 0, 0, last], i as u8).await,
        ));
    }
    let svc = service("web", port, Protocol::Tcp);
    p.apply(&upsert(vec![view(&svc, Some(eps))])).await.unwrap();
    let mut seen = [0usize; 3];
    timeout(Duration::from_secs(8), async {
        for i in 0..300 {
            let (mut s, id) = connect(port).await;
            seen[id as usize] += 1;
            if i % 50 == 0 {
                echo(&mut s, b"hello").await;
            }
        }
    })
    .await
    .unwrap();
    for n in seen {
        assert!((60..=141).contains(&n), "uneven spread {seen:?}");
    }
    assert_eq!(conns(&metrics, "web", "TCP", "ok"), 300);
    let st = p.status();
    assert_eq!(st.len(), 1);
    assert_eq!(st[0].state, PortState::Listening);
    assert_eq!(st[0].backends.len(), 3);
    p.shutdown().await;
}

#[tokio::test]
async fn terminating_and_removed_endpoints_keep_open_connections() {
    let (p, _) = proxy();
    let port = free_port();
    let a = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 1).await);
    let b = ep([127, 0, 0, 3], tcp_backend([127, 0, 0, 3], 2).await);
    let svc = service("web", port, Protocol::Tcp);
    p.apply(&upsert(vec![view(&svc, Some(vec![a.clone()]))]))
        .await
        .unwrap();
    let (mut old, id) = connect(port).await;
    assert_eq!(id, 1);
    echo(&mut old, b"before").await;

    let mut a_term = a.clone();
    a_term.terminating = true;
    p.apply(&upsert(vec![view(&svc, Some(vec![a_term, b.clone()]))]))
        .await
        .unwrap();
    assert_eq!(p.status()[0].backends[0].state, BackendState::Terminating);
    for _ in 0..20 {
        assert_eq!(
            connect(port).await.1,
            2,
            "terminating endpoint got a new connection"
        );
    }
    echo(&mut old, b"while terminating").await;

    // Gone from the list altogether: still not cut.
    p.apply(&upsert(vec![view(&svc, Some(vec![b]))]))
        .await
        .unwrap();
    echo(&mut old, b"after removal").await;

    // Removing the service closes the listener, not the connection.
    let delta = Delta {
        removed: vec![svc.key()],
        ..Delta::default()
    };
    p.apply(&delta).await.unwrap();
    assert!(p.status().is_empty());
    let refused = timeout(PATIENCE, TcpStream::connect(("127.0.0.1", port))).await;
    assert!(matches!(refused, Ok(Err(_))), "listener still open");
    echo(&mut old, b"after service removal").await;
    timeout(PATIENCE, p.shutdown()).await.unwrap();
}

/// Reads until the proxy closes the connection; `None` when it stays open.
async fn closed_within(s: &mut TcpStream, patience: Duration) -> Option<()> {
    let mut buf = [0u8; 64];
    match timeout(patience, s.read(&mut buf)).await {
        Ok(Ok(0) | Err(_)) => Some(()),
        Ok(Ok(_)) | Err(_) => None,
    }
}

#[tokio::test]
async fn connections_to_a_leaving_endpoint_end_after_the_drain_time() {
    let (p, m) = proxy();
    let port = free_port();
    let a = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 1).await);
    let b = ep([127, 0, 0, 3], tcp_backend([127, 0, 0, 3], 2).await);
    let mut svc = service("drain", port, Protocol::Tcp);
    svc.spec.drain_seconds = 1;
    p.apply(&upsert(vec![view(&svc, Some(vec![a.clone()]))]))
        .await
        .unwrap();
    let (mut old, id) = connect(port).await;
    assert_eq!(id, 1);
    echo(&mut old, b"0123456789").await;
    // Bytes are counted while the connection is open (1 id byte + the echo back).
    let bytes = |dir: &str| {
        m.proxy_bytes
            .get_or_create(&crate::metrics::BytesLabels {
                service: "default/drain".into(),
                protocol: "TCP".into(),
                direction: dir.into(),
            })
            .get()
    };
    assert_eq!((bytes("to_backend"), bytes("to_client")), (10, 11));

    let mut a_term = a.clone();
    a_term.terminating = true;
    p.apply(&upsert(vec![view(&svc, Some(vec![a_term, b.clone()]))]))
        .await
        .unwrap();
    // Still served within the drain time...
    echo(&mut old, b"draining").await;
    // ...and closed once it is over.
    assert!(
        closed_within(&mut old, PATIENCE).await.is_some(),
        "connection outlived drainSeconds"
    );

    // A backend that comes back before the drain time is over keeps its connections.
    p.apply(&upsert(vec![view(&svc, Some(vec![a.clone()]))]))
        .await
        .unwrap();
    let (mut second, id) = connect(port).await;
    assert_eq!(id, 1);
    p.apply(&upsert(vec![view(&svc, Some(vec![b.clone()]))]))
        .await
        .unwrap();
    p.apply(&upsert(vec![view(&svc, Some(vec![a.clone(), b]))]))
        .await
        .unwrap();
    assert!(
        closed_within(&mut second, Duration::from_millis(1500))
            .await
            .is_none(),
        "a backend that returned was drained"
    );
    echo(&mut second, b"still here").await;
    timeout(PATIENCE, p.shutdown()).await.unwrap();
}

#[tokio::test]
async fn deleting_an_endpoint_moves_traffic_to_the_rest() {
    let (p, _) = proxy();
    let port = free_port();
    let a = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 1).await);
    let b = ep([127, 0, 0, 3], tcp_backend([127, 0, 0, 3], 2).await);
    let svc = service("web", port, Protocol::Tcp);
    p.apply(&upsert(vec![view(&svc, Some(vec![a, b.clone()]))]))
        .await
        .unwrap();
    let mut ids = BTreeSet::new();
    for _ in 0..40 {
        ids.insert(connect(port).await.1);
    }
    assert_eq!(ids, BTreeSet::from([1, 2]));
    p.apply(&upsert(vec![view(&svc, Some(vec![b]))]))
        .await
        .unwrap();
    for _ in 0..40 {
        assert_eq!(connect(port).await.1, 2);
    }
    p.shutdown().await;
}

/// Reads until EOF or reset: what a refused client sees.
async fn refused(port: u16) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut buf = [0u8; 1];
    match timeout(PATIENCE, s.read(&mut buf)).await.unwrap() {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("read {n} bytes from a service without backends"),
    }
}

#[tokio::test]
async fn no_backends_refuse_and_count() {
    let (p, metrics) = proxy();
    let (port1, port2) = (free_port(), free_port());
    let empty = service("empty", port1, Protocol::Tcp);
    let unknown = service("unknown", port2, Protocol::Tcp);
    let mut not_ready = ep([127, 0, 0, 2], 1);
    not_ready.ready = false;
    p.apply(&upsert(vec![
        view(&empty, Some(vec![not_ready])),
        view(&unknown, None),
    ]))
    .await
    .unwrap();
    refused(port1).await;
    refused(port2).await;
    refused(port2).await;
    assert_eq!(conns(&metrics, "empty", "TCP", "no_backend"), 1);
    assert_eq!(conns(&metrics, "unknown", "TCP", "no_backend"), 2);
    assert_eq!(conns(&metrics, "empty", "TCP", "ok"), 0);
    let st = p.status();
    assert!(st[0].endpoints_known && !st[1].endpoints_known);
    assert_eq!(st[0].backends[0].state, BackendState::NotReady);
    p.shutdown().await;
}

/// A UDP backend on `ip` that answers `[id] + payload`; returns its port.
async fn udp_backend(ip: [u8; 4], id: u8) -> u16 {
    let s = UdpSocket::bind((Ipv4Addr::from(ip), 0)).await.unwrap();
    let port = s.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut buf = [0u8; 2048];
        while let Ok((n, peer)) = s.recv_from(&mut buf[1..]).await {
            buf[0] = id;
            s.send_to(&buf[..n + 1], peer).await.ok();
        }
    });
    port
}

async fn udp_round_trip(c: &UdpSocket, msg: &[u8]) -> u8 {
    c.send(msg).await.unwrap();
    let mut buf = [0u8; 2048];
    let n = timeout(PATIENCE, c.recv(&mut buf)).await.unwrap().unwrap();
    assert_eq!(&buf[1..n], msg);
    buf[0]
}

#[tokio::test]
async fn a_udp_flow_to_a_removed_backend_moves_after_the_drain_time() {
    let (p, _) = proxy();
    let port = free_port();
    let a = ep([127, 0, 0, 2], udp_backend([127, 0, 0, 2], 1).await);
    let b = ep([127, 0, 0, 3], udp_backend([127, 0, 0, 3], 2).await);
    let mut svc = service("stats", port, Protocol::Udp);
    svc.spec.drain_seconds = 1;
    p.apply(&upsert(vec![view(&svc, Some(vec![a.clone(), b.clone()]))]))
        .await
        .unwrap();
    let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    c.connect(("127.0.0.1", port)).await.unwrap();
    let first = udp_round_trip(&c, b"m0").await;
    let rest = if first == 1 { b } else { a };
    p.apply(&upsert(vec![view(&svc, Some(vec![rest]))]))
        .await
        .unwrap();
    // Within the drain time the flow keeps its backend...
    assert_eq!(udp_round_trip(&c, b"m1").await, first);
    // ...then it ends, and the client's next datagram goes to a live backend, even
    // though the client never paused (an idle timeout alone would never move it).
    let moved = timeout(PATIENCE, async {
        loop {
            // A datagram in flight when the flow ends may be lost, as on a network.
            c.send(b"m2").await.unwrap();
            let mut buf = [0u8; 64];
            if let Ok(Ok(n)) = timeout(Duration::from_millis(300), c.recv(&mut buf)).await
                && n > 0
                && buf[0] != first
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(moved.is_ok(), "the flow outlived drainSeconds");
    p.shutdown().await;
}

#[tokio::test]
async fn udp_round_trips_and_a_flow_keeps_its_backend() {
    let (p, metrics) = proxy();
    let port = free_port();
    let a = ep([127, 0, 0, 2], udp_backend([127, 0, 0, 2], 1).await);
    let b = ep([127, 0, 0, 3], udp_backend([127, 0, 0, 3], 2).await);
    let svc = service("dns", port, Protocol::Udp);
    p.apply(&upsert(vec![view(&svc, Some(vec![a.clone(), b.clone()]))]))
        .await
        .unwrap();
    let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    c.connect(("127.0.0.1", port)).await.unwrap();
    let first = udp_round_trip(&c, b"q1").await;
    for i in 0..5 {
        assert_eq!(udp_round_trip(&c, format!("q{i}").as_bytes()).await, first);
    }
    // Its backend starts terminating: the flow stays; new clients go elsewhere.
    let (mut a2, mut b2) = (a, b);
    if first == 1 { &mut a2 } else { &mut b2 }.terminating = true;
    p.apply(&upsert(vec![view(&svc, Some(vec![a2, b2]))]))
        .await
        .unwrap();
    assert_eq!(udp_round_trip(&c, b"again").await, first);
    let c2 = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    c2.connect(("127.0.0.1", port)).await.unwrap();
    assert_ne!(udp_round_trip(&c2, b"new").await, first);
    assert_eq!(conns(&metrics, "dns", "UDP", "ok"), 2);
    p.shutdown().await;
}

#[tokio::test]
async fn a_taken_port_fails_alone_and_is_retried() {
    let (p, metrics) = proxy();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let port = free_port();
    let good = service("good", port, Protocol::Tcp);
    let bad = service("bad", taken_port, Protocol::Tcp);
    let backend = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 7).await);
    p.apply(&upsert(vec![
        view(&bad, Some(vec![backend.clone()])),
        view(&good, Some(vec![backend])),
    ]))
    .await
    .unwrap();
    let st = p.status();
    let PortState::Failed { reason } = &st[0].state else {
        panic!("taken port reported as {:?}", st[0].state);
    };
    assert!(reason.contains("in use"), "{reason}");
    assert_eq!(st[1].state, PortState::Listening);
    let up = |name: &str, port| {
        metrics
            .proxy_listener_up
            .get_or_create(&ServicePortLabels {
                service: format!("default/{name}"),
                port,
                protocol: "TCP".into(),
            })
            .get()
    };
    assert_eq!((up("bad", taken_port), up("good", port)), (0, 1));
    assert_eq!(connect(port).await.1, 7);

    // Freed: the background retry takes it.
    drop(taken);
    timeout(PATIENCE, async {
        while p.status()[0].state != PortState::Listening {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(connect(taken_port).await.1, 7);
    assert_eq!(up("bad", taken_port), 1);
    p.shutdown().await;
}

#[tokio::test]
async fn a_port_freed_and_taken_in_one_delta_is_bound_without_waiting_for_the_retry() {
    let config = ProxyConfig {
        bind_retry_interval: Duration::from_secs(600),
        ..ProxyConfig::default()
    };
    let p = UserspaceProxy::new(config, Arc::new(Metrics::new())).unwrap();
    let port = free_port();
    let backend = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 7).await);
    let old = service("old", port, Protocol::Tcp);
    let new = service("new", port, Protocol::Tcp);
    p.apply(&upsert(vec![view(&old, Some(vec![backend.clone()]))]))
        .await
        .unwrap();
    let delta = Delta {
        removed: vec![old.key()],
        upserted: vec![view(&new, Some(vec![backend]))],
        ..Delta::default()
    };
    p.apply(&delta).await.unwrap();
    timeout(PATIENCE, async {
        while p.status()[0].state != PortState::Listening {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the new service did not get the freed port");
    assert_eq!(connect(port).await.1, 7);
    p.shutdown().await;
}

#[tokio::test]
async fn a_port_beyond_65535_after_offset_fails_with_a_reason() {
    let metrics = Arc::new(Metrics::new());
    let config = ProxyConfig {
        port_offset: 1000,
        ..ProxyConfig::default()
    };
    let p = UserspaceProxy::new(config, metrics).unwrap();
    let svc = service("high", 65000, Protocol::Udp);
    p.apply(&upsert(vec![view(&svc, None)])).await.unwrap();
    let st = p.status();
    assert_eq!(st[0].listen, None);
    assert!(
        matches!(&st[0].state, PortState::Failed { reason } if reason.contains("66000")),
        "{:?}",
        st[0].state
    );
    p.shutdown().await;
}

#[tokio::test]
async fn shutdown_stops_everything() {
    let (p, _) = proxy();
    let (tport, uport) = (free_port(), free_port());
    let backend = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 1).await);
    let ubackend = ep([127, 0, 0, 2], udp_backend([127, 0, 0, 2], 1).await);
    let t = service("t", tport, Protocol::Tcp);
    let u = service("u", uport, Protocol::Udp);
    p.apply(&upsert(vec![
        view(&t, Some(vec![backend])),
        view(&u, Some(vec![ubackend])),
    ]))
    .await
    .unwrap();
    let (mut open, _) = connect(tport).await;
    let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    c.connect(("127.0.0.1", uport)).await.unwrap();
    udp_round_trip(&c, b"x").await;

    timeout(PATIENCE, p.shutdown()).await.unwrap();
    assert!(p.inner.tracker.is_empty(), "tasks left after shutdown");
    // The open connection was closed, the ports are free again.
    let mut buf = [0u8; 1];
    assert!(matches!(
        timeout(PATIENCE, open.read(&mut buf)).await.unwrap(),
        Ok(0) | Err(_)
    ));
    std::net::TcpListener::bind(("127.0.0.1", tport)).unwrap();
    std::net::UdpSocket::bind(("127.0.0.1", uport)).unwrap();
    assert!(matches!(
        p.apply(&Delta::default()).await,
        Err(DataPlaneError::ShutDown { .. })
    ));
}

#[test]
fn locality_preference_and_target_ports() {
    let mut svc = service("web", 80, Protocol::Tcp);
    svc.spec.ports[0].target_port = Some(8080);
    let mut remote = ep([10, 0, 0, 2], 0);
    remote.node = "node-b".into();
    remote.ports.clear();
    let local = ep([10, 0, 0, 1], 9090);
    let eps = Some(vec![remote.clone(), local.clone()]);
    let pick_all = |pref, eps: Option<Vec<Endpoint>>| {
        let mut s = svc.clone();
        s.spec.discovery.locality_preference = pref;
        let v = view(&s, eps);
        let shared = PortShared::new(
            "x".into(),
            Protocol::Tcp,
            Backends::build(&v, &s.spec.ports[0], "node-a", 13, None),
            &Metrics::new(),
            TaskTracker::new(),
            CancellationToken::new(),
        );
        (1000..1200)
            .filter_map(|port| shared.pick(SocketAddr::from(([192, 0, 2, 1], port))))
            .collect::<BTreeSet<_>>()
    };
    let r: SocketAddr = "10.0.0.2:8080".parse().unwrap();
    let l: SocketAddr = "10.0.0.1:9090".parse().unwrap();
    use LocalityPreference::*;
    assert_eq!(pick_all(Any, eps.clone()), BTreeSet::from([r, l]));
    assert_eq!(pick_all(PreferLocal, eps.clone()), BTreeSet::from([l]));
    assert_eq!(pick_all(LocalOnly, eps.clone()), BTreeSet::from([l]));
    assert_eq!(
        pick_all(PreferLocal, Some(vec![remote.clone()])),
        BTreeSet::from([r])
    );
    assert_eq!(pick_all(LocalOnly, Some(vec![remote])), BTreeSet::new());
}

#[test]
fn client_ip_affinity_sticks_across_ports_and_backend_changes() {
    let mut svc = service("web", 80, Protocol::Tcp);
    svc.spec.session_affinity = SessionAffinity::ClientIp {
        timeout_seconds: 60,
    };
    let eps: Vec<_> = (1..=5).map(|i| ep([10, 0, 0, i], 80)).collect();
    let build = |eps: Vec<Endpoint>| {
        Backends::build(&view(&svc, Some(eps)), &svc.spec.ports[0], "", 13, None)
    };
    let shared = Arc::new(PortShared::new(
        "x".into(),
        Protocol::Tcp,
        build(eps.clone()),
        &Metrics::new(),
        TaskTracker::new(),
        CancellationToken::new(),
    ));
    let client = |port| SocketAddr::from(([192, 0, 2, 9], port));
    let first = shared.pick(client(1000)).unwrap();
    for port in 1001..1100 {
        assert_eq!(shared.pick(client(port)), Some(first));
    }
    // Another backend added: the remembered one stays.
    let mut more = eps.clone();
    more.push(ep([10, 0, 0, 6], 80));
    shared.set_backends(build(more));
    assert_eq!(shared.pick(client(2000)), Some(first));
    // The remembered one leaves: the client moves, and sticks again.
    let rest: Vec<_> = eps
        .into_iter()
        .filter(|e| SocketAddr::new(e.address, 80) != first)
        .collect();
    shared.set_backends(build(rest));
    let second = shared.pick(client(3000)).unwrap();
    assert_ne!(second, first);
    assert_eq!(shared.pick(client(3001)), Some(second));
}

/// Production mode with a fake address manager: listeners on each service's VIP
/// (127.0.0.0/8 addresses, bindable without adding them), VIPs held by the ports on
/// them, stale addresses of an earlier agent removed, others' never touched.
#[tokio::test]
async fn vips_are_held_by_their_ports_and_released_with_the_last() {
    use super::vip_addrs::fake::FakeOps;
    let fake = FakeOps::default();
    let (vip, moved, stale, theirs): (IpAddr, IpAddr, IpAddr, IpAddr) = (
        [127, 0, 0, 77].into(),
        [127, 0, 0, 79].into(),
        [127, 0, 0, 99].into(),
        [127, 0, 0, 98].into(),
    );
    fake.addrs
        .lock()
        .unwrap()
        .extend([(stale, true), (theirs, false)]);
    let metrics = Arc::new(Metrics::new());
    let config = ProxyConfig {
        listen: ListenOn::Vips,
        node_name: "node-a".into(),
        bind_retry_interval: Duration::from_millis(100),
        ..ProxyConfig::default()
    };
    let p = UserspaceProxy::with_address_ops(config, metrics, Box::new(fake.clone())).unwrap();
    let (tport, uport) = (free_port(), free_port());
    let backend = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 7).await);
    let mut a = service("a", tport, Protocol::Tcp);
    a.spec.discovery.vips = vec![vip];
    let mut b = service("b", uport, Protocol::Udp);
    b.spec.discovery.vips = vec![vip];
    p.apply(&Delta {
        full: true,
        ..upsert(vec![
            view(&a, Some(vec![backend.clone()])),
            view(&b, Some(vec![])),
        ])
    })
    .await
    .unwrap();
    assert_eq!(
        fake.on_interface(),
        BTreeMap::from([(vip, true), (theirs, false)]),
        "the VIP added, the stale address of ours removed, the other left"
    );
    let st = p.status();
    assert_eq!(st[0].listen, Some(SocketAddr::new(vip, tport)));
    assert_eq!(st[0].state, PortState::Listening);
    let mut s = TcpStream::connect((vip, tport)).await.unwrap();
    let mut id = [0u8];
    s.read_exact(&mut id).await.unwrap();
    assert_eq!(id[0], 7);

    // b goes: a still holds the VIP.
    p.apply(&Delta {
        removed: vec![b.key()],
        ..Delta::default()
    })
    .await
    .unwrap();
    assert!(fake.on_interface().contains_key(&vip));

    // a moves to another VIP: the old one goes, the connection open on it stays.
    a.spec.discovery.vips = vec![moved];
    p.apply(&upsert(vec![view(&a, Some(vec![backend]))]))
        .await
        .unwrap();
    assert_eq!(
        fake.on_interface(),
        BTreeMap::from([(moved, true), (theirs, false)])
    );
    echo(&mut s, b"still").await;
    let mut s2 = TcpStream::connect((moved, tport)).await.unwrap();
    s2.read_exact(&mut id).await.unwrap();
    assert_eq!(id[0], 7);

    timeout(PATIENCE, p.shutdown()).await.unwrap();
    assert_eq!(fake.on_interface(), BTreeMap::from([(theirs, false)]));
}

#[tokio::test]
async fn a_service_without_vip_fails_alone_in_production() {
    use super::vip_addrs::fake::FakeOps;
    let config = ProxyConfig {
        listen: ListenOn::Vips,
        ..ProxyConfig::default()
    };
    let p = UserspaceProxy::with_address_ops(
        config,
        Arc::new(Metrics::new()),
        Box::new(FakeOps::default()),
    )
    .unwrap();
    let svc = service("novip", free_port(), Protocol::Tcp);
    p.apply(&upsert(vec![view(&svc, None)])).await.unwrap();
    let st = p.status();
    assert_eq!(st[0].listen, None);
    assert!(
        matches!(&st[0].state, PortState::Failed { reason } if reason.contains("no VIP")),
        "{:?}",
        st[0].state
    );
    p.shutdown().await;
}

/// A client that aborts (RST) makes the proxy abort its backend connection too,
/// rather than close it with a FIN (which would leave it in TIME_WAIT on the node).
#[tokio::test]
async fn a_client_reset_is_passed_on_to_the_backend() {
    let (p, _) = proxy();
    let l = TcpListener::bind("127.0.0.2:0").await.unwrap();
    let bport = l.local_addr().unwrap().port();
    let port = free_port();
    let svc = service("rst", port, Protocol::Tcp);
    p.apply(&upsert(vec![view(
        &svc,
        Some(vec![ep([127, 0, 0, 2], bport)]),
    )]))
    .await
    .unwrap();
    let c = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let (mut b, _) = timeout(PATIENCE, l.accept()).await.unwrap().unwrap();
    let mut c = c;
    c.write_all(b"x").await.unwrap();
    let mut buf = [0u8; 1];
    timeout(PATIENCE, b.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    c.set_zero_linger().unwrap();
    drop(c);
    let r = timeout(PATIENCE, b.read(&mut buf)).await.unwrap();
    assert_eq!(
        r.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionReset),
        "the backend sees a reset, not an orderly close"
    );
    p.shutdown().await;
}
