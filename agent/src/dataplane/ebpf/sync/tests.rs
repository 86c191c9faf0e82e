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
