//! The plan kept up to date by difference: a change recompiles only the policies
//! it can affect and re-merges only the addresses they guard, and tells the data
//! planes which guarded addresses changed.
//!
//! A changed service affects: its own policy (spec or endpoints changed); when
//! what peers see of it changed (endpoints, VIPs, ports, or it came or went),
//! every policy naming it as a service peer or its namespace as a namespace
//! peer. Each affected policy's [`Contribution`] is recompiled; the addresses of
//! the old and new contributions that differ are re-merged from every service
//! guarding them (an address several policies guard gets the union of their
//! rules). The result equals [`super::compile::compile_guarding`] over the same
//! services (a unit test checks it over random change sequences).

use super::{
    GuardedEndpoint, PolicyPlan,
    compile::{PeerResolver, contribution},
    contribution::{Contribution, merge},
};
use crate::{
    endpoints::ServiceView,
    model::{PeerSelector, ServiceKey},
};
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

/// What one step changed in the plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanChange {
    /// Guarded addresses whose rules changed, came or went (look them up in the
    /// plan: absent means no longer guarded).
    pub addresses: BTreeSet<IpAddr>,
    /// Whether the services with a policy (or their rule counts) changed.
    pub services: bool,
}

impl PlanChange {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.addresses.is_empty() && !self.services
    }
}

/// The compiled plan with what it was merged from.
#[derive(Debug, Default)]
pub struct Compiled {
    /// The plan as the services held now compile.
    plan: PolicyPlan,
    /// Each policy's contribution, by service.
    contributions: BTreeMap<ServiceKey, Contribution>,
    /// Each guarded address's contributing services.
    guards: BTreeMap<IpAddr, BTreeSet<ServiceKey>>,
    /// Policies by the services they name as peers.
    by_peer_service: HashMap<ServiceKey, BTreeSet<ServiceKey>>,
    /// Policies by the namespaces they name as peers.
    by_peer_namespace: HashMap<String, BTreeSet<ServiceKey>>,
}

impl Compiled {
    /// The plan.
    pub fn plan(&self) -> &PolicyPlan {
        &self.plan
    }

    /// Compiles everything in `views` anew; every address of the old or new plan
    /// counts as changed.
    pub fn rebuild(
        &mut self,
        node: Option<&str>,
        views: &BTreeMap<ServiceKey, ServiceView>,
    ) -> PlanChange {
        let old = std::mem::take(self);
        let mut peers = PeerResolver::new(views);
        for (key, view) in views {
            self.index(key, view, true);
            if let Some(c) = contribution(key, view, node, &mut peers) {
                for address in c.addresses.keys() {
                    self.guards.entry(*address).or_default().insert(key.clone());
                }
                self.contributions.insert(key.clone(), c);
            }
        }
        self.plan = PolicyPlan {
            endpoints: self
                .guards
                .iter()
                .map(|(address, keys)| (*address, self.merge(*address, keys)))
                .collect(),
            services: self
                .contributions
                .iter()
                .map(|(key, c)| (key.clone(), c.rule_count))
                .collect(),
        };
        let mut addresses: BTreeSet<IpAddr> = old.plan.endpoints.keys().copied().collect();
        addresses.extend(self.plan.endpoints.keys().copied());
        PlanChange {
            addresses,
            services: old.plan.services != self.plan.services,
        }
    }

