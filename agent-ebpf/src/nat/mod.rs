//! North-south VIP load balancing, shared by `rune_tc_ingress`, `rune_xdp_lb` and
//! `rune_tc_egress`: one parsing and rewrite core over the packet's raw pointers.
//!
//! * [`dnat`] (tc ingress, XDP): a TCP/UDP packet whose (daddr, dport, proto) is a
//!   frontend goes to the backend its conntrack entry names, else to a new one from
//!   `select::pick_backend` ([`ct::track`] decides, and keeps both directions'
//!   entries); its daddr/dport are rewritten to the backend's, its sport to the
//!   client port the backend is to see (the client's own unless another flow holds
//!   it towards that backend), and the checksums updated.
//! * [`snat`] (tc egress): a packet from a backend whose own tuple keys a reply
//!   entry, and whose flow takes it as a reply ([`ct::reply`]: not a SYN-ACK of
//!   another connection, not an expired UDP flow), gets the VIP and service port
//!   back as its source and the client's own port as its destination.
//! * A new flow to a frontend without backends is refused ([`refuse`]): TCP with a
//!   RST, UDP with an ICMP/ICMPv6 port unreachable, sent back by the hook.
//!
//! Before the frontend lookup, the VIP prefilter (`RUNE_VIP_FILTER`,
//! `agent_common::filter`) passes most packets to no VIP after one array read.
//!
//! Which packets are "for a VIP": those whose frontend key can be read, i.e. the
//! Ethernet, IP (IPv4 with any IHL ≥ 5, not a non-first fragment; IPv6 with TCP/UDP
//! as next header) and the transport ports are inside the packet. Anything else
//! passes untouched, for the stack to handle or drop. A packet matching a frontend
//! that cannot be translated (transport header cut short, TCP data offset < 5, IP
//! length shorter than the headers or longer than the packet) is dropped and counted
//! as `DropReason::Malformed`.
//!
//! Checksums: the core writes the new address and port through the packet pointers,
//! then hands a [`CsumFix`] to the hook ([`NatCtx::fix_csums`]). XDP applies it with
//! [`fix_csums_in_place`] (RFC 1624 on the full checksums XDP sees); tc uses the
//! kernel's `bpf_l{3,4}_csum_replace`, which also handle `CHECKSUM_PARTIAL` and
//! `CHECKSUM_COMPLETE` skbs.

pub mod csum;
pub mod ct;
pub mod parse;
pub mod refuse;

use agent_common::{
    filter::{vip_filter_bit_v4, vip_filter_bit_v6},
    hash::{FLOW_HASH_SEED, flow_hash_v4, flow_hash_v6},
    lb::{
        Backend, DropReason, FAMILY_V4, FAMILY_V6, PROTO_TCP, ServiceKeyV4, ServiceKeyV6,
        ServiceValue,
    },
};

use crate::{
    maps::{RUNE_SVC_V4, RUNE_SVC_V6, RUNE_VIP_FILTER},
    select,
};
use parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6, L4Pos, TCP_LEN, UDP_LEN, load, store};

/// What the core did with a packet that goes on (both become `XDP_PASS` /
/// `TC_ACT_OK`); a packet to drop is an `Err(DropReason)`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not for us: the packet is untouched.
    Untouched,
    /// Addresses and ports rewritten, checksums updated.
    Translated,
    /// A packet to a frontend without backends, rewritten in place into the reply
    /// that refuses it (counted as `DropReason::NoBackend`): for TCP the RST, for
    /// UDP the ICMP port unreachable ([`NatCtx::write_unreachable`]). The hook trims
    /// the frame to this length and sends it back where it came from.
    Refused(usize),
}

/// The verdict on a refused packet: its reply when one is due, else a drop.
#[inline(always)]
fn refused(reply: Option<Verdict>) -> Result<Verdict, DropReason> {
    match reply {
        Some(verdict) => {
            select::count_drop(DropReason::NoBackend);
            Ok(verdict)
        }
        None => Err(DropReason::NoBackend),
    }
}

