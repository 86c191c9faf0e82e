//! The network policy maps: guarded endpoint addresses, their rules as peer
//! prefixes and port sets, the policy conntrack and the verdict counters.
//!
//! The programs `rune_tc_policy_to` (tc egress of a policy interface: packets
//! delivered to a local endpoint, its *ingress* rules) and `rune_tc_policy_from`
//! (tc ingress: packets sent by a local endpoint, its *egress* rules) read them:
//!
//! 1. [`ENDPOINTS`]: the guarded address (destination or source) → per direction a
//!    rule-set id, a counter id and a mode. No entry: the packet passes.
//! 2. [`POLICY_CONNTRACK_V4`]/`_V6`: a flow this hook or the opposite one allowed
//!    before passes (replies included) without a rule lookup. A TCP SYN without ACK
//!    is always checked against the rules: a policy change applies to every new
//!    connection.
//! 3. [`PEERS_V4`]/`_V6`: LPM tries keyed by (rule-set id, peer address): the
//!    longest prefix of the rule set holding the peer names a port set. The agent
//!    merges the ports of every containing prefix into each entry, so the longest
//!    match alone decides.
//! 4. [`PORTS`]: (port set, destination port, protocol) → allowed. Port set
//!    [`PORTS_ALL`] allows every port and protocol.
//!
//! Byte order as in [`crate::lb`]: addresses and ports in network order.

use crate::lb::Addr;

/// [`PolicyDirection::mode`]: no rules in this direction (every packet passes).
pub const MODE_NONE: u8 = 0;
/// Packets no rule allows are dropped.
pub const MODE_ENFORCE: u8 = 1;
/// Packets no rule allows pass and are counted as audit would-drops.
pub const MODE_AUDIT: u8 = 2;
/// The rules could not be programmed (fail closed): every new flow is dropped and
/// counted as [`Verdict::DropUnprogrammable`].
pub const MODE_DENY_ALL: u8 = 3;
/// An audit policy that could not be programmed: flows pass and are counted as
/// [`Verdict::AuditUnprogrammable`] (audit never refuses).
pub const MODE_AUDIT_UNPROGRAMMABLE: u8 = 4;

/// [`PolicyCtKeyV4::dir`]: the entry was made by an ingress check (packet to the
/// guarded endpoint, which is the destination).
pub const DIR_INGRESS: u8 = 0;
/// The entry was made by an egress check (packet from the guarded endpoint).
pub const DIR_EGRESS: u8 = 1;

/// [`PeerValue::ports`] that allows every port and protocol.
pub const PORTS_ALL: u32 = 0;

/// A guarded address. Key of [`ENDPOINTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointKey {
    /// The address (network order; IPv4 in word 0).
    pub addr: Addr,
    /// [`crate::lb::FAMILY_V4`] or [`crate::lb::FAMILY_V6`].
    pub family: u8,
    /// Always zero.
    pub pad: [u8; 3],
}

/// One direction's policy of a guarded address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyDirection {
    /// The rule set's id in [`PEERS_V4`]/[`PEERS_V6`] (rule sets with the same
    /// rules share one id).
    pub rules: u32,
    /// The verdict counters' id: [`verdict_slot`] (one per service and direction).
    pub counter: u32,
    /// [`MODE_NONE`], [`MODE_ENFORCE`], [`MODE_AUDIT`], [`MODE_DENY_ALL`] or
    /// [`MODE_AUDIT_UNPROGRAMMABLE`].
    pub mode: u8,
    /// Always zero.
    pub pad: [u8; 3],
}

/// Both directions of a guarded address. Value of [`ENDPOINTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointPolicy {
    /// Packets to the address.
    pub ingress: PolicyDirection,
    /// Packets from the address.
    pub egress: PolicyDirection,
}

/// The data of an IPv4 peer key: rule set, then the peer address. An LPM key's
/// prefix length is `32 + prefix` (the rule set always matches in full).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerV4 {
    /// The rule set's id, big-endian (any fixed order works: it is matched whole).
    pub rules: u32,
    /// The peer address (network order).
    pub addr: u32,
}

/// The data of an IPv6 peer key; see [`PeerV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerV6 {
    /// The rule set's id, big-endian.
    pub rules: u32,
    /// The peer address (network order).
    pub addr: Addr,
}

/// What a peer prefix allows. Value of [`PEERS_V4`] and [`PEERS_V6`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerValue {
    /// The port set in [`PORTS`], or [`PORTS_ALL`].
    pub ports: u32,
}

/// One allowed port of a port set. Key of [`PORTS`] (value: `u32` 1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortKey {
    /// The port set's id (never [`PORTS_ALL`]).
    pub set: u32,
    /// The destination port (network order).
    pub port: u16,
    /// [`crate::lb::PROTO_TCP`] or [`crate::lb::PROTO_UDP`].
    pub proto: u8,
    /// Always zero.
    pub pad: u8,
}

