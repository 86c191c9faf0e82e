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
/// 1,000 services at the default size take 16 MiB instead of 64 MiB.
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
mod tests {
    use super::*;

    fn keys(n: usize) -> Vec<BackendKey> {
        (0..n)
            .map(|i| {
                BackendKey(SocketAddr::from((
                    [10, 0, (i / 250) as u8, (i % 250) as u8 + 1],
                    8080,
                )))
            })
            .collect()
    }

    fn counts(t: &Maglev, n: usize) -> Vec<usize> {
        let mut c = vec![0; n];
        for b in t.slots() {
            c[b] += 1;
        }
        c
    }

    #[test]
    fn spread_is_even() {
        // Maglev fills round-robin, one slot per backend per round, until the table
        // is full: every backend ends with floor(M/N) or ceil(M/N) slots.
        for n in [1, 3, 7, 10, 100] {
            let t = Maglev::new(&keys(n), DEFAULT_TABLE_SIZE).unwrap();
            let m = DEFAULT_TABLE_SIZE as usize;
            for (i, c) in counts(&t, n).into_iter().enumerate() {
                assert!(
                    c == m / n || c == m.div_ceil(n),
                    "n={n} backend {i} has {c}"
                );
            }
        }
    }

    fn table(t: &Maglev) -> Vec<u32> {
        t.slots().map(|i| i as u32).collect()
    }

    fn changed(a: &[u32], b: &[u32], map: impl Fn(u32) -> u32) -> f64 {
        let d = a.iter().zip(b).filter(|(x, y)| map(**x) != **y).count();
        d as f64 / a.len() as f64
    }

    #[test]
    fn removing_or_adding_one_moves_about_one_nth() {
        for n in [3, 7, 10, 50] {
            let all = keys(n);
            let full = Maglev::new(&all, DEFAULT_TABLE_SIZE).unwrap();
            for gone in [0, n / 2, n - 1] {
                let mut rest = all.clone();
                rest.remove(gone);
                let less = Maglev::new(&rest, DEFAULT_TABLE_SIZE).unwrap();
                // Indices above `gone` shift down by one in the smaller list.
                let map = |i: u32| if i as usize > gone { i - 1 } else { i };
                let frac = changed(&table(&full), &table(&less), map);
                assert!(frac <= 1.0 / n as f64 + 0.01, "n={n} remove {gone}: {frac}");
                // Adding it back is the same change the other way.
                let frac = changed(&table(&less), &table(&full), |i| {
                    if i as usize >= gone { i + 1 } else { i }
                });
                assert!(frac <= 1.0 / n as f64 + 0.01, "n={n} add {gone}: {frac}");
            }
        }
    }

    #[test]
    fn order_does_not_matter_and_table_is_golden() {
        let k = keys(3);
        let a = Maglev::new(&k, DEFAULT_TABLE_SIZE).unwrap();
        let rev: Vec<_> = k.iter().rev().copied().collect();
        let b = Maglev::new(&rev, DEFAULT_TABLE_SIZE).unwrap();
        let b_mapped: Vec<u32> = table(&b).iter().map(|&i| 2 - i).collect();
        assert_eq!(table(&a), b_mapped);
        assert_eq!(&table(&a)[..12], &GOLDEN[..]);
        assert_eq!(a.lookup(0), Some(GOLDEN[0] as usize));
        assert_eq!(a.lookup(DEFAULT_TABLE_SIZE + 1), Some(GOLDEN[1] as usize));
    }
    const GOLDEN: [u32; 12] = [0, 0, 2, 0, 0, 2, 0, 2, 2, 0, 1, 2];

    #[test]
    fn bad_sizes_and_empty() {
        let k = keys(3);
        assert_eq!(
            Maglev::new(&k, 16380),
            Err(MaglevError::NotPrime { size: 16380 })
        );
        assert_eq!(
            Maglev::new(&k, 2),
            Err(MaglevError::BadSize {
                size: 2,
                backends: 3
            })
        );
        assert!(matches!(
            Maglev::new(&k, 0),
            Err(MaglevError::BadSize { .. })
        ));
        assert!(matches!(
            Maglev::new(&k, 131_101),
            Err(MaglevError::BadSize { .. })
        ));
        assert!(Maglev::new(&k, 3).is_ok());
        let dup = [k[0], k[1], k[0]];
        assert_eq!(
            Maglev::new(&dup, 7),
            Err(MaglevError::Duplicate { backend: k[0].0 })
        );
        let empty = Maglev::new(&[], DEFAULT_TABLE_SIZE).unwrap();
        assert_eq!(empty.lookup(42), None);
        assert!(empty.is_empty());
    }

    #[test]
    fn mapped_slots_follow_the_indexes_in_every_width() {
        for n in [0, 3, 300] {
            let t = Maglev::new(&keys(n), 1021).unwrap();
            let ids: Vec<u32> = (0..n as u32).map(|i| i * 7 + 5).collect();
            let want: Vec<u32> = t.slots().map(|i| ids[i]).collect();
            assert_eq!(t.map_slots(&ids), want, "{n} backends");
            assert_eq!(want.len(), if n == 0 { 0 } else { 1021 });
        }
    }

    #[test]
    fn primality_of_large_sizes_does_not_overflow() {
        assert!(is_prime(4_294_967_291)); // the largest 32-bit prime
        assert!(!is_prime(u32::MAX));
        assert!(is_prime(DEFAULT_TABLE_SIZE) && is_prime(MAX_TABLE_SIZE));
        assert!(!is_prime(0) && !is_prime(1) && !is_prime(16383));
    }

    #[test]
    fn wide_backend_sets_keep_every_index() {
        // 300 backends need two bytes per slot; every backend still owns slots.
        let n = 300;
        let t = Maglev::new(&keys(n), DEFAULT_TABLE_SIZE).unwrap();
        assert!(matches!(t.slots, Slots::U16(_)));
        assert_eq!(t.len(), DEFAULT_TABLE_SIZE as usize);
        assert!(
            counts(&t, n)
                .iter()
                .all(|&c| c >= DEFAULT_TABLE_SIZE as usize / n)
        );
    }
}