/// The hook the core runs in: packet bounds and how checksums are fixed.
pub trait NatCtx {
    /// Start of the packet (the Ethernet header).
    fn data(&self) -> usize;
    /// End of the directly accessible part of the packet.
    fn data_end(&self) -> usize;
    /// Length of the whole packet from the Ethernet header (tc: also the part not
    /// directly accessible).
    fn len(&self) -> usize;
    /// Updates the checksums after the core rewrote one address and the ports in
    /// place. Packet pointers may be invalid afterwards (tc helpers).
    fn fix_csums(&self, fix: &CsumFix) -> Result<(), DropReason>;
    /// Turns the refused UDP datagram `plan` describes into its ICMP port
    /// unreachable: makes `plan.room()` bytes after the Ethernet header, sizes the
    /// frame to `plan.frame_len()` and writes it with [`refuse::write_icmp`].
    /// Returns the frame's length. (Done here, where the plan is made, rather than
    /// by the hook from a verdict: a plan carried out of the core in registers was
    /// merged with the other verdicts' undefined bytes, which the verifier refused.)
    fn write_unreachable(&self, plan: &refuse::IcmpPlan) -> Result<usize, DropReason>;
}

/// The checksum update after one address and the ports were rewritten.
pub struct CsumFix {
    /// Address of the IPv4 header checksum; 0 for IPv6 (no IP checksum).
    pub ip_check: usize,
    /// Address of the TCP/UDP checksum.
    pub l4_check: usize,
    /// Offset of the TCP/UDP checksum from the start of the packet.
    pub l4_check_off: usize,
    /// Ones'-complement diff of the address change ([`csum::diff32`]/[`csum::diff128`]).
    pub addr_diff: u32,
    /// Both ports before, as one word loaded from the packet (source port first).
    pub old_ports: u32,
    /// Both ports after.
    pub new_ports: u32,
    /// UDP: a zero checksum means "none" and stays zero; a result of zero is sent
    /// as 0xffff.
    pub udp: bool,
    /// IPv6 packet.
    pub v6: bool,
}

/// Offset of the IPv4 header checksum from the start of the packet.
pub const IPV4_CHECK_OFF: usize = ETH_LEN + 10;

/// Applies `fix` by hand, RFC 1624 (XDP: checksums are complete, never partial).
///
/// # Safety
///
/// The addresses in `fix` must be inside the packet, as the core checked them.
#[inline(always)]
pub unsafe fn fix_csums_in_place(fix: &CsumFix) {
    // SAFETY (both blocks): the core checked these fields are inside the packet.
    if fix.ip_check != 0 {
        unsafe {
            let check: u16 = load(fix.ip_check);
            store(fix.ip_check, csum::update(check, fix.addr_diff));
        }
    }
    unsafe {
        let check: u16 = load(fix.l4_check);
        if fix.udp && check == 0 {
            return;
        }
        let diff = csum::add(fix.addr_diff, csum::diff32(fix.old_ports, fix.new_ports));
        let mut new = csum::update(check, diff);
        if fix.udp && new == 0 {
            new = 0xffff;
        }
        store(fix.l4_check, new);
    }
}

/// Whether the VIP prefilter lets a packet whose frontend key hashes to `bit` on to
/// the frontend lookup: false only when the bit is set (no frontend hashes there).
#[inline(always)]
fn maybe_frontend(bit: u32) -> bool {
    match RUNE_VIP_FILTER.get(bit / 64) {
        Some(word) => *word & (1u64 << (bit % 64)) == 0,
        None => true,
    }
}

/// DNAT of a packet to a VIP (tc ingress and XDP).
#[inline(always)]
pub fn dnat<C: NatCtx>(ctx: &C) -> Result<Verdict, DropReason> {
    let (data, end) = (ctx.data(), ctx.data_end());
    match parse::ethertype(data, end) {
        Some(ETH_P_IP) => dnat_v4(ctx, data, end),
        Some(ETH_P_IPV6) => dnat_v6(ctx, data, end),
        _ => Ok(Verdict::Untouched),
    }
}

/// Reverse NAT of a backend's reply (tc egress).
#[inline(always)]
pub fn snat<C: NatCtx>(ctx: &C) -> Result<Verdict, DropReason> {
    let (data, end) = (ctx.data(), ctx.data_end());
    match parse::ethertype(data, end) {
        Some(ETH_P_IP) => snat_v4(ctx, data, end),
        Some(ETH_P_IPV6) => snat_v6(ctx, data, end),
        _ => Ok(Verdict::Untouched),
    }
}

