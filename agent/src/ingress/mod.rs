//! The `ingress` subsystem (`run --ingress`): an HTTP(S) edge proxy for services
//! with `spec.expose` (docs/ingress.md).
//!
//! Routes ([`routes`]) and certificates ([`tls`]) are rebuilt from the endpoint
//! cache on every change and swapped in whole, so requests never take a lock.
//! Connections are served on the [`workers`] threads, each with its own listeners
//! and upstream connections ([`serve`]): plain proxied HTTP/1.1 requests on the
//! [`fastpath`], everything else by hyper (HTTP/1.1 and h2, on both listeners);
//! TLS handshakes run on threads of their own ([`handshakes`]); each
//! request goes to the least loaded ready endpoint of its route ([`proxy`]);
//! `Upgrade` requests (WebSocket) are spliced through once the endpoint agrees
//! ([`upgrade`]). Routes with `tls.mode: acme` get their certificates from
//! [`acme`], which the plain listener helps by answering HTTP-01 challenges.

mod access_log;
pub mod acme;
mod activity;
mod answers;
mod body;
mod body_limit;
mod client_cert;
mod client_stream;
mod conn_cap;
mod fastpath;
mod handshakes;
mod headers;
mod metrics;
mod proxy;
mod route_status;
mod routes;
mod serve;
mod tls;
mod upgrade;
mod upstream;
mod workers;

pub use acme::{AcmeCertStatus, AcmeServer, AcmeSettings};
pub use metrics::IngressMetrics;
pub use proxy::ProxyLimits;
pub use route_status::RouteStatus;

use crate::{
    endpoints::{EndpointCache, ServiceView},
    model::{Kind, ServiceKey},
    subsystem::{Readiness, ReadySetter, StartContext, Subsystem, SubsystemError},
};
use acme::Acme;
use client_cert::TlsConfigs;
use conn_cap::ConnCap;
use handshakes::Handshakes;
use proxy::Proxy;
use routes::RouteTable;
use serve::Serve;
use std::{
    collections::BTreeSet,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};
use tls::CertMap;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// What the ingress proxy listens on and how it treats clients.
#[derive(Clone, Debug)]
pub struct IngressConfig {
    /// The plain-HTTP listener.
    pub addr: SocketAddr,
    /// The TLS listener.
    pub tls_addr: SocketAddr,
    /// Time for a request's headers (and a TLS handshake).
    pub header_timeout: Duration,
    /// Time an idle client connection is kept.
    pub idle_timeout: Duration,
    /// Largest request head in bytes (431 beyond).
    pub max_header_bytes: usize,
    /// Most client connections open at once, both listeners together.
    pub max_connections: usize,
    /// Worker threads serving clients, each with its own listeners and upstream
    /// connections (at least 1).
    pub workers: usize,
    /// Threads doing TLS handshakes for the workers (0: each worker its own).
    pub handshake_threads: usize,
    /// Plain HTTP/1.1 requests on the fast path ([`fastpath`]), else all on hyper.
    pub fast_path: bool,
    /// The Secret whose certificate answers names no route has (else refused).
    pub default_cert: Option<ServiceKey>,
    /// Upstream limits and forwarding rules.
    pub limits: ProxyLimits,
    /// Certificates for routes with `tls.mode: acme`.
    pub acme: AcmeSettings,
}

/// The `ingress` subsystem.
pub struct IngressServer {
    config: IngressConfig,
    cache: Arc<EndpointCache>,
    proxy: Arc<Proxy>,
    resolver: Arc<tls::SniResolver>,
    acme: Arc<Acme>,
    metrics: IngressMetrics,
    ready: ReadySetter,
    readiness: Readiness,
    tasks: TaskTracker,
    /// The addresses bound (the configured ones, with port 0 resolved).
    bound: Mutex<Option<(SocketAddr, SocketAddr)>>,
}

impl IngressServer {
    /// A server fed by `cache`, counting into `ingress` (the agent's
    /// `rune_ingress_*` families).
    pub fn new(config: IngressConfig, cache: Arc<EndpointCache>, ingress: IngressMetrics) -> Self {
        let (ready, readiness) = Readiness::new();
        let proxy = Proxy::new(config.limits.clone(), ingress.clone());
        let acme = Acme::new(config.acme.clone(), proxy.challenges.clone());
        Self {
            proxy: Arc::new(proxy),
            acme: Arc::new(acme),
            config,
            cache,
            resolver: Arc::new(tls::SniResolver::default()),
            metrics: ingress,
            ready,
            readiness,
            tasks: TaskTracker::new(),
            bound: Mutex::new(None),
        }
    }

    /// Each ACME certificate's state, for `status`.
    pub fn acme_status(&self) -> Arc<dyn Fn() -> Vec<AcmeCertStatus> + Send + Sync> {
        let acme = self.acme.clone();
        Arc::new(move || acme.status())
    }

    /// Each route, for `status`.
    pub fn route_status(&self) -> Arc<dyn Fn() -> Vec<RouteStatus> + Send + Sync> {
        let (routes, resolver) = (self.proxy.routes.clone(), self.resolver.clone());
        Arc::new(move || route_status::routes(&routes.load(), &resolver.certs.load()))
    }

