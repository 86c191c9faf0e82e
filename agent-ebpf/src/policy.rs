//! `rune_tc_policy_to` and `rune_tc_policy_from`: network policy on the interfaces
//! toward local endpoints (the maps and the decision order: `agent_common::policy`).
//!
//! tc egress of such an interface sees packets delivered to an endpoint (VIP
//! traffic already DNAT'd by the uplink's program, so one check covers both paths)
//! and checks the destination's ingress rules; tc ingress sees packets an endpoint
//! sends, before any DNAT, and checks the source's egress rules.
//!
//! A TCP/UDP flow allowed by a check gets a policy conntrack entry, keyed the
//! same for the flow's packets and its replies at the opposite hook; later packets
//! of the flow, and its replies, pass after that one lookup, before the guarded
//! address is looked up at all. A TCP SYN without ACK is always checked (a policy
//! change applies to every new connection). Packets without ports (other protocols, non-first fragments) are
//! checked per packet by peer only: a peer prefix whose rule allows every port lets
//! them through. ICMPv6 neighbour discovery always passes.

use agent_common::{
    lb::{Addr, CT_UDP_TIMEOUT_UNITS, PROTO_TCP, PROTO_UDP, ct_now},
    policy::{
        DIR_EGRESS, DIR_INGRESS, EVENT_DROP_FULL, EVENT_DROP_RATE, EVENT_WINDOW_NS,
        EVENTS_PER_WINDOW, EndpointKey, MODE_AUDIT, MODE_AUDIT_UNPROGRAMMABLE, MODE_DENY_ALL,
        MODE_NONE, PORTS_ALL, PeerValue, PolicyCtKey, PolicyCtValue, PolicyDirection, PortKey,
        Verdict, VerdictEvent, verdict_slot,
    },
};
use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::bpf_ktime_get_ns,
    macros::classifier,
    maps::LruHashMap,
    programs::TcContext,
};

mod family;

use family::{Family, V4, V6};

use crate::{
    maps::{
        RUNE_POL_EP, RUNE_POL_EVENT_BUDGET, RUNE_POL_EVENT_DROPS, RUNE_POL_EVENTS, RUNE_POL_PORTS,
        RUNE_POL_VERDICTS,
    },
    nat::parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6, IPV4_LEN, IPV6_LEN, ethertype, load},
    tc::pull_headers,
};

/// TCP flag SYN.
const TCP_SYN: u8 = 0x02;
/// TCP flag ACK.
const TCP_ACK: u8 = 0x10;
/// IPv4 fragment offset bits, as a native load reads them.
const IP_OFFSET_MASK: u16 = 0x1fffu16.to_be();
/// ICMPv6's next-header number.
const PROTO_ICMPV6: u8 = 58;

/// tc egress of a policy interface: the ingress rules of the packet's destination.
/// Named as `agent_common::policy::PROG_POLICY_TO`.
#[classifier]
pub fn rune_tc_policy_to(ctx: TcContext) -> i32 {
    check(&ctx, DIR_INGRESS)
}

/// tc ingress of a policy interface: the egress rules of the packet's source.
/// Named as `agent_common::policy::PROG_POLICY_FROM`.
#[classifier]
pub fn rune_tc_policy_from(ctx: TcContext) -> i32 {
    check(&ctx, DIR_EGRESS)
}

#[inline(always)]
fn check(ctx: &TcContext, dir: u8) -> i32 {
    pull_headers(ctx);
    let (data, end) = (ctx.data(), ctx.data_end());
    let pass = match ethertype(data, end) {
        Some(ETH_P_IP) => check_v4(data, end, dir),
        Some(ETH_P_IPV6) => check_v6(data, end, dir),
        _ => true,
    };
    if pass {
        TC_ACT_OK as i32
    } else {
        TC_ACT_SHOT as i32
    }
}

/// A packet's transport as the checks see it.
#[derive(Clone, Copy)]
struct Transport {
    /// Source and destination port (network order), when the packet has them.
    ports: Option<(u16, u16)>,
    /// A TCP SYN without ACK: a new connection, always checked.
    syn: bool,
}

/// Reads the ports (and TCP flags) of a TCP/UDP header at `l4`.
#[inline(always)]
fn transport(l4: usize, end: usize, proto: u8) -> Transport {
    let none = Transport {
        ports: None,
        syn: false,
    };
    if proto == PROTO_TCP {
        if l4 + 14 > end {
            return none;
        }
        // SAFETY: bounds checked above.
        let (sport, dport, flags) =
            unsafe { (load::<u16>(l4), load::<u16>(l4 + 2), load::<u8>(l4 + 13)) };
        Transport {
            ports: Some((sport, dport)),
            syn: flags & (TCP_SYN | TCP_ACK) == TCP_SYN,
        }
    } else if proto == PROTO_UDP {
        if l4 + 4 > end {
            return none;
        }
        // SAFETY: bounds checked above.
        let (sport, dport) = unsafe { (load::<u16>(l4), load::<u16>(l4 + 2)) };
        Transport {
            ports: Some((sport, dport)),
            syn: false,
        }
    } else {
        none
    }
}

