use super::*;

/// The compact address sorts as `SocketAddr` does (backend ids are handed out
/// in address order) and converts back unchanged.
#[test]
fn order_and_round_trip_match_socket_addr() {
    let mut addrs: Vec<SocketAddr> = [
        "[fd00::2]:80",
        "10.0.0.2:80",
        "10.0.0.1:8080",
        "[fd00::1]:443",
        "10.0.0.1:80",
        "[::1]:1",
        "255.255.255.255:65535",
    ]
    .iter()
    .map(|s| s.parse().expect("socket address"))
    .collect();
    let mut compact: Vec<BackendAddr> = addrs.iter().copied().map(BackendAddr::from).collect();
    addrs.sort_unstable();
    compact.sort_unstable();
    let back: Vec<SocketAddr> = compact.iter().map(|a| a.socket_addr()).collect();
    assert_eq!(back, addrs);
    assert_eq!(size_of::<BackendAddr>(), 20);
}

/// Inserts, lookups and removals (which move the last record) keep every
/// address finding its own record.
#[test]
fn removal_keeps_the_index_consistent() {
    let addr = |i: u32| BackendAddr::from(SocketAddr::from((Ipv4Addr::from(i), 80)));
    let mut table: BackendTable<u32> = BackendTable::default();
    for i in 0..1000 {
        *table.get_or_default(addr(i)) = i;
    }
    for i in (0..1000).step_by(3) {
        table.remove(&addr(i));
    }
    table.retain(|_, v| v % 3 != 1);
    table.shrink();
    let capacity = table.records.capacity();
    assert!((333..400).contains(&capacity), "{capacity}");
    // One more record fits without growing (no copy per added backend).
    *table.get_or_default(addr(5000)) = 5000;
    table.shrink();
    assert_eq!(table.records.capacity(), capacity);
    table.remove(&addr(5000));
    for i in 0..1000 {
        let want = (i % 3 == 2).then_some(i);
        assert_eq!(table.get(&addr(i)).copied(), want, "backend {i}");
    }
    assert_eq!(table.values().count(), 333);
    assert!(table.iter().all(|(a, v)| *a == addr(*v)));
}
