//! The eBPF data plane's policy state: the [`PolicyBook`] fed by the same deltas
//! as the load balancer, and the sync that writes its plan into the policy maps.

use super::{maps::PolicyMaps, sync::PolicySync};
use crate::{
    dataplane::ebpf::error::MapsError,
    endpoints::Delta,
    policy::{PolicyBook, PolicyState, ServicePolicyStatus},
};

/// The policy book and the policy maps' sync engine, applied together.
pub struct PolicyEngine<P> {
    /// The policies held (also what `status` shows of each).
    book: PolicyBook,
    sync: PolicySync<P>,
    /// Why the last write of the maps failed (the next apply writes again).
    failed: Option<String>,
    /// Whether the policy programs are attached anywhere (`--policy-interfaces`).
    attached: bool,
}

impl<P: PolicyMaps> PolicyEngine<P> {
    /// An engine for node `node_name` over `maps`; `attached` says whether the
    /// policy programs run on any interface.
    pub fn new(node_name: &str, maps: P, attached: bool) -> Self {
        Self {
            book: PolicyBook::new(node_name),
            sync: PolicySync::new(maps),
            failed: None,
            attached,
        }
    }

    /// Takes `delta` in and, when the plan changed (or the last write failed),
    /// writes what changed into the maps.
    pub fn apply(&mut self, delta: &Delta) -> Result<(), MapsError> {
        let change = self.book.apply(delta);
        let plan = self.book.plan();
        // A full delta, or a retry after a failed write, checks every address;
        // otherwise only the addresses the change names are written.
        let result = if delta.full || self.failed.is_some() {
            self.sync.apply(plan)
        } else if !change.is_empty() {
            self.sync.apply_change(plan, &change)
        } else {
            return Ok(());
        };
        self.written_result(result)
    }

    /// Records the outcome of a write of the maps.
    fn written_result(&mut self, result: Result<(), MapsError>) -> Result<(), MapsError> {
        match result {
            Ok(()) => {
                self.failed = None;
                for (service, (_, _, state)) in self.sync.services() {
                    if let PolicyState::Failed { reason } = state {
                        tracing::warn!(%service, %reason, "network policy not programmed: its guarded traffic is refused");
                    }
                }
                Ok(())
            }
            Err(e) => {
                self.failed = Some(e.to_string());
                Err(e)
            }
        }
    }

    /// The sync engine (its maps and counters).
    pub fn sync(&self) -> &PolicySync<P> {
        &self.sync
    }

    /// Each service with a policy as `status` shows it.
    pub fn statuses(&self) -> Vec<ServicePolicyStatus> {
        self.book
            .policies()
            .map(|(key, policy)| {
                let state = if !self.attached {
                    PolicyState::Partial {
                        reason: "not enforced: no --policy-interfaces, the eBPF policy programs run nowhere".into(),
                    }
                } else if let Some(reason) = &self.failed {
                    PolicyState::Failed {
                        reason: format!("writing the policy maps failed ({reason}); retried at the next sync"),
                    }
                } else {
                    self.sync
                        .services()
                        .get(key)
                        .map_or(PolicyState::Programmed, |(_, _, state)| state.clone())
                };
                ServicePolicyStatus {
                    service: key.to_string(),
                    mode: policy.mode,
                    ingress_rules: policy.ingress.len(),
                    egress_rules: policy.egress.len(),
                    state,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
