//! Refused flows of the nftables policy, for `rune-agent observe`: the deny
//! chains log a packet to NFLOG group N (rate-limited in the kernel), and the
//! agent reads that group over netlink and publishes each packet as a
//! [`FlowVerdict`] to the same hub the eBPF ring buffer reader feeds.
//!
//! * The rule ([`log_rule`]) names the verdict in its prefix: direction, reason and
//!   mode in three letters, then `NAMESPACE/NAME` (or `#` and a digest of it when
//!   that exceeds the kernel's 127 bytes; the reader resolves the digest against
//!   the services it programmed).
//! * `limit rate` sits before `log` in the same rule, so past the rate the kernel
//!   skips the log (the verdict and its counter still apply): a flood costs the
//!   agent at most [`LOG_RATE_PER_SECOND`] events a second per service, direction
//!   and reason.
//! * NFLOG groups belong to a network namespace: agents in different namespaces
//!   can use the same group number. Within one namespace, one socket owns a group
//!   (a second bind fails with `EPERM`; measured on kernel 6.18).
//! * Events the socket could not queue (`ENOBUFS`: the receive buffer overran) are
//!   counted, as the eBPF mode counts ring buffer drops.
//!
//! Messages are encoded and parsed by `netlink-packet-netfilter` (the rust-netlink
//! project's NFLOG types) over a `netlink-sys` socket.

use crate::{
    model::{PolicyMode, ServiceKey},
    policy::{
        events::{FlowVerdict, hub},
        metrics::{Direction, DropReason},
    },
};
use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::{
    NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
    nflog::{ConfigCmd, ConfigMode, ConfigNla, PacketNla, Timeout, ULogMessage, config_request},
};
use netlink_sys::{Socket, constants::NETLINK_NETFILTER};
use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::io::unix::AsyncFd;
use tokio_util::sync::CancellationToken;

/// Logged packets per second each deny chain sends at most (burst twice that).
pub const LOG_RATE_PER_SECOND: u32 = 10;

/// Longest prefix the kernel keeps (`NF_LOG_PREFIXLEN` less its NUL).
const PREFIX_MAX: usize = 127;

/// Bytes of each packet the kernel copies: an IPv6 header and a TCP header's ports
/// with room to spare.
const COPY_RANGE: u32 = 96;

/// Receive buffer of the socket: a burst of every chain's limit fits.
const RECV_BUFFER: usize = 1 << 20;

/// The log rule of a deny chain: `key`'s `reason` in direction `d` under `mode`,
/// sent to NFLOG `group`.
pub fn log_rule(
    group: u16,
    d: Direction,
    reason: DropReason,
    mode: PolicyMode,
    key: &ServiceKey,
) -> String {
    format!(
        "limit rate {LOG_RATE_PER_SECOND}/second burst {} packets log prefix \"{}\" group {group}",
        2 * LOG_RATE_PER_SECOND,
        prefix(d, reason, mode, key)
    )
}

/// `DRM NAMESPACE/NAME`: direction (`i`/`o`), reason (`n`/`p`/`u`), mode
/// (`e`/`a`); `DRM #DIGEST` when that is too long.
fn prefix(d: Direction, reason: DropReason, mode: PolicyMode, key: &ServiceKey) -> String {
    let d = match d {
        Direction::Ingress => 'i',
        Direction::Egress => 'o',
    };
    let r = match reason {
        DropReason::NoMatchingRule => 'n',
        DropReason::PortNotAllowed => 'p',
        DropReason::PolicyUnprogrammable => 'u',
    };
    let m = match mode {
        PolicyMode::Enforce => 'e',
        PolicyMode::Audit => 'a',
    };
    let full = format!("{d}{r}{m} {}/{}", key.namespace, key.name);
    if full.len() <= PREFIX_MAX {
        full
    } else {
        format!("{d}{r}{m} #{}", digest(key))
    }
}

