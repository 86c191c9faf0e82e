use super::*;

#[test]
fn addresses_keep_wire_order() {
    let v4 = addr_from_octets(&[198, 18, 0, 1]);
    assert_eq!(v4[0].to_ne_bytes(), [198, 18, 0, 1]);
    assert_eq!(&v4[1..], &[0, 0, 0]);
    let octets: [u8; 16] = core::array::from_fn(|i| i as u8);
    assert_eq!(addr_octets(&addr_from_octets(&octets)), octets);
    assert_eq!(addr_from_octets(&[1, 2, 3]), [0; 4]);
}

#[test]
fn udp_entries_live_for_the_timeout_across_the_wrap() {
    assert_eq!(CT_UDP_TIMEOUT_UNITS, 56);
    let now = ct_now(3_600 * 1_000_000_000);
    assert!(ct_udp_live(now, now));
    assert!(ct_udp_live(now - CT_UDP_TIMEOUT_UNITS, now));
    assert!(!ct_udp_live(now - CT_UDP_TIMEOUT_UNITS - 1, now));
    assert!(ct_udp_live(u32::MAX - 5, 10));
    assert!(!ct_udp_live(u32::MAX - 60, 10));
    // Refreshed by another CPU after this packet read the clock.
    assert!(ct_udp_live(now + 1, now));
    assert!(ct_udp_live(0, u32::MAX));
}

#[test]
fn nat_ports_keep_their_class() {
    for port in [1u16, 80, 511, 512, 599, 600, 1023, 1024, 32768, 65535] {
        let (first, count) = nat_port_class(port);
        let last = u32::from(first) + u32::from(count) - 1;
        assert!(last <= 65535, "{port}: {first}+{count}");
        let privileged = |p: u32| p < 1024;
        assert_eq!(
            privileged(u32::from(first)),
            privileged(u32::from(port)),
            "{port}"
        );
        assert_eq!(privileged(last), privileged(u32::from(port)), "{port}");
    }
    assert_eq!(nat_port_class(40000), (1024, 64512));
    assert_eq!(nat_port_class(700), (600, 424));
    assert_eq!(nat_port_class(22), (1, 511));
}

#[test]
fn drop_reasons_index_in_order() {
    for (i, reason) in DropReason::ALL.iter().enumerate() {
        assert_eq!(*reason as usize, i);
    }
}
