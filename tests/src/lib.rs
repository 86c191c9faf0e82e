//! Helpers for the end-to-end tests that know the agent (its modes, VIP scenarios,
//! map layouts, DNS); everything generic (namespaces, topology, pins, cgroups, the
//! agent process, packets, `BPF_PROG_TEST_RUN`) is in `rune-harness`, shared with
//! `cargo xtask bench`.

pub mod dns;
pub mod grpc;
pub mod http;
pub mod ingress;
pub mod maps;
pub mod modes;
pub mod nginx;
pub mod observe;
pub mod pebble;
pub mod vip;
pub mod wire;
