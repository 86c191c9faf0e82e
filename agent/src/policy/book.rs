//! The desired state a policy plan is compiled from, kept up to date from the
//! endpoint cache's deltas by whichever data plane enforces policy.

use super::{
    PolicyPlan, PolicyState, ServicePolicyStatus,
    incremental::{Compiled, PlanChange},
};
use crate::{
    endpoints::{Delta, ServiceView},
    model::{NetworkPolicy, ServiceKey},
};
use std::collections::BTreeMap;

/// Every service (with its endpoints) as the last deltas left them, and the plan
/// they compile to, kept up to date by difference.
#[derive(Debug)]
pub struct PolicyBook {
    /// This node's name: endpoints naming it (or none) are guarded here; `None`:
    /// the endpoints on every node are.
    node_name: Option<String>,
    /// Every service, by key.
    views: BTreeMap<ServiceKey, ServiceView>,
    /// The plan and what it was merged from.
    compiled: Compiled,
}

impl PolicyBook {
    /// An empty book for node `node_name`.
    pub fn new(node_name: &str) -> Self {
        Self::guarding(Some(node_name.to_owned()))
    }

    /// An empty book whose plan guards the endpoints on every node: for a proxy,
    /// which sends a VIP's connections to endpoints anywhere and is the only place
    /// they are checked.
    pub fn every_node() -> Self {
        Self::guarding(None)
    }

    fn guarding(node_name: Option<String>) -> Self {
        Self {
            node_name,
            views: BTreeMap::new(),
            compiled: Compiled::default(),
        }
    }

    /// Takes `delta` in (a full one replaces everything and recompiles it all;
    /// otherwise only the policies the changed services can affect are
    /// recompiled) and tells what changed in the plan.
    pub fn apply(&mut self, delta: &Delta) -> PlanChange {
        let node = self.node_name.as_deref();
        if delta.full {
            self.views = delta
                .upserted
                .iter()
                .map(|v| (v.key(), v.clone()))
                .collect();
            return self.compiled.rebuild(node, &self.views);
        }
        let mut changed: BTreeMap<ServiceKey, Option<ServiceView>> = BTreeMap::new();
        for key in &delta.removed {
            let old = self.views.remove(key);
            changed.entry(key.clone()).or_insert(old);
        }
        for view in &delta.upserted {
            let key = view.key();
            let old = self.views.insert(key.clone(), view.clone());
            changed.entry(key).or_insert(old);
        }
        self.compiled.update(node, &self.views, &changed)
    }

    /// The plan of the services and endpoints held now.
    pub fn plan(&self) -> &PolicyPlan {
        self.compiled.plan()
    }

    /// Each policy held, by service.
    pub fn policies(&self) -> impl Iterator<Item = (&ServiceKey, &NetworkPolicy)> {
        self.views.iter().filter_map(|(key, view)| {
            view.service
                .spec
                .network_policy
                .as_ref()
                .map(|policy| (key, policy))
        })
    }

    /// Each policy's rule count (ingress and egress), as [`PolicyPlan::services`]
    /// has it, without compiling.
    pub fn rule_counts(&self) -> BTreeMap<ServiceKey, usize> {
        self.policies()
            .map(|(key, p)| (key.clone(), p.ingress.len() + p.egress.len()))
            .collect()
    }

    /// The `status` rows of every policy held, each in `state`.
    pub fn statuses(&self, state: PolicyState) -> Vec<ServicePolicyStatus> {
        self.policies()
            .map(|(key, p)| ServicePolicyStatus {
                service: key.to_string(),
                mode: p.mode,
                ingress_rules: p.ingress.len(),
                egress_rules: p.egress.len(),
                state: state.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
