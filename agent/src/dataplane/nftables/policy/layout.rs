//! The objects of one direction of one guarded address: the check chain of its
//! group, the group's sets and their peer prefixes, and the address's own
//! elements (its entry in the direction's verdict map, its ports).
//!
//! A group is what the guarded addresses of a service with the same rules share:
//! its name says the direction and family, the mode, the shape of the rules
//! (`a` when a rule allows every port, then the number of port rules), the
//! reporting service and, for an address several services guard, a digest of
//! them (`in4-ea1-shop/web`, `out6-e2-shop/web.1f2e3d4c`). Everything a chain's
//! rules say is in its name, so a change of peers or ports is elements only.

use super::{PolicyKey, PolicyObjects, counter, dir, verdict_chains};
use crate::{
    model::{PolicyMode, ServiceKey},
    policy::{DirectionRules, GuardedEndpoint, PortMatch, metrics::Direction},
};
use ipnet::IpNet;
use std::{collections::BTreeSet, net::IpAddr};

/// What the sets of a group hold: the same for every address of the group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Content {
    /// Ingress or egress.
    pub direction: Direction,
    /// IPv4 (else IPv6).
    pub v4: bool,
    /// Enforce or audit.
    pub mode: PolicyMode,
    /// The service verdicts are counted under.
    pub service: ServiceKey,
    /// The aggregated peers of the rule for every port, when there is one.
    pub any: Option<Vec<IpNet>>,
    /// The aggregated peers of each port rule.
    pub peers: Vec<Vec<IpNet>>,
}

/// One direction of one guarded address, before its group is named.
#[derive(Clone, Debug)]
pub struct Want {
    /// The group's name unless its content is taken (then `.2`, `.3` … follow).
    pub base: String,
    /// The group's content.
    pub content: Content,
    /// The address's ports of each port rule.
    pub ports: Vec<BTreeSet<PortMatch>>,
    /// Fail closed: the base is the service's failure chain.
    pub failed: bool,
}

/// The rules of `guarded` address `addr` in direction `d`.
pub fn want(addr: IpAddr, guarded: &GuardedEndpoint, d: Direction, rules: &DirectionRules) -> Want {
    let v4 = addr.is_ipv4();
    let family = |n: &&IpNet| n.addr().is_ipv4() == v4;
    let mut any = None;
    let mut peers = Vec::new();
    let mut ports = Vec::new();
    for rule in &rules.rules {
        let nets: Vec<IpNet> = rule.peers.iter().filter(family).copied().collect();
        if rule.ports.is_empty() {
            any.get_or_insert_with(Vec::new).extend(nets);
        } else {
            peers.push(IpNet::aggregate(&nets));
            ports.push(rule.ports.clone());
        }
    }
    let any = any.map(|nets| IpNet::aggregate(&nets));
    let m = mode_letter(rules.mode);
    let shape = format!("{m}{}{}", if any.is_some() { "a" } else { "" }, peers.len());
    let key = &rules.service;
    let mut base = format!(
        "{}{}-{shape}-{}/{}",
        dir(d),
        if v4 { '4' } else { '6' },
        key.namespace,
        key.name
    );
    if guarded.services.len() > 1 {
        let all: Vec<String> = guarded.services.iter().map(ToString::to_string).collect();
        let digest = super::super::nflog::digest(&ServiceKey::new("", all.join(",")));
        base = format!("{base}.{}", &digest[..8]);
    }
    Want {
        base,
        content: Content {
            direction: d,
            v4,
            mode: rules.mode,
            service: rules.service.clone(),
            any,
            peers,
        },
        ports,
        failed: false,
    }
}

/// `e` (enforce) or `a` (audit), as chain names say it.
pub fn mode_letter(mode: PolicyMode) -> char {
    if mode == PolicyMode::Audit { 'a' } else { 'e' }
}

/// A group's sets: the peers of the rule for every port (when there is one),
/// then per port rule its peers and its ports.
pub type GroupSets = (Option<String>, Vec<(String, String)>);

/// The port set of port rule `i` of every group of direction and family `dir`
/// (`in4` …): its elements are keyed by their guarded address, so one set
/// serves them all.
pub fn port_set(dir: &str, i: usize) -> String {
    format!("pol-{dir}-q{i}")
}

/// The check chain of group `group`.
pub fn check_chain(group: &str) -> String {
    format!("pol-c-{group}")
}

