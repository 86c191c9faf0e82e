//! Prometheus metrics of the agent (names prefixed `rune_`), and the HTTP listener that
//! serves them with `/healthz` and `/readyz`.
//!
//! Handles are cheap clones (`Arc` inside), so subsystems keep the ones they update on
//! hot paths instead of looking them up per event.

use std::{convert::Infallible, sync::Arc, time::Duration};

use http_body_util::Full;
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Bytes, Incoming},
    header::{self, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};
use tokio::net::TcpListener;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::subsystem::{Readiness, StartContext, Subsystem, SubsystemError};

/// Labels of per-subsystem metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SubsystemLabels {
    /// The subsystem's stable name, as in `status`.
    pub subsystem: String,
}

/// Labels of per-kind object counts.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// Object kind, e.g. `Service`.
    pub kind: String,
}

/// Labels of a service port handled by a proxy: `service` is `namespace/name`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServicePortLabels {
    /// `namespace/name` of the service.
    pub service: String,
    /// The service port (before any dev-mode offset).
    pub port: u16,
    /// `TCP` or `UDP`.
    pub protocol: String,
}

/// Labels of proxied connections (UDP: flows) by outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectionLabels {
    /// `namespace/name` of the service.
    pub service: String,
    /// `TCP` or `UDP`.
    pub protocol: String,
    /// `ok`, `no_backend` (refused: no ready endpoint) or `dial_error`.
    pub result: String,
}

/// Labels of proxied bytes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BytesLabels {
    /// `namespace/name` of the service.
    pub service: String,
    /// `TCP` or `UDP`.
    pub protocol: String,
    /// `to_backend` or `to_client`.
    pub direction: String,
}

/// Labels of DNS queries answered by the embedded DNS server.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DnsQueryLabels {
    /// The query type (`A`, `AAAA`, `SRV`, ...).
    pub r#type: &'static str,
    /// The response code (`NOERROR`, `NXDOMAIN`, `REFUSED`, ...).
    pub rcode: &'static str,
    /// `rune` for names the agent is authoritative for, `other` for the rest.
    pub zone: &'static str,
}

/// Labels of failed upstream DNS exchanges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DnsUpstreamErrorLabels {
    /// `timeout`, `io`, `malformed` or `overloaded` (too many questions in flight).
    pub reason: &'static str,
}

/// Labels of DNS query latency.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DnsZoneLabels {
    /// `rune` for names the agent is authoritative for, `other` for the rest.
    pub zone: &'static str,
}

/// Labels of the data plane mode gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DataplaneModeLabels {
    /// `ebpf`, `nftables` or `userspace`.
    pub mode: String,
}

/// Labels of a preflight check's result.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PreflightCheckLabels {
    /// The check's name, as `rune-agent preflight` prints it.
    pub check: String,
}

/// The buckets of `rune_dns_query_duration_seconds`: 50 µs to about 3.3 s.
fn dns_duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_05, 4.0, 9))
}

/// The data plane's scrape-time counters, plugged in after [`Metrics::new`] (the
/// data plane is built after the metrics). prometheus-client encodes a collector
/// with an encoder it cannot lend twice, so there is one slot.
#[derive(Debug, Default)]
struct DataplaneCollector(std::sync::RwLock<Option<Box<dyn Collector>>>);

impl Collector for DataplaneCollector {
    fn encode(&self, encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let collector = self
            .0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match collector.as_ref() {
            Some(c) => c.encode(encoder),
            None => Ok(()),
        }
    }
}

