use super::compile;
use crate::{
    endpoints::ServiceView,
    model::{Object, PolicyMode, Protocol, ServiceKey, parse_documents},
    policy::{PolicyPlan, PortMatch, Rule},
};
use ipnet::IpNet;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

/// Every service of `yaml` with its endpoints (services without an Endpoints
/// object get none).
pub(crate) fn views(yaml: &str) -> BTreeMap<ServiceKey, ServiceView> {
    let mut out = BTreeMap::new();
    let objects = parse_documents(yaml).unwrap();
    for o in &objects {
        if let Object::Service(s) = o {
            out.insert(
                s.key(),
                ServiceView {
                    service: Arc::new(s.clone()),
                    endpoints: None,
                },
            );
        }
    }
    for o in objects {
        if let Object::Endpoints(e) = o {
            let key = ServiceKey::new(&e.metadata.namespace, &e.metadata.name);
            out.get_mut(&key).unwrap().endpoints = Some(Arc::new(e));
        }
    }
    out
}

/// A service `ns/name` with `ports` (flow YAML list), VIP `vip` (or none),
/// `policy` (flow YAML, or empty for none), and endpoints `eps` (flow YAML list).
pub(crate) fn service(
    ns: &str,
    name: &str,
    ports: &str,
    vip: &str,
    policy: &str,
    eps: &str,
) -> String {
    let vips = if vip.is_empty() {
        String::new()
    } else {
        format!("  discovery: {{vips: [\"{vip}\"]}}\n")
    };
    let policy = if policy.is_empty() {
        String::new()
    } else {
        format!("  networkPolicy: {policy}\n")
    };
    format!(
        "---\napiVersion: rune/v1\nkind: Service\nmetadata: {{namespace: {ns}, name: {name}}}\n\
         spec:\n  ports: {ports}\n{vips}{policy}---\napiVersion: rune/v1\nkind: Endpoints\n\
         metadata: {{namespace: {ns}, name: {name}}}\nspec: {{endpoints: {eps}}}\n"
    )
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn nets(list: &[&str]) -> BTreeSet<IpNet> {
    list.iter().map(|s| net(s)).collect()
}

fn tcp(port: u16) -> PortMatch {
    PortMatch {
        protocol: Protocol::Tcp,
        port,
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

const WEB_PORTS: &str =
    "[{name: http, port: 80, targetPort: 8080}, {name: dns, port: 53, protocol: UDP}]";

fn plan(yaml: &str) -> PolicyPlan {
    compile("node-a", &views(yaml))
}

#[test]
fn a_cidr_peer_guards_each_local_endpoint_and_only_those() {
    let yaml = service(
        "shop",
        "web",
        WEB_PORTS,
        "198.18.100.1",
        "{ingress: [{from: [{cidr: 198.18.1.2/32}]}]}",
        "[{address: 198.18.11.2, node: node-a}, {address: 198.18.12.2}, {address: 198.18.13.2, node: node-b}]",
    );
    let plan = plan(&yaml);
    assert_eq!(
        plan.services,
        BTreeMap::from([(ServiceKey::new("shop", "web"), 1)])
    );
    let guarded: Vec<IpAddr> = plan.endpoints.keys().copied().collect();
    assert_eq!(
        guarded,
        [ip("198.18.11.2"), ip("198.18.12.2")],
        "node-b's endpoint is not this node's"
    );
    let g = &plan.endpoints[&ip("198.18.11.2")];
    assert!(g.egress.is_none());
    let ingress = g.ingress.as_ref().unwrap();
    assert_eq!(ingress.mode, PolicyMode::Enforce);
    assert_eq!(ingress.service, ServiceKey::new("shop", "web"));
    assert_eq!(
        ingress.rules,
        [Rule {
            peers: nets(&["198.18.1.2/32"]),
            ports: BTreeSet::new()
        }]
    );
}

#[test]
fn ingress_ports_resolve_to_target_ports_with_overrides() {
    let yaml = service(
        "shop",
        "web",
        WEB_PORTS,
        "198.18.100.1",
        "{ingress: [{from: [{cidr: 198.18.1.0/24}], ports: [http, \"53/udp\", \"9000\"]}]}",
        "[{address: 198.18.11.2}, {address: 198.18.12.2, ports: {http: 8081}}]",
    );
    let plan = plan(&yaml);
    let ports = |a: &str| {
        plan.endpoints[&ip(a)].ingress.as_ref().unwrap().rules[0]
            .ports
            .clone()
    };
    let udp53 = PortMatch {
        protocol: Protocol::Udp,
        port: 53,
    };
    assert_eq!(
        ports("198.18.11.2"),
        BTreeSet::from([tcp(8080), tcp(9000), udp53])
    );
    assert_eq!(
        ports("198.18.12.2"),
        BTreeSet::from([tcp(8081), tcp(9000), udp53])
    );
}

#[test]
fn a_service_peer_is_its_endpoints_on_any_node_and_its_vips() {
    let mut yaml = service(
        "shop",
        "web",
        WEB_PORTS,
        "",
        "{ingress: [{from: [{service: api}, {service: ops, namespace: admin}]}]}",
        "[{address: 198.18.11.2}]",
    );
    yaml += &service(
        "shop",
        "api",
        "[{port: 80}]",
        "198.18.100.2",
        "",
        "[{address: 198.18.1.2, node: node-z, ready: false}, {address: \"fd00:1::2\", terminating: true}]",
    );
    yaml += &service(
        "admin",
        "ops",
        "[{port: 80}]",
        "",
        "",
        "[{address: 198.18.1.9}]",
    );
    yaml += &service(
        "shop",
        "other",
        "[{port: 80}]",
        "",
        "",
        "[{address: 198.18.1.3}]",
    );
    let plan = plan(&yaml);
    let rules = &plan.endpoints[&ip("198.18.11.2")]
        .ingress
        .as_ref()
        .unwrap()
        .rules;
    assert_eq!(rules.len(), 1);
    assert_eq!(
        rules[0].peers,
        nets(&[
            "198.18.1.2/32",
            "fd00:1::2/128",
            "198.18.100.2/32",
            "198.18.1.9/32"
        ])
    );
}

#[test]
fn a_namespace_peer_is_every_service_in_it() {
    let mut yaml = service(
        "shop",
        "web",
        WEB_PORTS,
        "",
        "{ingress: [{from: [{namespace: ops}]}]}",
        "[{address: 198.18.11.2}]",
    );
    yaml += &service(
        "ops",
        "a",
        "[{port: 80}]",
        "198.18.100.7",
        "",
        "[{address: 198.18.1.2}]",
    );
    yaml += &service(
        "ops",
        "b",
        "[{port: 80}]",
        "",
        "",
        "[{address: 198.18.1.3}]",
    );
    yaml += &service(
        "shop",
        "c",
        "[{port: 80}]",
        "",
        "",
        "[{address: 198.18.1.4}]",
    );
    let plan = plan(&yaml);
    let rules = &plan.endpoints[&ip("198.18.11.2")]
        .ingress
        .as_ref()
        .unwrap()
        .rules;
    assert_eq!(
        rules[0].peers,
        nets(&["198.18.1.2/32", "198.18.1.3/32", "198.18.100.7/32"])
    );
}

#[test]
fn a_peer_with_no_endpoints_matches_nothing_and_empty_from_matches_everything() {
    let yaml = service(
        "shop",
        "web",
        WEB_PORTS,
        "",
        "{ingress: [{from: [{service: ghost}]}], egress: [{ports: [\"53/udp\"]}]}",
        "[{address: 198.18.11.2}]",
    );
    let plan = plan(&yaml);
    let g = &plan.endpoints[&ip("198.18.11.2")];
    assert_eq!(
        g.ingress.as_ref().unwrap().rules,
        [],
        "nothing allowed: default deny"
    );
    let egress = &g.egress.as_ref().unwrap().rules;
    assert_eq!(egress.len(), 1);
    assert_eq!(egress[0].peers, nets(&["0.0.0.0/0", "::/0"]));
}

#[test]
fn egress_to_a_service_allows_its_vip_port_and_its_endpoints_target_ports() {
    let mut yaml = service(
        "shop",
        "web",
        WEB_PORTS,
        "",
        "{egress: [{to: [{service: db}, {cidr: 10.0.0.0/8}], ports: [\"5432\"]}]}",
        "[{address: 198.18.11.2}]",
    );
    yaml += &service(
        "shop",
        "db",
        "[{name: pg, port: 5432, targetPort: 15432}]",
        "198.18.100.9",
        "",
        "[{address: 198.18.12.2}, {address: 198.18.13.2, ports: {pg: 25432}}]",
    );
    let plan = plan(&yaml);
    let g = &plan.endpoints[&ip("198.18.11.2")];
    assert!(g.ingress.is_none());
    let rules = &g.egress.as_ref().unwrap().rules;
    assert_eq!(rules.len(), 2, "{rules:?}");
    assert!(rules.contains(&Rule {
        peers: nets(&["10.0.0.0/8"]),
        ports: BTreeSet::from([tcp(5432)])
    }));
    assert!(rules.contains(&Rule {
        peers: nets(&["198.18.100.9/32", "198.18.12.2/32", "198.18.13.2/32"]),
        ports: BTreeSet::from([tcp(5432), tcp(15432), tcp(25432)]),
    }));
}

#[test]
fn one_backend_behind_two_services_gets_the_union_and_enforce_wins() {
    let mut yaml = service(
        "shop",
        "a",
        "[{port: 80}]",
        "",
        "{mode: audit, ingress: [{from: [{cidr: 198.18.1.2/32}]}]}",
        "[{address: 198.18.11.2}]",
    );
    yaml += &service(
        "shop",
        "b",
        "[{port: 81}]",
        "",
        "{ingress: [{from: [{cidr: 198.18.1.3/32}], ports: [\"81\"]}]}",
        "[{address: 198.18.11.2}]",
    );
    yaml += &service(
        "shop",
        "c",
        "[{port: 82}]",
        "",
        "{mode: audit, egress: [{}]}",
        "[{address: 198.18.11.2}]",
    );
    let plan = plan(&yaml);
    let g = &plan.endpoints[&ip("198.18.11.2")];
    assert_eq!(g.services.len(), 3);
    let ingress = g.ingress.as_ref().unwrap();
    assert_eq!(ingress.mode, PolicyMode::Enforce);
    assert_eq!(ingress.service, ServiceKey::new("shop", "a"));
    assert_eq!(
        ingress.rules,
        [
            Rule {
                peers: nets(&["198.18.1.2/32"]),
                ports: BTreeSet::new()
            },
            Rule {
                peers: nets(&["198.18.1.3/32"]),
                ports: BTreeSet::from([tcp(81)])
            },
        ]
    );
    let egress = g.egress.as_ref().unwrap();
    assert_eq!(
        (egress.mode, &egress.service),
        (PolicyMode::Audit, &ServiceKey::new("shop", "c"))
    );
}

#[test]
fn rules_with_the_same_ports_merge_and_the_output_is_deterministic() {
    let yaml = service(
        "shop",
        "web",
        WEB_PORTS,
        "",
        "{ingress: [{from: [{cidr: 198.18.1.3/32}], ports: [http]}, {from: [{cidr: 198.18.1.2/32}], ports: [\"80\"]}]}",
        "[{address: 198.18.11.2}]",
    );
    let first = plan(&yaml);
    assert_eq!(first, plan(&yaml));
    let rules = &first.endpoints[&ip("198.18.11.2")]
        .ingress
        .as_ref()
        .unwrap()
        .rules;
    assert_eq!(
        rules,
        &[Rule {
            peers: nets(&["198.18.1.2/32", "198.18.1.3/32"]),
            ports: BTreeSet::from([tcp(8080)])
        }]
    );
}

#[test]
fn a_thousand_policies_with_ten_peers_each_compile() {
    let mut yaml = String::new();
    for i in 0..1000u32 {
        let peers: Vec<String> = (1..=10)
            .map(|p| format!("{{service: s{}}}", (i + p) % 1000))
            .collect();
        yaml += &service(
            "bench",
            &format!("s{i}"),
            "[{port: 80}]",
            "",
            &format!(
                "{{ingress: [{{from: [{}], ports: [\"80\"]}}], egress: [{{to: [{}]}}]}}",
                peers.join(", "),
                peers[0]
            ),
            &format!(
                "[{{address: 10.{}.{}.1}}, {{address: 10.{}.{}.2, node: node-b}}]",
                i / 256,
                i % 256,
                i / 256,
                i % 256
            ),
        );
    }
    let views = views(&yaml);
    let plan = compile("node-a", &views);
    assert_eq!(plan.services.len(), 1000);
    assert_eq!(plan.endpoints.len(), 1000);
    let g = &plan.endpoints[&ip("10.0.0.1")];
    assert_eq!(g.ingress.as_ref().unwrap().rules[0].peers.len(), 20);
}
