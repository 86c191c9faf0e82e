use super::*;
use crate::model::parse_documents;
use crate::{
    metrics::Metrics,
    orderedlog::{LogError, OrderedLog},
    subsystem::{StartContext, Subsystem},
};
use futures::StreamExt;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

fn objs(yaml: &str) -> Vec<Object> {
    parse_documents(yaml).unwrap()
}

fn service(name: &str, port: u16) -> Object {
    objs(&format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: {port}}}]}}\n"
    ))
    .remove(0)
}

fn endpoints(name: &str, addrs: &[&str]) -> Object {
    let list: Vec<String> = addrs.iter().map(|a| format!("{{address: {a}}}")).collect();
    objs(&format!(
        "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\nspec: {{endpoints: [{}]}}\n",
        list.join(", ")
    ))
    .remove(0)
}

fn put(revision: Revision, object: Object) -> Event {
    Event::Put { revision, object }
}

fn names(views: &[ServiceView]) -> Vec<String> {
    views.iter().map(|v| v.key().to_string()).collect()
}

#[test]
fn first_delta_is_full_then_only_changes() {
    let cache = Arc::new(EndpointCache::loaded());
    cache.apply_snapshot(&Snapshot {
        revision: 2,
        objects: vec![service("a", 80), service("b", 81)],
    });
    let mut sub = cache.subscribe();
    let d = sub.try_next().unwrap();
    assert!(d.full);
    assert_eq!(d.revision, 2);
    assert_eq!(names(&d.upserted), ["default/a", "default/b"]);
    assert!(sub.try_next().is_none(), "nothing changed since");

    cache.apply_event(&put(3, endpoints("a", &["198.18.1.2"])));
    let d = sub.try_next().unwrap();
    assert!(!d.full);
    assert_eq!(d.revision, 3);
    assert_eq!(names(&d.upserted), ["default/a"]);
    let eps = d.upserted[0].endpoints.as_ref().unwrap();
    assert_eq!(eps.spec.endpoints[0].address.to_string(), "198.18.1.2");
}

#[test]
fn changes_coalesce_per_service_and_read_the_newest_state() {
    let cache = Arc::new(EndpointCache::loaded());
    let mut sub = cache.subscribe();
    sub.try_next().unwrap();
    cache.apply_event(&put(1, service("a", 80)));
    cache.apply_event(&put(2, endpoints("a", &["198.18.1.2"])));
    cache.apply_event(&put(3, endpoints("a", &["198.18.1.3"])));
    let d = sub.try_next().unwrap();
    assert_eq!(d.upserted.len(), 1, "three events, one service: one view");
    let eps = d.upserted[0].endpoints.as_ref().unwrap();
    assert_eq!(eps.spec.endpoints[0].address.to_string(), "198.18.1.3");
}

#[test]
fn deletes_become_removals_and_unknown_vs_empty_endpoints_differ() {
    let cache = Arc::new(EndpointCache::loaded());
    cache.apply_event(&put(1, service("a", 80)));
    cache.apply_event(&put(2, endpoints("a", &[])));
    cache.apply_event(&put(3, service("b", 81)));
    let mut sub = cache.subscribe();
    let full = sub.try_next().unwrap();
    let a = &full.upserted[0];
    assert_eq!(
        a.endpoints.as_ref().map(|e| e.spec.endpoints.len()),
        Some(0)
    );
    assert!(
        full.upserted[1].endpoints.is_none(),
        "b's endpoints unknown"
    );

    cache.apply_event(&Event::Delete {
        revision: 4,
        key: ObjectKey::new(Kind::Service, "default", "a"),
    });
    let d = sub.try_next().unwrap();
    assert_eq!(d.removed, [ServiceKey::new("default", "a")]);
    assert!(d.upserted.is_empty());
    assert_eq!(
        cache.orphan_endpoints(),
        [ObjectKey::new(Kind::Endpoints, "default", "a")]
    );
}

#[test]
fn old_events_are_ignored() {
    let cache = Arc::new(EndpointCache::loaded());
    cache.apply_event(&put(5, service("a", 80)));
    cache.apply_event(&put(4, service("stale", 80)));
    assert_eq!(cache.revision(), 5);
    assert!(cache.view(&ServiceKey::new("default", "stale")).is_none());
}

