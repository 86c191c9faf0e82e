//! The incremental plan equals a full compile after every step of random change
//! sequences (seeded, bounded), and each step names every address that changed.

use crate::{
    endpoints::{Delta, ServiceView},
    model::ServiceKey,
    policy::{
        PolicyBook, PolicyPlan,
        compile::{
            compile, compile_guarding,
            tests::{service, views},
        },
    },
};
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::collections::BTreeMap;

const NAMESPACES: [&str; 2] = ["a", "b"];
const NAMES: [&str; 4] = ["s0", "s1", "s2", "s3"];
const ADDRESSES: [&str; 6] = [
    "198.18.0.1",
    "198.18.0.2",
    "198.18.0.3",
    "198.18.0.4",
    "\"fd00::1\"",
    "\"fd00::2\"",
];
const CIDRS: [&str; 3] = ["198.18.0.0/24", "10.0.0.0/8", "\"fd00::/64\""];
const PORTS: [&str; 4] = ["http", "\"80\"", "\"53/udp\"", "\"8080\""];

fn pick<'a>(rng: &mut StdRng, from: &[&'a str]) -> &'a str {
    from[rng.random_range(0..from.len())]
}

/// A random rule: peer list under `peers_key` (flow YAML) and ports from `ports_from`.
fn rule(rng: &mut StdRng, peers_key: &str, ports_from: &[&str]) -> String {
    let mut peers = Vec::new();
    for _ in 0..rng.random_range(0..3) {
        peers.push(match rng.random_range(0..4) {
            0 => format!("{{cidr: {}}}", pick(rng, &CIDRS)),
            1 => format!("{{namespace: {}}}", pick(rng, &NAMESPACES)),
            2 => format!("{{service: {}}}", pick(rng, &NAMES)),
            _ => format!(
                "{{service: {}, namespace: {}}}",
                pick(rng, &NAMES),
                pick(rng, &NAMESPACES)
            ),
        });
    }
    let mut ports = std::collections::BTreeSet::new();
    for _ in 0..rng.random_range(0..3) {
        ports.insert(pick(rng, ports_from));
    }
    let ports: Vec<&str> = ports.into_iter().collect();
    format!(
        "{{{peers_key}: [{}], ports: [{}]}}",
        peers.join(", "),
        ports.join(", ")
    )
}

/// Service `ns/name` in a random version, as YAML with its endpoints.
fn random_service(rng: &mut StdRng, ns: &str, name: &str) -> String {
    let ports = if rng.random_bool(0.5) {
        "[{name: http, port: 80, targetPort: 8080}]"
    } else {
        "[{name: http, port: 80}, {name: dns, port: 53, protocol: UDP}]"
    };
    let vip = if rng.random_bool(0.5) {
        format!("198.19.0.{}", rng.random_range(1..4))
    } else {
        String::new()
    };
    let policy = if rng.random_bool(0.6) {
        let mode = if rng.random_bool(0.3) {
            "audit"
        } else {
            "enforce"
        };
        let ingress: Vec<String> = (0..rng.random_range(0..3))
            .map(|_| rule(rng, "from", &PORTS))
            .collect();
        let egress: Vec<String> = (0..rng.random_range(0..2))
            .map(|_| rule(rng, "to", &PORTS[1..]))
            .collect();
        format!(
            "{{mode: {mode}, ingress: [{}], egress: [{}]}}",
            ingress.join(", "),
            egress.join(", ")
        )
    } else {
        String::new()
    };
    let mut eps = Vec::new();
    for address in ADDRESSES {
        if !rng.random_bool(0.3) {
            continue;
        }
        let node = pick(rng, &["node-a", "node-b", ""]);
        let node = if node.is_empty() {
            String::new()
        } else {
            format!(", node: {node}")
        };
        let ports = if rng.random_bool(0.2) {
            ", ports: {http: 9090}"
        } else {
            ""
        };
        eps.push(format!("{{address: {address}{node}{ports}}}"));
    }
    let eps = format!("[{}]", eps.join(", "));
    service(ns, name, ports, &vip, &policy, &eps)
}

/// The addresses where `a` and `b` differ.
fn differing(a: &PolicyPlan, b: &PolicyPlan) -> Vec<std::net::IpAddr> {
    let mut out: Vec<_> = a
        .endpoints
        .keys()
        .chain(b.endpoints.keys())
        .filter(|k| a.endpoints.get(k) != b.endpoints.get(k))
        .copied()
        .collect();
    out.sort();
    out.dedup();
    out
}

fn run(seed: u64, node: Option<&str>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut book = match node {
        Some(n) => PolicyBook::new(n),
        None => PolicyBook::every_node(),
    };
    let mut held: BTreeMap<ServiceKey, ServiceView> = BTreeMap::new();
    for step in 0..40 {
        let before = book.plan().clone();
        let full = step == 0 || rng.random_bool(0.05);
        let mut delta = Delta {
            revision: Default::default(),
            full,
            upserted: Vec::new(),
            removed: Vec::new(),
        };
        // A delta names each service once, upserted or removed.
        let mut named = std::collections::BTreeSet::new();
        for _ in 0..rng.random_range(1..4) {
            let key = ServiceKey::new(pick(&mut rng, &NAMESPACES), pick(&mut rng, &NAMES));
            if !named.insert(key.clone()) {
                continue;
            }
            if rng.random_bool(0.2) {
                held.remove(&key);
                delta.removed.push(key);
            } else {
                let yaml = random_service(&mut rng, &key.namespace, &key.name);
                let view = views(&yaml).remove(&key).expect("the service parses");
                held.insert(key, view.clone());
                delta.upserted.push(view);
            }
        }
        if full {
            delta.upserted = held.values().cloned().collect();
            delta.removed.clear();
        }
        let change = book.apply(&delta);
        let want = match node {
            Some(n) => compile(n, &held),
            None => compile_guarding(None, &held),
        };
        assert_eq!(*book.plan(), want, "seed {seed} step {step}: plan");
        for address in differing(&before, &want) {
            assert!(
                change.addresses.contains(&address),
                "seed {seed} step {step}: {address} changed unannounced"
            );
        }
        assert_eq!(
            change.services,
            before.services != want.services,
            "seed {seed} step {step}: services"
        );
    }
}

#[test]
fn the_incremental_plan_equals_a_full_compile_after_every_step() {
    for seed in 0..40 {
        run(seed, Some("node-a"));
    }
}

#[test]
fn the_incremental_plan_guarding_every_node_equals_a_full_compile() {
    for seed in 100..120 {
        run(seed, None);
    }
}
