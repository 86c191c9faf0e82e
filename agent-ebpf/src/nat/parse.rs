//! Header walking over raw packet pointers (`data`, `data_end`), shared by tc and XDP.
//!
//! Everything is an address (`usize`) into the packet; every access is preceded by a
//! bounds check against `data_end` that the verifier can follow (constant sizes from
//! a base pointer). Fields are loaded natively from network-order bytes and compared
//! against network-order constants, so nothing is byte-swapped on the fast path.

use agent_common::lb::{PROTO_TCP, PROTO_UDP};

/// Ethernet header length (no VLAN tags: tagged frames are not parsed and pass).
pub const ETH_LEN: usize = 14;
/// IPv4 header length without options.
pub const IPV4_LEN: usize = 20;
/// IPv6 fixed header length.
pub const IPV6_LEN: usize = 40;
/// TCP header length without options.
pub const TCP_LEN: usize = 20;
/// UDP header length.
pub const UDP_LEN: usize = 8;

/// EtherType IPv4, as a native load of the wire bytes reads it.
pub const ETH_P_IP: u16 = 0x0800u16.to_be();
/// EtherType IPv6, as a native load of the wire bytes reads it.
pub const ETH_P_IPV6: u16 = 0x86ddu16.to_be();
/// IPv4 fragment offset bits, as a native load reads them.
const IP_OFFSET_MASK: u16 = 0x1fffu16.to_be();

/// Loads a `T` at `addr`.
///
/// # Safety
///
/// `addr..addr + size_of::<T>()` must be inside the packet (bounds-checked against
/// `data_end`). Packet fields may be unaligned: the kernel allows unaligned packet
/// access on the architectures the JIT targets, and a single load is what we want.
#[inline(always)]
pub unsafe fn load<T: Copy>(addr: usize) -> T {
    // SAFETY: see above.
    unsafe { *(addr as *const T) }
}

/// Stores a `T` at `addr`; same contract as [`load`].
///
/// # Safety
///
/// As [`load`], and the packet must be writable (it is in tc and XDP).
#[inline(always)]
pub unsafe fn store<T: Copy>(addr: usize, value: T) {
    // SAFETY: see above.
    unsafe { *(addr as *mut T) = value }
}

/// Where the transport header of a TCP/UDP packet starts. Only `l4 + 4` (the ports)
/// is known to be inside the packet; the rest is checked by [`full_l4`].
#[derive(Clone, Copy)]
pub struct L4Pos {
    /// Address of the IP header.
    pub ip: usize,
    /// Address of the TCP/UDP header.
    pub l4: usize,
    /// Offset of the TCP/UDP header from the start of the packet.
    pub l4_off: usize,
    /// [`PROTO_TCP`] or [`PROTO_UDP`].
    pub proto: u8,
}

/// The EtherType of the frame, if the Ethernet header is complete.
#[inline(always)]
pub fn ethertype(data: usize, end: usize) -> Option<u16> {
    if data + ETH_LEN > end {
        return None;
    }
    // SAFETY: bounds checked above.
    Some(unsafe { load::<u16>(data + 12) })
}

/// Walks an IPv4 header (options included, by IHL) to a TCP/UDP header whose ports
/// are inside the packet. `None` for anything else: another protocol, a bad version
/// or IHL, a non-first fragment (no transport header), or a packet cut before the
/// ports. Those are never translated.
#[inline(always)]
pub fn ipv4(data: usize, end: usize) -> Option<L4Pos> {
    let ip = data + ETH_LEN;
    if ip + IPV4_LEN > end {
        return None;
    }
    // SAFETY: the fixed header is inside the packet (checked above).
    let (vihl, proto, frag) = unsafe { (load::<u8>(ip), load::<u8>(ip + 9), load::<u16>(ip + 6)) };
    if vihl >> 4 != 4 || vihl & 0xf < 5 {
        return None;
    }
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return None;
    }
    if frag & IP_OFFSET_MASK != 0 {
        return None;
    }
    let ihl = ((vihl & 0xf) as usize) << 2;
    let l4 = ip + ihl;
    if l4 + 4 > end {
        return None;
    }
    Some(L4Pos {
        ip,
        l4,
        l4_off: ETH_LEN + ihl,
        proto,
    })
}

/// Walks an IPv6 header to a TCP/UDP header (no extension headers: packets with
/// any are not translated) whose ports are inside the packet.
#[inline(always)]
pub fn ipv6(data: usize, end: usize) -> Option<L4Pos> {
    let ip = data + ETH_LEN;
    if ip + IPV6_LEN + 4 > end {
        return None;
    }
    // SAFETY: the fixed header and the ports are inside the packet (checked above).
    let (version, proto) = unsafe { (load::<u8>(ip), load::<u8>(ip + 6)) };
    if version >> 4 != 6 {
        return None;
    }
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return None;
    }
    Some(L4Pos {
        ip,
        l4: ip + IPV6_LEN,
        l4_off: ETH_LEN + IPV6_LEN,
        proto,
    })
}
