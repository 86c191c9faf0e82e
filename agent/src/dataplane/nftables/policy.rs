//! Network policy in table `inet rune`: the objects a [`PolicyPlan`] needs, and the
//! commands that get there from what was programmed. Pure: no process, no kernel.
//!
//! * Base chains `pol-forward`, `pol-output`, `pol-input` (filter, priority 0,
//!   after DNAT: VIP traffic is checked on its chosen backend) jump to `pol`, which
//!   accepts established and related packets (replies of allowed connections) and
//!   IPv6 neighbour and router discovery, then
//!   jumps to `pol-out` (egress: the source is guarded) and `pol-in` (ingress: the
//!   destination is guarded).
//! * Each of those looks the packet up in shared interval verdict maps keyed by
//!   guarded address . peer prefix: `pol-in4-any` (rules for every port),
//!   `pol-in4-ports` (also . protocol . port), `pol-in4-peers` (peers of port rules,
//!   telling `port_not_allowed` from `no_matching_rule`) and last `pol-in4` (the
//!   guarded address alone: nothing matched). Each element `goto`s a small chain of
//!   the reporting service and mode that counts (named counters
//!   `pc-DIR-KIND-NS/NAME`) and returns (allowed, or audit) or drops; a return
//!   from a goto'd chain ends that direction's check, so a packet between two
//!   guarded addresses is checked both ways. The refusing chains first log the
//!   packet, rate-limited, to NFLOG for `observe` (`super::nflog`).
//! * Only the sixteen lookup rules bind the maps (binding walks a map's elements):
//!   a full sync is elements and one-rule chains, and a change is elements (plus
//!   the chains of a service's first policy).
//! * Fail closed ([`failed_objects`]): when the kernel refuses the policy, each
//!   guarded address `goto`s `pol-fail-DIR-NS/NAME`, which counts and drops (audit
//!   policies: returns).
//!
//! * A change touches only the guarded addresses the plan's change names
//!   ([`Programmed`] keeps the objects per address and the chains' use counts).
//!
//! Interval maps refuse overlapping keys, so each peer list is the aggregate of its
//! prefixes (contained prefixes dropped, neighbours merged).

use super::ruleset::{TABLE, is_policy_chain};
use crate::{
    model::{PolicyMode, Protocol, ServiceKey},
    policy::{
        GuardedEndpoint, PolicyPlan,
        metrics::{Direction, DropReason},
    },
};
use ipnet::IpNet;
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

/// The lookup kinds in check order, each with its key type (`A` stands for the
/// family's address type).
const KINDS: [(&str, &str); 4] = [
    ("-any", "A . A"),
    ("-ports", "A . A . inet_proto . inet_service"),
    ("-peers", "A . A"),
    ("", "A"),
];

/// Every verdict map: `pol-{in,out}{4,6}{kind}`.
fn maps() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for d in ["in", "out"] {
        for (f, addr) in [('4', "ipv4_addr"), ('6', "ipv6_addr")] {
            for (kind, key) in KINDS {
                out.push((format!("pol-{d}{f}{kind}"), key.replace('A', addr)));
            }
        }
    }
    out
}

/// A map's definition, bounded by `size` when given.
fn map_definition(name: &str, key: &str, size: Option<u32>) -> String {
    let interval = if name.ends_with(['4', '6']) {
        ""
    } else {
        " flags interval ;"
    };
    let size = size.map_or_else(String::new, |n| format!(" size {n} ;"));
    format!("{{ type {key} : verdict ;{interval}{size} }}")
}

/// The fixed chains: name, definition, rules.
fn skeleton() -> Vec<(String, &'static str, Vec<String>)> {
    // Chains before the rules that jump to them.
    let mut out = Vec::new();
    for (d, guarded, peer) in [("in", "daddr", "saddr"), ("out", "saddr", "daddr")] {
        let mut rules = Vec::new();
        for (kind, _) in KINDS {
            for (f, ipf) in [('4', "ip"), ('6', "ip6")] {
                let key = match kind {
                    "-ports" => format!("{ipf} {guarded} . {ipf} {peer} . meta l4proto . th dport"),
                    "" => format!("{ipf} {guarded}"),
                    _ => format!("{ipf} {guarded} . {ipf} {peer}"),
                };
                rules.push(format!("{key} vmap @pol-{d}{f}{kind}"));
            }
        }
        out.push((format!("pol-{d}"), "", rules));
    }
    out.push((
        "pol".to_owned(),
        "",
        vec![
            "ct state established,related accept".to_owned(),
            // IPv6 neighbour discovery is the link's, not a peer's: without it a
            // guarded address's neighbour entries fail and allowed traffic stops.
            "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert, nd-router-solicit, \
             nd-router-advert } accept"
                .to_owned(),
            "jump pol-out".to_owned(),
            "jump pol-in".to_owned(),
        ],
    ));
    for hook in ["forward", "output", "input"] {
        out.push((
            format!("pol-{hook}"),
            match hook {
                "forward" => "{ type filter hook forward priority 0; policy accept; }",
                "output" => "{ type filter hook output priority 0; policy accept; }",
                _ => "{ type filter hook input priority 0; policy accept; }",
            },
            vec!["jump pol".to_owned()],
        ));
    }
    out
}

