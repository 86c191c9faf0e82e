//! Prometheus metrics of the agent (names prefixed `rune_`), and the HTTP listener that
//! serves them with `/healthz` and `/readyz`.
//!
//! Handles are cheap clones (`Arc` inside), so subsystems keep the ones they update on
//! hot paths instead of looking them up per event.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
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

/// Every metric the agent exports, registered once in [`Metrics::new`].
pub struct Metrics {
    registry: Registry,
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
}

impl Metrics {
    /// Every handle, unregistered (placeholder until the registering `new` lands).
    pub fn new() -> Self {
        Self {
            registry: Registry::default(),
            subsystem_ready: Family::default(),
            objects: Family::default(),
            revision_applied: Gauge::default(),
            proxy_connections: Family::default(),
            proxy_bytes: Family::default(),
            proxy_listener_up: Family::default(),
            outbox_depth: Gauge::default(),
            outbox_dropped: Counter::default(),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
