//! The desired content of table `inet rune`, and the `nft` script that gets the
//! kernel there from what was programmed before. Pure: no process, no kernel.
//!
//! Layout: few chains, and per-service state only in map elements, so that a change
//! of one service is a handful of element commands the kernel applies without
//! re-validating any chain.
//!
//! * maps `service-vips` / `service-vips6` (with a counter per element: new flows of
//!   each service port): `VIP . proto . port : goto pick4-N` for a port with N
//!   eligible backends; `no-endpoints` / `no-endpoints6`: the same keys `: goto
//!   reject-service` for ports that refuse;
//! * data maps `backends4-tcp`, `backends4-udp`, `backends6-tcp`, `backends6-udp`:
//!   `VIP . port . i : addr . port` for backend `i` (0..N) of each balanced port;
//! * one shared chain per family and backend count in use (`pick4-N`, `pick6-N`),
//!   one rule per protocol: `dnat ip to ip daddr . tcp dport . numgen random mod N
//!   map @backends4-tcp`. Only these few rules bind the data maps (binding a map to
//!   a rule walks its elements);
//! * base chains `nat-prerouting` / `nat-output` (nat, dstnat) jump to `services`,
//!   which looks the packet up in the service maps; `filter-prerouting` /
//!   `filter-output` (filter, dstnat − 10) send new connections to refusing ports to
//!   `reject-service` (TCP reset / ICMP port unreachable, counted);
//! * with ClientIP affinity (which the shared chains cannot express), the port keeps
//!   a chain of its own (`svc4-NS/NAME/tcp/80`): per endpoint a set of client
//!   addresses with the affinity timeout (`aff4-…`) and a chain (`ep4-…`) that
//!   refreshes it and DNATs; known clients go to their endpoint, the rest are
//!   balanced by a `numgen` cascade.
//!
//! Every element, and every chain but the shared ones, belongs to one service, so a
//! change of one service produces commands for that service's objects only (plus a
//! `pick` chain the first time a backend count is used).

use crate::{
    dataplane::vip,
    endpoints::{Delta, ServiceView},
    model::{Protocol, ServiceKey, SessionAffinity},
};
mod objects;

pub use objects::*;
use objects::{pick_chain_rules, picks_used};

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt::{self, Write as _},
    net::{IpAddr, SocketAddr},
};

/// The table's family and name: everything we program lives in it.
pub const TABLE: &str = "inet rune";
/// The table's name alone (as `nft -j` reports it).
pub const TABLE_NAME: &str = "rune";
/// The chain that refuses connections to ports without endpoints.
pub const REJECT_CHAIN: &str = "reject-service";

/// The IPv4 service map (`VIP . proto . port : verdict`, a counter per element).
pub const SERVICE_MAP_V4: &str = "service-vips";
/// The IPv6 service map.
pub const SERVICE_MAP_V6: &str = "service-vips6";
const REFUSE_MAP_V4: &str = "no-endpoints";
const REFUSE_MAP_V6: &str = "no-endpoints6";
/// The data maps, `VIP . port . index : backend addr . port`, one per family and
/// protocol (`backends4-tcp` …).
pub const BACKEND_MAPS: [&str; 4] = [
    "backends4-tcp",
    "backends4-udp",
    "backends6-tcp",
    "backends6-udp",
];

/// Maps that hold per-service elements (flushed and refilled by a full sync).
pub const ELEMENT_MAPS: [&str; 8] = [
    SERVICE_MAP_V4,
    SERVICE_MAP_V6,
    REFUSE_MAP_V4,
    REFUSE_MAP_V6,
    BACKEND_MAPS[0],
    BACKEND_MAPS[1],
    BACKEND_MAPS[2],
    BACKEND_MAPS[3],
];

/// The data map of family `f` (`'4'`/`'6'`) and protocol `p` (`tcp`/`udp`).
fn backend_map(f: char, p: &str) -> &'static str {
    match (f, p) {
        ('4', "tcp") => BACKEND_MAPS[0],
        ('4', _) => BACKEND_MAPS[1],
        (_, "tcp") => BACKEND_MAPS[2],
        _ => BACKEND_MAPS[3],
    }
}

