use super::*;
use crate::model::ModelError;
use crate::model::parse_documents;
use crate::orderedlog::{Event, EventStream, OrderedLog};
use futures::StreamExt;
use std::{collections::BTreeMap, time::Duration};
use tokio::time::timeout;

/// How long a watcher may take to see an event before the test fails.
const PATIENCE: Duration = Duration::from_secs(10);
/// How long a watcher must stay silent to count as having nothing more.
const QUIET: Duration = Duration::from_millis(200);

fn svc(name: &str, vip: &str) -> Object {
    let text = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
         spec: {{ports: [{{port: 80}}], discovery: {{vips: [{vip}]}}}}\n"
    );
    parse_documents(&text).unwrap().remove(0)
}

fn eps(name: &str, addr: &str) -> Object {
    let text = format!(
        "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\n\
         spec: {{endpoints: [{{address: {addr}}}]}}\n"
    );
    parse_documents(&text).unwrap().remove(0)
}

fn open(dir: &Path) -> EmbeddedLog {
    EmbeddedLog::open(dir, EmbeddedOptions::default()).unwrap()
}

fn open_with_history(dir: &Path, history: u64) -> EmbeddedLog {
    EmbeddedLog::open(dir, EmbeddedOptions { history }).unwrap()
}

fn key(kind: Kind, name: &str) -> ObjectKey {
    ObjectKey::new(kind, "default", name)
}

async fn next(s: &mut EventStream) -> Result<Event, LogError> {
    timeout(PATIENCE, s.next())
        .await
        .expect("watcher timed out")
        .expect("watch stream ended")
}

async fn take(s: &mut EventStream, n: usize) -> Vec<Event> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(next(s).await.unwrap());
    }
    out
}

async fn assert_quiet(s: &mut EventStream) {
    if let Ok(item) = timeout(QUIET, s.next()).await {
        panic!("expected no more events, got {item:?}");
    }
}

fn revisions(events: &[Event]) -> Vec<Revision> {
    events.iter().map(Event::revision).collect()
}

fn put(revision: Revision, object: &Object) -> Event {
    Event::Put {
        revision,
        object: object.clone(),
    }
}

#[tokio::test]
async fn snapshot_then_watch_sees_later_puts_and_deletes_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    let web = svc("web", "198.18.0.1");
    let web_eps = eps("web", "10.0.0.1");
    let out = log.apply(vec![web_eps.clone(), web.clone()]).unwrap();
    assert_eq!(out.revision, 2);
    assert_eq!(
        out.results,
        vec![
            (web_eps.key(), Change::Created),
            (web.key(), Change::Created)
        ]
    );

    let snap = log.snapshot().await.unwrap();
    assert_eq!(snap.revision, 2);
    // Ordered by key: Service sorts before Endpoints.
    assert_eq!(snap.objects, vec![web.clone(), web_eps.clone()]);

    let mut stream = log.watch(snap.revision).await.unwrap();
    assert_quiet(&mut stream).await;
    let web_eps2 = eps("web", "10.0.0.2");
    let api = svc("api", "198.18.0.2");
    assert_eq!(log.apply(vec![web_eps2.clone()]).unwrap().revision, 3);
    assert_eq!(log.delete(&web.key()).unwrap(), Some(4));
    assert_eq!(log.apply(vec![api.clone()]).unwrap().revision, 5);
    assert_eq!(
        take(&mut stream, 3).await,
        vec![
            put(3, &web_eps2),
            Event::Delete {
                revision: 4,
                key: web.key()
            },
            put(5, &api),
        ]
    );
    assert_quiet(&mut stream).await;
    assert_eq!(log.revision(), 5);
}

