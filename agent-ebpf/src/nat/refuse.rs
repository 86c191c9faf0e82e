//! Refusals: a UDP datagram to a frontend without backends is answered with an
//! ICMP / ICMPv6 port unreachable quoting its IP header and first 8 bytes (built in
//! room the hook makes in front of it, see [`IcmpPlan`]); a TCP packet with a TCP RST
//! built in place of the packet (addresses, ports and MACs swapped, sequence
//! numbers as RFC 9293 §3.10.7.1 asks of a closed port, the way Linux's
//! `tcp_v4_send_reset` does it), so the client's connect fails at once with
//! ECONNREFUSED instead of timing out. The hook trims the frame to the returned
//! length and sends it back out of the interface it came in on.
//!
//! Every header is rewritten whole and both checksums are computed from scratch
//! (the reply has no IP options and no TCP options or payload).

use super::parse::{ETH_LEN, IPV4_LEN, IPV6_LEN, L4Pos, TCP_LEN, load, store};

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// Length of an IPv4 RST frame (Ethernet + IPv4 + TCP, no options).
pub const RST_V4_LEN: usize = ETH_LEN + IPV4_LEN + TCP_LEN;
/// Length of an IPv6 RST frame.
pub const RST_V6_LEN: usize = ETH_LEN + IPV6_LEN + TCP_LEN;

/// Sums `N` 16-bit words at `addr` (ones'-complement, not folded).
///
/// # Safety
///
/// `addr..addr + 2 * N` must be inside the packet.
#[inline(always)]
unsafe fn sum_words<const N: usize>(addr: usize) -> u32 {
    let mut sum = 0u32;
    let mut i = 0;
    while i < N {
        // SAFETY: the caller guarantees the words are inside the packet.
        sum = super::csum::add(sum, u32::from(unsafe { load::<u16>(addr + 2 * i) }));
        i += 1;
    }
    sum
}

/// What the reply's TCP header says, from the refused segment.
struct RstFields {
    sport: u16,
    dport: u16,
    /// Network order.
    seq: u32,
    /// Network order.
    ack: u32,
    flags: u8,
}

/// Reads the refused segment and decides the reply: `None` for a RST (never
/// answered). `payload` is the segment's data length.
///
/// # Safety
///
/// The TCP fixed header at `l4` must be inside the packet.
#[inline(always)]
unsafe fn rst_fields(l4: usize, payload: usize) -> Option<RstFields> {
    // SAFETY: the caller guarantees the TCP fixed header is inside the packet.
    let (sport, dport, seq, ack, flags) = unsafe {
        (
            load::<u16>(l4),
            load::<u16>(l4 + 2),
            load::<u32>(l4 + 4),
            load::<u32>(l4 + 8),
            load::<u8>(l4 + 13),
        )
    };
    if flags & TCP_RST != 0 {
        return None;
    }
    Some(if flags & TCP_ACK != 0 {
        // <SEQ=SEG.ACK><CTL=RST>
        RstFields {
            sport: dport,
            dport: sport,
            seq: ack,
            ack: 0,
            flags: TCP_RST,
        }
    } else {
        // <SEQ=0><ACK=SEG.SEQ+SEG.LEN><CTL=RST,ACK>, SYN and FIN counting one each.
        let len =
            payload as u32 + u32::from(flags & TCP_SYN != 0) + u32::from(flags & TCP_FIN != 0);
        RstFields {
            sport: dport,
            dport: sport,
            seq: 0,
            ack: u32::from_be(seq).wrapping_add(len).to_be(),
            flags: TCP_RST | TCP_ACK,
        }
    })
}

/// Swaps the Ethernet addresses of the frame at `data`.
///
/// # Safety
///
/// The Ethernet header must be inside the packet.
#[inline(always)]
unsafe fn swap_macs(data: usize) {
    // SAFETY: the caller guarantees the Ethernet header is inside the packet.
    unsafe {
        let dst: [u8; 6] = load(data);
        let src: [u8; 6] = load(data + 6);
        store(data, src);
        store(data + 6, dst);
    }
}