/// Checks the transport header is complete and consistent with the IP length
/// (`l4_len`: transport header + payload per the IP header; `None` when the IP
/// header's length is already too short). Returns the checksum field's offset.
#[inline(always)]
fn full_l4<C: NatCtx>(
    ctx: &C,
    pos: &L4Pos,
    end: usize,
    l4_len: Option<usize>,
) -> Result<usize, DropReason> {
    let (hdr, check) = if pos.proto == PROTO_TCP {
        if pos.l4 + TCP_LEN > end {
            return Err(DropReason::Malformed);
        }
        // SAFETY: the TCP header is inside the packet (checked above).
        let doff = (unsafe { load::<u8>(pos.l4 + 12) } >> 4) as usize * 4;
        (doff, 16)
    } else {
        if pos.l4 + UDP_LEN > end {
            return Err(DropReason::Malformed);
        }
        (UDP_LEN, 6)
    };
    let min = if pos.proto == PROTO_TCP {
        TCP_LEN
    } else {
        UDP_LEN
    };
    let avail = ctx.len().saturating_sub(pos.l4_off);
    match l4_len {
        Some(len) if hdr >= min && len >= hdr && len <= avail => Ok(check),
        _ => Err(DropReason::Malformed),
    }
}

/// The ports of a TCP/UDP header as one word, as a native load of the header's
/// first four bytes reads them (`src` and `dst` in network order).
#[inline(always)]
fn ports_word(src: u16, dst: u16) -> u32 {
    let (s, d) = (src.to_ne_bytes(), dst.to_ne_bytes());
    u32::from_ne_bytes([s[0], s[1], d[0], d[1]])
}

/// What a refused new flow (no backend) becomes: the TCP RST or the ICMP/ICMPv6
/// port unreachable `tcp_rst` / `v6` ask for, written in place.
#[inline(always)]
fn refuse_flow<C: NatCtx>(
    ctx: &C,
    data: usize,
    end: usize,
    pos: &L4Pos,
    tcp_rst: impl FnOnce() -> Option<usize>,
    v6: bool,
) -> Result<Verdict, DropReason> {
    if pos.proto == PROTO_TCP {
        return refused(tcp_rst().map(Verdict::Refused));
    }
    let Some(plan) = refuse::plan_icmp(data, end, pos, v6) else {
        return Err(DropReason::NoBackend);
    };
    let len = ctx.write_unreachable(&plan)?;
    refused(Some(Verdict::Refused(len)))
}

#[inline(always)]
fn dnat_v4<C: NatCtx>(ctx: &C, data: usize, end: usize) -> Result<Verdict, DropReason> {
    let Some(pos) = parse::ipv4(data, end) else {
        return Ok(Verdict::Untouched);
    };
    // SAFETY: the IPv4 fixed header and the ports are inside the packet.
    let (daddr, dport) = unsafe { (load::<u32>(pos.ip + 16), load::<u16>(pos.l4 + 2)) };
    if !maybe_frontend(vip_filter_bit_v4(daddr, dport, pos.proto)) {
        return Ok(Verdict::Untouched);
    }
    let svc_key = ServiceKeyV4 {
        addr: daddr,
        port: dport,
        proto: pos.proto,
        pad: 0,
    };
    // SAFETY: the value is copied out at once.
    let Some(svc) = (unsafe { RUNE_SVC_V4.get(&svc_key) }).copied() else {
        return Ok(Verdict::Untouched);
    };
    let ihl = pos.l4_off - ETH_LEN;
    // SAFETY: the IPv4 fixed header is inside the packet.
    let tot_len = u16::from_be(unsafe { load::<u16>(pos.ip + 2) }) as usize;
    let check_off = full_l4(ctx, &pos, end, tot_len.checked_sub(ihl))?;
    // SAFETY: as above.
    let (saddr, sport, ports) = unsafe {
        (
            load::<u32>(pos.ip + 12),
            load::<u16>(pos.l4),
            load::<u32>(pos.l4),
        )
    };
    let flow = ct::Tuple {
        client: saddr,
        vip: daddr,
        cport: sport,
        vport: dport,
        proto: pos.proto,
    };
    let seg = ct::Segment::read(&pos, end);
    let pick = || {
        let hash = flow_hash_v4(u32::from_be(saddr), u16::from_be(sport), FLOW_HASH_SEED);
        pick(&svc, &[saddr, 0, 0, 0], hash, FAMILY_V4)
    };
    let route = match ct::track::<ct::V4>(&flow, svc.id, &seg, pick) {
        Ok(route) => route,
        Err(DropReason::NoBackend) => {
            let rst = || refuse::tcp_rst_v4(data, end, &pos, tot_len);
            return refuse_flow(ctx, data, end, &pos, rst, false);
        }
        Err(e) => return Err(e),
    };

    let new_ports = ports_word(route.nat_port, route.backend.port);
    // SAFETY: the fields were bounds-checked above.
    unsafe {
        store(pos.ip + 16, route.backend.addr[0]);
        store(pos.l4, new_ports);
    }
    ctx.fix_csums(&CsumFix {
        ip_check: pos.ip + 10,
        l4_check: pos.l4 + check_off,
        l4_check_off: pos.l4_off + check_off,
        addr_diff: csum::diff32(daddr, route.backend.addr[0]),
        old_ports: ports,
        new_ports,
        udp: pos.proto != PROTO_TCP,
        v6: false,
    })?;
    select::count_packet(
        svc.id,
        route.id,
        (ctx.len() - ETH_LEN) as u64,
        route.new_flow,
    );
    Ok(Verdict::Translated)
}

