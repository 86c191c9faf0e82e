//! The userspace data plane: a TCP listener or UDP socket per service port, relaying
//! to a backend chosen by Maglev over the service's ready endpoints.
//!
//! Used in dev mode (on 127.0.0.1, ports shifted by `--dev-port-offset`) and as the
//! last-resort fallback in production, where it listens on the VIPs themselves
//! (added to `lo` by [`vip_addrs`]) on the real service ports. Applies swap each
//! port's backend set in place: listeners keep running, connections already open
//! are never cut by an apply, and a port that cannot be bound is reported (and
//! retried) without stopping the others.

mod backends;
pub mod policy_gate;
mod tcp;
mod udp;
pub mod vip_addrs;

#[cfg(test)]
mod tests;

use self::{
    backends::{Backends, PortShared},
    policy_gate::{GateCollector, PolicyGate},
    vip_addrs::{AddressOps, NetlinkAddressOps, VipAddrs},
};
use crate::{
    dataplane::{DataPlane, DataPlaneError, PortState, ServicePortStatus},
    endpoints::{Delta, ServiceView},
    lock::lock,
    maglev::{self, Maglev},
    metrics::{Metrics, ServicePortLabels},
    model::{Protocol, ServiceKey, ServicePort},
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
    /// Each service's own VIPs (production): the proxy adds them to `lo` while a
    /// service port listens on them (see [`vip_addrs`]).
    Vips,
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
    /// Network policy for connections through the VIPs.
    policy: Arc<PolicyGate>,
    state: Mutex<State>,
    /// The VIP addresses (with [`ListenOn::Vips`] only).
    vips: Option<VipAddrs>,
    /// One apply at a time: VIP addresses are added before binding and removed after.
    apply_serial: tokio::sync::Mutex<()>,
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
    /// One per listen address (one per VIP in production).
    listeners: Vec<Bound>,
    /// Why the port has no listen address at all (port + offset above 65535, a
    /// service without VIPs).
    unlistenable: Option<String>,
    labels: ServicePortLabels,
}

struct Bound {
    addr: SocketAddr,
    listener: Listener,
}

impl PortEntry {
    fn addrs(&self) -> Vec<SocketAddr> {
        self.listeners.iter().map(|b| b.addr).collect()
    }

    fn any_failed(&self) -> bool {
        self.listeners
            .iter()
            .any(|b| matches!(b.listener, Listener::Failed(_)))
    }
}

/// The key a service port holds its VIPs by.
fn holder(service: &str, port: u16, protocol: Protocol) -> String {
    format!("{service}/{port}/{protocol}")
}

enum Listener {
    Running(CancellationToken),
    Failed(String),
}

impl UserspaceProxy {
    /// The policy metric families, from the proxies' verdict counts.
    pub fn collector(&self) -> GateCollector {
        GateCollector(self.inner.policy.clone())
    }

    /// A proxy with nothing to serve yet; listeners start on the first
    /// [`apply`](DataPlane::apply).
    pub fn new(config: ProxyConfig, metrics: Arc<Metrics>) -> Result<Self, DataPlaneError> {
        Self::with_address_ops(config, metrics, Box::new(NetlinkAddressOps))
    }

    /// Like [`new`](Self::new), with VIP addresses managed through `ops` (tests
    /// use a fake); `ops` is unused unless `config.listen` is [`ListenOn::Vips`].
    pub fn with_address_ops(
        config: ProxyConfig,
        metrics: Arc<Metrics>,
        ops: Box<dyn AddressOps>,
    ) -> Result<Self, DataPlaneError> {
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
        let vips = (config.listen == ListenOn::Vips).then(|| VipAddrs::new(ops));
        Ok(Self {
            inner: Arc::new(Inner {
                policy: Arc::new(PolicyGate::new()),
                config,
                metrics,
                vips,
                apply_serial: tokio::sync::Mutex::new(()),
                state: Mutex::new(State::default()),
                cancel: CancellationToken::new(),
                retry_soon: tokio::sync::Notify::new(),
                tracker: TaskTracker::new(),
            }),
        })
    }
}

