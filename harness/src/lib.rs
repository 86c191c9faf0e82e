//! The one harness of rune-agent's end-to-end tests (`tests/`), the agent crate's
//! privileged unit tests and `cargo xtask bench`.
//!
//! Every guard here makes a uniquely named thing (`rune-<tag>-<pid>-<n>`) and removes
//! it on drop, also when a test panics; nothing touches the root network namespace,
//! the default pin directory or the machine's root cgroup.
//!
//! | module | what |
//! |---|---|
//! | [`netns`] | network namespaces, veth pairs, entering a namespace, [`netns::require_root`] |
//! | [`topology`] | client ─ node ─ backends in namespaces, with echo servers |
//! | [`cluster`] | several nodes on a bridge, a pod each, relays to etcd |
//! | [`bpffs`] | bpffs detection and mounting, private pin directories |
//! | [`cgroup`] | cgroup v2 children for socket-LB tests |
//! | [`agent`] | the `rune-agent` process, its CLI, metrics and readiness |
//! | [`etcd`] | a real etcd on loopback (TLS optional), its outages, a cuttable relay |
//! | [`nginx`] | Debian's nginx as a child process, configured under one directory |
//! | [`packet`] | hand-built frames with valid checksums, and their parser |
//! | [`prog_test_run`] | `BPF_PROG_TEST_RUN` on a loaded program |
//! | [`test_programs`] | the test-only eBPF object (`rune_xdp_pass`, bench drivers) |
//!
//! It does not depend on the agent crate: xtask uses it, and xtask must build before
//! `cargo xtask setup` has installed the eBPF toolchain the agent's build needs.

pub mod agent;
pub mod bpffs;
pub mod cgroup;
pub mod cluster;
pub mod etcd;
pub mod netns;
pub mod nginx;
pub mod packet;
pub mod prog_test_run;
pub mod test_programs;
pub mod topology;
