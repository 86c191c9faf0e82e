use super::*;
use crate::{
    dataplane::ebpf::maps::{Capacity, FakeMaps},
    endpoints::{Delta, EndpointCache},
    model::parse_documents,
    orderedlog::Snapshot,
};
use prometheus_client::registry::Registry;
use std::time::Instant;

/// The per-backend series are labelled with the backend's socket address, so
/// endpoints sharing an address are separate series.
#[test]
fn backends_on_one_address_are_separate_series() {
    let yaml = "apiVersion: rune/v1\nkind: Service\nmetadata: {name: web}\n\
        spec: {ports: [{name: http, port: 80}], discovery: {vips: [198.18.0.20, 'fd00:100::20']}}\n---\n\
        apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: web}\nspec:\n  endpoints:\n\
        \x20   - {address: 127.0.0.1, ports: {http: 8081}}\n\
        \x20   - {address: 127.0.0.1, ports: {http: 8082}}\n\
        \x20   - {address: 'fd00::1', ports: {http: 8081}}\n";
    let cache = EndpointCache::new();
    cache.apply_snapshot(&Snapshot {
        revision: 1,
        objects: parse_documents(yaml).expect("valid objects"),
    });
    let mut sync = LbSync::new(
        FakeMaps::new(Capacity {
            frontends: 4,
            backends: 16,
            table_size: 31,
            flows: 16,
        }),
        "node",
    );
    let delta = Delta {
        revision: 1,
        full: true,
        upserted: cache.views(),
        removed: Vec::new(),
    };
    sync.apply(&delta, Instant::now()).expect("sync");
    let mut registry = Registry::with_prefix("rune");
    registry.register_collector(Box::new(LbCollector {
        sync: Arc::new(Mutex::new(sync)),
        policy: None,
    }));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("rune_dataplane_backend_flows_total{"))
        .collect();
    assert_eq!(
        series,
        [
            "rune_dataplane_backend_flows_total{backend=\"127.0.0.1:8081\"} 0",
            "rune_dataplane_backend_flows_total{backend=\"127.0.0.1:8082\"} 0",
            "rune_dataplane_backend_flows_total{backend=\"[fd00::1]:8081\"} 0",
        ],
        "{text}"
    );
}
