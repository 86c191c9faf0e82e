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
mod tests;
