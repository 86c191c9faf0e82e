//! Conntrack, both directions (the rules are on `agent_common::lb::CtValue`).
//!
//! * [`track`] (tc ingress, XDP): the backend and client port a client's packet to
//!   a VIP goes to. The forward entry (keyed as the client sent the packet) says,
//!   while it describes the packet's flow; a new flow gets a backend from the
//!   caller's pick (or its entry's again, while that one takes new flows) and
//!   [`claim`]s the backend-side tuple: the reply entry keyed as the backend's
//!   replies will carry it.
//! * [`reply`] (tc egress): the forward entry a backend's packet is a reply of,
//!   found through the reply entry keyed by the packet's own tuple (one lookup,
//!   however many frontends lead to the backend), and whether the packet still
//!   belongs to that flow ([`is_reply`]).
//!
//! Writes are kept off the established path: a TCP entry is written when a SYN
//! (re)starts a flow on its tuple, a UDP entry at most once per `ct_now` unit.

use agent_common::lb::{
    Addr, BACKEND_ACTIVE, Backend, CtKeyV4, CtKeyV6, CtReplyV4, CtReplyV6, CtValue, DropReason,
    FAMILY_V4, FAMILY_V6, NAT_PORT_TRIES, ct_now, ct_udp_live, nat_port_class,
};
use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    maps::LruHashMap,
};

use super::parse::{L4Pos, TCP_LEN, load};
use crate::{
    maps::{RUNE_BACKENDS, RUNE_CT_REPLY_V4, RUNE_CT_REPLY_V6, RUNE_CT_V4, RUNE_CT_V6},
    select,
};

/// TCP flag SYN.
const TCP_SYN: u8 = 0x02;
/// TCP flag ACK.
const TCP_ACK: u8 = 0x10;

/// One address family's conntrack maps and the shapes of their keys and values.
pub trait Family {
    /// An address as the packet carries it.
    type Addr: Copy + PartialEq;
    /// The key of both maps.
    type Key: 'static;
    /// The reply entries' value.
    type Reply: Copy + 'static;
    /// `Backend::family` of this family.
    const FAMILY: u8;
    /// The forward entries.
    fn forward() -> &'static LruHashMap<Self::Key, CtValue>;
    /// The reply entries.
    fn replies() -> &'static LruHashMap<Self::Key, Self::Reply>;
    /// A key from a packet's (or a reply's) addresses, ports and protocol.
    fn key(saddr: Self::Addr, daddr: Self::Addr, sport: u16, dport: u16, proto: u8) -> Self::Key;
    /// A reply entry's value.
    fn reply(vip: Self::Addr, vport: u16, cport: u16, backend_id: u32) -> Self::Reply;
    /// A reply entry's VIP, service port, client port and backend id.
    fn parts(reply: &Self::Reply) -> (Self::Addr, u16, u16, u32);
    /// A backend's address in this family's form.
    fn backend_addr(backend: &Backend) -> Self::Addr;
}

/// IPv4: `RUNE_CT_V4` and `RUNE_CT_REPLY_V4`.
pub struct V4;

impl Family for V4 {
    type Addr = u32;
    type Key = CtKeyV4;
    type Reply = CtReplyV4;
    const FAMILY: u8 = FAMILY_V4;

    #[inline(always)]
    fn forward() -> &'static LruHashMap<CtKeyV4, CtValue> {
        &RUNE_CT_V4
    }

    #[inline(always)]
    fn replies() -> &'static LruHashMap<CtKeyV4, CtReplyV4> {
        &RUNE_CT_REPLY_V4
    }

    #[inline(always)]
    fn key(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8) -> CtKeyV4 {
        CtKeyV4 {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            pad: [0; 3],
        }
    }

    #[inline(always)]
    fn reply(vip: u32, vport: u16, cport: u16, backend_id: u32) -> CtReplyV4 {
        CtReplyV4 {
            vip,
            vport,
            cport,
            backend_id,
        }
    }

    #[inline(always)]
    fn parts(reply: &CtReplyV4) -> (u32, u16, u16, u32) {
        (reply.vip, reply.vport, reply.cport, reply.backend_id)
    }

    #[inline(always)]
    fn backend_addr(backend: &Backend) -> u32 {
        backend.addr[0]
    }
}

/// IPv6: `RUNE_CT_V6` and `RUNE_CT_REPLY_V6`.
pub struct V6;

impl Family for V6 {
    type Addr = Addr;
    type Key = CtKeyV6;
    type Reply = CtReplyV6;
    const FAMILY: u8 = FAMILY_V6;

