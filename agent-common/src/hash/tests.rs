use super::*;

// Golden values computed with the Linux kernel's jhash.h compiled as C: any change
// to the function (which would move every flow to another backend) fails here.
#[test]
fn jhash2_matches_the_kernel() {
    assert_eq!(jhash2(&[], 0), 0xdead_beef);
    assert_eq!(jhash2(&[1], 0), 0x72a8_2a9b);
    assert_eq!(jhash2(&[1, 2, 3], 0), 0xa461_58f5);
    assert_eq!(jhash2(&[1, 2, 3, 4, 5], 0), 0x6291_29c0);
}

#[test]
fn flow_hashes_are_golden() {
    // 192.0.2.1:40000
    assert_eq!(
        flow_hash_v4(0xc000_0201, 40000, FLOW_HASH_SEED),
        0xe7df_e031
    );
    assert_eq!(flow_hash_v4(0xc000_0201, 0, FLOW_HASH_SEED), 0x864d_2212);
    // [2001:db8::1]:40000
    assert_eq!(
        flow_hash_v6([0x2001_0db8, 0, 0, 1], 40000, FLOW_HASH_SEED),
        0x624d_c89c
    );
}

#[test]
fn seed_and_port_change_the_hash() {
    let h = flow_hash_v4(0x7f00_0001, 1234, FLOW_HASH_SEED);
    assert_ne!(h, flow_hash_v4(0x7f00_0001, 1235, FLOW_HASH_SEED));
    assert_ne!(h, flow_hash_v4(0x7f00_0001, 1234, FLOW_HASH_SEED ^ 1));
}
