use super::{
    Objects, PolicyObjects, Programmed, failed_objects, full_script, objects, verdict_counts,
};
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
    let ports = "[{name: http, port: 80, targetPort: 8080}]";
    compile(
        "node-a",
        &views(&service("shop", "web", ports, "", policy, eps)),
    )
}

/// What a full sync to `plan` programs.
fn programmed(plan: &PolicyPlan) -> Programmed {
    let mut out = Programmed::default();
    out.commit(Programmed::full(
        plan,
        Objects::Rules(None),
        &BTreeSet::new(),
        None,
    ));
    out
}

/// The elements of `map` as `key : goto chain` lines.
fn elements(o: &PolicyObjects, map: &str) -> Vec<String> {
    o.elements
        .iter()
        .filter(|((m, _), _)| m == map)
        .map(|((_, k), c)| format!("{k} : goto {c}"))
        .collect()
}

#[test]
fn rules_become_aggregated_elements_keyed_by_the_guarded_address() {
    let p = plan(
        "{ingress: [{from: [{cidr: 198.18.1.2/32}, {cidr: 198.18.1.3/32}, {cidr: 198.18.0.0/16}]}, \
         {from: [{cidr: 10.0.0.0/8}], ports: [http, \"53/udp\"]}]}",
        "[{address: 198.18.11.2}]",
    );
    let o = objects(&p, None);
    assert_eq!(
        elements(&o, "pol-in4-any"),
        ["198.18.11.2 . 198.18.0.0/16 : goto pol-ok-in-e-shop/web"]
    );
    assert_eq!(
        elements(&o, "pol-in4-ports"),
        [
            "198.18.11.2 . 10.0.0.0/8 . tcp . 8080 : goto pol-ok-in-e-shop/web",
            "198.18.11.2 . 10.0.0.0/8 . udp . 53 : goto pol-ok-in-e-shop/web",
        ]
    );
    assert_eq!(
        elements(&o, "pol-in4-peers"),
        ["198.18.11.2 . 10.0.0.0/8 : goto pol-port-in-e-shop/web"]
    );
    assert_eq!(
        elements(&o, "pol-in4"),
        ["198.18.11.2 : goto pol-nomatch-in-e-shop/web"]
    );
    assert_eq!(
        o.chains["pol-nomatch-in-e-shop/web"],
        ["counter name pc-in-nomatch-shop/web drop"]
    );
    assert_eq!(
        o.chains["pol-ok-in-e-shop/web"],
        ["counter name pc-in-allow-shop/web return"]
    );
}

#[test]
fn audit_chains_count_and_return() {
    let p = plan(
        "{mode: audit, egress: [{to: [{cidr: 10.0.0.0/8}]}]}",
        "[{address: \"fd00:11::2\"}]",
    );
    let o = objects(&p, None);
    assert_eq!(
        elements(&o, "pol-out6"),
        ["fd00:11::2 : goto pol-nomatch-out-a-shop/web"]
    );
    assert_eq!(
        o.chains["pol-nomatch-out-a-shop/web"],
        ["counter name pc-out-audit-shop/web return"]
    );
    assert!(o.chains.values().flatten().all(|r| !r.ends_with("drop")));
}

#[test]
fn a_new_endpoint_changes_elements_only() {
    let policy = "{ingress: [{from: [{cidr: 198.18.1.2/32}]}]}";
    let (before, after) = (
        plan(policy, "[{address: 198.18.11.2}]"),
        plan(policy, "[{address: 198.18.12.2}]"),
    );
    let old = programmed(&before);
    let pending = old.change(&after, &old.all_addresses(&after), Objects::Rules(None));
    let script = pending.script.clone();
    let lines: Vec<&str> = script.lines().collect();
    assert_eq!(
        lines,
        [
            "delete element inet rune pol-in4 { 198.18.11.2 }",
            "delete element inet rune pol-in4-any { 198.18.11.2 . 198.18.1.2/32 }",
            "add element inet rune pol-in4 { 198.18.12.2 : goto pol-nomatch-in-e-shop/web }",
            "add element inet rune pol-in4-any { 198.18.12.2 . 198.18.1.2/32 : goto pol-ok-in-e-shop/web }",
        ]
    );
    let mut new = old.clone();
    new.commit(pending);
    assert_eq!(new, programmed(&after));
    assert_eq!(
        new.change(&after, &new.all_addresses(&after), Objects::Rules(None))
            .script,
        ""
    );
}

#[test]
fn a_removed_policy_takes_its_objects_along_after_its_elements() {
    let before = programmed(&plan("{ingress: [{}]}", "[{address: 198.18.11.2}]"));
    let none = PolicyPlan::default();
    let script = before
        .change(&none, &before.all_addresses(&none), Objects::Rules(None))
        .script;
    let chain = script
        .find("delete chain inet rune pol-ok-in-e-shop/web\n")
        .unwrap();
    assert!(
        script.find("delete element inet rune pol-in4 ").unwrap() < chain,
        "{script}"
    );
    assert!(
        chain
            < script
                .find("delete counter inet rune pc-in-allow-shop/web\n")
                .unwrap()
    );
}

