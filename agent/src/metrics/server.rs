//! The `metrics` subsystem: the HTTP listener that serves the agent's metrics on
//! `/metrics`, its liveness on `/healthz` and its readiness on `/readyz`.

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
use tokio::net::TcpListener;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use super::{Metrics, OPENMETRICS_CONTENT_TYPE};
use crate::subsystem::{Readiness, StartContext, Subsystem, SubsystemError};

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
    use crate::metrics::BytesLabels;

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
