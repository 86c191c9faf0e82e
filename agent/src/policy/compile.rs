//! The semantics of `networkPolicy`: every policy's rules resolved against the
//! services and endpoints into the [`PolicyPlan`] of one node.
//!
//! * Guarded addresses: the addresses of the endpoints (any state) of each service
//!   with a policy that run on this node. An endpoint that names no node counts as
//!   local: single-node and embedded setups leave `node` empty, and guarding an
//!   address this node does not host only checks traffic that passes through it
//!   against the same rules (fail closed rather than open).
//! * Peers: a CIDR as written; a service: the addresses of its endpoints on any
//!   node, in any state, as host prefixes, and its VIPs; a namespace: the same for
//!   every service in it. `from`/`to` empty: any address.
//! * Ingress ports resolve against the guarded endpoint, because they are checked
//!   after DNAT (VIP traffic) or on direct traffic alike: a service port (by
//!   number/protocol or name) becomes its target port with the endpoint's
//!   override; a number that is no service port stays as written.
//! * Egress ports are destination ports; towards a service peer, a number that is
//!   one of its service ports also allows that port's target ports on its
//!   endpoints (with overrides), so dialing its VIP and its endpoints both work.
//! * An address guarded by several policies gets the union of their rules per
//!   direction, enforced when any of them with rules in that direction enforces.
//!
//! Rules with the same ports are merged (their peers united) and rules that match
//! nothing are left out; the output depends only on the input.

use super::{
    PolicyPlan, PortMatch,
    contribution::{AddressRules, Contribution, RuleMap, merge},
};
use crate::{
    endpoints::ServiceView,
    model::{Endpoint, NetworkPolicy, Peer, PeerSelector, PortEntry, ServiceKey, ServiceSpec},
};
use ipnet::IpNet;
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    rc::Rc,
    sync::Arc,
};

/// Compiles the plan of node `node` from every service (with its endpoints).
pub fn compile(node: &str, views: &BTreeMap<ServiceKey, ServiceView>) -> PolicyPlan {
    compile_guarding(Some(node), views)
}

/// Compiles the plan guarding the endpoints on node `node`, or with `None` those
/// on every node (a proxy that sends connections to any node checks them all).
pub fn compile_guarding(
    node: Option<&str>,
    views: &BTreeMap<ServiceKey, ServiceView>,
) -> PolicyPlan {
    let mut peers = PeerResolver::new(views);
    let contributions: BTreeMap<&ServiceKey, Contribution> = views
        .iter()
        .filter_map(|(key, view)| Some((key, contribution(key, view, node, &mut peers)?)))
        .collect();
    let mut guards: BTreeMap<IpAddr, Vec<(&ServiceKey, &Contribution)>> = BTreeMap::new();
    for (key, c) in &contributions {
        for address in c.addresses.keys() {
            guards.entry(*address).or_default().push((*key, c));
        }
    }
    PolicyPlan {
        endpoints: guards
            .into_iter()
            .map(|(address, services)| (address, merge(address, services)))
            .collect(),
        services: contributions
            .iter()
            .map(|(key, c)| ((*key).clone(), c.rule_count))
            .collect(),
    }
}

/// What the policy of service `key` (`view`) adds to the plan of node `node`
/// (`None`: every node); `None` when the service has no policy.
pub fn contribution(
    key: &ServiceKey,
    view: &ServiceView,
    node: Option<&str>,
    peers: &mut PeerResolver<'_>,
) -> Option<Contribution> {
    let policy = view.service.spec.network_policy.as_ref()?;
    let local = local_endpoints(view, node);
    let egress = (!policy.egress.is_empty() && !local.is_empty())
        .then(|| Arc::new(egress_rules(policy, key, &view.service.spec, peers)));
    let addresses = local
        .into_iter()
        .map(|(address, endpoints)| {
            let ingress = (!policy.ingress.is_empty())
                .then(|| ingress_rules(policy, key, &view.service.spec, &endpoints, peers));
            let rules = AddressRules {
                ingress,
                egress: egress.clone(),
            };
            (address, rules)
        })
        .collect();
    Some(Contribution {
        rule_count: policy.ingress.len() + policy.egress.len(),
        mode: policy.mode,
        addresses,
    })
}

/// The endpoints of `view` on node `node` (or naming none; every endpoint when
/// `node` is `None`), by address.
fn local_endpoints<'v>(
    view: &'v ServiceView,
    node: Option<&str>,
) -> BTreeMap<IpAddr, Vec<&'v Endpoint>> {
    let mut out: BTreeMap<IpAddr, Vec<&Endpoint>> = BTreeMap::new();
    for e in view.endpoint_list() {
        if node.is_none_or(|node| e.node.is_empty() || *e.node == *node) {
            out.entry(e.address).or_default().push(e);
        }
    }
    out
}

/// The ingress rules of `policy` for one guarded address of its service (`spec`),
/// where `endpoints` (the service's endpoints at that address) listen.
fn ingress_rules(
    policy: &NetworkPolicy,
    key: &ServiceKey,
    spec: &ServiceSpec,
    endpoints: &[&Endpoint],
    peers: &mut PeerResolver<'_>,
) -> RuleMap {
    let mut out = RuleMap::new();
    for rule in &policy.ingress {
        let mut ports = BTreeSet::new();
        for text in &rule.ports {
            let Ok(entry) = PortEntry::parse(text, spec) else {
                continue; // refused at apply; an unknown entry allows nothing
            };
            let service_port = spec.ports.iter().find(|p| match &entry {
                PortEntry::Name(name) => p.name == *name,
                PortEntry::Number { port, protocol } => p.port == *port && p.protocol == *protocol,
            });
            match (service_port, &entry) {
                (Some(sp), _) => ports.extend(endpoints.iter().map(|e| PortMatch {
                    protocol: sp.protocol,
                    port: e.port_for(sp),
                })),
                (None, PortEntry::Number { port, protocol }) => {
                    ports.insert(PortMatch {
                        protocol: *protocol,
                        port: *port,
                    });
                }
                (None, PortEntry::Name(_)) => {}
            }
        }
        if !rule.ports.is_empty() && ports.is_empty() {
            continue;
        }
        let allowed = out.entry(ports).or_default();
        peers.extend_all(&rule.from, &key.namespace, allowed);
    }
    out
}

