//! Ones'-complement arithmetic for incremental checksum updates (RFC 1624).
//!
//! Every value is summed exactly as it was loaded from the packet (native-order
//! loads of network-order bytes): a ones'-complement sum does not depend on byte
//! order as long as loads and stores agree, so nothing is swapped. A "diff" is the
//! 32-bit ones'-complement sum of `!old + new` over the changed words, the same
//! `__wsum` `bpf_csum_diff` produces and `bpf_l{3,4}_csum_replace` accept with size 0.

/// 32-bit ones'-complement addition (end-around carry).
#[inline(always)]
pub const fn add(a: u32, b: u32) -> u32 {
    let (sum, carry) = a.overflowing_add(b);
    sum.wrapping_add(carry as u32)
}

/// The diff of replacing the 32-bit word `old` by `new`.
#[inline(always)]
pub const fn diff32(old: u32, new: u32) -> u32 {
    add(!old, new)
}

/// The diff of replacing a 128-bit address (four words) `old` by `new`.
#[inline(always)]
pub const fn diff128(old: &[u32; 4], new: &[u32; 4]) -> u32 {
    add(
        add(diff32(old[0], new[0]), diff32(old[1], new[1])),
        add(diff32(old[2], new[2]), diff32(old[3], new[3])),
    )
}

/// Folds a 32-bit ones'-complement sum to 16 bits.
#[inline(always)]
pub const fn fold(sum: u32) -> u16 {
    let sum = (sum & 0xffff) + (sum >> 16);
    let sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// RFC 1624 eqn. 3: the checksum field `check` after the words summed in `diff`
/// changed: `~(~HC + ~m + m')`.
#[inline(always)]
pub const fn update(check: u16, diff: u32) -> u16 {
    !fold(add((!check) as u32, diff))
}
