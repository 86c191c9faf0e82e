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
mod tests;
