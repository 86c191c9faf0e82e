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