/// A stable digest of `key` (FNV-1a, 64 bits, hex) for prefixes that would not
/// fit otherwise.
pub fn digest(key: &ServiceKey) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.namespace.bytes().chain([b'/']).chain(key.name.bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// A prefix read back.
#[derive(Debug, PartialEq, Eq)]
struct Prefix {
    direction: Direction,
    reason: DropReason,
    audit: bool,
    /// `NAMESPACE/NAME`, or `#DIGEST`.
    service: String,
}

fn parse_prefix(s: &str) -> Option<Prefix> {
    let (code, service) = s.split_once(' ')?;
    let &[d, r, m] = code.as_bytes() else {
        return None;
    };
    Some(Prefix {
        direction: match d {
            b'i' => Direction::Ingress,
            b'o' => Direction::Egress,
            _ => return None,
        },
        reason: match r {
            b'n' => DropReason::NoMatchingRule,
            b'p' => DropReason::PortNotAllowed,
            b'u' => DropReason::PolicyUnprogrammable,
            _ => return None,
        },
        audit: match m {
            b'e' => false,
            b'a' => true,
            _ => return None,
        },
        service: service.to_owned(),
    })
}

/// Addresses, protocol and ports of a packet that starts at its IP header; ports
/// are 0 for protocols without them, for an IPv4 fragment after the first or a
/// header length below the minimum (no transport header there), and for a
/// truncated copy.
fn flow(payload: &[u8]) -> Option<(SocketAddr, SocketAddr, u8)> {
    let (src, dst, proto, l4): (IpAddr, IpAddr, u8, &[u8]) = match payload.first()? >> 4 {
        4 => {
            let ihl = usize::from(payload[0] & 0x0f) * 4;
            let src: [u8; 4] = payload.get(12..16)?.try_into().ok()?;
            let dst: [u8; 4] = payload.get(16..20)?.try_into().ok()?;
            let offset = u16::from_be_bytes([*payload.get(6)?, *payload.get(7)?]) & 0x1fff;
            let l4 = if ihl < 20 || offset != 0 {
                &[][..]
            } else {
                payload.get(ihl..).unwrap_or_default()
            };
            (
                Ipv4Addr::from(src).into(),
                Ipv4Addr::from(dst).into(),
                *payload.get(9)?,
                l4,
            )
        }
        6 => {
            let src: [u8; 16] = payload.get(8..24)?.try_into().ok()?;
            let dst: [u8; 16] = payload.get(24..40)?.try_into().ok()?;
            (
                Ipv6Addr::from(src).into(),
                Ipv6Addr::from(dst).into(),
                *payload.get(6)?,
                payload.get(40..).unwrap_or_default(),
            )
        }
        _ => return None,
    };
    let ports = match (proto, l4.get(0..4)) {
        (6 | 17, Some(p)) => (
            u16::from_be_bytes([p[0], p[1]]),
            u16::from_be_bytes([p[2], p[3]]),
        ),
        _ => (0, 0),
    };
    Some((
        SocketAddr::new(src, ports.0),
        SocketAddr::new(dst, ports.1),
        proto,
    ))
}

/// The event of one logged packet; `resolve` names the service of a digest.
fn describe(
    prefix: &str,
    payload: &[u8],
    resolve: &dyn Fn(&str) -> Option<ServiceKey>,
) -> Option<FlowVerdict> {
    let p = parse_prefix(prefix)?;
    let (source, destination, proto) = flow(payload)?;
    let service = match p.service.strip_prefix('#') {
        Some(digest) => resolve(digest)?,
        None => {
            let (namespace, name) = p.service.split_once('/')?;
            ServiceKey::new(namespace, name)
        }
    };
    Some(FlowVerdict {
        source: source.to_string(),
        destination: destination.to_string(),
        protocol: match proto {
            6 => "TCP".to_owned(),
            17 => "UDP".to_owned(),
            other => other.to_string(),
        },
        verdict: if p.audit { "audit" } else { "denied" },
        reason: p.reason.label(),
        direction: p.direction.label(),
        namespace: service.namespace,
        service: service.name,
    })
}

/// Sends one config request for `group` and waits for its acknowledgement.
fn configure(socket: &Socket, group: u16, nlas: Vec<ConfigNla>) -> io::Result<()> {
    let request = config_request(NetfilterProtoFamily::Unspec, group, nlas);
    let mut buf = vec![0; request.header.length as usize];
    request.serialize(&mut buf);
    socket.send(&buf, 0)?;
    let mut reply = Vec::with_capacity(4096);
    socket.recv(&mut reply, 0)?;
    let message = NetlinkMessage::<NetfilterMessage>::deserialize(&reply)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    match message.payload {
        NetlinkPayload::Error(e) if e.code.is_some() => Err(e.to_io()),
        _ => Ok(()),
    }
}

/// Binds NFLOG `group` in the calling thread's network namespace, copying each
/// packet's first [`COPY_RANGE`] bytes, delivered within 50 ms.
pub fn open(group: u16) -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.set_rx_buf_sz(RECV_BUFFER)?;
    configure(&socket, group, vec![ConfigCmd::Bind.into()])?;
    configure(
        &socket,
        group,
        vec![
            ConfigMode::new_packet(COPY_RANGE).into(),
            Timeout::from(Duration::from_millis(50)).into(),
        ],
    )?;
    socket.set_non_blocking(true)?;
    Ok(socket)
}