/// Events of one transaction share a revision (an etcd apply): a Service and its
/// Endpoints written together both reach the cache, while events a snapshot
/// already covers (its revision or older) are left out.
#[test]
fn events_sharing_a_revision_are_all_applied_after_the_snapshot() {
    let cache = Arc::new(EndpointCache::loaded());
    cache.apply_snapshot(&Snapshot {
        revision: 7,
        objects: vec![service("a", 80)],
    });
    cache.apply_events(&[
        put(7, service("covered", 80)),
        put(8, service("b", 81)),
        put(8, endpoints("b", &["198.18.1.2"])),
    ]);
    assert!(cache.view(&ServiceKey::new("default", "covered")).is_none());
    let b = cache.view(&ServiceKey::new("default", "b")).expect("b");
    assert!(
        b.endpoints.is_some(),
        "the Endpoints of the same transaction"
    );
    cache.apply_event(&put(8, endpoints("a", &["198.18.1.3"])));
    let a = cache.view(&ServiceKey::new("default", "a")).expect("a");
    assert!(
        a.endpoints.is_some(),
        "a later event of revision 8 in the stream"
    );
    cache.apply_event(&put(6, endpoints("covered", &["198.18.1.4"])));
    assert!(cache.view(&ServiceKey::new("default", "covered")).is_none());
    assert_eq!(cache.revision(), 8);
}

#[test]
fn a_resync_snapshot_reports_only_differences() {
    let cache = Arc::new(EndpointCache::loaded());
    cache.apply_snapshot(&Snapshot {
        revision: 3,
        objects: vec![
            service("a", 80),
            service("b", 81),
            endpoints("b", &["198.18.1.2"]),
        ],
    });
    let mut sub = cache.subscribe();
    sub.try_next().unwrap();
    // After a compaction the consumer resyncs: a is gone, b's endpoints changed, c new.
    cache.apply_snapshot(&Snapshot {
        revision: 9,
        objects: vec![
            service("b", 81),
            endpoints("b", &["198.18.1.3"]),
            service("c", 82),
        ],
    });
    let d = sub.try_next().unwrap();
    assert_eq!(d.revision, 9);
    assert_eq!(names(&d.upserted), ["default/b", "default/c"]);
    assert_eq!(d.removed, [ServiceKey::new("default", "a")]);
    assert_eq!(cache.counts()[&Kind::Service], 2);
}

#[tokio::test]
async fn next_waits_for_a_change() {
    let cache = Arc::new(EndpointCache::loaded());
    let mut sub = cache.subscribe();
    assert!(sub.next().await.full);
    let waiter = tokio::spawn(async move { sub.next().await });
    // On the test's single-threaded runtime, one yield lets the waiter run up to
    // its wait: it must then be blocked, so the event below is what wakes it.
    tokio::task::yield_now().await;
    assert!(
        !waiter.is_finished(),
        "next() returned with nothing changed"
    );
    cache.apply_event(&put(1, service("a", 80)));
    let d = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("next() woke up")
        .unwrap();
    assert_eq!(names(&d.upserted), ["default/a"]);
}

#[test]
fn request_full_resends_everything() {
    let cache = Arc::new(EndpointCache::loaded());
    cache.apply_event(&put(1, service("a", 80)));
    let mut sub = cache.subscribe();
    sub.try_next().unwrap();
    sub.request_full();
    let d = sub.try_next().unwrap();
    assert!(d.full);
    assert_eq!(names(&d.upserted), ["default/a"]);
}

/// An ordered log whose first watch breaks with a compaction: the feed must resync
/// from a new snapshot.
struct CompactingLog {
    snapshots: Mutex<Vec<Snapshot>>,
    watches: Mutex<u32>,
}

#[async_trait::async_trait]
impl OrderedLog for CompactingLog {
    async fn snapshot(&self) -> Result<Snapshot, LogError> {
        let mut s = self.snapshots.lock().unwrap();
        Ok(if s.len() > 1 {
            s.remove(0)
        } else {
            s[0].clone()
        })
    }

    async fn watch(&self, from: Revision) -> Result<crate::orderedlog::EventStream, LogError> {
        *self.watches.lock().unwrap() += 1;
        if from == 1 {
            let err = LogError::Compacted {
                requested: 1,
                oldest: 4,
            };
            Ok(futures::stream::iter([Err(err)]).boxed())
        } else {
            Ok(futures::stream::pending().boxed())
        }
    }
}

