//! The load balancer's maps: service frontends, backends, Maglev tables, conntrack
//! (both directions), session affinity, the socket-LB reverse map and the counters.
//!
//! Byte order: addresses and ports are stored exactly as they appear on the wire and
//! in `struct bpf_sock_addr` (network order), so the programs compare and copy them
//! without swapping. An address is always four 32-bit words (`Addr`); an IPv4
//! address uses word 0 and leaves the rest zero. On the agent side, build one with
//! [`addr_from_octets`]; `u32::from_ne_bytes(ipv4.octets())` is the IPv4 word.
//!
//! Every type is `#[repr(C)]` with explicit padding fields (always zero), so that the
//! kernel, which hashes and compares keys byte by byte, sees the same bytes the agent
//! wrote. Sizes are checked at compile time below.

/// An address as four network-order 32-bit words (IPv4 in word 0, rest zero).
pub type Addr = [u32; 4];

/// IP protocol number of TCP.
pub const PROTO_TCP: u8 = 6;
/// IP protocol number of UDP.
pub const PROTO_UDP: u8 = 17;

/// `Backend::family` / `SockRevValue::family` of an IPv4 address.
pub const FAMILY_V4: u8 = 4;
/// `Backend::family` / `SockRevValue::family` of an IPv6 address.
pub const FAMILY_V6: u8 = 6;

/// Builds an [`Addr`] from an address's octets (4 or 16 of them): the words hold the
/// octets in wire order. Any other length gives the zero address.
#[must_use]
pub fn addr_from_octets(octets: &[u8]) -> Addr {
    let mut words = [0u32; 4];
    if octets.len() == 4 || octets.len() == 16 {
        for (i, chunk) in octets.chunks_exact(4).enumerate() {
            words[i] = u32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        }
    }
    words
}

/// The octets of an [`Addr`] in wire order (16 of them; an IPv4 address is the
/// first 4).
#[must_use]
pub fn addr_octets(addr: &Addr) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, word) in addr.iter().enumerate() {
        out[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
    }
    out
}

/// A service frontend, IPv4: VIP, port and protocol. Key of [`SERVICES_V4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKeyV4 {
    /// The VIP (network order).
    pub addr: u32,
    /// The service port (network order).
    pub port: u16,
    /// [`PROTO_TCP`] or [`PROTO_UDP`].
    pub proto: u8,
    /// Always zero.
    pub pad: u8,
}

/// A service frontend, IPv6: VIP, port and protocol. Key of [`SERVICES_V6`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKeyV6 {
    /// The VIP (network order).
    pub addr: Addr,
    /// The service port (network order).
    pub port: u16,
    /// [`PROTO_TCP`] or [`PROTO_UDP`].
    pub proto: u8,
    /// Always zero.
    pub pad: u8,
}

/// What a frontend leads to. Value of [`SERVICES_V4`] and [`SERVICES_V6`].
///
/// `maglev_size == 0` means the service is known but has no backend for new flows:
/// the programs refuse and count [`DropReason::NoBackend`] (tc/XDP: a TCP RST or an
/// ICMP/ICMPv6 port unreachable goes back; socket LB: the connect fails).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceValue {
    /// This frontend's id: index into [`SERVICE_STATS`], part of affinity keys.
    pub id: u32,
    /// First slot of this frontend's table in [`MAGLEV`].
    pub maglev_base: u32,
    /// Slots in the table (a prime), or 0: no backend takes new flows.
    pub maglev_size: u32,
    /// ClientIP session affinity timeout in seconds; 0 when affinity is off.
    pub affinity_timeout: u32,
}

/// A backend: where a flow is sent. Value of [`BACKENDS`], indexed by backend id
/// (id 0 is never used, so a zero id means "none").
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Backend {
    /// The backend's address (network order).
    pub addr: Addr,
    /// The backend's port (network order).
    pub port: u16,
    /// [`FAMILY_V4`] or [`FAMILY_V6`]; 0 for an unused slot.
    pub family: u8,
    /// [`BACKEND_ACTIVE`] or [`BACKEND_DRAINING`].
    pub state: u8,
}

/// [`Backend::state`] of a backend that may take new flows (it is in Maglev tables).
pub const BACKEND_ACTIVE: u8 = 1;
/// [`Backend::state`] of a terminating or not-ready backend: it keeps the flows it
/// has (through conntrack) but session affinity no longer leads to it.
pub const BACKEND_DRAINING: u8 = 2;

