use super::*;
use crate::{
    endpoints::ServiceView,
    model::{Object, parse_documents},
};
use hickory_proto::rr::{LowerName, Name, RData};
use std::{
    net::{IpAddr, SocketAddr},
    str::FromStr,
};

fn config(mode: Mode) -> ZoneConfig {
    ZoneConfig {
        domain: "rune.".into(),
        ttl: 5,
        mode,
        dev_port_offset: 10000,
    }
}

/// A view from a Service document and, optionally, an Endpoints document.
fn view(service_yaml: &str, endpoints_yaml: Option<&str>) -> ServiceView {
    let service = match parse_documents(service_yaml).unwrap().remove(0) {
        Object::Service(s) => s,
        other => panic!("not a service: {other:?}"),
    };
    let endpoints = endpoints_yaml.map(|y| match parse_documents(y).unwrap().remove(0) {
        Object::Endpoints(e) => Arc::new(e),
        other => panic!("not endpoints: {other:?}"),
    });
    ServiceView {
        service: Arc::new(service),
        endpoints,
    }
}

fn web() -> ServiceView {
    view(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: web, namespace: shop}\n\
         spec:\n  ports: [{name: http, port: 80}, {name: dns, port: 53, protocol: UDP}]\n  \
         discovery: {vips: [198.18.100.10, 'fd00:100::10']}\n",
        None,
    )
}

fn headless() -> ServiceView {
    view(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: db}\n\
         spec: {ports: [{name: pg, port: 5432}], discovery: {headless: true}}\n",
        Some(
            "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: db}\nspec:\n  endpoints:\n\
             \x20   - {address: 198.18.1.2, ready: true}\n\
             \x20   - {address: 198.18.1.3, ready: false}\n\
             \x20   - {address: 198.18.1.4, ready: true, terminating: true}\n\
             \x20   - {address: 'fd00::1:5', ready: true}\n",
        ),
    )
}

fn zone(mode: Mode, views: &[ServiceView]) -> Zone {
    Zone::build(&config(mode), 7, views).unwrap()
}

fn name(s: &str) -> LowerName {
    LowerName::from_str(s).unwrap()
}

