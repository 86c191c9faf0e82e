//! Socket-level load balancing: cgroup v2 `sock_addr` programs.
//!
//! A TCP or UDP socket of a process in the cgroup that addresses a VIP is pointed at
//! a backend before any packet exists: `connect` (TCP, connected UDP) and `sendmsg`
//! (unconnected UDP, per datagram) rewrite the destination; `recvmsg` and
//! `getpeername` rewrite the backend back to the VIP, so the application only ever
//! sees the address it asked for. The backend choice is the shared one
//! ([`crate::select::pick_backend`]).
//!
//! * Hash: `bpf_get_prandom_u32()`; the source port is not known at connect time.
//! * ClientIP affinity: the "client address" is the socket's network-namespace cookie
//!   (`bpf_get_netns_cookie`), spread into an [`Addr`] by [`netns_client`]. Affinity
//!   in socket LB is therefore per client network namespace (a pod), as Cilium does:
//!   every socket of that namespace sticks to the same backend.
//! * Every rewrite stores a `RUNE_SOCK_REV` entry {socket cookie, backend} → VIP, which
//!   `recvmsg` and `getpeername` read. The map is an LRU; entries are not removed
//!   when sockets close (there is no close hook here), LRU eviction recycles them.
//! * A known frontend with no backend for new flows, or whose Maglev slot names a
//!   missing backend (or one of the other address family), refuses the `connect` /
//!   `sendmsg` (the program returns 0: the syscall fails with `EPERM`) and counts
//!   the reason in `RUNE_DROPS`.
//! * An IPv4-mapped destination (`::ffff:a.b.c.d`) on an IPv6 socket is looked up in
//!   the IPv4 frontends and rewritten to the IPv4-mapped backend. (For unconnected UDP
//!   the kernel runs `sendmsg4` for such destinations, never `sendmsg6`.) Reverse
//!   entries of mapped addresses are stored as IPv4, so both families find them.
//!
//! Byte order: `user_ip4`, `user_ip6` and `user_port` hold network-order values, as the
//! maps do (the port in the low 16 bits of the 32-bit field, i.e. the first two
//! bytes in memory), so they are copied and compared raw. The context is read and
//! written with volatile 32-bit accesses: the verifier accepts only 4-byte writes to
//! these fields, and this keeps LLVM from merging or narrowing the accesses.

use core::ptr::{addr_of, addr_of_mut, read_volatile, write_volatile};

use agent_common::lb::{
    Addr, Backend, DropReason, FAMILY_V4, FAMILY_V6, PROTO_TCP, PROTO_UDP, ServiceKeyV4,
    ServiceKeyV6, ServiceValue, SockRevKey, SockRevValue,
};
use aya_ebpf::{
    EbpfContext as _,
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};

use crate::{
    maps::{RUNE_SOCK_REV, RUNE_SVC_V4, RUNE_SVC_V6},
    select::{count_drop, count_flow, pick_backend},
};

/// Return value letting the syscall proceed (with the rewritten address, if any).
const ALLOW: i32 = 1;
/// Return value refusing `connect` / `sendmsg`: the syscall fails with `EPERM`.
const REFUSE: i32 = 0;

/// Word 2 of an IPv4-mapped IPv6 address (`::ffff:0:0/96`), network order.
const V4_MAPPED_WORD2: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

/// Word 3 of a netns affinity "address" ([`netns_client`]): no real IPv4 client
/// (words 1–3 zero) can equal one.
const NETNS_CLIENT_MARK: u32 = u32::from_ne_bytes(*b"rune");

#[cgroup_sock_addr(connect4)]
pub fn rune_connect4(ctx: SockAddrContext) -> i32 {
    verdict(try_forward4(&ctx))
}

#[cgroup_sock_addr(connect6)]
pub fn rune_connect6(ctx: SockAddrContext) -> i32 {
    verdict(try_forward6(&ctx))
}

#[cgroup_sock_addr(sendmsg4)]
pub fn rune_sendmsg4(ctx: SockAddrContext) -> i32 {
    verdict(try_forward4(&ctx))
}

#[cgroup_sock_addr(sendmsg6)]
pub fn rune_sendmsg6(ctx: SockAddrContext) -> i32 {
    verdict(try_forward6(&ctx))
}

// `recvmsg` and `getpeername` programs must return 1 (the verifier enforces it):
// the reverse translation either finds an entry or leaves the address alone.

#[cgroup_sock_addr(recvmsg4)]
pub fn rune_recvmsg4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx);
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn rune_recvmsg6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx);
    ALLOW
}

#[cgroup_sock_addr(getpeername4)]
pub fn rune_getpeername4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx);
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn rune_getpeername6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx);
    ALLOW
}

