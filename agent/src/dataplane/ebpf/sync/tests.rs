use super::*;
use crate::{
    dataplane::ebpf::maps::FakeMaps,
    model::{Object, parse_documents},
};
use agent_common::lb::{BACKEND_ACTIVE, BACKEND_DRAINING};

fn view(name: &str, vip: &str, endpoints: &[&str]) -> ServiceView {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|a| format!("{{address: {a}}}"))
        .collect();
    let yaml = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: 80, targetPort: 8080}}], discovery: {{vips: [{vip}]}}}}\n---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\nspec: {{endpoints: [{}]}}\n",
        eps.join(", ")
    );
    let mut objects = parse_documents(&yaml).expect("valid objects").into_iter();
    let (Some(Object::Service(s)), Some(Object::Endpoints(e))) = (objects.next(), objects.next())
    else {
        panic!("a service and its endpoints");
    };
    ServiceView {
        service: Arc::new(s),
        endpoints: Some(Arc::new(e)),
    }
}

fn delta(full: bool, upserted: Vec<ServiceView>, removed: Vec<ServiceKey>) -> Delta {
    Delta {
        revision: 1,
        full,
        upserted,
        removed,
    }
}

fn state(sync: &LbSync<FakeMaps>, addr: &str) -> u8 {
    let addr: SocketAddr = addr.parse().expect("socket address");
    let id = sync.backend_id(&addr).expect("a backend id");
    sync.maps().backends[id as usize].state
}

/// A backend shared by two services stays active while either has it in a table,
/// and drains once neither has (the per-backend reference counts).
#[test]
fn shared_backend_state_follows_every_service() {
    let mut sync = LbSync::new(
        FakeMaps::new(Capacity {
            frontends: 4,
            backends: 16,
            table_size: 7,
            flows: 16,
        }),
        "node",
    );
    let now = Instant::now();
    let a = view("a", "198.18.0.10", &["10.0.0.1", "10.0.0.2"]);
    let b = view("b", "198.18.0.11", &["10.0.0.1"]);
    sync.apply(&delta(true, vec![a, b.clone()], vec![]), now)
        .expect("sync");
    assert_eq!(state(&sync, "10.0.0.1:8080"), BACKEND_ACTIVE);

    // `a` drops the shared backend: `b` still uses it.
    let a = view("a", "198.18.0.10", &["10.0.0.2"]);
    sync.apply(&delta(false, vec![a.clone()], vec![]), now)
        .expect("sync");
    assert_eq!(state(&sync, "10.0.0.1:8080"), BACKEND_ACTIVE);

    // `b` goes too: the backend drains (a's drain deadline keeps it).
    sync.apply(&delta(false, vec![], vec![b.key()]), now)
        .expect("sync");
    assert_eq!(state(&sync, "10.0.0.1:8080"), BACKEND_DRAINING);

    // `a` takes it back: active again.
    let a = view("a", "198.18.0.10", &["10.0.0.1", "10.0.0.2"]);
    sync.apply(&delta(false, vec![a], vec![]), now)
        .expect("sync");
    assert_eq!(state(&sync, "10.0.0.1:8080"), BACKEND_ACTIVE);
    assert_eq!(state(&sync, "10.0.0.2:8080"), BACKEND_ACTIVE);
}

/// Service `web` on VIP 198.18.0.20, port `http` 80 → 8080, with `endpoints` (YAML
/// flow mappings).
fn web(endpoints: &[&str]) -> ServiceView {
    let yaml = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: web}}\nspec: {{ports: [{{name: http, port: 80, targetPort: 8080}}], discovery: {{vips: [198.18.0.20]}}, drainSeconds: 10}}\n---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: web}}\nspec: {{endpoints: [{}]}}\n",
        endpoints.join(", ")
    );
    let mut objects = parse_documents(&yaml).expect("valid objects").into_iter();
    let (Some(Object::Service(s)), Some(Object::Endpoints(e))) = (objects.next(), objects.next())
    else {
        panic!("a service and its endpoints");
    };
    ServiceView {
        service: Arc::new(s),
        endpoints: Some(Arc::new(e)),
    }
}

/// The backend ids in `web`'s table, each once, sorted.
fn table_ids(sync: &LbSync<FakeMaps>) -> Vec<u32> {
    let frontend = sync.frontend_ids(&key_of("web"))[0].1;
    let mut ids = sync.maps().table(frontend).expect("a table").to_vec();
    ids.sort_unstable();
    ids.dedup();
    ids
}

fn key_of(name: &str) -> ServiceKey {
    ServiceKey::new("default", name)
}

/// Endpoints on one address with different ports are separate backends: each its
/// own id and Maglev slots, and one of them draining (its state, its drain, its
/// flows purged at the end) leaves the other untouched.
#[test]
fn backends_sharing_an_address_are_separate_backends() {
    let mut sync = LbSync::new(
        FakeMaps::new(Capacity {
            frontends: 4,
            backends: 16,
            table_size: 31,
            flows: 16,
        }),
        "node",
    );
    let now = Instant::now();
    let both = [
        "{address: 10.0.0.1, ports: {http: 8081}}",
        "{address: 10.0.0.1, ports: {http: 8082}}",
        "{address: 10.0.0.2}",
    ];
    sync.apply(&delta(true, vec![web(&both)], vec![]), now)
        .expect("sync");
    let id = |addr: &str| {
        sync.backend_id(&addr.parse().expect("socket address"))
            .expect("a backend id")
    };
    let (a, b, c) = (
        id("10.0.0.1:8081"),
        id("10.0.0.1:8082"),
        id("10.0.0.2:8080"),
    );
    assert_eq!(BTreeSet::from([a, b, c]).len(), 3, "three backends");
    let mut want = vec![a, b, c];
    want.sort_unstable();
    assert_eq!(table_ids(&sync), want);
    assert_eq!(
        sync.backends().len(),
        3,
        "the metrics' backend label tells them apart"
    );
    let state_of = |sync: &LbSync<FakeMaps>, id: u32| sync.maps().backends[id as usize].state;

    // 10.0.0.1:8082 terminates: out of the table, draining; its neighbour on the
    // same address stays active.
    sync.maps_mut().flows = vec![a, b, b, c];
    let draining = [
        both[0],
        "{address: 10.0.0.1, ports: {http: 8082}, terminating: true}",
        both[2],
    ];
    sync.apply(&delta(false, vec![web(&draining)], vec![]), now)
        .expect("sync");
    let mut want = vec![a, c];
    want.sort_unstable();
    assert_eq!(table_ids(&sync), want);
    assert_eq!(state_of(&sync, a), BACKEND_ACTIVE);
    assert_eq!(state_of(&sync, b), BACKEND_DRAINING);

    // The drain ends: only its flows go, and only its id is freed.
    sync.expire(now + std::time::Duration::from_secs(11))
        .expect("expire");
    assert_eq!(sync.maps().flows, [a, c]);
    assert_eq!(
        sync.backend_id(&"10.0.0.1:8082".parse().expect("addr")),
        None
    );
    assert_eq!(state_of(&sync, a), BACKEND_ACTIVE);
}
