//! The test-only eBPF object: programs that tests and benches load and the agent
//! never does, kept out of the object embedded in the agent.
//!
//! It is the `agent-ebpf-test` binary of the `agent-ebpf` crate
//! (`agent-ebpf/src/test_programs/`), built beside the agent's own object by the
//! agent's build script (into `target/agent-ebpf-build/`) and by `cargo xtask
//! build-ebpf`:
//!
//! * [`XDP_PASS`] counts every packet and its bytes into [`XDP_STATS`] and passes it
//!   on: a veth peer's XDP program (see docs/testing.md, `XDP_TX` on a veth), the
//!   floor of the per-packet bench, a first attach test;
//! * the bench drivers ([`BENCH_XDP_DRIVER`], [`BENCH_TC_DRIVER`]) restore a packet's
//!   headers from [`BENCH_PKT`] and tail-call the program in their jump table (which
//!   may come from another object, e.g. the agent's), so `BPF_PROG_TEST_RUN` with
//!   `repeat` times the same packet every iteration; their no-op targets measure the
//!   drivers alone.

use std::path::{Path, PathBuf};

use agent_common::PacketStats;
use anyhow::{Context as _, bail};
use aya::{
    Ebpf,
    maps::PerCpuArray,
    programs::{Xdp, XdpMode, xdp::XdpLinkId},
};

/// The object's file name (a binary of `agent-ebpf`).
pub const OBJECT: &str = "agent-ebpf-test";

/// The XDP pass-through program that counts packets.
pub const XDP_PASS: &str = "rune_xdp_pass";
/// Its per-CPU `PacketStats` counters (one entry, index 0).
pub const XDP_STATS: &str = "RUNE_XDP_STATS";

/// The XDP bench driver: restore, then tail-call index 0 of [`BENCH_XDP_JMP`].
pub const BENCH_XDP_DRIVER: &str = "rune_bench_xdp_driver";
/// The tc bench driver: restore, then tail-call index 0 of [`BENCH_TC_JMP`].
pub const BENCH_TC_DRIVER: &str = "rune_bench_tc_driver";
/// The XDP no-op target (`XDP_PASS`): the driver alone.
pub const BENCH_XDP_NOOP: &str = "rune_bench_xdp_noop";
/// The tc no-op target (`TC_ACT_OK`): the driver alone.
pub const BENCH_TC_NOOP: &str = "rune_bench_tc_noop";
/// The XDP driver's jump table (one entry).
pub const BENCH_XDP_JMP: &str = "RUNE_BENCH_XDP_JMP";
/// The tc driver's jump table (one entry).
pub const BENCH_TC_JMP: &str = "RUNE_BENCH_TC_JMP";
/// The packet's first [`BENCH_HEADER`] bytes, which the drivers restore (index 0).
pub const BENCH_PKT: &str = "RUNE_BENCH_PKT";
/// Index 0 non-zero: every iteration a new flow (the IPv4 source address becomes a
/// per-CPU sequence number).
pub const BENCH_VARY: &str = "RUNE_BENCH_VARY";
/// Bytes the drivers restore (`BENCH_HEADER` in `agent-ebpf/src/test_programs/bench.rs`).
pub const BENCH_HEADER: usize = 64;

/// Where the agent's build script leaves the object: `target/agent-ebpf-build/`
/// (under `$CARGO_TARGET_DIR` when set).
pub fn object_path() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("agent-ebpf-build").join(OBJECT)
}

/// The object's bytes (from [`object_path`]); fails, saying what to do, when it was
/// not built.
pub fn object() -> anyhow::Result<Vec<u8>> {
    let path = object_path();
    match std::fs::read(&path) {
        Ok(bytes) if !bytes.is_empty() => Ok(bytes),
        Ok(_) | Err(_) => bail!(
            "the test eBPF programs are missing ({}): build the agent with its eBPF \
             programs first (`cargo build -p rune-agent`, not with AYA_BUILD_SKIP=1; \
             `cargo xtask test` does)",
            path.display()
        ),
    }
}

/// Loads the object ([`object`]) as it is: its maps are created, its programs not
/// loaded yet, nothing is pinned. Needs `CAP_BPF` (root in practice).
pub fn load() -> anyhow::Result<Ebpf> {
    let bytes = object()?;
    Ebpf::load(&bytes).with_context(|| format!("loading {}", object_path().display()))
}

/// Loads [`XDP_PASS`] (once) and attaches it to `interface` (resolved in the calling
/// thread's network namespace) in `mode`. It stays attached as long as `ebpf` lives,
/// or until detached through the returned id.
pub fn attach_xdp_pass(
    ebpf: &mut Ebpf,
    interface: &str,
    mode: XdpMode,
) -> anyhow::Result<XdpLinkId> {
    let program: &mut Xdp = ebpf
        .program_mut(XDP_PASS)
        .with_context(|| format!("no program {XDP_PASS} in the object"))?
        .try_into()?;
    match program.load() {
        Ok(()) | Err(aya::programs::ProgramError::AlreadyLoaded) => {}
        Err(e) => return Err(e).with_context(|| format!("loading {XDP_PASS}")),
    }
    program
        .attach(interface, mode)
        .with_context(|| format!("attaching {XDP_PASS} to {interface} ({mode:?})"))
}

/// [`XDP_PASS`]'s counters, summed over all CPUs.
pub fn xdp_pass_stats(ebpf: &Ebpf) -> anyhow::Result<PacketStats> {
    let map = ebpf
        .map(XDP_STATS)
        .with_context(|| format!("no map {XDP_STATS} in the object"))?;
    let array: PerCpuArray<_, PacketStats> = PerCpuArray::try_from(map)?;
    let per_cpu = array.get(&0, 0)?;
    Ok(per_cpu
        .iter()
        .fold(PacketStats::default(), |sum, cpu| sum.add(*cpu)))
}
