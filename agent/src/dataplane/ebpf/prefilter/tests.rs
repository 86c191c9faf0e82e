use super::*;
use crate::dataplane::ebpf::maps::{Capacity, FakeMaps};
use agent_common::{
    codec::frontend_key,
    lb::{PROTO_TCP, PROTO_UDP},
};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

fn v4(last: u8, port: u16, proto: u8) -> FrontendKey {
    frontend_key(IpAddr::V4(Ipv4Addr::new(10, 96, 0, last)), port, proto)
}

fn v6(last: u8) -> FrontendKey {
    let vip = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, u16::from(last));
    frontend_key(IpAddr::V6(vip), 443, PROTO_TCP)
}

fn fake() -> FakeMaps {
    FakeMaps::new(Capacity {
        frontends: 16,
        backends: 16,
        table_size: 7,
        flows: 16,
    })
}

/// Whether the map lets `key` through to the frontend lookup.
fn passes(maps: &FakeMaps, key: &FrontendKey) -> bool {
    let bit = bit_of(key);
    maps.vip_filter[(bit / 64) as usize] & (1 << (bit % 64)) == 0
}

#[test]
fn reset_writes_every_word_and_only_frontends_pass() {
    let keys = [v4(1, 80, PROTO_TCP), v4(2, 53, PROTO_UDP), v6(1)];
    let mut filter = VipFilter::default();
    let mut maps = fake();
    filter.reset(&keys);
    filter.write(&mut maps).unwrap();
    assert!(keys.iter().all(|k| passes(&maps, k)));
    let set: u32 = maps.vip_filter.iter().map(|w| w.count_ones()).sum();
    assert_eq!(set, VIP_FILTER_WORDS * 64 - 3, "one clear bit per frontend");
    assert!(!passes(&maps, &v4(3, 80, PROTO_TCP)));
    assert!(!passes(&maps, &v4(1, 81, PROTO_TCP)));
    assert!(!passes(&maps, &v4(1, 80, PROTO_UDP)));
}

#[test]
fn changes_rewrite_only_their_words() {
    let mut filter = VipFilter::default();
    let mut maps = fake();
    filter.reset([]);
    filter.write(&mut maps).unwrap();
    maps.vip_filter_writes = 0;
    let key = v4(7, 8080, PROTO_TCP);
    filter.add(&key);
    filter.write(&mut maps).unwrap();
    assert_eq!(maps.vip_filter_writes, 1);
    assert!(passes(&maps, &key));
    filter.remove(&key);
    filter.write(&mut maps).unwrap();
    assert_eq!(maps.vip_filter_writes, 2);
    assert!(!passes(&maps, &key));
    assert!(maps.vip_filter.iter().all(|w| *w == u64::MAX));
    filter.write(&mut maps).unwrap();
    assert_eq!(
        maps.vip_filter_writes, 2,
        "nothing changed, nothing written"
    );
}

#[test]
fn a_shared_bit_stays_clear_until_its_last_frontend_goes() {
    // Two different frontends with the same bit (found by search: the bitmap
    // has 262,144 bits, so a few thousand keys collide).
    let first = v4(1, 80, PROTO_TCP);
    let other = (1..=u16::MAX)
        .map(|port| v4(2, port, PROTO_TCP))
        .find(|k| bit_of(k) == bit_of(&first))
        .or_else(|| {
            (0..=255u8)
                .flat_map(|a| (1..=u16::MAX).map(move |p| v4(a, p, PROTO_UDP)))
                .find(|k| bit_of(k) == bit_of(&first))
        })
        .expect("a key sharing the bit");
    let mut filter = VipFilter::default();
    let mut maps = fake();
    filter.reset([&first, &other]);
    filter.write(&mut maps).unwrap();
    filter.remove(&first);
    filter.write(&mut maps).unwrap();
    assert!(passes(&maps, &other));
    filter.remove(&other);
    filter.write(&mut maps).unwrap();
    assert!(!passes(&maps, &first) && !passes(&maps, &other));
}

#[test]
fn a_failed_write_is_retried() {
    use crate::dataplane::ebpf::maps::FaultyMaps;
    let mut filter = VipFilter::default();
    let mut maps = FaultyMaps {
        inner: fake(),
        writes_left: Some(0),
    };
    let key = v6(9);
    filter.reset([&key]);
    assert!(filter.write(&mut maps).is_err());
    maps.writes_left = None;
    filter.write(&mut maps).unwrap();
    assert!(passes(&maps.inner, &key));
    assert!(!passes(&maps.inner, &v6(10)));
}
