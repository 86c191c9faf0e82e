//! The policy metric families every data plane exports alike:
//! `rune_policy_drops_total{namespace,service,direction,reason}`,
//! `rune_policy_allows_total{namespace,service,direction}`,
//! `rune_policy_audit_would_drop_total{namespace,service,direction}` and
//! `rune_policy_rules{namespace,service}`.
//!
//! A data plane hands over its verdict counts per (service, direction, verdict) as
//! [`VerdictCounts`] and the plan's rule counts; [`encode`] writes the families
//! from a collector at scrape time.

use crate::model::ServiceKey;
use prometheus_client::{
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
};
use std::collections::BTreeMap;

/// Which way a packet went relative to the guarded endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// To it.
    Ingress,
    /// From it.
    Egress,
}

impl Direction {
    /// The `direction` label.
    pub fn label(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// Why a packet was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    /// No rule names its peer.
    NoMatchingRule,
    /// A rule names its peer, but not its port.
    PortNotAllowed,
    /// The policy could not be programmed: its guarded traffic is refused.
    PolicyUnprogrammable,
}

impl DropReason {
    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            DropReason::NoMatchingRule => "no_matching_rule",
            DropReason::PortNotAllowed => "port_not_allowed",
            DropReason::PolicyUnprogrammable => "policy_unprogrammable",
        }
    }
}

/// What happened to a packet (or connection) policy looked at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Verdict {
    /// A rule allowed it.
    Allow,
    /// It was dropped.
    Drop(DropReason),
    /// Audit mode: no rule allowed it, it passed anyway.
    AuditWouldDrop,
}

/// Verdict counts by (service, direction, verdict), as a data plane reads them.
pub type VerdictCounts = BTreeMap<(ServiceKey, Direction, Verdict), u64>;

/// Writes the four policy families: `counts` and each policy's rule count.
pub fn encode(
    encoder: &mut DescriptorEncoder,
    counts: &VerdictCounts,
    rules: &BTreeMap<ServiceKey, usize>,
) -> Result<(), std::fmt::Error> {
    let mut drops = encoder.encode_descriptor(
        "policy_drops",
        "Packets or connections network policy dropped, by service, direction and reason",
        None,
        MetricType::Counter,
    )?;
    for ((key, direction, verdict), n) in counts {
        if let Verdict::Drop(reason) = verdict {
            let labels = [
                ("namespace", key.namespace.as_str()),
                ("service", key.name.as_str()),
                ("direction", direction.label()),
                ("reason", reason.label()),
            ];
            ConstCounter::new(*n).encode(drops.encode_family(&labels)?)?;
        }
    }
    for (name, help, wanted) in [
        (
            "policy_allows",
            "Packets or connections a network policy rule allowed",
            Verdict::Allow,
        ),
        (
            "policy_audit_would_drop",
            "Packets or connections an audit-mode policy would have dropped (and let pass)",
            Verdict::AuditWouldDrop,
        ),
    ] {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for ((key, direction, verdict), n) in counts {
            if *verdict == wanted {
                let labels = [
                    ("namespace", key.namespace.as_str()),
                    ("service", key.name.as_str()),
                    ("direction", direction.label()),
                ];
                ConstCounter::new(*n).encode(family.encode_family(&labels)?)?;
            }
        }
    }
    let mut family = encoder.encode_descriptor(
        "policy_rules",
        "Rules (ingress and egress) of each service's network policy",
        None,
        MetricType::Gauge,
    )?;
    for (key, n) in rules {
        let labels = [
            ("namespace", key.namespace.as_str()),
            ("service", key.name.as_str()),
        ];
        ConstGauge::new(*n as i64).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
