use super::*;
use std::net::SocketAddr;

/// Uses list active and draining backends in one address order, and a new use
/// of an address replaces its old one.
#[test]
fn uses_keep_one_use_per_address_in_address_order() {
    let addr = |s: &str| BackendAddr::from(s.parse::<SocketAddr>().expect("address"));
    let until = Instant::now();
    let mut uses = Uses::default();
    uses.insert(addr("10.0.0.3:80"), Use::Active);
    uses.insert(addr("10.0.0.1:80"), Use::Draining { until });
    uses.insert(addr("10.0.0.2:80"), Use::Active);
    uses.insert(addr("[fd00::1]:80"), Use::Draining { until });
    uses.insert(addr("10.0.0.2:80"), Use::Draining { until });
    uses.insert(addr("10.0.0.1:80"), Use::Active);
    let listed: Vec<(SocketAddr, Use)> = uses.iter().map(|(a, u)| (a.socket_addr(), *u)).collect();
    let want: Vec<(SocketAddr, Use)> = [
        ("10.0.0.1:80", Use::Active),
        ("10.0.0.2:80", Use::Draining { until }),
        ("10.0.0.3:80", Use::Active),
        ("[fd00::1]:80", Use::Draining { until }),
    ]
    .iter()
    .map(|(a, u)| (a.parse().expect("address"), *u))
    .collect();
    assert_eq!(listed, want);
    uses.remove(&addr("10.0.0.2:80"));
    assert!(!uses.contains_key(&addr("10.0.0.2:80")));
    assert_eq!(uses.get(&addr("10.0.0.3:80")), Some(&Use::Active));
    assert_eq!(uses.keys().count(), 3);
}
