//! Shared helpers for the end-to-end tests.

pub mod agent;
pub mod bpf;
pub mod cgroup;
pub mod dns;
pub mod modes;
pub mod netns;
pub mod packet;
pub mod prog_test_run;
pub mod topology;
pub mod vip;
