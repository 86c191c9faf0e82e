//! The desired state a policy plan is compiled from, kept up to date from the
//! endpoint cache's deltas by whichever data plane enforces policy.

use super::{PolicyPlan, PolicyState, ServicePolicyStatus, compile::compile_guarding};
use crate::{
    endpoints::{Delta, ServiceView},
    model::{NetworkPolicy, PeerSelector, ServiceKey},
};
use std::collections::{BTreeMap, HashSet};

/// Every service (with its endpoints) as the last deltas left them, and what the
/// policies among them refer to, so that a change no policy can see is told apart.
#[derive(Debug)]
pub struct PolicyBook {
    /// This node's name: endpoints naming it (or none) are guarded here; `None`:
    /// the endpoints on every node are.
    node_name: Option<String>,
    /// Every service, by key.
    views: BTreeMap<ServiceKey, ServiceView>,
    /// Services the policies name as peers.
    peer_services: HashSet<ServiceKey>,
    /// Namespaces the policies name as peers.
    peer_namespaces: HashSet<String>,
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
            peer_services: HashSet::new(),
            peer_namespaces: HashSet::new(),
        }
    }

    /// Takes `delta` in (a full one replaces everything) and tells whether the plan
    /// may have changed: false only when no changed service has or had a policy
    /// and none is a policy's peer (by name or namespace).
    pub fn apply(&mut self, delta: &Delta) -> bool {
        let mut changed = false;
        let mut policies_changed = false;
        if delta.full {
            changed = self.views.values().any(has_policy) || delta.upserted.iter().any(has_policy);
            policies_changed = true;
            self.views.clear();
        }
        for key in &delta.removed {
            if let Some(old) = self.views.remove(key) {
                policies_changed |= has_policy(&old);
                changed |= has_policy(&old) || self.is_peer(key);
            }
        }
        for view in &delta.upserted {
            let key = view.key();
            let had = self.views.get(&key).is_some_and(has_policy);
            let has = has_policy(view);
            policies_changed |= had || has;
            changed |= had || has || self.is_peer(&key);
            self.views.insert(key, view.clone());
        }
        if policies_changed {
            self.index_peers();
        }
        changed
    }

    /// The plan of the services and endpoints held now.
    pub fn plan(&self) -> PolicyPlan {
        compile_guarding(self.node_name.as_deref(), &self.views)
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

    fn is_peer(&self, key: &ServiceKey) -> bool {
        self.peer_services.contains(key) || self.peer_namespaces.contains(&key.namespace)
    }

    /// Rebuilds the peer index from the policies held.
    fn index_peers(&mut self) {
        self.peer_services.clear();
        self.peer_namespaces.clear();
        for (key, view) in &self.views {
            let Some(policy) = &view.service.spec.network_policy else {
                continue;
            };
            let from = policy.ingress.iter().flat_map(|r| &r.from);
            let to = policy.egress.iter().flat_map(|r| &r.to);
            for peer in from.chain(to) {
                match peer.selector(&key.namespace) {
                    Some(PeerSelector::Service { namespace, name }) => {
                        self.peer_services.insert(ServiceKey { namespace, name });
                    }
                    Some(PeerSelector::Namespace(ns)) => {
                        self.peer_namespaces.insert(ns);
                    }
                    Some(PeerSelector::Cidr(_)) | None => {}
                }
            }
        }
    }
}

fn has_policy(view: &ServiceView) -> bool {
    view.service.spec.network_policy.is_some()
}

#[cfg(test)]
mod tests;