/// Every metric the agent exports, registered once in [`Metrics::new`].
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    dataplane: Arc<DataplaneCollector>,
    /// `rune_subsystem_ready{subsystem}`: 1 when the subsystem reported ready.
    pub subsystem_ready: Family<SubsystemLabels, Gauge>,
    /// `rune_objects{kind}`: objects in the agent's cache, by kind.
    pub objects: Family<KindLabels, Gauge>,
    /// `rune_revision_applied`: the last ordered-log revision the agent applied.
    pub revision_applied: Gauge,
    /// `rune_proxy_connections_total{service,protocol,result}`.
    pub proxy_connections: Family<ConnectionLabels, Counter>,
    /// `rune_proxy_bytes_total{service,protocol,direction}`.
    pub proxy_bytes: Family<BytesLabels, Counter>,
    /// `rune_proxy_listener_up{service,port,protocol}`: 1 listening, 0 failed to bind.
    pub proxy_listener_up: Family<ServicePortLabels, Gauge>,
    /// `rune_outbox_depth`: entries waiting in the outbox.
    pub outbox_depth: Gauge,
    /// `rune_outbox_dropped_total`: entries refused because the outbox was full.
    pub outbox_dropped: Counter,
    /// `rune_dns_queries_total{type,rcode,zone}`: queries answered by the DNS server.
    pub dns_queries: Family<DnsQueryLabels, Counter>,
    /// `rune_dns_upstream_errors_total{reason}`: failed exchanges with upstreams.
    pub dns_upstream_errors: Family<DnsUpstreamErrorLabels, Counter>,
    /// `rune_dns_cache_hits_total`: forwarded questions answered from the cache.
    pub dns_cache_hits: Counter,
    /// `rune_dns_cache_misses_total`: forwarded questions sent upstream.
    pub dns_cache_misses: Counter,
    /// `rune_dns_query_duration_seconds{zone}`: time from query to response.
    pub dns_query_duration: Family<DnsZoneLabels, Histogram, fn() -> Histogram>,
    /// `rune_dataplane_mode{mode}`: 1 for the data plane carrying services.
    pub dataplane_mode: Family<DataplaneModeLabels, Gauge>,
    /// `rune_preflight_check{check}`: 1 passed, 0 failed at the last start.
    pub preflight_check: Family<PreflightCheckLabels, Gauge>,
}

