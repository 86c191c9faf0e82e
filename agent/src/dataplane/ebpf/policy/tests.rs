//! The policy sync over fake maps: what it writes, what it shares, how it fails
//! closed, and what a restarted engine adopts.

use super::{
    fake::FakePolicyMaps,
    maps::{PolicyCapacity, endpoint_key},
    sync::PolicySync,
};
use crate::{
    model::{Protocol, ServiceKey},
    policy::{
        DirectionRules, GuardedEndpoint, PlanChange, PolicyMode, PolicyPlan, PolicyState,
        PortMatch, Rule,
    },
};
use agent_common::policy::{MODE_AUDIT, MODE_DENY_ALL, MODE_ENFORCE, MODE_NONE};
use std::net::IpAddr;

const CAPACITY: PolicyCapacity = PolicyCapacity {
    endpoints: 64,
    peers: 64,
    ports: 64,
};

fn svc(name: &str) -> ServiceKey {
    ServiceKey::new("default", name)
}

fn rules(peers: &[&str], ports: &[u16], mode: PolicyMode, service: &str) -> DirectionRules {
    DirectionRules {
        mode,
        service: svc(service),
        rules: vec![Rule {
            peers: peers.iter().map(|p| p.parse().unwrap()).collect(),
            ports: ports
                .iter()
                .map(|port| PortMatch {
                    protocol: Protocol::Tcp,
                    port: *port,
                })
                .collect(),
        }],
    }
}

/// `web`'s two endpoints guarded by one ingress rule, `api`'s one by another.
fn plan(web_peers: &[&str]) -> PolicyPlan {
    let mut plan = PolicyPlan::default();
    for (addr, service, peers) in [
        ("198.18.1.2", "web", web_peers),
        ("198.18.1.3", "web", web_peers),
        ("198.18.2.2", "api", &["198.18.0.0/16"][..]),
    ] {
        plan.endpoints.insert(
            addr.parse().unwrap(),
            GuardedEndpoint {
                services: [svc(service)].into(),
                ingress: Some(rules(peers, &[8080], PolicyMode::Enforce, service)),
                egress: None,
            },
        );
        plan.services.insert(svc(service), 1);
    }
    plan
}

fn ep(sync: &PolicySync<FakePolicyMaps>, addr: &str) -> agent_common::policy::EndpointPolicy {
    sync.maps().endpoints[&endpoint_key(addr.parse::<IpAddr>().unwrap())]
}

#[test]
fn identical_rules_share_one_rule_set_and_a_change_swaps_it_whole() {
    let mut sync = PolicySync::new(FakePolicyMaps::new(CAPACITY));
    sync.apply(&plan(&["198.19.0.10/32"])).unwrap();
    let (a, b) = (ep(&sync, "198.18.1.2"), ep(&sync, "198.18.1.3"));
    assert_eq!(a.ingress.rules, b.ingress.rules);
    assert_eq!(a.ingress.mode, MODE_ENFORCE);
    assert_eq!(a.egress.mode, MODE_NONE);
    assert_ne!(a.ingress.rules, ep(&sync, "198.18.2.2").ingress.rules);
    // Two rule sets of one peer each; one port set (both allow 8080/tcp).
    assert_eq!(sync.maps().peers.len(), 2);
    assert_eq!(sync.maps().ports.len(), 1);

    // Unchanged plan: nothing written.
    let before = sync.maps().writes.len();
    sync.apply(&plan(&["198.19.0.10/32"])).unwrap();
    assert_eq!(sync.maps().writes.len(), before);

    // web's peers change: the new set is written before the addresses switch, the
    // old one removed after; api's entries are untouched.
    sync.apply(&plan(&["198.19.0.11/32"])).unwrap();
    let writes = &sync.maps().writes[before..];
    let new_rules = ep(&sync, "198.18.1.2").ingress.rules;
    assert_ne!(new_rules, a.ingress.rules);
    assert_eq!(
        writes,
        [
            format!("peer {new_rules} 198.19.0.11/32"),
            "endpoint 33624774".to_owned(),
            "endpoint 50401990".to_owned(),
            format!("-peer {} 198.19.0.10/32", a.ingress.rules),
        ]
    );
    assert!(matches!(
        sync.services()[&svc("web")].2,
        PolicyState::Programmed
    ));
}

#[test]
fn a_rule_set_that_does_not_fit_denies_its_addresses_and_says_why() {
    let small = PolicyCapacity {
        peers: 2,
        ..CAPACITY
    };
    let mut sync = PolicySync::new(FakePolicyMaps::new(small));
    sync.apply(&plan(&["198.19.0.10/32", "198.19.0.11/32"]))
        .unwrap();
    // api's set (one prefix) is first in table order and fits; web's does not.
    let web = ep(&sync, "198.18.1.2");
    assert_eq!(web.ingress.mode, MODE_DENY_ALL);
    assert_eq!(ep(&sync, "198.18.2.2").ingress.mode, MODE_ENFORCE);
    match &sync.services()[&svc("web")].2 {
        PolicyState::Failed { reason } => {
            assert!(reason.contains("RUNE_POL_PEER4"), "{reason}");
            assert!(reason.contains("--policy-max-entries"), "{reason}");
        }
        other => panic!("web: {other:?}"),
    }
    assert_eq!(sync.services()[&svc("api")].2, PolicyState::Programmed);
}

