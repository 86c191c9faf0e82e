use super::{PREFIX_MAX, Prefix, describe, digest, flow, log_rule, parse_prefix, prefix, publish};
use crate::{
    dataplane::nftables::policy::objects,
    model::{PolicyMode, ServiceKey},
    policy::{
        compile::{
            compile,
            tests::{service, views},
        },
        events::hub,
        metrics::{Direction, DropReason},
    },
};
use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterProtoFamily,
    nflog::{PacketNla, ULogMessage},
};
use std::ffi::CString;

/// An IPv4 TCP packet 198.18.1.2:40000 → 198.18.11.2:8080 (header fields the
/// parser reads; the rest zero).
fn tcp4() -> Vec<u8> {
    let mut p = vec![0u8; 40];
    p[0] = 0x45;
    p[9] = 6;
    p[12..16].copy_from_slice(&[198, 18, 1, 2]);
    p[16..20].copy_from_slice(&[198, 18, 11, 2]);
    p[20..22].copy_from_slice(&40000u16.to_be_bytes());
    p[22..24].copy_from_slice(&8080u16.to_be_bytes());
    p
}

/// An IPv6 UDP packet [fd00::1]:5353 → [fd00::2]:53.
fn udp6() -> Vec<u8> {
    let mut p = vec![0u8; 48];
    p[0] = 0x60;
    p[6] = 17;
    p[8..24].copy_from_slice(&"fd00::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
    p[24..40].copy_from_slice(&"fd00::2".parse::<std::net::Ipv6Addr>().unwrap().octets());
    p[40..42].copy_from_slice(&5353u16.to_be_bytes());
    p[42..44].copy_from_slice(&53u16.to_be_bytes());
    p
}

#[test]
fn a_prefix_names_direction_reason_mode_and_service_and_reads_back() {
    let key = ServiceKey::new("shop", "web");
    let p = prefix(
        Direction::Egress,
        DropReason::PortNotAllowed,
        PolicyMode::Audit,
        &key,
    );
    assert_eq!(p, "opa shop/web");
    assert_eq!(
        parse_prefix(&p),
        Some(Prefix {
            direction: Direction::Egress,
            reason: DropReason::PortNotAllowed,
            audit: true,
            service: "shop/web".to_owned(),
        })
    );
    assert_eq!(parse_prefix("rune: something else"), None);
    assert_eq!(parse_prefix("xne a/b"), None);
}

#[test]
fn a_name_too_long_for_the_kernel_goes_as_a_digest_that_resolves() {
    let key = ServiceKey::new("n".repeat(63), "s".repeat(63));
    let p = prefix(
        Direction::Ingress,
        DropReason::NoMatchingRule,
        PolicyMode::Enforce,
        &key,
    );
    assert!(p.len() <= PREFIX_MAX, "{p}");
    assert_eq!(p, format!("ine #{}", digest(&key)));
    let wanted = key.clone();
    let event = describe(&p, &tcp4(), &|d| {
        (d == digest(&wanted)).then(|| wanted.clone())
    })
    .expect("resolved");
    assert_eq!(event.service, key.name);
    assert_eq!(event.namespace, key.namespace);
    // An unknown digest names no service: no event.
    assert_eq!(describe(&p, &tcp4(), &|_| None), None);
}

#[test]
fn packets_give_addresses_ports_and_protocol() {
    let (src, dst, proto) = flow(&tcp4()).unwrap();
    assert_eq!(
        (src.to_string(), dst.to_string(), proto),
        (
            "198.18.1.2:40000".to_owned(),
            "198.18.11.2:8080".to_owned(),
            6
        )
    );
    let (src, dst, proto) = flow(&udp6()).unwrap();
    assert_eq!(
        (src.to_string(), dst.to_string(), proto),
        ("[fd00::1]:5353".to_owned(), "[fd00::2]:53".to_owned(), 17)
    );
    // ICMP: no ports. Truncated or not IP: nothing.
    let mut icmp = tcp4();
    icmp[9] = 1;
    assert_eq!(flow(&icmp).unwrap().0.port(), 0);
    assert_eq!(flow(&tcp4()[..10]), None);
    assert_eq!(flow(&[0x20; 40]), None);
    // A fragment after the first, or a header length below 20: no ports.
    let mut fragment = tcp4();
    fragment[6..8].copy_from_slice(&185u16.to_be_bytes());
    let (src, dst, _) = flow(&fragment).unwrap();
    assert_eq!((src.port(), dst.port()), (0, 0));
    let mut short = tcp4();
    short[0] = 0x42;
    assert_eq!(flow(&short).unwrap().1.port(), 0);
}

#[test]
fn an_event_carries_what_observe_shows() {
    let e = describe("ine shop/web", &tcp4(), &|_| None).unwrap();
    assert_eq!(e.source, "198.18.1.2:40000");
    assert_eq!(e.destination, "198.18.11.2:8080");
    assert_eq!(e.protocol, "TCP");
    assert_eq!(e.verdict, "denied");
    assert_eq!(e.reason, "no_matching_rule");
    assert_eq!(e.direction, "ingress");
    assert_eq!((e.namespace.as_str(), e.service.as_str()), ("shop", "web"));
    let e = describe("opa shop/web", &udp6(), &|_| None).unwrap();
    assert_eq!(
        (e.verdict, e.reason, e.direction, e.protocol.as_str()),
        ("audit", "port_not_allowed", "egress", "UDP")
    );
}

#[test]
fn the_refusing_chains_log_first_and_the_allowing_one_does_not() {
    let ports = "[{name: http, port: 80, targetPort: 8080}]";
    let plan = compile(
        "node-a",
        &views(&service(
            "shop",
            "web",
            ports,
            "",
            "{ingress: [{from: [{cidr: 198.18.1.0/24}], ports: [http]}]}",
            "[{address: 198.18.11.2}]",
        )),
    );
    let o = objects(&plan, Some(6108));
    let key = ServiceKey::new("shop", "web");
    let log = |reason| log_rule(6108, Direction::Ingress, reason, PolicyMode::Enforce, &key);
    assert_eq!(
        o.chains["pol-nomatch-in-e-shop/web"],
        [
            log(DropReason::NoMatchingRule),
            "counter name pc-in-nomatch-shop/web drop".to_owned()
        ]
    );
    assert_eq!(
        o.chains["pol-port-in-e-shop/web"][0],
        log(DropReason::PortNotAllowed)
    );
    assert_eq!(o.chains["pol-ok-in-e-shop/web"].len(), 1);
    assert_eq!(
        log(DropReason::NoMatchingRule),
        "limit rate 10/second burst 20 packets log prefix \"ine shop/web\" group 6108"
    );
    // Without a group nothing logs.
    let o = objects(&plan, None);
    assert_eq!(o.chains["pol-nomatch-in-e-shop/web"].len(), 1);
}

#[tokio::test]
async fn a_datagram_of_several_messages_publishes_each_packet() {
    let mut rx = hub().subscribe();
    let mut bytes = Vec::new();
    for (prefix, payload) in [("ine a/one", tcp4()), ("ipa a/two", udp6())] {
        let mut m = NetlinkMessage::new(
            NetlinkHeader::default(),
            NetlinkPayload::from(NetfilterMessage::new(
                NetfilterHeader::new(NetfilterProtoFamily::Inet, 0, 6108),
                ULogMessage::Packet(vec![
                    PacketNla::Prefix(CString::new(prefix).unwrap()),
                    PacketNla::Payload(payload),
                ]),
            )),
        );
        m.finalize();
        let mut buf = vec![0; m.header.length as usize];
        m.serialize(&mut buf);
        bytes.extend_from_slice(&buf);
    }
    publish(&bytes, &|_| None);
    // The hub is the process's: other tests may publish too; find ours.
    let mut seen = Vec::new();
    while let Ok(e) = rx.try_recv() {
        if e.namespace == "a" {
            seen.push(e.service);
        }
    }
    assert_eq!(seen, ["one", "two"]);
}
