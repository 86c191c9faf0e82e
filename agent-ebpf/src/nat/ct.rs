//! Conntrack entry lifetime (the rules are on `agent_common::lb::CtValue`): which
//! backend a packet to a VIP goes to and what its entry records ([`lookup`],
//! [`insert`]), and
//! whether a backend's packet is a reply of the flow an entry describes
//! ([`is_reply`]).
//!
//! Writes are kept off the established path: a TCP entry is written when a SYN
//! (re)starts a flow on its tuple, a UDP entry at most once per `ct_now` unit.

use agent_common::lb::{BACKEND_ACTIVE, Backend, CtValue, DropReason, ct_now, ct_udp_live};
use aya_ebpf::{helpers::bpf_ktime_get_ns, maps::LruHashMap};

use super::parse::{L4Pos, TCP_LEN, load};
use crate::{maps::RUNE_BACKENDS, select};

/// TCP flag SYN.
const TCP_SYN: u8 = 0x02;
/// TCP flag ACK.
const TCP_ACK: u8 = 0x10;

/// What conntrack reads of a packet's transport header.
#[derive(Clone, Copy)]
pub struct Segment {
    /// TCP: the flags byte; 0 for UDP, or a TCP header cut short.
    flags: u8,
    /// TCP: the sequence number (network order).
    seq: u32,
    /// TCP: the acknowledgment number (network order).
    ack: u32,
    /// UDP: `ct_now` at this packet; `None` for TCP.
    udp_now: Option<u32>,
}

impl Segment {
    /// Reads the TCP flags, sequence and acknowledgment numbers (when the TCP header
    /// is inside the packet), or the time for a UDP packet.
    #[inline(always)]
    pub fn read(pos: &L4Pos, end: usize) -> Self {
        if pos.proto != agent_common::lb::PROTO_TCP {
            // SAFETY: a helper without arguments.
            let now = ct_now(unsafe { bpf_ktime_get_ns() });
            return Self {
                flags: 0,
                seq: 0,
                ack: 0,
                udp_now: Some(now),
            };
        }
        if pos.l4 + TCP_LEN > end {
            return Self {
                flags: 0,
                seq: 0,
                ack: 0,
                udp_now: None,
            };
        }
        // SAFETY: the TCP header is inside the packet (checked above).
        unsafe {
            Self {
                flags: load(pos.l4 + 13),
                seq: load(pos.l4 + 4),
                ack: load(pos.l4 + 8),
                udp_now: None,
            }
        }
    }

    /// A client's SYN (without ACK): the start of a TCP connection.
    #[inline(always)]
    fn opens(&self) -> bool {
        self.flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }

    /// The `CtValue::syn_ack` a SYN-ACK answering this SYN carries.
    #[inline(always)]
    fn expected_syn_ack(&self) -> u32 {
        u32::from_be(self.seq).wrapping_add(1).to_be()
    }
}

/// The backend conntrack gives a packet to a frontend (id `service_id`) whose key is
/// `key`: the entry's, while it describes this packet's flow and its backend exists;
/// for a new flow on the entry's tuple (a TCP SYN with another sequence number, an
/// expired UDP flow) the entry's backend again if it still takes new flows, the
/// entry re-initialised. Returns the id, the backend and whether the flow is new;
/// `None`: the caller picks a backend and stores it with [`insert`].
#[inline(always)]
pub fn lookup<K>(
    ct: &LruHashMap<K, CtValue>,
    key: &K,
    service_id: u32,
    seg: &Segment,
    family: u8,
) -> Option<(u32, Backend, bool)> {
    let entry = ct.get_ptr_mut(key)?;
    // SAFETY: a pointer from a successful lookup stays valid for this run; another
    // CPU writing the same entry at once can at worst make one field stale.
    let entry = unsafe { &mut *entry };
    let id = entry.backend_id;
    let backend = backend_of(id, family)?;
    let last_seen = seg.udp_now.unwrap_or(0);
    let same_flow = match seg.udp_now {
        Some(now) => ct_udp_live(entry.last_seen, now),
        // Established packets, and a retransmitted SYN.
        None => !seg.opens() || entry.syn_ack == seg.expected_syn_ack(),
    };
    if same_flow {
        if entry.last_seen != last_seen {
            entry.last_seen = last_seen;
        }
        return Some((id, backend, false));
    }
    if backend.state != BACKEND_ACTIVE {
        return None;
    }
    *entry = value(id, service_id, seg);
    Some((id, backend, true))
}

/// Stores a new flow's entry: backend `backend_id` of frontend `service_id`, the
/// SYN-ACK expected or the UDP time from `seg`. A failure (rare: the LRU map evicts)
/// is counted; the flow still goes to its backend, whose Maglev slot is stable.
#[inline(always)]
pub fn insert<K>(
    ct: &LruHashMap<K, CtValue>,
    key: &K,
    backend_id: u32,
    service_id: u32,
    seg: &Segment,
) {
    if ct
        .insert(key, &value(backend_id, service_id, seg), 0)
        .is_err()
    {
        select::count_drop(DropReason::MapFull);
    }
}

/// A fresh entry for the flow `seg` starts.
#[inline(always)]
fn value(backend_id: u32, service_id: u32, seg: &Segment) -> CtValue {
    CtValue {
        backend_id,
        service_id,
        syn_ack: if seg.opens() {
            seg.expected_syn_ack()
        } else {
            0
        },
        last_seen: seg.udp_now.unwrap_or(0),
    }
}

/// Backend `id`, if its slot holds a backend of `family`.
#[inline(always)]
fn backend_of(id: u32, family: u8) -> Option<Backend> {
    let backend = *RUNE_BACKENDS.get(id)?;
    (backend.family == family).then_some(backend)
}

/// Whether the backend's packet `seg` is a reply of the flow `entry` describes. TCP:
/// anything but a SYN is; a SYN-ACK only if it answers the client's SYN through the
/// VIP. UDP: while the entry is younger than the UDP timeout (refreshing it). False
/// means the VIP flow is over: the caller deletes the entry.
#[inline(always)]
pub fn is_reply(entry: *mut CtValue, seg: &Segment) -> bool {
    // SAFETY: as in `lookup`.
    let entry = unsafe { &mut *entry };
    match seg.udp_now {
        Some(now) => {
            if !ct_udp_live(entry.last_seen, now) {
                return false;
            }
            if entry.last_seen != now {
                entry.last_seen = now;
            }
            true
        }
        None => seg.flags & TCP_SYN == 0 || (seg.flags & TCP_ACK != 0 && seg.ack == entry.syn_ack),
    }
}