/// A policy conntrack key of either family (`A`: `u32` or [`Addr`]): the flow's
/// two ends, the lower (address, port; compared as the program loads them, in
/// host order of the packet's bytes) first, and the direction of the check that
/// allowed it, turned when the first packet went from the higher end; so a packet
/// at the hook of that check and a reply at the opposite hook find the same key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PolicyCtKey<A> {
    /// The lower end's address.
    pub saddr: A,
    /// The higher end's address.
    pub daddr: A,
    /// The lower end's port.
    pub sport: u16,
    /// The higher end's port.
    pub dport: u16,
    /// IP protocol.
    pub proto: u8,
    /// [`DIR_INGRESS`] or [`DIR_EGRESS`].
    pub dir: u8,
    /// Always zero.
    pub pad: [u8; 2],
}

/// Key of [`POLICY_CONNTRACK_V4`].
pub type PolicyCtKeyV4 = PolicyCtKey<u32>;

/// Key of [`POLICY_CONNTRACK_V6`].
pub type PolicyCtKeyV6 = PolicyCtKey<Addr>;

/// A policy conntrack value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PolicyCtValue {
    /// UDP: [`crate::lb::ct_now`] at the flow's last packet (refreshed at most once
    /// per unit); the entry is dead after [`crate::lb::CT_UDP_TIMEOUT_UNITS`]. TCP: 0.
    pub last_seen: u32,
}

/// A verdict on a new flow (or a packet without ports), counted per counter id.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verdict {
    /// A rule allowed it.
    Allow = 0,
    /// Dropped: no rule's peers hold the peer address.
    DropNoMatchingRule = 1,
    /// Dropped: a rule's peers hold it, but not for this port.
    DropPortNotAllowed = 2,
    /// Dropped: the policy could not be programmed.
    DropUnprogrammable = 3,
    /// Audit: would have been dropped, no matching rule.
    AuditNoMatchingRule = 4,
    /// Audit: would have been dropped, port not allowed.
    AuditPortNotAllowed = 5,
    /// Audit: would have been dropped, the policy could not be programmed.
    AuditUnprogrammable = 6,
}

impl Verdict {
    /// Every verdict, in index order.
    pub const ALL: [Self; 7] = [
        Self::Allow,
        Self::DropNoMatchingRule,
        Self::DropPortNotAllowed,
        Self::DropUnprogrammable,
        Self::AuditNoMatchingRule,
        Self::AuditPortNotAllowed,
        Self::AuditUnprogrammable,
    ];

    /// The metric label of a drop or audit verdict's reason (`None` for allow).
    #[must_use]
    pub const fn reason(self) -> Option<&'static str> {
        match self {
            Self::Allow => None,
            Self::DropNoMatchingRule | Self::AuditNoMatchingRule => Some("no_matching_rule"),
            Self::DropPortNotAllowed | Self::AuditPortNotAllowed => Some("port_not_allowed"),
            Self::DropUnprogrammable | Self::AuditUnprogrammable => Some("policy_unprogrammable"),
        }
    }

    /// Whether the packet was dropped.
    #[must_use]
    pub const fn dropped(self) -> bool {
        matches!(
            self,
            Self::DropNoMatchingRule | Self::DropPortNotAllowed | Self::DropUnprogrammable
        )
    }
}

/// Slots per counter id in [`VERDICTS`] (a power of two ≥ the verdicts).
pub const VERDICT_SLOTS: u32 = 8;

/// The slot of counter `counter`'s `verdict` in [`VERDICTS`].
#[inline(always)]
#[must_use]
pub const fn verdict_slot(counter: u32, verdict: Verdict) -> u32 {
    counter
        .wrapping_mul(VERDICT_SLOTS)
        .wrapping_add(verdict as u32)
}

/// Counter ids [`VERDICTS`] has room for (one per service and direction).
pub const MAX_COUNTERS: u32 = 2048;

/// A verdict event: a new flow (or a packet without ports) a policy dropped or,
/// in audit mode, would have dropped. Records of [`EVENTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct VerdictEvent {
    /// Source address (network order; IPv4 in word 0).
    pub saddr: Addr,
    /// Destination address.
    pub daddr: Addr,
    /// Source port (network order; 0 without ports).
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// The counter id of the service and direction ([`PolicyDirection::counter`]).
    pub counter: u32,
    /// IP protocol.
    pub proto: u8,
    /// [`crate::lb::FAMILY_V4`] or [`crate::lb::FAMILY_V6`].
    pub family: u8,
    /// [`DIR_INGRESS`] or [`DIR_EGRESS`].
    pub dir: u8,
    /// The [`Verdict`] as a number.
    pub verdict: u8,
}

