//! The policy objects in the kernel, per guarded address and per group, and the
//! transaction that takes them from one plan to the next touching only the
//! addresses that changed.
//!
//! An address owns its verdict map entries and its port elements; a group's
//! sets, their peers and its check chain are shared by its members; chains and
//! counters are shared by a service's groups, the port sets by every group of
//! a direction and family, and counted. A group is named after
//! what its rules look like ([`layout`]); should members of one name need
//! different peers, the later ones take `NAME.2`, `NAME.3` …, so a set always
//! holds one aggregated peer list. The commands come in the order one
//! transaction needs: elements that change or go, new counters, sets and chains,
//! new elements, then the chains, sets and counters no longer used.

use super::{
    super::netlink::Element,
    PolicyKey, PolicyObjects,
    diff::Diff,
    fail_chain, full_script,
    layout::{self, Content, Want},
};
use crate::policy::{PolicyPlan, metrics::Direction};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

/// Which objects a guarded address gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Objects {
    /// Its rules, refusals logged to NFLOG `log_group` when given, each set
    /// holding at most `size` elements when given.
    Rules {
        /// The NFLOG group.
        log_group: Option<u16>,
        /// The sets' bound.
        size: Option<u32>,
    },
    /// Fail closed: its services' failure chains (the kernel refused the rules).
    Failed,
}

/// What is programmed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Programmed {
    /// Each guarded address's own elements and groups.
    addresses: BTreeMap<IpAddr, Own>,
    /// Each group in use.
    groups: BTreeMap<String, Group>,
    /// Each set in use with its definition and the number of groups using it.
    sets: BTreeMap<String, (String, usize)>,
    /// Each chain in use with its rules and the number of groups using it.
    chains: BTreeMap<String, (Vec<String>, usize)>,
    /// Each counter in use with the number of groups using it.
    counters: BTreeMap<String, usize>,
}

/// What one guarded address owns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Own {
    /// Its verdict map entries and port elements.
    elements: BTreeMap<(String, PolicyKey), Option<String>>,
    /// The groups it is a member of.
    groups: BTreeSet<String>,
}

/// One group: its content, objects and number of members.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Group {
    content: Content,
    objects: PolicyObjects,
    members: usize,
}

/// A transaction's policy commands and what is programmed once the kernel took
/// them ([`Programmed::commit`]).
#[derive(Debug)]
pub struct Pending {
    /// The `nft -f` commands.
    pub script: String,
    /// The same transaction as one netlink batch when it is element commands only
    /// (and not empty).
    pub elements: Option<Vec<Element>>,
    next: Next,
}

#[derive(Debug)]
enum Next {
    /// Everything anew (a full sync).
    Replace(Programmed),
    /// These addresses, groups, chains and counters (`None`/0: gone).
    Update {
        addresses: Vec<(IpAddr, Option<Own>)>,
        groups: Vec<(String, Option<Group>)>,
        sets: Vec<(String, String, usize)>,
        chains: Vec<(String, Vec<String>, usize)>,
        counters: Vec<(String, usize)>,
    },
}

/// What address `addr` of `plan` wants per direction (none when not guarded).
fn wants(plan: &PolicyPlan, addr: IpAddr, kind: Objects) -> Option<Vec<(Direction, Want)>> {
    let guarded = plan.endpoints.get(&addr)?;
    let mut out = Vec::new();
    for (d, rules) in [
        (Direction::Ingress, &guarded.ingress),
        (Direction::Egress, &guarded.egress),
    ] {
        let Some(rules) = rules else { continue };
        let want = match kind {
            Objects::Rules { .. } => layout::want(addr, guarded, d, rules),
            Objects::Failed => Want {
                base: fail_chain(d, &rules.service),
                content: Content {
                    direction: d,
                    v4: true,
                    mode: rules.mode,
                    service: rules.service.clone(),
                    any: None,
                    peers: Vec::new(),
                },
                ports: Vec::new(),
                failed: true,
            },
        };
        out.push((d, want));
    }
    Some(out)
}

