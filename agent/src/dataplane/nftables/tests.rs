//! Unit tests of the ruleset builder: desired table from deltas, and the commands one
//! change produces (no kernel, no `nft`).

use super::ruleset::{ElementKey, ElementOp, ElementValue, Existing, Plan, Ruleset, TABLE};
use crate::{
    endpoints::{Delta, ServiceView},
    model::{Object, Protocol, ServiceKey, parse_documents},
};
use std::sync::Arc;

/// A service `name` with one TCP port 80 → 8080 and `extra` spec fields, and
/// `endpoints` (YAML flow mappings), or no Endpoints object when `None`.
fn view_with(name: &str, vips: &str, extra: &str, endpoints: Option<&[&str]>) -> ServiceView {
    let mut yaml = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: 80, targetPort: 8080}}], discovery: {{vips: [{vips}]}}{extra}}}\n"
    );
    if let Some(eps) = endpoints {
        yaml.push_str(&format!(
            "---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\nspec: {{endpoints: [{}]}}\n",
            eps.join(", ")
        ));
    }
    let mut objects = parse_documents(&yaml).expect("valid objects").into_iter();
    let Some(Object::Service(s)) = objects.next() else {
        panic!("a service");
    };
    let endpoints = objects.next().map(|o| match o {
        Object::Endpoints(e) => Arc::new(e),
        _ => panic!("endpoints"),
    });
    ServiceView {
        service: Arc::new(s),
        endpoints,
    }
}

fn view(name: &str, vip: &str, addrs: &[&str]) -> ServiceView {
    let eps: Vec<String> = addrs.iter().map(|a| format!("{{address: {a}}}")).collect();
    let eps: Vec<&str> = eps.iter().map(String::as_str).collect();
    view_with(name, vip, "", Some(&eps))
}

fn delta(full: bool, upserted: Vec<ServiceView>, removed: Vec<ServiceKey>) -> Delta {
    Delta {
        revision: 1,
        full,
        upserted,
        removed,
    }
}

/// The transaction of a change (not a full delta) that upserts `view` into `rs`.
fn plan_change(rs: &Ruleset, view: ServiceView) -> Plan {
    rs.plan(&delta(false, vec![view], vec![]), &Existing::default())
}

/// Applies a full delta of `views` to a fresh ruleset.
fn programmed(views: Vec<ServiceView>) -> Ruleset {
    let mut rs = Ruleset::new("node-a");
    let plan = rs.plan(&delta(true, views, vec![]), &Existing::default());
    rs.commit(plan);
    rs
}

#[test]
fn full_delta_builds_maps_elements_and_one_shared_chain_per_backend_count() {
    let rs = Ruleset::new("node-a");
    let plan = rs.plan(
        &delta(
            true,
            vec![
                view("web", "198.18.100.10", &["198.18.1.2", "198.18.1.3"]),
                view("api", "198.18.100.11", &["198.18.1.4", "198.18.1.5"]),
                view("v6", "\"fd00:100::10\"", &["\"fd00:1::2\""]),
            ],
            vec![],
        ),
        &Existing::default(),
    );
    let s = &plan.script;
    assert!(s.starts_with(&format!("add table {TABLE}\n")), "{s}");
    assert!(s.contains("add chain inet rune nat-prerouting { type nat hook prerouting"));
    assert!(s.contains("add chain inet rune nat-output { type nat hook output"));
    // Two services with two backends share one chain; no chain per service.
    assert!(
        s.contains(
            "add chain inet rune pick4-2\n\
             add rule inet rune pick4-2 dnat ip to ip daddr . tcp dport . numgen random mod 2 map @backends4-tcp\n\
             add rule inet rune pick4-2 dnat ip to ip daddr . udp dport . numgen random mod 2 map @backends4-udp\n"
        ),
        "{s}"
    );
    assert!(
        s.contains(
            "add rule inet rune pick6-1 dnat ip6 to ip6 daddr . tcp dport . numgen random mod 1 map @backends6-tcp\n"
        ),
        "{s}"
    );
    assert_eq!(s.matches("add chain inet rune pick").count(), 2, "{s}");
    assert!(!s.contains("svc4-") && !s.contains("svc6-"), "{s}");
    assert!(s.contains("add element inet rune service-vips { 198.18.100.10 . tcp . 80 : goto pick4-2, 198.18.100.11 . tcp . 80 : goto pick4-2 }"), "{s}");
    assert!(
        s.contains(
            "add element inet rune service-vips6 { fd00:100::10 . tcp . 80 : goto pick6-1 }"
        ),
        "{s}"
    );
    assert!(s.contains("add element inet rune backends4-tcp { 198.18.100.10 . 80 . 0 : 198.18.1.2 . 8080, 198.18.100.10 . 80 . 1 : 198.18.1.3 . 8080, 198.18.100.11 . 80 . 0 : 198.18.1.4 . 8080, 198.18.100.11 . 80 . 1 : 198.18.1.5 . 8080 }"), "{s}");
    assert!(
        s.contains(
            "add element inet rune backends6-tcp { fd00:100::10 . 80 . 0 : fd00:1::2 . 8080 }"
        ),
        "{s}"
    );
    // Maps and chains exist before the elements that name them.
    let chain = s.find("add chain inet rune pick4-2").expect("chain");
    let element = s
        .find("add element inet rune service-vips ")
        .expect("element");
    assert!(chain < element, "{s}");
    // Nothing is ever said about another table, and nothing deleted on a fresh one.
    assert!(s.lines().all(|l| l.contains(" inet rune")), "{s}");
    assert!(!s.contains("delete") && !s.contains("flush"), "{s}");
}

