use super::{PolicyObjects, change_script, failed_objects, full_script, objects, verdict_counts};
use crate::{
    model::ServiceKey,
    policy::{
        PolicyPlan,
        compile::{
            compile,
            tests::{service, views},
        },
        metrics::{Direction, DropReason, Verdict},
    },
};
use std::collections::{BTreeMap, BTreeSet};

fn plan(policy: &str, eps: &str) -> PolicyPlan {
    compile(
        "node-a",
        &views(&service(
            "shop",
            "web",
            "[{name: http, port: 80, targetPort: 8080}]",
            "",
            policy,
            eps,
        )),
    )
}

fn elements<'o>(o: &'o PolicyObjects, set: &str) -> &'o BTreeSet<String> {
    &o.sets
        .get(set)
        .unwrap_or_else(|| panic!("no set {set}: {:?}", o.sets.keys()))
        .1
}

#[test]
fn rules_become_aggregated_set_elements_keyed_by_the_guarded_address() {
    let p = plan(
        "{ingress: [{from: [{cidr: 198.18.1.2/32}, {cidr: 198.18.1.3/32}, {cidr: 198.18.0.0/16}]}, \
         {from: [{cidr: 10.0.0.0/8}], ports: [http, \"53/udp\"]}]}",
        "[{address: 198.18.11.2}]",
    );
    let o = objects(&p, None);
    assert_eq!(
        elements(&o, "pol-in4-any-shop/web"),
        &BTreeSet::from(["198.18.11.2 . 198.18.0.0/16".to_owned()])
    );
    assert_eq!(
        elements(&o, "pol-in4-ports-shop/web"),
        &BTreeSet::from([
            "198.18.11.2 . 10.0.0.0/8 . tcp . 8080".to_owned(),
            "198.18.11.2 . 10.0.0.0/8 . udp . 53".to_owned(),
        ])
    );
    assert_eq!(
        elements(&o, "pol-in4-peers-shop/web"),
        &BTreeSet::from(["198.18.11.2 . 10.0.0.0/8".to_owned()])
    );
    assert!(elements(&o, "pol-in6-any-shop/web").is_empty());
    let chain = &o.verdicts[&("pol-to4", "198.18.11.2".parse().unwrap())];
    assert_eq!(chain, "pol-in-e-shop/web");
    let rules = &o.chains[chain];
    assert_eq!(
        rules.last().unwrap(),
        "counter name pc-in-nomatch-shop/web drop"
    );
    assert!(
        rules.contains(
            &"ip daddr . ip saddr @pol-in4-peers-shop/web counter name pc-in-port-shop/web drop"
                .to_owned()
        )
    );
    assert!(!o.sets["pol-in4-any-shop/web"].0.contains("size"));
    assert!(
        objects(&p, Some(9)).sets["pol-in4-any-shop/web"]
            .0
            .contains("size 9 ;")
    );
}

#[test]
fn audit_chains_count_and_pass() {
    let p = plan(
        "{mode: audit, egress: [{to: [{cidr: 10.0.0.0/8}]}]}",
        "[{address: \"fd00:11::2\"}]",
    );
    let o = objects(&p, None);
    let chain = &o.verdicts[&("pol-from6", "fd00:11::2".parse().unwrap())];
    assert_eq!(chain, "pol-out-a-shop/web");
    let rules = &o.chains[chain];
    assert_eq!(rules.last().unwrap(), "counter name pc-out-audit-shop/web");
    assert!(rules.iter().all(|r| !r.ends_with("drop")), "{rules:?}");
    assert!(rules.contains(&"ip6 saddr . ip6 daddr @pol-out6-any-shop/web counter name pc-out-allow-shop/web return".to_owned()));
}

#[test]
fn a_new_endpoint_changes_elements_only() {
    let policy = "{ingress: [{from: [{cidr: 198.18.1.2/32}]}]}";
    let before = objects(&plan(policy, "[{address: 198.18.11.2}]"), None);
    let after = objects(&plan(policy, "[{address: 198.18.12.2}]"), None);
    let script = change_script(&before, &after);
    let lines: Vec<&str> = script.lines().collect();
    assert_eq!(
        lines,
        [
            "delete element inet rune pol-to4 { 198.18.11.2 }",
            "delete element inet rune pol-in4-any-shop/web { 198.18.11.2 . 198.18.1.2/32 }",
            "add element inet rune pol-in4-any-shop/web { 198.18.12.2 . 198.18.1.2/32 }",
            "add element inet rune pol-to4 { 198.18.12.2 : jump pol-in-e-shop/web }",
        ]
    );
    assert_eq!(change_script(&after, &after), "");
}

