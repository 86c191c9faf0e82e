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
mod tests {
    use super::*;
    use hickory_proto::rr::{
        Name,
        rdata::{A, SOA},
    };
    use std::str::FromStr;

    fn key(name: &str) -> CacheKey {
        CacheKey {
            name: LowerName::from(Name::from_str(name).unwrap()),
            rtype: RecordType::A,
            class: DNSClass::IN,
        }
    }

    fn a(name: &str, ttl: u32) -> Record {
        Record::from_rdata(
            Name::from_str(name).unwrap(),
            ttl,
            RData::A(A::new(192, 0, 2, 1)),
        )
    }

    fn soa(ttl: u32, minimum: u32) -> Record {
        Record::from_rdata(
            Name::from_str("example.").unwrap(),
            ttl,
            RData::SOA(SOA::new(
                Name::from_str("ns.example.").unwrap(),
                Name::from_str("admin.example.").unwrap(),
                1,
                3600,
                600,
                86_400,
                minimum,
            )),
        )
    }

    fn positive(ttls: &[u32]) -> Arc<Cached> {
        Arc::new(Cached {
            rcode: ResponseCode::NoError,
            answers: ttls.iter().map(|&t| a("www.example.", t)).collect(),
            authorities: vec![],
            additionals: vec![],
        })
    }

    #[test]
    fn positive_answers_live_for_their_smallest_ttl_and_age() {
        let cache = DnsCache::new(10);
        let t0 = Instant::now();
        assert!(cache.insert(key("www.example."), positive(&[30, 10]), t0));
        let hit = cache
            .get(&key("WWW.Example."), t0 + Duration::from_secs(4))
            .unwrap();
        assert_eq!(
            hit.answers.iter().map(|r| r.ttl).collect::<Vec<_>>(),
            [6, 6]
        );
        assert!(
            cache
                .get(&key("www.example."), t0 + Duration::from_millis(9_999))
                .is_some()
        );
        assert_eq!(
            cache.get(&key("www.example."), t0 + Duration::from_secs(10)),
            None
        );
        assert!(cache.is_empty(), "an expired entry is dropped on lookup");
    }

    #[test]
    fn negative_answers_use_the_soa_minimum_capped() {
        let cache = DnsCache::new(10);
        let t0 = Instant::now();
        let nx = |ttl, minimum| {
            Arc::new(Cached {
                rcode: ResponseCode::NXDomain,
                answers: vec![],
                authorities: vec![soa(ttl, minimum)],
                additionals: vec![],
            })
        };
        assert_eq!(nx(3600, 60).cache_ttl(), Some(60));
        assert_eq!(nx(30, 60).cache_ttl(), Some(30));
        assert_eq!(nx(86_400, 86_400).cache_ttl(), Some(MAX_NEGATIVE_TTL));
        assert!(cache.insert(key("nope.example."), nx(3600, 60), t0));
        let hit = cache
            .get(&key("nope.example."), t0 + Duration::from_secs(59))
            .unwrap();
        assert_eq!(hit.rcode, ResponseCode::NXDomain);
        assert_eq!(hit.authorities[0].ttl, 1);
        assert_eq!(
            cache.get(&key("nope.example."), t0 + Duration::from_secs(60)),
            None
        );
        // Without an SOA a negative answer is not cached; errors never are.
        let bare = Arc::new(Cached {
            rcode: ResponseCode::NXDomain,
            answers: vec![],
            authorities: vec![],
            additionals: vec![],
        });
        assert!(!cache.insert(key("bare.example."), bare, t0));
        let servfail = Arc::new(Cached {
            rcode: ResponseCode::ServFail,
            answers: vec![],
            authorities: vec![soa(60, 60)],
            additionals: vec![],
        });
        assert!(!cache.insert(key("fail.example."), servfail, t0));
        assert!(!cache.insert(key("zero.example."), positive(&[0]), t0));
    }

    #[test]
    fn a_full_cache_evicts_the_least_recently_used() {
        let cache = DnsCache::new(3);
        let t0 = Instant::now();
        for name in ["a.example.", "b.example.", "c.example."] {
            assert!(cache.insert(key(name), positive(&[60]), t0));
        }
        // `a` is used, so `b` is the oldest when `d` arrives.
        assert!(cache.get(&key("a.example."), t0).is_some());
        assert!(cache.insert(key("d.example."), positive(&[60]), t0));
        assert_eq!(cache.len(), 3);
        assert!(cache.get(&key("b.example."), t0).is_none());
        for name in ["a.example.", "c.example.", "d.example."] {
            assert!(cache.get(&key(name), t0).is_some(), "{name}");
        }
        // Many more inserts never grow it past its bound.
        for i in 0..100 {
            cache.insert(key(&format!("n{i}.example.")), positive(&[60]), t0);
        }
        assert_eq!(cache.len(), 3);
        assert!(!DnsCache::new(0).insert(key("a.example."), positive(&[60]), t0));
    }
}