#[test]
fn only_ready_non_terminating_endpoints_get_new_flows() {
    let rs = programmed(vec![view_with(
        "web",
        "198.18.100.10",
        "",
        Some(&[
            "{address: 198.18.1.2}",
            "{address: 198.18.1.3, terminating: true}",
            "{address: 198.18.1.4, ready: false}",
        ]),
    )]);
    let o = rs
        .service(&ServiceKey::new("default", "web"))
        .expect("programmed");
    let elements: Vec<(&str, String, String)> = o
        .elements
        .iter()
        .map(|((map, key), value)| (*map, key.to_string(), value.to_string()))
        .collect();
    assert_eq!(
        elements,
        vec![
            (
                "backends4-tcp",
                "198.18.100.10 . 80 . 0".to_owned(),
                "198.18.1.2 . 8080".to_owned()
            ),
            (
                "service-vips",
                "198.18.100.10 . tcp . 80".to_owned(),
                "goto pick4-1".to_owned()
            ),
        ]
    );
    assert!(o.chains.is_empty());
}

#[test]
fn empty_and_unknown_endpoints_refuse_and_local_only_filters() {
    let empty = view_with("empty", "198.18.100.11", "", Some(&[]));
    let unknown = view_with("unknown", "198.18.100.12", "", None);
    let local = view_with(
        "local",
        "198.18.100.13",
        "",
        Some(&["{address: 198.18.1.2, node: node-b}"]),
    );
    let mut local = local;
    Arc::make_mut(&mut local.service)
        .spec
        .discovery
        .locality_preference = crate::model::LocalityPreference::LocalOnly;
    let rs = Ruleset::new("node-a");
    let plan = rs.plan(
        &delta(true, vec![empty, unknown, local], vec![]),
        &Existing::default(),
    );
    assert!(plan.script.contains("add element inet rune no-endpoints { 198.18.100.11 . tcp . 80 : goto reject-service, 198.18.100.12 . tcp . 80 : goto reject-service, 198.18.100.13 . tcp . 80 : goto reject-service }"), "{}", plan.script);
    assert!(!plan.script.contains("svc4-"), "{}", plan.script);
}

#[test]
fn client_ip_affinity_gives_each_endpoint_a_timed_set_of_clients() {
    let rs = programmed(vec![view_with(
        "sticky",
        "198.18.100.10",
        ", sessionAffinity: {type: ClientIP, timeoutSeconds: 60}",
        Some(&["{address: 198.18.1.2}", "{address: 198.18.1.3}"]),
    )]);
    let o = rs
        .service(&ServiceKey::new("default", "sticky"))
        .expect("programmed");
    assert_eq!(
        o.sets["aff4-default/sticky/tcp/80/198.18.1.2/8080"],
        "{ type ipv4_addr; flags dynamic,timeout; timeout 60s; }"
    );
    assert_eq!(
        o.chains["ep4-default/sticky/tcp/80/198.18.1.3/8080"],
        vec![
            "update @aff4-default/sticky/tcp/80/198.18.1.3/8080 { ip saddr } meta l4proto tcp dnat ip to 198.18.1.3:8080"
        ]
    );
    assert_eq!(
        o.chains["svc4-default/sticky/tcp/80"],
        vec![
            "counter",
            "ip saddr @aff4-default/sticky/tcp/80/198.18.1.2/8080 goto ep4-default/sticky/tcp/80/198.18.1.2/8080",
            "ip saddr @aff4-default/sticky/tcp/80/198.18.1.3/8080 goto ep4-default/sticky/tcp/80/198.18.1.3/8080",
            "numgen random mod 2 0 goto ep4-default/sticky/tcp/80/198.18.1.2/8080",
            "goto ep4-default/sticky/tcp/80/198.18.1.3/8080",
        ]
    );
}

