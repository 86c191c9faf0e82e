//! A service's backend uses ([`Uses`]) and a backend's users ([`Users`]): the two
//! sides of the relation the sync engine keeps between services and backends, each
//! kept compact, as there is one of either per service or backend.

use crate::{dataplane::ebpf::backend_table::BackendAddr, model::ServiceKey};
use std::{sync::Arc, time::Instant};

/// How a service uses a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Use {
    /// In the service's tables.
    Active,
    /// Out of the tables; its flows go on until the deadline.
    Draining { until: Instant },
}

/// A service's backend uses, sorted by address: the active ones as bare addresses,
/// the draining ones (rare) with their deadlines, so that the common use costs no
/// more than its address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Uses {
    active: Vec<BackendAddr>,
    /// Each a [`Use::Draining`].
    draining: Vec<(BackendAddr, Use)>,
}

impl Uses {
    /// Makes room for `additional` active uses, exactly (grown by doubling, then
    /// shrunk, the vector left small holes in the heap between longer-lived
    /// objects).
    pub(super) fn reserve_active(&mut self, additional: usize) {
        self.active.reserve_exact(additional);
    }

    fn draining_position(&self, addr: &BackendAddr) -> Result<usize, usize> {
        self.draining.binary_search_by(|(a, _)| a.cmp(addr))
    }

    pub(super) fn get(&self, addr: &BackendAddr) -> Option<&Use> {
        if self.active.binary_search(addr).is_ok() {
            return Some(&Use::Active);
        }
        self.draining_position(addr)
            .ok()
            .map(|i| &self.draining[i].1)
    }

    pub(super) fn contains_key(&self, addr: &BackendAddr) -> bool {
        self.get(addr).is_some()
    }

    /// Sets `addr`'s use (replacing the one it had).
    pub(super) fn insert(&mut self, addr: BackendAddr, u: Use) {
        match u {
            Use::Active => {
                if let Ok(i) = self.draining_position(&addr) {
                    self.draining.remove(i);
                }
                if let Err(i) = self.active.binary_search(&addr) {
                    self.active.insert(i, addr);
                }
            }
            Use::Draining { .. } => {
                if let Ok(i) = self.active.binary_search(&addr) {
                    self.active.remove(i);
                }
                match self.draining_position(&addr) {
                    Ok(i) => self.draining[i].1 = u,
                    Err(i) => self.draining.insert(i, (addr, u)),
                }
            }
        }
    }

    pub(super) fn remove(&mut self, addr: &BackendAddr) {
        if let Ok(i) = self.active.binary_search(addr) {
            self.active.remove(i);
        }
        if let Ok(i) = self.draining_position(addr) {
            self.draining.remove(i);
        }
    }

    /// The addresses, in order.
    pub(super) fn keys(&self) -> impl Iterator<Item = &BackendAddr> {
        self.iter().map(|(a, _)| a)
    }

    /// The uses, in address order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&BackendAddr, &Use)> {
        let mut active = self.active.iter().peekable();
        let mut draining = self.draining.iter().peekable();
        std::iter::from_fn(move || {
            let take_active = match (active.peek(), draining.peek()) {
                (None, None) => return None,
                (Some(a), Some((d, _))) => *a < d,
                (Some(_), None) => true,
                (None, Some(_)) => false,
            };
            if take_active {
                active.next().map(|a| (a, &Use::Active))
            } else {
                draining.next().map(|(a, u)| (a, u))
            }
        })
    }

    pub(super) fn shrink_to_fit(&mut self) {
        self.active.shrink_to_fit();
        self.draining.shrink_to_fit();
    }
}

/// The services using one backend: one, nearly always, kept inline in 16 bytes
/// rather than in a set per backend.
#[derive(Clone, Debug, Default)]
pub(super) enum Users {
    #[default]
    None,
    One(Arc<ServiceKey>),
    /// Two or more.
    #[expect(
        clippy::box_collection,
        reason = "a thin pointer keeps the enum at 16 bytes"
    )]
    Many(Box<Vec<Arc<ServiceKey>>>),
}

impl Users {
    pub(super) fn is_empty(&self) -> bool {
        matches!(self, Self::None)
    }

    pub(super) fn iter(&self) -> std::slice::Iter<'_, Arc<ServiceKey>> {
        match self {
            Self::None => [].iter(),
            Self::One(key) => std::slice::from_ref(key).iter(),
            Self::Many(keys) => keys.iter(),
        }
    }

    pub(super) fn push(&mut self, key: Arc<ServiceKey>) {
        *self = match std::mem::take(self) {
            Self::None => Self::One(key),
            Self::One(first) => Self::Many(Box::new(vec![first, key])),
            Self::Many(mut keys) => {
                keys.push(key);
                Self::Many(keys)
            }
        };
    }

    pub(super) fn retain(&mut self, mut keep: impl FnMut(&Arc<ServiceKey>) -> bool) {
        match self {
            Self::None => {}
            Self::One(key) => {
                if !keep(key) {
                    *self = Self::None;
                }
            }
            Self::Many(keys) => {
                keys.retain(keep);
                *self = match keys.len() {
                    0 => Self::None,
                    1 => Self::One(keys.swap_remove(0)),
                    _ => return,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests;