    #[inline(always)]
    fn forward() -> &'static LruHashMap<CtKeyV6, CtValue> {
        &RUNE_CT_V6
    }

    #[inline(always)]
    fn replies() -> &'static LruHashMap<CtKeyV6, CtReplyV6> {
        &RUNE_CT_REPLY_V6
    }

    #[inline(always)]
    fn key(saddr: Addr, daddr: Addr, sport: u16, dport: u16, proto: u8) -> CtKeyV6 {
        CtKeyV6 {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            pad: [0; 3],
        }
    }

    #[inline(always)]
    fn reply(vip: Addr, vport: u16, cport: u16, backend_id: u32) -> CtReplyV6 {
        CtReplyV6 {
            vip,
            vport,
            cport,
            backend_id,
        }
    }

    #[inline(always)]
    fn parts(reply: &CtReplyV6) -> (Addr, u16, u16, u32) {
        (reply.vip, reply.vport, reply.cport, reply.backend_id)
    }

    #[inline(always)]
    fn backend_addr(backend: &Backend) -> Addr {
        backend.addr
    }
}

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

/// A client's packet to a frontend: its addresses, ports (network order) and
/// protocol as it reached the hook.
pub struct Tuple<A> {
    /// The client's address.
    pub client: A,
    /// The VIP.
    pub vip: A,
    /// The client's port.
    pub cport: u16,
    /// The service port.
    pub vport: u16,
    /// `PROTO_TCP` or `PROTO_UDP`.
    pub proto: u8,
}

/// Where [`track`] sends a packet.
pub struct Route {
    /// The backend's id.
    pub id: u32,
    /// The backend.
    pub backend: Backend,
    /// The client's port as the backend is to see it (network order).
    pub nat_port: u16,
    /// Whether the packet starts a flow (counted as one).
    pub new_flow: bool,
}

/// The route of the client's packet `t` to the frontend `service_id`: its forward
/// entry's while the entry describes this packet's flow and its backend exists.
/// For a new flow on the entry's tuple (a TCP SYN with another sequence number, an
/// expired UDP flow) the entry's backend and client port again if the backend
/// still takes new flows, else (and without an entry) the backend `pick` returns
/// and the client's own port; either way the backend-side tuple is [`claim`]ed
/// first and the entry (re)written. Errors: `pick`'s (the caller refuses the flow),
/// or [`DropReason::NoNatPort`].
#[inline(always)]
pub fn track<F: Family>(
    t: &Tuple<F::Addr>,
    service_id: u32,
    seg: &Segment,
    pick: impl FnOnce() -> Result<(u32, Backend), DropReason>,
) -> Result<Route, DropReason> {
    let key = F::key(t.client, t.vip, t.cport, t.vport, t.proto);
    let mut kept: Option<(*mut CtValue, u32, Backend, u16)> = None;
    if let Some(entry) = F::forward().get_ptr_mut(&key) {
        // SAFETY: a pointer from a successful lookup stays valid for this run;
        // another CPU writing the same entry at once can at worst make one field
        // stale.
        let value = unsafe { &mut *entry };
        if let Some(backend) = backend_of(value.backend_id, F::FAMILY) {
            let same_flow = match seg.udp_now {
                Some(now) => ct_udp_live(value.last_seen, now),
                // Established packets, and a retransmitted SYN.
                None => !seg.opens() || value.syn_ack == seg.expected_syn_ack(),
            };
            if same_flow {
                let last_seen = seg.udp_now.unwrap_or(0);
                if value.last_seen != last_seen {
                    value.last_seen = last_seen;
                }
                return Ok(Route {
                    id: value.backend_id,
                    backend,
                    nat_port: value.nat_port,
                    new_flow: false,
                });
            }
            if backend.state == BACKEND_ACTIVE {
                kept = Some((entry, value.backend_id, backend, value.nat_port));
            }
        }
    }
    let (entry, id, backend, port) = match kept {
        Some((entry, id, backend, port)) => (Some(entry), id, backend, port),
        None => {
            let (id, backend) = pick()?;
            (None, id, backend, t.cport)
        }
    };
    let nat_port = claim::<F>(t, id, &backend, port)?;
    let value = value(id, service_id, seg, nat_port);
    match entry {
        // SAFETY: as above.
        Some(entry) => unsafe { *entry = value },
        None => {
            // A failure (rare: the LRU map evicts) is counted; the flow still goes
            // to its backend, whose Maglev slot is stable.
            if F::forward().insert(&key, &value, 0).is_err() {
                select::count_drop(DropReason::MapFull);
            }
        }
    }
    Ok(Route {
        id,
        backend,
        nat_port,
        new_flow: true,
    })
}