/// Service `shared` (port `http` 80 → 8080 on 198.18.100.10, `extra` spec fields)
/// with two endpoints on 198.18.1.2 (ports 8081 and 8082) and one on 198.18.1.3.
fn shared_address(extra: &str) -> ServiceView {
    let yaml = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: shared}}\nspec: {{ports: [{{name: http, port: 80, targetPort: 8080}}], discovery: {{vips: [198.18.100.10]}}{extra}}}\n---\n\
         apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: shared}}\nspec: {{endpoints: [{{address: 198.18.1.2, ports: {{http: 8081}}}}, {{address: 198.18.1.2, ports: {{http: 8082}}}}, {{address: 198.18.1.3}}]}}\n"
    );
    let mut objects = parse_documents(&yaml).expect("valid objects").into_iter();
    let (Some(Object::Service(s)), Some(Object::Endpoints(e))) = (objects.next(), objects.next())
    else {
        panic!("a service and its endpoints");
    };
    ServiceView {
        service: Arc::new(s),
        endpoints: Some(Arc::new(e)),
    }
}

/// Endpoints sharing an address are separate DNAT targets, and with ClientIP
/// affinity each has its own set of clients and chain (named by address and port).
#[test]
fn endpoints_sharing_an_address_are_separate_targets_and_affinity_sets() {
    let rs = programmed(vec![shared_address("")]);
    let o = rs
        .service(&ServiceKey::new("default", "shared"))
        .expect("programmed");
    let targets: Vec<String> = o
        .elements
        .iter()
        .filter(|((map, _), _)| *map == "backends4-tcp")
        .map(|((_, key), value)| format!("{key} : {value}"))
        .collect();
    assert_eq!(
        targets,
        [
            "198.18.100.10 . 80 . 0 : 198.18.1.2 . 8081",
            "198.18.100.10 . 80 . 1 : 198.18.1.2 . 8082",
            "198.18.100.10 . 80 . 2 : 198.18.1.3 . 8080",
        ]
    );

    let rs = programmed(vec![shared_address(
        ", sessionAffinity: {type: ClientIP, timeoutSeconds: 60}",
    )]);
    let o = rs
        .service(&ServiceKey::new("default", "shared"))
        .expect("programmed");
    let sets: Vec<&str> = o.sets.keys().map(String::as_str).collect();
    assert_eq!(
        sets,
        [
            "aff4-default/shared/tcp/80/198.18.1.2/8081",
            "aff4-default/shared/tcp/80/198.18.1.2/8082",
            "aff4-default/shared/tcp/80/198.18.1.3/8080",
        ]
    );
    assert_eq!(
        o.chains["ep4-default/shared/tcp/80/198.18.1.2/8082"],
        vec![
            "update @aff4-default/shared/tcp/80/198.18.1.2/8082 { ip saddr } meta l4proto tcp dnat ip to 198.18.1.2:8082"
        ]
    );
}

#[test]
fn one_endpoint_change_rewrites_only_that_service() {
    let mut rs = programmed(vec![
        view("a", "198.18.100.10", &["198.18.1.2", "198.18.1.3"]),
        view("b", "198.18.100.11", &["198.18.1.2", "198.18.1.3"]),
    ]);
    let plan = plan_change(
        &rs,
        view("a", "198.18.100.10", &["198.18.1.2", "198.18.1.4"]),
    );
    // Only the changed backend's element: no chain, no rule, nothing of b.
    assert_eq!(
        plan.script,
        "delete element inet rune backends4-tcp { 198.18.100.10 . 80 . 1 }\n\
         add element inet rune backends4-tcp { 198.18.100.10 . 80 . 1 : 198.18.1.4 . 8080 }\n"
    );
    rs.commit(plan);
    // A new backend count: the service's elements, and the pick chain it first needs.
    let plan = plan_change(
        &rs,
        view(
            "a",
            "198.18.100.10",
            &["198.18.1.2", "198.18.1.4", "198.18.1.6"],
        ),
    );
    assert_eq!(
        plan.script,
        "delete element inet rune service-vips { 198.18.100.10 . tcp . 80 }\n\
         add chain inet rune pick4-3\n\
         add rule inet rune pick4-3 dnat ip to ip daddr . tcp dport . numgen random mod 3 map @backends4-tcp\n\
         add rule inet rune pick4-3 dnat ip to ip daddr . udp dport . numgen random mod 3 map @backends4-udp\n\
         add element inet rune backends4-tcp { 198.18.100.10 . 80 . 2 : 198.18.1.6 . 8080 }\n\
         add element inet rune service-vips { 198.18.100.10 . tcp . 80 : goto pick4-3 }\n"
    );
    rs.commit(plan);
    // Back to two: the pick chain made before stays (shared), nothing else new.
    let plan = plan_change(
        &rs,
        view("a", "198.18.100.10", &["198.18.1.2", "198.18.1.4"]),
    );
    assert_eq!(
        plan.script,
        "delete element inet rune backends4-tcp { 198.18.100.10 . 80 . 2 }\n\
         delete element inet rune service-vips { 198.18.100.10 . tcp . 80 }\n\
         add element inet rune service-vips { 198.18.100.10 . tcp . 80 : goto pick4-2 }\n"
    );
    rs.commit(plan);
    // The same state again: nothing to do.
    let again = plan_change(
        &rs,
        view("a", "198.18.100.10", &["198.18.1.2", "198.18.1.4"]),
    );
    assert!(again.is_empty(), "{}", again.script);
}