/// Writes the reply's TCP header at `tcp` (checksum from `pseudo`, the pseudo
/// header's sum).
///
/// # Safety
///
/// `tcp..tcp + TCP_LEN` must be inside the packet.
#[inline(always)]
unsafe fn write_tcp(tcp: usize, f: &RstFields, pseudo: u32) {
    // SAFETY: the caller guarantees the header is inside the packet.
    unsafe {
        store(tcp, f.sport);
        store(tcp + 2, f.dport);
        store(tcp + 4, f.seq);
        store(tcp + 8, f.ack);
        store::<u8>(tcp + 12, 5 << 4);
        store::<u8>(tcp + 13, f.flags);
        store::<u16>(tcp + 14, 0); // window
        store::<u16>(tcp + 16, 0); // checksum
        store::<u16>(tcp + 18, 0); // urgent pointer
        let sum = super::csum::add(pseudo, sum_words::<{ TCP_LEN / 2 }>(tcp));
        store(tcp + 16, !super::csum::fold(sum));
    }
}

/// Turns the IPv4 TCP segment at `pos` (IP total length `tot_len`) into the RST
/// that refuses it, in place. Returns the reply's frame length ([`RST_V4_LEN`]), or
/// `None` when no reply is due (a RST) or the packet is too short.
#[inline(always)]
pub fn tcp_rst_v4(data: usize, end: usize, pos: &L4Pos, tot_len: usize) -> Option<usize> {
    if pos.l4 + TCP_LEN > end || data + RST_V4_LEN > end {
        return None;
    }
    let ip = data + ETH_LEN;
    let tcp = ip + IPV4_LEN;
    // SAFETY (all blocks): the TCP header at `pos.l4` and the reply's headers up to
    // `data + RST_V4_LEN` are inside the packet (checked above). Everything is read
    // before anything is written: with IP options the old TCP header overlaps the
    // new one.
    let doff = (unsafe { load::<u8>(pos.l4 + 12) } >> 4) as usize * 4;
    let payload = tot_len.saturating_sub(pos.l4_off - ETH_LEN + doff);
    let f = unsafe { rst_fields(pos.l4, payload) }?;
    let (saddr, daddr) = unsafe { (load::<u32>(ip + 12), load::<u32>(ip + 16)) };
    unsafe {
        swap_macs(data);
        // Version 4, IHL 5, TOS 0 | total length | id 0, DF | TTL 64, TCP, checksum 0.
        store::<u16>(ip, u16::from_ne_bytes([0x45, 0]));
        store::<u16>(ip + 2, ((IPV4_LEN + TCP_LEN) as u16).to_be());
        store::<u32>(ip + 4, u32::from_ne_bytes([0, 0, 0x40, 0]));
        store::<u32>(ip + 8, u32::from_ne_bytes([64, 6, 0, 0]));
        store(ip + 12, daddr);
        store(ip + 16, saddr);
        store(
            ip + 10,
            !super::csum::fold(sum_words::<{ IPV4_LEN / 2 }>(ip)),
        );
        let pseudo = super::csum::add(
            sum_words::<4>(ip + 12),
            u32::from(u16::from_ne_bytes([0, 6])) + u32::from((TCP_LEN as u16).to_be()),
        );
        write_tcp(tcp, &f, pseudo);
    }
    Some(RST_V4_LEN)
}

