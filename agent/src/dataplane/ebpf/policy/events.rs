//! Reads the policy programs' verdict events from their ring buffer and publishes
//! them, with the service they were counted under, to `crate::policy::events::hub`.

use super::{maps::PolicyMaps, sync::INGRESS};
use crate::{
    lock::lock,
    policy::events::{FlowVerdict, hub},
};
use agent_common::{
    lb::{FAMILY_V4, PROTO_TCP, PROTO_UDP, addr_octets},
    policy::{Verdict, VerdictEvent},
};
use aya::maps::{MapData, RingBuf};
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, Mutex},
};
use tokio::io::{Interest, unix::AsyncFd};
use tokio_util::sync::CancellationToken;

/// Drains `ring` whenever it has data until `cancel` fires, publishing each event
/// with the service `engine`'s counters name.
pub async fn read<P: PolicyMaps + 'static>(
    ring: RingBuf<MapData>,
    engine: Arc<Mutex<super::PolicyEngine<P>>>,
    cancel: CancellationToken,
) {
    // SAFETY: the ring buffer owns its map's fd for as long as it lives, and
    // `as_raw_fd` returns that same fd.
    let registered = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) };
    let Ok(mut fd) = registered else {
        tracing::warn!("policy verdict events: cannot poll the ring buffer; observe shows nothing");
        return;
    };
    loop {
        let mut guard = tokio::select! {
            () = cancel.cancelled() => return,
            ready = fd.readable_mut() => match ready {
                Ok(guard) => guard,
                Err(e) => {
                    tracing::warn!(error = %e, "policy verdict events: polling failed");
                    return;
                }
            },
        };
        let ring = guard.get_inner_mut();
        let mut events = Vec::new();
        while let Some(item) = ring.next() {
            if item.len() >= size_of::<VerdictEvent>() {
                // SAFETY: the buffer holds at least one `VerdictEvent`, a plain
                // `repr(C)` struct of integers; read unaligned.
                events.push(unsafe {
                    std::ptr::read_unaligned(item.as_ptr().cast::<VerdictEvent>())
                });
            }
        }
        guard.clear_ready();
        if events.is_empty() || hub().receiver_count() == 0 {
            continue;
        }
        let engine = lock(&engine);
        for e in events {
            let service = engine
                .sync()
                .counters()
                .iter()
                .find(|(_, id)| **id == e.counter)
                .map(|((service, _), _)| service.clone());
            if let Some(service) = service {
                // No receiver is not an error: nobody observes.
                let _ = hub().send(describe(&e, service.namespace, service.name));
            }
        }
    }
}

/// The event as `observe` shows it.
fn describe(e: &VerdictEvent, namespace: String, service: String) -> FlowVerdict {
    let addr = |a| -> IpAddr {
        let octets = addr_octets(a);
        if e.family == FAMILY_V4 {
            Ipv4Addr::new(octets[0], octets[1], octets[2], octets[3]).into()
        } else {
            Ipv6Addr::from(octets).into()
        }
    };
    let verdict = Verdict::ALL
        .into_iter()
        .find(|v| *v as u8 == e.verdict)
        .unwrap_or(Verdict::DropNoMatchingRule);
    FlowVerdict {
        source: SocketAddr::new(addr(&e.saddr), u16::from_be(e.sport)).to_string(),
        destination: SocketAddr::new(addr(&e.daddr), u16::from_be(e.dport)).to_string(),
        protocol: match e.proto {
            PROTO_TCP => "TCP".to_owned(),
            PROTO_UDP => "UDP".to_owned(),
            other => other.to_string(),
        },
        verdict: if verdict.dropped() { "denied" } else { "audit" },
        reason: verdict.reason().unwrap_or("no_matching_rule"),
        direction: if e.dir == INGRESS {
            "ingress"
        } else {
            "egress"
        },
        namespace,
        service,
    }
}
