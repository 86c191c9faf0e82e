//! Backend choice for one service port: the eligible endpoints, their Maglev table,
//! and client-IP session affinity.

use crate::lock::lock;
use crate::{
    dataplane::{BackendState, BackendStatus},
    endpoints::ServiceView,
    maglev::{BackendKey, Maglev},
    metrics::{BytesLabels, ConnectionLabels, Metrics},
    model::{LocalityPreference, Protocol, ServicePort, SessionAffinity},
};
use agent_common::hash::{FLOW_HASH_SEED, flow_hash_v4, flow_hash_v6};
use prometheus_client::metrics::counter::Counter;
use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex, PoisonError, RwLock},
    time::{Duration, Instant},
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// How often a full affinity map may be swept for expired clients.
const AFFINITY_SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Client IP → (backend, last use), for ClientIP session affinity.
#[derive(Default)]
struct Affinity {
    clients: HashMap<IpAddr, (SocketAddr, Instant)>,
    /// When the map was last swept because it was full.
    swept: Option<Instant>,
}

/// At most this many client IPs are remembered per service port for session affinity.
const MAX_AFFINITY_ENTRIES: usize = 65_536;

/// An immutable snapshot of a port's backends, swapped whole on every apply.
#[derive(Debug)]
pub(super) struct Backends {
    /// Endpoints that get new connections, by socket address (endpoints sharing an
    /// address are as many backends as they have ports), sorted; Maglev indices
    /// point here.
    eligible: Vec<SocketAddr>,
    maglev: Arc<Maglev>,
    /// Every backend of the port, for `status`.
    pub(super) status: Vec<BackendStatus>,
    /// Whether an Endpoints object exists.
    pub(super) known: bool,
    /// Session affinity idle timeout, `None` without affinity.
    affinity: Option<Duration>,
    /// How long connections to an endpoint that stopped taking new ones may go on.
    pub(super) drain: Duration,
}

impl Backends {
    /// The backends of `port` of `view` as seen from `node`; reuses `prev`'s table
    /// when the eligible set did not change.
    pub(super) fn build(
        view: &ServiceView,
        port: &ServicePort,
        node: &str,
        table_size: u32,
        prev: Option<&Backends>,
    ) -> Backends {
        let spec = &view.service.spec;
        let target = |e: &crate::model::Endpoint| SocketAddr::new(e.address, e.port_for(port));
        let ready: Vec<_> = view
            .endpoint_list()
            .iter()
            .filter(|e| e.accepts_new())
            .collect();
        let local = || ready.iter().filter(|e| *e.node == *node);
        let mut eligible: Vec<SocketAddr> = match spec.discovery.locality_preference {
            LocalityPreference::Any => ready.iter().map(|e| target(e)).collect(),
            LocalityPreference::LocalOnly => local().map(|e| target(e)).collect(),
            LocalityPreference::PreferLocal if local().next().is_some() => {
                local().map(|e| target(e)).collect()
            }
            LocalityPreference::PreferLocal => ready.iter().map(|e| target(e)).collect(),
        };
        eligible.sort_unstable();
        eligible.dedup();
        let maglev = match prev {
            Some(p) if p.eligible == eligible => p.maglev.clone(),
            _ => {
                let keys: Vec<_> = eligible.iter().copied().map(BackendKey).collect();
                match Maglev::new(&keys, table_size) {
                    Ok(m) => Arc::new(m),
                    Err(e) => {
                        tracing::error!(service = %view.key(), port = port.port, error = %e,
                            "cannot build the maglev table: refusing connections");
                        eligible.clear();
                        Arc::new(Maglev::default())
                    }
                }
            }
        };
        let status = view
            .port_backends(port)
            .into_iter()
            .map(|b| BackendStatus {
                address: b.addr.ip(),
                port: b.addr.port(),
                node: b.endpoint.node.to_string(),
                state: BackendState::of(b.endpoint),
                counters: None,
            })
            .collect();
        let affinity = match spec.session_affinity {
            SessionAffinity::None => None,
            SessionAffinity::ClientIp { timeout_seconds } => {
                Some(Duration::from_secs(u64::from(timeout_seconds)))
            }
        };
        Backends {
            eligible,
            maglev,
            status,
            known: view.endpoints.is_some(),
            affinity,
            drain: Duration::from_secs(u64::from(spec.drain_seconds)),
        }
    }
}