/// The objects of group `name` with `content`.
fn group_objects(name: &str, content: &Content, failed: bool, kind: Objects) -> PolicyObjects {
    let mut out = PolicyObjects::default();
    match kind {
        Objects::Rules { log_group, size } if !failed => {
            layout::group_objects(&mut out, name, content, log_group, size);
        }
        _ => layout::failed_objects(
            &mut out,
            name,
            content.direction,
            content.mode,
            &content.service,
        ),
    }
    out
}

impl Programmed {
    /// Everything programmed, as one set of objects.
    pub fn objects(&self) -> PolicyObjects {
        let mut out = PolicyObjects::default();
        for g in self.groups.values() {
            out.extend(&g.objects);
        }
        for o in self.addresses.values() {
            out.elements
                .extend(o.elements.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        out
    }

    /// The addresses programmed or guarded by `plan`.
    pub fn all_addresses(&self, plan: &PolicyPlan) -> BTreeSet<IpAddr> {
        let mut out: BTreeSet<IpAddr> = self.addresses.keys().copied().collect();
        out.extend(plan.endpoints.keys().copied());
        out
    }

    /// What programming `plan` from nothing leads to.
    pub fn build(plan: &PolicyPlan, kind: Objects) -> Programmed {
        let mut next = Programmed::default();
        let all = plan.endpoints.keys().copied().collect();
        let pending = next.plan(plan, &all, kind, false);
        next.commit(pending);
        next
    }

    /// A full sync to `plan`: see [`full_script`] (`existing_chains` are the
    /// table's chains, `size` the verdict maps' bound).
    pub fn full(
        plan: &PolicyPlan,
        kind: Objects,
        existing_chains: &BTreeSet<String>,
        size: Option<u32>,
    ) -> Pending {
        let next = Self::build(plan, kind);
        Pending {
            script: full_script(&next.objects(), existing_chains, size),
            elements: None,
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
        self.plan(plan, addresses, kind, true)
    }

    fn plan(
        &self,
        plan: &PolicyPlan,
        addresses: &BTreeSet<IpAddr>,
        kind: Objects,
        write: bool,
    ) -> Pending {
        // Members each touched group keeps, without the addresses that change.
        let mut members: BTreeMap<String, usize> = BTreeMap::new();
        for addr in addresses {
            for g in self.addresses.get(addr).iter().flat_map(|o| &o.groups) {
                let n = members
                    .entry(g.clone())
                    .or_insert_with(|| self.groups.get(g).map_or(0, |g| g.members));
                *n = n.saturating_sub(1);
            }
        }
        // Each address's groups, named: the base, or the first `.N` that holds
        // this content or nothing.
        let mut claimed: BTreeMap<String, (Content, bool)> = BTreeMap::new();
        let mut updates = Vec::new();
        for addr in addresses {
            let Some(wants) = wants(plan, *addr, kind) else {
                updates.push((*addr, None));
                continue;
            };
            let mut own = Own::default();
            for (d, want) in wants {
                let name = (1..)
                    .map(|n| match n {
                        1 => want.base.clone(),
                        n => format!("{}.{n}", want.base),
                    })
                    .find(|name| match claimed.get(name) {
                        Some((c, _)) => *c == want.content,
                        None => match self.groups.get(name) {
                            Some(g) if g.content != want.content => {
                                members.get(name).copied().unwrap_or(g.members) == 0
                            }
                            _ => true,
                        },
                    })
                    .unwrap_or_default();
                claimed
                    .entry(name.clone())
                    .or_insert_with(|| (want.content.clone(), want.failed));
                // A name not counted yet has no member among `addresses`.
                *members
                    .entry(name.clone())
                    .or_insert_with(|| self.groups.get(&name).map_or(0, |g| g.members)) += 1;
                let (group, target) = if want.failed {
                    (None, name.clone())
                } else {
                    (Some(name.as_str()), layout::check_chain(&name))
                };
                let mut objects = PolicyObjects::default();
                layout::own_elements(&mut objects, *addr, d, group, &target, &want.ports);
                own.elements.extend(objects.elements);
                own.groups.insert(name);
            }
            updates.push((*addr, Some(own)));
        }
        // The touched groups as they will be.
        let groups: Vec<(String, Option<Group>)> = members
            .iter()
            .map(|(name, n)| {
                let old = self.groups.get(name);
                let group = match (claimed.get(name), old) {
                    _ if *n == 0 => None,
                    (Some((c, _)), Some(g)) if g.content == *c => Some(Group {
                        members: *n,
                        ..g.clone()
                    }),
                    (Some((c, failed)), _) => Some(Group {
                        content: c.clone(),
                        objects: group_objects(name, c, *failed, kind),
                        members: *n,
                    }),
                    (None, g) => g.map(|g| Group {
                        members: *n,
                        ..g.clone()
                    }),
                };
                (name.clone(), group)
            })
            .collect();
        let mut diff = Diff::new(write);
        let empty = PolicyObjects::default();
        for (name, new) in &groups {
            let old = self.groups.get(name).map_or(&empty, |g| &g.objects);
            let new = new.as_ref().map_or(&empty, |g| &g.objects);
            if old != new {
                diff.objects(self, old, new);
            }
        }
        for (addr, new) in &updates {
            let old = self.addresses.get(addr).map(|o| &o.elements);
            let new = new.as_ref().map(|o| &o.elements);
            diff.elements(old.into_iter().flatten(), new.into_iter().flatten());
        }
        let (script, elements) = if write {
            diff.commands()
        } else {
            (String::new(), None)
        };
        Pending {
            script,
            elements,
            next: Next::Update {
                addresses: updates,
                groups,
                sets: diff.sets.into_iter().map(|(k, (d, n))| (k, d, n)).collect(),
                chains: diff
                    .chains
                    .into_iter()
                    .map(|(k, (r, n))| (k, r, n))
                    .collect(),
                counters: diff.counters.into_iter().collect(),
            },
        }
    }

    /// Set `name` with its definition and use count, when in use.
    pub(super) fn set(&self, name: &str) -> Option<&(String, usize)> {
        self.sets.get(name)
    }

    /// Chain `name` with its rules and use count, when in use.
    pub(super) fn chain(&self, name: &str) -> Option<&(Vec<String>, usize)> {
        self.chains.get(name)
    }

    /// The use count of counter `name`.
    pub(super) fn counter(&self, name: &str) -> usize {
        self.counters.get(name).copied().unwrap_or(0)
    }

    /// Takes in that the kernel accepted `pending`.
    pub fn commit(&mut self, pending: Pending) {
        match pending.next {
            Next::Replace(next) => *self = next,
            Next::Update {
                addresses,
                groups,
                sets,
                chains,
                counters,
            } => {
                for (addr, own) in addresses {
                    match own {
                        Some(own) => self.addresses.insert(addr, own),
                        None => self.addresses.remove(&addr),
                    };
                }
                for (name, group) in groups {
                    match group {
                        Some(group) => self.groups.insert(name, group),
                        None => self.groups.remove(&name),
                    };
                }
                for (name, def, n) in sets {
                    match n {
                        0 => self.sets.remove(&name),
                        n => self.sets.insert(name, (def, n)),
                    };
                }
                for (name, rules, n) in chains {
                    match n {
                        0 => self.chains.remove(&name),
                        n => self.chains.insert(name, (rules, n)),
                    };
                }
                for (name, n) in counters {
                    match n {
                        0 => self.counters.remove(&name),
                        n => self.counters.insert(name, n),
                    };
                }
            }
        }
    }
}
