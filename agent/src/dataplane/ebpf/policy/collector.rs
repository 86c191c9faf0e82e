//! The policy verdict counters as Prometheus metrics (`rune_policy_*`), read from
//! the kernel's per-CPU counters at each scrape, and the rule counts.

use super::{
    maps::PolicyMaps,
    sync::{INGRESS, PolicySync},
};
use agent_common::policy::Verdict;
use prometheus_client::{
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
};

/// Writes `rune_policy_allows_total`, `rune_policy_drops_total`,
/// `rune_policy_audit_would_drop_total` and `rune_policy_rules` for every service
/// with a policy.
pub fn encode<P: PolicyMaps>(
    sync: &PolicySync<P>,
    encoder: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    let mut rows = Vec::new();
    for ((service, dir), counter) in sync.counters() {
        match sync.maps().verdicts(*counter) {
            Ok(counts) => rows.push((service, *dir, counts)),
            Err(e) => {
                tracing::warn!(error = %e, "reading the policy counters failed: left out of this scrape");
            }
        }
    }
    let direction = |dir: u8| if dir == INGRESS { "ingress" } else { "egress" };
    let mut family = encoder.encode_descriptor(
        "policy_allows",
        "New flows (and packets without ports) a network policy allowed",
        None,
        MetricType::Counter,
    )?;
    for (service, dir, counts) in &rows {
        let labels = [
            ("namespace", service.namespace.as_str()),
            ("service", service.name.as_str()),
            ("direction", direction(*dir)),
        ];
        ConstCounter::new(counts[Verdict::Allow as usize])
            .encode(family.encode_family(&labels)?)?;
    }
    let mut family = encoder.encode_descriptor(
        "policy_drops",
        "Packets a network policy dropped, by reason",
        None,
        MetricType::Counter,
    )?;
    for (service, dir, counts) in &rows {
        for verdict in Verdict::ALL.into_iter().filter(|v| v.dropped()) {
            let labels = [
                ("namespace", service.namespace.as_str()),
                ("service", service.name.as_str()),
                ("direction", direction(*dir)),
                ("reason", verdict.reason().unwrap_or_default()),
            ];
            ConstCounter::new(counts[verdict as usize]).encode(family.encode_family(&labels)?)?;
        }
    }
    let mut family = encoder.encode_descriptor(
        "policy_audit_would_drop",
        "New flows an audit-mode network policy would have dropped",
        None,
        MetricType::Counter,
    )?;
    for (service, dir, counts) in &rows {
        let labels = [
            ("namespace", service.namespace.as_str()),
            ("service", service.name.as_str()),
            ("direction", direction(*dir)),
        ];
        let audit = [
            Verdict::AuditNoMatchingRule,
            Verdict::AuditPortNotAllowed,
            Verdict::AuditUnprogrammable,
        ]
        .iter()
        .fold(0u64, |sum, v| sum.wrapping_add(counts[*v as usize]));
        ConstCounter::new(audit).encode(family.encode_family(&labels)?)?;
    }
    let mut family = encoder.encode_descriptor(
        "policy_rules",
        "Rules in each service's network policy",
        None,
        MetricType::Gauge,
    )?;
    for (service, (rules, _, _)) in sync.services() {
        let labels = [
            ("namespace", service.namespace.as_str()),
            ("service", service.name.as_str()),
        ];
        ConstGauge::new(i64::try_from(*rules).unwrap_or(i64::MAX))
            .encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}
