//! `rune_tc_ingress` (VIP DNAT) and `rune_tc_egress` (reverse NAT of replies) on the
//! tc hooks (see [`crate::nat`]).

use agent_common::lb::DropReason;
use aya_ebpf::{
    bindings::{
        BPF_CSUM_LEVEL_RESET, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_OK, TC_ACT_SHOT,
        bpf_adj_room_mode,
    },
    helpers::{bpf_csum_level, bpf_redirect, bpf_skb_change_tail},
    macros::classifier,
    programs::TcContext,
};

use crate::{
    nat::{self, CsumFix, IPV4_CHECK_OFF, NatCtx, refuse},
    select,
};

/// `BPF_F_IPV6` of `bpf_l4_csum_replace` (kernel 6.14+, not in aya's bindings yet):
/// the pseudo-header change of an IPv6 packet leaves a `CHECKSUM_COMPLETE` sum as is.
const BPF_F_IPV6: u64 = 1 << 7;

/// Bytes the headers can span (Ethernet, IPv4 with options, TCP without options);
/// pulled into the linear area when the skb is not linear that far.
const PULL_LEN: usize = 14 + 60 + 20;

impl NatCtx for TcContext {
    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }

    #[inline(always)]
    fn len(&self) -> usize {
        TcContext::len(self) as usize
    }

    #[inline(always)]
    fn fix_csums(&self, fix: &CsumFix) -> Result<(), DropReason> {
        let mangled0 = if fix.udp {
            u64::from(BPF_F_MARK_MANGLED_0)
        } else {
            0
        };
        let v6 = if fix.v6 { BPF_F_IPV6 } else { 0 };
        // Size 0: `to` is a ones'-complement diff (`__wsum`), as `bpf_csum_diff` makes.
        if !fix.v6 {
            self.l3_csum_replace(IPV4_CHECK_OFF, 0, u64::from(fix.addr_diff), 0)
                .map_err(|_| DropReason::Malformed)?;
        }
        self.l4_csum_replace(
            fix.l4_check_off,
            0,
            u64::from(fix.addr_diff),
            u64::from(BPF_F_PSEUDO_HDR) | mangled0 | v6,
        )
        .map_err(|_| DropReason::Malformed)?;
        self.l4_csum_replace(
            fix.l4_check_off,
            u64::from(fix.old_ports),
            u64::from(fix.new_ports),
            4 | mangled0,
        )
        .map_err(|_| DropReason::Malformed)
    }

    #[inline(always)]
    fn write_unreachable(&self, plan: &refuse::IcmpPlan) -> Result<usize, DropReason> {
        self.adjust_room(plan.room() as i32, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, 0)
            .map_err(|_| DropReason::NoBackend)?;
        let len = plan.frame_len();
        // SAFETY: `self.skb.skb` is this program's context; packet pointers are read
        // again below.
        if unsafe { bpf_skb_change_tail(self.skb.skb, len as u32, 0) } != 0 {
            return Err(DropReason::NoBackend);
        }
        self.pull_data(len as u32)
            .map_err(|_| DropReason::NoBackend)?;
        if !refuse::write_icmp(self.data(), self.data_end(), plan) {
            return Err(DropReason::NoBackend);
        }
        Ok(len)
    }
}

/// Makes the headers directly accessible when the skb's linear part is shorter than
/// the packet and than [`PULL_LEN`] (rare: GRO'd or fragmented skbs).
#[inline(always)]
pub(crate) fn pull_headers(ctx: &TcContext) {
    let linear = ctx.data_end() - ctx.data();
    let len = ctx.len() as usize;
    if linear < len && linear < PULL_LEN {
        // On failure the parser sees the short linear part: a VIP packet is then
        // dropped as malformed, anything else passes.
        if ctx.pull_data(len.min(PULL_LEN) as u32).is_err() {
            return;
        }
    }
}

/// tc ingress: DNAT VIP → backend, then on to the stack; a packet to a service
/// without backends goes back out of the interface it came in on as a TCP RST or an
/// ICMP port unreachable. Named as
/// `agent_common::lb::PROG_TC_INGRESS`.
#[classifier]
pub fn rune_tc_ingress(ctx: TcContext) -> i32 {
    match try_rune_tc_ingress(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            select::count_drop(reason);
            TC_ACT_SHOT as i32
        }
    }
}

#[inline(always)]
fn try_rune_tc_ingress(ctx: &TcContext) -> Result<i32, DropReason> {
    pull_headers(ctx);
    match nat::dnat(ctx)? {
        nat::Verdict::Refused(len) => send_back(ctx, len),
        _ => Ok(TC_ACT_OK as i32),
    }
}

/// Trims the reply built in place to `len` bytes and redirects it to the egress of
/// the interface it arrived on.
#[inline(always)]
fn send_back(ctx: &TcContext, len: usize) -> Result<i32, DropReason> {
    let skb = ctx.skb.skb;
    // SAFETY: `skb` is this program's context; the helpers only invalidate packet
    // pointers, and none is used afterwards.
    unsafe {
        if bpf_skb_change_tail(skb, len as u32, 0) != 0 {
            return Err(DropReason::NoBackend);
        }
        // The checksums are complete: no offload state of the original may apply.
        bpf_csum_level(skb, u64::from(BPF_CSUM_LEVEL_RESET));
        Ok(bpf_redirect((*skb).ifindex, 0) as i32)
    }
}

/// tc egress of the client-facing interface: a backend's reply gets the VIP and
/// service port back as its source. Named as `agent_common::lb::PROG_TC_EGRESS`.
#[classifier]
pub fn rune_tc_egress(ctx: TcContext) -> i32 {
    match try_rune_tc_egress(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            select::count_drop(reason);
            TC_ACT_SHOT as i32
        }
    }
}

#[inline(always)]
fn try_rune_tc_egress(ctx: &TcContext) -> Result<i32, DropReason> {
    pull_headers(ctx);
    nat::snat(ctx).map(|_| TC_ACT_OK as i32)
}
