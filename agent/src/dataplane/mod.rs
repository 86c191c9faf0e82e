//! (to be written)
pub mod ebpf;
