//! `rune_xdp_lb`: VIP DNAT on the uplink's XDP hook (see [`crate::nat`]).

use agent_common::lb::DropReason;
use aya_ebpf::{
    bindings::xdp_action,
    helpers::{bpf_xdp_adjust_head, bpf_xdp_adjust_tail, bpf_xdp_get_buff_len},
    macros::xdp,
    programs::XdpContext,
};

use crate::{
    nat::{self, CsumFix, NatCtx, refuse},
    select,
};

impl NatCtx for XdpContext {
    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }

    #[inline(always)]
    fn len(&self) -> usize {
        // Without the frags flag the whole packet is linear.
        XdpContext::data_end(self) - XdpContext::data(self)
    }

    #[inline(always)]
    fn fix_csums(&self, fix: &CsumFix) -> Result<(), DropReason> {
        // SAFETY: the core bounds-checked every address in `fix`.
        unsafe { nat::fix_csums_in_place(fix) };
        Ok(())
    }

    #[inline(always)]
    fn write_unreachable(&self, plan: &refuse::IcmpPlan) -> Result<usize, DropReason> {
        // SAFETY: `self` is this program's context; growing the head only
        // invalidates packet pointers, which are read again below.
        if unsafe { bpf_xdp_adjust_head(self.ctx, -(plan.room() as i32)) } != 0 {
            return Err(DropReason::NoBackend);
        }
        let len = plan.frame_len();
        trim(self, len)?;
        if !refuse::write_icmp(self.data(), self.data_end(), plan) {
            return Err(DropReason::NoBackend);
        }
        Ok(len)
    }
}

/// XDP load balancer: DNAT VIP → backend, then `XDP_PASS` to the stack, which routes
/// the packet to the backend; a packet to a service without backends goes back out
/// as a TCP RST or an ICMP port unreachable (`XDP_TX`). Named as `agent_common::lb::PROG_XDP_LB`.
#[xdp]
pub fn rune_xdp_lb(ctx: XdpContext) -> u32 {
    match try_rune_xdp_lb(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            select::count_drop(reason);
            xdp_action::XDP_DROP
        }
    }
}

#[inline(always)]
fn try_rune_xdp_lb(ctx: &XdpContext) -> Result<u32, DropReason> {
    match nat::dnat(ctx)? {
        nat::Verdict::Refused(len) => {
            trim(ctx, len)?;
            Ok(xdp_action::XDP_TX)
        }
        _ => Ok(xdp_action::XDP_PASS),
    }
}

/// Trims the frame to `len` bytes.
#[inline(always)]
fn trim(ctx: &XdpContext, len: usize) -> Result<(), DropReason> {
    // The length from the helper: computed from the packet pointers, the compiler
    // turns it into arithmetic on `data_end`, which the verifier refuses.
    // SAFETY: `ctx` is this program's context; shrinking the tail only invalidates
    // packet pointers, which are read again afterwards.
    let delta = len as i32 - unsafe { bpf_xdp_get_buff_len(ctx.ctx) } as i32;
    // SAFETY: as above.
    if unsafe { bpf_xdp_adjust_tail(ctx.ctx, delta) } != 0 {
        return Err(DropReason::NoBackend);
    }
    Ok(())
}