#[test]
fn a_table_that_fits_once_the_old_one_is_gone_is_programmed_in_the_same_apply() {
    let small = PolicyCapacity {
        peers: 3,
        ..CAPACITY
    };
    let mut sync = PolicySync::new(FakePolicyMaps::new(small));
    sync.apply(&plan(&["198.19.0.10/32", "198.19.0.11/32"]))
        .unwrap();
    sync.apply(&plan(&["198.19.0.12/32", "198.19.0.13/32"]))
        .unwrap();
    assert_eq!(ep(&sync, "198.18.1.2").ingress.mode, MODE_ENFORCE);
    assert_eq!(sync.maps().peers.len(), 3);
    assert_eq!(sync.services()[&svc("web")].2, PolicyState::Programmed);
}

#[test]
fn audit_mode_and_a_restarted_engine_adopts_ids_and_counters() {
    let mut p = plan(&["198.19.0.10/32"]);
    for guarded in p.endpoints.values_mut() {
        if let Some(ingress) = &mut guarded.ingress {
            ingress.mode = PolicyMode::Audit;
        }
    }
    let mut sync = PolicySync::new(FakePolicyMaps::new(CAPACITY));
    sync.apply(&p).unwrap();
    let before = ep(&sync, "198.18.1.2");
    assert_eq!(before.ingress.mode, MODE_AUDIT);

    let mut maps = sync.maps().clone();
    maps.writes.clear();
    let mut restarted = PolicySync::new(maps);
    restarted.apply(&p).unwrap();
    assert!(
        restarted.maps().writes.is_empty(),
        "{:?}",
        restarted.maps().writes
    );
    assert_eq!(ep(&restarted, "198.18.1.2"), before);
    assert_eq!(
        restarted.counters()[&(svc("web"), super::sync::INGRESS)],
        before.ingress.counter
    );
}

#[test]
fn an_empty_plan_removes_everything() {
    let mut sync = PolicySync::new(FakePolicyMaps::new(CAPACITY));
    sync.apply(&plan(&["198.19.0.10/32"])).unwrap();
    sync.apply(&PolicyPlan::default()).unwrap();
    let maps = sync.maps();
    assert!(maps.endpoints.is_empty() && maps.peers.is_empty() && maps.ports.is_empty());
    assert!(sync.services().is_empty());
}

/// The maps' content without ids: each guarded address's directions as (mode,
/// peer prefixes of its rule set), the peer and port entry counts.
fn content(sync: &PolicySync<FakePolicyMaps>) -> (Vec<String>, usize, usize) {
    let maps = sync.maps();
    let nets = |rules: u32| -> Vec<String> {
        maps.peers
            .keys()
            .filter(|e| e.rules == rules)
            .map(|e| e.net.to_string())
            .collect()
    };
    let endpoints = maps
        .endpoints
        .iter()
        .map(|(k, v)| {
            format!(
                "{k:?}: {} {:?} / {} {:?}",
                v.ingress.mode,
                nets(v.ingress.rules),
                v.egress.mode,
                nets(v.egress.rules)
            )
        })
        .collect();
    (endpoints, maps.peers.len(), maps.ports.len())
}

#[test]
fn a_change_written_by_address_leaves_the_maps_as_a_full_apply_would() {
    let before = plan(&["198.19.0.10/32"]);
    // web's peers change and api's address goes.
    let mut after = plan(&["198.19.0.11/32", "198.19.0.12/32"]);
    let api: IpAddr = "198.18.2.2".parse().unwrap();
    after.endpoints.remove(&api);
    after.services.remove(&svc("api"));
    let mut sync = PolicySync::new(FakePolicyMaps::new(CAPACITY));
    sync.apply(&before).unwrap();
    let change = PlanChange {
        addresses: ["198.18.1.2", "198.18.1.3", "198.18.2.2"]
            .map(|a| a.parse().unwrap())
            .into(),
        services: true,
    };
    sync.apply_change(&after, &change).unwrap();
    let mut fresh = PolicySync::new(FakePolicyMaps::new(CAPACITY));
    fresh.apply(&after).unwrap();
    assert_eq!(content(&sync), content(&fresh));
    assert_eq!(sync.services(), fresh.services());
    // A change naming nothing writes nothing.
    let writes = sync.maps().writes.len();
    sync.apply_change(&after, &PlanChange::default()).unwrap();
    assert_eq!(sync.maps().writes.len(), writes);
}
