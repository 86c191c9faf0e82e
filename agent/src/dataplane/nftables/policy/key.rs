//! The key of a policy set or map element: what the nft script writes (its
//! `Display`) and what the netlink encoder turns into the kernel's bytes.

use crate::{dataplane::nftables::ruleset::proto, model::Protocol};
use ipnet::IpNet;
use std::{fmt, net::IpAddr};

/// The key of a policy set or map element, written in nft's syntax by `Display`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PolicyKey {
    /// A guarded address (the verdict maps).
    Addr(IpAddr),
    /// A peer prefix (the interval sets).
    Prefix(IpNet),
    /// Guarded address . protocol . port (the port sets).
    Port(IpAddr, Protocol, u16),
}

impl fmt::Display for PolicyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyKey::Addr(a) => write!(f, "{a}"),
            PolicyKey::Prefix(n) => write!(f, "{n}"),
            PolicyKey::Port(a, p, port) => write!(f, "{a} . {} . {port}", proto(*p)),
        }
    }
}
