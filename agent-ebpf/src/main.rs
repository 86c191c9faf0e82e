//! The agent's eBPF programs, built for `bpfel-unknown-none` by `agent/build.rs` and
//! embedded in the agent binary.
//!
//! Program and map names are part of the contract with the loader in
//! `agent/src/dataplane/ebpf/`; they are spelled out in `agent-common`. Programs
//! only tests and benches load live in the second binary, `agent-ebpf-test`
//! (`src/test_programs/`).
#![no_std]
#![no_main]

mod maps;
mod nat;
mod policy;
mod select;
mod sock;
mod tc;
mod xdp;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects programs that could reach this; it is never called.
    loop {}
}

/// The program's license; GPL-compatible so it may call GPL-only helpers.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