    /// The plain and TLS addresses bound, once started.
    pub fn bound(&self) -> Option<(SocketAddr, SocketAddr)> {
        *crate::lock::lock(&self.bound)
    }
}

#[async_trait::async_trait]
impl Subsystem for IngressServer {
    fn name(&self) -> &str {
        "ingress"
    }

    async fn start(&self, ctx: &StartContext) -> Result<(), SubsystemError> {
        let workers = self.config.workers.max(1);
        let plain = workers::bind(self.config.addr, workers)?;
        let secure = workers::bind(self.config.tls_addr, workers)?;
        let local = |l: &std::net::TcpListener, a| l.local_addr().unwrap_or(a);
        let addrs = (
            local(&plain[0], self.config.addr),
            local(&secure[0], self.config.tls_addr),
        );
        *crate::lock::lock(&self.bound) = Some(addrs);
        let tls_configs = TlsConfigs::new(self.resolver.clone())
            .map_err(|e| SubsystemError::failed("ingress: TLS configuration", e))?;
        self.tasks.spawn(follow(
            Follow {
                cache: self.cache.clone(),
                proxy: self.proxy.clone(),
                resolver: self.resolver.clone(),
                acme: self.acme.clone(),
                default_cert: self.config.default_cert.clone(),
                metrics: self.metrics.clone(),
            },
            self.ready.clone(),
            ctx.cancel.clone(),
        ));
        self.tasks
            .spawn(self.acme.clone().run(ctx.cancel.child_token()));
        let cap = Arc::new(ConnCap::new(self.config.max_connections));
        let serves = plain
            .into_iter()
            .zip(secure)
            .map(|(plain, secure)| {
                let serve = Serve {
                    proxy: Arc::new(self.proxy.for_worker()),
                    cap: cap.clone(),
                    config: self.config.clone(),
                    metrics: self.metrics.clone(),
                    tasks: TaskTracker::new(),
                    cancel: ctx.cancel.clone(),
                };
                (serve, plain, secure)
            })
            .collect();
        let handshakes = Handshakes::start(
            self.config.handshake_threads,
            Arc::new(tls_configs),
            self.proxy.routes.clone(),
            self.config.header_timeout,
            &self.tasks,
        )
        .map_err(|e| SubsystemError::io("ingress: TLS handshake threads", e))?;
        workers::spawn(serves, &Arc::new(handshakes), &self.tasks)?;
        tracing::info!(
            http = %addrs.0,
            https = %addrs.1,
            workers,
            handshake_threads = self.config.handshake_threads,
            "ingress serving"
        );
        Ok(())
    }

    fn ready(&self) -> Readiness {
        self.readiness.clone()
    }

    async fn stop(&self) -> Result<(), SubsystemError> {
        self.tasks.close();
        self.tasks.wait().await;
        Ok(())
    }
}

/// What the route watcher reads and writes.
struct Follow {
    cache: Arc<EndpointCache>,
    proxy: Arc<Proxy>,
    resolver: Arc<tls::SniResolver>,
    acme: Arc<Acme>,
    default_cert: Option<ServiceKey>,
    metrics: IngressMetrics,
}

/// Rebuilds the routes and certificates on every cache delta and every ACME
/// certificate change; ready after the first.
async fn follow(f: Follow, ready: ReadySetter, cancel: CancellationToken) {
    let Follow {
        cache,
        proxy,
        resolver,
        acme,
        default_cert,
        metrics,
    } = f;
    let mut sub = cache.subscribe();
    let mut acme_changes = acme.changes();
    let mut secrets_seen = None;
    loop {
        let delta = tokio::select! {
            () = cancel.cancelled() => return,
            d = sub.next() => Some(d),
            _ = acme_changes.changed() => None,
        };
        let secrets_at = cache.secrets_changed_at();
        if delta.as_ref().is_some_and(|d| d.only_revision()) && secrets_seen == Some(secrets_at) {
            continue;
        }
        secrets_seen = Some(secrets_at);
        // The whole table: simple, and cheap next to the changes that cause it.
        let (views, secrets) = (cache.views(), cache.secrets());
        acme.want(acme_hosts(&views));
        proxy
            .routes
            .store(Arc::new(RouteTable::build(&views, &secrets)));
        let certs = CertMap::build(&views, &secrets, default_cert.as_ref(), &acme.certs());
        metrics.certificate_expiry.clear();
        for (host, expiry) in &certs.expiries {
            let labels = metrics::HostLabels { host: host.clone() };
            metrics
                .certificate_expiry
                .get_or_create(&labels)
                .set(*expiry);
        }
        resolver.certs.store(Arc::new(certs));
        tracing::debug!(
            revision = ?delta.as_ref().map(|d| d.revision),
            secrets = cache.counts().get(&Kind::Secret).copied().unwrap_or(0),
            "ingress routes rebuilt"
        );
        // Ready once the cache's first delta is in, not on an ACME change before it.
        if delta.is_some() {
            ready.set_ready();
        }
    }
}

/// The hosts of routes with `tls.mode: acme`.
fn acme_hosts(views: &[ServiceView]) -> BTreeSet<String> {
    views
        .iter()
        .filter_map(|v| v.service.spec.expose.as_ref()?.acme_host())
        .map(str::to_owned)
        .collect()
}
