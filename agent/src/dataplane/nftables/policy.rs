//! Network policy in table `inet rune`: the objects a [`PolicyPlan`] needs, and the
//! commands that get there from what was programmed. Pure: no process, no kernel.
//!
//! * Base chains `pol-forward`, `pol-output`, `pol-input` (filter, priority 0,
//!   after DNAT: VIP traffic is checked on its chosen backend) jump to `pol`, which
//!   accepts established and related packets (replies of allowed connections) and
//!   looks the source up in `pol-from4`/`pol-from6` (egress) and the destination
//!   in `pol-to4`/`pol-to6` (ingress): guarded address → `jump` the chain of the
//!   service the address reports under.
//! * Per service and direction, one chain per mode (`pol-in-e-NS/NAME`,
//!   `pol-in-a-…`; `pol-out-…` for egress) and per family three interval sets
//!   keyed by guarded address . peer prefix: `…-any-…` (rules for every port),
//!   `…-ports-…` (also . protocol . port) and `…-peers-…` (peers of port rules,
//!   to tell `port_not_allowed` from `no_matching_rule`). Allowed packets
//!   `return` (so a packet between two guarded addresses is checked both ways);
//!   the rest are dropped (enforce) or counted and passed (audit).
//! * Named counters `pc-DIR-KIND-NS/NAME` count each verdict; [`verdict_counts`]
//!   maps them back to the policy metrics.
//! * Fail closed ([`failed_objects`]): when the kernel refuses the policy's
//!   objects, each guarded address jumps to `pol-fail-DIR-NS/NAME`, which counts
//!   and drops (audit policies: passes).
//!
//! Interval sets refuse overlapping elements, so each element list is the
//! aggregate of its prefixes (contained prefixes dropped, neighbours merged).

use super::ruleset::TABLE;
use crate::{
    model::{PolicyMode, Protocol, ServiceKey},
    policy::{
        PolicyPlan,
        metrics::{Direction, DropReason, Verdict, VerdictCounts},
    },
};
use ipnet::IpNet;
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

/// The verdict maps: `(name, definition)`.
const VMAPS: [(&str, &str); 4] = [
    ("pol-to4", "type ipv4_addr : verdict ;"),
    ("pol-to6", "type ipv6_addr : verdict ;"),
    ("pol-from4", "type ipv4_addr : verdict ;"),
    ("pol-from6", "type ipv6_addr : verdict ;"),
];

/// The fixed chains: name, definition, rules.
fn skeleton() -> [(&'static str, &'static str, &'static [&'static str]); 4] {
    [
        (
            "pol",
            "",
            &[
                "ct state established,related accept",
                "ip saddr vmap @pol-from4",
                "ip6 saddr vmap @pol-from6",
                "ip daddr vmap @pol-to4",
                "ip6 daddr vmap @pol-to6",
            ],
        ),
        (
            "pol-forward",
            "{ type filter hook forward priority 0; policy accept; }",
            &["jump pol"],
        ),
        (
            "pol-output",
            "{ type filter hook output priority 0; policy accept; }",
            &["jump pol"],
        ),
        (
            "pol-input",
            "{ type filter hook input priority 0; policy accept; }",
            &["jump pol"],
        ),
    ]
}

/// Whether a chain or set of the table belongs to policy (the rest of the planner
/// leaves those to this module).
pub fn owns(name: &str) -> bool {
    name.starts_with("pol") || name.starts_with("pc-")
}

/// The policy objects of the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyObjects {
    /// Interval sets: name → (definition, elements).
    pub sets: BTreeMap<String, (String, BTreeSet<String>)>,
    /// Per-service chains with their rules.
    pub chains: BTreeMap<String, Vec<String>>,
    /// Named counters.
    pub counters: BTreeSet<String>,
    /// Verdict map elements: (map, guarded address) → chain jumped to.
    pub verdicts: BTreeMap<(&'static str, IpAddr), String>,
}

/// The counters of a service chain, by verdict.
const COUNTER_KINDS: [&str; 5] = ["allow", "port", "nomatch", "audit", "unprog"];

/// `in` or `out`.
fn dir(d: Direction) -> &'static str {
    match d {
        Direction::Ingress => "in",
        Direction::Egress => "out",
    }
}

/// The counter of `kind` (`allow`, `port`, `nomatch`, `audit`, `unprog`).
fn counter(d: Direction, kind: &str, key: &ServiceKey) -> String {
    format!("pc-{}-{kind}-{}/{}", dir(d), key.namespace, key.name)
}