/// Events each CPU may write per [`EVENT_WINDOW_NS`]; more are counted in
/// [`EVENT_DROPS`] (slot [`EVENT_DROP_RATE`]) and not written, so a flood cannot
/// starve the agent.
pub const EVENTS_PER_WINDOW: u64 = 200;
/// The rate limit's window: 100 ms.
pub const EVENT_WINDOW_NS: u64 = 100_000_000;
/// [`EVENT_DROPS`] slot: events over the rate limit.
pub const EVENT_DROP_RATE: u32 = 0;
/// [`EVENT_DROPS`] slot: events the ring buffer had no room for.
pub const EVENT_DROP_FULL: u32 = 1;
/// Bytes of the [`EVENTS`] ring buffer (a power of two of pages).
pub const EVENTS_BYTES: u32 = 256 * 1024;

// Map names.

/// `RingBuf` of [`VerdictEvent`]s.
pub const EVENTS: &str = "RUNE_POL_EVENTS";
/// `PerCpuArray<[u64; 2]>` of one entry: each CPU's rate-limit window start and
/// events written in it.
pub const EVENT_BUDGET: &str = "RUNE_POL_EVENT_BUDGET";
/// `PerCpuArray<u64>` of 2: events not written, by [`EVENT_DROP_RATE`] and
/// [`EVENT_DROP_FULL`].
pub const EVENT_DROPS: &str = "RUNE_POL_EVENT_DROPS";

/// `HashMap<EndpointKey, EndpointPolicy>`: the guarded addresses.
pub const ENDPOINTS: &str = "RUNE_POL_EP";
/// `LpmTrie<PeerV4, PeerValue>`: IPv4 peer prefixes per rule set.
pub const PEERS_V4: &str = "RUNE_POL_PEER4";
/// `LpmTrie<PeerV6, PeerValue>`: IPv6 peer prefixes per rule set.
pub const PEERS_V6: &str = "RUNE_POL_PEER6";
/// `HashMap<PortKey, u32>`: the port sets.
pub const PORTS: &str = "RUNE_POL_PORTS";
/// `LruHashMap<PolicyCtKeyV4, PolicyCtValue>`: allowed IPv4 flows.
pub const POLICY_CONNTRACK_V4: &str = "RUNE_POL_CT4";
/// `LruHashMap<PolicyCtKeyV6, PolicyCtValue>`: allowed IPv6 flows.
pub const POLICY_CONNTRACK_V6: &str = "RUNE_POL_CT6";
/// `PerCpuArray<u64>` of [`MAX_COUNTERS`] × [`VERDICT_SLOTS`]: verdict counters at
/// [`verdict_slot`].
pub const VERDICTS: &str = "RUNE_POL_VERDICTS";

/// tc egress of a policy interface: ingress rules of the destination endpoint.
pub const PROG_POLICY_TO: &str = "rune_tc_policy_to";
/// tc ingress of a policy interface: egress rules of the source endpoint.
pub const PROG_POLICY_FROM: &str = "rune_tc_policy_from";

const _: () = assert!(size_of::<EndpointKey>() == 20);
const _: () = assert!(size_of::<PolicyDirection>() == 12);
const _: () = assert!(size_of::<EndpointPolicy>() == 24);
const _: () = assert!(size_of::<PeerV4>() == 8);
const _: () = assert!(size_of::<PeerV6>() == 20);
const _: () = assert!(size_of::<PeerValue>() == 4);
const _: () = assert!(size_of::<PortKey>() == 8);
const _: () = assert!(size_of::<PolicyCtKeyV4>() == 16);
const _: () = assert!(size_of::<PolicyCtKeyV6>() == 40);
const _: () = assert!(size_of::<PolicyCtValue>() == 4);
const _: () = assert!(size_of::<VerdictEvent>() == 44);

// SAFETY (all below): each type is `#[repr(C)]`, built only of integers and integer
// arrays, has no implicit padding (sizes checked above) and every bit pattern is a
// valid value.
#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for EndpointKey {}
    unsafe impl aya::Pod for EndpointPolicy {}
    unsafe impl aya::Pod for PeerV4 {}
    unsafe impl aya::Pod for PeerV6 {}
    unsafe impl aya::Pod for PeerValue {}
    unsafe impl aya::Pod for PortKey {}
    unsafe impl aya::Pod for PolicyCtKeyV4 {}
    unsafe impl aya::Pod for PolicyCtKeyV6 {}
    unsafe impl aya::Pod for PolicyCtValue {}
    unsafe impl aya::Pod for VerdictEvent {}
}
