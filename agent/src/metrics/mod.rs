//! The agent's Prometheus metrics (names prefixed `rune_`): every family and handle,
//! registered once, and their text for a scrape. [`server`] is the listener that
//! serves them.
//!
//! Handles are cheap clones (`Arc` inside), so subsystems keep the ones they update on
//! hot paths instead of looking them up per event.

pub mod server;

use std::sync::Arc;

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
    /// `rune_store_connected`: 1 while the store answers (always with the embedded
    /// store), 0 while etcd does not.
    pub store_connected: Gauge,
    /// `rune_store_skipped_keys_total`: etcd keys skipped because their value is not
    /// a valid object or their kind is unknown.
    pub store_skipped_keys: Counter,
    /// `rune_applied_revision` and `rune_watch_lag_seconds` ([`AppliedMetrics`]).
    pub applied: AppliedMetrics,
    /// `rune_ingress_*`: the ingress proxy's.
    pub ingress: crate::ingress::IngressMetrics,
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
        let store_connected = Gauge::default();
        registry.register(
            "store_connected",
            "1 while the store holding the objects answers, 0 while etcd does not",
            store_connected.clone(),
        );
        let store_skipped_keys = Counter::default();
        registry.register(
            "store_skipped_keys",
            "etcd keys skipped because their value is not a valid object or their kind is unknown",
            store_skipped_keys.clone(),
        );
        let applied = AppliedMetrics::register(&mut registry);
        let ingress = crate::ingress::IngressMetrics::register(&mut registry);
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
            store_connected,
            store_skipped_keys,
            applied,
            ingress,
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

// ---- Applied revision (crate::applied): what is in this node's kernel ----

/// The buckets of `rune_watch_lag_seconds`: 1 ms to about 65 s.
fn watch_lag_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 4.0, 9))
}

/// The applied revision's metrics, kept by [`crate::applied::AppliedRevision`].
#[derive(Clone, Debug)]
pub struct AppliedMetrics {
    /// `rune_applied_revision`: the highest revision in effect in the kernel.
    pub applied_revision: Gauge,
    /// `rune_watch_lag_seconds`: receipt of a batch of events to its effect.
    pub watch_lag: Histogram,
}

impl AppliedMetrics {
    /// Registers both metrics in `registry`.
    fn register(registry: &mut Registry) -> Self {
        let applied_revision = Gauge::default();
        registry.register(
            "applied_revision",
            "The highest ordered-log revision whose effect is in this node's kernel \
             (data plane written and DNS zone swapped); rune_revision_applied is what the \
             cache received",
            applied_revision.clone(),
        );
        let watch_lag = watch_lag_histogram();
        registry.register(
            "watch_lag_seconds",
            "Time from the agent receiving a batch of ordered-log events (etcd keeps no \
             write times, so not from the write) to their effect in the kernel",
            watch_lag.clone(),
        );
        Self {
            applied_revision,
            watch_lag,
        }
    }
}

/// The content type of [`Metrics::encode`]'s output.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests;
