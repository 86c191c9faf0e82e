//! Requests to endpoints: HTTP/1.1 over this worker's pooled connections, each
//! driven inside the task of the request using it ([`Http1Pool`]), h2c over
//! hyper-util's pooled client, and the raw connections of the HTTP/1.1 fast path
//! ([`Origins`]).

mod driven;
mod origins;
mod pool;
#[cfg(test)]
mod tests;

pub use origins::{Origin, Origins};
pub use pool::Http1Pool;

use super::{body::ProxyBody, routes::Backend};
use hyper::{StatusCode, Uri, http::uri::PathAndQuery};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use std::time::Duration;

/// How long an unused connection is kept.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Why an upstream exchange failed.
pub enum Failure {
    /// No connection could be made (nothing was sent).
    Connect,
    /// No response headers within the response timeout.
    Timeout,
    /// The connection broke or the response was not HTTP.
    Protocol,
}

impl Failure {
    /// The client's answer: its status and the proxy's short text (no internal
    /// error text), the same on both ways of serving.
    pub fn answer(&self) -> (StatusCode, &'static str) {
        match self {
            Failure::Timeout => (StatusCode::GATEWAY_TIMEOUT, "upstream timeout\n"),
            Failure::Connect | Failure::Protocol => (StatusCode::BAD_GATEWAY, "upstream error\n"),
        }
    }

    /// The `reason` label of `rune_ingress_upstream_errors_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Timeout => "timeout",
            Failure::Protocol => "protocol",
        }
    }
}

/// The pooled h2c client to endpoints (one multiplexed connection each), each
/// connected within `connect_timeout`.
pub fn h2c_client(connect_timeout: Duration) -> Client<HttpConnector, ProxyBody> {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .pool_idle_timeout(IDLE_TIMEOUT)
        .http2_only(true)
        .timer(hyper_util::rt::TokioTimer::new())
        .build(connector)
}

/// Whether a request of `method` may be sent twice (RFC 9110 §9.2.2).
pub fn is_idempotent(method: &str) -> bool {
    matches!(
        method,
        "GET" | "HEAD" | "OPTIONS" | "PUT" | "DELETE" | "TRACE"
    )
}

/// `http://ADDR/path?query`, from the backend's authority and the request's
/// path (both shared, not copied).
pub fn upstream_uri(backend: &Backend, uri: &Uri) -> Uri {
    let mut parts = hyper::http::uri::Parts::default();
    parts.scheme = Some(hyper::http::uri::Scheme::HTTP);
    parts.authority = Some(backend.authority.clone());
    parts.path_and_query = Some(path_and_query(uri));
    Uri::from_parts(parts).unwrap_or_default()
}

/// The request's path and query (`/` when it has none: `OPTIONS *` aside, only an
/// authority-form `CONNECT` lacks one).
pub fn path_and_query(uri: &Uri) -> PathAndQuery {
    uri.path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"))
}