fn ips(answer: &Answer) -> Vec<IpAddr> {
    answer
        .answers
        .iter()
        .map(|r| match &r.data {
            RData::A(a) => IpAddr::V4(a.0),
            RData::AAAA(a) => IpAddr::V6(a.0),
            other => panic!("not an address: {other:?}"),
        })
        .collect()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn assert_soa_in_authority(answer: &Answer) {
    assert_eq!(answer.authority.len(), 1, "{answer:?}");
    assert_eq!(answer.authority[0].record_type(), RecordType::SOA);
    assert_eq!(answer.authority[0].name, Name::from_str("rune.").unwrap());
}

#[test]
fn service_names_answer_their_vips_per_family() {
    let z = zone(Mode::Production, &[web()]);
    let a = z.lookup(&name("web.shop.rune."), RecordType::A);
    assert_eq!(a.rcode, ResponseCode::NoError);
    assert!(a.authoritative);
    assert_eq!(ips(&a), [ip("198.18.100.10")]);
    assert_eq!(a.answers[0].ttl, 5);
    assert!(a.authority.is_empty());
    let aaaa = z.lookup(&name("web.shop.rune."), RecordType::AAAA);
    assert_eq!(ips(&aaaa), [ip("fd00:100::10")]);
}

#[test]
fn names_are_case_insensitive() {
    let z = zone(Mode::Production, &[web()]);
    let a = z.lookup(&name("WeB.SHOP.Rune."), RecordType::A);
    assert_eq!(ips(&a), [ip("198.18.100.10")]);
}

#[test]
fn srv_for_named_ports_points_at_the_service_name() {
    let z = zone(Mode::Production, &[web()]);
    let srv = z.lookup(&name("_http._tcp.web.shop.rune."), RecordType::SRV);
    assert_eq!(srv.rcode, ResponseCode::NoError);
    match srv.answers.as_slice() {
        [r] => match &r.data {
            RData::SRV(s) => {
                assert_eq!((s.priority, s.weight, s.port), (0, 0, 80));
                assert_eq!(s.target, Name::from_str("web.shop.rune.").unwrap());
            }
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
    let udp = z.lookup(&name("_dns._udp.web.shop.rune."), RecordType::SRV);
    assert_eq!(udp.answers.len(), 1);
    // The protocol is part of the name.
    let wrong = z.lookup(&name("_dns._tcp.web.shop.rune."), RecordType::SRV);
    assert_eq!(wrong.rcode, ResponseCode::NXDomain);
    // `_udp.web.shop.rune.` exists (it has a child): NOERROR, empty.
    let ent = z.lookup(&name("_udp.web.shop.rune."), RecordType::SRV);
    assert_eq!(ent.rcode, ResponseCode::NoError);
    assert!(ent.answers.is_empty());
}

#[test]
fn vips_have_ptr_records() {
    let z = zone(Mode::Production, &[web()]);
    for reverse in [
        "10.100.18.198.in-addr.arpa.",
        "0.1.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.1.0.0.0.d.f.ip6.arpa.",
    ] {
        let ptr = z.lookup(&name(reverse), RecordType::PTR);
        assert_eq!(ptr.rcode, ResponseCode::NoError, "{reverse}");
        match ptr.answers.as_slice() {
            [r] => assert_eq!(
                r.data,
                RData::PTR(hickory_proto::rr::rdata::PTR(
                    Name::from_str("web.shop.rune.").unwrap()
                ))
            ),
            other => panic!("{reverse}: {other:?}"),
        }
    }
    let other = z.lookup(&name("11.100.18.198.in-addr.arpa."), RecordType::PTR);
    assert_eq!(other.rcode, ResponseCode::Refused);
}

#[test]
fn apex_has_soa_and_ns() {
    let z = zone(Mode::Production, &[]);
    let soa = z.lookup(&name("rune."), RecordType::SOA);
    assert_eq!(soa.rcode, ResponseCode::NoError);
    match soa.answers.as_slice() {
        [r] => match &r.data {
            RData::SOA(s) => {
                assert_eq!(s.serial, 7);
                assert_eq!(s.minimum, 5);
                assert_eq!(s.mname, Name::from_str("ns.rune.").unwrap());
            }
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
    let ns = z.lookup(&name("rune."), RecordType::NS);
    assert_eq!(ns.answers.len(), 1);
    assert_eq!(ns.answers[0].record_type(), RecordType::NS);
}

#[test]
fn unknown_names_are_nxdomain_and_missing_types_are_empty() {
    let z = zone(Mode::Production, &[web()]);
    let nx = z.lookup(&name("nope.shop.rune."), RecordType::A);
    assert_eq!(nx.rcode, ResponseCode::NXDomain);
    assert!(nx.authoritative);
    assert!(nx.answers.is_empty());
    assert_soa_in_authority(&nx);

    let nodata = z.lookup(&name("web.shop.rune."), RecordType::TXT);
    assert_eq!(nodata.rcode, ResponseCode::NoError);
    assert!(nodata.answers.is_empty());
    assert_soa_in_authority(&nodata);

    // The namespace is an empty non-terminal: it exists.
    let ns = z.lookup(&name("shop.rune."), RecordType::A);
    assert_eq!(ns.rcode, ResponseCode::NoError);
    assert_soa_in_authority(&ns);
}

#[test]
fn names_outside_the_zone_are_refused() {
    let z = zone(Mode::Production, &[web()]);
    let out = z.lookup(&name("example.com."), RecordType::A);
    assert_eq!(out.rcode, ResponseCode::Refused);
    assert!(!out.authoritative);
    assert!(out.answers.is_empty() && out.authority.is_empty());
    assert_eq!(out.authority_kind, Authority::Other);
    // A name that merely ends like the zone is not in it.
    let near = z.lookup(&name("web.shop.notrune."), RecordType::A);
    assert_eq!(near.rcode, ResponseCode::Refused);
}

#[test]
fn headless_answers_ready_endpoints_only() {
    let z = zone(Mode::Production, &[headless()]);
    let a = z.lookup(&name("db.default.rune."), RecordType::A);
    assert_eq!(ips(&a), [ip("198.18.1.2")]);
    let aaaa = z.lookup(&name("db.default.rune."), RecordType::AAAA);
    assert_eq!(ips(&aaaa), [ip("fd00::1:5")]);
    // No VIP, no PTR for endpoints.
    let ptr = z.lookup(&name("2.1.18.198.in-addr.arpa."), RecordType::PTR);
    assert_eq!(ptr.rcode, ResponseCode::Refused);
}

/// Ready backends of a headless service, several on one address: each address
/// answers once, each backend has an SRV record with its own port naming its
/// address's record.
#[test]
fn headless_srv_names_each_backend_and_addresses_answer_once() {
    let shared = view(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: db}\n\
         spec: {ports: [{name: pg, port: 5432, targetPort: 5000}], discovery: {headless: true}}\n",
        Some(
            "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: db}\nspec:\n  endpoints:\n\
             \x20   - {address: 127.0.0.1, ports: {pg: 5001}}\n\
             \x20   - {address: 127.0.0.1, ports: {pg: 5002}}\n\
             \x20   - {address: 127.0.0.1, ports: {pg: 5003}, terminating: true}\n\
             \x20   - {address: 198.18.1.9}\n\
             \x20   - {address: 'fd00::1:5'}\n",
        ),
    );
    let z = zone(Mode::Production, &[shared]);
    let a = z.lookup(&name("db.default.rune."), RecordType::A);
    assert_eq!(ips(&a), [ip("127.0.0.1"), ip("198.18.1.9")]);
    let srv = z.lookup(&name("_pg._tcp.db.default.rune."), RecordType::SRV);
    let mut got: Vec<(u16, String)> = srv
        .answers
        .iter()
        .map(|r| match &r.data {
            RData::SRV(s) => (s.port, s.target.to_string()),
            other => panic!("{other:?}"),
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            (5000, "198-18-1-9.db.default.rune.".to_owned()),
            (5000, "fd00-0-0-0-0-0-1-5.db.default.rune.".to_owned()),
            (5001, "127-0-0-1.db.default.rune.".to_owned()),
            (5002, "127-0-0-1.db.default.rune.".to_owned()),
        ]
    );
    for (target, qtype, want) in [
        ("127-0-0-1.db.default.rune.", RecordType::A, "127.0.0.1"),
        ("198-18-1-9.db.default.rune.", RecordType::A, "198.18.1.9"),
        (
            "fd00-0-0-0-0-0-1-5.db.default.rune.",
            RecordType::AAAA,
            "fd00::1:5",
        ),
    ] {
        assert_eq!(ips(&z.lookup(&name(target), qtype)), [ip(want)], "{target}");
    }
    // A VIP service's SRV record still names the service and its port.
    let z = zone(Mode::Production, &[web()]);
    let srv = z.lookup(&name("_http._tcp.web.shop.rune."), RecordType::SRV);
    assert_eq!(srv.answers.len(), 1);
}

#[test]
fn a_service_without_addresses_exists_with_no_answer() {
    let no_eps = view(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: lone}\n\
         spec: {ports: [{port: 80}], discovery: {headless: true}}\n",
        None,
    );
    let z = zone(Mode::Production, &[no_eps]);
    let a = z.lookup(&name("lone.default.rune."), RecordType::A);
    assert_eq!(a.rcode, ResponseCode::NoError);
    assert!(a.answers.is_empty());
    assert_soa_in_authority(&a);
    // An unnamed port has no SRV record.
    let srv = z.lookup(&name("_tcp.lone.default.rune."), RecordType::SRV);
    assert_eq!(srv.rcode, ResponseCode::NXDomain);
}

#[test]
fn dev_mode_answers_loopback_and_no_aaaa() {
    let z = zone(Mode::Dev, &[web(), headless()]);
    for svc in ["web.shop.rune.", "db.default.rune."] {
        let a = z.lookup(&name(svc), RecordType::A);
        assert_eq!(ips(&a), [ip("127.0.0.1")], "{svc}");
        let aaaa = z.lookup(&name(svc), RecordType::AAAA);
        assert_eq!(aaaa.rcode, ResponseCode::NoError, "{svc}");
        assert!(aaaa.answers.is_empty(), "{svc}: {aaaa:?}");
    }
    // SRV ports are where the dev proxies listen.
    let srv = z.lookup(&name("_http._tcp.web.shop.rune."), RecordType::SRV);
    match &srv.answers[0].data {
        RData::SRV(s) => assert_eq!(s.port, 10080),
        other => panic!("{other:?}"),
    }
    let ptr = z.lookup(&name("10.100.18.198.in-addr.arpa."), RecordType::PTR);
    assert_eq!(ptr.rcode, ResponseCode::Refused);
}

#[test]
fn another_domain_and_ttl_are_used() {
    let cfg = ZoneConfig {
        domain: "cluster.example.".into(),
        ttl: 30,
        mode: Mode::Production,
        dev_port_offset: 0,
    };
    let z = Zone::build(&cfg, 1, &[web()]).unwrap();
    let a = z.lookup(&name("web.shop.cluster.example."), RecordType::A);
    assert_eq!(ips(&a), [ip("198.18.100.10")]);
    assert_eq!(a.answers[0].ttl, 30);
    let old = z.lookup(&name("web.shop.rune."), RecordType::A);
    assert_eq!(old.rcode, ResponseCode::Refused);
}

#[tokio::test]
async fn the_zone_follows_the_cache() {
    use crate::orderedlog::{Event, Snapshot};
    let cache = Arc::new(EndpointCache::loaded());
    cache.apply_snapshot(&Snapshot {
        revision: 1,
        objects: vec![Object::Service((*web().service).clone())],
    });
    let zone = Arc::new(ArcSwap::from_pointee(
        Zone::build(&config(Mode::Production), 0, std::iter::empty()).unwrap(),
    ));
    let (ready, readiness) = Readiness::new();
    let cancel = CancellationToken::new();
    let applied = crate::applied::AppliedRevision::new();
    let task = tokio::spawn(follow(
        cache.clone(),
        config(Mode::Production),
        zone.clone(),
        ready,
        Some(applied.consumer("dns")),
        cancel.clone(),
    ));
    tokio::time::timeout(Duration::from_secs(5), readiness.wait())
        .await
        .unwrap();
    let a = zone
        .load()
        .lookup(&name("web.shop.rune."), RecordType::A)
        .rcode;
    assert_eq!(a, ResponseCode::NoError);

    cache.apply_event(&Event::Put {
        revision: 2,
        object: Object::Service((*headless().service).clone()),
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let z = zone.load();
        let found = z.lookup(&name("db.default.rune."), RecordType::A).rcode;
        if found == ResponseCode::NoError {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "new service not in the zone"
        );
        drop(z);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Each swap is acknowledged; a revision that changes nothing in DNS too.
    let mut rx = applied.subscribe();
    tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|r| *r == 2))
        .await
        .expect("revision 2 acknowledged")
        .unwrap();
    cache.apply_snapshot(&Snapshot {
        revision: 3,
        objects: vec![
            Object::Service((*web().service).clone()),
            Object::Service((*headless().service).clone()),
        ],
    });
    tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|r| *r == 3))
        .await
        .expect("revision 3 acknowledged without a change")
        .unwrap();
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
}

fn server(addrs: Vec<SocketAddr>) -> DnsServer {
    DnsServer::new(
        DnsConfig {
            addrs,
            zone: config(Mode::Production),
            forward: ForwardConfig::default(),
        },
        Arc::new(EndpointCache::loaded()),
        Arc::new(Metrics::new()),
    )
    .unwrap()
}

#[tokio::test]
async fn production_start_fails_with_the_address_and_the_os_reason() {
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let dns = server(vec![addr]);
    let ctx = StartContext::new(CancellationToken::new(), Mode::Production);
    let error = dns.start(&ctx).await.unwrap_err();
    let text = format!("{error}: {}", std::error::Error::source(&error).unwrap());
    assert!(text.starts_with(&format!("bind udp {addr}: ")), "{text}");
    assert!(text.to_lowercase().contains("in use"), "{text}");
    dns.stop().await.unwrap();
}

#[tokio::test]
async fn dev_start_without_a_free_address_is_ready_with_dns_off() {
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let dns = server(vec![addr]);
    let cancel = CancellationToken::new();
    dns.start(&StartContext::new(cancel.clone(), Mode::Dev))
        .await
        .unwrap();
    assert!(dns.ready().is_ready());
    match dns.state() {
        DnsState::Disabled { reason } => {
            assert!(
                reason.starts_with(&format!("bind udp {addr}: ")),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    cancel.cancel();
    dns.stop().await.unwrap();
}

#[tokio::test]
async fn serves_on_a_bound_port_and_stops() {
    let dns = server(vec!["127.0.0.1:0".parse().unwrap()]);
    let cancel = CancellationToken::new();
    dns.start(&StartContext::new(cancel.clone(), Mode::Dev))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), dns.ready().wait())
        .await
        .unwrap();
    let DnsState::Serving { addrs, upstreams } = dns.state() else {
        panic!("{:?}", dns.state())
    };
    assert_ne!(addrs[0].port(), 0);
    assert!(upstreams.is_empty(), "no upstream configured, none read");
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(5), dns.stop())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(dns.state(), DnsState::Off);
}

#[tokio::test]
async fn upstreams_that_are_the_agent_itself_are_left_out() {
    // A port free for both TCP and UDP when asked.
    let port = loop {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = tcp.local_addr().unwrap().port();
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            break port;
        }
    };
    let own: SocketAddr = SocketAddr::from(([127, 0, 0, 1], port));
    // Never asked: no query is sent in this test.
    let other: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let dns = DnsServer::new(
        DnsConfig {
            addrs: vec![own],
            zone: config(Mode::Production),
            forward: ForwardConfig {
                upstreams: vec![own, other],
                ..ForwardConfig::default()
            },
        },
        Arc::new(EndpointCache::loaded()),
        Arc::new(Metrics::new()),
    )
    .unwrap();
    let cancel = CancellationToken::new();
    dns.start(&StartContext::new(cancel.clone(), Mode::Dev))
        .await
        .unwrap();
    match dns.state() {
        DnsState::Serving { upstreams, .. } => assert_eq!(upstreams, [other]),
        other => panic!("{other:?}"),
    }
    assert!(
        dns.state()
            .to_string()
            .ends_with("; forwarding to 127.0.0.1:9")
    );
    cancel.cancel();
    dns.stop().await.unwrap();
}