/// The flow hash of a client (IP only when `port` is 0).
fn client_hash(ip: IpAddr, port: u16) -> u32 {
    match ip {
        IpAddr::V4(a) => flow_hash_v4(u32::from(a), port, FLOW_HASH_SEED),
        IpAddr::V6(a) => {
            let s = a.segments().map(u32::from);
            let w = [0, 2, 4, 6].map(|i| (s[i] << 16) | s[i + 1]);
            flow_hash_v6(w, port, FLOW_HASH_SEED)
        }
    }
}

/// Counters of one service port, looked up once instead of per connection.
pub(super) struct PortMetrics {
    pub(super) ok: Counter,
    pub(super) no_backend: Counter,
    pub(super) dial_error: Counter,
    /// UDP flows refused because the flow table was full.
    pub(super) flow_limit: Counter,
    pub(super) to_backend: Counter,
    pub(super) to_client: Counter,
}

impl PortMetrics {
    fn new(metrics: &Metrics, service: &str, protocol: Protocol) -> Self {
        let conn = |result: &str| {
            metrics
                .proxy_connections
                .get_or_create(&ConnectionLabels {
                    service: service.to_owned(),
                    protocol: protocol.as_str().to_owned(),
                    result: result.to_owned(),
                })
                .clone()
        };
        let bytes = |direction: &str| {
            metrics
                .proxy_bytes
                .get_or_create(&BytesLabels {
                    service: service.to_owned(),
                    protocol: protocol.as_str().to_owned(),
                    direction: direction.to_owned(),
                })
                .clone()
        };
        Self {
            ok: conn("ok"),
            no_backend: conn("no_backend"),
            dial_error: conn("dial_error"),
            flow_limit: conn("flow_limit"),
            to_backend: bytes("to_backend"),
            to_client: bytes("to_client"),
        }
    }
}

/// What a port's listener task shares with the reconciler: the swappable backends,
/// the affinity memory and the counters.
pub(super) struct PortShared {
    /// `namespace/name`, for logs.
    pub(super) service: String,
    backends: RwLock<Arc<Backends>>,
    affinity: Mutex<Affinity>,
    /// Per backend with open connections or flows: the token that ends them once the
    /// backend has been out of the eligible set for the drain time.
    drains: Mutex<HashMap<SocketAddr, Drain>>,
    /// Where drain timers run, and the proxy-wide shutdown that ends them.
    timers: TaskTracker,
    shutdown: CancellationToken,
    pub(super) m: PortMetrics,
}

/// The drain state of one backend's connections.
struct Drain {
    /// Cancelled when the drain time is over: the connections close.
    token: CancellationToken,
    /// Since when the backend gets no new connections (`None` while it does).
    leaving: Option<Instant>,
}

impl PortShared {
    pub(super) fn new(
        service: String,
        protocol: Protocol,
        backends: Backends,
        metrics: &Metrics,
        timers: TaskTracker,
        shutdown: CancellationToken,
    ) -> Self {
        let m = PortMetrics::new(metrics, &service, protocol);
        Self {
            service,
            backends: RwLock::new(Arc::new(backends)),
            affinity: Mutex::new(Affinity::default()),
            drains: Mutex::new(HashMap::new()),
            timers,
            shutdown,
            m,
        }
    }

    /// The token a connection or flow to `backend` ends on when the backend is
    /// drained. Taken after the backend was picked: if it stopped being eligible
    /// meanwhile, its drain time starts now, so no connection escapes draining.
    pub(super) fn drain_token(self: &Arc<Self>, backend: SocketAddr) -> CancellationToken {
        let mut drains = lock(&self.drains);
        let entry = drains.entry(backend).or_insert_with(|| Drain {
            token: CancellationToken::new(),
            leaving: None,
        });
        let token = entry.token.clone();
        if entry.leaving.is_none() {
            // Read under the drains lock, so a concurrent `set_backends` either sees
            // this entry or has already swapped the set read here.
            let b = self.backends();
            if b.eligible.binary_search(&backend).is_err() {
                let now = Instant::now();
                entry.leaving = Some(now);
                drop(drains);
                self.expire_later(backend, now, b.drain);
            }
        }
        token
    }

