//! Map keys, values and constants shared by the eBPF programs (`agent-ebpf`) and the
//! agent. `#![no_std]`, `#[repr(C)]` and padding-free, so both sides agree on layout.
//! With the `user` feature, the user-space side also gets `aya::Pod` for the map
//! types and [`codec`], the conversions between socket addresses and map entries.
#![no_std]
#[cfg(feature = "user")]
pub mod codec;
pub mod filter;
pub mod hash;
pub mod lb;
pub mod policy;

/// Packet and byte counters kept by an XDP program, one slot per CPU (the test
/// object's `rune_xdp_pass`).
///
/// The kernel side bumps its own CPU's slot without atomics (a `PerCpuArray`); user
/// space reads every CPU's slot and sums them with [`PacketStats::add`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PacketStats {
    /// Packets the program has seen.
    pub packets: u64,
    /// Bytes of those packets, from the start of the Ethernet header.
    pub bytes: u64,
}

// Two u64s, no implicit padding: the byte layout is the same on both sides.
const _: () = assert!(size_of::<PacketStats>() == 16);
const _: () = assert!(align_of::<PacketStats>() == 8);

impl PacketStats {
    /// Returns the field-wise sum, wrapping on overflow as the kernel counters do.
    #[must_use]
    pub const fn add(self, other: Self) -> Self {
        Self {
            packets: self.packets.wrapping_add(other.packets),
            bytes: self.bytes.wrapping_add(other.bytes),
        }
    }
}

// SAFETY: `PacketStats` is `#[repr(C)]`, made only of `u64`s, has no padding (checked
// above) and every bit pattern is a valid value.
#[cfg(feature = "user")]
unsafe impl aya::Pod for PacketStats {}
