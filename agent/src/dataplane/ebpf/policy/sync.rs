//! Keeps the policy maps equal to a [`PolicyPlan`], by difference.
//!
//! Rule sets and port sets are content-addressed: a table already in the maps
//! keeps its id, a changed one is written whole under a new id before the guarded
//! addresses switch to it, and the old entries go last, so a packet meets either
//! the old rules or the new ones, never a mix. A table that does not fit
//! (`--policy-max-entries`) is not written: the addresses it guards get the
//! deny-all marker (fail closed) and their services report the cause.

use super::{
    maps::{PeerEntry, PolicyMaps, endpoint_key},
    table::{self, DesiredDirection, PeerTable, Port},
};
use crate::{
    dataplane::ebpf::error::MapsError,
    model::ServiceKey,
    policy::{PolicyMode, PolicyPlan, PolicyState},
};
use agent_common::policy::{
    self as pol, EndpointKey, EndpointPolicy, MAX_COUNTERS, PORTS_ALL, PeerValue, PolicyDirection,
    PortKey,
};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// Direction index of counters: ingress.
pub const INGRESS: u8 = pol::DIR_INGRESS;
/// Direction index of counters: egress.
pub const EGRESS: u8 = pol::DIR_EGRESS;

/// The policy maps' sync engine.
pub struct PolicySync<P> {
    maps: P,
    /// Rule sets in the maps, by id.
    rule_sets: BTreeMap<u32, PeerTable>,
    /// Port sets in the maps, by id.
    port_sets: BTreeMap<u32, BTreeSet<Port>>,
    /// Guarded addresses as written.
    endpoints: BTreeMap<EndpointKey, EndpointPolicy>,
    /// Counter ids by service and direction.
    counters: BTreeMap<(ServiceKey, u8), u32>,
    /// Each service with a policy: its rule count and state.
    services: BTreeMap<ServiceKey, (usize, PolicyMode, PolicyState)>,
    /// Whether the maps were read back (a previous agent's state adopted).
    adopted: bool,
}

impl<P: PolicyMaps> PolicySync<P> {
    /// An engine over `maps`; the first [`Self::apply`] adopts what they hold.
    pub fn new(maps: P) -> Self {
        Self {
            maps,
            rule_sets: BTreeMap::new(),
            port_sets: BTreeMap::new(),
            endpoints: BTreeMap::new(),
            counters: BTreeMap::new(),
            services: BTreeMap::new(),
            adopted: false,
        }
    }

    /// The maps (tests read them).
    pub fn maps(&self) -> &P {
        &self.maps
    }

    /// Each service's counter ids by direction, for the collector.
    pub fn counters(&self) -> &BTreeMap<(ServiceKey, u8), u32> {
        &self.counters
    }

    /// Each service with a policy: its rule count, mode and state.
    pub fn services(&self) -> &BTreeMap<ServiceKey, (usize, PolicyMode, PolicyState)> {
        &self.services
    }

    /// Reads what the maps hold: a previous agent's rule sets, port sets and
    /// guarded addresses are kept as they are until the plan says otherwise.
    fn adopt(&mut self) -> Result<(), MapsError> {
        for key in self.maps.ports()? {
            let set = self.port_sets.entry(key.set).or_default();
            set.insert((key.proto, u16::from_be(key.port)));
        }
        for (entry, value) in self.maps.peers()? {
            let ports = if value.ports == PORTS_ALL {
                None
            } else {
                Some(
                    self.port_sets
                        .get(&value.ports)
                        .cloned()
                        .unwrap_or_default(),
                )
            };
            let table = self.rule_sets.entry(entry.rules).or_default();
            table.insert(entry.net, ports);
        }
        self.endpoints = self.maps.endpoints()?.into_iter().collect();
        self.adopted = true;
        Ok(())
    }

    /// Makes the maps enforce `plan`. A map error leaves the engine to re-read the
    /// maps on the next apply.
    pub fn apply(&mut self, plan: &PolicyPlan) -> Result<(), MapsError> {
        if !self.adopted {
            self.adopt()?;
        }
        let result = self.apply_once(plan).and_then(|retry| {
            // Tables that did not fit beside the old ones may fit now.
            if retry {
                self.apply_once(plan).map(|_| ())
            } else {
                Ok(())
            }
        });
        if result.is_err() {
            self.adopted = false;
            self.rule_sets.clear();
            self.port_sets.clear();
        }
        result
    }