/// As [`tcp_rst_v4`] for IPv6 (`payload_len` from the IPv6 header); returns
/// [`RST_V6_LEN`].
#[inline(always)]
pub fn tcp_rst_v6(data: usize, end: usize, pos: &L4Pos, payload_len: usize) -> Option<usize> {
    if pos.l4 + TCP_LEN > end || data + RST_V6_LEN > end {
        return None;
    }
    let ip = data + ETH_LEN;
    let tcp = ip + IPV6_LEN;
    // SAFETY (all blocks): as in `tcp_rst_v4`; without extension headers the TCP
    // header stays where it was.
    let doff = (unsafe { load::<u8>(pos.l4 + 12) } >> 4) as usize * 4;
    let payload = payload_len.saturating_sub(doff);
    let f = unsafe { rst_fields(pos.l4, payload) }?;
    let (saddr, daddr) = unsafe { (load::<[u32; 4]>(ip + 8), load::<[u32; 4]>(ip + 24)) };
    unsafe {
        swap_macs(data);
        // Version 6, no traffic class or flow label | payload length | TCP, hop limit 64.
        store::<u32>(ip, u32::from_ne_bytes([0x60, 0, 0, 0]));
        store::<u16>(ip + 4, (TCP_LEN as u16).to_be());
        store::<u16>(ip + 6, u16::from_ne_bytes([6, 64]));
        store(ip + 8, daddr);
        store(ip + 24, saddr);
        let pseudo = super::csum::add(
            sum_words::<16>(ip + 8),
            u32::from(u16::from_ne_bytes([0, 6])) + u32::from((TCP_LEN as u16).to_be()),
        );
        write_tcp(tcp, &f, pseudo);
    }
    Some(RST_V6_LEN)
}

/// Bytes an ICMP port unreachable adds in front of the refused IPv4 packet (outer
/// IPv4 header + ICMP header).
pub const ICMP_V4_ROOM: usize = IPV4_LEN + 8;
/// Bytes an ICMPv6 port unreachable adds in front of the refused IPv6 packet.
pub const ICMP_V6_ROOM: usize = IPV6_LEN + 8;
/// Bytes of the refused datagram the error quotes after its IP header (RFC 792:
/// "the first 64 bits of the original datagram's data").
const QUOTED_L4: usize = 8;
/// Largest quote: an IPv4 header with all options, or the IPv6 header, plus 8.
const MAX_QUOTE: usize = 60 + QUOTED_L4;

/// What the ICMP error for a refused UDP datagram needs, read before the hook
/// makes room in front of it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IcmpPlan {
    /// IPv6 (ICMPv6) rather than IPv4.
    pub v6: bool,
    /// The datagram's Ethernet destination and source.
    macs: [u8; 12],
    /// The datagram's source (the client, network order; IPv4 in word 0).
    client: [u32; 4],
    /// The datagram's destination (the VIP).
    vip: [u32; 4],
    /// Bytes quoted: the datagram's IP header and the first 8 bytes after it.
    pub quote: usize,
}

impl IcmpPlan {
    /// Bytes to insert between the Ethernet header and the datagram.
    #[inline(always)]
    pub fn room(&self) -> usize {
        if self.v6 { ICMP_V6_ROOM } else { ICMP_V4_ROOM }
    }

    /// The error's frame length.
    #[inline(always)]
    pub fn frame_len(&self) -> usize {
        ETH_LEN + self.room() + self.quote
    }
}

/// Plans the port unreachable for the UDP datagram at `pos`; `None` when its
/// headers are not all inside the packet.
#[inline(always)]
pub fn plan_icmp(data: usize, end: usize, pos: &L4Pos, v6: bool) -> Option<IcmpPlan> {
    if pos.l4 + QUOTED_L4 > end || data + ETH_LEN + IPV4_LEN > end {
        return None;
    }
    let ip = data + ETH_LEN;
    // SAFETY: the Ethernet header, the IP header up to `pos.l4` and 8 bytes after it
    // are inside the packet (checked above and by the parser).
    unsafe {
        let macs: [u8; 12] = load(data);
        let (client, vip) = if v6 {
            if ip + IPV6_LEN > end {
                return None;
            }
            (load::<[u32; 4]>(ip + 8), load::<[u32; 4]>(ip + 24))
        } else {
            (
                [load::<u32>(ip + 12), 0, 0, 0],
                [load::<u32>(ip + 16), 0, 0, 0],
            )
        };
        Some(IcmpPlan {
            v6,
            macs,
            client,
            vip,
            quote: pos.l4_off - ETH_LEN + QUOTED_L4,
        })
    }
}

