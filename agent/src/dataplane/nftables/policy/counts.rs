//! The policy verdict counts read back from the table's named counters.

use crate::{
    model::ServiceKey,
    policy::metrics::{Direction, DropReason, Verdict, VerdictCounts},
};
use std::collections::BTreeMap;

/// Every verdict.
const ALL: [Verdict; 5] = [
    Verdict::Allow,
    Verdict::Drop(DropReason::PortNotAllowed),
    Verdict::Drop(DropReason::NoMatchingRule),
    Verdict::Drop(DropReason::PolicyUnprogrammable),
    Verdict::AuditWouldDrop,
];

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
        let key = ServiceKey::new(namespace, svc);
        // Every verdict of a service and direction with counters is shown, 0
        // when its mode has no counter for it.
        for v in ALL {
            out.entry((key.clone(), direction, v)).or_default();
        }
        *out.entry((key, direction, verdict)).or_default() += n;
    }
    out
}
