//! Element-only transactions sent to the kernel as one nfnetlink batch, without
//! starting `nft`: an endpoint or policy change is a few element commands
//! ([`elements`]), and starting the
//! `nft` process (exec, libraries, its cache read) is most of its cost on a busy
//! node. Anything else (chains, sets, full syncs) still goes through `nft -f`.
//!
//! The batch is atomic like `nft -f`: the kernel applies all of it or nothing.
//!
//! Encoded here rather than through a crate: rustables is GPL-3.0, and nftnl binds
//! the C libnftnl, whose sets take keys only (no map data, no element deletes).

mod elements;
#[cfg(test)]
mod tests;

pub use elements::{Data, Element, backend_bytes, key_bytes, policy_elements};

use super::ruleset::TABLE_NAME;
use std::io;

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
const NFTA_SET_ELEM_FLAGS: u16 = 3;
const NFTA_SET_ELEM_USERDATA: u16 = 6;
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

/// Most elements one message carries.
const ELEMENTS_PER_MESSAGE: usize = 256;

/// The batch for `ops`: begin, one message per run of commands on the same set
/// (additions or deletions), end. Returns the bytes and the sequence numbers that
/// want an answer.
pub fn batch(ops: &[Element], first_seq: u32) -> (Vec<u8>, Vec<u32>) {
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
    let runs = ops
        .chunk_by(|a, b| a.set == b.set && a.add == b.add)
        .flat_map(|run| run.chunks(ELEMENTS_PER_MESSAGE));
    for run in runs {
        seq += 1;
        let mut attrs = Vec::new();
        attr(&mut attrs, NFTA_SET_ELEM_LIST_TABLE, &cstr(TABLE_NAME));
        attr(&mut attrs, NFTA_SET_ELEM_LIST_SET, &cstr(&run[0].set));
        nested(&mut attrs, NFTA_SET_ELEM_LIST_ELEMENTS, |list| {
            for op in run {
                nested(list, NFTA_LIST_ELEM, |elem| encode_element(elem, op));
            }
        });
        let (ty, flags) = if run[0].add {
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

/// The attributes of one element: key, flags, data, user data.
fn encode_element(elem: &mut Vec<u8>, op: &Element) {
    nested(elem, NFTA_SET_ELEM_KEY, |k| {
        attr(k, NFTA_DATA_VALUE, &op.key)
    });
    if op.flags != 0 {
        attr(elem, NFTA_SET_ELEM_FLAGS, &op.flags.to_be_bytes());
    }
    match &op.data {
        Some(Data::Value(v)) => {
            nested(elem, NFTA_SET_ELEM_DATA, |d| attr(d, NFTA_DATA_VALUE, v));
        }
        Some(Data::Goto(chain)) => {
            nested(elem, NFTA_SET_ELEM_DATA, |d| {
                nested(d, NFTA_DATA_VERDICT, |v| {
                    attr(v, NFTA_VERDICT_CODE, &NFT_GOTO.to_be_bytes());
                    attr(v, NFTA_VERDICT_CHAIN, &cstr(chain));
                });
            });
        }
        None => {}
    }
    if let Some(udata) = &op.udata {
        attr(elem, NFTA_SET_ELEM_USERDATA, udata);
    }
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
    pub fn apply(&mut self, ops: &[Element]) -> Result<(), NetlinkError> {
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
    ops: &[Element],
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