/// The definitions of [`ELEMENT_MAPS`]. The data maps are declared with `typeof`
/// (numgen's type has no name), one per protocol: the `tcp dport` / `udp dport`
/// of the map's value makes nft add that protocol as a dependency to the rule
/// that uses it (and nft 1.0.6 cannot read back a `th dport` value type).
fn map_definitions() -> [(&'static str, &'static str); 8] {
    [
        (
            SERVICE_MAP_V4,
            "type ipv4_addr . inet_proto . inet_service : verdict ; counter ;",
        ),
        (
            SERVICE_MAP_V6,
            "type ipv6_addr . inet_proto . inet_service : verdict ; counter ;",
        ),
        (
            REFUSE_MAP_V4,
            "type ipv4_addr . inet_proto . inet_service : verdict ;",
        ),
        (
            REFUSE_MAP_V6,
            "type ipv6_addr . inet_proto . inet_service : verdict ;",
        ),
        (
            BACKEND_MAPS[0],
            "typeof ip daddr . tcp dport . numgen random mod 1 : ip daddr . tcp dport ;",
        ),
        (
            BACKEND_MAPS[1],
            "typeof ip daddr . udp dport . numgen random mod 1 : ip daddr . udp dport ;",
        ),
        (
            BACKEND_MAPS[2],
            "typeof ip6 daddr . tcp dport . numgen random mod 1 : ip6 daddr . tcp dport ;",
        ),
        (
            BACKEND_MAPS[3],
            "typeof ip6 daddr . udp dport . numgen random mod 1 : ip6 daddr . udp dport ;",
        ),
    ]
}

/// The shared chain that balances over `n` backends of family `f` (`'4'`/`'6'`).
pub fn pick_chain(f: char, n: usize) -> String {
    format!("pick{f}-{n}")
}

/// The rules of [`pick_chain`], one per protocol: backend `numgen random mod n` of
/// the packet's service port, looked up in the protocol's data map.
fn pick_rules(f: char, n: usize) -> Vec<String> {
    let ipf = if f == '4' { "ip" } else { "ip6" };
    ["tcp", "udp"]
        .into_iter()
        .map(|p| {
            let map = backend_map(f, p);
            format!("dnat {ipf} to {ipf} daddr . {p} dport . numgen random mod {n} map @{map}")
        })
        .collect()
}

/// Whether `chain` is a shared pick chain.
fn is_pick_chain(chain: &str) -> bool {
    chain.starts_with("pick4-") || chain.starts_with("pick6-")
}

/// The fixed part of the table: maps, dispatch and hook chains with their rules.
/// Chains are listed with their definition (hook or none) and rules.
fn skeleton() -> Vec<(&'static str, &'static str, &'static [&'static str])> {
    vec![
        (
            REJECT_CHAIN,
            "",
            &[
                "counter",
                "meta l4proto tcp reject with tcp reset",
                "reject",
            ],
        ),
        (
            "services",
            "",
            &[
                "ip daddr . meta l4proto . th dport vmap @service-vips",
                "ip6 daddr . meta l4proto . th dport vmap @service-vips6",
            ],
        ),
        (
            "refuse-check",
            "",
            &[
                "ip daddr . meta l4proto . th dport vmap @no-endpoints",
                "ip6 daddr . meta l4proto . th dport vmap @no-endpoints6",
            ],
        ),
        (
            "nat-prerouting",
            "{ type nat hook prerouting priority -100; policy accept; }",
            &["jump services"],
        ),
        (
            "nat-output",
            "{ type nat hook output priority -100; policy accept; }",
            &["jump services"],
        ),
        (
            "filter-prerouting",
            "{ type filter hook prerouting priority -110; policy accept; }",
            &["ct state new jump refuse-check"],
        ),
        (
            "filter-output",
            "{ type filter hook output priority -110; policy accept; }",
            &["ct state new jump refuse-check"],
        ),
    ]
}

/// Names of the chains of the fixed part.
pub fn skeleton_chains() -> BTreeSet<&'static str> {
    skeleton().into_iter().map(|(name, _, _)| name).collect()
}

/// What is in the kernel's table before a full sync (names only), for adoption.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Existing {
    /// Whether the table exists at all.
    pub table: bool,
    /// Every chain in it.
    pub chains: BTreeSet<String>,
    /// Every set and map in it.
    pub sets: BTreeSet<String>,
}