    /// Marks backends with connections that are no longer eligible (all of them when
    /// `eligible` is `None`: the port is going away) as leaving now, and eligible ones
    /// as staying; each newly leaving one is drained after `drain`.
    pub(super) fn mark_leaving(self: &Arc<Self>, eligible: Option<&[SocketAddr]>, drain: Duration) {
        let now = Instant::now();
        let mut leaving = Vec::new();
        for (addr, d) in lock(&self.drains).iter_mut() {
            let stays = eligible.is_some_and(|e| e.binary_search(addr).is_ok());
            if stays {
                d.leaving = None;
            } else if d.leaving.is_none() {
                d.leaving = Some(now);
                leaving.push(*addr);
            }
        }
        for backend in leaving {
            self.expire_later(backend, now, drain);
        }
    }

    /// After `drain`, ends the connections to `backend` if it has been leaving since
    /// `since` without coming back in between.
    fn expire_later(self: &Arc<Self>, backend: SocketAddr, since: Instant, drain: Duration) {
        let (me, shutdown) = (self.clone(), self.shutdown.clone());
        self.timers.spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(drain) => {
                    let mut drains = lock(&me.drains);
                    if drains.get(&backend).is_some_and(|d| d.leaving == Some(since))
                        && let Some(d) = drains.remove(&backend)
                    {
                        d.token.cancel();
                    }
                }
            }
        });
    }

    /// The current backends.
    pub(super) fn backends(&self) -> Arc<Backends> {
        self.backends
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Swaps in a new backend set. Connections already open are not touched: those
    /// to backends that left the set are drained after the service's drain time.
    pub(super) fn set_backends(self: &Arc<Self>, b: Backends) {
        if b.affinity.is_none() {
            lock(&self.affinity).clients.clear();
        }
        let b = Arc::new(b);
        *self
            .backends
            .write()
            .unwrap_or_else(PoisonError::into_inner) = b.clone();
        self.mark_leaving(Some(&b.eligible), b.drain);
    }

    /// The port is going away: every backend's connections drain.
    pub(super) fn retire(self: &Arc<Self>) {
        self.mark_leaving(None, self.backends().drain);
    }

    /// The backend for a new connection from `client`, `None` when there is none.
    pub(super) fn pick(&self, client: SocketAddr) -> Option<SocketAddr> {
        let b = self.backends();
        let Some(timeout) = b.affinity else {
            let i = b.maglev.lookup(client_hash(client.ip(), client.port()))?;
            return b.eligible.get(i).copied();
        };
        let now = Instant::now();
        let mut aff = lock(&self.affinity);
        if let Some((addr, last)) = aff.clients.get_mut(&client.ip())
            && now.duration_since(*last) < timeout
            && b.eligible.binary_search(addr).is_ok()
        {
            *last = now;
            return Some(*addr);
        }
        let i = b.maglev.lookup(client_hash(client.ip(), 0))?;
        let addr = *b.eligible.get(i)?;
        let map_full = aff.clients.len() >= MAX_AFFINITY_ENTRIES;
        // Sweeping a full map costs a pass over every entry: at most once a second,
        // not once per new client.
        if map_full
            && !aff.clients.contains_key(&client.ip())
            && aff
                .swept
                .is_none_or(|t| now.duration_since(t) >= AFFINITY_SWEEP_EVERY)
        {
            aff.swept = Some(now);
            aff.clients
                .retain(|_, (_, last)| now.duration_since(*last) < timeout);
        }
        let map = &mut aff.clients;
        // When still full the hash alone keeps the client on its backend while the
        // backend set is unchanged.
        if map.len() < MAX_AFFINITY_ENTRIES || map.contains_key(&client.ip()) {
            map.insert(client.ip(), (addr, now));
        }
        Some(addr)
    }
}

#[cfg(test)]
mod tests;
