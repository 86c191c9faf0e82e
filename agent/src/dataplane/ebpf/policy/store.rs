//! The rule sets and port sets in the policy maps, content-addressed: each
//! distinct [`PeerTable`] and port set is written once under an id and shared by
//! every guarded address (and rule set) that names it.
//!
//! Kept with reverse indexes (table → id), running entry totals (for the
//! capacity checks) and use counts (guarded-address directions per rule set, rule
//! sets per port set), so that writing one changed address costs the size of its
//! tables, not of everything in the maps.

use super::{
    maps::{PeerEntry, PolicyCapacity, PolicyMaps},
    table::{self, PeerTable, Port},
};
use crate::dataplane::ebpf::error::MapsError;
use agent_common::policy::{self as pol, EndpointPolicy, PORTS_ALL, PeerValue, PortKey};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The rule sets and port sets in the maps.
#[derive(Debug, Default)]
pub struct RuleStore {
    /// Rule sets by id.
    rule_sets: BTreeMap<u32, PeerTable>,
    /// The id of each rule set (the lowest where an adopted table is there twice).
    ids: HashMap<PeerTable, u32>,
    /// Port sets by id.
    port_sets: BTreeMap<u32, BTreeSet<Port>>,
    /// The id of each port set.
    port_ids: HashMap<BTreeSet<Port>, u32>,
    /// Peer entries in the IPv4 and the IPv6 trie.
    peers: (usize, usize),
    /// Port entries.
    ports: usize,
    /// Guarded-address directions naming each rule set.
    users: HashMap<u32, usize>,
    /// Rule sets naming each port set.
    port_users: HashMap<u32, usize>,
    /// Rule sets that may have no user left (checked by [`Self::remove_unused`]).
    maybe_unused: BTreeSet<u32>,
}