    /// One pass; returns whether a table failed while stale entries were removed
    /// afterwards (a second pass may fit it).
    fn apply_once(&mut self, plan: &PolicyPlan) -> Result<bool, MapsError> {
        let desired = table::desired(plan);
        let capacity = self.maps.capacity();
        // Tables not in the maps yet, to program in a fixed order.
        let missing: BTreeSet<&PeerTable> = {
            let known = self.table_ids();
            desired
                .values()
                .flat_map(|e| [&e.ingress, &e.egress])
                .flatten()
                .map(|d| &d.table)
                .filter(|table| !known.contains_key(table))
                .collect()
        };
        let mut failed: BTreeMap<PeerTable, String> = BTreeMap::new();
        for table in missing {
            if let Err(reason) = self.program(table, capacity) {
                failed.insert(table.clone(), reason);
            }
        }
        self.assign_counters(plan, &desired)?;
        let ids = self.table_ids();

        // Guarded addresses, then what nothing uses any more.
        let mut endpoints = BTreeMap::new();
        let mut failures: BTreeMap<ServiceKey, String> = BTreeMap::new();
        for (addr, want) in &desired {
            let direction = |d: &Option<DesiredDirection>, dir: u8| -> PolicyDirection {
                let Some(d) = d else {
                    return PolicyDirection::default();
                };
                let counter = self.counters[&(d.service.clone(), dir)];
                let audit = d.mode == PolicyMode::Audit;
                match ids.get(&d.table) {
                    Some(id) => PolicyDirection {
                        rules: *id,
                        counter,
                        mode: if audit {
                            pol::MODE_AUDIT
                        } else {
                            pol::MODE_ENFORCE
                        },
                        pad: [0; 3],
                    },
                    None => PolicyDirection {
                        rules: 0,
                        counter,
                        mode: if audit {
                            pol::MODE_AUDIT_UNPROGRAMMABLE
                        } else {
                            pol::MODE_DENY_ALL
                        },
                        pad: [0; 3],
                    },
                }
            };
            let value = EndpointPolicy {
                ingress: direction(&want.ingress, INGRESS),
                egress: direction(&want.egress, EGRESS),
            };
            for d in [&want.ingress, &want.egress].into_iter().flatten() {
                if let Some(reason) = failed.get(&d.table) {
                    for service in &plan.endpoints[addr].services {
                        failures.insert(service.clone(), reason.clone());
                    }
                }
            }
            endpoints.insert(endpoint_key(*addr), value);
        }
        drop(ids);
        // Addresses no longer guarded go first, so that new ones find their room.
        let gone: Vec<EndpointKey> = self
            .endpoints
            .keys()
            .filter(|k| !endpoints.contains_key(k))
            .copied()
            .collect();
        for key in gone {
            self.maps.delete_endpoint(&key)?;
            self.endpoints.remove(&key);
        }
        for (key, value) in &endpoints {
            if self.endpoints.get(key) == Some(value) {
                continue;
            }
            if let Err(e) = self.maps.put_endpoint(key, value) {
                if self.endpoints.len() < capacity.endpoints as usize {
                    return Err(e);
                }
                let reason = format!(
                    "the guarded-address map {} is full (capacity {}): this address is not guarded; raise --lb-max-backends",
                    pol::ENDPOINTS,
                    capacity.endpoints
                );
                for (addr, guarded) in &plan.endpoints {
                    if endpoint_key(*addr) == *key {
                        for service in &guarded.services {
                            failures.insert(service.clone(), reason.clone());
                        }
                    }
                }
                continue;
            }
            self.endpoints.insert(*key, *value);
        }
        let freed = self.remove_unused()?;

        // Each service's mode, as the first guarded address reporting to it has it.
        let mut modes: HashMap<&ServiceKey, PolicyMode> = HashMap::new();
        for d in desired
            .values()
            .flat_map(|e| [&e.ingress, &e.egress])
            .flatten()
        {
            modes.entry(&d.service).or_insert(d.mode);
        }
        self.services = plan
            .services
            .iter()
            .map(|(service, rules)| {
                let mode = modes.get(service).copied().unwrap_or(PolicyMode::Enforce);
                let state = match failures.get(service) {
                    Some(reason) => PolicyState::Failed {
                        reason: reason.clone(),
                    },
                    None => PolicyState::Programmed,
                };
                (service.clone(), (*rules, mode, state))
            })
            .collect();
        Ok(!failed.is_empty() && freed)
    }

    /// The id of each rule set in the maps, by its table (the lowest id where an
    /// adopted table is there twice).
    fn table_ids(&self) -> HashMap<&PeerTable, u32> {
        let mut ids = HashMap::with_capacity(self.rule_sets.len());
        for (id, table) in &self.rule_sets {
            ids.entry(table).or_insert(*id);
        }
        ids
    }