/// The sets of group `group` (named after its check chain's suffix), read from
/// the name alone, so a full sync finds the sets of the chains it deletes.
pub fn sets(group: &str) -> Option<GroupSets> {
    let mut parts = group.splitn(3, '-');
    let dir = parts.next()?;
    let shape = parts.next()?.get(1..)?;
    let (any, k) = match shape.strip_prefix('a') {
        Some(k) => (true, k),
        None => (false, shape),
    };
    let k: usize = k.parse().ok()?;
    let any = any.then(|| format!("pol-any-{group}"));
    let rules = (0..k)
        .map(|i| (format!("pol-p{i}-{group}"), port_set(dir, i)))
        .collect();
    Some((any, rules))
}

/// The objects group `group` with `content` adds: its sets (bounded by `size`)
/// with their peers, its check chain, its service's verdict chains (refusals
/// logged to `log_group`) and counters.
pub fn group_objects(
    out: &mut PolicyObjects,
    group: &str,
    c: &Content,
    log_group: Option<u16>,
    size: Option<u32>,
) {
    let [ok, port, nomatch] = verdict_chains(out, c.direction, c.mode, &c.service, log_group);
    let (addr, ip) = if c.v4 {
        ("ipv4_addr", "ip")
    } else {
        ("ipv6_addr", "ip6")
    };
    let (guarded, peer) = match c.direction {
        Direction::Ingress => ("daddr", "saddr"),
        Direction::Egress => ("saddr", "daddr"),
    };
    let size = size.map_or_else(String::new, |n| format!(" size {n} ;"));
    let peer_set = format!("{{ type {addr} ; flags interval ;{size} }}");
    let port_set = format!("{{ type {addr} . inet_proto . inet_service ;{size} }}");
    let Some((any, rules)) = sets(group) else {
        return;
    };
    let add_peers = |out: &mut PolicyObjects, set: &str, nets: &[IpNet]| {
        out.sets.insert(set.to_owned(), peer_set.clone());
        for n in nets {
            out.elements
                .insert((set.to_owned(), PolicyKey::Prefix(*n)), None);
        }
    };
    let mut chain = Vec::new();
    if let (Some(set), Some(nets)) = (&any, &c.any) {
        add_peers(out, set, nets);
        chain.push(format!("{ip} {peer} @{set} goto {ok}"));
    }
    for ((p, q), nets) in rules.iter().zip(&c.peers) {
        add_peers(out, p, nets);
        out.sets.insert(q.clone(), port_set.clone());
        chain.push(format!(
            "{ip} {guarded} . meta l4proto . th dport @{q} {ip} {peer} @{p} goto {ok}"
        ));
    }
    for (p, _) in &rules {
        chain.push(format!("{ip} {peer} @{p} goto {port}"));
    }
    chain.push(format!("goto {nomatch}"));
    out.chains.insert(check_chain(group), chain);
}

/// The objects of fail-closed group `chain` (`pol-fail-DIR-NS/NAME`): the chain
/// that counts and drops (audit: returns) and its counter.
pub fn failed_objects(
    out: &mut PolicyObjects,
    chain: &str,
    d: Direction,
    mode: PolicyMode,
    key: &ServiceKey,
) {
    out.counters.insert(counter(d, "unprog", key));
    out.chains.insert(
        chain.to_owned(),
        vec![super::deny_rule(d, mode, "unprog", key)],
    );
}

/// The elements address `addr` owns in direction `d` as a member of group
/// `group` (`None`: fail closed, going to chain `target`): its verdict map entry
/// and its ports.
pub fn own_elements(
    out: &mut PolicyObjects,
    addr: IpAddr,
    d: Direction,
    group: Option<&str>,
    target: &str,
    ports: &[BTreeSet<PortMatch>],
) {
    let f = if addr.is_ipv4() { '4' } else { '6' };
    let map = format!("pol-{}{f}", dir(d));
    out.elements.insert(
        (map.clone(), PolicyKey::Addr(addr)),
        Some(target.to_owned()),
    );
    if group.is_none() {
        return;
    }
    for (i, ports) in ports.iter().enumerate() {
        for p in ports {
            out.elements.insert(
                (
                    port_set(&map["pol-".len()..], i),
                    PolicyKey::Port(addr, p.protocol, p.port),
                ),
                None,
            );
        }
    }
}