/// A conntrack entry's key, IPv4: a packet's addresses and ports as it reached the
/// hook. Key of [`CONNTRACK_V4`], where it is the client's packet (client → VIP),
/// and of [`CONNTRACK_REPLY_V4`], where it is the backend's reply (backend → client,
/// the client's port as the backend sees it: [`CtValue::nat_port`]).
///
/// Each flow has one entry in both: the reply entry names the forward one, so a
/// reply finds its VIP with one lookup by its own tuple, however many frontends
/// lead to its backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKeyV4 {
    /// Source address: the client, or the backend in a reply key (network order).
    pub saddr: u32,
    /// Destination address: the VIP, or the client in a reply key (network order).
    pub daddr: u32,
    /// Source port: the client's, or the backend's in a reply key (network order).
    pub sport: u16,
    /// Destination port: the service port, or the client's as the backend sees it
    /// in a reply key (network order).
    pub dport: u16,
    /// [`PROTO_TCP`] or [`PROTO_UDP`].
    pub proto: u8,
    /// Always zero.
    pub pad: [u8; 3],
}

/// A conntrack entry's key, IPv6; see [`CtKeyV4`]. Key of [`CONNTRACK_V6`] and
/// [`CONNTRACK_REPLY_V6`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKeyV6 {
    /// Source address: the client, or the backend in a reply key (network order).
    pub saddr: Addr,
    /// Destination address: the VIP, or the client in a reply key (network order).
    pub daddr: Addr,
    /// Source port: the client's, or the backend's in a reply key (network order).
    pub sport: u16,
    /// Destination port: the service port, or the client's as the backend sees it
    /// in a reply key (network order).
    pub dport: u16,
    /// [`PROTO_TCP`] or [`PROTO_UDP`].
    pub proto: u8,
    /// Always zero.
    pub pad: [u8; 3],
}

/// A conntrack entry's value (both families): where the flow goes, the client port
/// the backend sees, and what tells a reply of this flow from a later, direct
/// (non-VIP) flow on the same addresses and ports.
///
/// At the backend a VIP flow and a direct flow from the same client address and
/// port have the same 4-tuple, so the reverse NAT needs more than the tuple:
///
/// * TCP: a packet from the backend with SYN set starts a connection. It belongs to
///   this flow only if it is a SYN-ACK acknowledging the SYN the client sent
///   through the VIP (`syn_ack`); any other SYN from the backend means the VIP flow
///   is over: its entries are deleted and the packet left as it is. A client's SYN
///   with a new sequence number (a new connection on the same tuple) re-initialises
///   the entry. Established packets only read the entry.
/// * UDP (no handshake): replies are translated while the entry is younger than
///   [`CT_UDP_TIMEOUT_SECS`] (`last_seen`, refreshed by packets in either direction
///   at most once per [`ct_now`] unit).
///
/// Two flows through different frontends (or a direct flow the backend still
/// remembers in TIME_WAIT) must not meet at the backend on one 4-tuple: its
/// TIME_WAIT would refuse the second SYN (another client view: timestamps and
/// sequence numbers from another offset) and the client would stall a second on
/// a SYN retransmit; replies would be ambiguous. So a new flow takes the client's
/// port only when no other flow's reply entry holds (backend, client, port);
/// otherwise another port of the same class ([`nat_port_class`]), as Linux NAT does.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtValue {
    /// The backend of the flow.
    pub backend_id: u32,
    /// The frontend's id ([`ServiceValue::id`]).
    pub service_id: u32,
    /// TCP: the acknowledgment number (network order) a SYN-ACK of this flow
    /// carries, the client's initial sequence number + 1; 0 when the entry was
    /// made by a packet other than a SYN (a flow picked up mid-stream). UDP: 0.
    pub syn_ack: u32,
    /// UDP: [`ct_now`] at the flow's last packet (either direction). TCP: 0.
    pub last_seen: u32,
    /// The client's port as the backend sees it (network order): the client's own
    /// unless another flow held it towards this backend.
    pub nat_port: u16,
    /// Always zero.
    pub pad: u16,
}

/// A reply entry's value, IPv4 ([`CONNTRACK_REPLY_V4`]): the forward entry the
/// backend's reply belongs to, (client, `vip`, `cport`, `vport`) with the client
/// from the reply's destination, and the backend it was made for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtReplyV4 {
    /// The VIP the client addressed (network order).
    pub vip: u32,
    /// The service port (network order).
    pub vport: u16,
    /// The client's own port (network order).
    pub cport: u16,
    /// The backend the entry was made for: a forward entry naming another one has
    /// moved on (the reply entry is stale).
    pub backend_id: u32,
}

