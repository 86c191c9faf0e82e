use super::*;

#[test]
fn bits_are_in_range_and_spread() {
    // 10.96.0.0/20 on one port: the typical ClusterIP range.
    let mut seen = [0u64; VIP_FILTER_WORDS as usize];
    let mut distinct = 0;
    for i in 0..4096u32 {
        let addr = (0x0a60_0000u32 | i).to_be();
        let bit = vip_filter_bit_v4(addr, 80u16.to_be(), 6);
        assert!(bit < VIP_FILTER_BITS);
        let (w, b) = ((bit / 64) as usize, bit % 64);
        if seen[w] & (1 << b) == 0 {
            distinct += 1;
        }
        seen[w] |= 1 << b;
    }
    // Random placement of 4096 keys in 262,144 bits collides ~32 times.
    assert!(distinct > 4000, "{distinct} distinct bits of 4096");
}

#[test]
fn port_protocol_and_v6_words_change_the_bit() {
    let addr = 0x0a60_0001u32.to_be();
    let tcp80 = vip_filter_bit_v4(addr, 80u16.to_be(), 6);
    assert_ne!(tcp80, vip_filter_bit_v4(addr, 81u16.to_be(), 6));
    assert_ne!(tcp80, vip_filter_bit_v4(addr, 80u16.to_be(), 17));
    let a = [0xfd00u32.to_be(), 0, 0, 1u32.to_be()];
    let b = [0xfd00u32.to_be(), 0, 1u32.to_be(), 1u32.to_be()];
    assert_ne!(
        vip_filter_bit_v6(&a, 443u16.to_be(), 6),
        vip_filter_bit_v6(&b, 443u16.to_be(), 6)
    );
}
