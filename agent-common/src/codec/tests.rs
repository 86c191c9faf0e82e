use super::*;
use crate::lb::{BACKEND_ACTIVE, BACKEND_DRAINING};
use core::net::Ipv6Addr;

fn sa(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("IP address")
}

#[test]
fn keys_and_values_are_in_network_order_and_round_trip() {
    let k = frontend_key(ip("198.18.0.1"), 80, lb::PROTO_TCP);
    let FrontendKey::V4(v4) = k else {
        panic!("{k:?}")
    };
    assert_eq!(v4.addr.to_ne_bytes(), [198, 18, 0, 1]);
    assert_eq!(v4.port.to_ne_bytes(), [0, 80]);
    assert_eq!((v4.proto, v4.pad), (lb::PROTO_TCP, 0));
    assert_eq!(frontend_addr(&k), (sa("198.18.0.1:80"), lb::PROTO_TCP));

    let k = frontend_key(ip("fd00::1:2"), 0x1234, lb::PROTO_UDP);
    let FrontendKey::V6(v6) = k else {
        panic!("{k:?}")
    };
    assert_eq!(
        lb::addr_octets(&v6.addr),
        "fd00::1:2".parse::<Ipv6Addr>().expect("IPv6").octets()
    );
    assert_eq!(v6.port.to_ne_bytes(), [0x12, 0x34]);
    assert_eq!(frontend_addr(&k), (sa("[fd00::1:2]:4660"), lb::PROTO_UDP));

    for a in [
        "198.18.1.2:8080",
        "[fd00:1::2]:53",
        "10.0.0.1:65535",
        "[::1]:1",
    ] {
        let b = backend_value(sa(a), BACKEND_DRAINING);
        assert_eq!(backend_addr(&b), Some(sa(a)));
        assert_eq!(b.state, BACKEND_DRAINING);
        assert_eq!(b.port.to_ne_bytes(), sa(a).port().to_be_bytes());
        let want = if a.starts_with('[') {
            FAMILY_V6
        } else {
            FAMILY_V4
        };
        assert_eq!(b.family, want);
    }
    let b = backend_value(sa("198.18.1.2:8080"), BACKEND_ACTIVE);
    assert_eq!(&lb::addr_octets(&b.addr)[..4], [198, 18, 1, 2]);
    assert_eq!(&b.addr[1..], [0, 0, 0]);
    assert_eq!(backend_addr(&Backend::default()), None);
}

/// Keys sort as the sync engine walks its frontends (and so orders its writes):
/// every IPv4 frontend before every IPv6 one.
#[test]
fn ipv4_keys_sort_before_ipv6_keys() {
    let v4 = frontend_key(ip("255.255.255.255"), 65535, lb::PROTO_UDP);
    let v6 = frontend_key(ip("::"), 0, lb::PROTO_TCP);
    assert!(v4 < v6);
}
