//! The `ingress` subsystem (`run --ingress`): an HTTP(S) edge proxy for services
//! with `spec.expose` (docs/ingress.md).
//!
//! Routes ([`routes`]) and certificates ([`tls`]) are rebuilt from the endpoint
//! cache on every change and swapped in whole, so requests never take a lock.
//! Connections are served by hyper (HTTP/1.1 and h2, on both listeners); each
//! request goes to the least loaded ready endpoint of its route ([`proxy`]);
//! `Upgrade` requests (WebSocket) are spliced through once the endpoint agrees
//! ([`upgrade`]). Routes with `tls.mode: acme` get their certificates from
//! [`acme`], which the plain listener helps by answering HTTP-01 challenges.

mod access_log;
pub mod acme;
mod activity;
mod body_limit;
mod client_cert;
mod conn_cap;
mod headers;
mod metrics;
mod proxy;
mod routes;
mod tls;
mod upgrade;

pub use acme::{AcmeCertStatus, AcmeServer, AcmeSettings};
pub use metrics::IngressMetrics;
pub use proxy::ProxyLimits;

use crate::{
    endpoints::{EndpointCache, ServiceView},
    model::{Kind, ServiceKey},
    subsystem::{Readiness, ReadySetter, StartContext, Subsystem, SubsystemError},
};
use acme::Acme;
use activity::Activity;
use client_cert::{TlsConfigs, TlsSession};
use conn_cap::ConnCap;
use hyper::{Request, body::Incoming, service::service_fn};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::conn::auto,
};
use metrics::ReasonLabels;
use proxy::Proxy;
use routes::RouteTable;
use std::{
    collections::BTreeSet,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};
use tls::CertMap;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpListener,
};
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
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|e| SubsystemError::io(format!("ingress: bind TCP {addr}"), e))
        };
        let plain = bind(self.config.addr).await?;
        let secure = bind(self.config.tls_addr).await?;
        let local = |l: &TcpListener, a| l.local_addr().unwrap_or(a);
        let addrs = (
            local(&plain, self.config.addr),
            local(&secure, self.config.tls_addr),
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
        let serve = Arc::new(Serve {
            proxy: self.proxy.clone(),
            cap: ConnCap::new(self.config.max_connections),
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            tasks: self.tasks.clone(),
            cancel: ctx.cancel.clone(),
        });
        self.tasks.spawn(serve.clone().accept(plain, None));
        self.tasks
            .spawn(serve.accept(secure, Some(Arc::new(tls_configs))));
        tracing::info!(http = %addrs.0, https = %addrs.1, "ingress serving");
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

/// What the accept loops and connections share.
struct Serve {
    proxy: Arc<Proxy>,
    config: IngressConfig,
    metrics: IngressMetrics,
    tasks: TaskTracker,
    cancel: CancellationToken,
    /// Room for client connections, shared by both listeners.
    cap: ConnCap,
}

impl Serve {
    /// Accepts connections until cancelled; each is served in its own task.
    async fn accept(self: Arc<Self>, listener: TcpListener, tls: Option<Arc<TlsConfigs>>) {
        loop {
            let (stream, peer) = tokio::select! {
                () = self.cancel.cancelled() => return,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(error) => {
                        // Out of file descriptors and the like: pause, then go on.
                        tracing::warn!(%error, "ingress: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            // At the cap, the accepted client waits (and later ones in the
            // backlog) until a connection closes; idle ones are asked to. A place
            // is taken only for a connection in hand, so the listeners waiting
            // for clients hold none.
            let permit = tokio::select! {
                () = self.cancel.cancelled() => return,
                p = self.cap.room() => p,
            };
            let _ = stream.set_nodelay(true);
            let this = self.clone();
            let tls = tls.clone();
            self.tasks.spawn(async move {
                let _permit = permit;
                match tls {
                    None => this.connection(stream, peer, None).await,
                    Some(configs) => {
                        let handshake = tokio::time::timeout(
                            this.config.header_timeout,
                            configs.accept(stream, |host| {
                                this.proxy.routes.load().requests_client_cert(host)
                            }),
                        );
                        match handshake.await {
                            Ok(Ok((stream, session))) => {
                                this.connection(stream, peer, Some(Arc::new(session))).await
                            }
                            Ok(Err(e)) => this.handshake_failed(peer, &e),
                            Err(_) => this.count_tls_error("timeout"),
                        }
                    }
                }
            });
        }
    }

    fn handshake_failed(&self, peer: SocketAddr, e: &std::io::Error) {
        let text = e.to_string();
        let reason = if text.contains("no server certificate") {
            "unknown_sni"
        } else {
            "handshake"
        };
        tracing::debug!(%peer, error = %text, "ingress: TLS handshake failed");
        self.count_tls_error(reason);
    }

    fn count_tls_error(&self, reason: &'static str) {
        self.metrics
            .tls_handshake_errors
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Serves one client connection (HTTP/1.1 or h2) until it ends, idles out or
    /// the subsystem stops (then gracefully).
    async fn connection<S>(&self, stream: S, peer: SocketAddr, tls: Option<Arc<TlsSession>>)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let activity = Arc::new(Activity::new());
        let service = {
            let (proxy, activity) = (self.proxy.clone(), activity.clone());
            service_fn(move |req: Request<Incoming>| {
                let (proxy, activity, tls) = (proxy.clone(), activity.clone(), tls.clone());
                async move {
                    activity.begin();
                    let resp = proxy.handle(req, peer, tls.as_deref()).await;
                    activity.end();
                    Ok::<_, std::convert::Infallible>(resp)
                }
            })
        };
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(self.config.header_timeout)
            .max_buf_size(self.config.max_header_bytes);
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_header_list_size(u32::try_from(self.config.max_header_bytes).unwrap_or(u32::MAX));
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
        tokio::pin!(conn);
        let idle = self.config.idle_timeout;
        let mut tick = tokio::time::interval(idle / 4);
        let stopping = loop {
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(error) = r {
                        tracing::debug!(%peer, %error, "ingress: connection ended");
                    }
                    return;
                }
                () = self.cancel.cancelled() => break true,
                _ = tick.tick() => if activity.idle_for() >= idle { break false },
                () = self.cap.pressure() => if activity.idle_after_requests() { break false },
            }
        };
        // Responses under way finish (a body still streaming after an idle tick
        // too); the agent's stop waits for them a bounded time only.
        conn.as_mut().graceful_shutdown();
        if stopping {
            let _ = tokio::time::timeout(self.config.header_timeout, conn).await;
        } else {
            let _ = conn.await;
        }
    }
}
