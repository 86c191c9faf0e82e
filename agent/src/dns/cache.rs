//! A bounded cache of forwarded answers, keyed by (lower-cased name, type, class).
//!
//! An entry lives as long as the smallest TTL of its records (positive answers) or
//! the SOA's negative TTL (NXDOMAIN and empty answers, RFC 2308), both capped; the
//! least recently used entry makes room when the cache is full. Time is passed in by
//! the caller, so tests drive it without sleeping.

use hickory_proto::{
    op::ResponseCode,
    rr::{DNSClass, LowerName, RData, Record, RecordType},
};
use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::lock::lock;

/// Longest time a positive answer is kept, whatever its TTL (one day).
pub const MAX_POSITIVE_TTL: u32 = 86_400;

/// Longest time a negative answer is kept, whatever the SOA says (five minutes).
pub const MAX_NEGATIVE_TTL: u32 = 300;

/// What a cached answer is looked up by.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct CacheKey {
    /// The question's name, lower case.
    pub name: LowerName,
    /// The question's type.
    pub rtype: RecordType,
    /// The question's class.
    pub class: DNSClass,
}

/// An upstream's answer, as sent back to clients.
#[derive(Clone, Debug, PartialEq)]
pub struct Cached {
    /// The response code (NOERROR or NXDOMAIN when it came from the cache).
    pub rcode: ResponseCode,
    /// The answer section.
    pub answers: Vec<Record>,
    /// The authority section.
    pub authorities: Vec<Record>,
    /// The additional section (without EDNS).
    pub additionals: Vec<Record>,
}

impl Cached {
    /// How long this answer may be cached, in seconds; `None` when not at all
    /// (errors, a zero TTL, a negative answer without an SOA).
    pub fn cache_ttl(&self) -> Option<u32> {
        let ttl = match self.rcode {
            ResponseCode::NoError if !self.answers.is_empty() => self
                .answers
                .iter()
                .map(|r| r.ttl)
                .min()?
                .min(MAX_POSITIVE_TTL),
            ResponseCode::NoError | ResponseCode::NXDomain => self
                .authorities
                .iter()
                .filter_map(|r| match &r.data {
                    RData::SOA(soa) => Some(r.ttl.min(soa.minimum)),
                    _ => None,
                })
                .min()?
                .min(MAX_NEGATIVE_TTL),
            _ => return None,
        };
        (ttl > 0).then_some(ttl)
    }

    /// This answer `age` after it was stored: every TTL lowered by the age (whole
    /// seconds) and by no more than what is `left` of the entry's life.
    fn aged(&self, age: Duration, left: Duration) -> Cached {
        let age = u32::try_from(age.as_secs()).unwrap_or(u32::MAX);
        let left = u32::try_from(left.as_secs()).unwrap_or(u32::MAX);
        let age_records = |records: &[Record]| {
            records
                .iter()
                .map(|r| {
                    let mut r = r.clone();
                    r.ttl = r.ttl.saturating_sub(age).min(left);
                    r
                })
                .collect()
        };
        Cached {
            rcode: self.rcode,
            answers: age_records(&self.answers),
            authorities: age_records(&self.authorities),
            additionals: age_records(&self.additionals),
        }
    }
}

struct Entry {
    answer: Arc<Cached>,
    stored: Instant,
    expires: Instant,
    /// Position in the recency order (larger is more recent).
    tick: u64,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<CacheKey, Entry>,
    /// Recency order: tick → key, oldest first.
    order: BTreeMap<u64, CacheKey>,
    next_tick: u64,
}

impl Inner {
    fn remove(&mut self, key: &CacheKey) {
        if let Some(entry) = self.entries.remove(key) {
            self.order.remove(&entry.tick);
        }
    }

    fn touch(&mut self, key: &CacheKey) {
        let tick = self.next_tick;
        if let Some(entry) = self.entries.get_mut(key) {
            self.order.remove(&entry.tick);
            entry.tick = tick;
            self.order.insert(tick, key.clone());
            self.next_tick += 1;
        }
    }
}

/// The forwarder's answer cache; at most `capacity` entries.
pub struct DnsCache {
    capacity: usize,
    inner: Mutex<Inner>,
}

impl DnsCache {
    /// An empty cache holding at most `capacity` answers (0: caches nothing).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// The answer for `key` if one is stored and unexpired at `now`, with its TTLs
    /// lowered by its age.
    pub fn get(&self, key: &CacheKey, now: Instant) -> Option<Cached> {
        let mut inner = lock(&self.inner);
        let entry = inner.entries.get(key)?;
        if now >= entry.expires {
            inner.remove(key);
            return None;
        }
        let aged = entry.answer.aged(
            now.saturating_duration_since(entry.stored),
            entry.expires.saturating_duration_since(now),
        );
        inner.touch(key);
        Some(aged)
    }

    /// Stores `answer` for `key` at `now` when it may be cached, evicting the least
    /// recently used entry when full. Returns whether it was stored.
    pub fn insert(&self, key: CacheKey, answer: Arc<Cached>, now: Instant) -> bool {
        if self.capacity == 0 {
            return false;
        }
        let Some(ttl) = answer.cache_ttl() else {
            return false;
        };
        let mut inner = lock(&self.inner);
        inner.remove(&key);
        while inner.entries.len() >= self.capacity {
            let Some((_, oldest)) = inner.order.pop_first() else {
                break;
            };
            inner.entries.remove(&oldest);
        }
        let tick = inner.next_tick;
        inner.next_tick += 1;
        inner.order.insert(tick, key.clone());
        inner.entries.insert(
            key,
            Entry {
                answer,
                stored: now,
                expires: now + Duration::from_secs(u64::from(ttl)),
                tick,
            },
        );
        true
    }

    /// How many answers are stored (expired ones included until looked up or
    /// evicted).
    pub fn len(&self) -> usize {
        lock(&self.inner).entries.len()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests;
