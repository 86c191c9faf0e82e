//! The element commands a batch carries, with their keys and data as the kernel
//! stores them: the DNAT maps' elements ([`ElementOp`]) and the policy sets' and
//! maps' ([`PolicyKey`]).
//!
//! A peer prefix in a single-field interval set is two elements, as `nft` sends
//! it: its first address, and the address after its last flagged as the
//! interval's end; a prefix that reaches the last address has no end element and
//! is marked open in its user data instead (so `nft list` shows it as `nft`
//! wrote it). Deleting a prefix names both elements again.

use super::super::ruleset::{ElementKey, ElementOp, ElementValue};
use crate::dataplane::{ebpf::codec::proto_number, nftables::policy::key::PolicyKey};
use ipnet::IpNet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The element flag of an interval's end.
pub const NFT_SET_ELEM_INTERVAL_END: u32 = 0x1;
/// libnftnl's user data of an interval without an end: attribute
/// `NFTNL_UDATA_SET_ELEM_FLAGS` (1), 4 bytes, `NFTNL_SET_ELEM_F_INTERVAL_OPEN` (1).
const OPEN_INTERVAL_UDATA: [u8; 6] = [1, 4, 1, 0, 0, 0];

/// One element command of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Element {
    /// The set or map.
    pub set: String,
    /// Add (`NEWSETELEM`) or delete (`DELSETELEM`).
    pub add: bool,
    /// The key as the kernel stores it.
    pub key: Vec<u8>,
    /// Element flags ([`NFT_SET_ELEM_INTERVAL_END`]).
    pub flags: u32,
    /// User data, when any.
    pub udata: Option<Vec<u8>>,
    /// A map element's data (additions only).
    pub data: Option<Data>,
}

/// A map element's data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Data {
    /// A verdict map's `goto CHAIN`.
    Goto(String),
    /// A data map's value, as the kernel stores it.
    Value(Vec<u8>),
}

/// Appends a 4-byte-aligned register word holding `bytes` (zero padded).
fn push_word(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(bytes);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

/// Appends `ip` as a register word (4 or 16 bytes).
fn push_addr(out: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(a) => push_word(out, &a.octets()),
        IpAddr::V6(a) => push_word(out, &a.octets()),
    }
}

/// `key` as the kernel stores it: addresses as they are, ports big-endian,
/// protocols one byte, the numgen index host-endian, each part padded to 4 bytes.
pub fn key_bytes(key: &ElementKey) -> Vec<u8> {
    let mut out = Vec::new();
    match *key {
        ElementKey::Port {
            vip,
            protocol,
            port,
        } => {
            push_addr(&mut out, vip);
            push_word(&mut out, &[proto_number(protocol)]);
            push_word(&mut out, &port.to_be_bytes());
        }
        ElementKey::Backend { vip, port, index } => {
            push_addr(&mut out, vip);
            push_word(&mut out, &port.to_be_bytes());
            push_word(&mut out, &index.to_ne_bytes());
        }
    }
    out
}

/// A data map's value (`addr . port`) as the kernel stores it.
pub fn backend_bytes(backend: SocketAddr) -> Vec<u8> {
    let mut out = Vec::new();
    push_addr(&mut out, backend.ip());
    push_word(&mut out, &backend.port().to_be_bytes());
    out
}

impl From<&ElementOp> for Element {
    fn from(op: &ElementOp) -> Self {
        Element {
            set: op.map.to_owned(),
            add: op.value.is_some(),
            key: key_bytes(&op.key),
            flags: 0,
            udata: None,
            data: op.value.as_ref().map(|v| match v {
                ElementValue::Goto(chain) => Data::Goto(chain.clone()),
                ElementValue::Backend(b) => Data::Value(backend_bytes(*b)),
            }),
        }
    }
}

/// The address after the last one of `net`; `None` when `net` reaches the end of
/// its family's space.
fn after(net: &IpNet) -> Option<IpAddr> {
    match net.broadcast() {
        IpAddr::V4(a) => u32::from(a)
            .checked_add(1)
            .map(|n| IpAddr::V4(Ipv4Addr::from(n))),
        IpAddr::V6(a) => u128::from(a)
            .checked_add(1)
            .map(|n| IpAddr::V6(Ipv6Addr::from(n))),
    }
}

/// The element commands that add (`goto` given for map elements) or delete
/// policy element `key` of `set`.
pub fn policy_elements(set: &str, key: &PolicyKey, goto: Option<&str>, add: bool) -> Vec<Element> {
    let element = |key: Vec<u8>, flags: u32, udata: Option<Vec<u8>>| Element {
        set: set.to_owned(),
        add,
        key,
        flags,
        udata,
        data: goto.filter(|_| add).map(|c| Data::Goto(c.to_owned())),
    };
    let mut bytes = Vec::new();
    match *key {
        PolicyKey::Addr(a) => {
            push_addr(&mut bytes, a);
            vec![element(bytes, 0, None)]
        }
        PolicyKey::Port(a, protocol, port) => {
            push_addr(&mut bytes, a);
            push_word(&mut bytes, &[proto_number(protocol)]);
            push_word(&mut bytes, &port.to_be_bytes());
            vec![element(bytes, 0, None)]
        }
        PolicyKey::Prefix(net) => {
            push_addr(&mut bytes, net.network());
            match after(&net) {
                Some(end) => {
                    let mut end_bytes = Vec::new();
                    push_addr(&mut end_bytes, end);
                    vec![
                        element(bytes, 0, None),
                        element(end_bytes, NFT_SET_ELEM_INTERVAL_END, None),
                    ]
                }
                None => vec![element(bytes, 0, Some(OPEN_INTERVAL_UDATA.to_vec()))],
            }
        }
    }
}
