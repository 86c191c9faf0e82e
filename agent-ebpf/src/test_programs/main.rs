//! Programs only tests and benches load, built into their own object
//! (`agent-ebpf-test`) so that the object embedded in the agent carries none of them.
//! The agent's build script builds both objects; the tests find this one through
//! `rune_harness::test_programs`, `cargo xtask bench ebpf` through `cargo xtask
//! build-ebpf`.
#![no_std]
#![no_main]

mod bench;

use agent_common::PacketStats;
use aya_ebpf::{
    bindings::xdp_action,
    macros::{map, xdp},
    maps::PerCpuArray,
    programs::XdpContext,
};

/// Per-CPU packet and byte counters of [`rune_xdp_pass`] (one entry, index 0).
#[map]
static RUNE_XDP_STATS: PerCpuArray<PacketStats> = PerCpuArray::with_max_entries(1, 0);

/// XDP pass-through: counts every packet and its bytes, then passes it to the stack
/// (a veth peer's XDP program in tests, the floor of the per-packet bench).
#[xdp]
pub fn rune_xdp_pass(ctx: XdpContext) -> u32 {
    match try_rune_xdp_pass(&ctx) {
        Ok(action) => action,
        Err(()) => xdp_action::XDP_ABORTED,
    }
}

fn try_rune_xdp_pass(ctx: &XdpContext) -> Result<u32, ()> {
    let len = ctx.data_end().saturating_sub(ctx.data()) as u64;
    let stats = RUNE_XDP_STATS.get_ptr_mut(0).ok_or(())?;
    // SAFETY: the pointer comes from a successful map lookup and stays valid for the
    // whole program run; the slot belongs to this CPU, so nothing else writes it now.
    unsafe {
        (*stats).packets = (*stats).packets.wrapping_add(1);
        (*stats).bytes = (*stats).bytes.wrapping_add(len);
    }
    Ok(xdp_action::XDP_PASS)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects programs that could reach this; it is never called.
    loop {}
}

/// The programs' license; GPL-compatible so they may call GPL-only helpers.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
