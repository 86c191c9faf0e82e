//! Element-only transactions sent to the kernel as one nfnetlink batch, without
//! starting `nft`: an endpoint change is a few element commands, and starting the
//! `nft` process (exec, libraries, its cache read) is most of its cost on a busy
//! node. Anything else (chains, sets, full syncs) still goes through `nft -f`.
//!
//! The batch is atomic like `nft -f`: the kernel applies all of it or nothing.
//!
//! Encoded here rather than through a crate: rustables is GPL-3.0, and nftnl binds
//! the C libnftnl, whose sets take keys only (no map data, no element deletes).

use super::ruleset::{ElementKey, ElementOp, ElementValue, TABLE_NAME};
use crate::dataplane::ebpf::codec::proto_number;
use std::{
    io,
    net::{IpAddr, SocketAddr},
};

const NETLINK_NETFILTER: libc::c_int = 12;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFPROTO_INET: u8 = 1;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 0x2;
const NLA_F_NESTED: u16 = 0x8000;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
const NFT_GOTO: i32 = -4;

/// Why a batch could not be sent.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// The socket could not be used.
    #[error("nfnetlink socket: {0}")]
    Io(#[from] io::Error),
    /// The kernel refused the batch (nothing of it was applied).
    #[error("the kernel refused the element batch: {0}")]
    Refused(io::Error),
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

fn attr(out: &mut Vec<u8>, ty: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&ty.to_ne_bytes());
    out.extend_from_slice(payload);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

fn nested(out: &mut Vec<u8>, ty: u16, build: impl FnOnce(&mut Vec<u8>)) {
    let mut inner = Vec::new();
    build(&mut inner);
    attr(out, ty | NLA_F_NESTED, &inner);
}

fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

/// One netlink message: header, nfgenmsg (`family`, `res_id`), attributes.
fn message(
    out: &mut Vec<u8>,
    ty: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
    attrs: &[u8],
) {
    let len = 16 + 4 + attrs.len();
    out.extend_from_slice(&(len as u32).to_ne_bytes());
    out.extend_from_slice(&ty.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.push(family);
    out.push(0);
    out.extend_from_slice(&res_id.to_be_bytes());
    out.extend_from_slice(attrs);
}

/// The batch for `ops`: begin, one message per command, end. Returns the bytes
/// and the sequence numbers that want an answer.
pub fn batch(ops: &[ElementOp], first_seq: u32) -> (Vec<u8>, Vec<u32>) {
    let mut out = Vec::new();
    let mut seq = first_seq;
    message(
        &mut out,
        NFNL_MSG_BATCH_BEGIN,
        NLM_F_REQUEST,
        seq,
        0,
        NFNL_SUBSYS_NFTABLES,
        &[],
    );
    let mut acked = Vec::new();
    for op in ops {
        seq += 1;
        let mut attrs = Vec::new();
        attr(&mut attrs, NFTA_SET_ELEM_LIST_TABLE, &cstr(TABLE_NAME));
        attr(&mut attrs, NFTA_SET_ELEM_LIST_SET, &cstr(op.map));
        nested(&mut attrs, NFTA_SET_ELEM_LIST_ELEMENTS, |list| {
            nested(list, NFTA_LIST_ELEM, |elem| {
                nested(elem, NFTA_SET_ELEM_KEY, |k| {
                    attr(k, NFTA_DATA_VALUE, &key_bytes(&op.key))
                });
                match &op.value {
                    Some(ElementValue::Backend(b)) => {
                        nested(elem, NFTA_SET_ELEM_DATA, |d| {
                            attr(d, NFTA_DATA_VALUE, &backend_bytes(*b))
                        });
                    }
                    Some(ElementValue::Goto(chain)) => {
                        nested(elem, NFTA_SET_ELEM_DATA, |d| {
                            nested(d, NFTA_DATA_VERDICT, |v| {
                                attr(v, NFTA_VERDICT_CODE, &NFT_GOTO.to_be_bytes());
                                attr(v, NFTA_VERDICT_CHAIN, &cstr(chain));
                            });
                        });
                    }
                    None => {}
                }
            });
        });
        let (ty, flags) = if op.value.is_some() {
            (NFT_MSG_NEWSETELEM, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE)
        } else {
            (NFT_MSG_DELSETELEM, NLM_F_REQUEST | NLM_F_ACK)
        };
        message(
            &mut out,
            (NFNL_SUBSYS_NFTABLES << 8) | ty,
            flags,
            seq,
            NFPROTO_INET,
            0,
            &attrs,
        );
        acked.push(seq);
    }
    seq += 1;
    message(
        &mut out,
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST,
        seq,
        0,
        NFNL_SUBSYS_NFTABLES,
        &[],
    );
    (out, acked)
}

/// A netfilter netlink socket kept open between batches: closing one makes the
/// kernel wait for a grace period, longer than a batch takes.
#[derive(Debug)]
pub struct Socket {
    fd: std::os::fd::OwnedFd,
    seq: u32,
}

impl Socket {
    /// Opens a socket in the calling thread's network namespace.
    pub fn open() -> Result<Self, NetlinkError> {
        use std::os::fd::FromRawFd as _;
        // SAFETY: plain socket syscall; the descriptor is owned from here on.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                NETLINK_NETFILTER,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error().into());
        }
        // SAFETY: `fd` was just opened and nothing else owns it.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let timeout = libc::timeval {
            tv_sec: 5,
            tv_usec: 0,
        };
        // SAFETY: valid fd and option buffer of the right size.
        unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            );
        }
        Ok(Self { fd, seq: 0 })
    }

    /// Sends `ops` as one batch and waits for the kernel's answer to each command.
    pub fn apply(&mut self, ops: &[ElementOp]) -> Result<(), NetlinkError> {
        let first = self.seq.wrapping_add(1);
        self.seq = first.wrapping_add(ops.len() as u32 + 2);
        // SAFETY: the socket is open for as long as `self` lives.
        unsafe { send_and_wait(std::os::fd::AsRawFd::as_raw_fd(&self.fd), ops, first) }
    }
}

/// # Safety
/// `fd` is an open netlink socket.
unsafe fn send_and_wait(
    fd: libc::c_int,
    ops: &[ElementOp],
    first_seq: u32,
) -> Result<(), NetlinkError> {
    let (bytes, mut waiting) = batch(ops, first_seq);
    // SAFETY: the buffer is valid for its length.
    let sent = unsafe { libc::send(fd, bytes.as_ptr().cast(), bytes.len(), 0) };
    if sent < 0 {
        return Err(io::Error::last_os_error().into());
    }
    let mut buf = vec![0u8; 65536];
    while !waiting.is_empty() {
        // SAFETY: the buffer is valid for its length.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error().into());
        }
        let mut msg = &buf[..n as usize];
        while msg.len() >= 16 {
            let len = u32::from_ne_bytes(msg[0..4].try_into().unwrap_or_default()) as usize;
            let ty = u16::from_ne_bytes(msg[4..6].try_into().unwrap_or_default());
            let seq = u32::from_ne_bytes(msg[8..12].try_into().unwrap_or_default());
            if len < 16 || len > msg.len() {
                break;
            }
            if ty == NLMSG_ERROR && len >= 20 {
                let code = i32::from_ne_bytes(msg[16..20].try_into().unwrap_or_default());
                if code != 0 {
                    return Err(NetlinkError::Refused(io::Error::from_raw_os_error(-code)));
                }
                waiting.retain(|s| *s != seq);
            }
            msg = &msg[len.next_multiple_of(4).min(msg.len())..];
        }
    }
    Ok(())
}
