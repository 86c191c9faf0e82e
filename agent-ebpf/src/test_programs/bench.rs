//! Benchmark drivers for `cargo xtask bench ebpf` (in the test object only).
//!
//! `BPF_PROG_TEST_RUN` with `repeat` runs every iteration on the same buffer, so a
//! program that rewrites the packet would time the rewritten packet's path from the
//! second iteration on (docs/performance.md). A driver restores the original
//! headers from [`RUNE_BENCH_PKT`] (and, with [`RUNE_BENCH_VARY`] set, makes every
//! iteration a new flow by writing a per-CPU sequence number into the IPv4 source
//! address), then tail-calls the program under test at index 0 of its jump table.
//! The cost of the driver itself is measured with the no-op targets and subtracted.

use aya_ebpf::{
    bindings::{TC_ACT_OK, xdp_action},
    helpers::bpf_get_smp_processor_id,
    macros::{classifier, map, xdp},
    maps::{Array, PerCpuArray, ProgramArray},
    programs::{TcContext, XdpContext},
};

/// Bytes of the packet the drivers restore (headers of an IPv4 TCP/UDP frame).
pub const BENCH_HEADER: usize = 64;

/// The original first [`BENCH_HEADER`] bytes of the packet under test (index 0).
#[map]
static RUNE_BENCH_PKT: Array<[u64; BENCH_HEADER / 8]> = Array::with_max_entries(1, 0);

/// Index 0: non-zero makes every iteration a new flow (IPv4 source address =
/// per-CPU sequence number).
#[map]
static RUNE_BENCH_VARY: Array<u32> = Array::with_max_entries(1, 0);

/// Per-CPU sequence number of the new-flow iterations.
#[map]
static RUNE_BENCH_SEQ: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// The XDP program under test, at index 0.
#[map]
static RUNE_BENCH_XDP_JMP: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// The tc program under test, at index 0.
#[map]
static RUNE_BENCH_TC_JMP: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// Restores the packet's headers at `data` (and varies the source when asked).
/// Returns false when the packet is too short or the maps are missing.
#[inline(always)]
fn restore(data: usize, end: usize) -> bool {
    if data + BENCH_HEADER > end {
        return false;
    }
    let Some(saved) = RUNE_BENCH_PKT.get(0) else {
        return false;
    };
    let dst = data as *mut u64;
    // Word by word: a whole-array copy compiles to a call to a `memmove` subprogram,
    // which made the driver (subtracted from every figure) slower and noisier.
    for (i, word) in saved.iter().enumerate() {
        // SAFETY: `BENCH_HEADER` bytes from `data` are inside the packet (checked
        // above); unaligned stores are fine for packet memory on the JIT's
        // architectures.
        unsafe { dst.add(i).write_unaligned(*word) };
    }
    if RUNE_BENCH_VARY.get(0).is_some_and(|v| *v != 0)
        && let Some(seq) = RUNE_BENCH_SEQ.get_ptr_mut(0)
    {
        // The CPU in the top bits: a run can migrate between CPUs (test_run
        // reschedules), and the CPUs' sequences must not produce the same address.
        // SAFETY: a per-CPU slot from a successful lookup; the source address is at
        // 14 + 12, inside the restored headers.
        unsafe {
            *seq = (*seq).wrapping_add(1) & 0x0fff_ffff;
            let cpu = bpf_get_smp_processor_id();
            ((data + 26) as *mut u32).write_unaligned(*seq | (cpu << 28));
        }
    }
    true
}

/// XDP driver: restore, then tail-call the program under test. `XDP_ABORTED` when
/// the restore or the tail call fails (the benchmark checks the return code).
#[xdp]
pub fn rune_bench_xdp_driver(ctx: XdpContext) -> u32 {
    if restore(ctx.data(), ctx.data_end()) {
        // SAFETY: a tail call; on success it does not return.
        unsafe { RUNE_BENCH_XDP_JMP.tail_call(&ctx, 0) };
    }
    xdp_action::XDP_ABORTED
}

/// tc driver: as [`rune_bench_xdp_driver`]; -1 (`TC_ACT_UNSPEC`) on failure.
#[classifier]
pub fn rune_bench_tc_driver(ctx: TcContext) -> i32 {
    if restore(ctx.data(), ctx.data_end()) {
        // SAFETY: a tail call; on success it does not return.
        unsafe { RUNE_BENCH_TC_JMP.tail_call(&ctx, 0) };
    }
    -1
}

/// The no-op XDP target: measures the driver alone.
#[xdp]
pub fn rune_bench_xdp_noop(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// The no-op tc target: measures the driver alone.
#[classifier]
pub fn rune_bench_tc_noop(_ctx: TcContext) -> i32 {
    TC_ACT_OK as i32
}
