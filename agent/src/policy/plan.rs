//! The compiled policy of one node: every rule resolved to address prefixes and
//! ports, per guarded endpoint address, as the data planes enforce it.
//!
//! The unit of enforcement is an address of an endpoint on this node: packets to it
//! are checked against its ingress rules, packets from it against its egress rules.
//! An address that several services with policies share (one backend behind many
//! services) is guarded by the union of their rules, as Kubernetes unions the
//! policies selecting a pod.

pub use crate::model::PolicyMode;
use crate::model::{Protocol, ServiceKey};
use ipnet::IpNet;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

/// What the data planes of one node enforce.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyPlan {
    /// Each address of an endpoint on this node that at least one policy guards.
    pub endpoints: BTreeMap<IpAddr, GuardedEndpoint>,
    /// Every service with a `networkPolicy`, with its rule count (for `status` and
    /// `rune_policy_rules`), guarded addresses on this node or not.
    pub services: BTreeMap<ServiceKey, usize>,
}

/// The rules that guard one endpoint address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GuardedEndpoint {
    /// The services whose policies guard the address, in key order.
    pub services: BTreeSet<ServiceKey>,
    /// Packets to the address; `None` when no guarding policy has ingress rules
    /// (then every packet to it is allowed).
    pub ingress: Option<DirectionRules>,
    /// Packets from the address; `None` when no guarding policy has egress rules.
    pub egress: Option<DirectionRules>,
}

/// The rules of one direction of one guarded address: a packet is allowed when any
/// rule matches it (or, in audit mode, allowed and counted as one that would have
/// been dropped).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectionRules {
    /// Enforce when any guarding policy with rules in this direction enforces;
    /// audit only when all of them audit.
    pub mode: PolicyMode,
    /// The service verdicts are counted and reported under (the first guarding
    /// service with rules in this direction).
    pub service: ServiceKey,
    /// The allow rules; empty means nothing is allowed.
    pub rules: Vec<Rule>,
}

/// One allow rule: a packet whose peer address is in `peers` and whose port at the
/// guarded side's peer (ingress: the guarded address's own port; egress: the
/// destination port) is in `ports`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    /// The peer addresses: CIDR peers as written, service and namespace peers as
    /// host prefixes of their endpoints' addresses (on any node) and their VIPs.
    /// Empty: the rule matches nothing (e.g. a service peer with no endpoints yet).
    pub peers: BTreeSet<IpNet>,
    /// The ports allowed; empty means every port and protocol.
    pub ports: BTreeSet<PortMatch>,
}

/// One port of a rule, as it appears in the packet at the hook that checks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortMatch {
    /// TCP or UDP.
    pub protocol: Protocol,
    /// The port number.
    pub port: u16,
}
