//! The policy verdict counters as Prometheus metrics (`rune_policy_*`, written by
//! the families every data plane shares), read from the kernel's per-CPU counters
//! at each scrape, and the rule counts.

use super::{
    maps::PolicyMaps,
    sync::{INGRESS, PolicySync},
};
use crate::policy::metrics::{self, Direction, DropReason};
use agent_common::policy::Verdict;
use prometheus_client::{
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, counter::ConstCounter},
};

/// Writes the shared policy families ([`metrics::encode`]) from the kernel's
/// counters, then `rune_policy_events_dropped_total`.
pub fn encode<P: PolicyMaps>(
    sync: &PolicySync<P>,
    encoder: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    let mut counts = metrics::VerdictCounts::new();
    for ((service, dir), counter) in sync.counters() {
        let found = match sync.maps().verdicts(*counter) {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, "reading the policy counters failed: left out of this scrape");
                continue;
            }
        };
        let direction = if *dir == INGRESS {
            Direction::Ingress
        } else {
            Direction::Egress
        };
        for verdict in Verdict::ALL {
            let n = found[verdict as usize];
            let entry = counts
                .entry((service.clone(), direction, shared(verdict)))
                .or_default();
            *entry = entry.wrapping_add(n);
        }
    }
    let rules = sync
        .services()
        .iter()
        .map(|(service, (rules, _, _))| (service.clone(), *rules))
        .collect();
    metrics::encode(encoder, &counts, &rules)?;
    if let Ok(drops) = sync.maps().event_drops() {
        let mut family = encoder.encode_descriptor(
            "policy_events_dropped",
            "Policy verdict events not written for `observe`, by reason",
            None,
            MetricType::Counter,
        )?;
        for (reason, n) in [("rate_limited", drops[0]), ("buffer_full", drops[1])] {
            ConstCounter::new(n).encode(family.encode_family(&[("reason", reason)])?)?;
        }
    }
    Ok(())
}

/// The kernel's verdict as the metrics name it (audit verdicts of every reason
/// are one `audit_would_drop`).
fn shared(verdict: Verdict) -> metrics::Verdict {
    match verdict {
        Verdict::Allow => metrics::Verdict::Allow,
        Verdict::DropNoMatchingRule => metrics::Verdict::Drop(DropReason::NoMatchingRule),
        Verdict::DropPortNotAllowed => metrics::Verdict::Drop(DropReason::PortNotAllowed),
        Verdict::DropUnprogrammable => metrics::Verdict::Drop(DropReason::PolicyUnprogrammable),
        Verdict::AuditNoMatchingRule
        | Verdict::AuditPortNotAllowed
        | Verdict::AuditUnprogrammable => metrics::Verdict::AuditWouldDrop,
    }
}