#[tokio::test]
async fn the_feed_resyncs_after_a_compaction() {
    let log = Arc::new(CompactingLog {
        snapshots: Mutex::new(vec![
            Snapshot {
                revision: 1,
                objects: vec![service("a", 80)],
            },
            Snapshot {
                revision: 5,
                objects: vec![service("b", 81)],
            },
        ]),
        watches: Mutex::new(0),
    });
    let cache = Arc::new(EndpointCache::loaded());
    let metrics = Arc::new(Metrics::new());
    let feed = CacheFeed::new(log.clone(), cache.clone(), metrics.clone());
    let ctx = StartContext::new(CancellationToken::new(), crate::config::Mode::Dev);
    feed.start(&ctx).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), feed.ready().wait())
        .await
        .expect("ready after the first snapshot");
    tokio::time::timeout(Duration::from_secs(5), async {
        while cache.revision() != 5 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("resynced to revision 5");
    assert!(cache.view(&ServiceKey::new("default", "a")).is_none());
    assert!(cache.view(&ServiceKey::new("default", "b")).is_some());
    assert_eq!(*log.watches.lock().unwrap(), 2);
    assert_eq!(metrics.revision_applied.get(), 5);
    ctx.cancel.cancel();
    tokio::time::timeout(Duration::from_secs(5), feed.stop())
        .await
        .unwrap()
        .unwrap();
}

/// A snapshot read started before the feed (as `run` does, beside preflight) is the
/// feed's first one: it watches from that snapshot's revision.
#[tokio::test]
async fn the_feed_starts_from_a_snapshot_read_earlier() {
    let log = Arc::new(CompactingLog {
        snapshots: Mutex::new(vec![
            Snapshot {
                revision: 1,
                objects: vec![service("a", 80)],
            },
            Snapshot {
                revision: 5,
                objects: vec![service("b", 81)],
            },
        ]),
        watches: Mutex::new(0),
    });
    let cache = Arc::new(EndpointCache::new());
    // The early read takes its snapshot (revision 1) into the cache by itself,
    // before any feed runs.
    let early = read_first_snapshot(log.clone(), cache.clone());
    tokio::time::timeout(Duration::from_secs(5), async {
        while cache.revision() != 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the early read loaded the cache");
    assert!(cache.view(&ServiceKey::new("default", "a")).is_some());
    let metrics = Arc::new(Metrics::new());
    let feed = CacheFeed::new(log.clone(), cache.clone(), metrics).with_first_snapshot(early);
    let ctx = StartContext::new(CancellationToken::new(), crate::config::Mode::Dev);
    feed.start(&ctx).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        while cache.revision() != 5 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("resynced to revision 5");
    // The early snapshot (revision 1) was watched from, which this log answers with
    // a compaction; the log's own snapshot (revision 5) came after.
    assert_eq!(*log.watches.lock().unwrap(), 2);
    assert!(cache.view(&ServiceKey::new("default", "b")).is_some());
    ctx.cancel.cancel();
    tokio::time::timeout(Duration::from_secs(5), feed.stop())
        .await
        .unwrap()
        .unwrap();
}

#[test]
fn events_applied_together_reach_subscribers_together() {
    let cache = Arc::new(EndpointCache::loaded());
    let mut sub = cache.subscribe();
    sub.try_next().unwrap();
    // One `apply` of a service and its endpoints: never a delta in between that
    // shows the service without its endpoints.
    cache.apply_events(&[
        put(1, service("a", 80)),
        put(2, endpoints("a", &["198.18.1.2"])),
    ]);
    let d = sub.try_next().unwrap();
    assert_eq!(d.revision, 2);
    assert_eq!(d.upserted.len(), 1);
    assert!(d.upserted[0].endpoints.is_some(), "{d:?}");
    assert!(sub.try_next().is_none());
}

/// The backends of each port of a view: endpoints sharing an address stay apart
/// where their ports differ and meet (once, as the one taking new connections)
/// where they resolve alike, also after a Service change made them meet.
#[test]
fn port_backends_keep_endpoints_sharing_an_address_apart() {
    let svc = |target: u16| {
        objs(&format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: web}}\n\
             spec: {{ports: [{{name: http, port: 80, targetPort: {target}}}, {{name: dns, port: 53, protocol: UDP}}]}}\n"
        ))
        .remove(0)
    };
    let eps = objs(
        "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: web}\nspec:\n  endpoints:\n\
         \x20   - {address: 127.0.0.1, ports: {http: 8081}, terminating: true}\n\
         \x20   - {address: 127.0.0.1, ports: {http: 8082}}\n\
         \x20   - {address: 127.0.0.1, ports: {http: 8083}}\n\
         \x20   - {address: 127.0.0.1}\n",
    )
    .remove(0);
    let cache = Arc::new(EndpointCache::loaded());
    cache.apply_events(&[put(1, svc(8080)), put(2, eps)]);
    let mut sub = cache.subscribe();
    let view = sub.try_next().unwrap().upserted.remove(0);
    let ports = &view.service.spec.ports;
    let backends = |port| -> Vec<(String, bool)> {
        view.port_backends(port)
            .iter()
            .map(|b| (b.addr.to_string(), b.endpoint.accepts_new()))
            .collect()
    };
    let s = |a: &str, ready| (a.to_owned(), ready);
    assert_eq!(
        backends(&ports[0]),
        [
            s("127.0.0.1:8081", false),
            s("127.0.0.1:8082", true),
            s("127.0.0.1:8083", true),
            s("127.0.0.1:8080", true),
        ]
    );
    // On `dns` none overrides: one backend, shown as one taking new connections.
    assert_eq!(backends(&ports[1]), [s("127.0.0.1:53", true)]);

    // The target port becomes 8081: the terminating endpoint and the defaulted one
    // meet there, in the first one's place, as the one taking new connections.
    cache.apply_event(&put(3, svc(8081)));
    let view = sub.try_next().unwrap().upserted.remove(0);
    let http: Vec<(String, bool)> = view
        .port_backends(&view.service.spec.ports[0])
        .iter()
        .map(|b| (b.addr.to_string(), b.endpoint.accepts_new()))
        .collect();
    assert_eq!(
        http,
        [
            s("127.0.0.1:8081", true),
            s("127.0.0.1:8082", true),
            s("127.0.0.1:8083", true),
        ]
    );
}

