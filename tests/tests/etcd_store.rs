//! The etcd store's write side against a real etcd (no root needed): all-or-nothing
//! applies checked as the embedded store checks them, VIP ownership across applies
//! and writers, compare-and-swap under concurrent writers, etcd's transaction
//! limits, and endpoints refused before anything is sent.

mod etcd_common;

use etcd_common::*;
use rune_agent::{
    model::{Kind, Object},
    orderedlog::{
        LogError, OrderedLog,
        embedded::{ApplyError, Change, EmbeddedLog, EmbeddedOptions},
        etcd::{ConnectError, EtcdLog, EtcdOptions},
        store::ObjectStore,
    },
};
use rune_harness::etcd::Etcd;
use std::sync::Arc;

/// Applies `batches` in order to a fresh embedded store and returns the error of
/// the last (the earlier ones must succeed): what the etcd store must say too.
fn embedded_error(batches: &[Vec<Object>]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedLog::open(dir.path(), EmbeddedOptions::default()).unwrap();
    let (last, first) = batches.split_last().unwrap();
    for b in first {
        store.apply(b.clone()).unwrap();
    }
    store.apply(last.clone()).unwrap_err().to_string()
}

/// Every key under the test prefix, as etcdctl lists them.
fn stored_keys(etcd: &Etcd) -> Vec<String> {
    etcd.ctl_ok(&["get", "--prefix", "--keys-only", "/rune-test/v1/"])
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_invalid_document_writes_nothing_and_is_reported_as_the_embedded_store_does() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let before = etcd.revision();
    let batch = vec![
        svc("web", "198.18.100.1"),
        eps("web", &["198.18.11.2"]),
        invalid_svc("zero"),
    ];
    let err = log.apply(batch.clone()).await.unwrap_err();
    assert!(matches!(err, ApplyError::Invalid(_)), "{err:?}");
    assert_eq!(err.to_string(), embedded_error(&[batch]));
    assert!(err.to_string().contains("spec.ports[0].port"), "{err}");
    assert_eq!(etcd.revision(), before, "nothing may be written");
    assert!(stored_keys(&etcd).is_empty());

    // The same object twice in one apply.
    let twice = vec![svc("web", "198.18.100.1"), svc("web", "198.18.100.2")];
    let err = log.apply(twice.clone()).await.unwrap_err();
    assert_eq!(err.to_string(), embedded_error(&[twice]));
    assert_eq!(etcd.revision(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vip_belongs_to_one_service_across_applies_with_the_embedded_stores_messages() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let a = vec![svc("a", "198.18.100.1, \"fd00:100::1\"")];
    log.apply(a.clone()).await.unwrap();

    // Another service taking an owned VIP, in a later apply or in the same batch.
    let b = vec![svc("b", "\"fd00:100::1\"")];
    let err = log.apply(b.clone()).await.unwrap_err();
    assert_eq!(err.to_string(), embedded_error(&[a.clone(), b]));
    assert_eq!(
        err.to_string(),
        "Service default/b: spec.discovery.vips[0]: VIP fd00:100::1 is already used by Service default/a"
    );
    let both = vec![svc("c", "198.18.100.3"), svc("d", "198.18.100.3")];
    let err = log.apply(both.clone()).await.unwrap_err();
    assert_eq!(err.to_string(), embedded_error(&[a.clone(), both]));

    // A VIP moves in one apply: a gives it up as b takes it.
    let moved = log
        .apply(vec![svc("a", "198.18.100.1"), svc("b", "\"fd00:100::1\"")])
        .await
        .unwrap();
    assert_eq!(
        moved.results.iter().map(|(_, c)| *c).collect::<Vec<_>>(),
        [Change::Configured, Change::Created]
    );
    let err = log
        .apply(vec![svc("e", "\"fd00:100::1\"")])
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .ends_with("is already used by Service default/b"),
        "{err}"
    );

    // A deleted service's VIPs are free again; an unchanged apply writes nothing.
    log.delete(&key(Kind::Service, "a")).await.unwrap().unwrap();
    log.apply(vec![svc("e", "198.18.100.1")]).await.unwrap();
    let before = etcd.revision();
    let again = log.apply(vec![svc("e", "198.18.100.1")]).await.unwrap();
    assert_eq!(again.results[0].1, Change::Unchanged);
    assert_eq!(again.revision, before);
    assert_eq!(etcd.revision(), before);
    assert_eq!(
        stored_keys(&etcd),
        [
            "/rune-test/v1/_index/vip/198.18.100.1",
            "/rune-test/v1/_index/vip/fd00:100::1",
            "/rune-test/v1/service/default/b",
            "/rune-test/v1/service/default/e",
        ]
    );
    let owner = etcd.ctl_ok(&[
        "get",
        "--print-value-only",
        "/rune-test/v1/_index/vip/198.18.100.1",
    ]);
    assert_eq!(owner.trim(), "service/default/e");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_lose_no_update() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    log.apply(vec![eps("web", &[])]).await.unwrap();
    let start = log.snapshot().await.unwrap().revision;
    let mut stream = log.watch(start).await.unwrap();

    // Two writers (separate clients, as on two nodes) each add 25 addresses of
    // their own to one Endpoints object, read-modify-write.
    const EACH: usize = 25;
    let mut tasks = Vec::new();
    for writer in 0..2 {
        let log = connect(etcd.endpoint()).await;
        tasks.push(tokio::spawn(async move {
            let mut revisions = Vec::new();
            for i in 0..EACH {
                let address = format!("198.18.{}.{}", 11 + writer, i + 2);
                let out = log
                    .update(&key(Kind::Endpoints, "web"), |current| {
                        let Some(Object::Endpoints(e)) = current else {
                            panic!("web's endpoints are missing");
                        };
                        let mut addrs: Vec<String> = e
                            .spec
                            .endpoints
                            .iter()
                            .map(|x| x.address.to_string())
                            .collect();
                        addrs.push(address.clone());
                        let refs: Vec<&str> = addrs.iter().map(String::as_str).collect();
                        Some(eps("web", &refs))
                    })
                    .await
                    .unwrap();
                assert_eq!(out.results[0].1, Change::Configured);
                revisions.push(out.revision);
            }
            revisions
        }));
    }
    let mut committed = Vec::new();
    for t in tasks {
        committed.extend(t.await.unwrap());
    }
    committed.sort_unstable();
    committed.dedup();
    assert_eq!(committed.len(), 2 * EACH, "every update its own revision");

    let (_, objects) = log
        .get(Some(Kind::Endpoints), None, Some("web"))
        .await
        .unwrap();
    let Object::Endpoints(e) = &objects[0] else {
        panic!("not endpoints")
    };
    assert_eq!(e.spec.endpoints.len(), 2 * EACH, "an update was lost");
    // Watchers saw every committed version, in order.
    let seen = revisions(&take(&mut stream, 2 * EACH).await);
    assert_eq!(seen, committed);

    // Two writers racing to give one VIP to two services: exactly one wins, the
    // other is refused naming the winner.
    for round in 0..5 {
        let vip = format!("198.18.100.{}", 10 + round);
        let (x, y) = (
            connect(etcd.endpoint()).await,
            connect(etcd.endpoint()).await,
        );
        let (sx, sy) = (
            svc(&format!("x{round}"), &vip),
            svc(&format!("y{round}"), &vip),
        );
        let (rx, ry) = tokio::join!(x.apply(vec![sx]), y.apply(vec![sy]));
        let wins = [&rx, &ry].iter().filter(|r| r.is_ok()).count();
        assert_eq!(wins, 1, "round {round}: {rx:?} {ry:?}");
        let loser = rx.err().or(ry.err()).unwrap();
        assert!(
            loser
                .to_string()
                .contains(&format!("VIP {vip} is already used by")),
            "{loser}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apply_larger_than_one_transaction_is_refused_before_anything_is_written() {
    // etcd's defaults: 128 operations and 1.5 MiB per transaction.
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let big: Vec<Object> = (0..70)
        .map(|i| svc(&format!("s{i:02}"), &format!("198.18.100.{}", i + 1)))
        .collect();
    let before = etcd.revision();
    let err = log.apply(big.clone()).await.unwrap_err();
    match &err {
        ApplyError::Log(LogError::TooLarge {
            needed,
            allowed,
            setting,
            ..
        }) => {
            assert_eq!((*needed, *allowed, *setting), (140, 128, "--max-txn-ops"));
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "the apply of 70 objects needs 140 operations in one etcd transaction, but etcd allows 128 \
         (--max-txn-ops): nothing was written. Split it into smaller applies, or raise \
         --max-txn-ops on every etcd member and give rune-agent the same limit"
    );
    assert_eq!(etcd.revision(), before);

    // Split in two, it fits; re-applied whole, only what changed counts.
    log.apply(big[..35].to_vec()).await.unwrap();
    log.apply(big[35..].to_vec()).await.unwrap();
    let mut again = big.clone();
    again[3] = svc("s03", "198.18.100.200");
    let out = log.apply(again).await.unwrap();
    let changed: Vec<_> = out
        .results
        .iter()
        .filter(|(_, c)| *c != Change::Unchanged)
        .collect();
    assert_eq!(changed.len(), 1);

    // Bytes: one large object over etcd's --max-request-bytes.
    let etcd = Etcd::builder().max_request_bytes(64 * 1024).start();
    let mut o = options(etcd.endpoint());
    o.max_request_bytes = 64 * 1024;
    let small = EtcdLog::connect(o).await.unwrap();
    let addrs: Vec<String> = (0..4000)
        .map(|i| format!("198.19.{}.{}", i / 250, i % 250 + 1))
        .collect();
    let refs: Vec<&str> = addrs.iter().map(String::as_str).collect();
    let huge = eps("web", &refs);
    let err = small.apply(vec![huge.clone()]).await.unwrap_err();
    assert!(
        matches!(
            &err,
            ApplyError::Log(LogError::TooLarge {
                setting: "--max-request-bytes",
                unit: "bytes",
                ..
            })
        ),
        "{err:?}"
    );
    // A client told a higher limit than etcd's: etcd's refusal, named, not a
    // transport error; still nothing written.
    let trusting = connect(etcd.endpoint()).await;
    let before = etcd.revision();
    let err = trusting.apply(vec![huge]).await.unwrap_err();
    match &err {
        ApplyError::Log(LogError::Refused { message, .. }) => {
            assert!(message.contains("--max-request-bytes"), "{message}");
            assert!(message.contains("nothing was written"), "{message}");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    assert_eq!(etcd.revision(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_and_delete_work_through_the_shared_store_trait() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let dir = tempfile::tempdir().unwrap();
    let embedded = EmbeddedLog::open(dir.path(), EmbeddedOptions::default()).unwrap();
    let stores: [Arc<dyn ObjectStore>; 2] = [Arc::new(log), Arc::new(embedded)];
    let mut answers = Vec::new();
    for store in &stores {
        let mut objects = vec![
            svc("web", "198.18.100.1"),
            eps("web", &["198.18.11.2"]),
            svc("api", ""),
        ];
        let mut shop = svc("cart", "198.18.100.2");
        if let Object::Service(s) = &mut shop {
            s.metadata.namespace = "shop".to_owned();
        }
        objects.push(shop);
        let out = store.apply(objects).await.unwrap();
        let (revision, all) = store.get(None, None, None).await.unwrap();
        assert_eq!(revision, out.revision);
        let (_, services) = store
            .get(Some(Kind::Service), Some("default"), None)
            .await
            .unwrap();
        let (_, web) = store
            .get(Some(Kind::Service), Some("default"), Some("web"))
            .await
            .unwrap();
        let gone = store.delete(&key(Kind::Service, "web")).await.unwrap();
        let missing = store.delete(&key(Kind::Service, "web")).await.unwrap();
        assert!(gone.is_some() && missing.is_none());
        let snap = store.snapshot().await.unwrap();
        let names = |v: &[Object]| v.iter().map(|o| o.key().to_string()).collect::<Vec<_>>();
        answers.push((
            names(&all),
            names(&services),
            names(&web),
            names(&snap.objects),
        ));
    }
    assert_eq!(answers[0], answers[1], "etcd and the embedded store differ");
    assert_eq!(
        answers[0].0,
        [
            "Service default/api",
            "Service default/web",
            "Service shop/cart",
            "Endpoints default/web"
        ]
    );
}

#[tokio::test]
async fn plain_http_to_an_address_that_is_not_loopback_is_refused_before_anything_is_sent() {
    // A documentation address (never contacted: the refusal comes first).
    let err = EtcdLog::connect(EtcdOptions::new(["http://192.0.2.10:2379"]))
        .await
        .unwrap_err();
    assert_eq!(
        err,
        ConnectError::PlainHttp {
            endpoint: "http://192.0.2.10:2379".to_owned()
        }
    );
    assert!(err.to_string().contains("https://"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_another_client_broke_can_be_replaced_or_deleted() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    // A service whose value another client overwrote with garbage, its VIPs
    // still in the index (unknown to a reader of the value).
    log.apply(vec![svc("broken", "198.18.100.9, \"fd00:100::9\"")])
        .await
        .unwrap();
    etcd.ctl_ok(&["put", "/rune-test/v1/service/default/broken", "{garbage"]);

    // Replacing it releases the VIPs it no longer names.
    let out = log
        .apply(vec![svc("broken", "198.18.100.9")])
        .await
        .unwrap();
    assert_eq!(out.results[0].1, Change::Configured);
    log.apply(vec![svc("other", "\"fd00:100::9\"")])
        .await
        .unwrap();

    // Deleting it while broken releases every VIP it owned.
    etcd.ctl_ok(&["put", "/rune-test/v1/service/default/broken", "{garbage"]);
    assert!(
        log.delete(&key(Kind::Service, "broken"))
            .await
            .unwrap()
            .is_some()
    );
    log.apply(vec![svc("third", "198.18.100.9")]).await.unwrap();

    // An index entry that names no service stops an apply that needs it, named.
    etcd.ctl_ok(&["put", "/rune-test/v1/_index/vip/198.18.100.7", "nonsense"]);
    let err = log
        .apply(vec![svc("fourth", "198.18.100.7")])
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("etcd VIP index entry /rune-test/v1/_index/vip/198.18.100.7"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_meeting_on_one_port_are_refused_against_their_service_as_embedded_does() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let doc = |text: &str| rune_agent::model::parse_documents(text).unwrap().remove(0);
    let service = doc(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: web}\n\
         spec: {ports: [{name: http, port: 80, targetPort: 8080}], discovery: {vips: [198.18.100.9]}}\n",
    );
    // Two endpoints on one address that differ only by an override equal to the
    // target port: the same backend once the Service's ports are known.
    let endpoints = doc(
        "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: web}\n\
         spec: {endpoints: [{address: 198.18.11.2}, {address: 198.18.11.2, ports: {http: 8080}}]}\n",
    );
    // The Service in the same apply.
    let batch = vec![service.clone(), endpoints.clone()];
    let before = etcd.revision();
    let err = log.apply(batch.clone()).await.unwrap_err();
    assert_eq!(err.to_string(), embedded_error(&[batch]));
    assert!(
        err.to_string()
            .contains("spec.endpoints[1]: duplicate endpoint 198.18.11.2:8080 (http)"),
        "{err}"
    );
    assert_eq!(etcd.revision(), before, "nothing written");
    // The Service already stored: read from etcd for the check.
    log.apply(vec![service.clone()]).await.unwrap();
    let before = etcd.revision();
    let err = log.apply(vec![endpoints.clone()]).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        embedded_error(&[vec![service.clone()], vec![endpoints.clone()]])
    );
    assert_eq!(etcd.revision(), before, "nothing written");
    // Through a read-modify-write too.
    let err = log
        .update(&key(Kind::Endpoints, "web"), |_| Some(endpoints.clone()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("duplicate endpoint"), "{err}");
}

/// A service `default/<name>` exposed at `host` and `path`.
fn exposed(name: &str, host: &str, path: &str) -> Object {
    let text = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
         spec: {{ports: [{{port: 80}}], expose: {{host: {host}, path: {path}}}}}\n"
    );
    rune_agent::model::parse_documents(&text)
        .expect("a valid service")
        .remove(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exposed_host_and_path_belong_to_one_service_as_a_vip_does() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let a = vec![exposed("a", "shop.example.com", "/api")];
    log.apply(a.clone()).await.unwrap();
    // Another path on the host is free; the same one is refused naming both.
    log.apply(vec![exposed("b", "shop.example.com", "/")])
        .await
        .unwrap();
    let c = vec![exposed("c", "shop.example.com", "/api")];
    let err = log.apply(c.clone()).await.unwrap_err();
    assert_eq!(err.to_string(), embedded_error(&[a.clone(), c]));
    assert_eq!(
        err.to_string(),
        "Service default/c: spec.expose: host shop.example.com path /api is already used by Service default/a"
    );
    // a moves to another path: its old claim is released in the same apply.
    log.apply(vec![exposed("a", "shop.example.com", "/v2")])
        .await
        .unwrap();
    log.apply(vec![exposed("c", "shop.example.com", "/api")])
        .await
        .unwrap();
    // The embedded store's index moves the same way.
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedLog::open(dir.path(), EmbeddedOptions::default()).unwrap();
    for (name, path) in [("a", "/api"), ("b", "/"), ("a", "/v2"), ("c", "/api")] {
        store
            .apply(vec![exposed(name, "shop.example.com", path)])
            .unwrap();
    }
    let index: Vec<String> = stored_keys(&etcd)
        .into_iter()
        .filter(|k| k.contains("/_index/"))
        .collect();
    assert_eq!(
        index,
        [
            "/rune-test/v1/_index/vip/route:shop.example.com/",
            "/rune-test/v1/_index/vip/route:shop.example.com/api",
            "/rune-test/v1/_index/vip/route:shop.example.com/v2",
        ]
    );
}