#[tokio::test]
async fn resume_from_a_middle_revision_gets_exactly_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    for i in 1..=5 {
        log.apply(vec![eps("web", &format!("10.0.0.{i}"))]).unwrap();
    }
    let mut stream = log.watch(2).await.unwrap();
    let events = take(&mut stream, 3).await;
    assert_eq!(revisions(&events), vec![3, 4, 5]);
    assert_eq!(events[2], put(5, &eps("web", "10.0.0.5")));
    assert_quiet(&mut stream).await;

    let mut all = log.watch(0).await.unwrap();
    assert_eq!(revisions(&take(&mut all, 5).await), vec![1, 2, 3, 4, 5]);

    let err = log.watch(6).await.err().unwrap();
    assert!(
        matches!(
            err,
            LogError::FutureRevision {
                requested: 6,
                current: 5
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn watching_compacted_history_asks_for_a_resync() {
    let dir = tempfile::tempdir().unwrap();
    let log = open_with_history(dir.path(), 3);
    for i in 1..=10 {
        log.apply(vec![eps("web", &format!("10.0.0.{i}"))]).unwrap();
    }
    let err = log.watch(5).await.err().unwrap();
    assert!(err.needs_resync(), "{err}");
    assert!(
        matches!(
            err,
            LogError::Compacted {
                requested: 5,
                oldest: 7
            }
        ),
        "{err}"
    );
    // The kept history is still there, and only it.
    let mut stream = log.watch(7).await.unwrap();
    assert_eq!(revisions(&take(&mut stream, 3).await), vec![8, 9, 10]);
    let stored = log.inner.db.begin_read().unwrap();
    let table = stored.open_table(LOG).unwrap();
    assert_eq!(table.first().unwrap().unwrap().0.value(), 8);

    // A watcher that falls behind while it waits gets the signal from its stream.
    let mut lagging = log.watch(10).await.unwrap();
    for i in 11..=15 {
        log.apply(vec![eps("web", &format!("10.0.0.{i}"))]).unwrap();
    }
    let err = next(&mut lagging).await.err().unwrap();
    assert!(err.needs_resync(), "{err}");
    let end = timeout(PATIENCE, lagging.next()).await.unwrap();
    assert!(end.is_none(), "stream goes on after its error: {end:?}");
}

#[tokio::test]
async fn objects_and_revisions_survive_close_and_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let web = svc("web", "198.18.0.1");
    {
        let log = open(dir.path());
        log.apply(vec![web.clone(), eps("web", "10.0.0.1")])
            .unwrap();
        assert_eq!(log.delete(&key(Kind::Endpoints, "web")).unwrap(), Some(3));
    }
    let log = open(dir.path());
    assert_eq!(log.revision(), 3);
    assert_eq!(log.get(None, None, None).unwrap(), (3, vec![web.clone()]));
    let out = log.apply(vec![eps("web", "10.0.0.9")]).unwrap();
    assert_eq!(out.revision, 4);
    let mut stream = log.watch(0).await.unwrap();
    let events = take(&mut stream, 4).await;
    assert_eq!(revisions(&events), vec![1, 2, 3, 4]);
    assert_eq!(
        events[2],
        Event::Delete {
            revision: 3,
            key: key(Kind::Endpoints, "web")
        }
    );
}

#[tokio::test]
async fn concurrent_writers_get_distinct_gapless_revisions_seen_in_order() {
    const THREADS: usize = 4;
    const EACH: usize = 25;
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    let mut stream = log.watch(0).await.unwrap();
    let writers: Vec<_> = (0..THREADS)
        .map(|t| {
            let log = log.clone();
            std::thread::spawn(move || {
                (0..EACH)
                    .map(|i| {
                        let o = eps(&format!("w{t}-{i}"), "10.0.0.1");
                        let out = log.apply(vec![o.clone()]).unwrap();
                        assert_eq!(out.results, vec![(o.key(), Change::Created)]);
                        (out.revision, o)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let events = take(&mut stream, THREADS * EACH).await;
    let mut by_revision = BTreeMap::new();
    for w in writers {
        let mine = w.join().unwrap();
        for pair in mine.windows(2) {
            assert!(pair[0].0 < pair[1].0, "not increasing: {pair:?}");
        }
        by_revision.extend(mine);
    }
    let all: Vec<Revision> = by_revision.keys().copied().collect();
    let expected: Vec<Revision> = (1..=(THREADS * EACH) as u64).collect();
    assert_eq!(all, expected);
    assert_eq!(revisions(&events), expected);
    for e in &events {
        assert_eq!(*e, put(e.revision(), &by_revision[&e.revision()]));
    }
    assert_quiet(&mut stream).await;
}

#[tokio::test]
async fn apply_is_all_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    let mut stream = log.watch(0).await.unwrap();
    let mut bad = svc("bad", "198.18.0.9");
    if let Object::Service(s) = &mut bad {
        s.spec.ports[0].port = 0;
    }
    let err = log
        .apply(vec![svc("web", "198.18.0.1"), eps("web", "10.0.0.1"), bad])
        .unwrap_err();
    match err {
        ApplyError::Invalid(ModelError::Invalid { object, field, .. }) => {
            assert_eq!(object, "Service default/bad");
            assert_eq!(field, "spec.ports[0].port");
        }
        other => panic!("unexpected {other:?}"),
    }
    // The same object twice in one batch is refused too.
    let err = log
        .apply(vec![eps("web", "10.0.0.1"), eps("web", "10.0.0.2")])
        .unwrap_err();
    assert!(matches!(err, ApplyError::Invalid(_)), "{err}");

    assert_eq!(log.revision(), 0);
    assert_eq!(log.get(None, None, None).unwrap(), (0, vec![]));
    assert_quiet(&mut stream).await;
}

#[tokio::test]
async fn an_unchanged_apply_makes_no_event() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    let web = svc("web", "198.18.0.1");
    let web_eps = eps("web", "10.0.0.1");
    log.apply(vec![web.clone(), web_eps.clone()]).unwrap();
    let mut stream = log.watch(2).await.unwrap();

    let out = log.apply(vec![web.clone(), web_eps.clone()]).unwrap();
    assert_eq!(out.revision, 2);
    assert_eq!(
        out.results,
        vec![
            (web.key(), Change::Unchanged),
            (web_eps.key(), Change::Unchanged)
        ]
    );
    assert_eq!(log.revision(), 2);
    assert_quiet(&mut stream).await;

    let changed = eps("web", "10.0.0.2");
    let out = log.apply(vec![web.clone(), changed.clone()]).unwrap();
    assert_eq!(out.revision, 3);
    assert_eq!(
        out.results,
        vec![
            (web.key(), Change::Unchanged),
            (changed.key(), Change::Configured)
        ]
    );
    assert_eq!(next(&mut stream).await.unwrap(), put(3, &changed));
    assert_quiet(&mut stream).await;
}

#[tokio::test]
async fn a_vip_conflict_is_refused_within_the_batch_and_with_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    let err = log
        .apply(vec![svc("a", "198.18.0.1"), svc("b", "198.18.0.1")])
        .unwrap_err();
    assert!(err.to_string().contains("already used by"), "{err}");
    assert_eq!(log.revision(), 0);

    log.apply(vec![svc("a", "198.18.0.1")]).unwrap();
    let err = log.apply(vec![svc("b", "198.18.0.1")]).unwrap_err();
    assert!(
        matches!(&err, ApplyError::Invalid(ModelError::Invalid { object, message, .. })
            if object == "Service default/b" && message.contains("Service default/a")),
        "{err}"
    );
    assert_eq!(log.revision(), 1);

    // The state the batch leaves counts: swapping VIPs in one apply is fine.
    let out = log
        .apply(vec![svc("a", "198.18.0.2"), svc("b", "198.18.0.1")])
        .unwrap();
    assert_eq!(out.revision, 3);
}

/// Endpoints that reach the same address and port through their Service (an
/// override equal to the target port) are refused, whether the Service comes in
/// the same apply or is already stored; nothing is written.
#[tokio::test]
async fn endpoints_meeting_on_one_address_and_port_are_refused_against_their_service() {
    let doc = |text: &str| parse_documents(text).unwrap().remove(0);
    let service = doc(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: web}\n\
         spec: {ports: [{name: http, port: 80, targetPort: 8080}], discovery: {vips: [198.18.0.9]}}\n",
    );
    let endpoints = doc(
        "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: web}\n\
         spec: {endpoints: [{address: 127.0.0.1}, {address: 127.0.0.1, ports: {http: 8080}}]}\n",
    );
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    for batch in [
        vec![service.clone(), endpoints.clone()],
        vec![endpoints.clone()],
    ] {
        if batch.len() == 1 {
            log.apply(vec![service.clone()]).unwrap();
        }
        let before = log.revision();
        let err = log.apply(batch).unwrap_err();
        assert!(
            err.to_string()
                .contains("spec.endpoints[1]: duplicate endpoint 127.0.0.1:8080 (http)"),
            "{err}"
        );
        assert_eq!(log.revision(), before, "nothing written");
    }
}

#[tokio::test]
async fn deleting_a_missing_key_returns_none() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    let k = key(Kind::Service, "web");
    assert_eq!(log.delete(&k).unwrap(), None);
    assert_eq!(log.revision(), 0);
    log.apply(vec![svc("web", "198.18.0.1")]).unwrap();
    assert_eq!(log.delete(&key(Kind::Endpoints, "web")).unwrap(), None);
    assert_eq!(log.delete(&k).unwrap(), Some(2));
    assert_eq!(log.delete(&k).unwrap(), None);
    assert_eq!(log.revision(), 2);
}

#[tokio::test]
async fn a_second_open_says_the_store_is_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let first = open(dir.path());
    let err = EmbeddedLog::open(dir.path(), EmbeddedOptions::default()).unwrap_err();
    assert!(matches!(err, LogError::Locked { .. }), "{err}");
    assert!(
        err.to_string().contains("in use by another process"),
        "{err}"
    );
    assert!(err.to_string().contains(STORE_FILE), "{err}");
    drop(first);
    open(dir.path());
}

#[tokio::test]
async fn get_filters_and_orders_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    let mut other_ns = svc("web", "198.18.0.3");
    if let Object::Service(s) = &mut other_ns {
        s.metadata.namespace = "a-b".into();
    }
    let objs = vec![
        eps("web", "10.0.0.1"),
        svc("web", "198.18.0.1"),
        svc("api", "198.18.0.2"),
        other_ns.clone(),
    ];
    log.apply(objs.clone()).unwrap();
    let (rev, all) = log.get(None, None, None).unwrap();
    assert_eq!(rev, 4);
    let mut sorted = objs.clone();
    sorted.sort_by_key(Object::key);
    assert_eq!(all, sorted);
    let (_, services) = log.get(Some(Kind::Service), None, None).unwrap();
    assert_eq!(services.len(), 3);
    let (_, in_default) = log.get(Some(Kind::Service), Some("default"), None).unwrap();
    assert_eq!(in_default, vec![objs[2].clone(), objs[1].clone()]);
    let (_, named) = log.get(None, None, Some("web")).unwrap();
    assert_eq!(named.len(), 3);
    let (_, one) = log.get(None, Some("a-b"), Some("web")).unwrap();
    assert_eq!(one, vec![other_ns]);
}

#[tokio::test]
async fn corrupt_records_are_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    log.apply(vec![eps("web", "10.0.0.1")]).unwrap();
    {
        let txn = log.inner.db.begin_write().unwrap();
        txn.open_table(LOG).unwrap().insert(1, "not json").unwrap();
        txn.open_table(OBJECTS)
            .unwrap()
            .insert("Endpoints/default/web", (1, "{}"))
            .unwrap();
        txn.commit().unwrap();
    }
    let mut stream = log.watch(0).await.unwrap();
    let err = next(&mut stream).await.unwrap_err();
    assert!(
        matches!(&err, LogError::Corrupt { what, .. } if what == "revision 1"),
        "{err}"
    );
    let err = log.snapshot().await.unwrap_err();
    assert!(
        matches!(&err, LogError::Corrupt { what, .. } if what == "object Endpoints/default/web"),
        "{err}"
    );
}