impl Inner {
    /// Where a service port listens, or why it cannot.
    fn listen_addrs(&self, view: &ServiceView, p: &ServicePort) -> Result<Vec<SocketAddr>, String> {
        let offset = u32::from(p.port) + u32::from(self.config.port_offset);
        let port = u16::try_from(offset).map_err(|_| {
            format!(
                "port {} + offset {} = {offset} is above 65535",
                p.port, self.config.port_offset
            )
        })?;
        let ips = match &self.config.listen {
            ListenOn::Loopback => vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
            ListenOn::Address(a) => vec![*a],
            ListenOn::Vips => view.service.spec.discovery.vips.clone(),
        };
        if ips.is_empty() {
            return Err("the service has no VIP to listen on".to_owned());
        }
        Ok(ips
            .into_iter()
            .map(|ip| SocketAddr::new(ip, port))
            .collect())
    }

    fn upsert(&self, st: &mut State, view: &ServiceView) -> bool {
        let key = view.key();
        let service = key.to_string();
        let spec = &view.service.spec;
        let mut freed = false;
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
                freed |= self.stop(e);
            }
        }
        let (node, size) = (&self.config.node_name, self.config.maglev_table_size);
        for (k, p) in wanted {
            let listen = self.listen_addrs(view, p);
            if let Some(e) = ports.get_mut(&k) {
                let prev = e.shared.backends();
                e.shared
                    .set_backends(Backends::build(view, p, node, size, Some(&prev)));
                let addrs = listen.as_ref().map_or_else(|_| Vec::new(), Clone::clone);
                if addrs != e.addrs() {
                    // The VIPs changed: listen on the new ones (open connections stay).
                    freed |= self.close_listeners(e);
                    set_listen(e, listen);
                    self.start(e, p.protocol);
                } else if e.any_failed() {
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
            let mut e = PortEntry {
                shared,
                listeners: Vec::new(),
                unlistenable: None,
                labels: ServicePortLabels {
                    service: service.clone(),
                    port: p.port,
                    protocol: p.protocol.as_str().to_owned(),
                },
            };
            set_listen(&mut e, listen);
            self.start(&mut e, p.protocol);
            ports.insert(k, e);
        }
        if ports.is_empty() {
            st.services.remove(&key);
        }
        freed
    }

    /// Binds the port's failed listeners and starts their tasks; on failure records
    /// why.
    fn start(&self, e: &mut PortEntry, protocol: Protocol) {
        for b in &mut e.listeners {
            if matches!(b.listener, Listener::Running(_)) {
                continue;
            }
            let addr = b.addr;
            let stop = self.cancel.child_token();
            let started = match protocol {
                Protocol::Tcp => bind_tcp(addr).map(|l| {
                    self.tracker.spawn(tcp::serve(
                        l,
                        e.shared.clone(),
                        self.policy.clone(),
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
                        self.policy.clone(),
                        limits,
                        stop.clone(),
                        self.tracker.clone(),
                    ));
                }),
            };
            match started {
                Ok(()) => {
                    if matches!(b.listener, Listener::Failed(_)) {
                        tracing::info!(service = %e.shared.service, %addr, %protocol, "listening");
                    }
                    b.listener = Listener::Running(stop);
                }
                Err(err) => {
                    let vip_failure = self.vips.as_ref().and_then(|v| v.failure(addr.ip()));
                    let reason = match vip_failure {
                        Some(why) => format!(
                            "cannot listen on {addr}/{protocol}: the VIP address could not be added: {why}"
                        ),
                        None => format!("cannot listen on {addr}/{protocol}: {err}"),
                    };
                    if !matches!(&b.listener, Listener::Failed(r) if *r == reason) {
                        tracing::warn!(service = %e.shared.service, %reason, "service port down");
                    }
                    b.listener = Listener::Failed(reason);
                }
            }
        }
        let up = !e.listeners.is_empty() && !e.any_failed();
        self.metrics
            .proxy_listener_up
            .get_or_create(&e.labels)
            .set(i64::from(up));
    }

    /// Closes the port's listeners (open connections stay); true when one was
    /// running.
    fn close_listeners(&self, e: &mut PortEntry) -> bool {
        let mut freed = false;
        for b in e.listeners.drain(..) {
            if let Listener::Running(stop) = b.listener {
                stop.cancel();
                freed = true;
            }
        }
        freed
    }

    /// Closes the port's listeners; open TCP connections are left to finish within
    /// the service's drain time. True when a listener was running.
    fn stop(&self, mut e: PortEntry) -> bool {
        let freed = self.close_listeners(&mut e);
        e.shared.retire();
        self.metrics.proxy_listener_up.remove(&e.labels);
        freed
    }

    fn retry_failed(&self) {
        let mut st = lock(&self.state);
        if st.shut_down {
            return;
        }
        for ports in st.services.values_mut() {
            for ((_, protocol), e) in ports.iter_mut() {
                if e.any_failed() {
                    self.start(e, *protocol);
                }
            }
        }
    }

    /// Every (holder, VIP) a listener of the current state needs.
    fn held_vips(&self) -> BTreeSet<(String, IpAddr)> {
        let st = lock(&self.state);
        st.services
            .values()
            .flat_map(|ports| ports.iter())
            .flat_map(|(&(port, protocol), e)| {
                let h = holder(&e.shared.service, port, protocol);
                e.listeners.iter().map(move |b| (h.clone(), b.addr.ip()))
            })
            .collect()
    }
}

