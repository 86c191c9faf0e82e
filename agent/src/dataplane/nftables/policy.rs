//! Network policy in table `inet rune`: the objects a [`PolicyPlan`] needs, and the
//! commands that get there from what was programmed. Pure: no process, no kernel.
//!
//! * Base chains `pol-forward`, `pol-output`, `pol-input` (filter, priority 0,
//!   after DNAT: VIP traffic is checked on its chosen backend) jump to `pol`, which
//!   accepts established and related packets (replies of allowed connections) and
//!   IPv6 neighbour and router discovery, then jumps to `pol-out` (egress: the
//!   source is guarded) and `pol-in` (ingress: the destination is guarded).
//! * Those look the guarded address up in a hash verdict map per direction and
//!   family (`pol-in4`, `pol-in6`, `pol-out4`, `pol-out6`), whose element `goto`s
//!   the check chain of the address's group ([`layout`]): the addresses of a
//!   service with the same rules share one chain and its small sets, named after
//!   the group `G` (`in4-e1-shop/web`): per port rule `pol-pI-G`, its peers (a
//!   single-field interval set, aggregated: interval sets refuse overlaps), and
//!   `pol-any-G`, the peers of the rule for every port; the ports of port rule I
//!   are in `pol-in4-qI`, guarded address . protocol . port (a hash set shared by
//!   the direction and family's groups: target ports may differ per endpoint, and
//!   fewer sets keep the kernel's by-name set lookups short).
//!   The check chain tries the rules (`goto pol-ok-…`), then the peers of the port
//!   rules (`goto pol-port-…`: `port_not_allowed`), else `goto pol-nomatch-…`.
//! * The verdict chains of a service and mode count (named counters
//!   `pc-DIR-KIND-NS/NAME`) and return (allowed, or audit) or drop; a return from
//!   a goto'd chain ends that direction's check, so a packet between two guarded
//!   addresses is checked both ways. The refusing chains first log the packet,
//!   rate-limited, to NFLOG for `observe` (`super::nflog`).
//! * Fail closed ([`failed_objects`]): when the kernel refuses the policy, each
//!   guarded address `goto`s `pol-fail-DIR-NS/NAME`, which counts and drops (audit
//!   policies: returns).
//!
//! A change touches only the guarded addresses the plan's change names
//! ([`Programmed`]): new peers or ports are element commands, which go to the
//! kernel as one netlink batch (`super::netlink`); a group's first address or
//! its last (chains and sets made or deleted) takes `nft -f`.

use super::ruleset::{TABLE, is_policy_chain};
use crate::{
    model::{PolicyMode, ServiceKey},
    policy::{
        PolicyPlan,
        metrics::{Direction, DropReason},
    },
};
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
};

/// The verdict maps, guarded address → `goto` its group's check chain:
/// `pol-{in,out}{4,6}`.
fn maps() -> Vec<(String, &'static str)> {
    let mut out = Vec::new();
    for d in ["in", "out"] {
        for (f, addr) in [('4', "ipv4_addr"), ('6', "ipv6_addr")] {
            out.push((format!("pol-{d}{f}"), addr));
        }
    }
    out
}

/// The fixed chains: name, definition, rules.
fn skeleton() -> Vec<(String, &'static str, Vec<String>)> {
    // Chains before the rules that jump to them.
    let mut out = Vec::new();
    for (d, guarded) in [("in", "daddr"), ("out", "saddr")] {
        let rules = [('4', "ip"), ('6', "ip6")]
            .map(|(f, ipf)| format!("{ipf} {guarded} vmap @pol-{d}{f}"))
            .to_vec();
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

/// The policy objects of the table, or of a part of it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyObjects {
    /// Set and map elements: (set, key) → the chain a map element goes to (`None`
    /// in a set).
    pub elements: BTreeMap<(String, PolicyKey), Option<String>>,
    /// Sets with their definition.
    pub sets: BTreeMap<String, String>,
    /// Chains with their rules.
    pub chains: BTreeMap<String, Vec<String>>,
    /// Named counters.
    pub counters: BTreeSet<String>,
}

impl PolicyObjects {
    /// Adds `other` to these objects.
    pub fn extend(&mut self, other: &PolicyObjects) {
        self.elements
            .extend(other.elements.iter().map(|(k, v)| (k.clone(), v.clone())));
        self.sets
            .extend(other.sets.iter().map(|(k, v)| (k.clone(), v.clone())));
        self.chains
            .extend(other.chains.iter().map(|(k, v)| (k.clone(), v.clone())));
        self.counters.extend(other.counters.iter().cloned());
    }
}

/// The counters the verdict chains of a service in `mode` count in (the failure
/// chain's is `unprog`); the metrics show the other verdicts as 0.
fn counter_kinds(mode: PolicyMode) -> &'static [&'static str] {
    match mode {
        PolicyMode::Enforce => &["allow", "port", "nomatch"],
        PolicyMode::Audit => &["allow", "audit"],
    }
}