/// A store that answered once and then went away: its watch breaks and every later
/// snapshot fails (etcd down).
struct VanishingLog {
    snapshots: Mutex<u32>,
}

#[async_trait::async_trait]
impl OrderedLog for VanishingLog {
    async fn snapshot(&self) -> Result<Snapshot, LogError> {
        let mut n = self.snapshots.lock().unwrap();
        *n += 1;
        if *n == 1 {
            return Ok(Snapshot {
                revision: 3,
                objects: vec![service("a", 80), endpoints("a", &["198.18.1.2"])],
            });
        }
        Err(LogError::Unavailable {
            endpoints: "http://127.0.0.1:2379".into(),
            message: "connection refused".into(),
        })
    }

    async fn watch(&self, _from: Revision) -> Result<crate::orderedlog::EventStream, LogError> {
        let err = LogError::Unavailable {
            endpoints: "http://127.0.0.1:2379".into(),
            message: "connection reset".into(),
        };
        Ok(futures::stream::iter([Err(err)]).boxed())
    }
}

/// Static stability: a store that goes away never empties the cache, never takes
/// readiness back, and wakes no subscriber (nothing is re-programmed).
#[tokio::test]
async fn a_store_that_goes_away_leaves_the_cache_and_readiness_as_they_were() {
    let log = Arc::new(VanishingLog {
        snapshots: Mutex::new(0),
    });
    let cache = Arc::new(EndpointCache::new());
    let feed = CacheFeed::new(log.clone(), cache.clone(), Arc::new(Metrics::new()));
    let ctx = StartContext::new(CancellationToken::new(), crate::config::Mode::Dev);
    feed.start(&ctx).await.unwrap();
    let ready = feed.ready();
    tokio::time::timeout(Duration::from_secs(5), ready.wait())
        .await
        .expect("ready after the first snapshot");
    let mut sub = cache.subscribe();
    assert!(sub.try_next().unwrap().full);
    // Several failed snapshots (backoff 100, 200, 400 ms…).
    tokio::time::timeout(Duration::from_secs(5), async {
        while *log.snapshots.lock().unwrap() < 4 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the feed keeps retrying");
    assert!(ready.is_ready(), "readiness stays once synced");
    assert_eq!(cache.revision(), 3);
    let a = cache.view(&ServiceKey::new("default", "a")).unwrap();
    assert_eq!(a.endpoint_list().len(), 1);
    assert!(sub.try_next().is_none(), "nothing to re-program");
    ctx.cancel.cancel();
    tokio::time::timeout(Duration::from_secs(5), feed.stop())
        .await
        .unwrap()
        .unwrap();
}