#[inline(always)]
fn dnat_v6<C: NatCtx>(ctx: &C, data: usize, end: usize) -> Result<Verdict, DropReason> {
    let Some(pos) = parse::ipv6(data, end) else {
        return Ok(Verdict::Untouched);
    };
    // SAFETY: the IPv6 fixed header and the ports are inside the packet.
    let (daddr, dport) = unsafe { (load::<[u32; 4]>(pos.ip + 24), load::<u16>(pos.l4 + 2)) };
    if !maybe_frontend(vip_filter_bit_v6(&daddr, dport, pos.proto)) {
        return Ok(Verdict::Untouched);
    }
    let svc_key = ServiceKeyV6 {
        addr: daddr,
        port: dport,
        proto: pos.proto,
        pad: 0,
    };
    // SAFETY: the value is copied out at once.
    let Some(svc) = (unsafe { RUNE_SVC_V6.get(&svc_key) }).copied() else {
        return Ok(Verdict::Untouched);
    };
    // SAFETY: as above.
    let payload = u16::from_be(unsafe { load::<u16>(pos.ip + 4) }) as usize;
    let check_off = full_l4(ctx, &pos, end, Some(payload))?;
    // SAFETY: as above.
    let (saddr, sport, ports) = unsafe {
        (
            load::<[u32; 4]>(pos.ip + 8),
            load::<u16>(pos.l4),
            load::<u32>(pos.l4),
        )
    };
    let flow = ct::Tuple {
        client: saddr,
        vip: daddr,
        cport: sport,
        vport: dport,
        proto: pos.proto,
    };
    let seg = ct::Segment::read(&pos, end);
    let pick = || {
        let words = [
            u32::from_be(saddr[0]),
            u32::from_be(saddr[1]),
            u32::from_be(saddr[2]),
            u32::from_be(saddr[3]),
        ];
        let hash = flow_hash_v6(words, u16::from_be(sport), FLOW_HASH_SEED);
        pick(&svc, &saddr, hash, FAMILY_V6)
    };
    let route = match ct::track::<ct::V6>(&flow, svc.id, &seg, pick) {
        Ok(route) => route,
        Err(DropReason::NoBackend) => {
            let rst = || refuse::tcp_rst_v6(data, end, &pos, payload);
            return refuse_flow(ctx, data, end, &pos, rst, true);
        }
        Err(e) => return Err(e),
    };

    let new_ports = ports_word(route.nat_port, route.backend.port);
    // SAFETY: the fields were bounds-checked above.
    unsafe {
        store(pos.ip + 24, route.backend.addr);
        store(pos.l4, new_ports);
    }
    ctx.fix_csums(&CsumFix {
        ip_check: 0,
        l4_check: pos.l4 + check_off,
        l4_check_off: pos.l4_off + check_off,
        addr_diff: csum::diff128(&daddr, &route.backend.addr),
        old_ports: ports,
        new_ports,
        udp: pos.proto != PROTO_TCP,
        v6: true,
    })?;
    select::count_packet(
        svc.id,
        route.id,
        (ctx.len() - ETH_LEN) as u64,
        route.new_flow,
    );
    Ok(Verdict::Translated)
}