/// `in` or `out`.
fn dir(d: Direction) -> &'static str {
    match d {
        Direction::Ingress => "in",
        Direction::Egress => "out",
    }
}

/// The counter of `kind` (`allow`, `port`, `nomatch`, `audit` or `unprog`).
fn counter(d: Direction, kind: &str, key: &ServiceKey) -> String {
    format!("pc-{}-{kind}-{}/{}", dir(d), key.namespace, key.name)
}

/// The fail-closed chain of service `key` in direction `d`.
fn fail_chain(d: Direction, key: &ServiceKey) -> String {
    format!("pol-fail-{}-{}/{}", dir(d), key.namespace, key.name)
}

/// The objects that enforce `plan`; refused (and audit would-drop) packets are
/// logged to NFLOG `log_group` when given (see `super::nflog`).
pub fn objects(plan: &PolicyPlan, log_group: Option<u16>) -> PolicyObjects {
    let kind = Objects::Rules {
        log_group,
        size: None,
    };
    Programmed::build(plan, kind).objects()
}

/// Fail closed: every guarded address of `plan` goes to its service's failure
/// chain, which drops and counts (`policy_unprogrammable`); audit policies pass.
pub fn failed_objects(plan: &PolicyPlan) -> PolicyObjects {
    Programmed::build(plan, Objects::Failed).objects()
}

