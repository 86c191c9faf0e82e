//! Shared helpers for the end-to-end tests.

pub mod agent;
pub mod cgroup;
pub mod dns;
pub mod netns;
