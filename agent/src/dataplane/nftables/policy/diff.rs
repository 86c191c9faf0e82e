//! The commands between two states of some policy objects: what a change
//! adds, deletes and leaves to [`Programmed`]'s use counts, written as an `nft`
//! script and, when it is element commands only, as one netlink batch.

use super::{
    super::netlink::{Element, policy_elements},
    PolicyKey, PolicyObjects, Programmed, TABLE, add_elements, is_check_chain,
};
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
};

/// The differences of one transaction, and the use counts after it of the
/// chains and counters it touches.
#[derive(Default)]
pub struct Diff {
    deleted: BTreeMap<(String, PolicyKey), Option<String>>,
    added: BTreeMap<(String, PolicyKey), Option<String>>,
    new_sets: BTreeMap<String, String>,
    gone_sets: BTreeSet<String>,
    /// Chains touched, with their rules and use count after.
    pub chains: BTreeMap<String, (Vec<String>, usize)>,
    /// Counters touched, with their use count after.
    pub counters: BTreeMap<String, usize>,
    /// Chains and counters in use before.
    chains_before: BTreeSet<String>,
    counters_before: BTreeSet<String>,
}

impl Diff {
    /// A group's objects from `old` to `new`.
    pub fn objects(&mut self, p: &Programmed, old: &PolicyObjects, new: &PolicyObjects) {
        self.elements(&old.elements, &new.elements);
        for (name, def) in &new.sets {
            if !old.sets.contains_key(name) {
                self.new_sets.insert(name.clone(), def.clone());
            }
        }
        for name in old.sets.keys().filter(|n| !new.sets.contains_key(*n)) {
            self.gone_sets.insert(name.clone());
        }
        for (objects, up) in [(old, false), (new, true)] {
            for (name, rules) in &objects.chains {
                let entry = self.chains.entry(name.clone()).or_insert_with(|| {
                    let (rules, n) = p.chain(name).cloned().unwrap_or((rules.clone(), 0));
                    if n > 0 {
                        self.chains_before.insert(name.clone());
                    }
                    (rules, n)
                });
                entry.1 = if up {
                    entry.1 + 1
                } else {
                    entry.1.saturating_sub(1)
                };
            }
            for name in &objects.counters {
                let n = self.counters.entry(name.clone()).or_insert_with(|| {
                    let n = p.counter(name);
                    if n > 0 {
                        self.counters_before.insert(name.clone());
                    }
                    n
                });
                *n = if up { *n + 1 } else { n.saturating_sub(1) };
            }
        }
    }

    /// Elements from `old` to `new`.
    pub fn elements<'a>(
        &mut self,
        old: impl IntoIterator<Item = (&'a (String, PolicyKey), &'a Option<String>)>,
        new: impl IntoIterator<Item = (&'a (String, PolicyKey), &'a Option<String>)>,
    ) {
        let new: BTreeMap<_, _> = new.into_iter().collect();
        let old: BTreeMap<_, _> = old.into_iter().collect();
        for (key, value) in &old {
            if new.get(key) != Some(value) {
                self.deleted.insert((*key).clone(), (*value).clone());
            }
        }
        for (key, value) in new {
            if old.get(key) != Some(&value) {
                self.added.insert(key.clone(), value.clone());
            }
        }
    }

    /// The `nft -f` script, and the netlink batch when it is elements only.
    pub fn commands(&self) -> (String, Option<Vec<Element>>) {
        let mut s = String::new();
        // Elements of deleted sets go with them.
        let deleted: Vec<_> = self
            .deleted
            .iter()
            .filter(|((set, _), _)| !self.gone_sets.contains(set))
            .collect();
        let mut by_set: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for ((set, key), _) in &deleted {
            by_set.entry(set).or_default().push(key.to_string());
        }
        for (set, keys) in by_set {
            let _ = writeln!(s, "delete element {TABLE} {set} {{ {} }}", keys.join(", "));
        }
        let new_counters: Vec<&String> = self
            .counters
            .iter()
            .filter(|(c, n)| **n > 0 && !self.counters_before.contains(*c))
            .map(|(c, _)| c)
            .collect();
        let new_chains: Vec<(&String, &Vec<String>)> = self
            .chains
            .iter()
            .filter(|(c, (_, n))| *n > 0 && !self.chains_before.contains(*c))
            .map(|(c, (rules, _))| (c, rules))
            .collect();
        let mut gone_chains: Vec<&String> = self
            .chains
            .iter()
            .filter(|(c, (_, n))| *n == 0 && self.chains_before.contains(*c))
            .map(|(c, _)| c)
            .collect();
        gone_chains.sort_by_key(|c| !is_check_chain(c));
        let gone_counters: Vec<&String> = self
            .counters
            .iter()
            .filter(|(c, n)| **n == 0 && self.counters_before.contains(*c))
            .map(|(c, _)| c)
            .collect();
        for c in &new_counters {
            let _ = writeln!(s, "add counter {TABLE} {c}");
        }
        for (name, def) in &self.new_sets {
            let _ = writeln!(s, "add set {TABLE} {name} {def}");
        }
        for (name, _) in &new_chains {
            let _ = writeln!(s, "add chain {TABLE} {name}");
        }
        for (name, rules) in &new_chains {
            for r in *rules {
                let _ = writeln!(s, "add rule {TABLE} {name} {r}");
            }
        }
        add_elements(&mut s, self.added.iter());
        for c in &gone_chains {
            let _ = writeln!(s, "delete chain {TABLE} {c}");
        }
        for set in &self.gone_sets {
            let _ = writeln!(s, "delete set {TABLE} {set}");
        }
        for c in &gone_counters {
            let _ = writeln!(s, "delete counter {TABLE} {c}");
        }
        let structural = !(new_counters.is_empty()
            && self.new_sets.is_empty()
            && new_chains.is_empty()
            && gone_chains.is_empty()
            && self.gone_sets.is_empty()
            && gone_counters.is_empty());
        let elements = (!structural && !s.is_empty()).then(|| {
            let del = deleted
                .iter()
                .flat_map(|((set, key), _)| policy_elements(set, key, None, false));
            let add = self
                .added
                .iter()
                .flat_map(|((set, key), goto)| policy_elements(set, key, goto.as_deref(), true));
            del.chain(add).collect()
        });
        (s, elements)
    }
}