impl Metrics {
    /// Every metric, zeroed and registered under its `rune_` name.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("rune");
        let subsystem_ready = Family::<SubsystemLabels, Gauge>::default();
        registry.register(
            "subsystem_ready",
            "1 when the subsystem reported ready, 0 otherwise",
            subsystem_ready.clone(),
        );
        let objects = Family::<KindLabels, Gauge>::default();
        registry.register(
            "objects",
            "Objects in the agent's cache, by kind",
            objects.clone(),
        );
        let revision_applied = Gauge::default();
        registry.register(
            "revision_applied",
            "The last ordered-log revision the agent applied",
            revision_applied.clone(),
        );
        let proxy_connections = Family::<ConnectionLabels, Counter>::default();
        registry.register(
            "proxy_connections",
            "Connections (UDP: flows) handled by the userspace proxies, by result",
            proxy_connections.clone(),
        );
        let proxy_bytes = Family::<BytesLabels, Counter>::default();
        registry.register(
            "proxy_bytes",
            "Bytes copied by the userspace proxies, by direction",
            proxy_bytes.clone(),
        );
        let proxy_listener_up = Family::<ServicePortLabels, Gauge>::default();
        registry.register(
            "proxy_listener_up",
            "1 when the proxy listens on the service port, 0 when it failed to bind",
            proxy_listener_up.clone(),
        );
        let outbox_depth = Gauge::default();
        registry.register(
            "outbox_depth",
            "Entries waiting in the outbox",
            outbox_depth.clone(),
        );
        let outbox_dropped = Counter::default();
        registry.register(
            "outbox_dropped",
            "Entries refused because the outbox was full",
            outbox_dropped.clone(),
        );
        let dns_queries = Family::<DnsQueryLabels, Counter>::default();
        registry.register(
            "dns_queries",
            "DNS queries answered, by query type, response code and zone",
            dns_queries.clone(),
        );
        let dns_upstream_errors = Family::<DnsUpstreamErrorLabels, Counter>::default();
        registry.register(
            "dns_upstream_errors",
            "Failed exchanges with upstream DNS resolvers, by reason",
            dns_upstream_errors.clone(),
        );
        let dns_cache_hits = Counter::default();
        registry.register(
            "dns_cache_hits",
            "Forwarded DNS questions answered from the cache",
            dns_cache_hits.clone(),
        );
        let dns_cache_misses = Counter::default();
        registry.register(
            "dns_cache_misses",
            "Forwarded DNS questions sent to an upstream",
            dns_cache_misses.clone(),
        );
        let dns_query_duration =
            Family::<DnsZoneLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                dns_duration_histogram,
            );
        registry.register(
            "dns_query_duration_seconds",
            "Time from a DNS query to its response, by zone",
            dns_query_duration.clone(),
        );
        let dataplane_mode = Family::<DataplaneModeLabels, Gauge>::default();
        registry.register(
            "dataplane_mode",
            "1 for the data plane carrying services (ebpf, nftables or userspace)",
            dataplane_mode.clone(),
        );
        let preflight_check = Family::<PreflightCheckLabels, Gauge>::default();
        registry.register(
            "preflight_check",
            "1 when the preflight check passed at start, 0 when it failed",
            preflight_check.clone(),
        );
        let dataplane = Arc::new(DataplaneCollector::default());
        registry.register_collector(Box::new(dataplane.clone()));
        Self {
            registry,
            dataplane,
            subsystem_ready,
            objects,
            revision_applied,
            proxy_connections,
            proxy_bytes,
            proxy_listener_up,
            outbox_depth,
            outbox_dropped,
            dns_queries,
            dns_upstream_errors,
            dns_cache_hits,
            dns_cache_misses,
            dns_query_duration,
            dataplane_mode,
            preflight_check,
        }
    }

    /// Records the data plane in use and each preflight check's result.
    pub fn set_dataplane(&self, mode: &str, checks: &[(String, bool)]) {
        self.dataplane_mode
            .get_or_create(&DataplaneModeLabels { mode: mode.into() })
            .set(1);
        for (check, passed) in checks {
            self.preflight_check
                .get_or_create(&PreflightCheckLabels {
                    check: check.clone(),
                })
                .set(i64::from(*passed));
        }
    }

    /// Sets the data plane's metrics, read at each scrape (its kernel counters).
    pub fn set_dataplane_collector(&self, collector: impl Collector) {
        *self
            .dataplane
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Box::new(collector));
    }

    /// The current values in the OpenMetrics text format (what `/metrics` serves).
    pub fn encode(&self) -> String {
        let mut text = String::new();
        if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            // Writing into a String does not fail; a metric's encoder would have to.
            tracing::error!(%error, "encoding metrics failed; serving what was written");
        }
        text
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The content type of [`Metrics::encode`]'s output.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long a client may take to send its request headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long to pause after a failed accept (e.g. out of file descriptors).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Connections served at once by the metrics listener.
const MAX_CONNECTIONS: usize = 64;

/// How long an open connection may take to finish once the listener stops.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Serves `GET /metrics`, `/healthz` (always 200 while the process runs) and
/// `/readyz` (503 until `ready` is set, then 200) on `listener`, over HTTP/1.
///
/// Returns once `cancel` is cancelled and every open connection has finished its
/// request in flight.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    ready: Readiness,
    cancel: CancellationToken,
) {
    let connections = TaskTracker::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = tokio::select! {
            () = cancel.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "metrics listener: accept failed");
                    tokio::select! {
                        () = cancel.cancelled() => break,
                        () = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => continue,
                    }
                }
            },
        };
        // Bounded: a flood of connections must not take the descriptors the
        // proxies need. Extra ones are closed at once.
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::debug!(%peer, "metrics listener: too many connections, closing");
            continue;
        };
        let metrics = Arc::clone(&metrics);
        let ready = ready.clone();
        let cancel = cancel.clone();
        connections.spawn(async move {
            let service = service_fn(move |request: Request<Incoming>| {
                let response = respond(&request, &metrics, &ready);
                async move { Ok::<_, Infallible>(response) }
            });
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                () = cancel.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    // A client that stops reading must not hold the agent's stop.
                    match tokio::time::timeout(SHUTDOWN_GRACE, connection).await {
                        Ok(result) => result,
                        Err(_) => Ok(()),
                    }
                }
            };
            drop(permit);
            if let Err(error) = result {
                tracing::debug!(%error, %peer, "metrics listener: connection ended with an error");
            }
        });
    }
    connections.close();
    connections.wait().await;
}