/// The egress rules of `policy` (service `key`), the same for each of its guarded
/// addresses.
fn egress_rules(
    policy: &NetworkPolicy,
    key: &ServiceKey,
    spec: &ServiceSpec,
    peers: &mut PeerResolver<'_>,
) -> RuleMap {
    let mut out = RuleMap::new();
    for rule in &policy.egress {
        let literal: BTreeSet<PortMatch> = rule
            .ports
            .iter()
            .filter_map(|text| match PortEntry::parse(text, spec) {
                Ok(PortEntry::Number { port, protocol }) => Some(PortMatch { protocol, port }),
                _ => None, // refused at apply; an unknown entry allows nothing
            })
            .collect();
        if !rule.ports.is_empty() && literal.is_empty() {
            continue;
        }
        if rule.to.is_empty() || literal.is_empty() {
            // Any destination, or every port: service ports add nothing.
            peers.extend_all(&rule.to, &key.namespace, out.entry(literal).or_default());
            continue;
        }
        for peer in &rule.to {
            match peer.selector(&key.namespace) {
                Some(PeerSelector::Cidr(net)) => {
                    out.entry(literal.clone()).or_default().insert(net);
                }
                Some(selector) => {
                    for view in peers.services(&selector) {
                        let ports = with_target_ports(&literal, view);
                        out.entry(ports)
                            .or_default()
                            .extend(peers.addresses(view).iter().copied());
                    }
                }
                None => {}
            }
        }
    }
    out
}

/// `literal` plus, for each of its ports that is a service port of `view`, that
/// port's target ports on `view`'s endpoints.
fn with_target_ports(literal: &BTreeSet<PortMatch>, view: &ServiceView) -> BTreeSet<PortMatch> {
    let mut ports = literal.clone();
    for sp in &view.service.spec.ports {
        if literal.contains(&PortMatch {
            protocol: sp.protocol,
            port: sp.port,
        }) {
            ports.insert(PortMatch {
                protocol: sp.protocol,
                port: sp.target(),
            });
            ports.extend(view.endpoint_list().iter().map(|e| PortMatch {
                protocol: sp.protocol,
                port: e.port_for(sp),
            }));
        }
    }
    ports
}

/// Resolves peers to addresses, indexing services by namespace once and each
/// service's addresses once per plan.
pub struct PeerResolver<'v> {
    views: &'v BTreeMap<ServiceKey, ServiceView>,
    by_namespace: HashMap<&'v str, Vec<&'v ServiceView>>,
    addresses: HashMap<&'v ServiceKey, Rc<BTreeSet<IpNet>>>,
}

impl<'v> PeerResolver<'v> {
    /// A resolver over `views`.
    pub fn new(views: &'v BTreeMap<ServiceKey, ServiceView>) -> Self {
        let mut by_namespace: HashMap<&str, Vec<&ServiceView>> = HashMap::new();
        for (key, view) in views {
            by_namespace.entry(&key.namespace).or_default().push(view);
        }
        Self {
            views,
            by_namespace,
            addresses: HashMap::new(),
        }
    }

    /// The services a service or namespace selector names (none for a CIDR).
    fn services(&self, selector: &PeerSelector) -> Vec<&'v ServiceView> {
        match selector {
            PeerSelector::Service { namespace, name } => self
                .views
                .get(&ServiceKey::new(namespace.as_str(), name.as_str()))
                .into_iter()
                .collect(),
            PeerSelector::Namespace(ns) => self
                .by_namespace
                .get(ns.as_str())
                .cloned()
                .unwrap_or_default(),
            PeerSelector::Cidr(_) => Vec::new(),
        }
    }

    /// The host prefixes of `view`'s endpoints and VIPs.
    fn addresses(&mut self, view: &'v ServiceView) -> Rc<BTreeSet<IpNet>> {
        let key = self.views.get_key_value(&view.key()).map(|(k, _)| k);
        let build = || -> Rc<BTreeSet<IpNet>> {
            let endpoints = view.endpoint_list().iter().map(|e| e.address);
            let vips = view.service.spec.discovery.vips.iter().copied();
            Rc::new(endpoints.chain(vips).map(IpNet::from).collect())
        };
        match key {
            Some(k) => self.addresses.entry(k).or_insert_with(build).clone(),
            None => build(),
        }
    }

    /// Adds the addresses of every peer in `list` (any address when it is empty)
    /// to `out`, service namespaces defaulting to `own_namespace`.
    fn extend_all(&mut self, list: &[Peer], own_namespace: &str, out: &mut BTreeSet<IpNet>) {
        if list.is_empty() {
            out.extend(["0.0.0.0/0", "::/0"].map(|n| n.parse::<IpNet>().expect("a prefix")));
            return;
        }
        for peer in list {
            match peer.selector(own_namespace) {
                Some(PeerSelector::Cidr(net)) => {
                    out.insert(net);
                }
                Some(selector) => {
                    for view in self.services(&selector) {
                        out.extend(self.addresses(view).iter().copied());
                    }
                }
                None => {}
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