/// Declares the verdict chains of `key` in direction `d` and mode `mode` with
/// their counters: allowed, peer without its port, nothing matched. The two
/// refusing chains first log the packet (rate-limited) to NFLOG `log_group`.
fn verdict_chains(
    out: &mut PolicyObjects,
    d: Direction,
    mode: PolicyMode,
    key: &ServiceKey,
    log_group: Option<u16>,
) -> [String; 3] {
    let m = layout::mode_letter(mode);
    let name = |what: &str| format!("pol-{what}-{}-{m}-{}/{}", dir(d), key.namespace, key.name);
    let names = [name("ok"), name("port"), name("nomatch")];
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
    for kind in counter_kinds(mode) {
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

/// Whether chain `name` is a group's check chain (deleted before the chains it
/// goes to).
fn is_check_chain(name: &str) -> bool {
    name.starts_with("pol-c-")
}

/// The policy part of a full sync, after the rest of the table's script (which
/// flushed every existing chain): declares the fixed part with verdict maps of at
/// most `size` elements, replaces every per-service object, and deletes those of
/// `existing_chains` no longer wanted (with the sets and counters that came with
/// them).
pub fn full_script(
    new: &PolicyObjects,
    existing_chains: &BTreeSet<String>,
    size: Option<u32>,
) -> String {
    let mut s = String::new();
    retire_earlier_maps(&mut s);
    let size = size.map_or_else(String::new, |n| format!(" size {n} ;"));
    for (map, addr) in maps() {
        let _ = writeln!(
            s,
            "add map {TABLE} {map} {{ type {addr} : verdict ;{size} }}"
        );
        let _ = writeln!(s, "flush map {TABLE} {map}");
    }
    for c in &new.counters {
        let _ = writeln!(s, "add counter {TABLE} {c}");
    }
    let old = old_objects(existing_chains);
    for (name, def) in &new.sets {
        let _ = writeln!(s, "add set {TABLE} {name} {def}");
        if old.sets.contains_key(name) {
            let _ = writeln!(s, "flush set {TABLE} {name}");
        }
    }
    for name in new.chains.keys() {
        let _ = writeln!(s, "add chain {TABLE} {name}");
    }
    for (name, rules) in &new.chains {
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
    let mut gone: Vec<&String> = existing_chains
        .iter()
        .filter(|c| is_policy_chain(c) && !fixed.contains(*c) && !new.chains.contains_key(*c))
        .collect();
    gone.sort_by_key(|c| !is_check_chain(c));
    for chain in gone {
        let _ = writeln!(s, "delete chain {TABLE} {chain}");
    }
    for set in old.sets.keys().filter(|n| !new.sets.contains_key(*n)) {
        let _ = writeln!(s, "delete set {TABLE} {set}");
    }
    for c in old.counters.difference(&new.counters) {
        let _ = writeln!(s, "delete counter {TABLE} {c}");
    }
    s
}

/// The shared interval maps of the earlier layout (`pol-{in,out}{4,6}-{any,ports,peers}`,
/// keyed by guarded address . peer): a table adopted from an agent of that layout
/// still holds them, their elements `goto` verdict chains this layout deletes by
/// the same names, and the kernel refuses to delete a chain a map still jumps to.
/// Each is declared as it was (a no-op when present, made when absent) and
/// deleted, first in the full sync; the flush of every chain before it has
/// already unbound them from their lookup rules.
fn retire_earlier_maps(s: &mut String) {
    for d in ["in", "out"] {
        for (f, addr) in [('4', "ipv4_addr"), ('6', "ipv6_addr")] {
            for (kind, key) in [
                ("any", "A . A"),
                ("ports", "A . A . inet_proto . inet_service"),
                ("peers", "A . A"),
            ] {
                let (name, key) = (format!("pol-{d}{f}-{kind}"), key.replace('A', addr));
                let _ = writeln!(
                    s,
                    "add map {TABLE} {name} {{ type {key} : verdict ; flags interval ; }}"
                );
                let _ = writeln!(s, "delete map {TABLE} {name}");
            }
        }
    }
}

/// The sets and counters that exist with the per-service chains among `chains`
/// (made and deleted together).
fn old_objects(chains: &BTreeSet<String>) -> PolicyObjects {
    let mut out = PolicyObjects::default();
    for chain in chains {
        if let Some(group) = chain.strip_prefix("pol-c-") {
            let Some((any, rules)) = layout::sets(group) else {
                continue;
            };
            for set in any
                .into_iter()
                .chain(rules.into_iter().flat_map(|(p, q)| [p, q]))
            {
                out.sets.insert(set, String::new());
            }
            continue;
        }
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
                // A second failure chain of one service (`NS/NAME.2`: its audit and
                // enforce addresses) counts into the service's one counter. Names
                // are DNS labels, so a dot starts the suffix.
                let service = rest.split_once('.').map_or(rest, |(s, _)| s);
                out.counters.insert(format!("pc-{d}-unprog-{service}"));
                continue;
            }
            "ok" | "port" | "nomatch" => rest,
            _ => continue,
        };
        let (mode, service) = match service.split_once('-') {
            Some(("a", service)) => (PolicyMode::Audit, service),
            Some(("e", service)) => (PolicyMode::Enforce, service),
            _ => continue,
        };
        for kind in counter_kinds(mode) {
            out.counters.insert(format!("pc-{d}-{kind}-{service}"));
        }
    }
    out
}

/// Writes `elements` as `add element` commands, one per set (in chunks).
fn add_elements<'a>(
    s: &mut String,
    elements: impl Iterator<Item = (&'a (String, PolicyKey), &'a Option<String>)>,
) {
    let mut by_set: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for ((set, key), chain) in elements {
        by_set.entry(set).or_default().push(match chain {
            Some(chain) => format!("{key} : goto {chain}"),
            None => key.to_string(),
        });
    }
    for (set, items) in by_set {
        for chunk in items.chunks(4096) {
            let _ = writeln!(s, "add element {TABLE} {set} {{ {} }}", chunk.join(", "));
        }
    }
}

mod counts;
mod diff;
pub(super) mod key;
mod layout;
mod programmed;

pub use counts::verdict_counts;
pub use key::PolicyKey;
pub use programmed::{Objects, Pending, Programmed};

#[cfg(test)]
mod tests;
