//! The policy objects in the kernel, per guarded address, and the transaction
//! that takes them from one plan to the next touching only the addresses that
//! changed.
//!
//! Every element is keyed by its guarded address first, so an address's
//! elements are its own; chains and counters are shared by the addresses of a
//! service and counted, so a change adds the chains of a service's first address
//! and deletes those of its last. The commands come in the order a whole-table
//! diff would give: elements that change or go, new counters and chains, new
//! elements, then chains and counters no element uses any more.

use super::{
    super::ruleset::TABLE, PolicyObjects, add_elements, address_objects, failed_address_objects,
    full_script,
};
use crate::policy::PolicyPlan;
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::IpAddr,
};

/// Which objects a guarded address gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Objects {
    /// Its rules, refusals logged to this NFLOG group when given.
    Rules(Option<u16>),
    /// Fail closed: its services' failure chains (the kernel refused the rules).
    Failed,
}

/// What is programmed, per guarded address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Programmed {
    /// Each guarded address's elements, chains and counters.
    addresses: BTreeMap<IpAddr, PolicyObjects>,
    /// Each chain in use with its rules and the number of addresses using it.
    chains: BTreeMap<String, (Vec<String>, usize)>,
    /// Each counter in use with the number of addresses using it.
    counters: BTreeMap<String, usize>,
}

/// A transaction's policy commands and what is programmed once the kernel took
/// them ([`Programmed::commit`]).
#[derive(Debug)]
pub struct Pending {
    /// The `nft -f` commands.
    pub script: String,
    next: Next,
}

#[derive(Debug)]
enum Next {
    /// Everything anew (a full sync).
    Replace(Programmed),
    /// These addresses' objects (`None`: no longer guarded).
    Update(Vec<(IpAddr, Option<PolicyObjects>)>),
}

/// The objects of address `addr` of `plan` (none when it is not guarded).
fn objects_of(plan: &PolicyPlan, addr: IpAddr, kind: Objects) -> Option<PolicyObjects> {
    let guarded = plan.endpoints.get(&addr)?;
    let mut out = PolicyObjects::default();
    match kind {
        Objects::Rules(log_group) => address_objects(&mut out, addr, guarded, log_group),
        Objects::Failed => failed_address_objects(&mut out, addr, guarded),
    }
    Some(out)
}

