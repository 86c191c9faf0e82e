use super::{
    Objects, PolicyObjects, Programmed, failed_objects, full_script, objects, verdict_counts,
};
use crate::{
    dataplane::nftables::netlink::{Data, Element},
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

const RULES: Objects = Objects::Rules {
    log_group: None,
    size: None,
};

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
    out.commit(Programmed::full(plan, RULES, &BTreeSet::new(), None));
    out
}

/// The elements of `set`, as nft writes them.
fn elements(o: &PolicyObjects, set: &str) -> Vec<String> {
    o.elements
        .iter()
        .filter(|((s, _), _)| s == set)
        .map(|((_, k), c)| match c {
            Some(c) => format!("{k} : goto {c}"),
            None => k.to_string(),
        })
        .collect()
}

#[test]
fn rules_become_a_groups_sets_and_one_check_chain() {
    let p = plan(
        "{ingress: [{from: [{cidr: 198.18.1.2/32}, {cidr: 198.18.1.3/32}, {cidr: 198.18.0.0/16}]}, \
         {from: [{cidr: 10.0.0.0/8}, {cidr: 10.1.0.0/16}], ports: [http, \"53/udp\"]}]}",
        "[{address: 198.18.11.2}, {address: 198.18.11.3}]",
    );
    let o = objects(&p, None);
    let g = "in4-ea1-shop/web";
    assert_eq!(
        elements(&o, "pol-in4"),
        [
            format!("198.18.11.2 : goto pol-c-{g}"),
            format!("198.18.11.3 : goto pol-c-{g}")
        ]
    );
    assert_eq!(elements(&o, &format!("pol-any-{g}")), ["198.18.0.0/16"]);
    assert_eq!(elements(&o, &format!("pol-p0-{g}")), ["10.0.0.0/8"]);
    assert_eq!(
        elements(&o, "pol-in4-q0"),
        [
            "198.18.11.2 . tcp . 8080",
            "198.18.11.2 . udp . 53",
            "198.18.11.3 . tcp . 8080",
            "198.18.11.3 . udp . 53"
        ]
    );
    assert_eq!(
        o.sets[&format!("pol-p0-{g}")],
        "{ type ipv4_addr ; flags interval ; }"
    );
    assert_eq!(
        o.sets["pol-in4-q0"],
        "{ type ipv4_addr . inet_proto . inet_service ; }"
    );
    assert_eq!(
        o.chains[&format!("pol-c-{g}")],
        [
            format!("ip saddr @pol-any-{g} goto pol-ok-in-e-shop/web"),
            format!(
                "ip daddr . meta l4proto . th dport @pol-in4-q0 ip saddr @pol-p0-{g} goto pol-ok-in-e-shop/web"
            ),
            format!("ip saddr @pol-p0-{g} goto pol-port-in-e-shop/web"),
            "goto pol-nomatch-in-e-shop/web".to_owned(),
        ]
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
fn audit_chains_count_and_return_and_egress_checks_the_source() {
    let p = plan(
        "{mode: audit, egress: [{to: [{cidr: \"fd00:1::/64\"}], ports: [\"53/udp\"]}]}",
        "[{address: \"fd00:11::2\"}]",
    );
    let o = objects(&p, None);
    let g = "out6-a1-shop/web";
    assert_eq!(
        elements(&o, "pol-out6"),
        [format!("fd00:11::2 : goto pol-c-{g}")]
    );
    assert_eq!(
        o.chains[&format!("pol-c-{g}")][0],
        format!(
            "ip6 saddr . meta l4proto . th dport @pol-out6-q0 ip6 daddr @pol-p0-{g} goto pol-ok-out-a-shop/web"
        )
    );
    assert_eq!(
        o.chains["pol-nomatch-out-a-shop/web"],
        ["counter name pc-out-audit-shop/web return"]
    );
    assert!(o.chains.values().flatten().all(|r| !r.ends_with("drop")));
}

#[test]
fn a_new_endpoint_changes_its_own_elements_over_netlink() {
    let policy = "{ingress: [{from: [{cidr: 198.18.1.2/32}], ports: [http]}]}";
    let (before, after) = (
        plan(policy, "[{address: 198.18.11.2}]"),
        plan(policy, "[{address: 198.18.12.2}]"),
    );
    let old = programmed(&before);
    let pending = old.change(&after, &old.all_addresses(&after), RULES);
    let g = "in4-e1-shop/web";
    let lines: Vec<&str> = pending.script.lines().collect();
    assert_eq!(
        lines,
        [
            "delete element inet rune pol-in4 { 198.18.11.2 }".to_owned(),
            "delete element inet rune pol-in4-q0 { 198.18.11.2 . tcp . 8080 }".to_owned(),
            format!("add element inet rune pol-in4 {{ 198.18.12.2 : goto pol-c-{g} }}"),
            "add element inet rune pol-in4-q0 { 198.18.12.2 . tcp . 8080 }".to_owned(),
        ]
    );
    let ops = pending.elements.clone().expect("elements only");
    assert_eq!(ops.len(), 4);
    assert_eq!(
        ops[2],
        Element {
            set: "pol-in4".to_owned(),
            add: true,
            key: vec![198, 18, 12, 2],
            flags: 0,
            udata: None,
            data: Some(Data::Goto(format!("pol-c-{g}"))),
        }
    );
    assert_eq!(ops[3].key, [198, 18, 12, 2, 6, 0, 0, 0, 0x1f, 0x90, 0, 0]);
    let mut new = old.clone();
    new.commit(pending);
    assert_eq!(new, programmed(&after));
    let again = new.change(&after, &new.all_addresses(&after), RULES);
    assert_eq!(again.script, "");
    assert!(again.elements.is_none());
}

#[test]
fn a_replaced_peer_is_one_interval_out_and_one_in() {
    let policy = |cidr: &str| {
        format!("{{ingress: [{{from: [{{cidr: {cidr}}}, {{cidr: 10.0.0.0/8}}], ports: [http]}}]}}")
    };
    let eps = "[{address: 198.18.11.2}, {address: 198.18.11.3}]";
    let (before, after) = (
        plan(&policy("198.19.64.1/32"), eps),
        plan(&policy("198.19.64.2/32"), eps),
    );
    let old = programmed(&before);
    let pending = old.change(&after, &old.all_addresses(&after), RULES);
    let set = "pol-p0-in4-e1-shop/web";
    assert_eq!(
        pending.script,
        format!(
            "delete element inet rune {set} {{ 198.19.64.1/32 }}\n\
             add element inet rune {set} {{ 198.19.64.2/32 }}\n"
        )
    );
    let ops = pending.elements.clone().expect("elements only");
    let expect = |add, a: u8, flags| Element {
        set: set.to_owned(),
        add,
        key: vec![198, 19, 64, a],
        flags,
        udata: None,
        data: None,
    };
    assert_eq!(
        ops,
        [
            expect(false, 1, 0),
            expect(false, 2, 1),
            expect(true, 2, 0),
            expect(true, 3, 1)
        ]
    );
    let mut new = old;
    new.commit(pending);
    assert_eq!(new, programmed(&after));
}

#[test]
fn a_removed_policy_takes_its_objects_along_after_its_elements() {
    let before = programmed(&plan("{ingress: [{}]}", "[{address: 198.18.11.2}]"));
    let none = PolicyPlan::default();
    let pending = before.change(&none, &before.all_addresses(&none), RULES);
    assert!(pending.elements.is_none(), "chains go: nft");
    let script = pending.script;
    let at = |line: &str| {
        script
            .find(line)
            .unwrap_or_else(|| panic!("{line} in {script}"))
    };
    let pin = at("delete element inet rune pol-in4 { 198.18.11.2 }\n");
    let check = at("delete chain inet rune pol-c-in4-ea0-shop/web\n");
    let ok = at("delete chain inet rune pol-ok-in-e-shop/web\n");
    let set = at("delete set inet rune pol-any-in4-ea0-shop/web\n");
    let counter = at("delete counter inet rune pc-in-allow-shop/web\n");
    assert!(
        pin < check && check < ok && ok < set && set < counter,
        "{script}"
    );
    assert!(
        !script.contains("delete element inet rune pol-any"),
        "{script}"
    );
}

#[test]
fn addresses_with_different_peers_never_share_a_set() {
    let p = plan(
        "{ingress: [{from: [{cidr: 10.0.0.0/8}]}]}",
        "[{address: 198.18.11.2}, {address: 198.18.11.3}]",
    );
    let a: std::net::IpAddr = "198.18.11.3".parse().unwrap();
    let mut odd = p.clone();
    let rules = odd.endpoints.get_mut(&a).unwrap().ingress.as_mut().unwrap();
    rules.rules[0].peers = BTreeSet::from(["172.16.0.0/12".parse().unwrap()]);
    let o = objects(&odd, None);
    let g = "in4-ea0-shop/web";
    assert_eq!(elements(&o, &format!("pol-any-{g}")), ["10.0.0.0/8"]);
    assert_eq!(elements(&o, &format!("pol-any-{g}.2")), ["172.16.0.0/12"]);
    assert_eq!(
        elements(&o, "pol-in4")[1],
        format!("198.18.11.3 : goto pol-c-{g}.2")
    );
    // Back to the same peers: the second group goes.
    let mut by_change = Programmed::build(&odd, RULES);
    let pending = by_change.change(&p, &BTreeSet::from([a]), RULES);
    assert!(
        pending
            .script
            .contains(&format!("delete set inet rune pol-any-{g}.2\n"))
    );
    by_change.commit(pending);
    assert_eq!(by_change, programmed(&p));
}

#[test]
fn failure_objects_drop_enforced_and_pass_audited_traffic() {
    let o = failed_objects(&plan(
        "{ingress: [{}], egress: [{}]}",
        "[{address: 198.18.11.2}, {address: \"fd00::2\"}]",
    ));
    assert_eq!(
        o.chains["pol-fail-in-shop/web"],
        ["counter name pc-in-unprog-shop/web drop"]
    );
    assert_eq!(
        elements(&o, "pol-out4"),
        ["198.18.11.2 : goto pol-fail-out-shop/web"]
    );
    assert_eq!(
        elements(&o, "pol-out6"),
        ["fd00::2 : goto pol-fail-out-shop/web"]
    );
    assert!(o.sets.is_empty());
    let audit = failed_objects(&plan(
        "{mode: audit, ingress: [{}]}",
        "[{address: 198.18.11.2}]",
    ));
    assert_eq!(audit.chains["pol-fail-in-shop/web"], ["return"]);
}

#[test]
fn a_full_sync_declares_bounded_sets_and_deletes_what_is_unwanted() {
    let p = plan("{ingress: [{}]}", "[{address: 198.18.11.2}]");
    let sized = Objects::Rules {
        log_group: None,
        size: Some(7),
    };
    let o = Programmed::build(&p, sized).objects();
    let existing = BTreeSet::from([
        "pol-ok-in-e-shop/web".to_owned(),
        "pol-c-in4-ea0-shop/web".to_owned(),
        "pol-ok-out-a-shop/gone".to_owned(),
        "pol-c-out4-a2-shop/gone".to_owned(),
        "pol-fail-in-shop/old".to_owned(),
        "pol".to_owned(),
        "services".to_owned(),
    ]);
    let script = full_script(&o, &existing, Some(7));
    for line in [
        "add set inet rune pol-any-in4-ea0-shop/web { type ipv4_addr ; flags interval ; size 7 ; }\n",
        "flush set inet rune pol-any-in4-ea0-shop/web\n",
        "add map inet rune pol-out6 { type ipv6_addr : verdict ; size 7 ; }\n",
        "delete chain inet rune pol-c-out4-a2-shop/gone\n",
        "delete chain inet rune pol-ok-out-a-shop/gone\n",
        "delete set inet rune pol-p1-out4-a2-shop/gone\n",
        "delete set inet rune pol-out4-q1\n",
        "delete counter inet rune pc-out-allow-shop/gone\n",
        "delete counter inet rune pc-out-audit-shop/gone\n",
        "delete counter inet rune pc-in-unprog-shop/old\n",
    ] {
        assert!(script.contains(line), "{line} in {script}");
    }
    assert!(
        script.find("delete chain inet rune pol-c-out4").unwrap()
            < script.find("delete chain inet rune pol-ok-out").unwrap()
    );
    assert!(!script.contains("delete set inet rune pol-any-out4-a2"));
    assert!(!script.contains("delete counter inet rune pc-in-allow-shop/web"));
    assert!(
        !script.contains("pc-out-port-shop/gone"),
        "audit has no port counter"
    );
    assert!(!script.contains("delete chain inet rune services"));
    assert!(!script.contains("delete chain inet rune pol\n"));
}

#[test]
fn a_full_sync_retires_the_earlier_layouts_maps_before_any_chain() {
    let p = plan("{ingress: [{}]}", "[{address: 198.18.11.2}]");
    let rules = Objects::Rules {
        log_group: None,
        size: None,
    };
    let o = Programmed::build(&p, rules).objects();
    // A second failure chain of one service (its audit and enforce addresses).
    let existing = BTreeSet::from([
        "pol-ok-in-e-shop/gone".to_owned(),
        "pol-fail-in-shop/old".to_owned(),
        "pol-fail-in-shop/old.2".to_owned(),
    ]);
    let script = full_script(&o, &existing, None);
    let retire = "add map inet rune pol-in4-any { type ipv4_addr . ipv4_addr : verdict ; flags interval ; }\n\
                  delete map inet rune pol-in4-any\n";
    assert!(script.starts_with(retire), "{script}");
    for kind in ["any", "ports", "peers"] {
        for map in ["in4", "in6", "out4", "out6"] {
            let line = format!("delete map inet rune pol-{map}-{kind}\n");
            assert!(
                script.find(&line) < script.find("delete chain"),
                "{line} first in {script}"
            );
        }
    }
    // The suffixed failure chain counts into the service's one counter.
    assert_eq!(
        script
            .matches("delete counter inet rune pc-in-unprog-shop/old\n")
            .count(),
        1
    );
    assert!(!script.contains("pc-in-unprog-shop/old.2"), "{script}");
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
    assert_eq!(counts.len(), 10, "every verdict of both directions");
    let api = ServiceKey::new("shop", "api");
    let only = verdict_counts(&BTreeMap::from([("pc-in-allow-shop/api".to_owned(), 1)]));
    assert_eq!(only.len(), 5);
    assert_eq!(only[&(api, Direction::Ingress, Verdict::AuditWouldDrop)], 0);
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
    // Two services sharing 198.18.11.3: its rules are the union, its group of
    // its own; the steps add, share, swap and remove addresses, and fail closed.
    let steps = [
        ("[{address: 198.18.11.2}]", "[]"),
        ("[{address: 198.18.11.2}, {address: 198.18.11.3}]", "[]"),
        ("[{address: 198.18.11.3}]", "[{address: 198.18.11.3}]"),
        ("[]", "[{address: 198.18.11.3}, {address: \"fd00::3\"}]"),
        ("[]", "[]"),
    ];
    let ports = "[{name: http, port: 80, targetPort: 8080}]";
    let mut by_change = Programmed::default();
    let mut last = PolicyPlan::default();
    for (i, (web, api)) in steps.into_iter().enumerate() {
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
        let changed = by_change.all_addresses(&last);
        let changed = changed
            .union(&now.endpoints.keys().copied().collect())
            .copied()
            .collect();
        let kind = if i == 2 { Objects::Failed } else { RULES };
        let pending = by_change.change(&now, &changed, kind);
        by_change.commit(pending);
        assert_eq!(by_change, Programmed::build(&now, kind), "step {i}");
        last = now;
    }
    assert_eq!(by_change, Programmed::default());
}
