//! Network policy in the userspace proxies: a connection (or a UDP flow's first
//! datagram) through a VIP is checked against the ingress rules of the backend the
//! proxy picked, with the client's address and the backend's port, as the plan
//! states them. Traffic straight to an endpoint never passes the proxy, and egress
//! is not the proxy's to see: `status` reports policies as partial.

use crate::{
    lock::lock,
    model::{PolicyMode, Protocol},
    policy::{
        PolicyBook, PolicyPlan, PolicyState, PortMatch, ServicePolicyStatus,
        metrics::{Direction, DropReason, Verdict, VerdictCounts},
    },
};
use prometheus_client::{collector::Collector, encoding::DescriptorEncoder};
use std::{
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
    plan: RwLock<Arc<PolicyPlan>>,
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
            plan: RwLock::new(Arc::new(PolicyPlan::default())),
            counts: Mutex::new(VerdictCounts::new()),
        }
    }

    /// Takes a delta in, recompiling the plan when it may have changed.
    pub fn apply(&self, delta: &crate::endpoints::Delta) {
        let mut book = lock(&self.book);
        if book.apply(delta) {
            let plan = Arc::new(book.plan());
            *self
                .plan
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = plan;
        }
    }

    /// Whether a connection from `client` to `backend` over `protocol` may go;
    /// counts the verdict when a policy guards the backend.
    pub fn admit(&self, client: IpAddr, backend: SocketAddr, protocol: Protocol) -> bool {
        let plan = self
            .plan
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let Some(rules) = plan
            .endpoints
            .get(&backend.ip())
            .and_then(|g| g.ingress.as_ref())
        else {
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
