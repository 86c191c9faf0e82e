//! North-south VIP load balancing, shared by `rune_tc_ingress`, `rune_xdp_lb` and
//! `rune_tc_egress`: one parsing and rewrite core over the packet's raw pointers.
//!
//! * [`dnat`] (tc ingress, XDP): a TCP/UDP packet whose (daddr, dport, proto) is a
//!   frontend goes to the backend its conntrack entry names, else to a new one from
//!   `select::pick_backend` (one conntrack entry is stored, keyed as the client
//!   sent the packet; [`ct::lookup`] and [`ct::insert`] decide); its daddr/dport
//!   are rewritten to the backend's and the checksums updated.
//! * [`snat`] (tc egress): a packet from a backend (found in the agent-filled
//!   `RUNE_REVNAT` index, which lists the frontends leading to it) whose conntrack
//!   entry, looked up as (client, candidate VIP, client port, candidate port), names
//!   that backend and takes the packet as a reply of its flow ([`ct::is_reply`]: not
//!   a SYN-ACK of another connection, not an expired UDP flow) gets the VIP and
//!   service port back as its source.
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
        Addr, Backend, CtKeyV4, CtKeyV6, CtValue, DropReason, FAMILY_V4, FAMILY_V6, PROTO_TCP,
        REVNAT_MAX_FRONTENDS, RevNatKey, RevNatValue, ServiceKeyV4, ServiceKeyV6, ServiceValue,
    },
};

use aya_ebpf::maps::LruHashMap;