/// The table as last programmed, and the planner of the next transaction.
#[derive(Debug, Default)]
pub struct Ruleset {
    node: String,
    services: HashMap<ServiceKey, ServiceObjects>,
    /// Which service holds each map element (a VIP may move between services).
    owners: HashMap<(&'static str, ElementKey), ServiceKey>,
    /// The shared pick chains in the kernel (kept once made, until a full sync).
    picks: BTreeSet<String>,
}

/// One transaction, and the state it leads to once the kernel took it.
#[derive(Debug)]
pub struct Plan {
    /// The `nft -f` script (empty when nothing changes).
    pub script: String,
    /// The same transaction as element commands when it holds nothing else (a
    /// change of elements only, not a full sync), in the script's order; `None`
    /// otherwise.
    pub element_ops: Option<Vec<ElementOp>>,
    next: Vec<(ServiceKey, Option<ServiceObjects>)>,
    /// Pick chains this transaction makes (full: every pick chain after it).
    picks: BTreeSet<String>,
    full: bool,
}

impl Plan {
    /// Whether the transaction changes nothing.
    pub fn is_empty(&self) -> bool {
        self.script.is_empty()
    }
}

impl Ruleset {
    /// An empty ruleset, balancing as seen from node `node` (locality preference).
    pub fn new(node: impl Into<String>) -> Self {
        Self {
            node: node.into(),
            ..Self::default()
        }
    }

    /// The objects programmed for `key`.
    pub fn service(&self, key: &ServiceKey) -> Option<&ServiceObjects> {
        self.services.get(key)
    }

    /// Number of services programmed.
    pub fn len(&self) -> usize {
        self.services.len()
    }

    /// Whether no service is programmed.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }

    /// The transaction that brings the kernel from the programmed state (or, for a
    /// full delta, from `existing`, what the kernel holds) to `delta`'s.
    pub fn plan(&self, delta: &Delta, existing: &Existing) -> Plan {
        if delta.full {
            self.plan_full(delta, existing)
        } else {
            self.plan_changes(delta)
        }
    }

    /// Records that the kernel took `plan`.
    pub fn commit(&mut self, plan: Plan) {
        if plan.full {
            self.services.clear();
            self.owners.clear();
            self.picks.clear();
        }
        self.picks.extend(plan.picks);
        for (key, objects) in plan.next {
            if let Some(old) = self.services.remove(&key) {
                for el in old.elements.keys() {
                    if self.owners.get(el) == Some(&key) {
                        self.owners.remove(el);
                    }
                }
            }
            if let Some(objects) = objects {
                for el in objects.elements.keys() {
                    if let Some(prev) = self.owners.insert(el.clone(), key.clone())
                        && prev != key
                        && let Some(o) = self.services.get_mut(&prev)
                    {
                        o.elements.remove(el);
                    }
                }
                self.services.insert(key, objects);
            }
        }
    }

