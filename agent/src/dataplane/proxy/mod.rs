//! The userspace data plane: a TCP listener or UDP socket per service port, relaying
//! to a backend chosen by Maglev over the service's ready endpoints.
//!
//! Used in dev mode (on 127.0.0.1, ports shifted by `--dev-port-offset`) and as the
//! last-resort fallback in production. Applies swap each port's backend set in place:
//! listeners keep running, connections already open are never cut by an apply, and
//! a port that cannot be bound is reported (and retried) without stopping the others.

mod backends;
mod tcp;
mod udp;

#[cfg(test)]
mod tests;

use self::backends::{Backends, PortShared};
use crate::{
    dataplane::{DataPlane, DataPlaneError, PortState, ServicePortStatus},
    endpoints::{Delta, ServiceView},
    maglev::{self, Maglev},
    metrics::{Metrics, ServicePortLabels},
    model::{Protocol, ServiceKey, ServicePort},
    sync::lock,
};
use async_trait::async_trait;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::net::{TcpSocket, UdpSocket};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// How long after a port was freed failed binds are retried (its listener task
/// needs a moment to end and close the socket).
const RETRY_SOON_AFTER: Duration = Duration::from_millis(50);

/// Where the proxy listens.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ListenOn {
    /// 127.0.0.1 (dev mode).
    Loopback,
    /// One given address (e.g. another loopback address, or a node address).
    Address(IpAddr),
}

impl ListenOn {
    fn ip(&self) -> IpAddr {
        match self {
            ListenOn::Loopback => IpAddr::V4(Ipv4Addr::LOCALHOST),
            ListenOn::Address(a) => *a,
        }
    }
}

/// How the userspace proxy runs.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// The address listeners bind.
    pub listen: ListenOn,
    /// Added to every service port (dev mode's `--dev-port-offset`), so that services
    /// on privileged ports can be proxied without root.
    pub port_offset: u16,
    /// This node's name: endpoints with the same `node` are local.
    pub node_name: String,
    /// Maglev table size per service port (a prime).
    pub maglev_table_size: u32,
    /// A UDP flow idle this long is forgotten; its client's next datagram may go to
    /// another backend.
    pub udp_idle_timeout: Duration,
    /// At most this many UDP flows per service port; further new flows are refused
    /// (counted with `result="flow_limit"`).
    pub max_udp_flows: usize,
    /// How often ports that failed to bind are retried between applies.
    pub bind_retry_interval: Duration,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            listen: ListenOn::Loopback,
            port_offset: 0,
            node_name: String::new(),
            maglev_table_size: maglev::DEFAULT_TABLE_SIZE,
            udp_idle_timeout: Duration::from_secs(60),
            max_udp_flows: 4096,
            bind_retry_interval: Duration::from_secs(3),
        }
    }
}

/// The userspace proxy data plane (mode `userspace`).
pub struct UserspaceProxy {
    inner: Arc<Inner>,
}

struct Inner {
    config: ProxyConfig,
    metrics: Arc<Metrics>,
    state: Mutex<State>,
    /// Cancelled on shutdown: ends every task (listeners are children of it).
    cancel: CancellationToken,
    /// Wakes the bind retry loop early (a port was freed).
    retry_soon: tokio::sync::Notify,
    tracker: TaskTracker,
}

#[derive(Default)]
struct State {
    services: BTreeMap<ServiceKey, BTreeMap<(u16, Protocol), PortEntry>>,
    retrying: bool,
    shut_down: bool,
}

struct PortEntry {
    shared: Arc<PortShared>,
    /// `None` when port + offset is above 65535.
    listen: Option<SocketAddr>,
    listener: Listener,
    labels: ServicePortLabels,
}

enum Listener {
    Running(CancellationToken),
    Failed(String),
}

impl UserspaceProxy {
    /// A proxy with nothing to serve yet; listeners start on the first
    /// [`apply`](DataPlane::apply).
    pub fn new(config: ProxyConfig, metrics: Arc<Metrics>) -> Result<Self, DataPlaneError> {
        if let Err(e) = Maglev::new(&[], config.maglev_table_size) {
            return Err(DataPlaneError::InvalidConfig {
                field: "maglev_table_size",
                reason: e.to_string(),
            });
        }
        if config.max_udp_flows == 0 {
            return Err(DataPlaneError::InvalidConfig {
                field: "max_udp_flows",
                reason: "must be at least 1".into(),
            });
        }
        if config.udp_idle_timeout.is_zero() || config.bind_retry_interval.is_zero() {
            return Err(DataPlaneError::InvalidConfig {
                field: "udp_idle_timeout / bind_retry_interval",
                reason: "must be longer than zero".into(),
            });
        }
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                metrics,
                state: Mutex::new(State::default()),
                cancel: CancellationToken::new(),
                retry_soon: tokio::sync::Notify::new(),
                tracker: TaskTracker::new(),
            }),
        })
    }
}

