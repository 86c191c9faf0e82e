//! The policy maps behind one trait, [`PolicyMaps`]: the kernel's
//! ([`KernelPolicyMaps`]) in the agent, an in-memory fake in unit tests.

use crate::dataplane::ebpf::error::MapsError;
use agent_common::{
    lb::{Addr, addr_from_octets, addr_octets},
    policy::{
        self as pol, EndpointKey, EndpointPolicy, PeerV4, PeerV6, PeerValue, PortKey,
        VERDICT_SLOTS, Verdict, verdict_slot,
    },
};
use aya::maps::{
    HashMap, IterableMap as _, Map, MapData, MapError, PerCpuArray, PerCpuValues,
    lpm_trie::{Key, LpmTrie},
};
use ipnet::IpNet;
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

/// How many entries the policy maps hold, as created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyCapacity {
    /// Guarded addresses.
    pub endpoints: u32,
    /// Peer prefixes per family trie (`--policy-max-entries`).
    pub peers: u32,
    /// Port entries (`--policy-max-entries`).
    pub ports: u32,
}

/// One peer prefix of one rule set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PeerEntry {
    /// The rule set's id.
    pub rules: u32,
    /// The prefix (host bits clear).
    pub net: IpNet,
}

/// What the policy sync needs from the policy maps.
pub trait PolicyMaps: Send {
    /// The maps' sizes.
    fn capacity(&self) -> PolicyCapacity;
    /// Every guarded address (read back at start to adopt a previous agent's state).
    fn endpoints(&self) -> Result<Vec<(EndpointKey, EndpointPolicy)>, MapsError>;
    /// Every peer entry of both tries.
    fn peers(&self) -> Result<Vec<(PeerEntry, PeerValue)>, MapsError>;
    /// Every port entry.
    fn ports(&self) -> Result<Vec<PortKey>, MapsError>;
    /// Inserts or replaces a guarded address.
    fn put_endpoint(&mut self, key: &EndpointKey, value: &EndpointPolicy) -> Result<(), MapsError>;
    /// Removes a guarded address (absent is fine).
    fn delete_endpoint(&mut self, key: &EndpointKey) -> Result<(), MapsError>;
    /// Inserts or replaces a peer entry.
    fn put_peer(&mut self, entry: &PeerEntry, value: &PeerValue) -> Result<(), MapsError>;
    /// Removes a peer entry (absent is fine).
    fn delete_peer(&mut self, entry: &PeerEntry) -> Result<(), MapsError>;
    /// Inserts a port entry.
    fn put_port(&mut self, key: &PortKey) -> Result<(), MapsError>;
    /// Removes a port entry (absent is fine).
    fn delete_port(&mut self, key: &PortKey) -> Result<(), MapsError>;
    /// Counter `counter`'s verdicts, summed over CPUs, in [`Verdict::ALL`] order.
    fn verdicts(&self, counter: u32) -> Result<[u64; Verdict::ALL.len()], MapsError>;
    /// Zeroes counter `counter` (before it is given to another service).
    fn reset_counter(&mut self, counter: u32) -> Result<(), MapsError>;
}

/// The map key of guarded address `addr`.
#[must_use]
pub fn endpoint_key(addr: IpAddr) -> EndpointKey {
    let (addr, family) = match addr {
        IpAddr::V4(a) => (addr_from_octets(&a.octets()), agent_common::lb::FAMILY_V4),
        IpAddr::V6(a) => (addr_from_octets(&a.octets()), agent_common::lb::FAMILY_V6),
    };
    EndpointKey {
        addr,
        family,
        pad: [0; 3],
    }
}

/// The kernel's policy maps, taken from the loaded object.
pub struct KernelPolicyMaps {
    endpoints: HashMap<MapData, EndpointKey, EndpointPolicy>,
    peers_v4: LpmTrie<MapData, PeerV4, PeerValue>,
    peers_v6: LpmTrie<MapData, PeerV6, PeerValue>,
    ports: HashMap<MapData, PortKey, u32>,
    verdicts: PerCpuArray<MapData, u64>,
    capacity: PolicyCapacity,
}

