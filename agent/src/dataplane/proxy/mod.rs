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
mod tcp;
mod udp;
pub mod vip_addrs;

use self::{
    backends::{Backends, PortShared},
    vip_addrs::{AddressOps, NetlinkAddressOps, VipAddrs},
};
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        dataplane::BackendState,
        endpoints::ServiceView,
        metrics::ConnectionLabels,
        model::{
            Discovery, Endpoint, Endpoints, EndpointsSpec, LocalityPreference, Metadata, Service,
            ServiceSpec, SessionAffinity,
        },
    };
    use std::{collections::BTreeMap, net::Ipv4Addr, time::Duration};
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream, UdpSocket},
        time::timeout,
    };

    const PATIENCE: Duration = Duration::from_secs(5);

    fn meta(name: &str) -> Metadata {
        Metadata {
            namespace: "default".into(),
            name: name.into(),
            labels: BTreeMap::new(),
        }
    }

    fn service(name: &str, port: u16, protocol: Protocol) -> Service {
        Service {
            metadata: meta(name),
            spec: ServiceSpec {
                ports: vec![ServicePort {
                    name: "p".into(),
                    port,
                    protocol,
                    target_port: None,
                }],
                discovery: Discovery::default(),
                session_affinity: SessionAffinity::None,
                drain_seconds: 30,
            },
        }
    }

    /// An endpoint at `ip` whose port `p` is overridden to `port`.
    fn ep(ip: [u8; 4], port: u16) -> Endpoint {
        Endpoint {
            address: IpAddr::from(ip),
            node: "node-a".into(),
            ready: true,
            serving: None,
            terminating: false,
            ports: BTreeMap::from([("p".to_owned(), port)]).into(),
        }
    }

    fn view(svc: &Service, eps: Option<Vec<Endpoint>>) -> ServiceView {
        ServiceView {
            service: Arc::new(svc.clone()),
            endpoints: eps.map(|endpoints| {
                Arc::new(Endpoints {
                    metadata: svc.metadata.clone(),
                    spec: EndpointsSpec { endpoints },
                })
            }),
        }
    }

    fn upsert(views: Vec<ServiceView>) -> Delta {
        Delta {
            upserted: views,
            ..Delta::default()
        }
    }

    fn proxy() -> (UserspaceProxy, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let config = ProxyConfig {
            node_name: "node-a".into(),
            udp_idle_timeout: Duration::from_secs(5),
            bind_retry_interval: Duration::from_millis(100),
            ..ProxyConfig::default()
        };
        (
            UserspaceProxy::new(config, metrics.clone()).unwrap(),
            metrics,
        )
    }

    fn conns(m: &Metrics, name: &str, protocol: &str, result: &str) -> u64 {
        m.proxy_connections
            .get_or_create(&ConnectionLabels {
                service: format!("default/{name}"),
                protocol: protocol.into(),
                result: result.into(),
            })
            .get()
    }

    /// A port free on 127.0.0.1 for TCP and UDP right now.
    fn free_port() -> u16 {
        loop {
            let t = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let port = t.local_addr().unwrap().port();
            if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }

    /// A TCP backend on `ip` that sends `id`, then echoes; returns its port.
    async fn tcp_backend(ip: [u8; 4], id: u8) -> u16 {
        let l = TcpListener::bind((Ipv4Addr::from(ip), 0)).await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    s.write_all(&[id]).await.ok();
                    let (mut r, mut w) = s.split();
                    tokio::io::copy(&mut r, &mut w).await.ok();
                });
            }
        });
        port
    }

    /// Connects through the proxy and returns the stream and the backend's id.
    async fn connect(port: u16) -> (TcpStream, u8) {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let mut id = [0u8];
        s.read_exact(&mut id).await.unwrap();
        (s, id[0])
    }

    async fn echo(s: &mut TcpStream, msg: &[u8]) {
        s.write_all(msg).await.unwrap();
        let mut buf = vec![0; msg.len()];
        timeout(PATIENCE, s.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(buf, msg);
    }

    #[tokio::test]
    async fn tcp_spreads_over_three_backends() {
        let (p, metrics) = proxy();
        let port = free_port();
        let mut eps = Vec::new();
        for (i, last) in [2u8, 3, 4].into_iter().enumerate() {
            eps.push(ep(
                [127, 0, 0, last],
                tcp_backend([127, 0, 0, last], i as u8).await,
            ));
        }
        let svc = service("web", port, Protocol::Tcp);
        p.apply(&upsert(vec![view(&svc, Some(eps))])).await.unwrap();
        let mut seen = [0usize; 3];
        timeout(Duration::from_secs(8), async {
            for i in 0..300 {
                let (mut s, id) = connect(port).await;
                seen[id as usize] += 1;
                if i % 50 == 0 {
                    echo(&mut s, b"hello").await;
                }
            }
        })
        .await
        .unwrap();
        for n in seen {
            assert!((60..=141).contains(&n), "uneven spread {seen:?}");
        }
        assert_eq!(conns(&metrics, "web", "TCP", "ok"), 300);
        let st = p.status();
        assert_eq!(st.len(), 1);
        assert_eq!(st[0].state, PortState::Listening);
        assert_eq!(st[0].backends.len(), 3);
        p.shutdown().await;
    }

    #[tokio::test]
    async fn terminating_and_removed_endpoints_keep_open_connections() {
        let (p, _) = proxy();
        let port = free_port();
        let a = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 1).await);
        let b = ep([127, 0, 0, 3], tcp_backend([127, 0, 0, 3], 2).await);
        let svc = service("web", port, Protocol::Tcp);
        p.apply(&upsert(vec![view(&svc, Some(vec![a.clone()]))]))
            .await
            .unwrap();
        let (mut old, id) = connect(port).await;
        assert_eq!(id, 1);
        echo(&mut old, b"before").await;

        let mut a_term = a.clone();
        a_term.terminating = true;
        p.apply(&upsert(vec![view(&svc, Some(vec![a_term, b.clone()]))]))
            .await
            .unwrap();
        assert_eq!(p.status()[0].backends[0].state, BackendState::Terminating);
        for _ in 0..20 {
            assert_eq!(
                connect(port).await.1,
                2,
                "terminating endpoint got a new connection"
            );
        }
        echo(&mut old, b"while terminating").await;

        // Gone from the list altogether: still not cut.
        p.apply(&upsert(vec![view(&svc, Some(vec![b]))]))
            .await
            .unwrap();
        echo(&mut old, b"after removal").await;

        // Removing the service closes the listener, not the connection.
        let delta = Delta {
            removed: vec![svc.key()],
            ..Delta::default()
        };
        p.apply(&delta).await.unwrap();
        assert!(p.status().is_empty());
        let refused = timeout(PATIENCE, TcpStream::connect(("127.0.0.1", port))).await;
        assert!(matches!(refused, Ok(Err(_))), "listener still open");
        echo(&mut old, b"after service removal").await;
        timeout(PATIENCE, p.shutdown()).await.unwrap();
    }

    /// Reads until the proxy closes the connection; `None` when it stays open.
    async fn closed_within(s: &mut TcpStream, patience: Duration) -> Option<()> {
        let mut buf = [0u8; 64];
        match timeout(patience, s.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => Some(()),
            Ok(Ok(_)) | Err(_) => None,
        }
    }

    #[tokio::test]
    async fn connections_to_a_leaving_endpoint_end_after_the_drain_time() {
        let (p, m) = proxy();
        let port = free_port();
        let a = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 1).await);
        let b = ep([127, 0, 0, 3], tcp_backend([127, 0, 0, 3], 2).await);
        let mut svc = service("drain", port, Protocol::Tcp);
        svc.spec.drain_seconds = 1;
        p.apply(&upsert(vec![view(&svc, Some(vec![a.clone()]))]))
            .await
            .unwrap();
        let (mut old, id) = connect(port).await;
        assert_eq!(id, 1);
        echo(&mut old, b"0123456789").await;
        // Bytes are counted while the connection is open (1 id byte + the echo back).
        let bytes = |dir: &str| {
            m.proxy_bytes
                .get_or_create(&crate::metrics::BytesLabels {
                    service: "default/drain".into(),
                    protocol: "TCP".into(),
                    direction: dir.into(),
                })
                .get()
        };
        assert_eq!((bytes("to_backend"), bytes("to_client")), (10, 11));

        let mut a_term = a.clone();
        a_term.terminating = true;
        p.apply(&upsert(vec![view(&svc, Some(vec![a_term, b.clone()]))]))
            .await
            .unwrap();
        // Still served within the drain time...
        echo(&mut old, b"draining").await;
        // ...and closed once it is over.
        assert!(
            closed_within(&mut old, PATIENCE).await.is_some(),
            "connection outlived drainSeconds"
        );

        // A backend that comes back before the drain time is over keeps its connections.
        p.apply(&upsert(vec![view(&svc, Some(vec![a.clone()]))]))
            .await
            .unwrap();
        let (mut second, id) = connect(port).await;
        assert_eq!(id, 1);
        p.apply(&upsert(vec![view(&svc, Some(vec![b.clone()]))]))
            .await
            .unwrap();
        p.apply(&upsert(vec![view(&svc, Some(vec![a.clone(), b]))]))
            .await
            .unwrap();
        assert!(
            closed_within(&mut second, Duration::from_millis(1500))
                .await
                .is_none(),
            "a backend that returned was drained"
        );
        echo(&mut second, b"still here").await;
        timeout(PATIENCE, p.shutdown()).await.unwrap();
    }

    #[tokio::test]
    async fn deleting_an_endpoint_moves_traffic_to_the_rest() {
        let (p, _) = proxy();
        let port = free_port();
        let a = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 1).await);
        let b = ep([127, 0, 0, 3], tcp_backend([127, 0, 0, 3], 2).await);
        let svc = service("web", port, Protocol::Tcp);
        p.apply(&upsert(vec![view(&svc, Some(vec![a, b.clone()]))]))
            .await
            .unwrap();
        let mut ids = BTreeSet::new();
        for _ in 0..40 {
            ids.insert(connect(port).await.1);
        }
        assert_eq!(ids, BTreeSet::from([1, 2]));
        p.apply(&upsert(vec![view(&svc, Some(vec![b]))]))
            .await
            .unwrap();
        for _ in 0..40 {
            assert_eq!(connect(port).await.1, 2);
        }
        p.shutdown().await;
    }

    /// Reads until EOF or reset: what a refused client sees.
    async fn refused(port: u16) {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let mut buf = [0u8; 1];
        match timeout(PATIENCE, s.read(&mut buf)).await.unwrap() {
            Ok(0) | Err(_) => {}
            Ok(n) => panic!("read {n} bytes from a service without backends"),
        }
    }

    #[tokio::test]
    async fn no_backends_refuse_and_count() {
        let (p, metrics) = proxy();
        let (port1, port2) = (free_port(), free_port());
        let empty = service("empty", port1, Protocol::Tcp);
        let unknown = service("unknown", port2, Protocol::Tcp);
        let mut not_ready = ep([127, 0, 0, 2], 1);
        not_ready.ready = false;
        p.apply(&upsert(vec![
            view(&empty, Some(vec![not_ready])),
            view(&unknown, None),
        ]))
        .await
        .unwrap();
        refused(port1).await;
        refused(port2).await;
        refused(port2).await;
        assert_eq!(conns(&metrics, "empty", "TCP", "no_backend"), 1);
        assert_eq!(conns(&metrics, "unknown", "TCP", "no_backend"), 2);
        assert_eq!(conns(&metrics, "empty", "TCP", "ok"), 0);
        let st = p.status();
        assert!(st[0].endpoints_known && !st[1].endpoints_known);
        assert_eq!(st[0].backends[0].state, BackendState::NotReady);
        p.shutdown().await;
    }

    /// A UDP backend on `ip` that answers `[id] + payload`; returns its port.
    async fn udp_backend(ip: [u8; 4], id: u8) -> u16 {
        let s = UdpSocket::bind((Ipv4Addr::from(ip), 0)).await.unwrap();
        let port = s.local_addr().unwrap().port();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            while let Ok((n, peer)) = s.recv_from(&mut buf[1..]).await {
                buf[0] = id;
                s.send_to(&buf[..n + 1], peer).await.ok();
            }
        });
        port
    }

    async fn udp_round_trip(c: &UdpSocket, msg: &[u8]) -> u8 {
        c.send(msg).await.unwrap();
        let mut buf = [0u8; 2048];
        let n = timeout(PATIENCE, c.recv(&mut buf)).await.unwrap().unwrap();
        assert_eq!(&buf[1..n], msg);
        buf[0]
    }

    #[tokio::test]
    async fn a_udp_flow_to_a_removed_backend_moves_after_the_drain_time() {
        let (p, _) = proxy();
        let port = free_port();
        let a = ep([127, 0, 0, 2], udp_backend([127, 0, 0, 2], 1).await);
        let b = ep([127, 0, 0, 3], udp_backend([127, 0, 0, 3], 2).await);
        let mut svc = service("stats", port, Protocol::Udp);
        svc.spec.drain_seconds = 1;
        p.apply(&upsert(vec![view(&svc, Some(vec![a.clone(), b.clone()]))]))
            .await
            .unwrap();
        let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        c.connect(("127.0.0.1", port)).await.unwrap();
        let first = udp_round_trip(&c, b"m0").await;
        let rest = if first == 1 { b } else { a };
        p.apply(&upsert(vec![view(&svc, Some(vec![rest]))]))
            .await
            .unwrap();
        // Within the drain time the flow keeps its backend...
        assert_eq!(udp_round_trip(&c, b"m1").await, first);
        // ...then it ends, and the client's next datagram goes to a live backend, even
        // though the client never paused (an idle timeout alone would never move it).
        let moved = timeout(PATIENCE, async {
            loop {
                // A datagram in flight when the flow ends may be lost, as on a network.
                c.send(b"m2").await.unwrap();
                let mut buf = [0u8; 64];
                if let Ok(Ok(n)) = timeout(Duration::from_millis(300), c.recv(&mut buf)).await
                    && n > 0
                    && buf[0] != first
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        assert!(moved.is_ok(), "the flow outlived drainSeconds");
        p.shutdown().await;
    }

    #[tokio::test]
    async fn udp_round_trips_and_a_flow_keeps_its_backend() {
        let (p, metrics) = proxy();
        let port = free_port();
        let a = ep([127, 0, 0, 2], udp_backend([127, 0, 0, 2], 1).await);
        let b = ep([127, 0, 0, 3], udp_backend([127, 0, 0, 3], 2).await);
        let svc = service("dns", port, Protocol::Udp);
        p.apply(&upsert(vec![view(&svc, Some(vec![a.clone(), b.clone()]))]))
            .await
            .unwrap();
        let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        c.connect(("127.0.0.1", port)).await.unwrap();
        let first = udp_round_trip(&c, b"q1").await;
        for i in 0..5 {
            assert_eq!(udp_round_trip(&c, format!("q{i}").as_bytes()).await, first);
        }
        // Its backend starts terminating: the flow stays; new clients go elsewhere.
        let (mut a2, mut b2) = (a, b);
        if first == 1 { &mut a2 } else { &mut b2 }.terminating = true;
        p.apply(&upsert(vec![view(&svc, Some(vec![a2, b2]))]))
            .await
            .unwrap();
        assert_eq!(udp_round_trip(&c, b"again").await, first);
        let c2 = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        c2.connect(("127.0.0.1", port)).await.unwrap();
        assert_ne!(udp_round_trip(&c2, b"new").await, first);
        assert_eq!(conns(&metrics, "dns", "UDP", "ok"), 2);
        p.shutdown().await;
    }

    #[tokio::test]
    async fn a_taken_port_fails_alone_and_is_retried() {
        let (p, metrics) = proxy();
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken_port = taken.local_addr().unwrap().port();
        let port = free_port();
        let good = service("good", port, Protocol::Tcp);
        let bad = service("bad", taken_port, Protocol::Tcp);
        let backend = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 7).await);
        p.apply(&upsert(vec![
            view(&bad, Some(vec![backend.clone()])),
            view(&good, Some(vec![backend])),
        ]))
        .await
        .unwrap();
        let st = p.status();
        let PortState::Failed { reason } = &st[0].state else {
            panic!("taken port reported as {:?}", st[0].state);
        };
        assert!(reason.contains("in use"), "{reason}");
        assert_eq!(st[1].state, PortState::Listening);
        let up = |name: &str, port| {
            metrics
                .proxy_listener_up
                .get_or_create(&ServicePortLabels {
                    service: format!("default/{name}"),
                    port,
                    protocol: "TCP".into(),
                })
                .get()
        };
        assert_eq!((up("bad", taken_port), up("good", port)), (0, 1));
        assert_eq!(connect(port).await.1, 7);

        // Freed: the background retry takes it.
        drop(taken);
        timeout(PATIENCE, async {
            while p.status()[0].state != PortState::Listening {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap();
        assert_eq!(connect(taken_port).await.1, 7);
        assert_eq!(up("bad", taken_port), 1);
        p.shutdown().await;
    }

    #[tokio::test]
    async fn a_port_freed_and_taken_in_one_delta_is_bound_without_waiting_for_the_retry() {
        let config = ProxyConfig {
            bind_retry_interval: Duration::from_secs(600),
            ..ProxyConfig::default()
        };
        let p = UserspaceProxy::new(config, Arc::new(Metrics::new())).unwrap();
        let port = free_port();
        let backend = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 7).await);
        let old = service("old", port, Protocol::Tcp);
        let new = service("new", port, Protocol::Tcp);
        p.apply(&upsert(vec![view(&old, Some(vec![backend.clone()]))]))
            .await
            .unwrap();
        let delta = Delta {
            removed: vec![old.key()],
            upserted: vec![view(&new, Some(vec![backend]))],
            ..Delta::default()
        };
        p.apply(&delta).await.unwrap();
        timeout(PATIENCE, async {
            while p.status()[0].state != PortState::Listening {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the new service did not get the freed port");
        assert_eq!(connect(port).await.1, 7);
        p.shutdown().await;
    }

    #[tokio::test]
    async fn a_port_beyond_65535_after_offset_fails_with_a_reason() {
        let metrics = Arc::new(Metrics::new());
        let config = ProxyConfig {
            port_offset: 1000,
            ..ProxyConfig::default()
        };
        let p = UserspaceProxy::new(config, metrics).unwrap();
        let svc = service("high", 65000, Protocol::Udp);
        p.apply(&upsert(vec![view(&svc, None)])).await.unwrap();
        let st = p.status();
        assert_eq!(st[0].listen, None);
        assert!(
            matches!(&st[0].state, PortState::Failed { reason } if reason.contains("66000")),
            "{:?}",
            st[0].state
        );
        p.shutdown().await;
    }

    #[tokio::test]
    async fn shutdown_stops_everything() {
        let (p, _) = proxy();
        let (tport, uport) = (free_port(), free_port());
        let backend = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 1).await);
        let ubackend = ep([127, 0, 0, 2], udp_backend([127, 0, 0, 2], 1).await);
        let t = service("t", tport, Protocol::Tcp);
        let u = service("u", uport, Protocol::Udp);
        p.apply(&upsert(vec![
            view(&t, Some(vec![backend])),
            view(&u, Some(vec![ubackend])),
        ]))
        .await
        .unwrap();
        let (mut open, _) = connect(tport).await;
        let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        c.connect(("127.0.0.1", uport)).await.unwrap();
        udp_round_trip(&c, b"x").await;

        timeout(PATIENCE, p.shutdown()).await.unwrap();
        assert!(p.inner.tracker.is_empty(), "tasks left after shutdown");
        // The open connection was closed, the ports are free again.
        let mut buf = [0u8; 1];
        assert!(matches!(
            timeout(PATIENCE, open.read(&mut buf)).await.unwrap(),
            Ok(0) | Err(_)
        ));
        std::net::TcpListener::bind(("127.0.0.1", tport)).unwrap();
        std::net::UdpSocket::bind(("127.0.0.1", uport)).unwrap();
        assert!(matches!(
            p.apply(&Delta::default()).await,
            Err(DataPlaneError::ShutDown { .. })
        ));
    }

    #[test]
    fn locality_preference_and_target_ports() {
        let mut svc = service("web", 80, Protocol::Tcp);
        svc.spec.ports[0].target_port = Some(8080);
        let mut remote = ep([10, 0, 0, 2], 0);
        remote.node = "node-b".into();
        remote.ports.clear();
        let local = ep([10, 0, 0, 1], 9090);
        let eps = Some(vec![remote.clone(), local.clone()]);
        let pick_all = |pref, eps: Option<Vec<Endpoint>>| {
            let mut s = svc.clone();
            s.spec.discovery.locality_preference = pref;
            let v = view(&s, eps);
            let shared = PortShared::new(
                "x".into(),
                Protocol::Tcp,
                Backends::build(&v, &s.spec.ports[0], "node-a", 13, None),
                &Metrics::new(),
                TaskTracker::new(),
                CancellationToken::new(),
            );
            (1000..1200)
                .filter_map(|port| shared.pick(SocketAddr::from(([192, 0, 2, 1], port))))
                .collect::<BTreeSet<_>>()
        };
        let r: SocketAddr = "10.0.0.2:8080".parse().unwrap();
        let l: SocketAddr = "10.0.0.1:9090".parse().unwrap();
        use LocalityPreference::*;
        assert_eq!(pick_all(Any, eps.clone()), BTreeSet::from([r, l]));
        assert_eq!(pick_all(PreferLocal, eps.clone()), BTreeSet::from([l]));
        assert_eq!(pick_all(LocalOnly, eps.clone()), BTreeSet::from([l]));
        assert_eq!(
            pick_all(PreferLocal, Some(vec![remote.clone()])),
            BTreeSet::from([r])
        );
        assert_eq!(pick_all(LocalOnly, Some(vec![remote])), BTreeSet::new());
    }

    #[test]
    fn client_ip_affinity_sticks_across_ports_and_backend_changes() {
        let mut svc = service("web", 80, Protocol::Tcp);
        svc.spec.session_affinity = SessionAffinity::ClientIp {
            timeout_seconds: 60,
        };
        let eps: Vec<_> = (1..=5).map(|i| ep([10, 0, 0, i], 80)).collect();
        let build = |eps: Vec<Endpoint>| {
            Backends::build(&view(&svc, Some(eps)), &svc.spec.ports[0], "", 13, None)
        };
        let shared = Arc::new(PortShared::new(
            "x".into(),
            Protocol::Tcp,
            build(eps.clone()),
            &Metrics::new(),
            TaskTracker::new(),
            CancellationToken::new(),
        ));
        let client = |port| SocketAddr::from(([192, 0, 2, 9], port));
        let first = shared.pick(client(1000)).unwrap();
        for port in 1001..1100 {
            assert_eq!(shared.pick(client(port)), Some(first));
        }
        // Another backend added: the remembered one stays.
        let mut more = eps.clone();
        more.push(ep([10, 0, 0, 6], 80));
        shared.set_backends(build(more));
        assert_eq!(shared.pick(client(2000)), Some(first));
        // The remembered one leaves: the client moves, and sticks again.
        let rest: Vec<_> = eps
            .into_iter()
            .filter(|e| SocketAddr::new(e.address, 80) != first)
            .collect();
        shared.set_backends(build(rest));
        let second = shared.pick(client(3000)).unwrap();
        assert_ne!(second, first);
        assert_eq!(shared.pick(client(3001)), Some(second));
    }

    /// Production mode with a fake address manager: listeners on each service's VIP
    /// (127.0.0.0/8 addresses, bindable without adding them), VIPs held by the ports on
    /// them, stale addresses of an earlier agent removed, others' never touched.
    #[tokio::test]
    async fn vips_are_held_by_their_ports_and_released_with_the_last() {
        use super::vip_addrs::fake::FakeOps;
        let fake = FakeOps::default();
        let (vip, moved, stale, theirs): (IpAddr, IpAddr, IpAddr, IpAddr) = (
            [127, 0, 0, 77].into(),
            [127, 0, 0, 79].into(),
            [127, 0, 0, 99].into(),
            [127, 0, 0, 98].into(),
        );
        fake.addrs
            .lock()
            .unwrap()
            .extend([(stale, true), (theirs, false)]);
        let metrics = Arc::new(Metrics::new());
        let config = ProxyConfig {
            listen: ListenOn::Vips,
            node_name: "node-a".into(),
            bind_retry_interval: Duration::from_millis(100),
            ..ProxyConfig::default()
        };
        let p = UserspaceProxy::with_address_ops(config, metrics, Box::new(fake.clone())).unwrap();
        let (tport, uport) = (free_port(), free_port());
        let backend = ep([127, 0, 0, 2], tcp_backend([127, 0, 0, 2], 7).await);
        let mut a = service("a", tport, Protocol::Tcp);
        a.spec.discovery.vips = vec![vip];
        let mut b = service("b", uport, Protocol::Udp);
        b.spec.discovery.vips = vec![vip];
        p.apply(&Delta {
            full: true,
            ..upsert(vec![
                view(&a, Some(vec![backend.clone()])),
                view(&b, Some(vec![])),
            ])
        })
        .await
        .unwrap();
        assert_eq!(
            fake.on_interface(),
            BTreeMap::from([(vip, true), (theirs, false)]),
            "the VIP added, the stale address of ours removed, the other left"
        );
        let st = p.status();
        assert_eq!(st[0].listen, Some(SocketAddr::new(vip, tport)));
        assert_eq!(st[0].state, PortState::Listening);
        let mut s = TcpStream::connect((vip, tport)).await.unwrap();
        let mut id = [0u8];
        s.read_exact(&mut id).await.unwrap();
        assert_eq!(id[0], 7);

        // b goes: a still holds the VIP.
        p.apply(&Delta {
            removed: vec![b.key()],
            ..Delta::default()
        })
        .await
        .unwrap();
        assert!(fake.on_interface().contains_key(&vip));

        // a moves to another VIP: the old one goes, the connection open on it stays.
        a.spec.discovery.vips = vec![moved];
        p.apply(&upsert(vec![view(&a, Some(vec![backend]))]))
            .await
            .unwrap();
        assert_eq!(
            fake.on_interface(),
            BTreeMap::from([(moved, true), (theirs, false)])
        );
        echo(&mut s, b"still").await;
        let mut s2 = TcpStream::connect((moved, tport)).await.unwrap();
        s2.read_exact(&mut id).await.unwrap();
        assert_eq!(id[0], 7);

        timeout(PATIENCE, p.shutdown()).await.unwrap();
        assert_eq!(fake.on_interface(), BTreeMap::from([(theirs, false)]));
    }

    #[tokio::test]
    async fn a_service_without_vip_fails_alone_in_production() {
        use super::vip_addrs::fake::FakeOps;
        let config = ProxyConfig {
            listen: ListenOn::Vips,
            ..ProxyConfig::default()
        };
        let p = UserspaceProxy::with_address_ops(
            config,
            Arc::new(Metrics::new()),
            Box::new(FakeOps::default()),
        )
        .unwrap();
        let svc = service("novip", free_port(), Protocol::Tcp);
        p.apply(&upsert(vec![view(&svc, None)])).await.unwrap();
        let st = p.status();
        assert_eq!(st[0].listen, None);
        assert!(
            matches!(&st[0].state, PortState::Failed { reason } if reason.contains("no VIP")),
            "{:?}",
            st[0].state
        );
        p.shutdown().await;
    }

    /// A client that aborts (RST) makes the proxy abort its backend connection too,
    /// rather than close it with a FIN (which would leave it in TIME_WAIT on the node).
    #[tokio::test]
    async fn a_client_reset_is_passed_on_to_the_backend() {
        let (p, _) = proxy();
        let l = TcpListener::bind("127.0.0.2:0").await.unwrap();
        let bport = l.local_addr().unwrap().port();
        let port = free_port();
        let svc = service("rst", port, Protocol::Tcp);
        p.apply(&upsert(vec![view(
            &svc,
            Some(vec![ep([127, 0, 0, 2], bport)]),
        )]))
        .await
        .unwrap();
        let c = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let (mut b, _) = timeout(PATIENCE, l.accept()).await.unwrap().unwrap();
        let mut c = c;
        c.write_all(b"x").await.unwrap();
        let mut buf = [0u8; 1];
        timeout(PATIENCE, b.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        c.set_zero_linger().unwrap();
        drop(c);
        let r = timeout(PATIENCE, b.read(&mut buf)).await.unwrap();
        assert_eq!(
            r.map_err(|e| e.kind()),
            Err(std::io::ErrorKind::ConnectionReset),
            "the backend sees a reset, not an orderly close"
        );
        p.shutdown().await;
    }
}