    /// Takes in that the services `changed` went from their `old` views (`None`:
    /// new) to what `views` holds now (absent: removed), recompiling what they
    /// affect.
    pub fn update(
        &mut self,
        node: Option<&str>,
        views: &BTreeMap<ServiceKey, ServiceView>,
        changed: &BTreeMap<ServiceKey, Option<ServiceView>>,
    ) -> PlanChange {
        let mut affected: BTreeSet<ServiceKey> = BTreeSet::new();
        let mut peer_changed: Vec<&ServiceKey> = Vec::new();
        for (key, old) in changed {
            let new = views.get(key);
            let had = old.as_ref().is_some_and(has_policy);
            let has = new.is_some_and(has_policy);
            // (A view without a policy has no index entries.)
            if let Some(old) = old {
                self.index(key, old, false);
            }
            if let Some(new) = new {
                self.index(key, new, true);
            }
            if had || has {
                affected.insert(key.clone());
            }
            if !same_to_peers(old.as_ref(), new) {
                peer_changed.push(key);
            }
        }
        for key in peer_changed {
            let by_service = self.by_peer_service.get(key).into_iter().flatten();
            let by_namespace = self
                .by_peer_namespace
                .get(&key.namespace)
                .into_iter()
                .flatten();
            affected.extend(by_service.chain(by_namespace).cloned());
        }
        let mut change = PlanChange::default();
        if affected.is_empty() {
            return change;
        }
        let mut peers = PeerResolver::new(views);
        let mut touched: BTreeSet<IpAddr> = BTreeSet::new();
        for key in &affected {
            let new = views
                .get(key)
                .and_then(|view| contribution(key, view, node, &mut peers));
            let old = self.contributions.remove(key);
            if old == new {
                if let Some(c) = old {
                    self.contributions.insert(key.clone(), c);
                }
                continue;
            }
            let old_addresses = old.iter().flat_map(|c| c.addresses.iter());
            for (address, rules) in old_addresses {
                if new.as_ref().and_then(|c| c.addresses.get(address)) != Some(rules)
                    || old.as_ref().map(|c| c.mode) != new.as_ref().map(|c| c.mode)
                {
                    touched.insert(*address);
                }
                let kept = new
                    .as_ref()
                    .is_some_and(|c| c.addresses.contains_key(address));
                if !kept && let Some(set) = self.guards.get_mut(address) {
                    set.remove(key);
                    if set.is_empty() {
                        self.guards.remove(address);
                    }
                }
            }
            let rule_count = new.as_ref().map(|c| c.rule_count);
            if rule_count != old.as_ref().map(|c| c.rule_count) {
                change.services = true;
                match rule_count {
                    Some(n) => self.plan.services.insert(key.clone(), n),
                    None => self.plan.services.remove(key),
                };
            }
            if let Some(c) = new {
                for (address, rules) in &c.addresses {
                    let before = old.as_ref().and_then(|o| o.addresses.get(address));
                    if before != Some(rules) || old.as_ref().map(|o| o.mode) != Some(c.mode) {
                        touched.insert(*address);
                    }
                    self.guards.entry(*address).or_default().insert(key.clone());
                }
                self.contributions.insert(key.clone(), c);
            }
        }
        for address in touched {
            let merged = self.guards.get(&address).map(|k| self.merge(address, k));
            let differs = match &merged {
                Some(m) => self.plan.endpoints.get(&address) != Some(m),
                None => self.plan.endpoints.contains_key(&address),
            };
            if !differs {
                continue;
            }
            match merged {
                Some(m) => self.plan.endpoints.insert(address, m),
                None => self.plan.endpoints.remove(&address),
            };
            change.addresses.insert(address);
        }
        change
    }

    /// Adds (`add`) or removes the peer index entries of `view`'s policy.
    fn index(&mut self, key: &ServiceKey, view: &ServiceView, add: bool) {
        let Some(policy) = &view.service.spec.network_policy else {
            return;
        };
        let from = policy.ingress.iter().flat_map(|r| &r.from);
        let to = policy.egress.iter().flat_map(|r| &r.to);
        for peer in from.chain(to) {
            match peer.selector(&key.namespace) {
                Some(PeerSelector::Service { namespace, name }) => {
                    edit(
                        &mut self.by_peer_service,
                        ServiceKey { namespace, name },
                        key,
                        add,
                    );
                }
                Some(PeerSelector::Namespace(ns)) => {
                    edit(&mut self.by_peer_namespace, ns, key, add);
                }
                Some(PeerSelector::Cidr(_)) | None => {}
            }
        }
    }

    /// The rules of `address`, merged from the contributions of `keys`.
    fn merge(&self, address: IpAddr, keys: &BTreeSet<ServiceKey>) -> GuardedEndpoint {
        let services = keys
            .iter()
            .filter_map(|k| self.contributions.get_key_value(k));
        merge(address, services)
    }
}

/// Adds `policy` to (or removes it from) the set of `index` under `at`.
fn edit<K: std::hash::Hash + Eq>(
    index: &mut HashMap<K, BTreeSet<ServiceKey>>,
    at: K,
    policy: &ServiceKey,
    add: bool,
) {
    if add {
        index.entry(at).or_default().insert(policy.clone());
    } else if let Some(set) = index.get_mut(&at) {
        set.remove(policy);
        if set.is_empty() {
            index.remove(&at);
        }
    }
}

fn has_policy(view: &ServiceView) -> bool {
    view.service.spec.network_policy.is_some()
}

/// Whether a policy naming the service as a peer resolves it the same in `old`
/// and `new`: same endpoints, VIPs and ports (and present in both or neither).
fn same_to_peers(old: Option<&ServiceView>, new: Option<&ServiceView>) -> bool {
    match (old, new) {
        (None, None) => true,
        (Some(a), Some(b)) => {
            a.endpoint_list() == b.endpoint_list()
                && a.service.spec.discovery.vips == b.service.spec.discovery.vips
                && a.service.spec.ports == b.service.spec.ports
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests;
