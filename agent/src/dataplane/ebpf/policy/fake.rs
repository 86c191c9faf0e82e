//! In-memory policy maps with the kernel's capacity limits, for unprivileged tests.

use super::maps::{PeerEntry, PolicyCapacity, PolicyMaps};
use crate::dataplane::ebpf::error::MapsError;
use agent_common::policy::{self as pol, EndpointKey, EndpointPolicy, PeerValue, PortKey, Verdict};
use std::collections::BTreeMap;

/// In-memory policy maps; a write of a new key into a full map fails as the
/// kernel's does.
#[derive(Clone, Debug)]
pub struct FakePolicyMaps {
    /// Guarded addresses.
    pub endpoints: BTreeMap<EndpointKey, EndpointPolicy>,
    /// Peer entries of both families.
    pub peers: BTreeMap<PeerEntry, PeerValue>,
    /// Port entries.
    pub ports: BTreeMap<PortKey, ()>,
    /// Verdict counters by counter id.
    pub verdicts: BTreeMap<u32, [u64; Verdict::ALL.len()]>,
    /// Every write, in order (`endpoint …`, `peer …`, `port …`, `-…` for deletes).
    pub writes: Vec<String>,
    capacity: PolicyCapacity,
}

impl FakePolicyMaps {
    /// Empty maps of the given capacity.
    #[must_use]
    pub fn new(capacity: PolicyCapacity) -> Self {
        Self {
            endpoints: BTreeMap::new(),
            peers: BTreeMap::new(),
            ports: BTreeMap::new(),
            verdicts: BTreeMap::new(),
            writes: Vec::new(),
            capacity,
        }
    }

    fn full(map: &'static str) -> MapsError {
        MapsError::new(map, "insert", "Argument list too long (os error 7)")
    }
}

impl PolicyMaps for FakePolicyMaps {
    fn capacity(&self) -> PolicyCapacity {
        self.capacity
    }

    fn endpoints(&self) -> Result<Vec<(EndpointKey, EndpointPolicy)>, MapsError> {
        Ok(self.endpoints.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn peers(&self) -> Result<Vec<(PeerEntry, PeerValue)>, MapsError> {
        Ok(self.peers.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn ports(&self) -> Result<Vec<PortKey>, MapsError> {
        Ok(self.ports.keys().copied().collect())
    }

    fn put_endpoint(&mut self, key: &EndpointKey, value: &EndpointPolicy) -> Result<(), MapsError> {
        if !self.endpoints.contains_key(key)
            && self.endpoints.len() >= self.capacity.endpoints as usize
        {
            return Err(Self::full(pol::ENDPOINTS));
        }
        self.writes.push(format!("endpoint {:?}", key.addr[0]));
        self.endpoints.insert(*key, *value);
        Ok(())
    }

    fn delete_endpoint(&mut self, key: &EndpointKey) -> Result<(), MapsError> {
        self.writes.push(format!("-endpoint {:?}", key.addr[0]));
        self.endpoints.remove(key);
        Ok(())
    }

    fn put_peer(&mut self, entry: &PeerEntry, value: &PeerValue) -> Result<(), MapsError> {
        let family = |e: &PeerEntry| e.net.addr().is_ipv4();
        let same_family = self
            .peers
            .keys()
            .filter(|e| family(e) == family(entry))
            .count();
        if !self.peers.contains_key(entry) && same_family >= self.capacity.peers as usize {
            return Err(Self::full(pol::PEERS_V4));
        }
        self.writes
            .push(format!("peer {} {}", entry.rules, entry.net));
        self.peers.insert(*entry, *value);
        Ok(())
    }

    fn delete_peer(&mut self, entry: &PeerEntry) -> Result<(), MapsError> {
        self.writes
            .push(format!("-peer {} {}", entry.rules, entry.net));
        self.peers.remove(entry);
        Ok(())
    }

    fn put_port(&mut self, key: &PortKey) -> Result<(), MapsError> {
        if !self.ports.contains_key(key) && self.ports.len() >= self.capacity.ports as usize {
            return Err(Self::full(pol::PORTS));
        }
        self.writes.push(format!("port {}", key.set));
        self.ports.insert(*key, ());
        Ok(())
    }

    fn delete_port(&mut self, key: &PortKey) -> Result<(), MapsError> {
        self.writes.push(format!("-port {}", key.set));
        self.ports.remove(key);
        Ok(())
    }

    fn verdicts(&self, counter: u32) -> Result<[u64; Verdict::ALL.len()], MapsError> {
        Ok(self.verdicts.get(&counter).copied().unwrap_or_default())
    }

    fn reset_counter(&mut self, counter: u32) -> Result<(), MapsError> {
        self.verdicts.remove(&counter);
        Ok(())
    }
}