/// A new flow's backend, which must be of the frontend's family (no NAT46/64).
#[inline(always)]
fn pick(
    svc: &ServiceValue,
    client: &[u32; 4],
    hash: u32,
    family: u8,
) -> Result<(u32, Backend), DropReason> {
    let (id, backend) = select::pick_backend(svc, client, hash)?;
    if backend.family != family {
        return Err(DropReason::BackendMissing);
    }
    Ok((id, backend))
}

#[inline(always)]
fn snat_v4<C: NatCtx>(ctx: &C, data: usize, end: usize) -> Result<Verdict, DropReason> {
    let Some(pos) = parse::ipv4(data, end) else {
        return Ok(Verdict::Untouched);
    };
    // SAFETY: the IPv4 fixed header and the ports are inside the packet.
    let (saddr, daddr, sport, dport, ports) = unsafe {
        (
            load::<u32>(pos.ip + 12),
            load::<u32>(pos.ip + 16),
            load::<u16>(pos.l4),
            load::<u16>(pos.l4 + 2),
            load::<u32>(pos.l4),
        )
    };
    let seg = ct::Segment::read(&pos, end);
    let Some(flow) = ct::reply::<ct::V4>(saddr, daddr, sport, dport, pos.proto, &seg) else {
        return Ok(Verdict::Untouched);
    };
    let ihl = pos.l4_off - ETH_LEN;
    // SAFETY: as above.
    let tot_len = u16::from_be(unsafe { load::<u16>(pos.ip + 2) }) as usize;
    let check_off = full_l4(ctx, &pos, end, tot_len.checked_sub(ihl))?;
    let new_ports = ports_word(flow.vport, flow.cport);
    // SAFETY: the fields were bounds-checked above.
    unsafe {
        store(pos.ip + 12, flow.vip);
        store(pos.l4, new_ports);
    }
    ctx.fix_csums(&CsumFix {
        ip_check: pos.ip + 10,
        l4_check: pos.l4 + check_off,
        l4_check_off: pos.l4_off + check_off,
        addr_diff: csum::diff32(saddr, flow.vip),
        old_ports: ports,
        new_ports,
        udp: pos.proto != PROTO_TCP,
        v6: false,
    })?;
    select::count_packet(
        flow.entry.service_id,
        flow.entry.backend_id,
        (ctx.len() - ETH_LEN) as u64,
        false,
    );
    Ok(Verdict::Translated)
}

#[inline(always)]
fn snat_v6<C: NatCtx>(ctx: &C, data: usize, end: usize) -> Result<Verdict, DropReason> {
    let Some(pos) = parse::ipv6(data, end) else {
        return Ok(Verdict::Untouched);
    };
    // SAFETY: the IPv6 fixed header and the ports are inside the packet.
    let (saddr, daddr, sport, dport, ports) = unsafe {
        (
            load::<[u32; 4]>(pos.ip + 8),
            load::<[u32; 4]>(pos.ip + 24),
            load::<u16>(pos.l4),
            load::<u16>(pos.l4 + 2),
            load::<u32>(pos.l4),
        )
    };
    let seg = ct::Segment::read(&pos, end);
    let Some(flow) = ct::reply::<ct::V6>(saddr, daddr, sport, dport, pos.proto, &seg) else {
        return Ok(Verdict::Untouched);
    };
    // SAFETY: as above.
    let payload = u16::from_be(unsafe { load::<u16>(pos.ip + 4) }) as usize;
    let check_off = full_l4(ctx, &pos, end, Some(payload))?;
    let new_ports = ports_word(flow.vport, flow.cport);
    // SAFETY: the fields were bounds-checked above.
    unsafe {
        store(pos.ip + 8, flow.vip);
        store(pos.l4, new_ports);
    }
    ctx.fix_csums(&CsumFix {
        ip_check: 0,
        l4_check: pos.l4 + check_off,
        l4_check_off: pos.l4_off + check_off,
        addr_diff: csum::diff128(&saddr, &flow.vip),
        old_ports: ports,
        new_ports,
        udp: pos.proto != PROTO_TCP,
        v6: true,
    })?;
    select::count_packet(
        flow.entry.service_id,
        flow.entry.backend_id,
        (ctx.len() - ETH_LEN) as u64,
        false,
    );
    Ok(Verdict::Translated)
}
