//! The Prometheus collector of the eBPF data plane: the programs' counters and the
//! maps' fill, read from the maps at each scrape.

use super::{error::MapsError, maps::LbMaps, sync::LbSync};
use crate::lock::lock;
use agent_common::{codec::frontend_addr, lb};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};
use std::sync::{Arc, Mutex};

/// Exports the programs' counters and the maps' fill (`rune_dataplane_*`), read
/// from the maps at each scrape.
pub struct LbCollector<M: LbMaps + 'static> {
    pub(super) sync: Arc<Mutex<LbSync<M>>>,
    /// The policy engine, whose verdict counters are exported too.
    pub(super) policy: Option<super::SharedPolicy>,
}

impl<M: LbMaps + 'static> std::fmt::Debug for LbCollector<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LbCollector")
    }
}

impl<M: LbMaps + 'static> Collector for LbCollector<M> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sync = lock(&self.sync);
        let maps = sync.maps();
        let frontends = sync.frontends();
        type Labels = Vec<(&'static str, String)>;
        let ids: Vec<u32> = frontends.iter().map(|(_, id, _)| *id).collect();
        let frontend_stats = scraped(maps.frontend_stats_of(&ids));
        let mut per_frontend: Vec<(Labels, lb::TrafficStats)> = Vec::new();
        for ((key, _, service), stats) in frontends.iter().zip(frontend_stats) {
            let (vip, proto) = frontend_addr(key);
            let labels = vec![
                ("service", service.to_string()),
                ("vip", vip.ip().to_string()),
                ("port", vip.port().to_string()),
                (
                    "protocol",
                    if proto == lb::PROTO_TCP { "TCP" } else { "UDP" }.to_owned(),
                ),
            ];
            per_frontend.push((labels, stats));
        }
        let backends = sync.backends();
        let ids: Vec<u32> = backends.iter().map(|(_, id)| *id).collect();
        let backend_stats = scraped(maps.backend_stats_of(&ids));
        let per_backend: Vec<(Labels, lb::TrafficStats)> = backends
            .into_iter()
            .zip(backend_stats)
            // The socket address (`ADDR:PORT`, `[ADDR]:PORT`): endpoints sharing an
            // address are separate backends, and separate series.
            .map(|((addr, _), stats)| (vec![("backend", addr.to_string())], stats))
            .collect();
        for (name, help, pick) in [
            (
                "dataplane_flows",
                "New flows balanced by the eBPF programs (connections, UDP flows, socket-LB connects and datagrams)",
                (|s: &lb::TrafficStats| s.flows) as fn(&lb::TrafficStats) -> u64,
            ),
            (
                "dataplane_packets",
                "Packets translated by the tc/XDP programs",
                |s: &lb::TrafficStats| s.packets,
            ),
            (
                "dataplane_bytes",
                "Bytes of the packets translated by the tc/XDP programs",
                |s: &lb::TrafficStats| s.bytes,
            ),
        ] {
            let mut family = encoder.encode_descriptor(
                name,
                &format!("{help}, by service frontend"),
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (labels, stats) in &per_frontend {
                ConstCounter::new(pick(stats)).encode(family.encode_family(labels)?)?;
            }
            let backend_name = name.replace("dataplane_", "dataplane_backend_");
            let mut family = encoder.encode_descriptor(
                &backend_name,
                &format!("{help}, by backend"),
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (labels, stats) in &per_backend {
                ConstCounter::new(pick(stats)).encode(family.encode_family(labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "dataplane_drops",
            "Packets or connections the eBPF programs refused or dropped, by reason",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (reason, count) in maps.drops().unwrap_or_default() {
            ConstCounter::new(count)
                .encode(family.encode_family(&[("reason", reason.label())])?)?;
        }
        let (frontends_used, backends_used, capacity) = sync.usage();
        let flows = maps.flows().unwrap_or(0);
        let mut family = encoder.encode_descriptor(
            "dataplane_map_entries",
            "Entries in use in the eBPF maps",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (map, n) in [
            ("frontends", frontends_used),
            ("backends", backends_used),
            ("conntrack", flows),
        ] {
            ConstGauge::new(n as i64).encode(family.encode_family(&[("map", map)])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "dataplane_map_capacity",
            "Capacity of the eBPF maps",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (map, n) in [
            ("frontends", capacity.frontends),
            ("backends", capacity.backends.saturating_sub(1)),
            ("conntrack", capacity.flows.saturating_mul(2)),
        ] {
            ConstGauge::new(i64::from(n)).encode(family.encode_family(&[("map", map)])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "dataplane_map_full",
            "Syncs that failed because an eBPF map was full",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        ConstCounter::new(sync.full_errors()).encode(family.encode_family(&[("map", "any")])?)?;
        if let Some(policy) = &self.policy {
            super::policy::collector::encode(lock(policy).sync(), &mut encoder)?;
        }
        Ok(())
    }
}

/// The counters a scrape read; none when the read failed (logged): their series
/// are left out of this scrape rather than shown as zeros, which would look like a
/// reset of every counter.
fn scraped(read: Result<Vec<lb::TrafficStats>, MapsError>) -> Vec<lb::TrafficStats> {
    read.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "reading the eBPF counters failed: left out of this scrape");
        Vec::new()
    })
}

#[cfg(test)]
mod tests;
