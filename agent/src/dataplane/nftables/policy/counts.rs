//! The policy verdict counts read back from the table's named counters.

use crate::{
    model::ServiceKey,
    policy::metrics::{Direction, DropReason, Verdict, VerdictCounts},
};
use std::collections::BTreeMap;

/// The verdict counts in named counters `packets` (`pc-DIR-KIND-NS/NAME` →
/// packets), for the policy metrics.
pub fn verdict_counts(packets: &BTreeMap<String, u64>) -> VerdictCounts {
    let mut out = VerdictCounts::new();
    for (name, n) in packets {
        let Some(rest) = name.strip_prefix("pc-") else {
            continue;
        };
        let Some((d, rest)) = rest.split_once('-') else {
            continue;
        };
        let Some((kind, service)) = rest.split_once('-') else {
            continue;
        };
        let Some((namespace, svc)) = service.split_once('/') else {
            continue;
        };
        let direction = match d {
            "in" => Direction::Ingress,
            "out" => Direction::Egress,
            _ => continue,
        };
        let verdict = match kind {
            "allow" => Verdict::Allow,
            "port" => Verdict::Drop(DropReason::PortNotAllowed),
            "nomatch" => Verdict::Drop(DropReason::NoMatchingRule),
            "unprog" => Verdict::Drop(DropReason::PolicyUnprogrammable),
            "audit" => Verdict::AuditWouldDrop,
            _ => continue,
        };
        *out.entry((ServiceKey::new(namespace, svc), direction, verdict))
            .or_default() += n;
    }
    out
}