/// Every question the tests ask, with what a zone answers.
fn answers_of(z: &Zone) -> Vec<(String, RecordType, Answer)> {
    let names = [
        "rune.",
        "shop.rune.",
        "default.rune.",
        "web.shop.rune.",
        "_http._tcp.web.shop.rune.",
        "_tcp.web.shop.rune.",
        "_dns._udp.web.shop.rune.",
        "db.default.rune.",
        "_pg._tcp.db.default.rune.",
        "198-18-1-2.db.default.rune.",
        "fd00-0-0-0-0-0-1-5.db.default.rune.",
        "10.100.18.198.in-addr.arpa.",
        "11.100.18.198.in-addr.arpa.",
    ];
    let types = [
        RecordType::A,
        RecordType::AAAA,
        RecordType::SRV,
        RecordType::PTR,
        RecordType::SOA,
        RecordType::NS,
        RecordType::ANY,
    ];
    names
        .iter()
        .flat_map(|n| types.iter().map(move |t| (n.to_string(), *t)))
        .map(|(n, t)| {
            let a = z.lookup(&name(&n), t);
            (n, t, a)
        })
        .collect()
}

#[test]
fn per_delta_updates_answer_as_a_zone_built_whole() {
    use crate::endpoints::Delta;
    let cfg = config(Mode::Production);
    let moved = view(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: web, namespace: shop}\n\
         spec:\n  ports: [{name: http, port: 8080}]\n  discovery: {vips: [198.18.100.11]}\n",
        None,
    );
    let delta = |upserted: Vec<ServiceView>, removed: Vec<ServiceView>| Delta {
        revision: 7,
        full: false,
        upserted,
        removed: removed.iter().map(ServiceView::key).collect(),
    };
    let mut writer = ZoneWriter::new(&cfg).unwrap();
    writer.apply(delta(vec![web(), headless()], vec![]));
    assert_eq!(
        answers_of(&writer.publish(7)),
        answers_of(&zone(Mode::Production, &[web(), headless()]))
    );
    let before = writer.publish(7);
    // The VIP, the port and a port name change: the old PTR and SRV names go.
    writer.apply(delta(vec![moved.clone()], vec![]));
    let after = writer.publish(7);
    assert_eq!(
        answers_of(&after),
        answers_of(&zone(Mode::Production, &[moved.clone(), headless()]))
    );
    assert_eq!(
        after
            .lookup(&name("10.100.18.198.in-addr.arpa."), RecordType::PTR)
            .rcode,
        ResponseCode::Refused
    );
    assert_eq!(
        after
            .lookup(&name("_dns._udp.web.shop.rune."), RecordType::SRV)
            .rcode,
        ResponseCode::NXDomain
    );
    // A version already published does not change.
    assert_eq!(
        answers_of(&before),
        answers_of(&zone(Mode::Production, &[web(), headless()]))
    );
    // A headless endpoint that stops being ready takes its name and SRV record.
    let fewer = view(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: db}\n\
         spec: {ports: [{name: pg, port: 5432}], discovery: {headless: true}}\n",
        Some(
            "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: db}\nspec:\n  endpoints:\n\
             \x20   - {address: 198.18.1.2, ready: false}\n\
             \x20   - {address: 'fd00::1:5', ready: true}\n",
        ),
    );
    writer.apply(delta(vec![fewer.clone()], vec![]));
    let gone = writer.publish(7);
    assert_eq!(
        answers_of(&gone),
        answers_of(&zone(Mode::Production, &[moved.clone(), fewer]))
    );
    assert_eq!(
        gone.lookup(&name("198-18-1-2.db.default.rune."), RecordType::A)
            .rcode,
        ResponseCode::NXDomain
    );
    writer.apply(delta(vec![headless()], vec![]));
    // The last service of a namespace goes: so does the namespace's name.
    writer.apply(delta(vec![], vec![moved]));
    let last = writer.publish(7);
    assert_eq!(
        answers_of(&last),
        answers_of(&zone(Mode::Production, &[headless()]))
    );
    assert_eq!(
        last.lookup(&name("shop.rune."), RecordType::A).rcode,
        ResponseCode::NXDomain
    );
    // A full delta replaces everything.
    writer.apply(Delta {
        revision: 7,
        full: true,
        upserted: vec![web()],
        removed: vec![],
    });
    assert_eq!(
        answers_of(&writer.publish(7)),
        answers_of(&zone(Mode::Production, &[web()]))
    );
    assert_eq!(writer.services(), 1);
}