#[test]
fn emptied_then_refilled_service_moves_between_maps_and_removal_deletes_its_objects() {
    let mut rs = programmed(vec![view("a", "198.18.100.10", &["198.18.1.2"])]);
    let plan = plan_change(&rs, view_with("a", "198.18.100.10", "", Some(&[])));
    assert_eq!(
        plan.script,
        "delete element inet rune backends4-tcp { 198.18.100.10 . 80 . 0 }\n\
         delete element inet rune service-vips { 198.18.100.10 . tcp . 80 }\n\
         add element inet rune no-endpoints { 198.18.100.10 . tcp . 80 : goto reject-service }\n"
    );
    // The same commands, typed, for the netlink batch.
    assert_eq!(
        plan.element_ops.as_deref().map(ops_script),
        Some(plan.script.clone())
    );
    rs.commit(plan);
    let plan = rs.plan(
        &delta(false, vec![], vec![ServiceKey::new("default", "a")]),
        &Existing::default(),
    );
    assert_eq!(
        plan.script,
        "delete element inet rune no-endpoints { 198.18.100.10 . tcp . 80 }\n"
    );
    rs.commit(plan);
    assert!(rs.is_empty());
}

#[test]
fn a_vip_moving_to_another_service_is_deleted_once_before_it_is_added() {
    let mut rs = programmed(vec![view("a", "198.18.100.10", &["198.18.1.2"])]);
    let plan = rs.plan(
        &delta(
            false,
            vec![view("b", "198.18.100.10", &["198.18.1.3"])],
            vec![ServiceKey::new("default", "a")],
        ),
        &Existing::default(),
    );
    let s = &plan.script;
    // Each of a's elements (service map, one backend) deleted once, before b's.
    assert_eq!(
        s.matches("delete element inet rune service-vips { 198.18.100.10 . tcp . 80 }")
            .count(),
        1,
        "{s}"
    );
    assert_eq!(s.matches("delete element").count(), 2, "{s}");
    let del = s.rfind("delete element").expect("deleted");
    let add = s.find("add element").expect("added");
    assert!(del < add, "{s}");
    assert_eq!(
        plan.element_ops.as_deref().map(ops_script).as_ref(),
        Some(s)
    );
    assert!(
        s.contains(
            "add element inet rune backends4-tcp { 198.18.100.10 . 80 . 0 : 198.18.1.3 . 8080 }"
        ),
        "{s}"
    );
    rs.commit(plan);
    assert!(rs.service(&ServiceKey::new("default", "a")).is_none());
}