/// Writes the port unreachable of `plan` into a frame whose datagram now starts at
/// `ETH_LEN + plan.room()` (the hook made the room and trimmed the frame to
/// `plan.frame_len()`): Ethernet addresses swapped, outer IP header from the VIP to
/// the client, ICMP header, checksums. `false` when the frame is not that long.
#[inline(always)]
pub fn write_icmp(data: usize, end: usize, plan: &IcmpPlan) -> bool {
    let quote = plan.quote;
    let icmp_len = 8 + quote;
    if quote > MAX_QUOTE || data + plan.frame_len() > end {
        return false;
    }
    let ip = data + ETH_LEN;
    // Constant bounds for the verifier (it cannot follow `frame_len`): the headers
    // and the shortest quote of each family.
    // SAFETY (all blocks): the headers are inside the packet (checked by each
    // branch); the checksum loop checks each word again.
    let icmp = if plan.v6 {
        if data + ETH_LEN + ICMP_V6_ROOM + IPV6_LEN + QUOTED_L4 > end {
            return false;
        }
        let icmp = ip + IPV6_LEN;
        unsafe {
            let mut macs = plan.macs;
            macs.rotate_left(6);
            store(data, macs);
            store::<u16>(data + 12, 0x86ddu16.to_be());
            store::<u32>(ip, u32::from_ne_bytes([0x60, 0, 0, 0]));
            store::<u16>(ip + 4, (icmp_len as u16).to_be());
            store::<u16>(ip + 6, u16::from_ne_bytes([58, 64]));
            store(ip + 8, plan.vip);
            store(ip + 24, plan.client);
            // ICMPv6 destination unreachable, code 4: port unreachable.
            store::<u32>(icmp, u32::from_ne_bytes([1, 4, 0, 0]));
            store::<u32>(icmp + 4, 0);
        }
        icmp
    } else {
        if data + ETH_LEN + ICMP_V4_ROOM + IPV4_LEN + QUOTED_L4 > end {
            return false;
        }
        let icmp = ip + IPV4_LEN;
        unsafe {
            let mut macs = plan.macs;
            macs.rotate_left(6);
            store(data, macs);
            store::<u16>(data + 12, 0x0800u16.to_be());
            store::<u16>(ip, u16::from_ne_bytes([0x45, 0xc0]));
            store::<u16>(ip + 2, ((IPV4_LEN + icmp_len) as u16).to_be());
            store::<u32>(ip + 4, 0);
            store::<u32>(ip + 8, u32::from_ne_bytes([64, 1, 0, 0]));
            store(ip + 12, plan.vip[0]);
            store(ip + 16, plan.client[0]);
            store(
                ip + 10,
                !super::csum::fold(sum_words::<{ IPV4_LEN / 2 }>(ip)),
            );
            // ICMP destination unreachable, code 3: port unreachable.
            store::<u32>(icmp, u32::from_ne_bytes([3, 3, 0, 0]));
            store::<u32>(icmp + 4, 0);
        }
        icmp
    };
    let mut sum = if plan.v6 {
        // SAFETY: the IPv6 header is inside the packet (checked above).
        super::csum::add(
            unsafe { sum_words::<16>(ip + 8) },
            u32::from((icmp_len as u16).to_be()) + u32::from(u16::from_ne_bytes([0, 58])),
        )
    } else {
        0
    };
    let mut i = 0;
    while i < (8 + MAX_QUOTE) / 2 {
        let at = icmp + 2 * i;
        if 2 * i >= icmp_len || at + 2 > end {
            break;
        }
        // SAFETY: checked just above.
        sum = super::csum::add(sum, u32::from(unsafe { load::<u16>(at) }));
        i += 1;
    }
    // SAFETY: the ICMP header is inside the packet (checked above).
    unsafe { store(icmp + 2, !super::csum::fold(sum)) };
    true
}
