//! The ingress proxy's metrics (`rune_ingress_*`), registered once with the agent's.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};
use std::sync::{PoisonError, RwLock};

/// Labels of a request the ingress answered.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The route's host as exposed (not the client's Host: bounded), empty without a route.
    pub host: String,
    /// `namespace/name` of the service, empty without a route.
    pub service: String,
    /// The HTTP status code sent to the client.
    pub code: u16,
}

/// A route's request counters by status code, each looked up in the family once:
/// a request then costs no label allocation or hashing, only a short scan.
#[derive(Debug, Default)]
pub struct CodeCounters(RwLock<Vec<(u16, Counter)>>);

impl CodeCounters {
    /// Counts one request answered with `code` on the route of `host` and
    /// `service`, in `family`.
    pub fn inc(
        &self,
        family: &Family<RequestLabels, Counter>,
        host: &str,
        service: &str,
        code: u16,
    ) {
        let counted = |list: &[(u16, Counter)]| {
            list.iter()
                .find(|(c, _)| *c == code)
                .map(|(_, counter)| counter.inc())
                .is_some()
        };
        if counted(&self.0.read().unwrap_or_else(PoisonError::into_inner)) {
            return;
        }
        let mut list = self.0.write().unwrap_or_else(PoisonError::into_inner);
        if counted(&list) {
            return;
        }
        let labels = RequestLabels {
            host: host.to_owned(),
            service: service.to_owned(),
            code,
        };
        let counter = family.get_or_create(&labels).clone();
        counter.inc();
        list.push((code, counter));
    }
}

/// Labels of a failure, by reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Upstream: `connect`, `timeout`, `protocol`; TLS: `unknown_sni`, `timeout`,
    /// `handshake`.
    pub reason: &'static str,
}

/// Labels of an exposed host.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HostLabels {
    /// The host as exposed (`*.example.com` for a wildcard).
    pub host: String,
}

/// Every ingress metric; handles are cheap clones.
#[derive(Clone, Debug)]
pub struct IngressMetrics {
    /// `rune_ingress_requests_total{host,service,code}`.
    pub requests: Family<RequestLabels, Counter>,
    /// `rune_ingress_request_duration_seconds`: request received to response headers sent.
    pub duration: Histogram,
    /// `rune_ingress_fast_path_requests_total`: of those, the ones the HTTP/1.1
    /// fast path served.
    pub fast_path_requests: Counter,
    /// `rune_ingress_upstream_errors_total{reason}`.
    pub upstream_errors: Family<ReasonLabels, Counter>,
    /// `rune_ingress_tls_handshake_errors_total{reason}`.
    pub tls_handshake_errors: Family<ReasonLabels, Counter>,
    /// `rune_ingress_certificate_expiry_seconds{host}`: when each host's
    /// certificate expires, Unix seconds.
    pub certificate_expiry: Family<HostLabels, Gauge>,
}

impl IngressMetrics {
    /// Registers every ingress metric in `registry` (prefixed `rune_` by it).
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            requests: Family::default(),
            // 100 µs to about 100 s.
            duration: Histogram::new(exponential_buckets(0.000_1, 4.0, 11)),
            fast_path_requests: Counter::default(),
            upstream_errors: Family::default(),
            tls_handshake_errors: Family::default(),
            certificate_expiry: Family::default(),
        };
        registry.register(
            "ingress_requests",
            "Requests answered by the ingress proxy, by route host, service and status code",
            m.requests.clone(),
        );
        registry.register(
            "ingress_request_duration_seconds",
            "Time from a request's headers to its response's headers at the ingress proxy",
            m.duration.clone(),
        );
        registry.register(
            "ingress_fast_path_requests",
            "Requests the ingress proxy served on its HTTP/1.1 fast path (the others through hyper)",
            m.fast_path_requests.clone(),
        );
        registry.register(
            "ingress_upstream_errors",
            "Failed exchanges of the ingress proxy with endpoints, by reason",
            m.upstream_errors.clone(),
        );
        registry.register(
            "ingress_tls_handshake_errors",
            "Failed TLS handshakes at the ingress proxy, by reason",
            m.tls_handshake_errors.clone(),
        );
        registry.register(
            "ingress_certificate_expiry_seconds",
            "When the certificate the ingress proxy serves for each exposed host expires, \
             as Unix time",
            m.certificate_expiry.clone(),
        );
        m
    }
}