#[inline(always)]
fn check_v4(data: usize, end: usize, dir: u8) -> bool {
    let ip = data + ETH_LEN;
    if ip + IPV4_LEN > end {
        return true;
    }
    // SAFETY: the fixed header is inside the packet (checked above).
    let (vihl, proto, frag, saddr, daddr) = unsafe {
        (
            load::<u8>(ip),
            load::<u8>(ip + 9),
            load::<u16>(ip + 6),
            load::<u32>(ip + 12),
            load::<u32>(ip + 16),
        )
    };
    let ihl = ((vihl & 0xf) as usize) << 2;
    let t = if frag & IP_OFFSET_MASK == 0 && ihl >= IPV4_LEN {
        transport(ip + ihl, end, proto)
    } else {
        Transport {
            ports: None,
            syn: false,
        }
    };
    decide::<V4>(saddr, daddr, proto, t, dir)
}

#[inline(always)]
fn check_v6(data: usize, end: usize, dir: u8) -> bool {
    let ip = data + ETH_LEN;
    if ip + IPV6_LEN > end {
        return true;
    }
    // SAFETY: the fixed header is inside the packet (checked above).
    let (proto, saddr, daddr) = unsafe {
        (
            load::<u8>(ip + 6),
            load::<Addr>(ip + 8),
            load::<Addr>(ip + 24),
        )
    };
    let l4 = ip + IPV6_LEN;
    if proto == PROTO_ICMPV6 && l4 + 1 <= end {
        // SAFETY: bounds checked above.
        let kind = unsafe { load::<u8>(l4) };
        // Router/neighbour solicitation and advertisement, redirect: the link
        // needs them whatever the policy says.
        if (133..=137).contains(&kind) {
            return true;
        }
    }
    decide::<V6>(saddr, daddr, proto, transport(l4, end, proto), dir)
}

/// The flow's conntrack key, the same for its packets at the hook `dir` that
/// checked it and for its replies at the opposite hook: the lower (address, port)
/// end first, and `dir` turned when that swaps the packet's ends. So one lookup
/// finds a packet's flow whichever way it goes.
#[inline(always)]
fn flow_key<A: Copy + Ord>(
    saddr: A,
    daddr: A,
    (sport, dport): (u16, u16),
    proto: u8,
    dir: u8,
) -> PolicyCtKey<A> {
    let (saddr, daddr, sport, dport, dir) = if (saddr, sport) <= (daddr, dport) {
        (saddr, daddr, sport, dport, dir)
    } else {
        (daddr, saddr, dport, sport, dir ^ 1)
    };
    PolicyCtKey {
        saddr,
        daddr,
        sport,
        dport,
        proto,
        dir,
        pad: [0; 2],
    }
}

/// Whether a packet passes at hook `dir`: an established flow after one conntrack
/// lookup; otherwise the guarded address's rules (an unguarded address: one more
/// lookup).
#[inline(always)]
fn decide<F: Family>(saddr: F::Addr, daddr: F::Addr, proto: u8, t: Transport, dir: u8) -> bool {
    let flow = t
        .ports
        .map(|ports| flow_key(saddr, daddr, ports, proto, dir));
    if let Some(key) = &flow
        && !t.syn
        && established(F::conntrack(), key, proto)
    {
        return true;
    }
    let (guarded, peer) = if dir == DIR_INGRESS {
        (daddr, saddr)
    } else {
        (saddr, daddr)
    };
    let key = EndpointKey {
        addr: F::wide(guarded),
        family: F::FAMILY,
        pad: [0; 3],
    };
    let Some(ep) = RUNE_POL_EP.get_ptr(&key) else {
        return true;
    };
    // SAFETY: a pointer from a successful lookup; copied at once.
    let ep = unsafe { *ep };
    let (this, other) = sides(ep.ingress, ep.egress, dir);
    let event = |v: Verdict| {
        let (sport, dport) = t.ports.unwrap_or((0, 0));
        emit(&VerdictEvent {
            saddr: F::wide(saddr),
            daddr: F::wide(daddr),
            sport,
            dport,
            counter: this.counter,
            proto,
            family: F::FAMILY,
            dir,
            verdict: v as u8,
        });
    };
    let peers = |rules: u32| F::peer(rules, peer);
    let port = t.ports.map(|(_, dport)| (dport, proto));
    let pass = verdict(&this, peers, port, event);
    if let Some(key) = &flow
        && pass
        && (this.mode != MODE_NONE || other.mode != MODE_NONE)
    {
        remember(F::conntrack(), key, proto);
    }
    pass
}