/// The verdict map of family `v4` and direction `d`.
fn vmap(d: Direction, v4: bool) -> &'static str {
    match (d, v4) {
        (Direction::Ingress, true) => VMAPS[0].0,
        (Direction::Ingress, false) => VMAPS[1].0,
        (Direction::Egress, true) => VMAPS[2].0,
        (Direction::Egress, false) => VMAPS[3].0,
    }
}

fn set_name(d: Direction, f: char, kind: &str, key: &ServiceKey) -> String {
    format!("pol-{}{f}-{kind}-{}/{}", dir(d), key.namespace, key.name)
}

/// The objects that enforce `plan`; sets hold at most `set_size` elements when
/// given (the kernel refuses more: fail closed).
pub fn objects(plan: &PolicyPlan, set_size: Option<u32>) -> PolicyObjects {
    let mut out = PolicyObjects::default();
    for (addr, guarded) in &plan.endpoints {
        for (d, rules) in [
            (Direction::Ingress, &guarded.ingress),
            (Direction::Egress, &guarded.egress),
        ] {
            let Some(rules) = rules else { continue };
            let key = &rules.service;
            let chain = service_chain(&mut out, d, rules.mode, key, set_size);
            let v4 = addr.is_ipv4();
            out.verdicts.insert((vmap(d, v4), *addr), chain);
            let f = if v4 { '4' } else { '6' };
            let family = |n: &&IpNet| n.addr().is_ipv4() == v4;
            let mut any = Vec::new();
            let mut peers = Vec::new();
            let mut by_port: BTreeMap<(Protocol, u16), Vec<IpNet>> = BTreeMap::new();
            for rule in &rules.rules {
                let nets = rule.peers.iter().filter(family).copied();
                if rule.ports.is_empty() {
                    any.extend(nets);
                    continue;
                }
                let nets: Vec<IpNet> = nets.collect();
                peers.extend(nets.iter().copied());
                for p in &rule.ports {
                    by_port
                        .entry((p.protocol, p.port))
                        .or_default()
                        .extend(nets.iter().copied());
                }
            }
            let elements = |set: &mut PolicyObjects, kind: &str, items: Vec<String>| {
                let name = set_name(d, f, kind, key);
                set.sets
                    .get_mut(&name)
                    .expect("service_chain declares the sets")
                    .1
                    .extend(items);
            };
            let pairs = |nets: Vec<IpNet>| -> Vec<String> {
                IpNet::aggregate(&nets)
                    .into_iter()
                    .map(|n| format!("{addr} . {n}"))
                    .collect()
            };
            elements(&mut out, "any", pairs(any));
            elements(&mut out, "peers", pairs(peers));
            let mut ported = Vec::new();
            for ((protocol, port), nets) in by_port {
                let p = super::ruleset::proto(protocol);
                ported.extend(
                    IpNet::aggregate(&nets)
                        .into_iter()
                        .map(|n| format!("{addr} . {n} . {p} . {port}")),
                );
            }
            elements(&mut out, "ports", ported);
        }
    }
    out
}

/// Declares the chain of `key` in direction `d` and mode `mode`, with its sets and
/// counters; its name.
fn service_chain(
    out: &mut PolicyObjects,
    d: Direction,
    mode: PolicyMode,
    key: &ServiceKey,
    set_size: Option<u32>,
) -> String {
    let m = if mode == PolicyMode::Audit { 'a' } else { 'e' };
    let chain = format!("pol-{}-{m}-{}/{}", dir(d), key.namespace, key.name);
    if out.chains.contains_key(&chain) {
        return chain;
    }
    let (guarded, peer) = match d {
        Direction::Ingress => ("daddr", "saddr"),
        Direction::Egress => ("saddr", "daddr"),
    };
    let size = set_size.map_or_else(String::new, |n| format!(" size {n} ;"));
    let allow = counter(d, "allow", key);
    let mut rules = Vec::new();
    let mut port_rules = Vec::new();
    for (f, ipf, addr_type) in [('4', "ip", "ipv4_addr"), ('6', "ip6", "ipv6_addr")] {
        for (kind, concat) in [
            ("any", format!("{addr_type} . {addr_type}")),
            (
                "ports",
                format!("{addr_type} . {addr_type} . inet_proto . inet_service"),
            ),
            ("peers", format!("{addr_type} . {addr_type}")),
        ] {
            let def = format!("{{ type {concat} ; flags interval ;{size} }}");
            out.sets
                .entry(set_name(d, f, kind, key))
                .or_insert_with(|| (def, BTreeSet::new()));
        }
        let pair = format!("{ipf} {guarded} . {ipf} {peer}");
        let any = set_name(d, f, "any", key);
        let ports = set_name(d, f, "ports", key);
        let peers = set_name(d, f, "peers", key);
        rules.push(format!("{pair} @{any} counter name {allow} return"));
        rules.push(format!(
            "{pair} . meta l4proto . th dport @{ports} counter name {allow} return"
        ));
        port_rules.push(match mode {
            PolicyMode::Enforce => format!(
                "{pair} @{peers} counter name {} drop",
                counter(d, "port", key)
            ),
            PolicyMode::Audit => format!(
                "{pair} @{peers} counter name {} return",
                counter(d, "audit", key)
            ),
        });
    }
    rules.extend(port_rules);
    rules.push(match mode {
        PolicyMode::Enforce => format!("counter name {} drop", counter(d, "nomatch", key)),
        PolicyMode::Audit => format!("counter name {}", counter(d, "audit", key)),
    });
    for kind in COUNTER_KINDS {
        out.counters.insert(counter(d, kind, key));
    }
    out.chains.insert(chain.clone(), rules);
    chain
}

