//! The agent's eBPF programs (filled in by the eBPF work).
#![no_std]
#![no_main]
