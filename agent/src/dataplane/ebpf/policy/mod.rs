//! Network policy in the eBPF data plane: the compiled [`crate::policy::PolicyPlan`]
//! written into the policy maps that `rune_tc_policy_to` / `rune_tc_policy_from`
//! read (layouts and decision order: `agent_common::policy`; design:
//! docs/policy-ebpf.md).
//!
//! [`table`] puts a plan into the maps' shape (peer prefixes with merged ports),
//! [`store`] keeps the rule and port sets in the maps content-addressed,
//! [`sync::PolicySync`] writes it by difference over [`maps::PolicyMaps`] (the
//! kernel's, or a fake in tests; a change writes only the addresses it names),
//! [`engine::PolicyEngine`] feeds it from the endpoint cache's deltas through a
//! `PolicyBook`, [`collector`] exports the
//! verdict counters.

pub mod collector;
pub mod engine;
pub mod events;
#[cfg(test)]
pub mod fake;
pub mod maps;
pub mod store;
pub mod sync;
pub mod table;

#[cfg(test)]
mod tests;

pub use engine::PolicyEngine;
pub use maps::{KernelPolicyMaps, POLICY_MAPS, PolicyCapacity, PolicyMaps};
pub use sync::PolicySync;