/// Fail closed: every guarded address of `plan` jumps to its service's failure
/// chain, which drops and counts (`policy_unprogrammable`); audit policies pass.
pub fn failed_objects(plan: &PolicyPlan) -> PolicyObjects {
    let mut out = PolicyObjects::default();
    for (addr, guarded) in &plan.endpoints {
        for (d, rules) in [
            (Direction::Ingress, &guarded.ingress),
            (Direction::Egress, &guarded.egress),
        ] {
            let Some(rules) = rules else { continue };
            let key = &rules.service;
            let chain = format!("pol-fail-{}-{}/{}", dir(d), key.namespace, key.name);
            let unprog = counter(d, "unprog", key);
            let rule = match rules.mode {
                PolicyMode::Enforce => format!("counter name {unprog} drop"),
                PolicyMode::Audit => "return".to_owned(),
            };
            out.counters.insert(unprog);
            out.chains.insert(chain.clone(), vec![rule]);
            out.verdicts.insert((vmap(d, addr.is_ipv4()), *addr), chain);
        }
    }
    out
}

/// The policy part of a full sync, after the rest of the table's script (which
/// flushed every existing chain): declares the fixed part, replaces every
/// per-service object, and deletes those of `existing_chains` no longer wanted.
pub fn full_script(new: &PolicyObjects, existing_chains: &BTreeSet<String>) -> String {
    let mut s = String::new();
    for (map, def) in VMAPS {
        let _ = writeln!(s, "add map {TABLE} {map} {{ {def} }}");
        let _ = writeln!(s, "flush map {TABLE} {map}");
    }
    // Sets of old service chains go (their rules were flushed); wanted ones are
    // declared afresh below, so their definitions may change.
    let (old_sets, old_counters) = old_objects(existing_chains);
    for set in &old_sets {
        let _ = writeln!(s, "delete set {TABLE} {set}");
    }
    for c in &new.counters {
        let _ = writeln!(s, "add counter {TABLE} {c}");
    }
    for (name, (def, elements)) in &new.sets {
        let _ = writeln!(s, "add set {TABLE} {name} {def}");
        add_elements(&mut s, name, elements);
    }
    for (name, def, rules) in skeleton() {
        let _ = writeln!(s, "add chain {TABLE} {name} {def}");
        for r in rules {
            let _ = writeln!(s, "add rule {TABLE} {name} {r}");
        }
    }
    for (name, rules) in &new.chains {
        let _ = writeln!(s, "add chain {TABLE} {name}");
        for r in rules {
            let _ = writeln!(s, "add rule {TABLE} {name} {r}");
        }
    }
    add_verdicts(&mut s, new.verdicts.iter());
    let fixed: BTreeSet<&str> = skeleton().iter().map(|(n, _, _)| *n).collect();
    for chain in existing_chains {
        if owns(chain) && !fixed.contains(chain.as_str()) && !new.chains.contains_key(chain) {
            let _ = writeln!(s, "delete chain {TABLE} {chain}");
        }
    }
    for c in old_counters.difference(&new.counters) {
        let _ = writeln!(s, "delete counter {TABLE} {c}");
    }
    s
}

