use super::{Direction, DropReason, Verdict, VerdictCounts, encode};
use crate::model::ServiceKey;
use prometheus_client::{collector::Collector, encoding::DescriptorEncoder, registry::Registry};
use std::collections::BTreeMap;

#[derive(Debug)]
struct Fixed(VerdictCounts, BTreeMap<ServiceKey, usize>);

impl Collector for Fixed {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        encode(&mut encoder, &self.0, &self.1)
    }
}

#[test]
fn the_families_carry_the_documented_names_and_labels() {
    let web = ServiceKey::new("shop", "web");
    let counts = VerdictCounts::from([
        ((web.clone(), Direction::Ingress, Verdict::Allow), 5),
        (
            (
                web.clone(),
                Direction::Ingress,
                Verdict::Drop(DropReason::PortNotAllowed),
            ),
            2,
        ),
        (
            (
                web.clone(),
                Direction::Egress,
                Verdict::Drop(DropReason::PolicyUnprogrammable),
            ),
            1,
        ),
        ((web.clone(), Direction::Egress, Verdict::AuditWouldDrop), 3),
    ]);
    let mut registry = Registry::with_prefix("rune");
    registry.register_collector(Box::new(Fixed(counts, BTreeMap::from([(web, 4)]))));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for line in [
        "rune_policy_allows_total{namespace=\"shop\",service=\"web\",direction=\"ingress\"} 5",
        "rune_policy_drops_total{namespace=\"shop\",service=\"web\",direction=\"ingress\",reason=\"port_not_allowed\"} 2",
        "rune_policy_drops_total{namespace=\"shop\",service=\"web\",direction=\"egress\",reason=\"policy_unprogrammable\"} 1",
        "rune_policy_audit_would_drop_total{namespace=\"shop\",service=\"web\",direction=\"egress\"} 3",
        "rune_policy_rules{namespace=\"shop\",service=\"web\"} 4",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line} in\n{text}");
    }
}
