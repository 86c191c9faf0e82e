//! Keeps the policy maps equal to a [`PolicyPlan`], by difference: a full pass
//! checks every guarded address, a change (the plan's [`PlanChange`]) only the
//! addresses it names (and those that failed before, to retry them).
//!
//! Rule sets and port sets are content-addressed ([`RuleStore`]): a table already
//! in the maps keeps its id, a changed one is written whole under a new id before
//! the guarded addresses switch to it, and the old entries go last, so a packet
//! meets either the old rules or the new ones, never a mix. Addresses no longer
//! guarded leave the map before new ones are written. A table that does not fit
//! (`--policy-max-entries`) is not written: the addresses it guards get the
//! deny-all marker (fail closed) and their services report the cause.

use super::{
    maps::{PolicyMaps, endpoint_key},
    store::RuleStore,
    table::{self, DesiredDirection, DesiredEndpoint, PeerTable},
};
use crate::{
    dataplane::ebpf::error::MapsError,
    model::ServiceKey,
    policy::{PlanChange, PolicyMode, PolicyPlan, PolicyState},
};
use agent_common::policy::{
    self as pol, EndpointKey, EndpointPolicy, MAX_COUNTERS, PolicyDirection,
};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

/// Direction index of counters: ingress.
pub const INGRESS: u8 = pol::DIR_INGRESS;
/// Direction index of counters: egress.
pub const EGRESS: u8 = pol::DIR_EGRESS;

/// The policy maps' sync engine.
pub struct PolicySync<P> {
    maps: P,
    /// Rule sets and port sets in the maps.
    store: RuleStore,
    /// Guarded addresses as written.
    endpoints: BTreeMap<EndpointKey, EndpointPolicy>,
    /// Counter ids by service and direction.
    counters: BTreeMap<(ServiceKey, u8), u32>,
    /// Each service with a policy: its rule count, mode and state.
    services: BTreeMap<ServiceKey, (usize, PolicyMode, PolicyState)>,
    /// The mode of the directions reporting to each service, as last written.
    modes: BTreeMap<ServiceKey, PolicyMode>,
    /// Guarded addresses that could not be programmed: their services and why.
    failures: BTreeMap<IpAddr, (BTreeSet<ServiceKey>, String)>,
    /// Whether the maps were read back (a previous agent's state adopted).
    adopted: bool,
}

/// Which guarded addresses a pass checks.
#[derive(Clone, Copy)]
enum Scope<'c> {
    /// Every one (and every written one not in the plan).
    All,
    /// These (and those that failed before).
    Some(&'c BTreeSet<IpAddr>),
}

impl<P: PolicyMaps> PolicySync<P> {
    /// An engine over `maps`; the first [`Self::apply`] adopts what they hold.
    pub fn new(maps: P) -> Self {
        Self {
            maps,
            store: RuleStore::default(),
            endpoints: BTreeMap::new(),
            counters: BTreeMap::new(),
            services: BTreeMap::new(),
            modes: BTreeMap::new(),
            failures: BTreeMap::new(),
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
        self.endpoints = self.maps.endpoints()?.into_iter().collect();
        self.store = RuleStore::adopt(&self.maps, self.endpoints.values())?;
        self.adopted = true;
        Ok(())
    }

    /// Makes the maps enforce `plan`, checking every guarded address. A map error
    /// leaves the engine to re-read the maps on the next apply.
    pub fn apply(&mut self, plan: &PolicyPlan) -> Result<(), MapsError> {
        self.run(plan, Scope::All)
    }

    /// Makes the maps enforce `plan`, which differs from the one last applied
    /// only as `change` says: only the addresses it names are written (a full
    /// pass when the maps were not read yet or the last apply failed).
    pub fn apply_change(
        &mut self,
        plan: &PolicyPlan,
        change: &PlanChange,
    ) -> Result<(), MapsError> {
        self.run(plan, Scope::Some(&change.addresses))
    }

    fn run(&mut self, plan: &PolicyPlan, scope: Scope<'_>) -> Result<(), MapsError> {
        let scope = if self.adopted { scope } else { Scope::All };
        if !self.adopted {
            self.adopt()?;
        }
        let result = self.apply_once(plan, scope).and_then(|retry| {
            // Tables that did not fit beside the old ones may fit now.
            if retry {
                self.apply_once(plan, scope).map(|_| ())
            } else {
                Ok(())
            }
        });
        if result.is_err() {
            self.adopted = false;
            self.store = RuleStore::default();
        }
        result
    }

    /// One pass; returns whether a table failed while stale entries were removed
    /// afterwards (a second pass may fit it).
    fn apply_once(&mut self, plan: &PolicyPlan, scope: Scope<'_>) -> Result<bool, MapsError> {
        // The addresses to check: in scope, or failed before.
        let addresses: BTreeSet<IpAddr> = match scope {
            Scope::All => plan.endpoints.keys().copied().collect(),
            Scope::Some(some) => some.iter().chain(self.failures.keys()).copied().collect(),
        };
        let desired = table::desired_for(plan, addresses.iter().copied());
        let capacity = self.maps.capacity();
        // Tables not in the maps yet, programmed in a fixed order.
        let missing: BTreeSet<&PeerTable> = desired
            .values()
            .flat_map(|e| [&e.ingress, &e.egress])
            .flatten()
            .map(|d| &d.table)
            .filter(|table| self.store.id(table).is_none())
            .collect();
        let mut failed: BTreeMap<&PeerTable, String> = BTreeMap::new();
        for table in missing {
            if let Err(reason) = self.store.program(&mut self.maps, table, capacity) {
                failed.insert(table, reason);
            }
        }
        self.assign_counters(plan, &desired)?;

        // The new value of each address in scope, and why any fails.
        match scope {
            Scope::All => self.failures.clear(),
            Scope::Some(_) => self.failures.retain(|a, _| !addresses.contains(a)),
        }
        let mut values = BTreeMap::new();
        for (addr, want) in &desired {
            let value = EndpointPolicy {
                ingress: self.direction(&want.ingress, INGRESS),
                egress: self.direction(&want.egress, EGRESS),
            };
            for d in [&want.ingress, &want.egress].into_iter().flatten() {
                self.modes.insert(d.service.clone(), d.mode);
                if let Some(reason) = failed.get(&d.table) {
                    self.fail(plan, *addr, reason.clone());
                }
            }
            values.insert(endpoint_key(*addr), (*addr, value));
        }
        // Addresses no longer guarded go first, so that new ones find their room.
        let gone: Vec<EndpointKey> = match scope {
            Scope::All => self
                .endpoints
                .keys()
                .filter(|k| !values.contains_key(k))
                .copied()
                .collect(),
            Scope::Some(_) => addresses
                .iter()
                .filter(|a| !plan.endpoints.contains_key(a))
                .map(|a| endpoint_key(*a))
                .filter(|k| self.endpoints.contains_key(k))
                .collect(),
        };
        for key in gone {
            self.maps.delete_endpoint(&key)?;
            let old = self.endpoints.remove(&key);
            self.store.retarget(old.as_ref(), None);
        }
        for (key, (addr, value)) in &values {
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
                self.fail(plan, *addr, reason);
                continue;
            }
            let old = self.endpoints.insert(*key, *value);
            self.store.retarget(old.as_ref(), Some(value));
        }
        let freed = self.store.remove_unused(&mut self.maps)?;
        self.modes
            .retain(|service, _| plan.services.contains_key(service));
        self.report(plan);
        Ok(!failed.is_empty() && freed)
    }

