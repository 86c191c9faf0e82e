//! Conversions between socket addresses and the load balancer's map keys and
//! values ([`crate::lb`]), for the user-space side: one copy for every data plane,
//! test and tool that writes or reads the maps.
//!
//! Every conversion keeps the maps' byte order (see [`crate::lb`]): addresses and
//! ports in network order, an IPv4 address in word 0 of an [`lb::Addr`].

use crate::lb::{
    self, Backend, FAMILY_V4, FAMILY_V6, ServiceKeyV4, ServiceKeyV6, addr_from_octets,
};
use core::net::{IpAddr, SocketAddr};

/// A frontend's key in either family's services map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrontendKey {
    /// A key of [`lb::SERVICES_V4`].
    V4(ServiceKeyV4),
    /// A key of [`lb::SERVICES_V6`].
    V6(ServiceKeyV6),
}

/// The map key of VIP `vip`, service port `port`, protocol `proto`
/// ([`lb::PROTO_TCP`] or [`lb::PROTO_UDP`]).
#[must_use]
pub fn frontend_key(vip: IpAddr, port: u16, proto: u8) -> FrontendKey {
    match vip {
        IpAddr::V4(a) => FrontendKey::V4(ServiceKeyV4 {
            addr: u32::from_ne_bytes(a.octets()),
            port: port.to_be(),
            proto,
            pad: 0,
        }),
        IpAddr::V6(a) => FrontendKey::V6(ServiceKeyV6 {
            addr: addr_from_octets(&a.octets()),
            port: port.to_be(),
            proto,
            pad: 0,
        }),
    }
}

/// The VIP, port and protocol a frontend key describes.
#[must_use]
pub fn frontend_addr(key: &FrontendKey) -> (SocketAddr, u8) {
    match key {
        FrontendKey::V4(k) => {
            let o = k.addr.to_ne_bytes();
            (
                SocketAddr::new(IpAddr::from(o), u16::from_be(k.port)),
                k.proto,
            )
        }
        FrontendKey::V6(k) => (
            SocketAddr::new(IpAddr::from(lb::addr_octets(&k.addr)), u16::from_be(k.port)),
            k.proto,
        ),
    }
}

/// The map value of backend `addr` in `state` ([`lb::BACKEND_ACTIVE`] or
/// [`lb::BACKEND_DRAINING`]).
#[must_use]
pub fn backend_value(addr: SocketAddr, state: u8) -> Backend {
    // An IPv4 address in the first four octets, the rest zero: the same words as
    // its four octets alone (and no allocation).
    let mut octets = [0u8; 16];
    let family = match addr.ip() {
        IpAddr::V4(a) => {
            octets[..4].copy_from_slice(&a.octets());
            FAMILY_V4
        }
        IpAddr::V6(a) => {
            octets = a.octets();
            FAMILY_V6
        }
    };
    Backend {
        addr: addr_from_octets(&octets),
        port: addr.port().to_be(),
        family,
        state,
    }
}

/// The socket address a backend value describes, if it is a used slot.
#[must_use]
pub fn backend_addr(b: &Backend) -> Option<SocketAddr> {
    let octets = lb::addr_octets(&b.addr);
    let ip = match b.family {
        FAMILY_V4 => IpAddr::from([octets[0], octets[1], octets[2], octets[3]]),
        FAMILY_V6 => IpAddr::from(octets),
        _ => return None,
    };
    Some(SocketAddr::new(ip, u16::from_be(b.port)))
}

#[cfg(test)]
mod tests {
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
}
