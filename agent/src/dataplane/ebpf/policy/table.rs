//! A [`PolicyPlan`] in the shape of the kernel's policy maps: per rule set a table
//! of peer prefixes, each with the ports it allows.
//!
//! The kernel finds a peer by longest prefix match only, so each prefix's entry
//! carries the ports of every rule whose peers contain it (the same prefix or a
//! shorter one): the longest match then allows what any matching rule allows.

use super::super::codec::proto_number;
use crate::model::ServiceKey;
use crate::policy::{DirectionRules, PolicyMode, PolicyPlan, Rule};
use ipnet::IpNet;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

/// One port as the maps hold it: (IP protocol number, port in host order).
pub type Port = (u8, u16);

/// The ports a peer prefix allows: `None` for every port and protocol.
pub type PortSpec = Option<BTreeSet<Port>>;

/// A rule set as the kernel sees it: peer prefix → allowed ports. Rule sets with
/// the same table share one id in the maps.
pub type PeerTable = BTreeMap<IpNet, PortSpec>;

/// One direction of a guarded address, before ids are given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredDirection {
    /// Enforce or audit.
    pub mode: PolicyMode,
    /// The service whose counters and status the verdicts go to.
    pub service: ServiceKey,
    /// The rules in the maps' shape.
    pub table: PeerTable,
}

/// A guarded address's two directions (`None`: unguarded in that direction).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredEndpoint {
    /// Packets to the address.
    pub ingress: Option<DesiredDirection>,
    /// Packets from the address.
    pub egress: Option<DesiredDirection>,
}

/// Every guarded address of `plan` with its rules in the maps' shape.
#[must_use]
pub fn desired(plan: &PolicyPlan) -> BTreeMap<IpAddr, DesiredEndpoint> {
    desired_for(plan, plan.endpoints.keys().copied())
}

/// The guarded addresses of `plan` among `addresses` with their rules in the
/// maps' shape (those `plan` does not guard are left out).
#[must_use]
pub fn desired_for(
    plan: &PolicyPlan,
    addresses: impl Iterator<Item = IpAddr>,
) -> BTreeMap<IpAddr, DesiredEndpoint> {
    // The endpoints of one service mostly share their rules: each table once.
    let mut tables = HashMap::new();
    addresses
        .filter_map(|addr| plan.endpoints.get_key_value(&addr))
        .map(|(addr, guarded)| {
            let endpoint = DesiredEndpoint {
                ingress: desired_direction(&mut tables, &guarded.ingress),
                egress: desired_direction(&mut tables, &guarded.egress),
            };
            (*addr, endpoint)
        })
        .collect()
}

/// One direction of [`desired`], its table taken from `tables` when the same
/// rules were seen before.
fn desired_direction<'p>(
    tables: &mut HashMap<&'p [Rule], PeerTable>,
    rules: &'p Option<DirectionRules>,
) -> Option<DesiredDirection> {
    rules.as_ref().map(|r| DesiredDirection {
        mode: r.mode,
        service: r.service.clone(),
        table: tables
            .entry(r.rules.as_slice())
            .or_insert_with(|| peer_table(&r.rules))
            .clone(),
    })
}

/// The peer table of `rules`: every peer prefix with the union of the ports of
/// the rules whose peers contain it.
#[must_use]
pub fn peer_table(rules: &[Rule]) -> PeerTable {
    // Each prefix once, with the ports of the rules naming it exactly.
    let mut own: PeerTable = BTreeMap::new();
    for rule in rules {
        let ports: PortSpec = if rule.ports.is_empty() {
            None
        } else {
            Some(
                rule.ports
                    .iter()
                    .map(|p| (proto_number(p.protocol), p.port))
                    .collect(),
            )
        };
        for peer in &rule.peers {
            let peer = peer.trunc();
            let entry = own.entry(peer).or_insert_with(|| Some(BTreeSet::new()));
            merge(entry, &ports);
        }
    }
    // Only a prefix shorter than a host prefix can contain another one: most peers
    // are host prefixes (endpoints, VIPs), so each prefix checks a few networks.
    let networks: Vec<(&IpNet, &PortSpec)> = own
        .iter()
        .filter(|(net, _)| net.prefix_len() < net.max_prefix_len())
        .collect();
    own.iter()
        .map(|(prefix, own_ports)| {
            let mut ports = own_ports.clone();
            for (outer, outer_ports) in &networks {
                if *outer != prefix && outer.contains(prefix) {
                    merge(&mut ports, outer_ports);
                }
            }
            (*prefix, ports)
        })
        .collect()
}

/// Adds `more` to `into` (every port absorbs everything).
fn merge(into: &mut PortSpec, more: &PortSpec) {
    match (into.as_mut(), more) {
        (None, _) => {}
        (Some(_), None) => *into = None,
        (Some(set), Some(more)) => set.extend(more.iter().copied()),
    }
}

/// The number of peer entries `table` takes in the IPv4 and the IPv6 trie.
#[must_use]
pub fn peer_entries(table: &PeerTable) -> (usize, usize) {
    let v4 = table.keys().filter(|n| matches!(n, IpNet::V4(_))).count();
    (v4, table.len() - v4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;
    use crate::policy::PortMatch;

    fn rule(peers: &[&str], ports: &[(Protocol, u16)]) -> Rule {
        Rule {
            peers: peers.iter().map(|p| p.parse().unwrap()).collect(),
            ports: ports
                .iter()
                .map(|(protocol, port)| PortMatch {
                    protocol: *protocol,
                    port: *port,
                })
                .collect(),
        }
    }

    #[test]
    fn a_longer_prefix_carries_the_ports_of_the_shorter_ones_containing_it() {
        let table = peer_table(&[
            rule(&["198.18.0.0/16"], &[(Protocol::Tcp, 80)]),
            rule(&["198.18.1.0/24", "198.19.0.1/32"], &[(Protocol::Udp, 53)]),
        ]);
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        assert_eq!(
            table[&net("198.18.1.0/24")],
            Some([(17, 53), (6, 80)].into_iter().collect())
        );
        assert_eq!(table[&net("198.18.0.0/16")], Some([(6, 80)].into()));
        assert_eq!(table[&net("198.19.0.1/32")], Some([(17, 53)].into()));
        assert_eq!(peer_entries(&table), (3, 0));
    }

    #[test]
    fn a_rule_without_ports_allows_every_port_of_the_prefixes_inside_its_peers() {
        let table = peer_table(&[
            rule(&["fd00::/8"], &[]),
            rule(&["fd00:1::/64", "198.18.0.1/32"], &[(Protocol::Tcp, 443)]),
        ]);
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        assert_eq!(table[&net("fd00:1::/64")], None);
        assert_eq!(table[&net("198.18.0.1/32")], Some([(6, 443)].into()));
        assert_eq!(peer_entries(&table), (1, 2));
    }

    #[test]
    fn host_bits_of_a_prefix_are_cleared() {
        let table = peer_table(&[rule(&["198.18.1.7/24"], &[])]);
        assert_eq!(
            table.keys().collect::<Vec<_>>(),
            vec![&"198.18.1.0/24".parse::<IpNet>().unwrap()]
        );
    }
}
