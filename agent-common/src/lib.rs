//! Map keys, values and constants shared by the eBPF programs (`agent-ebpf`) and the
//! agent. `#![no_std]`, `#[repr(C)]` and padding-free, so both sides agree on layout.
#![no_std]
pub mod hash;
