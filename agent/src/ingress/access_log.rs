//! The ingress proxy's access log: one structured line per request (a `tracing`
//! event with target `rune::ingress::access`, so `RUST_LOG` can route or silence
//! it), for a configured share of the requests.
//!
//! Sampling is by count, not by chance: with rate `r` the `n`th request is logged
//! when `floor(n·r)` steps up, so exactly `r` of every `1/r` requests are written
//! and the log's volume is predictable.

use std::{
    net::SocketAddr,
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

/// The target of access-log events.
pub const TARGET: &str = "rune::ingress::access";

/// Decides which requests are logged.
#[derive(Debug)]
pub struct AccessLog {
    /// The share of requests logged, 0 to 1.
    rate: f64,
    /// Requests seen.
    seen: AtomicU64,
}

/// What one access-log line says about a request.
pub struct Entry<'a> {
    /// The client's address.
    pub client: SocketAddr,
    /// The request method.
    pub method: &'a str,
    /// The host routed by (normalized), empty when the request had none usable.
    pub host: &'a str,
    /// The request's path (without the query: it may carry secrets).
    pub path: &'a str,
    /// The HTTP version of the client's request.
    pub version: &'a str,
    /// Whether the request came over TLS.
    pub tls: bool,
    /// The status sent to the client.
    pub status: u16,
    /// `namespace/name` of the route's service, empty without a route.
    pub service: &'a str,
    /// The endpoint that answered, if one did.
    pub upstream: Option<SocketAddr>,
    /// Request headers in to response headers out.
    pub duration: Duration,
}

impl AccessLog {
    /// Logs a share `rate` (clamped to 0–1) of requests.
    pub fn new(rate: f64) -> AccessLog {
        AccessLog {
            rate: if rate.is_nan() {
                0.0
            } else {
                rate.clamp(0.0, 1.0)
            },
            seen: AtomicU64::new(0),
        }
    }

    /// Whether the next request is one to log.
    pub fn sampled(&self) -> bool {
        if self.rate <= 0.0 {
            return false;
        }
        if self.rate >= 1.0 {
            return true;
        }
        let n = self.seen.fetch_add(1, Ordering::Relaxed);
        // u64 → f64 loses precision only beyond 2^53 requests.
        let (before, after) = (n as f64 * self.rate, (n + 1) as f64 * self.rate);
        after.floor() > before.floor()
    }

    /// Whether the next request gets a line: sampled, and the log filter lets
    /// access lines through.
    pub fn wanted(&self) -> bool {
        tracing::enabled!(target: TARGET, tracing::Level::INFO) && self.sampled()
    }

    /// Writes `entry` (a request [`AccessLog::wanted`] a line for).
    pub fn record(entry: &Entry<'_>) {
        let upstream = entry.upstream.map(|a| a.to_string());
        tracing::info!(
            target: TARGET,
            client = %entry.client,
            method = entry.method,
            host = entry.host,
            path = entry.path,
            version = entry.version,
            tls = entry.tls,
            status = entry.status,
            service = entry.service,
            upstream = upstream.as_deref().unwrap_or("-"),
            duration_us = u64::try_from(entry.duration.as_micros()).unwrap_or(u64::MAX),
            "access"
        );
    }
}

/// `HTTP/1.1`, `HTTP/2` and so on, for the access log.
pub fn version_name(v: hyper::Version) -> &'static str {
    match v {
        hyper::Version::HTTP_09 => "HTTP/0.9",
        hyper::Version::HTTP_10 => "HTTP/1.0",
        hyper::Version::HTTP_11 => "HTTP/1.1",
        hyper::Version::HTTP_2 => "HTTP/2",
        hyper::Version::HTTP_3 => "HTTP/3",
        _ => "HTTP/?",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logged(rate: f64, requests: usize) -> usize {
        let log = AccessLog::new(rate);
        (0..requests).filter(|_| log.sampled()).count()
    }

    #[test]
    fn sampling_logs_the_configured_share_exactly() {
        assert_eq!(logged(1.0, 100), 100);
        assert_eq!(logged(0.0, 100), 0);
        assert_eq!(logged(0.25, 100), 25);
        assert_eq!(logged(0.1, 1000), 100);
        assert_eq!(logged(0.5, 7), 3);
        // Out-of-range rates are clamped; NaN logs nothing.
        assert_eq!(logged(2.0, 10), 10);
        assert_eq!(logged(f64::NAN, 10), 0);
    }

    #[test]
    fn a_sampled_stream_spreads_its_lines_evenly() {
        let log = AccessLog::new(0.25);
        let picks: Vec<bool> = (0..8).map(|_| log.sampled()).collect();
        assert_eq!(
            picks,
            [false, false, false, true, false, false, false, true]
        );
    }
}