/// The response to one request on the metrics listener.
fn respond(
    request: &Request<Incoming>,
    metrics: &Metrics,
    ready: &Readiness,
) -> Response<Full<Bytes>> {
    let path = request.uri().path();
    let known = matches!(path, "/metrics" | "/healthz" | "/readyz");
    if !known {
        return text(StatusCode::NOT_FOUND, "not found");
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
        response
            .headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    match path {
        "/metrics" => {
            let mut response = Response::new(Full::new(Bytes::from(metrics.encode())));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(OPENMETRICS_CONTENT_TYPE),
            );
            response
        }
        "/readyz" if !ready.is_ready() => text(StatusCode::SERVICE_UNAVAILABLE, "not ready"),
        _ => text(StatusCode::OK, "ok"),
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// The `metrics` subsystem: binds the listener at start (a taken address fails the
/// start, naming it) and serves until stopped.
pub struct MetricsServer {
    addr: std::net::SocketAddr,
    metrics: Arc<Metrics>,
    agent_ready: Readiness,
    tasks: TaskTracker,
}

impl MetricsServer {
    /// A server for `addr`; `/readyz` follows `agent_ready`.
    pub fn new(addr: std::net::SocketAddr, metrics: Arc<Metrics>, agent_ready: Readiness) -> Self {
        Self {
            addr,
            metrics,
            agent_ready,
            tasks: TaskTracker::new(),
        }
    }
}

#[async_trait::async_trait]
impl Subsystem for MetricsServer {
    fn name(&self) -> &str {
        "metrics"
    }

    async fn start(&self, ctx: &StartContext) -> Result<(), SubsystemError> {
        let listener = TcpListener::bind(self.addr)
            .await
            .map_err(|e| SubsystemError::io(format!("bind metrics listener {}", self.addr), e))?;
        tracing::info!(addr = %self.addr, "serving /metrics, /healthz, /readyz");
        self.tasks.spawn(serve(
            listener,
            self.metrics.clone(),
            self.agent_ready.clone(),
            ctx.cancel.clone(),
        ));
        Ok(())
    }

    fn ready(&self) -> Readiness {
        Readiness::ready()
    }

    async fn stop(&self) -> Result<(), SubsystemError> {
        self.tasks.close();
        self.tasks.wait().await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// One HTTP/1.0 request; returns the status code and the body.
    async fn get(addr: SocketAddr, method: &str, path: &str) -> (u16, String, String) {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(format!("{method} {path} HTTP/1.0\r\nHost: test\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut raw = String::new();
        tokio::time::timeout(Duration::from_secs(2), stream.read_to_string(&mut raw))
            .await
            .expect("server did not close the connection")
            .unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, head.to_owned(), body.to_owned())
    }

    struct Server {
        addr: SocketAddr,
        cancel: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    }

    async fn start(metrics: Arc<Metrics>, ready: Readiness) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(serve(listener, metrics, ready, cancel.clone()));
        Server { addr, cancel, task }
    }

    #[test]
    fn every_metric_is_registered_under_its_documented_name() {
        let metrics = Metrics::new();
        metrics
            .subsystem_ready
            .get_or_create(&SubsystemLabels {
                subsystem: "dns".into(),
            })
            .set(1);
        metrics
            .objects
            .get_or_create(&KindLabels {
                kind: "Service".into(),
            })
            .set(2);
        metrics
            .proxy_connections
            .get_or_create(&ConnectionLabels {
                service: "default/web".into(),
                protocol: "TCP".into(),
                result: "ok".into(),
            })
            .inc();
        metrics
            .proxy_bytes
            .get_or_create(&BytesLabels {
                service: "default/web".into(),
                protocol: "TCP".into(),
                direction: "to_backend".into(),
            })
            .inc_by(10);
        metrics
            .proxy_listener_up
            .get_or_create(&ServicePortLabels {
                service: "default/web".into(),
                port: 80,
                protocol: "TCP".into(),
            })
            .set(1);
        metrics.revision_applied.set(7);
        metrics.set_dataplane(
            "ebpf",
            &[("btf".to_owned(), true), ("nft".to_owned(), false)],
        );
        let text = metrics.encode();
        for line in [
            "rune_subsystem_ready{subsystem=\"dns\"} 1",
            "rune_objects{kind=\"Service\"} 2",
            "rune_revision_applied 7",
            "rune_proxy_connections_total{service=\"default/web\",protocol=\"TCP\",result=\"ok\"} 1",
            "rune_proxy_bytes_total{service=\"default/web\",protocol=\"TCP\",direction=\"to_backend\"} 10",
            "rune_proxy_listener_up{service=\"default/web\",port=\"80\",protocol=\"TCP\"} 1",
            "rune_outbox_depth 0",
            "rune_outbox_dropped_total 0",
            "rune_dataplane_mode{mode=\"ebpf\"} 1",
            "rune_preflight_check{check=\"btf\"} 1",
            "rune_preflight_check{check=\"nft\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in:\n{text}"
            );
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[tokio::test]
    async fn readyz_is_503_until_ready_then_200() {
        let (setter, ready) = Readiness::new();
        let server = start(Arc::new(Metrics::new()), ready).await;

        let (status, _, body) = get(server.addr, "GET", "/readyz").await;
        assert_eq!((status, body.as_str()), (503, "not ready"));
        setter.set_ready();
        let (status, _, body) = get(server.addr, "GET", "/readyz").await;
        assert_eq!((status, body.as_str()), (200, "ok"));
        setter.set_not_ready();
        assert_eq!(get(server.addr, "GET", "/readyz").await.0, 503);

        server.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(2), server.task)
            .await
            .expect("serve did not end on cancel")
            .unwrap();
    }

    #[tokio::test]
    async fn metrics_healthz_and_unknown_paths() {
        let metrics = Arc::new(Metrics::new());
        metrics.outbox_depth.set(3);
        let (_setter, ready) = Readiness::new();
        let server = start(metrics, ready).await;

        let (status, head, body) = get(server.addr, "GET", "/metrics").await;
        assert_eq!(status, 200);
        assert!(
            head.to_ascii_lowercase()
                .contains(&format!("content-type: {OPENMETRICS_CONTENT_TYPE}")),
            "{head}"
        );
        assert!(body.contains("rune_outbox_depth 3"), "{body}");
        assert!(body.contains("rune_outbox_dropped_total 0"), "{body}");

        assert_eq!(get(server.addr, "GET", "/healthz").await.0, 200);
        assert_eq!(get(server.addr, "GET", "/healthz").await.2, "ok");
        assert_eq!(get(server.addr, "GET", "/nope").await.0, 404);
        assert_eq!(get(server.addr, "POST", "/metrics").await.0, 405);

        server.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(2), server.task)
            .await
            .expect("serve did not end on cancel")
            .unwrap();
    }

    #[tokio::test]
    async fn cancel_ends_serve_with_an_idle_connection_open() {
        let (_setter, ready) = Readiness::new();
        let server = start(Arc::new(Metrics::new()), ready).await;
        // A client that connects and never sends a request.
        let _idle = tokio::net::TcpStream::connect(server.addr).await.unwrap();
        // Make sure the server accepted it: a full request on another connection.
        assert_eq!(get(server.addr, "GET", "/healthz").await.0, 200);
        server.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(2), server.task)
            .await
            .expect("serve did not end on cancel while a connection was idle")
            .unwrap();
    }

    #[tokio::test]
    async fn cancel_ends_serve_while_a_client_does_not_read_its_answer() {
        use tokio::io::AsyncWriteExt;
        // A body far larger than the socket buffers (about 15 MB).
        let metrics = Metrics::new();
        for i in 0..150_000 {
            metrics
                .proxy_bytes
                .get_or_create(&BytesLabels {
                    service: format!("default/service-{i}"),
                    protocol: "TCP".into(),
                    direction: "to_backend".into(),
                })
                .inc();
        }
        let (_setter, ready) = Readiness::new();
        let server = start(Arc::new(metrics), ready).await;
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        let mut stuck = sock.connect(server.addr).await.unwrap();
        stuck
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        // Let the server start answering into the full socket.
        tokio::time::sleep(Duration::from_millis(500)).await;
        server.cancel.cancel();
        tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(3), server.task)
            .await
            .expect("a client that does not read held the listener's stop")
            .unwrap();
    }
}