use crate::{
    maps::{RUNE_CT_V4, RUNE_CT_V6, RUNE_REVNAT, RUNE_SVC_V4, RUNE_SVC_V6, RUNE_VIP_FILTER},
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
    /// Updates the checksums after the core rewrote one address and one port in
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

/// The checksum update after one address and one port were rewritten.
pub struct CsumFix {
    /// Address of the IPv4 header checksum; 0 for IPv6 (no IP checksum).
    pub ip_check: usize,
    /// Address of the TCP/UDP checksum.
    pub l4_check: usize,
    /// Offset of the TCP/UDP checksum from the start of the packet.
    pub l4_check_off: usize,
    /// Ones'-complement diff of the address change ([`csum::diff32`]/[`csum::diff128`]).
    pub addr_diff: u32,
    /// The port before (as loaded from the packet).
    pub old_port: u16,
    /// The port after.
    pub new_port: u16,
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
        let diff = csum::add(fix.addr_diff, csum::diff16(fix.old_port, fix.new_port));
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
    let (saddr, sport) = unsafe { (load::<u32>(pos.ip + 12), load::<u16>(pos.l4)) };

    let key = CtKeyV4 {
        saddr,
        daddr,
        sport,
        dport,
        proto: pos.proto,
        pad: [0; 3],
    };
    let seg = ct::Segment::read(&pos, end);
    let found = ct::lookup(&RUNE_CT_V4, &key, svc.id, &seg, FAMILY_V4);
    let (id, backend, new_flow) = match found {
        Some(found) => found,
        None => {
            let hash = flow_hash_v4(u32::from_be(saddr), u16::from_be(sport), FLOW_HASH_SEED);
            let (id, backend) = match pick(&svc, &[saddr, 0, 0, 0], hash, FAMILY_V4) {
                Ok(found) => found,
                Err(DropReason::NoBackend) if pos.proto == PROTO_TCP => {
                    return refused(
                        refuse::tcp_rst_v4(data, end, &pos, tot_len).map(Verdict::Refused),
                    );
                }
                Err(DropReason::NoBackend) => {
                    let plan = refuse::plan_icmp(data, end, &pos, false);
                    let Some(plan) = plan else {
                        return Err(DropReason::NoBackend);
                    };
                    let len = ctx.write_unreachable(&plan)?;
                    return refused(Some(Verdict::Refused(len)));
                }
                Err(e) => return Err(e),
            };
            ct::insert(&RUNE_CT_V4, &key, id, svc.id, &seg);
            (id, backend, true)
        }
    };

    // SAFETY: the fields were bounds-checked above.
    unsafe {
        store(pos.ip + 16, backend.addr[0]);
        store(pos.l4 + 2, backend.port);
    }
    ctx.fix_csums(&CsumFix {
        ip_check: pos.ip + 10,
        l4_check: pos.l4 + check_off,
        l4_check_off: pos.l4_off + check_off,
        addr_diff: csum::diff32(daddr, backend.addr[0]),
        old_port: dport,
        new_port: backend.port,
        udp: pos.proto != PROTO_TCP,
        v6: false,
    })?;
    select::count_packet(svc.id, id, (ctx.len() - ETH_LEN) as u64, new_flow);
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
    let (saddr, sport) = unsafe { (load::<[u32; 4]>(pos.ip + 8), load::<u16>(pos.l4)) };

    let key = CtKeyV6 {
        saddr,
        daddr,
        sport,
        dport,
        proto: pos.proto,
        pad: [0; 3],
    };
    let seg = ct::Segment::read(&pos, end);
    let found = ct::lookup(&RUNE_CT_V6, &key, svc.id, &seg, FAMILY_V6);
    let (id, backend, new_flow) = match found {
        Some(found) => found,
        None => {
            let words = [
                u32::from_be(saddr[0]),
                u32::from_be(saddr[1]),
                u32::from_be(saddr[2]),
                u32::from_be(saddr[3]),
            ];
            let hash = flow_hash_v6(words, u16::from_be(sport), FLOW_HASH_SEED);
            let (id, backend) = match pick(&svc, &saddr, hash, FAMILY_V6) {
                Ok(found) => found,
                Err(DropReason::NoBackend) if pos.proto == PROTO_TCP => {
                    return refused(
                        refuse::tcp_rst_v6(data, end, &pos, payload).map(Verdict::Refused),
                    );
                }
                Err(DropReason::NoBackend) => {
                    let plan = refuse::plan_icmp(data, end, &pos, true);
                    let Some(plan) = plan else {
                        return Err(DropReason::NoBackend);
                    };
                    let len = ctx.write_unreachable(&plan)?;
                    return refused(Some(Verdict::Refused(len)));
                }
                Err(e) => return Err(e),
            };
            ct::insert(&RUNE_CT_V6, &key, id, svc.id, &seg);
            (id, backend, true)
        }
    };

    // SAFETY: the fields were bounds-checked above.
    unsafe {
        store(pos.ip + 24, backend.addr);
        store(pos.l4 + 2, backend.port);
    }
    ctx.fix_csums(&CsumFix {
        ip_check: 0,
        l4_check: pos.l4 + check_off,
        l4_check_off: pos.l4_off + check_off,
        addr_diff: csum::diff128(&daddr, &backend.addr),
        old_port: dport,
        new_port: backend.port,
        udp: pos.proto != PROTO_TCP,
        v6: true,
    })?;
    select::count_packet(svc.id, id, (ctx.len() - ETH_LEN) as u64, new_flow);
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

/// The frontend a backend's reply belongs to: the backend's [`RevNatValue`] lists
/// the candidates, and the first whose conntrack entry in `ct` (keyed by `ct_key`
/// from the candidate's VIP and port) names this backend and takes `seg` as a reply
/// ([`ct::is_reply`]) wins; an entry that names the backend but whose flow is over
/// is deleted on the way. Returns the VIP, the service port and the entry.
#[inline(always)]
fn reply_frontend<K>(
    revnat: &RevNatValue,
    proto: u8,
    seg: &ct::Segment,
    ct_key: impl Fn(&Addr, u16) -> K,
    ct: &LruHashMap<K, CtValue>,
) -> Option<(Addr, u16, CtValue)> {
    let count = revnat.count as usize;
    for i in 0..REVNAT_MAX_FRONTENDS {
        if i >= count {
            break;
        }
        let f = &revnat.frontends[i];
        if f.proto != proto {
            continue;
        }
        let key = ct_key(&f.addr, f.port);
        let Some(entry) = ct.get_ptr_mut(&key) else {
            continue;
        };
        // SAFETY: a pointer from a successful lookup stays valid for this run.
        let value = unsafe { *entry };
        if value.backend_id != revnat.backend_id {
            continue;
        }
        if ct::is_reply(entry, seg) {
            return Some((f.addr, f.port, value));
        }
        // Deleting a missing entry (another CPU was first) is fine.
        let _ = ct.remove(&key);
    }
    None
}

#[inline(always)]
fn snat_v4<C: NatCtx>(ctx: &C, data: usize, end: usize) -> Result<Verdict, DropReason> {
    let Some(pos) = parse::ipv4(data, end) else {
        return Ok(Verdict::Untouched);
    };
    // SAFETY: the IPv4 fixed header and the ports are inside the packet.
    let (saddr, daddr, sport, dport) = unsafe {
        (
            load::<u32>(pos.ip + 12),
            load::<u32>(pos.ip + 16),
            load::<u16>(pos.l4),
            load::<u16>(pos.l4 + 2),
        )
    };
    let rkey = RevNatKey {
        addr: [saddr, 0, 0, 0],
        port: sport,
        family: FAMILY_V4,
        pad: 0,
    };
    // SAFETY: the value is only read during this run.
    let Some(revnat) = (unsafe { RUNE_REVNAT.get(&rkey) }) else {
        return Ok(Verdict::Untouched);
    };
    let seg = ct::Segment::read(&pos, end);
    let found = reply_frontend(
        revnat,
        pos.proto,
        &seg,
        |vip, vport| CtKeyV4 {
            saddr: daddr,
            daddr: vip[0],
            sport: dport,
            dport: vport,
            proto: pos.proto,
            pad: [0; 3],
        },
        &RUNE_CT_V4,
    );
    let Some((vip, vport, ct)) = found else {
        return Ok(Verdict::Untouched);
    };
    let ihl = pos.l4_off - ETH_LEN;
    // SAFETY: as above.
    let tot_len = u16::from_be(unsafe { load::<u16>(pos.ip + 2) }) as usize;
    let check_off = full_l4(ctx, &pos, end, tot_len.checked_sub(ihl))?;
    // SAFETY: the fields were bounds-checked above.
    unsafe {
        store(pos.ip + 12, vip[0]);
        store(pos.l4, vport);
    }
    ctx.fix_csums(&CsumFix {
        ip_check: pos.ip + 10,
        l4_check: pos.l4 + check_off,
        l4_check_off: pos.l4_off + check_off,
        addr_diff: csum::diff32(saddr, vip[0]),
        old_port: sport,
        new_port: vport,
        udp: pos.proto != PROTO_TCP,
        v6: false,
    })?;
    select::count_packet(
        ct.service_id,
        ct.backend_id,
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
    let (saddr, daddr, sport, dport) = unsafe {
        (
            load::<[u32; 4]>(pos.ip + 8),
            load::<[u32; 4]>(pos.ip + 24),
            load::<u16>(pos.l4),
            load::<u16>(pos.l4 + 2),
        )
    };
    let rkey = RevNatKey {
        addr: saddr,
        port: sport,
        family: FAMILY_V6,
        pad: 0,
    };
    // SAFETY: the value is only read during this run.
    let Some(revnat) = (unsafe { RUNE_REVNAT.get(&rkey) }) else {
        return Ok(Verdict::Untouched);
    };
    let seg = ct::Segment::read(&pos, end);
    let found = reply_frontend(
        revnat,
        pos.proto,
        &seg,
        |vip, vport| CtKeyV6 {
            saddr: daddr,
            daddr: *vip,
            sport: dport,
            dport: vport,
            proto: pos.proto,
            pad: [0; 3],
        },
        &RUNE_CT_V6,
    );
    let Some((vip, vport, ct)) = found else {
        return Ok(Verdict::Untouched);
    };
    // SAFETY: as above.
    let payload = u16::from_be(unsafe { load::<u16>(pos.ip + 4) }) as usize;
    let check_off = full_l4(ctx, &pos, end, Some(payload))?;
    // SAFETY: the fields were bounds-checked above.
    unsafe {
        store(pos.ip + 8, vip);
        store(pos.l4, vport);
    }
    ctx.fix_csums(&CsumFix {
        ip_check: 0,
        l4_check: pos.l4 + check_off,
        l4_check_off: pos.l4_off + check_off,
        addr_diff: csum::diff128(&saddr, &vip),
        old_port: sport,
        new_port: vport,
        udp: pos.proto != PROTO_TCP,
        v6: true,
    })?;
    select::count_packet(
        ct.service_id,
        ct.backend_id,
        (ctx.len() - ETH_LEN) as u64,
        false,
    );
    Ok(Verdict::Translated)
}