#[test]
fn failure_objects_drop_enforced_and_pass_audited_traffic() {
    let o = failed_objects(&plan(
        "{ingress: [{}], egress: [{}]}",
        "[{address: 198.18.11.2}]",
    ));
    assert_eq!(
        o.chains["pol-fail-in-shop/web"],
        ["counter name pc-in-unprog-shop/web drop"]
    );
    assert_eq!(
        elements(&o, "pol-out4"),
        ["198.18.11.2 : goto pol-fail-out-shop/web"]
    );
    let audit = failed_objects(&plan(
        "{mode: audit, ingress: [{}]}",
        "[{address: 198.18.11.2}]",
    ));
    assert_eq!(audit.chains["pol-fail-in-shop/web"], ["return"]);
}

#[test]
fn a_full_sync_declares_bounded_maps_and_deletes_what_is_unwanted() {
    let o = objects(&plan("{ingress: [{}]}", "[{address: 198.18.11.2}]"), None);
    let existing = BTreeSet::from([
        "pol-ok-in-e-shop/web".to_owned(),
        "pol-ok-out-a-shop/gone".to_owned(),
        "pol-fail-in-shop/old".to_owned(),
        "pol".to_owned(),
        "services".to_owned(),
    ]);
    let script = full_script(&o, &existing, Some(7));
    assert!(script.contains(
        "add map inet rune pol-in4-ports { type ipv4_addr . ipv4_addr . inet_proto . inet_service : verdict ; flags interval ; size 7 ; }\n"
    ), "{script}");
    assert!(
        script.contains("add map inet rune pol-out6 { type ipv6_addr : verdict ; size 7 ; }\n")
    );
    assert!(script.contains("delete chain inet rune pol-ok-out-a-shop/gone\n"));
    assert!(script.contains("delete counter inet rune pc-out-allow-shop/gone\n"));
    assert!(script.contains("delete counter inet rune pc-in-unprog-shop/old\n"));
    assert!(!script.contains("delete counter inet rune pc-in-allow-shop/web"));
    assert!(!script.contains("delete chain inet rune services"));
    assert!(!script.contains("delete chain inet rune pol\n"));
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
    let port = Verdict::Drop(DropReason::PortNotAllowed);
    assert_eq!(counts[&(web.clone(), Direction::Ingress, port)], 2);
    let nomatch = Verdict::Drop(DropReason::NoMatchingRule);
    assert_eq!(counts[&(web.clone(), Direction::Egress, nomatch)], 1);
    let unprog = Verdict::Drop(DropReason::PolicyUnprogrammable);
    assert_eq!(counts[&(web.clone(), Direction::Egress, unprog)], 3);
    assert_eq!(
        counts[&(web, Direction::Ingress, Verdict::AuditWouldDrop)],
        5
    );
}

#[test]
fn changes_by_address_program_what_a_full_sync_would() {
    // Two services sharing 198.18.11.3: its rules are the union, its chains the
    // first service's; the steps add, share, swap and remove addresses.
    let steps = [
        ("[{address: 198.18.11.2}]", "[]"),
        ("[{address: 198.18.11.2}, {address: 198.18.11.3}]", "[]"),
        ("[{address: 198.18.11.3}]", "[{address: 198.18.11.3}]"),
        ("[]", "[{address: 198.18.11.3}, {address: \"fd00::3\"}]"),
        ("[]", "[]"),
    ];
    let ports = "[{name: http, port: 80, targetPort: 8080}]";
    let mut programmed_by_change = Programmed::default();
    let mut last = PolicyPlan::default();
    for (web, api) in steps {
        let yaml = service(
            "shop",
            "web",
            ports,
            "",
            "{ingress: [{from: [{cidr: 198.18.1.0/24}], ports: [http]}]}",
            web,
        ) + &service(
            "shop",
            "api",
            ports,
            "",
            "{mode: audit, egress: [{to: [{cidr: 10.0.0.0/8}]}]}",
            api,
        );
        let now = compile("node-a", &views(&yaml));
        let changed = programmed_by_change.all_addresses(&last);
        let changed = changed
            .union(&now.endpoints.keys().copied().collect())
            .copied()
            .collect();
        let pending = programmed_by_change.change(&now, &changed, Objects::Rules(None));
        programmed_by_change.commit(pending);
        assert_eq!(programmed_by_change, programmed(&now));
        assert_eq!(programmed_by_change.objects(), objects(&now, None));
        last = now;
    }
}
