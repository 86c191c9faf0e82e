//! Network policy in the userspace proxies: a connection (or a UDP flow's first
//! datagram) through a VIP is checked against the ingress rules of the backend the
//! proxy picked, with the client's address and the backend's port, as the plan
//! states them. Traffic straight to an endpoint never passes the proxy, and egress
//! is not the proxy's to see: `status` reports policies as partial.

use crate::{
    lock::lock,
    model::{PolicyMode, Protocol},
    policy::{
        DirectionRules, PolicyBook, PolicyState, PortMatch, ServicePolicyStatus,
        metrics::{Direction, DropReason, Verdict, VerdictCounts},
    },
};
use prometheus_client::{collector::Collector, encoding::DescriptorEncoder};
use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex, RwLock},
};

/// What `status` says the proxies leave out.
pub const PARTIAL: &str = "userspace mode checks ingress through the VIPs only (at accept, or a \
                           UDP flow's first datagram); traffic straight to endpoint addresses \
                           and egress rules are not enforced";

/// The policy the proxies enforce and their verdict counts.
#[derive(Debug)]
pub struct PolicyGate {
    book: Mutex<PolicyBook>,
    /// The ingress rules of each guarded address, as the plan has them: patched
    /// per changed address, each entry shared with the checks reading it.
    ingress: RwLock<HashMap<IpAddr, Arc<DirectionRules>>>,
    counts: Mutex<VerdictCounts>,
}

impl Default for PolicyGate {
    fn default() -> Self {
        Self::new()
    }
}

impl PolicyGate {
    /// A gate with no policy yet. It guards the endpoints on every node: the
    /// proxy sends connections to any of them, and no other node checks traffic
    /// that came through this proxy.
    pub fn new() -> Self {
        Self {
            book: Mutex::new(PolicyBook::every_node()),
            ingress: RwLock::new(HashMap::new()),
            counts: Mutex::new(VerdictCounts::new()),
        }
    }

    /// Takes a delta in: the plan is updated by difference and only the guarded
    /// addresses it changed are replaced.
    pub fn apply(&self, delta: &crate::endpoints::Delta) {
        let mut book = lock(&self.book);
        let change = book.apply(delta);
        if change.addresses.is_empty() {
            return;
        }
        let plan = book.plan();
        let mut ingress = self
            .ingress
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for addr in &change.addresses {
            match plan.endpoints.get(addr).and_then(|g| g.ingress.clone()) {
                Some(rules) => ingress.insert(*addr, Arc::new(rules)),
                None => ingress.remove(addr),
            };
        }
    }

    /// Whether a connection from `client` to `backend` over `protocol` may go;
    /// counts the verdict when a policy guards the backend.
    pub fn admit(&self, client: IpAddr, backend: SocketAddr, protocol: Protocol) -> bool {
        let rules = self
            .ingress
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&backend.ip())
            .cloned();
        let Some(rules) = rules else {
            return true;
        };
        let port = PortMatch {
            protocol,
            port: backend.port(),
        };
        let mut peer_known = false;
        let mut allowed = false;
        for rule in &rules.rules {
            if rule.peers.iter().any(|net| net.contains(&client)) {
                peer_known = true;
                if rule.ports.is_empty() || rule.ports.contains(&port) {
                    allowed = true;
                    break;
                }
            }
        }
        let verdict = match (allowed, rules.mode) {
            (true, _) => Verdict::Allow,
            (false, PolicyMode::Audit) => Verdict::AuditWouldDrop,
            (false, PolicyMode::Enforce) if peer_known => Verdict::Drop(DropReason::PortNotAllowed),
            (false, PolicyMode::Enforce) => Verdict::Drop(DropReason::NoMatchingRule),
        };
        *lock(&self.counts)
            .entry((rules.service.clone(), Direction::Ingress, verdict))
            .or_default() += 1;
        !matches!(verdict, Verdict::Drop(_))
    }

    /// Each policy held, partially enforced.
    pub fn statuses(&self) -> Vec<ServicePolicyStatus> {
        lock(&self.book).statuses(PolicyState::Partial {
            reason: PARTIAL.to_owned(),
        })
    }
}

/// Exports the gate's verdict counts as the policy metric families.
#[derive(Debug)]
pub struct GateCollector(pub Arc<PolicyGate>);

impl Collector for GateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let rules = lock(&self.0.book).rule_counts();
        let counts = lock(&self.0.counts).clone();
        crate::policy::metrics::encode(&mut encoder, &counts, &rules)
    }
}

#[cfg(test)]
mod tests;