/// Maps a forward translation's outcome to the program's return value, counting
/// a refusal.
#[inline(always)]
fn verdict(result: Result<(), DropReason>) -> i32 {
    match result {
        Ok(()) => ALLOW,
        Err(reason) => {
            count_drop(reason);
            REFUSE
        }
    }
}

/// `connect4` / `sendmsg4`: an IPv4 VIP destination becomes a backend.
#[inline(always)]
fn try_forward4(ctx: &SockAddrContext) -> Result<(), DropReason> {
    let sa = ctx.sock_addr;
    let Some(proto) = l4_proto(sa) else {
        return Ok(());
    };
    let vip = read_ip4(sa);
    let port = read_port(sa);
    let key = ServiceKeyV4 {
        addr: vip,
        port,
        proto,
        pad: 0,
    };
    // SAFETY: the value is copied out at once; the agent replaces entries whole.
    let Some(svc) = (unsafe { RUNE_SVC_V4.get(key) }).copied() else {
        return Ok(());
    };
    let (id, backend) = choose(ctx, &svc, FAMILY_V4)?;
    write_ip4(sa, backend.addr[0]);
    write_port(sa, backend.port);
    count_flow(svc.id, id);
    remember(ctx, &backend, [vip, 0, 0, 0], port, FAMILY_V4);
    Ok(())
}

/// `connect6` / `sendmsg6`: an IPv6 VIP destination (or an IPv4-mapped IPv4 VIP)
/// becomes a backend.
#[inline(always)]
fn try_forward6(ctx: &SockAddrContext) -> Result<(), DropReason> {
    let sa = ctx.sock_addr;
    let Some(proto) = l4_proto(sa) else {
        return Ok(());
    };
    let vip = read_ip6(sa);
    let port = read_port(sa);
    if is_v4_mapped(&vip) {
        let key = ServiceKeyV4 {
            addr: vip[3],
            port,
            proto,
            pad: 0,
        };
        // SAFETY: as in `try_forward4`.
        let Some(svc) = (unsafe { RUNE_SVC_V4.get(key) }).copied() else {
            return Ok(());
        };
        let (id, backend) = choose(ctx, &svc, FAMILY_V4)?;
        // SAFETY: `sa` is the program's context; word 3 of `user_ip6` is writable.
        unsafe { write_volatile(addr_of_mut!((*sa).user_ip6[3]), backend.addr[0]) };
        write_port(sa, backend.port);
        count_flow(svc.id, id);
        remember(ctx, &backend, [vip[3], 0, 0, 0], port, FAMILY_V4);
        return Ok(());
    }
    let key = ServiceKeyV6 {
        addr: vip,
        port,
        proto,
        pad: 0,
    };
    // SAFETY: as in `try_forward4`.
    let Some(svc) = (unsafe { RUNE_SVC_V6.get(key) }).copied() else {
        return Ok(());
    };
    let (id, backend) = choose(ctx, &svc, FAMILY_V6)?;
    write_ip6(sa, &backend.addr);
    write_port(sa, backend.port);
    count_flow(svc.id, id);
    remember(ctx, &backend, vip, port, FAMILY_V6);
    Ok(())
}

/// Picks a backend of `family` for a new socket flow of `svc`.
#[inline(always)]
fn choose(
    ctx: &SockAddrContext,
    svc: &ServiceValue,
    family: u8,
) -> Result<(u32, Backend), DropReason> {
    let client = netns_client(ctx);
    // SAFETY: a helper without arguments or preconditions.
    let hash = unsafe { bpf_get_prandom_u32() };
    let (id, backend) = pick_backend(svc, &client, hash)?;
    if backend.family != family {
        // A table naming a backend of the other family is a bug in the maps: refuse
        // rather than hand the socket an address it cannot connect to.
        return Err(DropReason::BackendMissing);
    }
    Ok((id, backend))
}

/// The affinity "client address" of a socket: its network namespace's cookie in
/// words 0–1, zero in word 2 and [`NETNS_CLIENT_MARK`] in word 3.
#[inline(always)]
fn netns_client(ctx: &SockAddrContext) -> Addr {
    // SAFETY: the helper accepts a `bpf_sock_addr` context.
    let cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    [cookie as u32, (cookie >> 32) as u32, 0, NETNS_CLIENT_MARK]
}

/// Stores the reverse entry {socket, backend} → {VIP, port}; a full map counts
/// [`DropReason::MapFull`] but lets the flow go on (only the VIP disguise is lost).
#[inline(always)]
fn remember(ctx: &SockAddrContext, backend: &Backend, vip: Addr, port: u16, family: u8) {
    let key = SockRevKey {
        cookie: socket_cookie(ctx),
        addr: backend.addr,
        port: backend.port,
        family,
        pad: [0; 5],
    };
    let value = SockRevValue {
        addr: vip,
        port,
        family,
        pad: 0,
    };
    if RUNE_SOCK_REV.insert(key, value, 0).is_err() {
        count_drop(DropReason::MapFull);
    }
}