#[tokio::test]
async fn closing_the_log_ends_watchers() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    let mut stream = log.watch(0).await.unwrap();
    drop(log);
    let err = next(&mut stream).await.unwrap_err();
    assert!(matches!(err, LogError::Closed), "{err}");
    // The store is free again, although the stream still exists.
    open(dir.path());
}

#[test]
fn put_rows_are_what_serializing_the_event_gives() {
    let doc = svc("web", "198.18.0.1").to_json();
    let by_serde = serde_json::to_string(&StoredEvent::Put {
        object: doc.clone(),
    })
    .unwrap();
    assert_eq!(put_event(&doc.to_string()), by_serde);
    assert_eq!(
        parse_key_string("Service/default/web"),
        Some(key(Kind::Service, "web"))
    );
    assert_eq!(parse_key_string("Pod/default/web"), None);
    assert_eq!(parse_key_string("Service/default"), None);
}

#[tokio::test]
async fn the_vip_index_follows_updates_moves_and_deletes() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    log.apply(vec![svc("a", "198.18.0.1"), svc("b", "198.18.0.2")])
        .unwrap();
    // A VIP moved between two services of one batch, in both orders.
    log.apply(vec![svc("a", "198.18.0.3"), svc("b", "198.18.0.1")])
        .unwrap();
    log.apply(vec![svc("b", "198.18.0.2"), svc("a", "198.18.0.1")])
        .unwrap();
    let err = log.apply(vec![svc("c", "198.18.0.1")]).unwrap_err();
    assert!(
        err.to_string()
            .contains("already used by Service default/a"),
        "{err}"
    );
    // A VIP a service gave up is free; so is a deleted service's.
    log.apply(vec![svc("a", "198.18.0.4")]).unwrap();
    log.apply(vec![svc("c", "198.18.0.1")]).unwrap();
    let err = log.apply(vec![svc("d", "198.18.0.2")]).unwrap_err();
    assert!(
        err.to_string()
            .contains("already used by Service default/b"),
        "{err}"
    );
    log.delete(&key(Kind::Service, "b")).unwrap();
    log.apply(vec![svc("d", "198.18.0.2")]).unwrap();
    // A service keeping its own VIP is no conflict.
    let out = log.apply(vec![svc("d", "198.18.0.2")]).unwrap();
    assert_eq!(out.results[0].1, Change::Unchanged);
}