/// A reply entry's value, IPv6 ([`CONNTRACK_REPLY_V6`]); see [`CtReplyV4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtReplyV6 {
    /// The VIP the client addressed (network order).
    pub vip: Addr,
    /// The service port (network order).
    pub vport: u16,
    /// The client's own port (network order).
    pub cport: u16,
    /// The backend the entry was made for.
    pub backend_id: u32,
}

/// Ports a new flow tries for its backend-side tuple: the client's own (or the one
/// its entry had), then random ones of its class; when every one is held the packet
/// is dropped ([`DropReason::NoNatPort`]) and the client's retransmission tries
/// again.
pub const NAT_PORT_TRIES: u32 = 4;

/// The ports a client port may be replaced by (host order): `(first, count)`.
/// Privileged ports stay privileged and others stay unprivileged, so that a
/// backend that trusts source ports below 1024 (as NFS and rsh servers do) never
/// sees one the client did not have; Linux NAT uses the same classes.
#[must_use]
pub const fn nat_port_class(port: u16) -> (u16, u16) {
    if port < 512 {
        (1, 511)
    } else if port < 1024 {
        (600, 424)
    } else {
        (1024, 64512)
    }
}

/// Right shift from `bpf_ktime_get_ns()` (CLOCK_MONOTONIC, ns) to
/// [`CtValue::last_seen`] units of 2^30 ns (~1.07 s).
pub const CT_TIME_SHIFT: u32 = 30;

/// How long a UDP flow's replies are reverse-translated after its last packet.
pub const CT_UDP_TIMEOUT_SECS: u64 = 60;

/// [`CT_UDP_TIMEOUT_SECS`] in [`CtValue::last_seen`] units (rounded up).
pub const CT_UDP_TIMEOUT_UNITS: u32 =
    (CT_UDP_TIMEOUT_SECS * 1_000_000_000).div_ceil(1 << CT_TIME_SHIFT) as u32;

/// A CLOCK_MONOTONIC time in ns as a [`CtValue::last_seen`] value.
#[must_use]
pub const fn ct_now(monotonic_ns: u64) -> u32 {
    (monotonic_ns >> CT_TIME_SHIFT) as u32
}

/// Whether a UDP entry last seen at `last_seen` is still live at `now` (both
/// [`ct_now`] values; wrapping, so the comparison survives the counter's wrap).
/// A `last_seen` ahead of `now` is live: another CPU may have refreshed the entry
/// after this packet read the clock.
#[must_use]
pub const fn ct_udp_live(last_seen: u32, now: u32) -> bool {
    (now.wrapping_sub(last_seen) as i32) <= CT_UDP_TIMEOUT_UNITS as i32
}

/// Session affinity key: frontend and client address. Key of [`AFFINITY`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    /// The client's address (network order).
    pub client: Addr,
    /// The frontend's id ([`ServiceValue::id`]).
    pub service_id: u32,
}

/// Session affinity value: the backend chosen and when the client was last seen.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityValue {
    /// `bpf_ktime_get_ns()` at the client's last new flow.
    pub last_used_ns: u64,
    /// The backend chosen.
    pub backend_id: u32,
    /// Always zero.
    pub pad: u32,
}

/// Socket-LB reverse map key: the socket (by cookie) and the backend it was sent
/// to, so that `recvmsg` can show the VIP as the peer. Key of [`SOCK_REVERSE`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevKey {
    /// `bpf_get_socket_cookie()` of the client socket.
    pub cookie: u64,
    /// The backend's address (network order).
    pub addr: Addr,
    /// The backend's port (network order).
    pub port: u16,
    /// [`FAMILY_V4`] or [`FAMILY_V6`].
    pub family: u8,
    /// Always zero.
    pub pad: [u8; 5],
}

/// Socket-LB reverse map value: the VIP and service port the client addressed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevValue {
    /// The VIP (network order).
    pub addr: Addr,
    /// The service port (network order).
    pub port: u16,
    /// [`FAMILY_V4`] or [`FAMILY_V6`].
    pub family: u8,
    /// Always zero.
    pub pad: u8,
}

/// Traffic counters of one frontend or backend, one entry per CPU. Values of
/// [`SERVICE_STATS`] and [`BACKEND_STATS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrafficStats {
    /// New flows balanced (connections, UDP flows, socket-LB connects/datagrams).
    pub flows: u64,
    /// Packets translated by the tc/XDP programs.
    pub packets: u64,
    /// Bytes of those packets, from the start of the IP header.
    pub bytes: u64,
}

impl TrafficStats {
    /// Returns the field-wise sum, wrapping on overflow as the kernel counters do.
    #[must_use]
    pub const fn add(self, other: Self) -> Self {
        Self {
            flows: self.flows.wrapping_add(other.flows),
            packets: self.packets.wrapping_add(other.packets),
            bytes: self.bytes.wrapping_add(other.bytes),
        }
    }
}

