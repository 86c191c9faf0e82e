//! Nodes in etcd against a real etcd (no root needed): registration under a lease,
//! deregistration on stop, expiry when the agent dies, a new lease after the old
//! one was lost, the document's facts and applied revision, `wait_applied`, the
//! `get nodes` table, and the object readers ignoring the nodes' keys.

mod etcd_common;

use etcd_common::*;
use futures::StreamExt as _;
use rune_agent::{
    applied::AppliedRevision,
    cli::nodes::{DocumentFormat, WaitError, get_node, list_nodes, wait_applied, write_table},
    config::Mode,
    dataplane::{DataPlane, DataPlaneError, ServicePortStatus, reconciler::Reconciler},
    endpoints::{CacheFeed, Delta, EndpointCache},
    identity::Identity,
    metrics::Metrics,
    model::Kind,
    node::{
        NodeDocument,
        conditions::{Kind as Condition, Status},
        facts::FactsSource,
        registrar::{Registrar, RegistrarOptions},
    },
    orderedlog::{
        Event, OrderedLog,
        etcd::{EtcdLog, NodeRecord},
    },
    subsystem::{Readiness, StartContext, Subsystem},
};
use rune_harness::etcd::{Etcd, Gate};
use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};
use tokio_util::sync::CancellationToken;

/// Short leases for the tests that wait for one to expire.
fn short() -> RegistrarOptions {
    RegistrarOptions {
        ttl: Duration::from_secs(2),
        heartbeat: Duration::from_millis(500),
        facts_interval: Duration::from_secs(60),
    }
}

fn identity(id: &str, hostname: &str) -> Identity {
    Identity {
        node_id: id.to_owned(),
        hostname: hostname.to_owned(),
        labels: BTreeMap::new(),
    }
}

/// A registrar on `log`, started; with its cancel token and applied revision.
struct Running {
    registrar: Registrar,
    cancel: CancellationToken,
    applied: AppliedRevision,
}

async fn start(log: &EtcdLog, id: &Identity, options: RegistrarOptions, ready: bool) -> Running {
    let dir = std::env::temp_dir();
    let mut source = FactsSource::fixed("userspace", "dev mode", dir);
    if !ready {
        source.ready = Arc::new(|| Err("dns is not ready".to_owned()));
    }
    let applied = AppliedRevision::new();
    let registrar = Registrar::new(log.clone(), id.clone(), source, applied.clone(), options);
    let cancel = CancellationToken::new();
    registrar
        .start(&StartContext::new(cancel.clone(), Mode::Dev))
        .await
        .expect("start");
    Running {
        registrar,
        cancel,
        applied,
    }
}

impl Running {
    async fn stop(self) {
        self.cancel.cancel();
        self.registrar.stop().await.expect("stop");
    }
}