impl RuleStore {
    /// What `maps` hold (a previous agent's rule sets and port sets), with the
    /// uses of the guarded addresses `endpoints`.
    pub fn adopt<'e, P: PolicyMaps>(
        maps: &P,
        endpoints: impl Iterator<Item = &'e EndpointPolicy>,
    ) -> Result<Self, MapsError> {
        let mut port_sets: BTreeMap<u32, BTreeSet<Port>> = BTreeMap::new();
        for key in maps.ports()? {
            let set = port_sets.entry(key.set).or_default();
            set.insert((key.proto, u16::from_be(key.port)));
        }
        let mut rule_sets: BTreeMap<u32, PeerTable> = BTreeMap::new();
        for (entry, value) in maps.peers()? {
            let ports = if value.ports == PORTS_ALL {
                None
            } else {
                Some(port_sets.get(&value.ports).cloned().unwrap_or_default())
            };
            rule_sets
                .entry(entry.rules)
                .or_default()
                .insert(entry.net, ports);
        }
        let mut store = Self::default();
        for (id, set) in port_sets {
            store.ports += set.len();
            store.port_ids.entry(set.clone()).or_insert(id);
            store.port_users.insert(id, 0);
            store.port_sets.insert(id, set);
        }
        for (id, table) in rule_sets {
            store.add_rule_set(id, table);
        }
        for v in endpoints {
            store.retarget(None, Some(v));
        }
        // Everything unused goes at the first pass's end.
        store.maybe_unused = store.rule_sets.keys().copied().collect();
        Ok(store)
    }

    /// The id of `table` when it is in the maps.
    pub fn id(&self, table: &PeerTable) -> Option<u32> {
        self.ids.get(table).copied()
    }

    /// Records that a guarded address's value went from `old` to `new` (either
    /// absent), for the use counts.
    pub fn retarget(&mut self, old: Option<&EndpointPolicy>, new: Option<&EndpointPolicy>) {
        for v in old.into_iter() {
            for id in [v.ingress.rules, v.egress.rules] {
                if id == 0 {
                    continue;
                }
                if let Some(n) = self.users.get_mut(&id) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        self.maybe_unused.insert(id);
                    }
                }
            }
        }
        for v in new.into_iter() {
            for id in [v.ingress.rules, v.egress.rules] {
                if id != 0 {
                    *self.users.entry(id).or_default() += 1;
                }
            }
        }
    }

    /// Writes `table` under a new id (its new port sets first); `Err` with the
    /// reason when it does not fit.
    pub fn program<P: PolicyMaps>(
        &mut self,
        maps: &mut P,
        table: &PeerTable,
        capacity: PolicyCapacity,
    ) -> Result<u32, String> {
        let (v4, v6) = table::peer_entries(table);
        let cap = capacity.peers as usize;
        if self.peers.0 + v4 > cap {
            return Err(full_reason(pol::PEERS_V4, capacity.peers));
        }
        if self.peers.1 + v6 > cap {
            return Err(full_reason(pol::PEERS_V6, capacity.peers));
        }
        let new_sets: BTreeSet<&BTreeSet<Port>> = table
            .values()
            .flatten()
            .filter(|set| !self.port_ids.contains_key(*set))
            .collect();
        let need_ports: usize = new_sets.iter().map(|s| s.len()).sum();
        if self.ports + need_ports > capacity.ports as usize {
            return Err(full_reason(pol::PORTS, capacity.ports));
        }
        for set in new_sets {
            let id = lowest_free(self.port_sets.keys());
            for (proto, port) in set {
                let key = PortKey {
                    set: id,
                    port: port.to_be(),
                    proto: *proto,
                    pad: 0,
                };
                maps.put_port(&key).map_err(|e| e.to_string())?;
            }
            self.ports += set.len();
            self.port_ids.insert(set.clone(), id);
            self.port_users.insert(id, 0);
            self.port_sets.insert(id, set.clone());
        }
        let id = lowest_free(self.rule_sets.keys());
        for (net, ports) in table {
            let value = PeerValue {
                ports: match ports {
                    None => PORTS_ALL,
                    Some(set) => self.port_ids.get(set).copied().unwrap_or(PORTS_ALL),
                },
            };
            maps.put_peer(
                &PeerEntry {
                    rules: id,
                    net: *net,
                },
                &value,
            )
            .map_err(|e| e.to_string())?;
        }
        self.add_rule_set(id, table.clone());
        self.maybe_unused.insert(id);
        Ok(id)
    }

    /// Removes the rule sets no guarded address names any more (of those that
    /// may have lost their last user) and the port sets no rule set names; returns
    /// whether anything was removed.
    pub fn remove_unused<P: PolicyMaps>(&mut self, maps: &mut P) -> Result<bool, MapsError> {
        let candidates = std::mem::take(&mut self.maybe_unused);
        let mut removed = false;
        let mut stale_sets = BTreeSet::new();
        for id in candidates {
            if self.users.get(&id).copied().unwrap_or(0) > 0 {
                continue;
            }
            let Some(table) = self.rule_sets.get(&id) else {
                continue;
            };
            for net in table.keys() {
                maps.delete_peer(&PeerEntry {
                    rules: id,
                    net: *net,
                })?;
            }
            let table = self.rule_sets.remove(&id).unwrap_or_default();
            self.users.remove(&id);
            let (v4, v6) = table::peer_entries(&table);
            self.peers = (self.peers.0 - v4, self.peers.1 - v6);
            if self.ids.get(&table) == Some(&id) {
                self.ids.remove(&table);
                // An adopted duplicate takes over.
                if let Some((other, _)) = self.rule_sets.iter().find(|(_, t)| **t == table) {
                    self.ids.insert(table.clone(), *other);
                }
            }
            for set in distinct_port_sets(&table) {
                if let Some(set_id) = self.port_ids.get(set).copied()
                    && let Some(n) = self.port_users.get_mut(&set_id)
                {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        stale_sets.insert(set_id);
                    }
                }
            }
            removed = true;
        }
        // Adopted port sets no rule set names.
        stale_sets.extend(
            self.port_users
                .iter()
                .filter(|(_, n)| **n == 0)
                .map(|(id, _)| *id),
        );
        for id in stale_sets {
            let Some(set) = self.port_sets.remove(&id) else {
                continue;
            };
            for (proto, port) in &set {
                maps.delete_port(&PortKey {
                    set: id,
                    port: port.to_be(),
                    proto: *proto,
                    pad: 0,
                })?;
            }
            self.ports -= set.len();
            self.port_users.remove(&id);
            if self.port_ids.get(&set) == Some(&id) {
                self.port_ids.remove(&set);
            }
            removed = true;
        }
        Ok(removed)
    }

    /// Records rule set `id` as in the maps.
    fn add_rule_set(&mut self, id: u32, table: PeerTable) {
        let (v4, v6) = table::peer_entries(&table);
        self.peers = (self.peers.0 + v4, self.peers.1 + v6);
        for set in distinct_port_sets(&table) {
            if let Some(set_id) = self.port_ids.get(set) {
                *self.port_users.entry(*set_id).or_default() += 1;
            }
        }
        self.ids.entry(table.clone()).or_insert(id);
        self.users.entry(id).or_default();
        self.rule_sets.insert(id, table);
    }
}

/// Each port set `table` names, once.
fn distinct_port_sets(table: &PeerTable) -> BTreeSet<&BTreeSet<Port>> {
    table.values().flatten().collect()
}

/// The status reason of a table that did not fit in `map`.
fn full_reason(map: &str, capacity: u32) -> String {
    format!(
        "policy map {map} is full (capacity {capacity}): the guarded traffic is refused; raise --policy-max-entries"
    )
}

/// The lowest id ≥ 1 not in `used`, which is ascending (0 means "none" in the
/// maps).
fn lowest_free<'a>(used: impl Iterator<Item = &'a u32>) -> u32 {
    let mut want = 1;
    for id in used {
        if *id == want {
            want += 1;
        } else if *id > want {
            break;
        }
    }
    want
}
