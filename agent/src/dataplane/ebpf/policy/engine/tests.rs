//! The policy engine fed by deltas, over fake maps: what it programs from a
//! Service's `networkPolicy` and what `status` says.

use super::PolicyEngine;
use crate::{
    dataplane::ebpf::policy::{
        fake::FakePolicyMaps,
        maps::{PolicyCapacity, endpoint_key},
    },
    endpoints::{Delta, EndpointCache},
    model::parse_documents,
    orderedlog::Snapshot,
    policy::{PolicyMode, PolicyState},
};
use agent_common::policy::{MODE_AUDIT, MODE_DENY_ALL, MODE_NONE};

const CAPACITY: PolicyCapacity = PolicyCapacity {
    endpoints: 16,
    peers: 16,
    ports: 16,
};

/// `web` with one endpoint on this node (`node-a`) and one elsewhere, and `policy`.
fn delta(policy: &str) -> Delta {
    let yaml = format!(
        "apiVersion: rune/v1
kind: Service
metadata: {{name: web}}
spec:
  ports: [{{name: http, port: 80, targetPort: 8080}}]
  discovery: {{vips: [198.18.100.10]}}
  networkPolicy: {policy}
---
apiVersion: rune/v1
kind: Endpoints
metadata: {{name: web}}
spec:
  endpoints:
    - {{address: 198.18.11.2, node: node-a, ready: true}}
    - {{address: 198.18.12.2, node: node-b, ready: true}}
"
    );
    let cache = EndpointCache::new();
    cache.apply_snapshot(&Snapshot {
        revision: 1,
        objects: parse_documents(&yaml).unwrap(),
    });
    Delta {
        revision: 1,
        full: true,
        upserted: cache.views(),
        removed: Vec::new(),
    }
}

#[test]
fn only_this_nodes_endpoints_are_guarded_and_status_counts_the_rules() {
    let mut engine = PolicyEngine::new("node-a", FakePolicyMaps::new(CAPACITY), true);
    engine
        .apply(&delta(
            "{mode: audit, ingress: [{from: [{cidr: 198.19.0.0/24}], ports: [http]}]}",
        ))
        .unwrap();
    let maps = engine.sync().maps();
    assert_eq!(maps.endpoints.len(), 1);
    let ep = maps.endpoints[&endpoint_key("198.18.11.2".parse().unwrap())];
    assert_eq!((ep.ingress.mode, ep.egress.mode), (MODE_AUDIT, MODE_NONE));
    let status = engine.statuses();
    assert_eq!(status.len(), 1);
    assert_eq!(status[0].service, "default/web");
    assert_eq!(status[0].mode, PolicyMode::Audit);
    assert_eq!((status[0].ingress_rules, status[0].egress_rules), (1, 0));
    assert_eq!(status[0].state, PolicyState::Programmed);
}

#[test]
fn without_policy_interfaces_status_says_nothing_is_enforced() {
    let mut engine = PolicyEngine::new("node-a", FakePolicyMaps::new(CAPACITY), false);
    engine
        .apply(&delta("{egress: [{to: [{cidr: 0.0.0.0/0}]}]}"))
        .unwrap();
    match &engine.statuses()[0].state {
        PolicyState::Partial { reason } => assert!(reason.contains("--policy-interfaces")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_policy_that_does_not_fit_is_deny_all_and_failed() {
    let tiny = PolicyCapacity {
        peers: 1,
        ..CAPACITY
    };
    let mut engine = PolicyEngine::new("node-a", FakePolicyMaps::new(tiny), true);
    engine
        .apply(&delta(
            "{ingress: [{from: [{cidr: 198.19.0.0/24}, {cidr: 198.20.0.0/24}]}]}",
        ))
        .unwrap();
    let ep = engine.sync().maps().endpoints[&endpoint_key("198.18.11.2".parse().unwrap())];
    assert_eq!(ep.ingress.mode, MODE_DENY_ALL);
    match &engine.statuses()[0].state {
        PolicyState::Failed { reason } => {
            assert!(reason.contains("--policy-max-entries"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // The policy goes: nothing is guarded any more.
    let mut gone = delta("null");
    gone.full = true;
    engine.apply(&gone).unwrap();
    assert!(engine.sync().maps().endpoints.is_empty());
    assert!(engine.statuses().is_empty());
}