/// The policy objects of the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyObjects {
    /// Verdict map elements: (map, key) → the chain they go to.
    pub elements: BTreeMap<(String, String), String>,
    /// Per-service chains with their rules.
    pub chains: BTreeMap<String, Vec<String>>,
    /// Named counters.
    pub counters: BTreeSet<String>,
}

/// The counters of a service, by verdict.
const COUNTER_KINDS: [&str; 5] = ["allow", "port", "nomatch", "audit", "unprog"];

/// `in` or `out`.
fn dir(d: Direction) -> &'static str {
    match d {
        Direction::Ingress => "in",
        Direction::Egress => "out",
    }
}

/// The counter of `kind` (one of [`COUNTER_KINDS`]).
fn counter(d: Direction, kind: &str, key: &ServiceKey) -> String {
    format!("pc-{}-{kind}-{}/{}", dir(d), key.namespace, key.name)
}

/// The objects that enforce `plan`; refused (and audit would-drop) packets are
/// logged to NFLOG `log_group` when given (see `super::nflog`).
pub fn objects(plan: &PolicyPlan, log_group: Option<u16>) -> PolicyObjects {
    every_address(plan, |out, addr, guarded| {
        address_objects(out, addr, guarded, log_group)
    })
}

/// The objects `add` gives each guarded address of `plan`, together.
fn every_address(
    plan: &PolicyPlan,
    add: impl Fn(&mut PolicyObjects, IpAddr, &GuardedEndpoint),
) -> PolicyObjects {
    let mut out = PolicyObjects::default();
    for (addr, guarded) in &plan.endpoints {
        add(&mut out, *addr, guarded);
    }
    out
}

/// Adds the objects that enforce the rules of guarded address `addr` to `out`:
/// its elements (each keyed by the address first) and the chains and counters
/// they go to (whose refusals log to NFLOG `log_group` when given).
pub fn address_objects(
    out: &mut PolicyObjects,
    addr: IpAddr,
    guarded: &GuardedEndpoint,
    log_group: Option<u16>,
) {
    for (d, rules) in [
        (Direction::Ingress, &guarded.ingress),
        (Direction::Egress, &guarded.egress),
    ] {
        let Some(rules) = rules else { continue };
        let [ok, port, nomatch] = service_chains(out, d, rules.mode, &rules.service, log_group);
        let v4 = addr.is_ipv4();
        let map = |kind: &str| format!("pol-{}{}{kind}", dir(d), if v4 { '4' } else { '6' });
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
        for n in IpNet::aggregate(&any) {
            out.elements
                .insert((map("-any"), format!("{addr} . {n}")), ok.clone());
        }
        for ((protocol, p), nets) in by_port {
            let proto = super::ruleset::proto(protocol);
            for n in IpNet::aggregate(&nets) {
                let key = format!("{addr} . {n} . {proto} . {p}");
                out.elements.insert((map("-ports"), key), ok.clone());
            }
        }
        for n in IpNet::aggregate(&peers) {
            out.elements
                .insert((map("-peers"), format!("{addr} . {n}")), port.clone());
        }
        out.elements.insert((map(""), addr.to_string()), nomatch);
    }
}

/// Declares the verdict chains of `key` in direction `d` and mode `mode` with
/// their counters: allowed, peer without its port, nothing matched. The two
/// refusing chains first log the packet (rate-limited) to NFLOG `log_group`.
fn service_chains(
    out: &mut PolicyObjects,
    d: Direction,
    mode: PolicyMode,
    key: &ServiceKey,
    log_group: Option<u16>,
) -> [String; 3] {
    let m = if mode == PolicyMode::Audit { 'a' } else { 'e' };
    let name = |what: &str| format!("pol-{what}-{}-{m}-{}/{}", dir(d), key.namespace, key.name);
    let names = [name("ok"), name("port"), name("nomatch")];
    if out.chains.contains_key(&names[0]) {
        return names;
    }
    let deny = |reason: DropReason, kind: &str| {
        let log = log_group.map(|group| super::nflog::log_rule(group, d, reason, mode, key));
        log.into_iter()
            .chain([deny_rule(d, mode, kind, key)])
            .collect()
    };
    let rules = [
        vec![format!("counter name {} return", counter(d, "allow", key))],
        deny(DropReason::PortNotAllowed, "port"),
        deny(DropReason::NoMatchingRule, "nomatch"),
    ];
    for (chain, rules) in names.iter().zip(rules) {
        out.chains.insert(chain.clone(), rules);
    }
    for kind in COUNTER_KINDS {
        out.counters.insert(counter(d, kind, key));
    }
    names
}