impl Inner {
    fn upsert(&self, st: &mut State, view: &ServiceView) {
        let key = view.key();
        let service = key.to_string();
        let spec = &view.service.spec;
        let wanted: BTreeMap<(u16, Protocol), &ServicePort> = if spec.discovery.headless {
            BTreeMap::new()
        } else {
            spec.ports
                .iter()
                .map(|p| ((p.port, p.protocol), p))
                .collect()
        };
        let ports = st.services.entry(key.clone()).or_default();
        let gone: Vec<_> = ports
            .keys()
            .filter(|k| !wanted.contains_key(k))
            .copied()
            .collect();
        for k in gone {
            if let Some(e) = ports.remove(&k) {
                self.stop(e);
            }
        }
        let (node, size) = (&self.config.node_name, self.config.maglev_table_size);
        for (k, p) in wanted {
            if let Some(e) = ports.get_mut(&k) {
                let prev = e.shared.backends();
                e.shared
                    .set_backends(Backends::build(view, p, node, size, Some(&prev)));
                if matches!(e.listener, Listener::Failed(_)) {
                    self.start(e, p.protocol);
                }
                continue;
            }
            let backends = Backends::build(view, p, node, size, None);
            let shared = Arc::new(PortShared::new(
                service.clone(),
                p.protocol,
                backends,
                &self.metrics,
                self.tracker.clone(),
                self.cancel.clone(),
            ));
            let offset = u32::from(p.port) + u32::from(self.config.port_offset);
            let listen = u16::try_from(offset)
                .ok()
                .map(|port| SocketAddr::new(self.config.listen.ip(), port));
            let mut e = PortEntry {
                shared,
                listen,
                listener: Listener::Failed(format!(
                    "port {} + offset {} = {offset} is above 65535",
                    p.port, self.config.port_offset
                )),
                labels: ServicePortLabels {
                    service: service.clone(),
                    port: p.port,
                    protocol: p.protocol.as_str().to_owned(),
                },
            };
            self.start(&mut e, p.protocol);
            ports.insert(k, e);
        }
        if ports.is_empty() {
            st.services.remove(&key);
        }
    }

    /// Binds the port's listener and starts its task; on failure records why.
    fn start(&self, e: &mut PortEntry, protocol: Protocol) {
        let Some(addr) = e.listen else {
            self.metrics
                .proxy_listener_up
                .get_or_create(&e.labels)
                .set(0);
            return;
        };
        let stop = self.cancel.child_token();
        let started = match protocol {
            Protocol::Tcp => bind_tcp(addr).map(|l| {
                self.tracker.spawn(tcp::serve(
                    l,
                    e.shared.clone(),
                    stop.clone(),
                    self.cancel.clone(),
                    self.tracker.clone(),
                ));
            }),
            Protocol::Udp => bind_udp(addr).map(|s| {
                let limits = udp::UdpLimits {
                    idle: self.config.udp_idle_timeout,
                    max_flows: self.config.max_udp_flows,
                };
                self.tracker.spawn(udp::serve(
                    s,
                    e.shared.clone(),
                    limits,
                    stop.clone(),
                    self.tracker.clone(),
                ));
            }),
        };
        let gauge = self.metrics.proxy_listener_up.get_or_create(&e.labels);
        match started {
            Ok(()) => {
                gauge.set(1);
                if matches!(e.listener, Listener::Failed(_)) {
                    tracing::info!(service = %e.shared.service, %addr, %protocol, "listening");
                }
                e.listener = Listener::Running(stop);
            }
            Err(err) => {
                gauge.set(0);
                let reason = format!("cannot listen on {addr}/{protocol}: {err}");
                if !matches!(&e.listener, Listener::Failed(r) if *r == reason) {
                    tracing::warn!(service = %e.shared.service, %reason, "service port down");
                }
                e.listener = Listener::Failed(reason);
            }
        }
    }

