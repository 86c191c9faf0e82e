use super::*;
use crate::model::{Object, parse_documents};
use std::collections::BTreeSet;

/// Service `web` (port `http` 80 → 8080, `extra` spec fields) with `endpoints` (YAML
/// flow mappings).
fn view(extra: &str, endpoints: &[&str]) -> ServiceView {
    let yaml = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: web}}\nspec: {{ports: [{{name: http, port: 80, targetPort: 8080}}]{extra}}}\n---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: web}}\nspec: {{endpoints: [{}]}}\n",
        endpoints.join(", ")
    );
    let mut objects = parse_documents(&yaml).unwrap().into_iter();
    let (Some(Object::Service(s)), Some(Object::Endpoints(e))) = (objects.next(), objects.next())
    else {
        panic!("a service and its endpoints");
    };
    ServiceView {
        service: Arc::new(s),
        endpoints: Some(Arc::new(e)),
    }
}

/// Three processes on 127.0.0.1 and a terminating fourth.
const LOCAL_THREE: [&str; 4] = [
    "{address: 127.0.0.1, ports: {http: 8081}}",
    "{address: 127.0.0.1, ports: {http: 8082}}",
    "{address: 127.0.0.1, ports: {http: 8083}}",
    "{address: 127.0.0.1, ports: {http: 8084}, terminating: true}",
];

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn shared(b: Backends) -> Arc<PortShared> {
    Arc::new(PortShared::new(
        "default/web".into(),
        Protocol::Tcp,
        b,
        &Metrics::new(),
        TaskTracker::new(),
        CancellationToken::new(),
    ))
}

/// Endpoints on one address with different ports are separate backends: every one
/// taking new connections gets some, each shows in `status` with its port, and a
/// client with affinity sticks to one of them.
#[test]
fn endpoints_sharing_an_address_are_separate_backends() {
    let v = view("", &LOCAL_THREE);
    let b = Backends::build(&v, &v.service.spec.ports[0], "", 1021, None);
    let ready = [
        sa("127.0.0.1:8081"),
        sa("127.0.0.1:8082"),
        sa("127.0.0.1:8083"),
    ];
    assert_eq!(b.eligible, ready);
    let rows: Vec<(SocketAddr, BackendState)> = b
        .status
        .iter()
        .map(|s| (SocketAddr::new(s.address, s.port), s.state))
        .collect();
    assert_eq!(
        rows,
        [
            (ready[0], BackendState::Active),
            (ready[1], BackendState::Active),
            (ready[2], BackendState::Active),
            (sa("127.0.0.1:8084"), BackendState::Terminating),
        ]
    );
    let port = shared(b);
    let picked: BTreeSet<SocketAddr> = (1000..1300)
        .filter_map(|p| port.pick(SocketAddr::from(([192, 0, 2, 1], p))))
        .collect();
    assert_eq!(picked, BTreeSet::from(ready));

    let v = view(
        ", sessionAffinity: {type: ClientIP, timeoutSeconds: 60}",
        &LOCAL_THREE,
    );
    let port = shared(Backends::build(
        &v,
        &v.service.spec.ports[0],
        "",
        1021,
        None,
    ));
    let client = |p| SocketAddr::from(([192, 0, 2, 9], p));
    let first = port.pick(client(1000)).unwrap();
    assert!((1001..1100).all(|p| port.pick(client(p)) == Some(first)));
}

/// One backend of an address leaving ends its own connections after the drain
/// time, never those of its neighbour on the same address.
#[tokio::test]
async fn draining_one_backend_on_an_address_keeps_its_neighbour() {
    let v = view(", drainSeconds: 0", &LOCAL_THREE[..2]);
    let port = shared(Backends::build(
        &v,
        &v.service.spec.ports[0],
        "",
        1021,
        None,
    ));
    let stays = port.drain_token(sa("127.0.0.1:8081"));
    let leaves = port.drain_token(sa("127.0.0.1:8082"));
    let v = view(", drainSeconds: 0", &LOCAL_THREE[..1]);
    port.set_backends(Backends::build(
        &v,
        &v.service.spec.ports[0],
        "",
        1021,
        None,
    ));
    tokio::time::timeout(Duration::from_secs(5), leaves.cancelled())
        .await
        .expect("the leaving backend's connections end");
    assert!(!stays.is_cancelled(), "its neighbour's connections go on");
}