#[test]
fn a_removed_policy_takes_its_objects_along() {
    let before = objects(&plan("{ingress: [{}]}", "[{address: 198.18.11.2}]"), None);
    let script = change_script(&before, &PolicyObjects::default());
    assert!(
        script.contains("delete chain inet rune pol-in-e-shop/web\n"),
        "{script}"
    );
    assert!(
        script.contains("delete set inet rune pol-in6-peers-shop/web\n"),
        "{script}"
    );
    assert!(
        script.contains("delete counter inet rune pc-in-allow-shop/web\n"),
        "{script}"
    );
    let chain = script.find("delete chain").unwrap();
    assert!(script.find("delete element inet rune pol-to4").unwrap() < chain);
    assert!(chain < script.find("delete set").unwrap());
}

#[test]
fn failure_objects_drop_enforced_and_pass_audited_traffic() {
    let p = plan("{ingress: [{}], egress: [{}]}", "[{address: 198.18.11.2}]");
    let o = failed_objects(&p);
    assert_eq!(
        o.chains["pol-fail-in-shop/web"],
        ["counter name pc-in-unprog-shop/web drop"]
    );
    assert_eq!(o.verdicts.len(), 2);
    let audit = failed_objects(&plan(
        "{mode: audit, ingress: [{}]}",
        "[{address: 198.18.11.2}]",
    ));
    assert_eq!(audit.chains["pol-fail-in-shop/web"], ["return"]);
}

#[test]
fn a_full_sync_replaces_the_sets_of_old_chains_and_deletes_unwanted_ones() {
    let o = objects(&plan("{ingress: [{}]}", "[{address: 198.18.11.2}]"), None);
    let existing = BTreeSet::from([
        "pol-in-e-shop/web".to_owned(),
        "pol-out-a-shop/gone".to_owned(),
        "services".to_owned(),
    ]);
    let script = full_script(&o, &existing);
    assert!(script.contains("delete set inet rune pol-in4-any-shop/web\n"));
    assert!(script.contains("add set inet rune pol-in4-any-shop/web "));
    assert!(script.contains("delete chain inet rune pol-out-a-shop/gone\n"));
    assert!(script.contains("delete counter inet rune pc-out-allow-shop/gone\n"));
    assert!(!script.contains("delete counter inet rune pc-in-allow-shop/web"));
    assert!(!script.contains("delete chain inet rune services"));
}

#[test]
fn named_counters_map_back_to_verdicts() {
    let counters = BTreeMap::from([
        ("pc-in-allow-shop/web".to_owned(), 4),
        ("pc-in-port-shop/web".to_owned(), 2),
        ("pc-out-nomatch-shop/web".to_owned(), 1),
        ("pc-out-unprog-shop/web".to_owned(), 3),
        ("pc-in-audit-shop/web".to_owned(), 5),
        ("unrelated".to_owned(), 9),
    ]);
    let web = ServiceKey::new("shop", "web");
    let counts = verdict_counts(&counters);
    assert_eq!(counts.len(), 5);
    assert_eq!(
        counts[&(web.clone(), Direction::Ingress, Verdict::Allow)],
        4
    );
    assert_eq!(
        counts[&(
            web.clone(),
            Direction::Ingress,
            Verdict::Drop(DropReason::PortNotAllowed)
        )],
        2
    );
    assert_eq!(
        counts[&(
            web.clone(),
            Direction::Egress,
            Verdict::Drop(DropReason::NoMatchingRule)
        )],
        1
    );
    assert_eq!(
        counts[&(
            web.clone(),
            Direction::Egress,
            Verdict::Drop(DropReason::PolicyUnprogrammable)
        )],
        3
    );
    assert_eq!(
        counts[&(web, Direction::Ingress, Verdict::AuditWouldDrop)],
        5
    );
}