/// Every (VIP, owner) pair of the index.
fn index_entries(log: &EmbeddedLog) -> Vec<(String, String)> {
    let txn = log.inner.db.begin_read().unwrap();
    let t = txn.open_table(vips::VIPS).unwrap();
    t.iter()
        .unwrap()
        .map(|r| {
            let (k, v) = r.unwrap();
            (k.value().to_owned(), v.value().to_owned())
        })
        .collect()
}

#[tokio::test]
async fn a_store_without_the_index_gets_it_rebuilt_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    log.apply(vec![
        svc("a", "198.18.0.1"),
        svc("b", "fd00::1"),
        eps("a", "10.0.0.1"),
    ])
    .unwrap();
    let want = vec![
        ("198.18.0.1".to_owned(), "Service/default/a".to_owned()),
        ("fd00::1".to_owned(), "Service/default/b".to_owned()),
    ];
    assert_eq!(index_entries(&log), want);
    // Kept by every write: a reopen does not rebuild it.
    drop(log);
    let log = open(dir.path());
    {
        let txn = log.inner.db.begin_write().unwrap();
        assert!(!vips::ensure(&txn, log.revision(), log.path()).unwrap());
        txn.abort().unwrap();
    }
    // What an older agent leaves: no index table, no index revision.
    {
        let txn = log.inner.db.begin_write().unwrap();
        txn.delete_table(vips::VIPS).unwrap();
        txn.open_table(META)
            .unwrap()
            .remove(vips::META_VIP_INDEX)
            .unwrap();
        txn.commit().unwrap();
    }
    drop(log);
    let log = open(dir.path());
    assert_eq!(index_entries(&log), want);
    let err = log.apply(vec![svc("c", "198.18.0.1")]).unwrap_err();
    assert!(
        err.to_string()
            .contains("already used by Service default/a"),
        "{err}"
    );

    // Objects written after the index by an older agent (the index's revision lags).
    {
        let txn = log.inner.db.begin_write().unwrap();
        txn.open_table(OBJECTS)
            .unwrap()
            .insert(
                "Service/default/c",
                (4, svc("c", "198.18.0.7").to_json().to_string().as_str()),
            )
            .unwrap();
        txn.open_table(META)
            .unwrap()
            .insert(META_REVISION, 4)
            .unwrap();
        txn.commit().unwrap();
    }
    drop(log);
    let log = open(dir.path());
    assert_eq!(index_entries(&log).len(), 3);
    let err = log.apply(vec![svc("d", "198.18.0.7")]).unwrap_err();
    assert!(
        err.to_string()
            .contains("already used by Service default/c"),
        "{err}"
    );
}