/// The reverse entry for a peer `addr`:`port` of this socket.
#[inline(always)]
fn lookup_reverse(
    ctx: &SockAddrContext,
    addr: Addr,
    port: u16,
    family: u8,
) -> Option<SockRevValue> {
    let key = SockRevKey {
        cookie: socket_cookie(ctx),
        addr,
        port,
        family,
        pad: [0; 5],
    };
    // SAFETY: the value is copied out at once.
    let value = (unsafe { RUNE_SOCK_REV.get(key) }).copied()?;
    (value.family == family).then_some(value)
}

/// `recvmsg4` / `getpeername4`: a backend peer shows as the VIP it stands for.
#[inline(always)]
fn reverse4(ctx: &SockAddrContext) {
    let sa = ctx.sock_addr;
    let peer = read_ip4(sa);
    let port = read_port(sa);
    if let Some(vip) = lookup_reverse(ctx, [peer, 0, 0, 0], port, FAMILY_V4) {
        write_ip4(sa, vip.addr[0]);
        write_port(sa, vip.port);
    }
}

/// `recvmsg6` / `getpeername6`: as [`reverse4`], also for IPv4-mapped peers.
#[inline(always)]
fn reverse6(ctx: &SockAddrContext) {
    let sa = ctx.sock_addr;
    let peer = read_ip6(sa);
    let port = read_port(sa);
    if is_v4_mapped(&peer) {
        if let Some(vip) = lookup_reverse(ctx, [peer[3], 0, 0, 0], port, FAMILY_V4) {
            // SAFETY: `sa` is the program's context; word 3 of `user_ip6` is writable.
            unsafe { write_volatile(addr_of_mut!((*sa).user_ip6[3]), vip.addr[0]) };
            write_port(sa, vip.port);
        }
    } else if let Some(vip) = lookup_reverse(ctx, peer, port, FAMILY_V6) {
        write_ip6(sa, &vip.addr);
        write_port(sa, vip.port);
    }
}

/// The socket's L4 protocol if it is one the load balancer handles.
#[inline(always)]
fn l4_proto(sa: *mut bpf_sock_addr) -> Option<u8> {
    // SAFETY: `sa` is the program's context; `protocol` is readable in every hook.
    let protocol = unsafe { read_volatile(addr_of!((*sa).protocol)) };
    match protocol {
        p if p == u32::from(PROTO_TCP) => Some(PROTO_TCP),
        p if p == u32::from(PROTO_UDP) => Some(PROTO_UDP),
        _ => None,
    }
}

#[inline(always)]
fn socket_cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: the helper accepts a `bpf_sock_addr` context.
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}

#[inline(always)]
fn is_v4_mapped(addr: &Addr) -> bool {
    addr[0] == 0 && addr[1] == 0 && addr[2] == V4_MAPPED_WORD2
}

// Context accessors. SAFETY (all): `sa` is the program's context pointer and these
// fields are readable, and writable with 4-byte stores, in every sock_addr hook
// these programs attach to.

#[inline(always)]
fn read_ip4(sa: *mut bpf_sock_addr) -> u32 {
    unsafe { read_volatile(addr_of!((*sa).user_ip4)) }
}

#[inline(always)]
fn write_ip4(sa: *mut bpf_sock_addr, addr: u32) {
    unsafe { write_volatile(addr_of_mut!((*sa).user_ip4), addr) }
}

#[inline(always)]
fn read_ip6(sa: *mut bpf_sock_addr) -> Addr {
    unsafe {
        [
            read_volatile(addr_of!((*sa).user_ip6[0])),
            read_volatile(addr_of!((*sa).user_ip6[1])),
            read_volatile(addr_of!((*sa).user_ip6[2])),
            read_volatile(addr_of!((*sa).user_ip6[3])),
        ]
    }
}

#[inline(always)]
fn write_ip6(sa: *mut bpf_sock_addr, addr: &Addr) {
    unsafe {
        write_volatile(addr_of_mut!((*sa).user_ip6[0]), addr[0]);
        write_volatile(addr_of_mut!((*sa).user_ip6[1]), addr[1]);
        write_volatile(addr_of_mut!((*sa).user_ip6[2]), addr[2]);
        write_volatile(addr_of_mut!((*sa).user_ip6[3]), addr[3]);
    }
}

/// The port, network order (the low 16 bits of `user_port` as a little-endian
/// load: the field's first two bytes).
#[inline(always)]
fn read_port(sa: *mut bpf_sock_addr) -> u16 {
    unsafe { read_volatile(addr_of!((*sa).user_port)) as u16 }
}

#[inline(always)]
fn write_port(sa: *mut bpf_sock_addr, port: u16) {
    unsafe { write_volatile(addr_of_mut!((*sa).user_port), u32::from(port)) }
}
