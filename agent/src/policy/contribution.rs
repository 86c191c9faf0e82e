//! What one service's policy adds to each guarded address, and how the additions
//! of every policy guarding one address merge into its [`GuardedEndpoint`].
//!
//! A full compile and an incremental one both go through here: the plan of an
//! address is the merge of the contributions of the services guarding it, in key
//! order, so recompiling one service and re-merging only its addresses gives the
//! same plan as compiling everything.

use super::{DirectionRules, GuardedEndpoint, PolicyMode, PortMatch, Rule};
use crate::model::ServiceKey;
use ipnet::IpNet;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

/// Rules of one direction while they are gathered: allowed peers by port set.
pub type RuleMap = BTreeMap<BTreeSet<PortMatch>, BTreeSet<IpNet>>;

/// One service's policy resolved for this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Contribution {
    /// Rules in its ingress and egress lists (for `status`).
    pub rule_count: usize,
    /// Enforce or audit.
    pub mode: PolicyMode,
    /// Per guarded address of the service on this node: its ingress rules (`None`
    /// when the policy has no ingress rules) and its egress rules (the same for
    /// every address, shared).
    pub addresses: BTreeMap<IpAddr, AddressRules>,
}

/// One service's rules for one of its guarded addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddressRules {
    /// Packets to the address.
    pub ingress: Option<RuleMap>,
    /// Packets from the address.
    pub egress: Option<Arc<RuleMap>>,
}

/// The rules guarding one address: the merge of the contributions of
/// `services` (each `(key, contribution)`, in key order) at `address`.
pub fn merge<'c>(
    address: IpAddr,
    services: impl IntoIterator<Item = (&'c ServiceKey, &'c Contribution)>,
) -> GuardedEndpoint {
    let mut keys = BTreeSet::new();
    let mut ingress = Direction::default();
    let mut egress = Direction::default();
    for (key, c) in services {
        let Some(rules) = c.addresses.get(&address) else {
            continue;
        };
        keys.insert(key.clone());
        if let Some(r) = &rules.ingress {
            ingress.add(c.mode, key, r);
        }
        if let Some(r) = &rules.egress {
            egress.add(c.mode, key, r);
        }
    }
    GuardedEndpoint {
        services: keys,
        ingress: ingress.finish(),
        egress: egress.finish(),
    }
}

/// One direction of a guarded address while policies are added to it.
#[derive(Default)]
struct Direction {
    /// Mode and reporting service, once a policy with rules here was added.
    head: Option<(PolicyMode, ServiceKey)>,
    rules: RuleMap,
}

impl Direction {
    /// Adds the rules of a policy in `mode` of service `key` in this direction.
    fn add(&mut self, mode: PolicyMode, key: &ServiceKey, rules: &RuleMap) {
        match &mut self.head {
            None => self.head = Some((mode, key.clone())),
            Some((have, _)) => *have = (*have).min(mode),
        }
        for (ports, peers) in rules {
            match self.rules.get_mut(ports) {
                Some(have) => have.extend(peers.iter().copied()),
                None => {
                    self.rules.insert(ports.clone(), peers.clone());
                }
            }
        }
    }

    fn finish(self) -> Option<DirectionRules> {
        let (mode, service) = self.head?;
        let rules = self
            .rules
            .into_iter()
            .filter(|(_, peers)| !peers.is_empty())
            .map(|(ports, peers)| Rule { peers, ports })
            .collect();
        Some(DirectionRules {
            mode,
            service,
            rules,
        })
    }
}