    /// Writes `table` under a new id (its port sets first); `Err` with the reason
    /// when it does not fit.
    fn program(
        &mut self,
        table: &PeerTable,
        capacity: super::maps::PolicyCapacity,
    ) -> Result<u32, String> {
        let (v4, v6) = table::peer_entries(table);
        let (have_v4, have_v6) = self
            .rule_sets
            .values()
            .map(table::peer_entries)
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
        let cap = capacity.peers as usize;
        if have_v4 + v4 > cap || have_v6 + v6 > cap {
            return Err(full_reason(
                if have_v4 + v4 > cap {
                    pol::PEERS_V4
                } else {
                    pol::PEERS_V6
                },
                capacity.peers,
            ));
        }
        let new_sets: BTreeSet<&BTreeSet<Port>> = table
            .values()
            .flatten()
            .filter(|set| !self.port_sets.values().any(|have| have == *set))
            .collect();
        let have_ports: usize = self.port_sets.values().map(BTreeSet::len).sum();
        let need_ports: usize = new_sets.iter().map(|s| s.len()).sum();
        if have_ports + need_ports > capacity.ports as usize {
            return Err(full_reason(pol::PORTS, capacity.ports));
        }
        for set in new_sets {
            let id = lowest_free(self.port_sets.keys());
            self.port_sets.insert(id, set.clone());
            for (proto, port) in set {
                let key = PortKey {
                    set: id,
                    port: port.to_be(),
                    proto: *proto,
                    pad: 0,
                };
                self.maps.put_port(&key).map_err(|e| e.to_string())?;
            }
        }
        let id = lowest_free(self.rule_sets.keys());
        self.rule_sets.insert(id, table.clone());
        for (net, ports) in table {
            let value = PeerValue {
                ports: match ports {
                    None => PORTS_ALL,
                    Some(set) => self
                        .port_sets
                        .iter()
                        .find(|(_, have)| *have == set)
                        .map_or(PORTS_ALL, |(id, _)| *id),
                },
            };
            let entry = PeerEntry {
                rules: id,
                net: *net,
            };
            self.maps
                .put_peer(&entry, &value)
                .map_err(|e| e.to_string())?;
        }
        Ok(id)
    }

    /// Gives each (service, direction) a guarded address uses a counter id: the one
    /// it has, else the one an adopted address of it carries, else a fresh zeroed
    /// one. Counters of services without a policy any more are freed.
    fn assign_counters(
        &mut self,
        plan: &PolicyPlan,
        desired: &BTreeMap<std::net::IpAddr, table::DesiredEndpoint>,
    ) -> Result<(), MapsError> {
        self.counters
            .retain(|(service, _), _| plan.services.contains_key(service));
        for (addr, want) in desired {
            for (d, dir) in [(&want.ingress, INGRESS), (&want.egress, EGRESS)] {
                let Some(d) = d else { continue };
                let key = (d.service.clone(), dir);
                if self.counters.contains_key(&key) {
                    continue;
                }
                let adopted = self.endpoints.get(&endpoint_key(*addr)).map(|v| {
                    if dir == INGRESS {
                        v.ingress.counter
                    } else {
                        v.egress.counter
                    }
                });
                let id = match adopted {
                    Some(id) if !self.counters.values().any(|c| *c == id) => id,
                    _ => {
                        let id = lowest_free(self.counters.values()).min(MAX_COUNTERS - 1);
                        self.maps.reset_counter(id)?;
                        id
                    }
                };
                self.counters.insert(key, id);
            }
        }
        Ok(())
    }

    /// Removes the rule sets no guarded address names and the port sets no rule
    /// set names; returns whether anything was removed.
    fn remove_unused(&mut self) -> Result<bool, MapsError> {
        let used: BTreeSet<u32> = self
            .endpoints
            .values()
            .flat_map(|v| [v.ingress.rules, v.egress.rules])
            .collect();
        let stale: Vec<u32> = self
            .rule_sets
            .keys()
            .filter(|id| !used.contains(id))
            .copied()
            .collect();
        let mut removed = false;
        for id in stale {
            if let Some(table) = self.rule_sets.remove(&id) {
                for net in table.keys() {
                    self.maps.delete_peer(&PeerEntry {
                        rules: id,
                        net: *net,
                    })?;
                }
                removed = true;
            }
        }
        let used_sets: HashSet<&BTreeSet<Port>> = self
            .rule_sets
            .values()
            .flat_map(|t| t.values().flatten())
            .collect();
        let stale: Vec<u32> = self
            .port_sets
            .iter()
            .filter(|(_, set)| !used_sets.contains(set))
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            if let Some(set) = self.port_sets.remove(&id) {
                for (proto, port) in set {
                    self.maps.delete_port(&PortKey {
                        set: id,
                        port: port.to_be(),
                        proto,
                        pad: 0,
                    })?;
                }
                removed = true;
            }
        }
        Ok(removed)
    }
}

/// The status reason of a table that did not fit in `map`.
fn full_reason(map: &str, capacity: u32) -> String {
    format!(
        "policy map {map} is full (capacity {capacity}): the guarded traffic is refused; raise --policy-max-entries"
    )
}

/// The lowest id ≥ 1 not in `used` (0 means "none" in the maps).
fn lowest_free<'a>(used: impl Iterator<Item = &'a u32>) -> u32 {
    let used: BTreeSet<u32> = used.copied().collect();
    (1..).find(|id| !used.contains(id)).unwrap_or(u32::MAX)
}
