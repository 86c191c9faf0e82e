//! Maglev consistent hashing (Eisenbud et al., NSDI 2016), as Katran and Cilium use
//! it: a lookup table of prime size `M` where each backend owns about `M/N` slots, so
//! that adding or removing one backend moves only about `1/N` of the flows.
//!
//! Each backend's preference order over the slots comes from two seeded hashes of its
//! stable identity ([`BackendKey`]: address and port), never from its position in the
//! list, and backends are filled in in sorted order: the same set gives the same table
//! on every node and build, whatever order the endpoints arrive in.

use agent_common::hash::jhash2;
use std::net::{IpAddr, SocketAddr};

/// The default table size: a prime, about 100 slots per backend for 160 backends.
pub const DEFAULT_TABLE_SIZE: u32 = 16381;

/// The largest table size accepted (Cilium's largest, a prime): bounds memory per
/// service.
pub const MAX_TABLE_SIZE: u32 = 131_071;

const OFFSET_SEED: u32 = 0x6d61_676f; // "mago"
const SKIP_SEED: u32 = 0x6d61_6773; // "mags"

/// A backend's stable identity: what its place in the table is derived from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendKey(pub SocketAddr);

impl BackendKey {
    /// The address as five words: an IPv4 address is hashed as its IPv4-mapped IPv6
    /// form, so one function covers both families.
    fn words(&self) -> [u32; 5] {
        let v6 = match self.0.ip() {
            IpAddr::V4(a) => a.to_ipv6_mapped(),
            IpAddr::V6(a) => a,
        };
        let o = v6.octets();
        let w = |i: usize| u32::from_be_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
        [w(0), w(4), w(8), w(12), u32::from(self.0.port())]
    }
}

/// Why a table could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MaglevError {
    /// The size must be a prime so every backend's permutation visits every slot.
    #[error("maglev table size {size} is not a prime")]
    NotPrime {
        /// The size asked for.
        size: u32,
    },
    /// The table needs at least one slot per backend, and at most [`MAX_TABLE_SIZE`].
    #[error(
        "maglev table size {size} is out of range for {backends} backends (at least the backend count, at most {MAX_TABLE_SIZE})"
    )]
    BadSize {
        /// The size asked for.
        size: u32,
        /// The number of backends.
        backends: usize,
    },
    /// Two backends with the same identity would share one permutation.
    #[error("backend {backend} is listed twice")]
    Duplicate {
        /// The duplicated backend.
        backend: SocketAddr,
    },
}

/// A Maglev lookup table: slot → index into the backend list it was built from.
/// The default is the empty table (no backends).
///
/// Slots are stored in the narrowest integer that holds every backend index (one
/// byte for up to 256 backends), because an agent keeps one table per service port:
/// a quarter of the memory of `u32` slots.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Maglev {
    slots: Slots,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
enum Slots {
    #[default]
    Empty,
    U8(Box<[u8]>),
    U16(Box<[u16]>),
    U32(Box<[u32]>),
}

/// Whether `n` is prime (Maglev table sizes must be).
pub fn is_prime(n: u32) -> bool {
    n >= 2
        && (2..)
            // `d <= n / d`, not `d * d <= n`: no overflow for n near u32::MAX.
            .take_while(|d: &u32| *d <= n / d)
            .all(|d| !n.is_multiple_of(d))
}