/// Every policy map's name, for taking them out of the loaded object.
pub const POLICY_MAPS: [&str; 5] = [
    pol::ENDPOINTS,
    pol::PEERS_V4,
    pol::PEERS_V6,
    pol::PORTS,
    pol::VERDICTS,
];

fn err(map: &'static str, op: &'static str) -> impl Fn(MapError) -> MapsError {
    move |e| MapsError::new(map, op, e)
}

impl KernelPolicyMaps {
    /// Takes the policy maps out of `maps` (by name, as `Ebpf::take_map` gives them).
    pub fn new(maps: &mut BTreeMap<String, Map>) -> Result<Self, MapsError> {
        fn typed<T: TryFrom<Map, Error = MapError>>(
            maps: &mut BTreeMap<String, Map>,
            name: &'static str,
        ) -> Result<T, MapsError> {
            let map = maps
                .remove(name)
                .ok_or_else(|| MapsError::new(name, "open", "missing from the eBPF object"))?;
            T::try_from(map).map_err(err(name, "open"))
        }
        let endpoints: HashMap<MapData, EndpointKey, EndpointPolicy> = typed(maps, pol::ENDPOINTS)?;
        let peers_v4: LpmTrie<MapData, PeerV4, PeerValue> = typed(maps, pol::PEERS_V4)?;
        let ports: HashMap<MapData, PortKey, u32> = typed(maps, pol::PORTS)?;
        let max = |data: &MapData, name| {
            data.info()
                .map(|i| i.max_entries())
                .map_err(err(name, "info"))
        };
        let capacity = PolicyCapacity {
            endpoints: max(endpoints.map(), pol::ENDPOINTS)?,
            peers: max(peers_v4.map(), pol::PEERS_V4)?,
            ports: max(ports.map(), pol::PORTS)?,
        };
        Ok(Self {
            endpoints,
            peers_v4,
            peers_v6: typed(maps, pol::PEERS_V6)?,
            ports,
            verdicts: typed(maps, pol::VERDICTS)?,
            capacity,
        })
    }
}

/// The LPM key of an IPv4 peer entry.
fn key_v4(rules: u32, net: &ipnet::Ipv4Net) -> Key<PeerV4> {
    Key::new(
        32 + u32::from(net.prefix_len()),
        PeerV4 {
            rules: rules.to_be(),
            addr: u32::from_ne_bytes(net.addr().octets()),
        },
    )
}

/// The LPM key of an IPv6 peer entry.
fn key_v6(rules: u32, net: &ipnet::Ipv6Net) -> Key<PeerV6> {
    Key::new(
        32 + u32::from(net.prefix_len()),
        PeerV6 {
            rules: rules.to_be(),
            addr: addr_from_octets(&net.addr().octets()),
        },
    )
}

/// The prefix of a peer key (`None` for a length out of range).
fn net_of(prefix_len: u32, addr: &Addr, v6: bool) -> Option<IpNet> {
    let len = u8::try_from(prefix_len.checked_sub(32)?).ok()?;
    let octets = addr_octets(addr);
    if v6 {
        IpNet::new(IpAddr::V6(Ipv6Addr::from(octets)), len).ok()
    } else {
        let v4: [u8; 4] = octets[..4].try_into().ok()?;
        IpNet::new(IpAddr::V4(Ipv4Addr::from(v4)), len).ok()
    }
}

impl PolicyMaps for KernelPolicyMaps {
    fn capacity(&self) -> PolicyCapacity {
        self.capacity
    }

    fn endpoints(&self) -> Result<Vec<(EndpointKey, EndpointPolicy)>, MapsError> {
        self.endpoints
            .iter()
            .collect::<Result<_, _>>()
            .map_err(err(pol::ENDPOINTS, "read"))
    }