/// Waits until `check` holds for node `id`'s record (or its absence).
async fn until(
    log: &EtcdLog,
    id: &str,
    what: &str,
    check: impl Fn(Option<&NodeRecord>) -> bool,
) -> Option<NodeRecord> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let record = log.get_node(id).await.ok().flatten();
        if check(record.as_ref()) {
            return record;
        }
        assert!(
            Instant::now() < deadline,
            "node {id}: {what} did not happen in time; last: {record:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn document(record: &NodeRecord) -> NodeDocument {
    NodeDocument::parse(&record.id, &record.value).expect("a node document")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_writes_the_document_under_a_30_second_lease_and_stop_deletes_it() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let id = identity("0123456789abcdef0123456789abcdef", "node-a");
    let node = start(&log, &id, RegistrarOptions::default(), true).await;
    let record = until(&log, &id.node_id, "registration", |r| r.is_some())
        .await
        .unwrap();
    let (left, granted) = record.ttl.expect("the key has a lease");
    assert_eq!(granted, 30);
    assert!((28..=30).contains(&left), "{left}");
    assert_eq!(node.registrar.lease().map(|l| l.id), Some(record.lease));

    let doc = document(&record);
    assert_eq!(doc.identity.id, id.node_id);
    assert_eq!(doc.identity.hostname, "node-a");
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_eq!(doc.facts.kernel_release, release.trim());
    assert_eq!(doc.facts.architecture, std::env::consts::ARCH);
    assert!(doc.facts.cpus >= 1 && doc.facts.memory_total_bytes > 0);
    assert_eq!(doc.facts.dataplane.mode, "userspace");
    assert!(doc.addresses.iter().all(|a| !a.is_loopback()));
    assert!(doc.is_ready());
    assert_eq!(
        doc.condition(Condition::StoreDisconnected).unwrap().status,
        Status::False
    );
    // camelCase on the wire.
    let text = String::from_utf8(record.value.clone()).unwrap();
    for field in [
        "\"appliedRevision\":0",
        "\"heartbeatTime\"",
        "\"kernelRelease\"",
        "\"lastTransitionTime\"",
    ] {
        assert!(text.contains(field), "{field} in {text}");
    }

    node.stop().await;
    assert_eq!(
        log.get_node(&id.node_id).await.unwrap(),
        None,
        "stop revokes the lease: the key is gone at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registrar_that_dies_leaves_its_key_to_expire_after_the_ttl() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let id = identity("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "dies");
    let node = start(&log, &id, short(), true).await;
    let first = until(&log, &id.node_id, "registration", |r| r.is_some())
        .await
        .unwrap();
    // Keep-alives hold it past the TTL, without rewriting the document (six
    // heartbeats of a quiet node: nothing changed).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let held = log
        .get_node(&id.node_id)
        .await
        .unwrap()
        .expect("heartbeats keep the key");
    assert_eq!(
        held.mod_revision, first.mod_revision,
        "a quiet node's heartbeats write nothing"
    );
    assert_eq!(held.lease, first.lease);
    // Dies: its loop ends, and nothing revokes the lease.
    node.cancel.cancel();
    let died = Instant::now();
    until(&log, &id.node_id, "expiry", |r| r.is_none()).await;
    assert!(
        died.elapsed() >= Duration::from_secs(1),
        "gone only when the lease expired: {:?}",
        died.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_lease_is_replaced_and_the_document_written_again() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let id = identity("bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", "revoked");
    let node = start(&log, &id, short(), true).await;
    let first = until(&log, &id.node_id, "registration", |r| r.is_some())
        .await
        .unwrap();
    etcd.ctl_ok(&["lease", "revoke", &format!("{:x}", first.lease)]);
    let again = until(&log, &id.node_id, "registration under a new lease", |r| {
        r.is_some_and(|r| r.lease != first.lease)
    })
    .await
    .unwrap();
    assert_eq!(document(&again).identity.id, id.node_id);
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_deleted_by_hand_is_written_again_at_the_next_heartbeat() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let id = identity("cccccccccccccccccccccccccccccccc", "deleted");
    let node = start(&log, &id, short(), true).await;
    let first = until(&log, &id.node_id, "registration", |r| r.is_some())
        .await
        .unwrap();
    let key = format!("{}nodes/{}", options(etcd.endpoint()).prefix, id.node_id);
    let deleted = etcd.ctl_ok(&["del", &key]);
    assert_eq!(deleted.trim(), "1", "{key}");
    // Nothing about the node changed: only the heartbeat's check brings it back,
    // under the same lease.
    let again = until(&log, &id.node_id, "the key written again", |r| r.is_some())
        .await
        .unwrap();
    assert_eq!(again.lease, first.lease);
    assert_eq!(document(&again).identity.id, id.node_id);
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_out_of_reach_longer_than_the_ttl_means_a_new_registration_when_it_returns() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let gate = Gate::new(etcd.addr());
    let mut options = options(&gate.endpoint());
    options.request_timeout = Duration::from_secs(1);
    options.connect_timeout = Duration::from_secs(1);
    let cut_off = EtcdLog::connect(options).await.unwrap();
    let id = identity("cccccccccccccccccccccccccccccccc", "cut-off");
    let node = start(&cut_off, &id, short(), true).await;
    let first = until(&log, &id.node_id, "registration", |r| r.is_some())
        .await
        .unwrap();

    gate.cut();
    // etcd itself runs on: the lease expires and the key goes.
    until(&log, &id.node_id, "expiry while cut off", |r| r.is_none()).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    gate.restore();
    let again = until(&log, &id.node_id, "registration after the cut", |r| {
        r.is_some()
    })
    .await
    .unwrap();
    assert_ne!(again.lease, first.lease);
    let doc = document(&again);
    assert_eq!(doc.identity.id, id.node_id);
    // Written again once the store answered: it says so.
    let store = until(&log, &id.node_id, "StoreDisconnected False", |r| {
        r.is_some_and(|r| {
            document(r)
                .condition(Condition::StoreDisconnected)
                .unwrap()
                .status
                == Status::False
        })
    })
    .await
    .unwrap();
    assert!(document(&store).is_ready());
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_applied_revision_is_published_and_wait_applied_waits_for_every_ready_node() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let a = start(
        &log,
        &identity("a0000000000000000000000000000000", "node-a"),
        short(),
        true,
    )
    .await;
    let b = start(
        &log,
        &identity("b0000000000000000000000000000000", "node-b"),
        short(),
        true,
    )
    .await;
    // Not Ready: never waited for.
    let c = start(
        &log,
        &identity("c0000000000000000000000000000000", "node-c"),
        short(),
        false,
    )
    .await;
    let (ack_a, ack_b, _ack_c) = (
        a.applied.consumer("dataplane"),
        b.applied.consumer("dataplane"),
        c.applied.consumer("dataplane"),
    );
    for n in [
        "a0000000000000000000000000000000",
        "b0000000000000000000000000000000",
        "c0000000000000000000000000000000",
    ] {
        until(&log, n, "registration", |r| r.is_some()).await;
    }

    let waiter = {
        let log = log.clone();
        tokio::spawn(async move { wait_applied(&log, 10, Duration::from_secs(20)).await })
    };
    ack_a.ack(10);
    until(
        &log,
        "a0000000000000000000000000000000",
        "applied 10",
        |r| r.is_some_and(|r| document(r).applied_revision == 10),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "node-b has not applied 10");
    ack_b.ack(12);
    let ready = tokio::time::timeout(PATIENCE, waiter)
        .await
        .expect("wait_applied returns")
        .unwrap();
    assert_eq!(ready.unwrap(), 2, "two Ready nodes have it");

    // The table.
    let mut out = Vec::new();
    write_table(&list_nodes(&log).await.unwrap(), &mut out).unwrap();
    let table = String::from_utf8(out).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("NAME") && lines[0].contains("HEARTBEAT"),
        "{table}"
    );
    assert!(
        lines[1].starts_with("node-a") && lines[1].contains("Ready") && lines[1].contains("10"),
        "{table}"
    );
    assert!(
        lines[3].starts_with("node-c") && lines[3].contains("NotReady"),
        "{table}"
    );
    let mut yaml = Vec::new();
    get_node(&log, "node-b", DocumentFormat::Yaml, &mut yaml)
        .await
        .unwrap();
    let yaml = String::from_utf8(yaml).unwrap();
    assert!(
        yaml.contains("appliedRevision: 12") && yaml.contains("kernelRelease:"),
        "{yaml}"
    );

    // A timeout names the laggard.
    ack_a.ack(20);
    let started = Instant::now();
    let err = wait_applied(&log, 20, Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(started.elapsed() >= Duration::from_secs(2));
    match &err {
        WaitError::Lagging(l) => {
            assert_eq!(l.lagging.len(), 1, "{err}");
            assert_eq!(
                (l.lagging[0].name.as_str(), l.lagging[0].applied),
                ("node-b", 12)
            );
        }
        other => panic!("{other}"),
    }
    assert!(
        err.to_string()
            .contains("node-b (b0000000000000000000000000000000) at 12"),
        "{err}"
    );
    for n in [a, b, c] {
        n.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_object_snapshot_and_watch_ignore_the_nodes_keys() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let node = start(
        &log,
        &identity("d0000000000000000000000000000000", "node-d"),
        short(),
        true,
    )
    .await;
    let ack = node.applied.consumer("dataplane");
    until(
        &log,
        "d0000000000000000000000000000000",
        "registration",
        |r| r.is_some(),
    )
    .await;

    let snapshot = log.snapshot().await.unwrap();
    assert!(snapshot.objects.is_empty(), "{:?}", snapshot.objects);
    let mut events = log.watch(snapshot.revision).await.unwrap();
    // Node writes (and an expiry-free rewrite) between object writes.
    ack.ack(1);
    until(&log, "d0000000000000000000000000000000", "applied 1", |r| {
        r.is_some_and(|r| document(r).applied_revision == 1)
    })
    .await;
    log.apply(vec![svc("web", "198.18.100.1")]).await.unwrap();
    ack.ack(2);
    match next(&mut events).await.unwrap() {
        Event::Put { object, .. } => assert_eq!(object.key(), key(Kind::Service, "web")),
        other => panic!("{other:?}"),
    }
    // The node's deletion (stop) is no event either.
    node.stop().await;
    assert!(
        tokio::time::timeout(QUIET, events.next()).await.is_err(),
        "nothing else"
    );
    assert_eq!(log.skipped().count, 0, "{:?}", log.skipped().last);
    let (_, objects) = log.get(None, None, None).await.unwrap();
    assert_eq!(objects.len(), 1);
}

/// A data plane that takes every delta (the chain's last link, without a kernel).
struct NullPlane;

/// The trait's methods as `async_trait` expands them (this crate does not
/// depend on the macro).
type Boxed<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

impl DataPlane for NullPlane {
    fn mode(&self) -> &'static str {
        "userspace"
    }
    fn apply<'life0, 'life1, 'async_trait>(
        &'life0 self,
        _: &'life1 Delta,
    ) -> Boxed<'async_trait, Result<(), DataPlaneError>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async { Ok(()) })
    }
    fn status(&self) -> Vec<ServicePortStatus> {
        Vec::new()
    }
    fn shutdown<'life0, 'async_trait>(&'life0 self) -> Boxed<'async_trait, ()>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async {})
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apply_reaches_the_applied_revision_through_the_watch_the_cache_and_the_data_plane() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let metrics = Arc::new(Metrics::new());
    let cache = Arc::new(EndpointCache::new());
    let applied = AppliedRevision::with_metrics(&metrics);
    let feed = CacheFeed::new(Arc::new(log.clone()), cache.clone(), metrics.clone())
        .with_applied(applied.clone());
    let plane = Reconciler::new(Arc::new(NullPlane), cache.clone())
        .with_applied(applied.consumer("dataplane"));
    let id = identity("e0000000000000000000000000000000", "node-e");
    let registrar = Registrar::new(
        log.clone(),
        id.clone(),
        FactsSource::fixed("userspace", "dev mode", std::env::temp_dir()),
        applied.clone(),
        short(),
    );
    let cancel = CancellationToken::new();
    let ctx = StartContext::new(cancel.clone(), Mode::Dev);
    for s in [&feed as &dyn Subsystem, &plane, &registrar] {
        s.start(&ctx).await.unwrap();
    }
    until(&log, &id.node_id, "registration", |r| r.is_some()).await;

    let outcome = log
        .apply(vec![
            svc("web", "198.18.100.1"),
            eps("web", &["198.18.11.2"]),
        ])
        .await
        .unwrap();
    let ready = wait_applied(&log, outcome.revision, PATIENCE)
        .await
        .unwrap();
    assert_eq!(ready, 1);
    let doc = document(&log.get_node(&id.node_id).await.unwrap().unwrap());
    assert_eq!(doc.applied_revision, outcome.revision);
    let text = metrics.encode();
    assert!(
        text.contains(&format!("rune_applied_revision {}", outcome.revision)),
        "{text}"
    );
    assert!(
        !text.contains("rune_watch_lag_seconds_count 0"),
        "the apply's events were measured: {text}"
    );

    cancel.cancel();
    for s in [&registrar as &dyn Subsystem, &plane, &feed] {
        s.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_of_readiness_is_written_at_once_not_at_the_next_heartbeat() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let (setter, readiness) = Readiness::new();
    let mut source = FactsSource::fixed("userspace", "dev mode", std::env::temp_dir());
    let flag = readiness.clone();
    source.ready = Arc::new(move || {
        if flag.is_ready() {
            Ok(())
        } else {
            Err("watch is not ready".to_owned())
        }
    });
    source.ready_changes = Some(readiness);
    let id = identity("f0000000000000000000000000000000", "node-f");
    // The default 10 s heartbeat: only the readiness change can write in time.
    let registrar = Registrar::new(
        log.clone(),
        id.clone(),
        source,
        AppliedRevision::new(),
        RegistrarOptions::default(),
    );
    let cancel = CancellationToken::new();
    registrar
        .start(&StartContext::new(cancel.clone(), Mode::Dev))
        .await
        .unwrap();
    let first = until(&log, &id.node_id, "registration", |r| r.is_some())
        .await
        .unwrap();
    let ready = document(&first);
    assert!(!ready.is_ready());
    assert_eq!(
        ready.condition(Condition::Ready).unwrap().message,
        "watch is not ready"
    );
    setter.set_ready();
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let doc = document(&log.get_node(&id.node_id).await.unwrap().unwrap());
        if doc.is_ready() {
            break;
        }
        assert!(Instant::now() < deadline, "Ready not written within 3 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cancel.cancel();
    registrar.stop().await.unwrap();
}
