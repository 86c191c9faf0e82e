//! The VIP prefilter: a bitmap the tc/XDP programs test before the frontend hash
//! lookup, so that most packets to no VIP pass after one (inlined) array read.
//!
//! Every frontend (VIP, port, protocol) hashes to one of [`VIP_FILTER_BITS`] bits.
//! A **set** bit means "no frontend hashes here": the packet is no VIP's. A clear
//! bit means "maybe a frontend": the program looks the frontend up as before. So a
//! zeroed map (new, or from an agent that never wrote it) filters nothing. A stale
//! set bit hides a frontend from tc/XDP, so the agent writes the changed words at
//! the end of every sync (a frontend added by a large sync, whose batch went out
//! earlier in it, is passed untranslated until then: milliseconds), and every start
//! creates the map afresh (the loader removes its pin), so no filter outlives the
//! agent that kept it. The map is `Array<u64>` ([`crate::lb::VIP_FILTER`]), bit `b`
//! is bit `b % 64` of word `b / 64`.
//!
//! The hash works on the raw key fields as they sit in the packet and in
//! `ServiceKeyV4`/`ServiceKeyV6` (network order, read as host integers), which the
//! agent and the programs see alike on the same (little-endian) host.

/// Words ([`u64`]) in the filter map.
pub const VIP_FILTER_WORDS: u32 = 4096;
/// Bits in the filter: 262,144 (32 KB), so even 65,536 frontends leave ~78% of
/// the bits set.
pub const VIP_FILTER_BITS: u32 = VIP_FILTER_WORDS * 64;
const _: () = assert!(VIP_FILTER_BITS.is_power_of_two());

/// The bit of IPv4 frontend `addr:port/proto` (raw key fields).
#[inline(always)]
#[must_use]
pub fn vip_filter_bit_v4(addr: u32, port: u16, proto: u8) -> u32 {
    bit_of(addr, port, proto)
}

/// The bit of IPv6 frontend `addr:port/proto` (raw key fields).
#[inline(always)]
#[must_use]
pub fn vip_filter_bit_v6(addr: &[u32; 4], port: u16, proto: u8) -> u32 {
    // Mixed, not only xor-ed: addresses that differ in two words the same way (as
    // in ::a:0:0:a and ::b:0:0:b) still spread.
    let folded = addr[0]
        .wrapping_mul(0x85eb_ca6b)
        .wrapping_add(addr[1])
        .wrapping_mul(0xc2b2_ae35)
        .wrapping_add(addr[2])
        .wrapping_mul(0x85eb_ca6b)
        .wrapping_add(addr[3]);
    bit_of(folded, port, proto)
}

/// Multiplicative (Fibonacci) hashing of the address mixed with port and protocol;
/// the top bits index the filter.
#[inline(always)]
fn bit_of(addr: u32, port: u16, proto: u8) -> u32 {
    let x = addr ^ (u32::from(port) << 8 | u32::from(proto)).rotate_left(16);
    let h = x.wrapping_mul(0x9e37_79b1);
    let h = (h ^ (h >> 15)).wrapping_mul(0x2c1b_3c6d);
    h >> (32 - VIP_FILTER_BITS.trailing_zeros())
}

#[cfg(test)]
mod tests;