/// This hook's direction of a guarded address, and the opposite one.
#[inline(always)]
fn sides(
    ingress: PolicyDirection,
    egress: PolicyDirection,
    dir: u8,
) -> (PolicyDirection, PolicyDirection) {
    if dir == DIR_EGRESS {
        (egress, ingress)
    } else {
        (ingress, egress)
    }
}

/// Whether `key` names a live allowed flow (UDP: seen within the timeout, and then
/// refreshed at most once per `ct_now` unit).
#[inline(always)]
fn established<K>(map: &LruHashMap<K, PolicyCtValue>, key: &K, proto: u8) -> bool {
    let Some(entry) = map.get_ptr_mut(key) else {
        return false;
    };
    if proto != PROTO_UDP {
        return true;
    }
    // SAFETY: the helper only reads the clock.
    let now = ct_now(unsafe { bpf_ktime_get_ns() });
    // SAFETY: a pointer from a successful lookup stays valid for this run.
    let last = unsafe { (*entry).last_seen };
    if now.wrapping_sub(last) >= CT_UDP_TIMEOUT_UNITS {
        return false;
    }
    if last != now {
        // SAFETY: as above.
        unsafe { (*entry).last_seen = now };
    }
    true
}

/// Records an allowed flow (best effort: a full LRU evicts the oldest).
#[inline(always)]
fn remember<K>(map: &LruHashMap<K, PolicyCtValue>, key: &K, proto: u8) {
    let last_seen = if proto == PROTO_UDP {
        // SAFETY: the helper only reads the clock.
        ct_now(unsafe { bpf_ktime_get_ns() })
    } else {
        0
    };
    let _ = map.insert(key, &PolicyCtValue { last_seen }, 0);
}

/// Decides and counts: whether the packet passes under `dir`'s rules, looking its
/// peer up with `peers` (by rule set) and its destination port in the port set.
#[inline(always)]
fn verdict(
    dir: &PolicyDirection,
    peers: impl FnOnce(u32) -> Option<PeerValue>,
    port: Option<(u16, u8)>,
    event: impl FnOnce(Verdict),
) -> bool {
    let v = match dir.mode {
        MODE_NONE => return true,
        MODE_DENY_ALL => Verdict::DropUnprogrammable,
        MODE_AUDIT_UNPROGRAMMABLE => Verdict::AuditUnprogrammable,
        mode => {
            let audit = mode == MODE_AUDIT;
            match peers(dir.rules) {
                None if audit => Verdict::AuditNoMatchingRule,
                None => Verdict::DropNoMatchingRule,
                Some(v) if v.ports == PORTS_ALL => Verdict::Allow,
                Some(v) => {
                    let allowed = port.is_some_and(|(port, proto)| {
                        RUNE_POL_PORTS
                            .get_ptr(PortKey {
                                set: v.ports,
                                port,
                                proto,
                                pad: 0,
                            })
                            .is_some()
                    });
                    if allowed {
                        Verdict::Allow
                    } else if audit {
                        Verdict::AuditPortNotAllowed
                    } else {
                        Verdict::DropPortNotAllowed
                    }
                }
            }
        }
    };
    if let Some(count) = RUNE_POL_VERDICTS.get_ptr_mut(verdict_slot(dir.counter, v)) {
        // SAFETY: a per-CPU slot from a successful lookup; only this CPU writes it.
        unsafe { *count = (*count).wrapping_add(1) };
    }
    if v != Verdict::Allow {
        event(v);
    }
    !v.dropped()
}

/// Writes `event` to the ring buffer, at most `EVENTS_PER_WINDOW` per CPU per
/// window; what is not written is counted.
#[inline(always)]
fn emit(event: &VerdictEvent) {
    let Some(budget) = RUNE_POL_EVENT_BUDGET.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: the helper only reads the clock; `budget` is this CPU's slot from a
    // successful lookup, only this CPU writes it.
    let over = unsafe {
        let now = bpf_ktime_get_ns();
        if now.wrapping_sub((*budget)[0]) > EVENT_WINDOW_NS {
            (*budget)[0] = now;
            (*budget)[1] = 0;
        }
        (*budget)[1] += 1;
        (*budget)[1] > EVENTS_PER_WINDOW
    };
    let slot = if over {
        EVENT_DROP_RATE
    } else if RUNE_POL_EVENTS.output::<VerdictEvent>(event, 0).is_err() {
        EVENT_DROP_FULL
    } else {
        return;
    };
    if let Some(count) = RUNE_POL_EVENT_DROPS.get_ptr_mut(slot) {
        // SAFETY: a per-CPU slot from a successful lookup; only this CPU writes it.
        unsafe { *count = (*count).wrapping_add(1) };
    }
}
