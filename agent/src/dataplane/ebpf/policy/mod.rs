//! Network policy in the eBPF data plane: the compiled [`crate::policy::PolicyPlan`]
//! written into the policy maps that `rune_tc_policy_to` / `rune_tc_policy_from`
//! read (layouts and decision order: `agent_common::policy`; design:
//! docs/policy-ebpf.md).
//!
//! [`table`] puts a plan into the maps' shape (peer prefixes with merged ports),
//! [`sync::PolicySync`] writes it by difference over [`maps::PolicyMaps`] (the
//! kernel's, or a fake in tests).

pub mod collector;
#[cfg(test)]
pub mod fake;
pub mod maps;
pub mod sync;
pub mod table;

#[cfg(test)]
mod tests;

pub use maps::{KernelPolicyMaps, POLICY_MAPS, PolicyCapacity, PolicyMaps};
pub use sync::PolicySync;

/// Each service with a policy as `status` shows it.
pub fn statuses<P: PolicyMaps>(sync: &PolicySync<P>) -> Vec<crate::policy::ServicePolicyStatus> {
    sync.services()
        .iter()
        .map(
            |(service, (rules, mode, state))| crate::policy::ServicePolicyStatus {
                service: service.to_string(),
                mode: *mode,
                ingress_rules: *rules,
                egress_rules: 0,
                state: state.clone(),
            },
        )
        .collect()
}
