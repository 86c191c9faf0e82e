use super::{sources::PlaneIndex, *};
use crate::{
    config::DataplaneMode,
    dataplane::{PortState, ServicePortStatus, TrafficCounters},
    preflight::Check,
};

#[test]
fn render_shows_the_data_plane_reason_and_failed_preflight_checks() {
    let st = AgentStatus {
        running: true,
        dataplane: Some("nftables".into()),
        dataplane_reason: Some("auto: ebpf unavailable: btf (missing)".into()),
        preflight: vec![
            Check::new("btf", false, "missing", &[DataplaneMode::Ebpf]),
            Check::new("nft", true, "nftables v1.0.6", &[DataplaneMode::Nftables]),
        ],
        ..AgentStatus::default()
    };
    let text = st.render();
    assert!(
        text.contains("data plane: nftables (auto: ebpf unavailable: btf (missing))\n"),
        "{text}"
    );
    assert!(
        text.contains("preflight:  1 of 2 checks passed\n"),
        "{text}"
    );
    assert!(text.contains("  failed btf: missing\n"), "{text}");
    assert!(!text.contains("failed nft"), "{text}");
    let json = serde_json::to_value(&st).unwrap();
    assert_eq!(
        json["dataplaneReason"],
        "auto: ebpf unavailable: btf (missing)"
    );
    assert_eq!(json["preflight"][0]["neededBy"][0], "ebpf");
    let back: AgentStatus = serde_json::from_value(json).unwrap();
    assert_eq!(back, st);
}

fn plane_row(service: &str, port: u16, backends: &[(&str, u16, u64)]) -> ServicePortStatus {
    ServicePortStatus {
        service: service.into(),
        port,
        protocol: crate::model::Protocol::Tcp,
        listen: None,
        state: PortState::Listening,
        endpoints_known: true,
        backends: backends
            .iter()
            .map(|(address, port, flows)| crate::dataplane::BackendStatus {
                address: address.parse().unwrap(),
                port: *port,
                node: String::new(),
                state: crate::dataplane::BackendState::Active,
                counters: Some(TrafficCounters {
                    flows: *flows,
                    packets: 2 * flows,
                    bytes: 100 * flows,
                }),
            })
            .collect(),
        counters: None,
    }
}

/// An endpoint's traffic is that of its own socket addresses: a neighbour on the
/// same address with another port is not counted, a port it serves twice (two
/// service ports, one backend) is counted once, and other services are left out;
/// `status` names each endpoint by its socket address.
#[test]
fn backend_counters_tell_endpoints_on_one_address_apart() {
    let rows = [
        plane_row(
            "default/web",
            80,
            &[("127.0.0.1", 8081, 3), ("127.0.0.1", 8082, 5)],
        ),
        plane_row(
            "default/web",
            81,
            &[("127.0.0.1", 8081, 3), ("127.0.0.1", 9090, 7)],
        ),
        plane_row("default/other", 80, &[("127.0.0.1", 8081, 11)]),
    ];
    let backend = |ports: &[u16]| BackendStatus {
        address: "127.0.0.1".into(),
        node: String::new(),
        state: "accepting".into(),
        ports: ports.to_vec(),
        counters: None,
    };
    let mut s = ServiceStatus {
        service: "default/web".into(),
        backends: vec![
            backend(&[8081, 8081]),
            backend(&[8082, 8082]),
            backend(&[8081, 9090]),
            backend(&[8083]),
        ],
        ..ServiceStatus::default()
    };
    PlaneIndex::new(&rows).annotate(&mut s);
    let counters: Vec<Option<&str>> = s.backends.iter().map(|b| b.counters.as_deref()).collect();
    assert_eq!(
        counters,
        [
            Some("flows 3, packets 6, bytes 300"),
            Some("flows 5, packets 10, bytes 500"),
            Some("flows 10, packets 20, bytes 1000"),
            None
        ]
    );
    let names: Vec<String> = s.backends.iter().map(BackendStatus::endpoint).collect();
    assert_eq!(
        names,
        [
            "127.0.0.1:8081",
            "127.0.0.1:8082",
            "127.0.0.1 ports 8081,9090",
            "127.0.0.1:8083"
        ]
    );
}

#[test]
fn render_shows_the_store_and_since_when_it_is_disconnected() {
    let st = AgentStatus {
        running: true,
        store: Some("etcd http://127.0.0.1:2379 (prefix /rune/v1/)".into()),
        store_disconnected: Some("since 2026-12-02T04:40:01Z, etcd is unavailable".into()),
        store_skipped: Some("2 keys skipped; last: /rune/v1/gadget/default/x".into()),
        ..AgentStatus::default()
    };
    let text = st.render();
    for line in [
        "store:      etcd http://127.0.0.1:2379 (prefix /rune/v1/)\n",
        "            StoreDisconnected since 2026-12-02T04:40:01Z, etcd is unavailable\n",
        "            2 keys skipped; last: /rune/v1/gadget/default/x\n",
    ] {
        assert!(text.contains(line), "{line:?} in:\n{text}");
    }
    let json = serde_json::to_value(&st).unwrap();
    assert_eq!(
        json["storeDisconnected"],
        "since 2026-12-02T04:40:01Z, etcd is unavailable"
    );
    let back: AgentStatus = serde_json::from_value(json).unwrap();
    assert_eq!(back, st);
}