impl Programmed {
    /// Everything programmed, as one set of objects.
    pub fn objects(&self) -> PolicyObjects {
        let mut out = PolicyObjects::default();
        for o in self.addresses.values() {
            out.elements
                .extend(o.elements.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        out.chains = self
            .chains
            .iter()
            .map(|(name, (rules, _))| (name.clone(), rules.clone()))
            .collect();
        out.counters = self.counters.keys().cloned().collect();
        out
    }

    /// The addresses programmed or guarded by `plan`.
    pub fn all_addresses(&self, plan: &PolicyPlan) -> BTreeSet<IpAddr> {
        let mut out: BTreeSet<IpAddr> = self.addresses.keys().copied().collect();
        out.extend(plan.endpoints.keys().copied());
        out
    }

    /// A full sync to `plan`: see [`full_script`] (`existing_chains` are the
    /// table's chains, `size` the maps' bound).
    pub fn full(
        plan: &PolicyPlan,
        kind: Objects,
        existing_chains: &BTreeSet<String>,
        size: Option<u32>,
    ) -> Pending {
        let mut next = Programmed::default();
        for addr in plan.endpoints.keys() {
            next.set(*addr, objects_of(plan, *addr, kind));
        }
        Pending {
            script: full_script(&next.objects(), existing_chains, size),
            next: Next::Replace(next),
        }
    }

    /// The commands that bring `addresses` to what `plan` says of them (the
    /// other addresses are as `plan` has them already); empty when nothing
    /// changes.
    pub fn change(
        &self,
        plan: &PolicyPlan,
        addresses: &BTreeSet<IpAddr>,
        kind: Objects,
    ) -> Pending {
        let updates: Vec<(IpAddr, Option<PolicyObjects>)> = addresses
            .iter()
            .map(|addr| (*addr, objects_of(plan, *addr, kind)))
            .filter(|(addr, new)| self.addresses.get(addr) != new.as_ref())
            .collect();
        let empty = PolicyObjects::default();
        let old = |addr: &IpAddr| self.addresses.get(addr).unwrap_or(&empty);
        // Use counts after the change, of the chains and counters it touches.
        let mut chains: BTreeMap<&str, isize> = BTreeMap::new();
        let mut counters: BTreeMap<&str, isize> = BTreeMap::new();
        for (addr, new) in &updates {
            let new = new.as_ref().unwrap_or(&empty);
            for (o, step) in [(old(addr), -1), (new, 1)] {
                for c in o.chains.keys() {
                    *chains.entry(c).or_insert_with(|| self.chain_uses(c)) += step;
                }
                for c in &o.counters {
                    *counters.entry(c).or_insert_with(|| self.counter_uses(c)) += step;
                }
            }
        }
        let mut s = String::new();
        // 1. Elements that change or go.
        let mut gone: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (addr, new) in &updates {
            let new = new.as_ref().unwrap_or(&empty);
            for (key @ (map, k), chain) in &old(addr).elements {
                if new.elements.get(key) != Some(chain) {
                    gone.entry(map).or_default().push(k);
                }
            }
        }
        for (map, keys) in gone {
            let _ = writeln!(s, "delete element {TABLE} {map} {{ {} }}", keys.join(", "));
        }
        // 2. New counters and chains (a chain's one rule never changes: its name
        //    says what it does).
        for (c, _) in counters
            .iter()
            .filter(|(c, n)| **n > 0 && self.counter_uses(c) == 0)
        {
            let _ = writeln!(s, "add counter {TABLE} {c}");
        }
        let mut added = BTreeSet::new();
        for new in updates.iter().filter_map(|(_, new)| new.as_ref()) {
            for (name, rules) in &new.chains {
                if self.chain_uses(name) == 0 && added.insert(name) {
                    let _ = writeln!(s, "add chain {TABLE} {name}");
                    for r in rules {
                        let _ = writeln!(s, "add rule {TABLE} {name} {r}");
                    }
                }
            }
        }
        // 3. Elements that are new or changed.
        add_elements(
            &mut s,
            updates.iter().flat_map(|(addr, new)| {
                let old = old(addr);
                new.iter().flat_map(move |new| {
                    new.elements
                        .iter()
                        .filter(move |(key, chain)| old.elements.get(*key) != Some(*chain))
                })
            }),
        );
        // 4. What is gone.
        for (name, _) in chains.iter().filter(|(_, n)| **n <= 0) {
            let _ = writeln!(s, "delete chain {TABLE} {name}");
        }
        for (c, _) in counters.iter().filter(|(_, n)| **n <= 0) {
            let _ = writeln!(s, "delete counter {TABLE} {c}");
        }
        Pending {
            script: s,
            next: Next::Update(updates),
        }
    }

    /// Takes in that the kernel accepted `pending`.
    pub fn commit(&mut self, pending: Pending) {
        match pending.next {
            Next::Replace(next) => *self = next,
            Next::Update(updates) => {
                for (addr, new) in updates {
                    self.set(addr, new);
                }
            }
        }
    }

    /// Sets address `addr`'s objects, keeping the use counts.
    fn set(&mut self, addr: IpAddr, new: Option<PolicyObjects>) {
        if let Some(old) = self.addresses.remove(&addr) {
            for name in old.chains.keys() {
                if let Some((_, n)) = self.chains.get_mut(name) {
                    *n -= 1;
                    if *n == 0 {
                        self.chains.remove(name);
                    }
                }
            }
            for c in &old.counters {
                if let Some(n) = self.counters.get_mut(c) {
                    *n -= 1;
                    if *n == 0 {
                        self.counters.remove(c);
                    }
                }
            }
        }
        if let Some(new) = new {
            for (name, rules) in &new.chains {
                self.chains
                    .entry(name.clone())
                    .or_insert_with(|| (rules.clone(), 0))
                    .1 += 1;
            }
            for c in &new.counters {
                *self.counters.entry(c.clone()).or_default() += 1;
            }
            self.addresses.insert(addr, new);
        }
    }

    fn chain_uses(&self, name: &str) -> isize {
        self.chains.get(name).map_or(0, |(_, n)| *n as isize)
    }

    fn counter_uses(&self, name: &str) -> isize {
        self.counters.get(name).map_or(0, |n| *n as isize)
    }
}
