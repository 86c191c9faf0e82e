//! How full the eBPF maps are, for the node's facts and its `MapPressure`
//! condition: the frontends and backends from the sync engine's own bookkeeping
//! (exact, and cheap enough to ask after every change), the conntrack maps by
//! walking their keys (exact at the time of the walk; one `bpf()` call per entry,
//! so at most their capacity, and only when asked [`MapCount::WithFlows`]).

use super::{EbpfDataPlane, maps::LbMaps};
use crate::{
    dataplane::{MapCount, MapUsage},
    lock::lock,
};

impl<M: LbMaps + 'static> EbpfDataPlane<M> {
    /// The maps' capacities and fill; the conntrack maps only with
    /// [`MapCount::WithFlows`] (their fill is `None` when the walk failed).
    pub fn map_usage(&self, count: MapCount) -> Vec<MapUsage> {
        let sync = lock(&self.sync);
        let (frontends, backends, capacity) = sync.usage();
        let mut maps = vec![
            MapUsage {
                name: "frontends",
                capacity: u64::from(capacity.frontends),
                used: Some(frontends as u64),
            },
            // Backend id 0 means "none": one slot fewer than the array.
            MapUsage {
                name: "backends",
                capacity: u64::from(capacity.backends.saturating_sub(1)),
                used: Some(backends as u64),
            },
        ];
        if count == MapCount::WithFlows {
            let flows = sync.maps().flows_by_family();
            if let Err(e) = &flows {
                tracing::warn!(error = %e, "counting the conntrack entries failed");
            }
            let flows = flows.ok();
            for (name, used) in [
                ("conntrack_v4", flows.map(|f| f.0)),
                ("conntrack_v6", flows.map(|f| f.1)),
            ] {
                maps.push(MapUsage {
                    name,
                    capacity: u64::from(capacity.flows),
                    used: used.map(|n| n as u64),
                });
            }
        }
        maps
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        dataplane::ebpf::maps::{Capacity, FakeMaps},
        endpoints::{Delta, ServiceView},
        model::{Object, parse_documents},
    };
    use std::{net::SocketAddr, sync::Arc, time::Instant};

    /// Service `name` on `vip`:80 with endpoints `addrs` (port 8080).
    fn view(name: &str, vip: &str, addrs: &[&str]) -> ServiceView {
        let eps: Vec<String> = addrs.iter().map(|a| format!("{{address: {a}}}")).collect();
        let yaml = format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: 80, targetPort: 8080}}], discovery: {{vips: [{vip}]}}}}\n---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\nspec: {{endpoints: [{}]}}\n",
            eps.join(", ")
        );
        let mut objects = parse_documents(&yaml).expect("valid objects").into_iter();
        let (Some(Object::Service(s)), Some(Object::Endpoints(e))) =
            (objects.next(), objects.next())
        else {
            panic!("a service and its endpoints");
        };
        ServiceView {
            service: Arc::new(s),
            endpoints: Some(Arc::new(e)),
        }
    }

    #[test]
    fn the_tables_are_counted_from_the_engine_and_flows_per_family() {
        let maps = FakeMaps::new(Capacity {
            frontends: 8,
            backends: 17,
            table_size: 7,
            flows: 100,
        });
        let plane = EbpfDataPlane::with_maps(maps, "node-a");
        let delta = Delta {
            revision: 1,
            full: true,
            upserted: vec![
                view("a", "198.18.100.1", &["198.18.1.1", "198.18.1.2"]),
                view("b", "fd00:100::1", &["fd00:1::1"]),
            ],
            removed: Vec::new(),
        };
        lock(&plane.sync).apply(&delta, Instant::now()).unwrap();
        let tables = plane.map_usage(MapCount::Tables);
        let got: Vec<(&str, u64, Option<u64>)> = tables
            .iter()
            .map(|m| (m.name, m.capacity, m.used))
            .collect();
        assert_eq!(got, [("frontends", 8, Some(2)), ("backends", 16, Some(3))]);

        // Two IPv4 flows and one IPv6 flow in the conntrack maps.
        {
            let mut sync = lock(&plane.sync);
            let id = |a: &str| sync.backend_id(&a.parse::<SocketAddr>().unwrap()).unwrap();
            let flows = vec![
                id("198.18.1.1:8080"),
                id("198.18.1.2:8080"),
                id("[fd00:1::1]:8080"),
            ];
            sync.maps_mut().flows = flows;
        }
        let all = plane.map_usage(MapCount::WithFlows);
        let got: Vec<(&str, u64, Option<u64>)> =
            all.iter().map(|m| (m.name, m.capacity, m.used)).collect();
        assert_eq!(
            got[2..],
            [
                ("conntrack_v4", 100, Some(2)),
                ("conntrack_v6", 100, Some(1))
            ]
        );
    }
}