/// Reads `socket` until `cancel` fires, publishing every logged packet; `lost`
/// counts overruns (each lost one or more events); `resolve` names the service
/// of a digest prefix.
pub async fn read(
    socket: Socket,
    resolve: impl Fn(&str) -> Option<ServiceKey> + Send + 'static,
    lost: Arc<AtomicU64>,
    cancel: CancellationToken,
) {
    // SAFETY: the socket owns its descriptor for as long as it lives, and
    // `as_raw_fd` returns that same descriptor.
    let fd = match unsafe { AsyncFd::register(socket) } {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!(error = %e, "policy nflog: cannot poll the socket; observe shows nothing");
            return;
        }
    };
    let mut buf = Vec::with_capacity(1 << 16);
    loop {
        let mut guard = tokio::select! {
            () = cancel.cancelled() => return,
            ready = fd.readable() => match ready {
                Ok(guard) => guard,
                Err(e) => {
                    tracing::warn!(error = %e, "policy nflog: polling failed");
                    return;
                }
            },
        };
        loop {
            buf.clear();
            match fd.get_ref().recv(&mut buf, 0) {
                Ok(_) => publish(&buf, &resolve),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    guard.clear_ready();
                    break;
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    lost.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "policy nflog: reading failed");
                    return;
                }
            }
        }
    }
}

/// Publishes the logged packets of one datagram (one or more messages).
fn publish(mut bytes: &[u8], resolve: &dyn Fn(&str) -> Option<ServiceKey>) {
    while !bytes.is_empty() {
        let Ok(message) = NetlinkMessage::<NetfilterMessage>::deserialize(bytes) else {
            return;
        };
        let len = (message.header.length as usize).next_multiple_of(4);
        if let NetlinkPayload::InnerMessage(NetfilterMessage {
            inner: NetfilterMessageInner::ULog(ULogMessage::Packet(nlas)),
            ..
        }) = &message.payload
        {
            let prefix = nlas.iter().find_map(|n| match n {
                PacketNla::Prefix(p) => p.to_str().ok(),
                _ => None,
            });
            let payload = nlas.iter().find_map(|n| match n {
                PacketNla::Payload(p) => Some(p.as_slice()),
                _ => None,
            });
            if let (Some(prefix), Some(payload)) = (prefix, payload)
                && hub().receiver_count() > 0
                && let Some(event) = describe(prefix, payload, resolve)
            {
                // No receiver is not an error: nobody observes.
                let _ = hub().send(event);
            }
        }
        if len == 0 || len > bytes.len() {
            return;
        }
        bytes = &bytes[len..];
    }
}

#[cfg(test)]
mod tests;
