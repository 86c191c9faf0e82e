//! The flow hash every data plane uses to pick a backend from a Maglev table.
//!
//! It is Bob Jenkins' `jhash2` exactly as the Linux kernel defines it
//! (`include/linux/jhash.h`), over a fixed number of 32-bit words: no tables, no
//! loops over unbounded data (the word count is a const generic, so the eBPF side
//! unrolls it), and the same value on every build, architecture and node. Being the
//! kernel's function, the golden values below can be checked against C.
//!
//! Words are host-order numbers: an IPv4 address is `u32::from(Ipv4Addr)` (its
//! big-endian value), so an eBPF program reading a raw `saddr` from a packet hashes
//! `u32::from_be(saddr)`. A port is its numeric value in the low 16 bits.

/// The seed of the flow hash, the same on every node so that a flow reaching any node
/// lands on the same backend ("RUNE" in ASCII).
pub const FLOW_HASH_SEED: u32 = 0x5255_4e45;

/// The kernel's `JHASH_INITVAL`.
const JHASH_INITVAL: u32 = 0xdead_beef;

#[inline(always)]
fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
    *a = a.wrapping_sub(*c);
    *a ^= c.rotate_left(4);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a);
    *b ^= a.rotate_left(6);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b);
    *c ^= b.rotate_left(8);
    *b = b.wrapping_add(*a);
    *a = a.wrapping_sub(*c);
    *a ^= c.rotate_left(16);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a);
    *b ^= a.rotate_left(19);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b);
    *c ^= b.rotate_left(4);
    *b = b.wrapping_add(*a);
}

#[inline(always)]
fn fin(a: &mut u32, b: &mut u32, c: &mut u32) {
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(14));
    *a ^= *c;
    *a = a.wrapping_sub(c.rotate_left(11));
    *b ^= *a;
    *b = b.wrapping_sub(a.rotate_left(25));
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(16));
    *a ^= *c;
    *a = a.wrapping_sub(c.rotate_left(4));
    *b ^= *a;
    *b = b.wrapping_sub(a.rotate_left(14));
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(24));
}

/// Linux's `jhash2(words, N, seed)`: a 32-bit hash of `N` words. `N` is fixed at
/// compile time, so the loop below is bounded and unrolls in eBPF.
#[inline(always)]
pub fn jhash2<const N: usize>(words: &[u32; N], seed: u32) -> u32 {
    let init = JHASH_INITVAL
        .wrapping_add((N as u32).wrapping_shl(2))
        .wrapping_add(seed);
    let (mut a, mut b, mut c) = (init, init, init);
    let mut i = 0;
    while N - i > 3 {
        a = a.wrapping_add(words[i]);
        b = b.wrapping_add(words[i + 1]);
        c = c.wrapping_add(words[i + 2]);
        mix(&mut a, &mut b, &mut c);
        i += 3;
    }
    let rest = N - i;
    if rest == 0 {
        return c;
    }
    if rest == 3 {
        c = c.wrapping_add(words[i + 2]);
    }
    if rest >= 2 {
        b = b.wrapping_add(words[i + 1]);
    }
    a = a.wrapping_add(words[i]);
    fin(&mut a, &mut b, &mut c);
    c
}

/// The flow hash of an IPv4 client: `jhash2([saddr, sport], seed)`. The service the
/// flow goes to is implied by the Maglev table it indexes, so it is not hashed.
/// Session affinity by client IP passes `sport = 0` (never a real source port).
#[inline(always)]
pub fn flow_hash_v4(saddr: u32, sport: u16, seed: u32) -> u32 {
    jhash2(&[saddr, sport as u32], seed)
}

/// The flow hash of an IPv6 client: `jhash2([saddr as 4 big-endian words, sport],
/// seed)`; `sport = 0` for affinity by client IP, as for IPv4.
#[inline(always)]
pub fn flow_hash_v6(saddr: [u32; 4], sport: u16, seed: u32) -> u32 {
    jhash2(
        &[saddr[0], saddr[1], saddr[2], saddr[3], sport as u32],
        seed,
    )
}

#[cfg(test)]
mod tests;