    fn plan_full(&self, delta: &Delta, existing: &Existing) -> Plan {
        let mut s = String::new();
        let mut next = Vec::new();
        let mut desired_chains = BTreeSet::new();
        let mut desired_sets = BTreeSet::new();
        let mut elements: BTreeMap<&'static str, Vec<String>> = BTreeMap::new();
        let mut chain_cmds = String::new();
        let mut set_cmds = String::new();
        let mut seen_elements = BTreeSet::new();
        let mut picks = BTreeSet::new();
        for view in &delta.upserted {
            let objects = service_objects(view, &self.node);
            picks.extend(picks_used(&objects).map(str::to_owned));
            for (name, def) in &objects.sets {
                desired_sets.insert(name.clone());
                let _ = writeln!(set_cmds, "add set {TABLE} {name} {def}");
            }
            for (name, rules) in &objects.chains {
                desired_chains.insert(name.clone());
                let _ = writeln!(chain_cmds, "add chain {TABLE} {name}");
                if existing.chains.contains(name) {
                    let _ = writeln!(chain_cmds, "flush chain {TABLE} {name}");
                }
                for r in rules {
                    let _ = writeln!(chain_cmds, "add rule {TABLE} {name} {r}");
                }
            }
            for ((map, key), value) in &objects.elements {
                // A VIP claimed twice within one delta: the later service wins.
                if seen_elements.insert((*map, key.clone())) {
                    elements
                        .entry(map)
                        .or_default()
                        .push(format!("{key} : {value}"));
                }
            }
            next.push((view.key(), Some(objects)));
        }
        // 1. The table and its fixed part. An adopted table keeps its chains and
        //    sets (and the affinity sets' entries); everything is rewritten inside
        //    this one transaction, so packets see the old or the new table, never a
        //    gap.
        let _ = writeln!(s, "add table {TABLE}");
        for (map, def) in map_definitions() {
            let _ = writeln!(s, "add map {TABLE} {map} {{ {def} }}");
            if existing.table {
                let _ = writeln!(s, "flush map {TABLE} {map}");
            }
        }
        // 2. Empty every old chain: no rule refers to anything old any more.
        let skeleton_names = skeleton_chains();
        for chain in &existing.chains {
            let _ = writeln!(s, "flush chain {TABLE} {chain}");
        }
        // 3. The fixed chains, sets, service chains, then the elements naming them.
        for (name, def, rules) in skeleton() {
            let _ = writeln!(s, "add chain {TABLE} {name} {def}");
            for r in rules {
                let _ = writeln!(s, "add rule {TABLE} {name} {r}");
            }
        }
        for chain in &picks {
            desired_chains.insert(chain.clone());
            let _ = writeln!(s, "add chain {TABLE} {chain}");
            for rule in pick_chain_rules(chain) {
                let _ = writeln!(s, "add rule {TABLE} {chain} {rule}");
            }
        }
        s.push_str(&set_cmds);
        // Service chains that already existed were flushed in step 2.
        for line in chain_cmds.lines() {
            if line.starts_with("flush chain ") {
                continue;
            }
            s.push_str(line);
            s.push('\n');
        }
        for (map, items) in &elements {
            for chunk in items.chunks(4096) {
                let _ = writeln!(s, "add element {TABLE} {map} {{ {} }}", chunk.join(", "));
            }
        }
        // 4. What the desired state no longer has.
        for chain in &existing.chains {
            if !desired_chains.contains(chain)
                && !skeleton_names.contains(chain.as_str())
                && !is_policy_chain(chain)
            {
                let _ = writeln!(s, "delete chain {TABLE} {chain}");
            }
        }
        for set in &existing.sets {
            if !desired_sets.contains(set) && !ELEMENT_MAPS.contains(&set.as_str()) {
                let _ = writeln!(s, "delete set {TABLE} {set}");
            }
        }
        Plan {
            script: s,
            element_ops: None,
            next,
            picks,
            full: true,
        }
    }