#[tokio::test]
async fn a_large_apply_keeps_only_the_history_in_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = open_with_history(dir.path(), 5);
    let objects: Vec<Object> = (0..20).map(|i| eps(&format!("e{i}"), "10.0.0.1")).collect();
    let out = log.apply(objects.clone()).unwrap();
    assert_eq!(out.revision, 20);
    let err = log.watch(14).await.err().unwrap();
    assert!(err.needs_resync(), "{err}");
    let mut stream = log.watch(15).await.unwrap();
    let events = take(&mut stream, 5).await;
    assert_eq!(revisions(&events), vec![16, 17, 18, 19, 20]);
    assert_eq!(events[4], put(20, &objects[19]));
    assert_eq!(log.get(None, None, None).unwrap().1.len(), 20);
}

#[test]
fn new_stores_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let log = open(&state);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(log.path()), 0o600);
}

#[tokio::test]
async fn reads_follow_key_order_where_key_strings_sort_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    // As key strings `a-b/…` < `a/…` < `a0/…`; as keys `a` < `a-b` < `a0`.
    let in_ns = |ns: &str, name: &str, vip: &str| {
        let mut o = svc(name, vip);
        if let Object::Service(s) = &mut o {
            s.metadata.namespace = ns.into();
        }
        o
    };
    let objs = vec![
        in_ns("a0", "x", "198.18.0.1"),
        in_ns("a-b", "x", "198.18.0.2"),
        in_ns("a", "y", "198.18.0.3"),
        in_ns("a", "x", "198.18.0.4"),
        eps("x", "10.0.0.1"),
    ];
    log.apply(objs.clone()).unwrap();
    let mut sorted = objs.clone();
    sorted.sort_by_key(Object::key);
    assert_eq!(log.get(None, None, None).unwrap().1, sorted);
    assert_eq!(log.snapshot().await.unwrap().objects, sorted);
    let mut first = Vec::new();
    log.scan(Some(Kind::Service), None, None, |_, o| {
        first.push(o);
        ControlFlow::Break(())
    })
    .unwrap();
    assert_eq!(first, vec![sorted[0].clone()]);
    let (rev, counts) = log.count().unwrap();
    assert_eq!(rev, 5);
    assert_eq!(counts[&Kind::Service], 4);
    assert_eq!(counts[&Kind::Endpoints], 1);
}
