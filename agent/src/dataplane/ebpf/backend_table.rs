//! The sync engine's records per backend address, kept compact: the addresses in
//! 20 bytes each (less than a `SocketAddr`), the records in a dense vector beside
//! them, and an index holding only positions (hashed by the address they point
//! at), where a hash map keyed by `SocketAddr` would hold a key and a record in
//! every bucket, spare ones included.

use hashbrown::HashTable;
use std::{
    hash::BuildHasher as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

/// A backend's socket address in 20 bytes, ordered as [`SocketAddr`] is (IPv4
/// before IPv6, then address, then port): sorting either gives the same order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct BackendAddr {
    /// 4 or 6.
    family: u8,
    /// The address's octets, an IPv4 one in the first four.
    ip: [u8; 16],
    port: u16,
}

impl BackendAddr {
    /// The socket address.
    pub(super) fn socket_addr(self) -> SocketAddr {
        let ip = if self.family == 4 {
            IpAddr::V4(Ipv4Addr::new(
                self.ip[0], self.ip[1], self.ip[2], self.ip[3],
            ))
        } else {
            IpAddr::V6(Ipv6Addr::from(self.ip))
        };
        SocketAddr::new(ip, self.port)
    }
}

impl From<SocketAddr> for BackendAddr {
    fn from(addr: SocketAddr) -> Self {
        let mut ip = [0u8; 16];
        let family = match addr.ip() {
            IpAddr::V4(a) => {
                ip[..4].copy_from_slice(&a.octets());
                4
            }
            IpAddr::V6(a) => {
                ip = a.octets();
                6
            }
        };
        Self {
            family,
            ip,
            port: addr.port(),
        }
    }
}

/// Records of type `V` by backend address, in no particular order.
#[derive(Debug)]
pub(super) struct BackendTable<V> {
    addrs: Vec<BackendAddr>,
    records: Vec<V>,
    /// Positions in `addrs`/`records`.
    index: HashTable<u32>,
    hasher: foldhash::fast::RandomState,
}

impl<V> Default for BackendTable<V> {
    fn default() -> Self {
        Self {
            addrs: Vec::new(),
            records: Vec::new(),
            index: HashTable::new(),
            hasher: foldhash::fast::RandomState::default(),
        }
    }
}

impl<V: Default> BackendTable<V> {
    fn position(&self, addr: &BackendAddr) -> Option<usize> {
        let hash = self.hasher.hash_one(addr);
        self.index
            .find(hash, |&i| self.addrs[i as usize] == *addr)
            .map(|&i| i as usize)
    }

    /// The record of `addr`.
    pub(super) fn get(&self, addr: &BackendAddr) -> Option<&V> {
        self.position(addr).map(|i| &self.records[i])
    }

    /// The record of `addr`, to change.
    pub(super) fn get_mut(&mut self, addr: &BackendAddr) -> Option<&mut V> {
        self.position(addr).map(|i| &mut self.records[i])
    }

    /// The record of `addr`, a default one added if it has none.
    pub(super) fn get_or_default(&mut self, addr: BackendAddr) -> &mut V {
        let i = match self.position(&addr) {
            Some(i) => i,
            None => {
                let i = self.records.len();
                let position = u32::try_from(i).expect("fewer than 2^32 backends");
                self.addrs.push(addr);
                self.records.push(V::default());
                let (addrs, hasher) = (&self.addrs, &self.hasher);
                self.index
                    .insert_unique(hasher.hash_one(addr), position, |&j| {
                        hasher.hash_one(addrs[j as usize])
                    });
                i
            }
        };
        &mut self.records[i]
    }

    /// Removes `addr`'s record.
    pub(super) fn remove(&mut self, addr: &BackendAddr) {
        let hash = self.hasher.hash_one(addr);
        let Ok(entry) = self
            .index
            .find_entry(hash, |&i| self.addrs[i as usize] == *addr)
        else {
            return;
        };
        let (removed, _) = entry.remove();
        let last = self.records.len() - 1;
        self.addrs.swap_remove(removed as usize);
        self.records.swap_remove(removed as usize);
        if removed as usize != last {
            // The last record moved into the hole: point its index entry there.
            let moved = self.addrs[removed as usize];
            if let Some(i) = self
                .index
                .find_mut(self.hasher.hash_one(moved), |&i| i as usize == last)
            {
                *i = removed;
            }
        }
    }

    /// Keeps the records `keep` accepts.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&BackendAddr, &V) -> bool) {
        let gone: Vec<BackendAddr> = self
            .iter()
            .filter(|(a, v)| !keep(a, v))
            .map(|(a, _)| *a)
            .collect();
        for addr in &gone {
            self.remove(addr);
        }
    }

    /// Every address with its record.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&BackendAddr, &V)> + Clone {
        self.addrs.iter().zip(&self.records)
    }

    /// Every record.
    pub(super) fn values(&self) -> impl Iterator<Item = &V> {
        self.records.iter()
    }

    /// Every record, to change.
    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.records.iter_mut()
    }

    /// Makes room for `total` records in all (no change when there is room).
    pub(super) fn reserve(&mut self, total: usize) {
        let additional = total.saturating_sub(self.records.len());
        self.addrs.reserve(additional);
        self.records.reserve(additional);
        let (addrs, hasher) = (&self.addrs, &self.hasher);
        self.index
            .reserve(additional, |&j| hasher.hash_one(addrs[j as usize]));
    }

    /// Gives back what a bulk change left unused (growth by doubling leaves up to
    /// half of the vectors empty after a full sync), keeping 1/16 spare: shrunk to
    /// the length, the next backend added would double the vectors again (and the
    /// next call shrink them), copying megabytes per change.
    pub(super) fn shrink(&mut self) {
        let len = self.records.len();
        if self.records.capacity() > len + len / 8 + 16 {
            let keep = len + len / 16 + 16;
            self.addrs.shrink_to(keep);
            self.records.shrink_to(keep);
        }
        let (addrs, hasher) = (&self.addrs, &self.hasher);
        if self.index.capacity() > 2 * len + 64 {
            self.index
                .shrink_to_fit(|&j| hasher.hash_one(addrs[j as usize]));
        }
    }
}

#[cfg(test)]
mod tests;