impl Maglev {
    /// Builds the table for `backends`; entries are indices into `backends`. No
    /// backends give an empty table whose [`lookup`](Self::lookup) is always `None`.
    pub fn new(backends: &[BackendKey], table_size: u32) -> Result<Self, MaglevError> {
        let m = table_size;
        if !(1..=MAX_TABLE_SIZE).contains(&m) || (m as usize) < backends.len() {
            return Err(MaglevError::BadSize {
                size: m,
                backends: backends.len(),
            });
        }
        if !is_prime(m) {
            return Err(MaglevError::NotPrime { size: m });
        }
        if backends.is_empty() {
            return Ok(Self::default());
        }
        // Fill in identity order, so the input order does not matter.
        let mut order: Vec<usize> = (0..backends.len()).collect();
        order.sort_by_key(|&i| backends[i]);
        if let Some(w) = order.windows(2).find(|w| backends[w[0]] == backends[w[1]]) {
            return Err(MaglevError::Duplicate {
                backend: backends[w[0]].0,
            });
        }
        // (next slot, skip) per backend, in fill order. Each permutation is
        // `offset, offset + skip, offset + 2·skip, ...` modulo m, walked by adding
        // `skip` and subtracting m once when past the end: no division per probe
        // (the fill probes about m·ln m slots, and a 64-bit modulo each dominated).
        let mut perm: Vec<(u32, u32)> = order
            .iter()
            .map(|&i| {
                let w = backends[i].words();
                let offset = jhash2(&w, OFFSET_SEED) % m;
                let skip = jhash2(&w, SKIP_SEED) % (m - 1).max(1) + 1;
                (offset, skip)
            })
            .collect();
        let mut filled = 0usize;
        let mut table = vec![u32::MAX; m as usize];
        // Both operands are below m ≤ MAX_TABLE_SIZE, so the sum never overflows.
        let advance = |slot: u32, skip: u32| {
            let next = slot + skip;
            if next >= m { next - m } else { next }
        };
        'fill: loop {
            for (k, (slot, skip)) in perm.iter_mut().enumerate() {
                // Each permutation visits every slot once (m prime, 0 < skip < m), and a
                // free slot exists while filled < m: this loop ends.
                while table[*slot as usize] != u32::MAX {
                    *slot = advance(*slot, *skip);
                }
                table[*slot as usize] = order[k] as u32;
                *slot = advance(*slot, *skip);
                filled += 1;
                if filled == m as usize {
                    break 'fill;
                }
            }
        }
        // Every entry is an index below backends.len(), so the narrowing casts below
        // are lossless.
        let slots = if backends.len() <= 1 << 8 {
            Slots::U8(table.iter().map(|&i| i as u8).collect())
        } else if backends.len() <= 1 << 16 {
            Slots::U16(table.iter().map(|&i| i as u16).collect())
        } else {
            Slots::U32(table.into_boxed_slice())
        };
        Ok(Self { slots })
    }

    /// The number of slots (0 without backends).
    pub fn len(&self) -> usize {
        match &self.slots {
            Slots::Empty => 0,
            Slots::U8(t) => t.len(),
            Slots::U16(t) => t.len(),
            Slots::U32(t) => t.len(),
        }
    }

    /// Whether the table is empty (no backends).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The backend index in `slot`; `None` when the slot is out of range.
    pub fn get(&self, slot: usize) -> Option<usize> {
        match &self.slots {
            Slots::Empty => None,
            Slots::U8(t) => t.get(slot).map(|&i| usize::from(i)),
            Slots::U16(t) => t.get(slot).map(|&i| usize::from(i)),
            Slots::U32(t) => t.get(slot).map(|&i| i as usize),
        }
    }

    /// The backend index for a flow hash, `None` when there are no backends.
    pub fn lookup(&self, hash: u32) -> Option<usize> {
        match self.len() {
            0 => None,
            len => self.get(hash as usize % len),
        }
    }

    /// Every slot's entry of `values` (one per backend, in the order the table was
    /// built from), in slot order: what a BPF map is filled with when it holds
    /// backend ids. Panics when `values` is shorter than the backend list.
    pub fn map_slots<T: Copy>(&self, values: &[T]) -> Vec<T> {
        // One match for the whole table, not one per slot.
        match &self.slots {
            Slots::Empty => Vec::new(),
            Slots::U8(t) => t.iter().map(|&i| values[usize::from(i)]).collect(),
            Slots::U16(t) => t.iter().map(|&i| values[usize::from(i)]).collect(),
            Slots::U32(t) => t.iter().map(|&i| values[i as usize]).collect(),
        }
    }

    /// Every slot's backend index in slot order (what a BPF map is filled with).
    pub fn slots(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.len()).filter_map(|i| self.get(i))
    }
}

#[cfg(test)]
mod tests;