    /// One direction of a guarded address as the map holds it.
    fn direction(&self, d: &Option<DesiredDirection>, dir: u8) -> PolicyDirection {
        let Some(d) = d else {
            return PolicyDirection::default();
        };
        let counter = self.counters[&(d.service.clone(), dir)];
        let audit = d.mode == PolicyMode::Audit;
        let (rules, mode) = match (self.store.id(&d.table), audit) {
            (Some(id), false) => (id, pol::MODE_ENFORCE),
            (Some(id), true) => (id, pol::MODE_AUDIT),
            (None, false) => (0, pol::MODE_DENY_ALL),
            (None, true) => (0, pol::MODE_AUDIT_UNPROGRAMMABLE),
        };
        PolicyDirection {
            rules,
            counter,
            mode,
            pad: [0; 3],
        }
    }

    /// Records that guarded address `addr` could not be programmed, for `reason`.
    fn fail(&mut self, plan: &PolicyPlan, addr: IpAddr, reason: String) {
        let services = plan
            .endpoints
            .get(&addr)
            .map(|g| g.services.clone())
            .unwrap_or_default();
        self.failures.insert(addr, (services, reason));
    }

    /// Sets each service's rule count, mode and state (failed when one of its
    /// guarded addresses could not be programmed).
    fn report(&mut self, plan: &PolicyPlan) {
        let mut failures: BTreeMap<&ServiceKey, &String> = BTreeMap::new();
        for (services, reason) in self.failures.values() {
            for service in services {
                failures.insert(service, reason);
            }
        }
        self.services = plan
            .services
            .iter()
            .map(|(service, rules)| {
                let mode = self
                    .modes
                    .get(service)
                    .copied()
                    .unwrap_or(PolicyMode::Enforce);
                let state = match failures.get(service) {
                    Some(reason) => PolicyState::Failed {
                        reason: (*reason).clone(),
                    },
                    None => PolicyState::Programmed,
                };
                (service.clone(), (*rules, mode, state))
            })
            .collect();
    }

    /// Gives each (service, direction) a guarded address uses a counter id: the one
    /// it has, else the one an adopted address of it carries, else a fresh zeroed
    /// one. Counters of services without a policy any more are freed.
    fn assign_counters(
        &mut self,
        plan: &PolicyPlan,
        desired: &BTreeMap<IpAddr, DesiredEndpoint>,
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
}

/// The lowest id ≥ 1 not in `used` (0 means "none" in the maps).
fn lowest_free<'a>(used: impl Iterator<Item = &'a u32>) -> u32 {
    let used: BTreeSet<u32> = used.copied().collect();
    (1..).find(|id| !used.contains(id)).unwrap_or(u32::MAX)
}
