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
    /// Whether element differences are wanted (not when only the use counts
    /// are).
    write: bool,
    deleted: BTreeMap<(String, PolicyKey), Option<String>>,
    added: BTreeMap<(String, PolicyKey), Option<String>>,
    /// Sets touched, with their definition and use count after.
    pub sets: BTreeMap<String, (String, usize)>,
    /// Chains touched, with their rules and use count after.
    pub chains: BTreeMap<String, (Vec<String>, usize)>,
    /// Counters touched, with their use count after.
    pub counters: BTreeMap<String, usize>,
    /// Sets, chains and counters in use before.
    sets_before: BTreeSet<String>,
    chains_before: BTreeSet<String>,
    counters_before: BTreeSet<String>,
}

impl Diff {
    /// A diff that writes commands (`write`) or only counts uses.
    pub fn new(write: bool) -> Self {
        Self {
            write,
            ..Self::default()
        }
    }

    /// A group's objects from `old` to `new`.
    pub fn objects(&mut self, p: &Programmed, old: &PolicyObjects, new: &PolicyObjects) {
        self.elements(&old.elements, &new.elements);
        for (objects, up) in [(old, false), (new, true)] {
            for (name, def) in &objects.sets {
                let now = p.set(name);
                count(&mut self.sets, &mut self.sets_before, now, name, def, up);
            }
            for (name, rules) in &objects.chains {
                let now = p.chain(name);
                count(
                    &mut self.chains,
                    &mut self.chains_before,
                    now,
                    name,
                    rules,
                    up,
                );
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
        if !self.write {
            return;
        }
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
        let new_sets: Vec<(&String, &String)> = self
            .sets
            .iter()
            .filter(|(c, (_, n))| *n > 0 && !self.sets_before.contains(*c))
            .map(|(c, (def, _))| (c, def))
            .collect();
        let gone_sets: BTreeSet<&String> = self
            .sets
            .iter()
            .filter(|(c, (_, n))| *n == 0 && self.sets_before.contains(*c))
            .map(|(c, _)| c)
            .collect();
        // Elements of deleted sets go with them.
        let deleted: Vec<_> = self
            .deleted
            .iter()
            .filter(|((set, _), _)| !gone_sets.contains(set))
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
        for (name, def) in &new_sets {
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
        for set in &gone_sets {
            let _ = writeln!(s, "delete set {TABLE} {set}");
        }
        for c in &gone_counters {
            let _ = writeln!(s, "delete counter {TABLE} {c}");
        }
        let structural = !(new_counters.is_empty()
            && new_sets.is_empty()
            && new_chains.is_empty()
            && gone_chains.is_empty()
            && gone_sets.is_empty()
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

/// Counts one more (`up`) or one less use of `name` (`value`: its rules or
/// definition) in `map`, starting from `now`, its count before the change
/// (noted in `before` when in use).
fn count<V: Clone>(
    map: &mut BTreeMap<String, (V, usize)>,
    before: &mut BTreeSet<String>,
    now: Option<&(V, usize)>,
    name: &str,
    value: &V,
    up: bool,
) {
    let entry = map.entry(name.to_owned()).or_insert_with(|| {
        let (value, n) = now.cloned().unwrap_or((value.clone(), 0));
        if n > 0 {
            before.insert(name.to_owned());
        }
        (value, n)
    });
    entry.1 = if up {
        entry.1 + 1
    } else {
        entry.1.saturating_sub(1)
    };
}
