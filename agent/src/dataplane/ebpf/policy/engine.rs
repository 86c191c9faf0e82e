//! The eBPF data plane's policy state: the [`PolicyBook`] fed by the same deltas
//! as the load balancer, and the sync that writes its plan into the policy maps.

use super::{maps::PolicyMaps, sync::PolicySync};
use crate::{
    dataplane::ebpf::error::MapsError,
    endpoints::Delta,
    model::ServiceKey,
    policy::{PolicyBook, PolicyMode, PolicyPlan, PolicyState, ServicePolicyStatus},
};
use std::collections::BTreeMap;

/// What `status` shows of a policy as written: its mode and rule counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Written {
    mode: PolicyMode,
    ingress: usize,
    egress: usize,
}

/// The policy book and the policy maps' sync engine, applied together.
pub struct PolicyEngine<P> {
    book: PolicyBook,
    /// Each service's policy as written, for `status`.
    written: BTreeMap<ServiceKey, Written>,
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
            written: BTreeMap::new(),
            sync: PolicySync::new(maps),
            failed: None,
            attached,
        }
    }

    /// Takes `delta` in and, when the plan may have changed (or the last write
    /// failed), writes the new plan into the maps.
    pub fn apply(&mut self, delta: &Delta) -> Result<(), MapsError> {
        if delta.full {
            self.written.clear();
        }
        for key in &delta.removed {
            self.written.remove(key);
        }
        for view in &delta.upserted {
            match &view.service.spec.network_policy {
                Some(p) => {
                    let written = Written {
                        mode: p.mode,
                        ingress: p.ingress.len(),
                        egress: p.egress.len(),
                    };
                    self.written.insert(view.key(), written);
                }
                None => {
                    self.written.remove(&view.key());
                }
            }
        }
        if self.book.apply(delta) || self.failed.is_some() {
            let plan = self.book.plan();
            self.apply_plan(&plan)?;
        }
        Ok(())
    }

    /// Writes `plan` into the maps.
    pub fn apply_plan(&mut self, plan: &PolicyPlan) -> Result<(), MapsError> {
        match self.sync.apply(plan) {
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
        self.written
            .iter()
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
                    ingress_rules: policy.ingress,
                    egress_rules: policy.egress,
                    state,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
