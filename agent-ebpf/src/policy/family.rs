//! The two address families of the policy programs: their conntrack and peer
//! maps and address shapes, so that one body (`super::decide`) checks both.

use agent_common::{
    lb::{Addr, FAMILY_V4, FAMILY_V6},
    policy::{PeerV4, PeerV6, PeerValue, PolicyCtKey, PolicyCtKeyV4, PolicyCtKeyV6, PolicyCtValue},
};
use aya_ebpf::maps::{LruHashMap, lpm_trie::Key};

use crate::maps::{RUNE_POL_CT4, RUNE_POL_CT6, RUNE_POL_PEER4, RUNE_POL_PEER6};

/// One address family's maps and address shape.
pub(super) trait Family {
    /// An address as the packet carries it (ordered: see `super::flow_key`).
    type Addr: Copy + Ord + 'static;
    /// `EndpointKey::family` and `VerdictEvent::family`.
    const FAMILY: u8;
    /// The policy conntrack of the family.
    fn conntrack() -> &'static LruHashMap<PolicyCtKey<Self::Addr>, PolicyCtValue>;
    /// The address as `EndpointKey` and `VerdictEvent` hold it.
    fn wide(addr: Self::Addr) -> Addr;
    /// The rule set `rules`' entry for `peer` (longest prefix).
    fn peer(rules: u32, peer: Self::Addr) -> Option<PeerValue>;
}

/// IPv4: `RUNE_POL_CT4`, `RUNE_POL_PEER4`.
pub(super) struct V4;

impl Family for V4 {
    type Addr = u32;
    const FAMILY: u8 = FAMILY_V4;

    #[inline(always)]
    fn conntrack() -> &'static LruHashMap<PolicyCtKeyV4, PolicyCtValue> {
        &RUNE_POL_CT4
    }

    #[inline(always)]
    fn wide(addr: u32) -> Addr {
        [addr, 0, 0, 0]
    }

    #[inline(always)]
    fn peer(rules: u32, addr: u32) -> Option<PeerValue> {
        let rules = rules.to_be();
        RUNE_POL_PEER4
            .get(Key::new(64, PeerV4 { rules, addr }))
            .copied()
    }
}

/// IPv6: `RUNE_POL_CT6`, `RUNE_POL_PEER6`.
pub(super) struct V6;

impl Family for V6 {
    type Addr = Addr;
    const FAMILY: u8 = FAMILY_V6;

    #[inline(always)]
    fn conntrack() -> &'static LruHashMap<PolicyCtKeyV6, PolicyCtValue> {
        &RUNE_POL_CT6
    }

    #[inline(always)]
    fn wide(addr: Addr) -> Addr {
        addr
    }

    #[inline(always)]
    fn peer(rules: u32, addr: Addr) -> Option<PeerValue> {
        let rules = rules.to_be();
        RUNE_POL_PEER6
            .get(Key::new(160, PeerV6 { rules, addr }))
            .copied()
    }
}