/// Why a program refused or dropped a packet or connection; index into [`DROPS`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum DropReason {
    /// The service has no backend for new flows (refused).
    NoBackend = 0,
    /// The Maglev slot or the backend entry it names is missing (maps being
    /// rewritten, or a bug); the flow is refused.
    BackendMissing = 1,
    /// A packet to a VIP was too short or malformed to translate.
    Malformed = 2,
    /// A conntrack or reverse entry could not be stored (map full).
    MapFull = 3,
    /// A VIP packet for a port or protocol the service does not have.
    NoFrontend = 4,
    /// A new flow found its client port, and every other port it tried
    /// ([`NAT_PORT_TRIES`]), held towards its backend by other flows.
    NoNatPort = 5,
}

impl DropReason {
    /// Every reason, in index order.
    pub const ALL: [Self; 6] = [
        Self::NoBackend,
        Self::BackendMissing,
        Self::Malformed,
        Self::MapFull,
        Self::NoFrontend,
        Self::NoNatPort,
    ];

    /// The reason's label in metrics and `status`.
    #[must_use]
    pub const fn label(self) -> &'static str {
        match self {
            Self::NoBackend => "no_backend",
            Self::BackendMissing => "backend_missing",
            Self::Malformed => "malformed",
            Self::MapFull => "map_full",
            Self::NoFrontend => "no_frontend",
            Self::NoNatPort => "no_nat_port",
        }
    }
}

/// Number of slots in [`DROPS`].
pub const DROP_REASONS: u32 = DropReason::ALL.len() as u32;

// Map names: the contract between the `#[map]` statics in `agent-ebpf` and the loader.

/// `HashMap<ServiceKeyV4, ServiceValue>`: IPv4 frontends.
pub const SERVICES_V4: &str = "RUNE_SVC_V4";
/// `HashMap<ServiceKeyV6, ServiceValue>`: IPv6 frontends.
pub const SERVICES_V6: &str = "RUNE_SVC_V6";
/// `Array<Backend>` indexed by backend id.
pub const BACKENDS: &str = "RUNE_BACKENDS";
/// `Array<[u32; 2]>` (mmapable) of backend ids, two slots per element: every
/// frontend's Maglev table, at slot `ServiceValue::maglev_base`, `maglev_size` slots
/// long; slot `s` is `element[s / 2][s % 2]`. Pairs, because the kernel rounds array
/// values up to 8 bytes: a `u32` array would waste half its memory and break the
/// agent's contiguous mmapped view of the slots.
pub const MAGLEV: &str = "RUNE_MAGLEV";

/// Slots per element of [`MAGLEV`].
pub const MAGLEV_SLOTS_PER_ENTRY: u32 = 2;
/// `LruHashMap<CtKeyV4, CtValue>`: IPv4 conntrack of the tc/XDP path.
pub const CONNTRACK_V4: &str = "RUNE_CT_V4";
/// `LruHashMap<CtKeyV6, CtValue>`: IPv6 conntrack of the tc/XDP path.
pub const CONNTRACK_V6: &str = "RUNE_CT_V6";
/// `LruHashMap<CtKeyV4, CtReplyV4>`: IPv4 reply entries, keyed by the reply's tuple.
pub const CONNTRACK_REPLY_V4: &str = "RUNE_CT_REPLY_V4";
/// `LruHashMap<CtKeyV6, CtReplyV6>`: IPv6 reply entries, keyed by the reply's tuple.
pub const CONNTRACK_REPLY_V6: &str = "RUNE_CT_REPLY_V6";
/// `LruHashMap<AffinityKey, AffinityValue>`: ClientIP session affinity.
pub const AFFINITY: &str = "RUNE_AFFINITY";
/// `LruHashMap<SockRevKey, SockRevValue>`: unconnected-UDP reverse translation.
pub const SOCK_REVERSE: &str = "RUNE_SOCK_REV";
/// `Array<TrafficStats>` of per-frontend counters, one region per possible CPU
/// (CPU-major): CPU `c`'s counters of frontend `id` are at `c * per_cpu + id`, where
/// `per_cpu` is the global [`SERVICE_STATS_PER_CPU`] (the array's size divided by
/// the number of possible CPUs). Readers sum the regions.
pub const SERVICE_STATS: &str = "RUNE_SVC_STATS";
/// `Array<TrafficStats>` of per-backend counters, laid out as [`SERVICE_STATS`]
/// with [`BACKEND_STATS_PER_CPU`] entries per CPU.
pub const BACKEND_STATS: &str = "RUNE_BACKEND_STATS";
/// Global `u32` of the programs: entries per CPU of [`SERVICE_STATS`] (0: no counting).
pub const SERVICE_STATS_PER_CPU: &str = "RUNE_SVC_STATS_PER_CPU";
/// Global `u32` of the programs: entries per CPU of [`BACKEND_STATS`].
pub const BACKEND_STATS_PER_CPU: &str = "RUNE_BACKEND_STATS_PER_CPU";
/// `PerCpuArray<u64>` indexed by [`DropReason`].
pub const DROPS: &str = "RUNE_DROPS";