/// Sets the port's listen addresses (all not yet bound), or why it has none.
fn set_listen(e: &mut PortEntry, listen: Result<Vec<SocketAddr>, String>) {
    match listen {
        Ok(addrs) => {
            e.unlistenable = None;
            e.listeners = addrs
                .into_iter()
                .map(|addr| Bound {
                    addr,
                    listener: Listener::Failed("not bound yet".to_owned()),
                })
                .collect();
        }
        Err(reason) => {
            e.unlistenable = Some(reason);
            e.listeners = Vec::new();
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
        let _serial = inner.apply_serial.lock().await;
        if lock(&inner.state).shut_down {
            return Err(DataPlaneError::ShutDown { mode: self.mode() });
        }
        // VIP addresses first, so that the binds below find them.
        if let Some(vips) = &inner.vips {
            for view in delta
                .upserted
                .iter()
                .filter(|v| !v.service.spec.discovery.headless)
            {
                let spec = &view.service.spec;
                let service = view.key().to_string();
                for p in &spec.ports {
                    vips.acquire(&holder(&service, p.port, p.protocol), &spec.discovery.vips)
                        .await;
                }
            }
        }
        inner.policy.apply(delta);
        self.apply_listeners(delta);
        // Then drop the addresses no listener needs any more (and stale adopted ones).
        if let Some(vips) = &inner.vips {
            let held = inner.held_vips();
            vips.retain(|h, ip| held.contains(&(h.to_owned(), ip)))
                .await;
        }
        Ok(())
    }

    fn status(&self) -> Vec<ServicePortStatus> {
        let st = lock(&self.inner.state);
        let mut out = Vec::new();
        for (key, ports) in &st.services {
            for (&(port, protocol), e) in ports {
                let b = e.shared.backends();
                let failures: Vec<&str> = e
                    .listeners
                    .iter()
                    .filter_map(|b| match &b.listener {
                        Listener::Failed(r) => Some(r.as_str()),
                        Listener::Running(_) => None,
                    })
                    .chain(e.unlistenable.as_deref())
                    .collect();
                out.push(ServicePortStatus {
                    service: key.to_string(),
                    port,
                    protocol,
                    listen: e.listeners.first().map(|b| b.addr),
                    state: if failures.is_empty() {
                        PortState::Listening
                    } else {
                        PortState::Failed {
                            reason: failures.join("; "),
                        }
                    },
                    endpoints_known: b.known,
                    backends: b.status.clone(),
                    counters: None,
                });
            }
        }
        out
    }

    fn policy(&self) -> Vec<crate::policy::ServicePolicyStatus> {
        self.inner.policy.statuses()
    }

    async fn shutdown(&self) {
        let inner = &self.inner;
        let _serial = inner.apply_serial.lock().await;
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
        if let Some(vips) = &inner.vips {
            vips.release_all().await;
        }
    }
}

impl UserspaceProxy {
    /// The synchronous part of an apply: services and their listeners.
    fn apply_listeners(&self, delta: &Delta) {
        let inner = &self.inner;
        let mut st = lock(&inner.state);
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
                freed |= inner.stop(e);
            }
        }
        for view in &delta.upserted {
            freed |= inner.upsert(&mut st, view);
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
                        Some(inner) => {
                            if let Some(vips) = &inner.vips {
                                vips.retry().await;
                            }
                            inner.retry_failed();
                        }
                        None => return,
                    }
                }
            });
        }
    }
}

impl Drop for UserspaceProxy {
    fn drop(&mut self) {
        // Without a shutdown, tasks would outlive the proxy; end them (not waited for).
        self.inner.cancel.cancel();
    }
}
