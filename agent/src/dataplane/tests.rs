use super::*;

fn row(service: &str, port: u16, backends: &[(&str, u16, u64)]) -> ServicePortStatus {
    ServicePortStatus {
        service: service.into(),
        port,
        protocol: Protocol::Tcp,
        listen: None,
        state: PortState::Listening,
        endpoints_known: true,
        backends: backends
            .iter()
            .map(|(address, port, flows)| BackendStatus {
                address: address.parse().unwrap(),
                port: *port,
                node: String::new(),
                state: BackendState::Active,
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
/// service ports, one backend) is counted once, and other services are left out.
#[test]
fn endpoint_counters_tell_endpoints_on_one_address_apart() {
    let rows = [
        row(
            "default/web",
            80,
            &[("127.0.0.1", 8081, 3), ("127.0.0.1", 8082, 5)],
        ),
        row(
            "default/web",
            81,
            &[("127.0.0.1", 8081, 3), ("127.0.0.1", 9090, 7)],
        ),
        row("default/other", 80, &[("127.0.0.1", 8081, 11)]),
    ];
    let ip = "127.0.0.1".parse().unwrap();
    let flows = |ports: &[u16]| endpoint_counters(&rows, "default/web", ip, ports).map(|c| c.flows);
    assert_eq!(flows(&[8081, 8081]), Some(3));
    assert_eq!(flows(&[8082, 8082]), Some(5));
    assert_eq!(flows(&[8081, 9090]), Some(10));
    assert_eq!(flows(&[8083]), None);
    let both = endpoint_counters(&rows, "default/web", ip, &[8081, 9090]).unwrap();
    assert_eq!((both.packets, both.bytes), (20, 1000));
}