    fn peers(&self) -> Result<Vec<(PeerEntry, PeerValue)>, MapsError> {
        let mut out = Vec::new();
        for item in self.peers_v4.iter() {
            let (key, value) = item.map_err(err(pol::PEERS_V4, "read"))?;
            let data = key.data();
            if let Some(net) = net_of(key.prefix_len(), &[data.addr, 0, 0, 0], false) {
                let rules = u32::from_be(data.rules);
                out.push((PeerEntry { rules, net }, value));
            }
        }
        for item in self.peers_v6.iter() {
            let (key, value) = item.map_err(err(pol::PEERS_V6, "read"))?;
            let data = key.data();
            if let Some(net) = net_of(key.prefix_len(), &data.addr, true) {
                let rules = u32::from_be(data.rules);
                out.push((PeerEntry { rules, net }, value));
            }
        }
        Ok(out)
    }

    fn ports(&self) -> Result<Vec<PortKey>, MapsError> {
        self.ports
            .keys()
            .collect::<Result<_, _>>()
            .map_err(err(pol::PORTS, "read"))
    }

    fn put_endpoint(&mut self, key: &EndpointKey, value: &EndpointPolicy) -> Result<(), MapsError> {
        self.endpoints
            .insert(key, value, 0)
            .map_err(err(pol::ENDPOINTS, "insert"))
    }

    fn delete_endpoint(&mut self, key: &EndpointKey) -> Result<(), MapsError> {
        absent_ok(self.endpoints.remove(key), pol::ENDPOINTS)
    }

    fn put_peer(&mut self, entry: &PeerEntry, value: &PeerValue) -> Result<(), MapsError> {
        match &entry.net {
            IpNet::V4(net) => self
                .peers_v4
                .insert(&key_v4(entry.rules, net), value, 0)
                .map_err(err(pol::PEERS_V4, "insert")),
            IpNet::V6(net) => self
                .peers_v6
                .insert(&key_v6(entry.rules, net), value, 0)
                .map_err(err(pol::PEERS_V6, "insert")),
        }
    }

    fn delete_peer(&mut self, entry: &PeerEntry) -> Result<(), MapsError> {
        match &entry.net {
            IpNet::V4(net) => absent_ok(
                self.peers_v4.remove(&key_v4(entry.rules, net)),
                pol::PEERS_V4,
            ),
            IpNet::V6(net) => absent_ok(
                self.peers_v6.remove(&key_v6(entry.rules, net)),
                pol::PEERS_V6,
            ),
        }
    }

    fn put_port(&mut self, key: &PortKey) -> Result<(), MapsError> {
        self.ports
            .insert(key, 1, 0)
            .map_err(err(pol::PORTS, "insert"))
    }

    fn delete_port(&mut self, key: &PortKey) -> Result<(), MapsError> {
        absent_ok(self.ports.remove(key), pol::PORTS)
    }

    fn verdicts(&self, counter: u32) -> Result<[u64; Verdict::ALL.len()], MapsError> {
        let mut out = [0; Verdict::ALL.len()];
        for (i, verdict) in Verdict::ALL.iter().enumerate() {
            let values = self
                .verdicts
                .get(&verdict_slot(counter, *verdict), 0)
                .map_err(err(pol::VERDICTS, "read"))?;
            out[i] = values.iter().fold(0u64, |a, b| a.wrapping_add(*b));
        }
        Ok(out)
    }

    fn reset_counter(&mut self, counter: u32) -> Result<(), MapsError> {
        let cpus =
            aya::util::nr_cpus().map_err(|(_, e)| MapsError::new(pol::VERDICTS, "reset", e))?;
        for slot in 0..VERDICT_SLOTS {
            let zeros = PerCpuValues::try_from(vec![0u64; cpus])
                .map_err(|e| MapsError::new(pol::VERDICTS, "reset", e))?;
            self.verdicts
                .set(counter * VERDICT_SLOTS + slot, zeros, 0)
                .map_err(err(pol::VERDICTS, "reset"))?;
        }
        Ok(())
    }
}

/// A removal's result, with "not there" as success.
fn absent_ok(result: Result<(), MapError>, map: &'static str) -> Result<(), MapsError> {
    match result {
        Err(MapError::KeyNotFound) | Ok(()) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(e) => Err(MapsError::new(map, "delete", e)),
    }
}