#[test]
fn full_delta_adopts_an_existing_table_in_one_transaction() {
    let rs = Ruleset::new("node-a");
    let existing = Existing {
        table: true,
        chains: [
            "nat-prerouting",
            "services",
            "pick4-1",
            "pick4-7",
            "svc4-default/gone/tcp/80",
        ]
        .into_iter()
        .map(str::to_owned)
        .collect(),
        sets: ["aff4-default/gone/tcp/80/198.18.1.9/8080"]
            .into_iter()
            .map(str::to_owned)
            .collect(),
    };
    let plan = rs.plan(
        &delta(
            true,
            vec![view("a", "198.18.100.10", &["198.18.1.2"])],
            vec![],
        ),
        &existing,
    );
    let s = &plan.script;
    // Never deleted as a whole: flushed and refilled.
    assert!(!s.contains("delete table"), "{s}");
    for map in [
        "service-vips",
        "service-vips6",
        "no-endpoints",
        "no-endpoints6",
        "backends4-tcp",
        "backends4-udp",
        "backends6-tcp",
        "backends6-udp",
    ] {
        assert!(s.contains(&format!("flush map inet rune {map}\n")), "{s}");
    }
    // The pick chain still in use is flushed and refilled, the unused one goes.
    assert!(s.contains("flush chain inet rune pick4-1\n"), "{s}");
    assert!(s.contains("add rule inet rune pick4-1 dnat"), "{s}");
    assert!(!s.contains("delete chain inet rune pick4-1\n"), "{s}");
    assert!(s.contains("delete chain inet rune pick4-7\n"), "{s}");
    assert!(
        s.contains("delete chain inet rune svc4-default/gone/tcp/80\n"),
        "{s}"
    );
    assert!(
        s.contains("delete set inet rune aff4-default/gone/tcp/80/198.18.1.9/8080\n"),
        "{s}"
    );
    assert!(!s.contains("delete chain inet rune services"), "{s}");
    let flush = s
        .find("flush chain inet rune svc4-default/gone")
        .expect("flushed");
    let delete = s
        .find("delete chain inet rune svc4-default/gone")
        .expect("deleted");
    assert!(flush < delete);
}

/// `ops` as the nft commands they stand for.
fn ops_script(ops: &[ElementOp]) -> String {
    ops.iter()
        .map(|op| match &op.value {
            Some(v) => format!("add element {TABLE} {} {{ {} : {v} }}\n", op.map, op.key),
            None => format!("delete element {TABLE} {} {{ {} }}\n", op.map, op.key),
        })
        .collect()
}

#[test]
fn element_keys_and_values_encode_as_the_kernel_stores_them() {
    use super::netlink::{backend_bytes, key_bytes};
    // Address, port big-endian padded to 4 bytes, numgen index host-endian.
    let key = ElementKey::Backend {
        vip: "198.18.100.10".parse().unwrap(),
        port: 80,
        index: 1,
    };
    let mut bytes = vec![198, 18, 100, 10, 0, 80, 0, 0];
    bytes.extend_from_slice(&1u32.to_ne_bytes());
    assert_eq!(key_bytes(&key), bytes);
    assert_eq!(
        backend_bytes("198.18.1.4:8080".parse().unwrap()),
        vec![198, 18, 1, 4, 0x1f, 0x90, 0, 0]
    );
    // Address, protocol one byte padded, port big-endian padded.
    let key6 = ElementKey::Port {
        vip: "fd00:100::10".parse().unwrap(),
        protocol: Protocol::Udp,
        port: 53,
    };
    let mut bytes6 = vec![0xfd, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10];
    bytes6.extend_from_slice(&[17, 0, 0, 0, 0, 53, 0, 0]);
    assert_eq!(key_bytes(&key6), bytes6);
    assert_eq!(key6.to_string(), "fd00:100::10 . udp . 53");
}

#[test]
fn an_endpoint_change_plan_goes_over_netlink_and_a_new_backend_count_does_not() {
    let rs = Ruleset::new("node-a");
    let full = rs.plan(
        &delta(
            true,
            vec![view("a", "198.18.100.10", &["198.18.1.2"])],
            vec![],
        ),
        &Existing::default(),
    );
    assert_eq!(full.element_ops, None, "a full sync goes to nft");
    let mut rs = programmed(vec![view(
        "a",
        "198.18.100.10",
        &["198.18.1.2", "198.18.1.3"],
    )]);
    let same_n = plan_change(
        &rs,
        view("a", "198.18.100.10", &["198.18.1.2", "198.18.1.4"]),
    );
    let key = ElementKey::Backend {
        vip: "198.18.100.10".parse().unwrap(),
        port: 80,
        index: 1,
    };
    let ops = same_n.element_ops.clone().expect("element commands only");
    assert_eq!(
        ops,
        vec![
            ElementOp {
                map: "backends4-tcp",
                key: key.clone(),
                value: None,
            },
            ElementOp {
                map: "backends4-tcp",
                key,
                value: Some(ElementValue::Backend("198.18.1.4:8080".parse().unwrap())),
            },
        ]
    );
    assert_eq!(ops_script(&ops), same_n.script);
    rs.commit(same_n);
    let new_n = plan_change(
        &rs,
        view(
            "a",
            "198.18.100.10",
            &["198.18.1.2", "198.18.1.4", "198.18.1.5"],
        ),
    );
    assert!(new_n.element_ops.is_none(), "{}", new_n.script);
    let unchanged = plan_change(
        &rs,
        view("a", "198.18.100.10", &["198.18.1.2", "198.18.1.4"]),
    );
    assert!(unchanged.is_empty() && unchanged.element_ops.is_none());
}
