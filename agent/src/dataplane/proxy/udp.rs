//! The UDP side of the proxy: one flow per client address, each with its own socket
//! connected to the backend chosen for it, replies sent back from the service socket.

use super::{backends::PortShared, policy_gate::PolicyGate};
use crate::model::Protocol;
use std::{
    collections::HashMap,
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::{net::UdpSocket, time::Instant};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// The largest UDP payload.
const MAX_DATAGRAM: usize = 65_536;

thread_local! {
    /// The reply buffer of the flows running on this thread.
    static REPLY_BUF: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; MAX_DATAGRAM]);
}

/// Flow limits of a UDP port.
#[derive(Clone, Copy)]
pub(super) struct UdpLimits {
    pub(super) idle: Duration,
    pub(super) max_flows: usize,
}

struct Flow {
    sock: Arc<UdpSocket>,
    /// Milliseconds since the port's epoch at the last datagram either way.
    last: Arc<AtomicU64>,
    /// Cancelled when the flow task has ended (idle, error, stop).
    done: CancellationToken,
}

fn millis(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Relays datagrams until `stop`. Flows are children of `stop`: a UDP port has no
/// connection to leave open, so its flows end with it.
pub(super) async fn serve(
    sock: UdpSocket,
    port: Arc<PortShared>,
    policy: Arc<PolicyGate>,
    limits: UdpLimits,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    let sock = Arc::new(sock);
    let epoch = Instant::now();
    let mut flows: HashMap<SocketAddr, Flow> = HashMap::new();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let received = tokio::select! {
            _ = stop.cancelled() => return,
            r = sock.recv_from(&mut buf) => r,
        };
        let (n, peer) = match received {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(service = %port.service, error = %e, "udp receive failed");
                continue;
            }
        };
        let live = flows.get(&peer).is_some_and(|f| !f.done.is_cancelled());
        if !live {
            if flows.len() >= limits.max_flows {
                flows.retain(|_, f| !f.done.is_cancelled());
            }
            if flows.len() >= limits.max_flows && !flows.contains_key(&peer) {
                port.m.flow_limit.inc();
                continue;
            }
            match open_flow(&sock, peer, &port, &policy, limits, epoch, &stop, &tracker).await {
                Some(f) => {
                    flows.insert(peer, f);
                }
                None => {
                    flows.remove(&peer);
                    continue;
                }
            }
        }
        let Some(flow) = flows.get(&peer) else {
            continue;
        };
        flow.last.store(millis(epoch), Ordering::Relaxed);
        // Never wait on one flow's full send buffer: every client of the port would
        // wait behind it. The datagram is dropped, as a congested network would.
        match flow.sock.try_send(&buf[..n]) {
            Ok(sent) => {
                port.m.to_backend.inc_by(sent as u64);
            }
            Err(e) => tracing::debug!(service = %port.service, error = %e, "udp datagram dropped"),
        }
    }
}

#[expect(
    clippy::too_many_arguments,
    reason = "the serve loop's state, passed as it is; a struct would only rename it"
)]
async fn open_flow(
    service: &Arc<UdpSocket>,
    peer: SocketAddr,
    port: &Arc<PortShared>,
    policy: &PolicyGate,
    limits: UdpLimits,
    epoch: Instant,
    stop: &CancellationToken,
    tracker: &TaskTracker,
) -> Option<Flow> {
    let Some(backend) = port.pick(peer) else {
        port.m.no_backend.inc();
        return None;
    };
    if !policy.admit(peer.ip(), backend, Protocol::Udp) {
        return None;
    }
    let any = match backend.ip() {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let sock = match UdpSocket::bind((any, 0)).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(service = %port.service, error = %e, "cannot open a udp flow socket");
            port.m.dial_error.inc();
            return None;
        }
    };
    if let Err(e) = sock.connect(backend).await {
        tracing::debug!(service = %port.service, %backend, error = %e, "udp connect failed");
        port.m.dial_error.inc();
        return None;
    }
    // A new socket's readiness is unknown to tokio until the driver reports it; the
    // relay uses `try_send`, so learn it once here (a fresh socket is writable).
    if let Err(e) = sock.writable().await {
        tracing::debug!(service = %port.service, %backend, error = %e, "udp socket not writable");
        port.m.dial_error.inc();
        return None;
    }
    port.m.ok.inc();
    let drained = port.drain_token(backend);
    let flow = Flow {
        sock: Arc::new(sock),
        last: Arc::new(AtomicU64::new(millis(epoch))),
        done: stop.child_token(),
    };
    tracker.spawn(replies(
        flow.sock.clone(),
        service.clone(),
        peer,
        port.clone(),
        flow.last.clone(),
        epoch,
        limits.idle,
        flow.done.clone(),
        drained,
    ));
    Some(flow)
}

/// Relays the backend's replies to the client until the flow is idle for `idle`, the
/// backend refuses (ICMP unreachable), its drain time is over (`drained`), or `done`
/// is cancelled. The client's next datagram then opens a new flow.
#[expect(
    clippy::too_many_arguments,
    reason = "a task entry point: its state, spelled out"
)]
async fn replies(
    backend: Arc<UdpSocket>,
    service: Arc<UdpSocket>,
    peer: SocketAddr,
    port: Arc<PortShared>,
    last: Arc<AtomicU64>,
    epoch: Instant,
    idle: Duration,
    done: CancellationToken,
    drained: CancellationToken,
) {
    let _ended = done.clone().drop_guard();
    loop {
        let deadline = epoch + Duration::from_millis(last.load(Ordering::Relaxed)) + idle;
        if deadline <= Instant::now() {
            return;
        }
        tokio::select! {
            _ = done.cancelled() => return,
            _ = drained.cancelled() => return,
            _ = tokio::time::sleep_until(deadline) => continue,
            r = backend.readable() => if let Err(e) = r {
                tracing::debug!(service = %port.service, error = %e, "udp flow failed");
                return;
            },
        }
        // One buffer per worker thread, used without an await in between: idle flows
        // hold no buffer and no datagram pays for zeroing 64 KiB.
        let relayed = REPLY_BUF.with_borrow_mut(|buf| match backend.try_recv(buf) {
            Ok(n) => {
                last.store(millis(epoch), Ordering::Relaxed);
                match service.try_send_to(&buf[..n], peer) {
                    Ok(sent) => {
                        port.m.to_client.inc_by(sent as u64);
                    }
                    // A full send buffer drops the datagram, as the network would.
                    Err(e) => tracing::debug!(service = %port.service, error = %e,
                        "udp reply dropped"),
                }
                Ok(())
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(e),
        });
        if let Err(e) = relayed {
            // The backend is gone (connection refused): the next datagram from this
            // client opens a new flow to a live backend.
            tracing::debug!(service = %port.service, error = %e, "udp flow ended");
            return;
        }
    }
}