/// The slot of CPU `cpu`'s counters of id `id` in a counters array of `per_cpu`
/// entries per CPU ([`SERVICE_STATS`], [`BACKEND_STATS`]): regions CPU-major, so
/// `slot % per_cpu` is the id again. The one definition of the layout the programs
/// write and the agent reads.
#[inline(always)]
#[must_use]
pub const fn stats_slot(cpu: u32, per_cpu: u32, id: u32) -> u32 {
    cpu.wrapping_mul(per_cpu).wrapping_add(id)
}
/// `Array<u64>` of [`crate::filter::VIP_FILTER_WORDS`] words: the VIP prefilter
/// (a set bit: no frontend hashes there; see [`crate::filter`]).
pub const VIP_FILTER: &str = "RUNE_VIP_FILTER";

// Program names: the contract between `agent-ebpf` and the loader.

/// cgroup `connect4`: picks a backend for a TCP / connected-UDP IPv4 VIP connect.
pub const PROG_CONNECT4: &str = "rune_connect4";
/// cgroup `connect6`.
pub const PROG_CONNECT6: &str = "rune_connect6";
/// cgroup `sendmsg4`: per datagram for unconnected UDP.
pub const PROG_SENDMSG4: &str = "rune_sendmsg4";
/// cgroup `sendmsg6`.
pub const PROG_SENDMSG6: &str = "rune_sendmsg6";
/// cgroup `recvmsg4`: shows the VIP as the sender of a backend's reply.
pub const PROG_RECVMSG4: &str = "rune_recvmsg4";
/// cgroup `recvmsg6`.
pub const PROG_RECVMSG6: &str = "rune_recvmsg6";
/// cgroup `getpeername4`: returns the VIP as the connected peer.
pub const PROG_GETPEERNAME4: &str = "rune_getpeername4";
/// cgroup `getpeername6`.
pub const PROG_GETPEERNAME6: &str = "rune_getpeername6";
/// tc ingress: DNAT VIP → backend with conntrack.
pub const PROG_TC_INGRESS: &str = "rune_tc_ingress";
/// tc egress: reverse NAT backend → VIP for replies.
pub const PROG_TC_EGRESS: &str = "rune_tc_egress";
/// XDP on the uplink: DNAT VIP → backend, as `rune_tc_ingress`.
pub const PROG_XDP_LB: &str = "rune_xdp_lb";

const _: () = assert!(size_of::<ServiceKeyV4>() == 8);
const _: () = assert!(size_of::<ServiceKeyV6>() == 20);
const _: () = assert!(size_of::<ServiceValue>() == 16);
const _: () = assert!(size_of::<Backend>() == 20);
const _: () = assert!(size_of::<CtKeyV4>() == 16);
const _: () = assert!(size_of::<CtKeyV6>() == 40);
const _: () = assert!(size_of::<CtValue>() == 20);
const _: () = assert!(size_of::<CtReplyV4>() == 12);
const _: () = assert!(size_of::<CtReplyV6>() == 24);
const _: () = assert!(size_of::<AffinityKey>() == 20);
const _: () = assert!(size_of::<AffinityValue>() == 16);
const _: () = assert!(size_of::<SockRevKey>() == 32);
const _: () = assert!(size_of::<SockRevValue>() == 20);
const _: () = assert!(size_of::<TrafficStats>() == 24);

// SAFETY (all below): each type is `#[repr(C)]`, built only of integers and integer
// arrays, has no implicit padding (sizes checked above) and every bit pattern is a
// valid value.
#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for ServiceKeyV4 {}
    unsafe impl aya::Pod for ServiceKeyV6 {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for CtKeyV4 {}
    unsafe impl aya::Pod for CtKeyV6 {}
    unsafe impl aya::Pod for CtValue {}
    unsafe impl aya::Pod for CtReplyV4 {}
    unsafe impl aya::Pod for CtReplyV6 {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for SockRevKey {}
    unsafe impl aya::Pod for SockRevValue {}
    unsafe impl aya::Pod for TrafficStats {}
}

#[cfg(test)]
mod tests;