    /// Closes the port's listener; open TCP connections are left to finish within
    /// the service's drain time.
    fn stop(&self, e: PortEntry) {
        if let Listener::Running(stop) = e.listener {
            stop.cancel();
        }
        e.shared.retire();
        self.metrics.proxy_listener_up.remove(&e.labels);
    }

    fn retry_failed(&self) {
        let mut st = lock(&self.state);
        if st.shut_down {
            return;
        }
        for ports in st.services.values_mut() {
            for ((_, protocol), e) in ports.iter_mut() {
                if matches!(e.listener, Listener::Failed(_)) && e.listen.is_some() {
                    self.start(e, *protocol);
                }
            }
        }
    }
}

fn bind_tcp(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let sock = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // Rebinding right after a restart must not wait for TIME_WAIT connections.
    sock.set_reuseaddr(true)?;
    sock.bind(addr)?;
    sock.listen(1024)
}

fn bind_udp(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    let sock = std::net::UdpSocket::bind(addr)?;
    sock.set_nonblocking(true)?;
    UdpSocket::from_std(sock)
}

#[async_trait]
impl DataPlane for UserspaceProxy {
    fn mode(&self) -> &'static str {
        "userspace"
    }

    async fn apply(&self, delta: &Delta) -> Result<(), DataPlaneError> {
        let inner = &self.inner;
        let mut st = lock(&inner.state);
        if st.shut_down {
            return Err(DataPlaneError::ShutDown { mode: self.mode() });
        }
        let mut gone: Vec<ServiceKey> = delta.removed.clone();
        if delta.full {
            let keep: BTreeSet<ServiceKey> = delta.upserted.iter().map(|v| v.key()).collect();
            gone.extend(st.services.keys().filter(|k| !keep.contains(*k)).cloned());
        }
        let mut freed = false;
        for k in &gone {
            for e in st
                .services
                .remove(k)
                .into_iter()
                .flat_map(|p| p.into_values())
            {
                freed |= matches!(e.listener, Listener::Running(_));
                inner.stop(e);
            }
        }
        for view in &delta.upserted {
            inner.upsert(&mut st, view);
        }
        // A port freed by this delta may be wanted by another service in it: its
        // listener closes as its task ends, so retry failed binds shortly.
        if freed {
            inner.retry_soon.notify_one();
        }
        if !std::mem::replace(&mut st.retrying, true) {
            let me = Arc::downgrade(inner);
            let (cancel, every) = (inner.cancel.clone(), inner.config.bind_retry_interval);
            inner.tracker.spawn(async move {
                loop {
                    let soon = async {
                        match me.upgrade() {
                            Some(inner) => inner.retry_soon.notified().await,
                            None => std::future::pending().await,
                        }
                        tokio::time::sleep(RETRY_SOON_AFTER).await;
                    };
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(every) => {}
                        _ = soon => {}
                    }
                    match me.upgrade() {
                        Some(inner) => inner.retry_failed(),
                        None => return,
                    }
                }
            });
        }
        Ok(())
    }

    fn status(&self) -> Vec<ServicePortStatus> {
        let st = lock(&self.inner.state);
        let mut out = Vec::new();
        for (key, ports) in &st.services {
            for (&(port, protocol), e) in ports {
                let b = e.shared.backends();
                out.push(ServicePortStatus {
                    service: key.to_string(),
                    port,
                    protocol,
                    listen: e.listen,
                    state: match &e.listener {
                        Listener::Running(_) => PortState::Listening,
                        Listener::Failed(reason) => PortState::Failed {
                            reason: reason.clone(),
                        },
                    },
                    endpoints_known: b.known,
                    backends: b.status.clone(),
                    counters: None,
                });
            }
        }
        out
    }

    async fn shutdown(&self) {
        let inner = &self.inner;
        {
            let mut st = lock(&inner.state);
            st.shut_down = true;
            for e in std::mem::take(&mut st.services)
                .into_values()
                .flat_map(|p| p.into_values())
            {
                inner.stop(e);
            }
        }
        inner.cancel.cancel();
        inner.tracker.close();
        inner.tracker.wait().await;
    }
}

impl Drop for UserspaceProxy {
    fn drop(&mut self) {
        // Without a shutdown, tasks would outlive the proxy; end them (not waited for).
        self.inner.cancel.cancel();
    }
}