    fn plan_changes(&self, delta: &Delta) -> Plan {
        let empty = ServiceObjects::default();
        let mut next: Vec<(ServiceKey, Option<ServiceObjects>)> = Vec::new();
        for key in &delta.removed {
            if self.services.contains_key(key) {
                next.push((key.clone(), None));
            }
        }
        for view in &delta.upserted {
            let objects = service_objects(view, &self.node);
            if self.services.get(&view.key()) != Some(&objects) {
                next.push((view.key(), Some(objects)));
            }
        }
        // Elements given up by one service in this delta may be taken by another.
        let mut released: BTreeSet<(&'static str, ElementKey)> = BTreeSet::new();
        let mut cmds = ChangeCommands::default();
        for (key, new) in &next {
            let old = self.services.get(key).unwrap_or(&empty);
            let new = new.as_ref().unwrap_or(&empty);
            diff_service(old, new, &mut cmds, &mut released);
            for el in new.elements.keys() {
                if let Some(owner) = self.owners.get(el)
                    && owner != key
                    && !released.contains(el)
                {
                    // Taken from a service this delta did not update (yet).
                    released.insert(el.clone());
                    cmds.delete_element(el);
                }
            }
        }
        // A backend count used for the first time gets its pick chain.
        let mut picks = BTreeSet::new();
        for (_, new) in &next {
            for chain in new.iter().flat_map(picks_used) {
                if !self.picks.contains(chain) && picks.insert(chain.to_owned()) {
                    cmds.command(format_args!("add chain {TABLE} {chain}"));
                    for rule in pick_chain_rules(chain) {
                        cmds.command(format_args!("add rule {TABLE} {chain} {rule}"));
                    }
                }
            }
        }
        let (script, element_ops) = cmds.finish();
        Plan {
            script,
            element_ops,
            next,
            picks,
            full: false,
        }
    }
}

/// The commands of a change transaction as the planner writes them: nft script
/// lines, and the element commands also as [`ElementOp`]s.
#[derive(Default)]
struct ChangeCommands {
    /// Commands in the order written (put in transaction order by [`reorder`]).
    script: String,
    /// Element additions, chain and set deletions: after every deletion of an
    /// element (see [`diff_service`]).
    tail: String,
    deletes: Vec<ElementOp>,
    adds: Vec<ElementOp>,
    /// Whether a command on chains or sets was written.
    structural: bool,
}

impl ChangeCommands {
    fn delete_element(&mut self, (map, key): &(&'static str, ElementKey)) {
        let _ = writeln!(self.script, "delete element {TABLE} {map} {{ {key} }}");
        self.deletes.push(ElementOp {
            map,
            key: key.clone(),
            value: None,
        });
    }

    fn add_element(&mut self, (map, key): &(&'static str, ElementKey), value: &ElementValue) {
        let _ = writeln!(self.tail, "add element {TABLE} {map} {{ {key} : {value} }}");
        self.adds.push(ElementOp {
            map,
            key: key.clone(),
            value: Some(value.clone()),
        });
    }

    /// A command on chains or sets.
    fn command(&mut self, line: fmt::Arguments<'_>) {
        let _ = writeln!(self.script, "{line}");
        self.structural = true;
    }

    /// A command on chains or sets that comes after the element additions.
    fn last(&mut self, line: fmt::Arguments<'_>) {
        let _ = writeln!(self.tail, "{line}");
        self.structural = true;
    }

    /// The script, and the element commands when there is nothing else (and at
    /// least one): deletions, then additions, as [`reorder`] puts the script.
    fn finish(mut self) -> (String, Option<Vec<ElementOp>>) {
        self.script.push_str(&self.tail);
        let script = reorder(&self.script);
        self.deletes.append(&mut self.adds);
        let ops = (!self.structural && !self.deletes.is_empty()).then_some(self.deletes);
        (script, ops)
    }
}

/// Puts element deletions first, element additions after every chain they name
/// exists, and chain/set deletions last: the order one transaction needs.
fn reorder(script: &str) -> String {
    let mut buckets: [String; 5] = Default::default();
    for line in script.lines() {
        let i = if line.starts_with("delete element") {
            0
        } else if line.starts_with("add set") || line.starts_with("add chain") {
            1
        } else if line.starts_with("flush chain") || line.starts_with("add rule") {
            2
        } else if line.starts_with("add element") {
            3
        } else {
            4
        };
        buckets[i].push_str(line);
        buckets[i].push('\n');
    }
    // Chains are flushed before their new rules: keep flush/add order per chain,
    // which the writer emitted in sequence.
    buckets.concat()
}

/// Commands that turn one service's `old` objects into `new`.
fn diff_service(
    old: &ServiceObjects,
    new: &ServiceObjects,
    cmds: &mut ChangeCommands,
    released: &mut BTreeSet<(&'static str, ElementKey)>,
) {
    for (el, value) in &old.elements {
        if new.elements.get(el) != Some(value) && !released.contains(el) {
            cmds.delete_element(el);
            released.insert(el.clone());
        }
    }
    for (name, def) in &new.sets {
        if !old.sets.contains_key(name) {
            cmds.command(format_args!("add set {TABLE} {name} {def}"));
        }
    }
    for (name, rules) in &new.chains {
        match old.chains.get(name) {
            Some(old_rules) if old_rules == rules => continue,
            Some(_) => cmds.command(format_args!("flush chain {TABLE} {name}")),
            None => cmds.command(format_args!("add chain {TABLE} {name}")),
        }
        for r in rules {
            cmds.command(format_args!("add rule {TABLE} {name} {r}"));
        }
    }
    for (el, value) in &new.elements {
        if old.elements.get(el) != Some(value) {
            cmds.add_element(el, value);
        }
    }
    for name in old.chains.keys() {
        if !new.chains.contains_key(name) {
            cmds.last(format_args!("delete chain {TABLE} {name}"));
        }
    }
    for name in old.sets.keys() {
        if !new.sets.contains_key(name) {
            cmds.last(format_args!("delete set {TABLE} {name}"));
        }
    }
}

/// Removes the table (nothing of ours is left); succeeds when there is none.
pub fn delete_script() -> String {
    format!("add table {TABLE}\ndelete table {TABLE}\n")
}