/// Reserves the backend-side tuple of the flow `t` to backend `id`: the reply entry
/// keyed (backend, client, backend port, port) for the first port no other flow
/// holds, trying `prefer` and then random ports of its class. An entry of this
/// same flow (same VIP, service port and client port) is taken over. Returns the
/// port.
#[inline(always)]
fn claim<F: Family>(
    t: &Tuple<F::Addr>,
    id: u32,
    backend: &Backend,
    prefer: u16,
) -> Result<u16, DropReason> {
    let baddr = F::backend_addr(backend);
    let mine = F::reply(t.vip, t.vport, t.cport, id);
    let (first, count) = nat_port_class(u16::from_be(t.cport));
    let mut port = prefer;
    for _ in 0..NAT_PORT_TRIES {
        let rkey = F::key(baddr, t.client, backend.port, port, t.proto);
        // Insert first: a new flow's tuple is nearly always free.
        if F::replies()
            .insert(&rkey, &mine, u64::from(BPF_NOEXIST))
            .is_ok()
        {
            return Ok(port);
        }
        // SAFETY: the value is copied out at once.
        if let Some(held) = unsafe { F::replies().get(&rkey) }.copied() {
            let (vip, vport, cport, held_id) = F::parts(&held);
            if vip == t.vip && vport == t.vport && cport == t.cport {
                if held_id != id && F::replies().insert(&rkey, &mine, 0).is_err() {
                    select::count_drop(DropReason::MapFull);
                }
                return Ok(port);
            }
        }
        // SAFETY: a helper without arguments.
        let random = unsafe { bpf_get_prandom_u32() };
        port = (first + (random % u32::from(count)) as u16).to_be();
    }
    Err(DropReason::NoNatPort)
}

/// A fresh forward entry for the flow `seg` starts, to backend `backend_id` of
/// frontend `service_id` with the client port `nat_port`.
#[inline(always)]
fn value(backend_id: u32, service_id: u32, seg: &Segment, nat_port: u16) -> CtValue {
    CtValue {
        backend_id,
        service_id,
        syn_ack: if seg.opens() {
            seg.expected_syn_ack()
        } else {
            0
        },
        last_seen: seg.udp_now.unwrap_or(0),
        nat_port,
        pad: 0,
    }
}

/// Backend `id`, if its slot holds a backend of `family`.
#[inline(always)]
fn backend_of(id: u32, family: u8) -> Option<Backend> {
    let backend = *RUNE_BACKENDS.get(id)?;
    (backend.family == family).then_some(backend)
}

/// What a backend's packet is a reply of: the VIP, the service port, the client's
/// own port and the flow's forward entry.
pub struct Reply<A> {
    /// The VIP the client addressed.
    pub vip: A,
    /// The service port.
    pub vport: u16,
    /// The client's own port.
    pub cport: u16,
    /// The flow's forward entry.
    pub entry: CtValue,
}

/// The flow the backend's packet (`saddr`:`sport` → `daddr`:`dport`, `proto`) is a
/// reply of: its reply entry's forward entry, when that still names the backend
/// and client port the reply entry was made for and takes `seg` as a reply
/// ([`is_reply`]). A reply entry whose forward entry moved on (another backend or
/// port, or gone) is deleted on the way; so are both entries of a flow that is over.
#[inline(always)]
pub fn reply<F: Family>(
    saddr: F::Addr,
    daddr: F::Addr,
    sport: u16,
    dport: u16,
    proto: u8,
    seg: &Segment,
) -> Option<Reply<F::Addr>> {
    let rkey = F::key(saddr, daddr, sport, dport, proto);
    // SAFETY: the value is copied out at once.
    let held = unsafe { F::replies().get(&rkey) }.copied()?;
    let (vip, vport, cport, backend_id) = F::parts(&held);
    let key = F::key(daddr, vip, cport, vport, proto);
    let Some(entry) = F::forward().get_ptr_mut(&key) else {
        // Deleting a missing entry (another CPU was first) is fine.
        let _ = F::replies().remove(&rkey);
        return None;
    };
    // SAFETY: a pointer from a successful lookup stays valid for this run.
    let value = unsafe { *entry };
    if value.backend_id != backend_id || value.nat_port != dport {
        let _ = F::replies().remove(&rkey);
        return None;
    }
    if !is_reply(entry, seg) {
        let _ = F::forward().remove(&key);
        let _ = F::replies().remove(&rkey);
        return None;
    }
    Some(Reply {
        vip,
        vport,
        cport,
        entry: value,
    })
}

/// Whether the backend's packet `seg` is a reply of the flow `entry` describes. TCP:
/// anything but a SYN is; a SYN-ACK only if it answers the client's SYN through the
/// VIP. UDP: while the entry is younger than the UDP timeout (refreshing it). False
/// means the VIP flow is over.
#[inline(always)]
fn is_reply(entry: *mut CtValue, seg: &Segment) -> bool {
    // SAFETY: as in `track`.
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