/// The sets and counters that exist with the service chains among `chains` (made
/// and deleted together).
fn old_objects(chains: &BTreeSet<String>) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut sets, mut counters) = (BTreeSet::new(), BTreeSet::new());
    for chain in chains {
        let Some(rest) = chain.strip_prefix("pol-") else {
            continue;
        };
        let Some((d, rest)) = rest.split_once('-') else {
            continue;
        };
        let direction = match d {
            "in" => Direction::Ingress,
            "out" => Direction::Egress,
            _ => continue, // pol-fail-…, pol-forward, …
        };
        let Some(service) = rest.strip_prefix("e-").or_else(|| rest.strip_prefix("a-")) else {
            continue;
        };
        let Some((namespace, name)) = service.split_once('/') else {
            continue;
        };
        let key = ServiceKey::new(namespace, name);
        for f in ['4', '6'] {
            for kind in ["any", "ports", "peers"] {
                sets.insert(set_name(direction, f, kind, &key));
            }
        }
        for kind in COUNTER_KINDS {
            counters.insert(counter(direction, kind, &key));
        }
    }
    for chain in chains {
        // pol-fail-DIR-NS/NAME: its one counter.
        let Some(rest) = chain.strip_prefix("pol-fail-") else {
            continue;
        };
        if let Some((d, service)) = rest.split_once('-') {
            counters.insert(format!("pc-{d}-unprog-{service}"));
        }
    }
    (sets, counters)
}

fn add_elements(s: &mut String, set: &str, elements: &BTreeSet<String>) {
    let items: Vec<&str> = elements.iter().map(String::as_str).collect();
    for chunk in items.chunks(4096) {
        let _ = writeln!(s, "add element {TABLE} {set} {{ {} }}", chunk.join(", "));
    }
}

fn add_verdicts<'a>(
    s: &mut String,
    verdicts: impl Iterator<Item = (&'a (&'static str, IpAddr), &'a String)>,
) {
    for ((map, addr), chain) in verdicts {
        let _ = writeln!(s, "add element {TABLE} {map} {{ {addr} : jump {chain} }}");
    }
}

/// The commands that turn the programmed `old` objects into `new`; empty when
/// they are equal.
pub fn change_script(old: &PolicyObjects, new: &PolicyObjects) -> String {
    let mut s = String::new();
    if old == new {
        return s;
    }
    // 1. Verdicts that change or go, and set elements that go.
    for (key @ (map, addr), chain) in &old.verdicts {
        if new.verdicts.get(key) != Some(chain) {
            let _ = writeln!(s, "delete element {TABLE} {map} {{ {addr} }}");
        }
    }
    for (name, (_, elements)) in &old.sets {
        if let Some((_, new_elements)) = new.sets.get(name) {
            let gone: Vec<&str> = elements
                .difference(new_elements)
                .map(String::as_str)
                .collect();
            if !gone.is_empty() {
                let _ = writeln!(s, "delete element {TABLE} {name} {{ {} }}", gone.join(", "));
            }
        }
    }
    // 2. New counters and sets, and new elements. A set's definition is the same
    //    for the whole run (only the size flag changes it; a start re-declares).
    for c in new.counters.difference(&old.counters) {
        let _ = writeln!(s, "add counter {TABLE} {c}");
    }
    for (name, (def, elements)) in &new.sets {
        match old.sets.get(name) {
            None => {
                let _ = writeln!(s, "add set {TABLE} {name} {def}");
                add_elements(&mut s, name, elements);
            }
            Some((_, old_elements)) => {
                let added: BTreeSet<String> = elements.difference(old_elements).cloned().collect();
                add_elements(&mut s, name, &added);
            }
        }
    }
    // 3. Chains that are new or changed.
    for (name, rules) in &new.chains {
        match old.chains.get(name) {
            Some(old_rules) if old_rules == rules => continue,
            Some(_) => {
                let _ = writeln!(s, "flush chain {TABLE} {name}");
            }
            None => {
                let _ = writeln!(s, "add chain {TABLE} {name}");
            }
        }
        for r in rules {
            let _ = writeln!(s, "add rule {TABLE} {name} {r}");
        }
    }
    // 4. Verdicts that are new or changed.
    add_verdicts(
        &mut s,
        new.verdicts
            .iter()
            .filter(|(key, chain)| old.verdicts.get(key) != Some(chain)),
    );
    // 5. What is gone.
    for name in old.chains.keys().filter(|c| !new.chains.contains_key(*c)) {
        let _ = writeln!(s, "delete chain {TABLE} {name}");
    }
    for name in old.sets.keys().filter(|n| !new.sets.contains_key(*n)) {
        let _ = writeln!(s, "delete set {TABLE} {name}");
    }
    for c in old.counters.difference(&new.counters) {
        let _ = writeln!(s, "delete counter {TABLE} {c}");
    }
    s
}

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
        *out.entry((ServiceKey::new(namespace, svc), direction, verdict))
            .or_default() += n;
    }
    out
}

#[cfg(test)]
mod tests;