/// The verdict rule of a chain that refuses a packet of service `key` in direction
/// `d` for `reason` (`port`, `nomatch` or `unprog`, each counted under its own
/// counter): enforce drops, audit counts a would-be drop and returns (the
/// failure chain of an audit policy just returns). Every policy drop is
/// rendered here.
fn deny_rule(d: Direction, mode: PolicyMode, reason: &str, key: &ServiceKey) -> String {
    match (mode, reason) {
        (PolicyMode::Enforce, _) => format!("counter name {} drop", counter(d, reason, key)),
        (PolicyMode::Audit, "unprog") => "return".to_owned(),
        (PolicyMode::Audit, _) => format!("counter name {} return", counter(d, "audit", key)),
    }
}

/// Fail closed: every guarded address of `plan` goes to its service's failure
/// chain, which drops and counts (`policy_unprogrammable`); audit policies pass.
pub fn failed_objects(plan: &PolicyPlan) -> PolicyObjects {
    every_address(plan, failed_address_objects)
}

/// Adds the fail-closed objects of guarded address `addr` to `out`.
pub fn failed_address_objects(out: &mut PolicyObjects, addr: IpAddr, guarded: &GuardedEndpoint) {
    for (d, rules) in [
        (Direction::Ingress, &guarded.ingress),
        (Direction::Egress, &guarded.egress),
    ] {
        let Some(rules) = rules else { continue };
        let key = &rules.service;
        let chain = format!("pol-fail-{}-{}/{}", dir(d), key.namespace, key.name);
        let unprog = counter(d, "unprog", key);
        let rule = deny_rule(d, rules.mode, "unprog", key);
        out.counters.insert(unprog);
        out.chains.insert(chain.clone(), vec![rule]);
        let f = if addr.is_ipv4() { '4' } else { '6' };
        out.elements
            .insert((format!("pol-{}{f}", dir(d)), addr.to_string()), chain);
    }
}

/// The policy part of a full sync, after the rest of the table's script (which
/// flushed every existing chain): declares the fixed part with maps of at most
/// `size` elements, replaces every per-service object, and deletes those of
/// `existing_chains` no longer wanted.
pub fn full_script(
    new: &PolicyObjects,
    existing_chains: &BTreeSet<String>,
    size: Option<u32>,
) -> String {
    let mut s = String::new();
    for (map, key) in maps() {
        let def = map_definition(&map, &key, size);
        let _ = writeln!(s, "add map {TABLE} {map} {def}");
        let _ = writeln!(s, "flush map {TABLE} {map}");
    }
    for c in &new.counters {
        let _ = writeln!(s, "add counter {TABLE} {c}");
    }
    for (name, rules) in &new.chains {
        let _ = writeln!(s, "add chain {TABLE} {name}");
        for r in rules {
            let _ = writeln!(s, "add rule {TABLE} {name} {r}");
        }
    }
    for (name, def, rules) in skeleton() {
        let _ = writeln!(s, "add chain {TABLE} {name} {def}");
        for r in rules {
            let _ = writeln!(s, "add rule {TABLE} {name} {r}");
        }
    }
    add_elements(&mut s, new.elements.iter());
    let fixed: BTreeSet<String> = skeleton().into_iter().map(|(n, _, _)| n).collect();
    for chain in existing_chains {
        if is_policy_chain(chain) && !fixed.contains(chain) && !new.chains.contains_key(chain) {
            let _ = writeln!(s, "delete chain {TABLE} {chain}");
        }
    }
    for c in old_counters(existing_chains).difference(&new.counters) {
        let _ = writeln!(s, "delete counter {TABLE} {c}");
    }
    s
}

/// The counters that exist with the per-service chains among `chains` (made and
/// deleted together).
fn old_counters(chains: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for chain in chains {
        let Some(rest) = chain.strip_prefix("pol-") else {
            continue;
        };
        let Some((what, rest)) = rest.split_once('-') else {
            continue;
        };
        let Some((d, rest)) = rest.split_once('-') else {
            continue;
        };
        let service = match what {
            "fail" => {
                out.insert(format!("pc-{d}-unprog-{rest}"));
                continue;
            }
            "ok" | "port" | "nomatch" => rest.get(2..).unwrap_or_default(),
            _ => continue,
        };
        for kind in COUNTER_KINDS {
            out.insert(format!("pc-{d}-{kind}-{service}"));
        }
    }
    out
}

fn add_elements<'a>(
    s: &mut String,
    elements: impl Iterator<Item = (&'a (String, String), &'a String)>,
) {
    let mut by_map: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for ((map, key), chain) in elements {
        by_map
            .entry(map)
            .or_default()
            .push(format!("{key} : goto {chain}"));
    }
    for (map, items) in by_map {
        for chunk in items.chunks(4096) {
            let _ = writeln!(s, "add element {TABLE} {map} {{ {} }}", chunk.join(", "));
        }
    }
}

mod counts;
mod programmed;

pub use counts::verdict_counts;
pub use programmed::{Objects, Pending, Programmed};

#[cfg(test)]
mod tests;
