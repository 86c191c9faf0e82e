//! Drains in etcd against a real etcd (no root needed): `drain` and `undrain`
//! write and delete `drains/<node-id>` (a second drain keeps the first record),
//! NODE is matched by id or host name and an unknown one is refused naming the
//! known nodes, the object readers ignore the drain keys, `get nodes` shows the
//! drain, and the `drains` subsystem hands the drained host names to the endpoint
//! cache, also across a broken connection (it lists again).

mod etcd_common;

use etcd_common::*;
use futures::StreamExt as _;
use rune_agent::{
    cli::{
        drain::{DrainError, drain, undrain},
        nodes::{list_nodes, write_table},
    },
    config::Mode,
    endpoints::EndpointCache,
    node::{drain::DrainRecord, drain_follower::DrainFollower},
    orderedlog::{OrderedLog, etcd::EtcdLog},
    subsystem::{StartContext, Subsystem},
};
use rune_harness::etcd::{Etcd, Gate};
use std::{
    collections::BTreeSet,
    sync::Arc,
    time::{Duration, Instant},
};
use tokio_util::sync::CancellationToken;

/// Registers node `id` with host name `hostname` (its document under a lease, as
/// its agent would write it).
async fn register(log: &EtcdLog, id: &str, hostname: &str) {
    let doc = format!(
        r#"{{"identity":{{"id":"{id}","hostname":"{hostname}"}},"addresses":[],
        "facts":{{"kernelRelease":"6.12","architecture":"x86_64","cpus":2,"memoryTotalBytes":1,
        "dataplane":{{"mode":"ebpf","reason":"test"}},"agentVersion":"0.1.0"}},
        "conditions":[],"appliedRevision":0,"heartbeatTime":"2026-12-02T05:00:00Z"}}"#
    );
    let lease = log.grant_lease(Duration::from_secs(60)).await.unwrap();
    log.put_node(id, doc.into_bytes(), lease)
        .await
        .unwrap()
        .unwrap();
}

/// The drained host names as `cache` has them, once they equal `want`.
async fn until_drained(cache: &EndpointCache, want: &[&str], what: &str) {
    let want: BTreeSet<String> = want.iter().map(|s| (*s).to_owned()).collect();
    let deadline = Instant::now() + PATIENCE;
    while cache.drained_nodes() != want {
        assert!(
            Instant::now() < deadline,
            "{what}: the cache has {:?}, not {want:?}",
            cache.drained_nodes()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_and_undrain_write_the_record_named_by_id_or_host_name() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    register(&log, "aaaa", "node-1").await;
    register(&log, "bbbb", "node-2").await;
    let snapshot = log.snapshot().await.unwrap();
    let mut events = log.watch(snapshot.revision).await.unwrap();

    let err = drain(&log, "nodde-1").await.unwrap_err();
    assert!(matches!(err, DrainError::NotFound { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "no node named nodde-1: the known nodes are node-1 (aaaa), node-2 (bbbb)"
    );

    let said = drain(&log, "node-1").await.unwrap();
    assert!(said.starts_with("node node-1 (aaaa) draining"), "{said}");
    let (_, drains) = log.list_drains().await.unwrap();
    assert_eq!(drains.len(), 1);
    let record = DrainRecord::parse(&drains[0].id, &drains[0].value).unwrap();
    assert_eq!(
        (record.node_id.as_str(), record.hostname.as_str()),
        ("aaaa", "node-1")
    );
    assert!(record.since.age() < Duration::from_secs(5), "{record:?}");
    // Again, by id: the first record stays.
    let said = drain(&log, "aaaa").await.unwrap();
    assert!(said.contains("drained already, since"), "{said}");
    let (_, again) = log.list_drains().await.unwrap();
    assert_eq!(again, drains);

    // `get nodes` shows it: no services, so Drained after the margin (2 s).
    let table = || async {
        let entries = list_nodes(&log).await.unwrap();
        let mut out = Vec::new();
        write_table(&entries, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    };
    let now = table().await;
    assert!(now.contains("node-1   NotReady,Draining"), "{now}");
    assert!(now.contains("node-2   NotReady   "), "{now}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = table().await;
    assert!(later.contains("node-1   NotReady,Drained "), "{later}");

    // The object readers see none of it: no event, nothing skipped.
    assert!(
        tokio::time::timeout(QUIET, events.next()).await.is_err(),
        "an object event for a drain"
    );
    let snapshot = log.snapshot().await.unwrap();
    assert!(snapshot.objects.is_empty());
    assert_eq!(log.skipped().count, 0, "{:?}", log.skipped().last);

    let said = undrain(&log, "node-1").await.unwrap();
    assert_eq!(
        said,
        "node node-1 (aaaa) undrained: its endpoints take new connections again"
    );
    let said = undrain(&log, "node-1").await.unwrap();
    assert_eq!(said, "node node-1 (aaaa) was not drained");
    assert!(log.list_drains().await.unwrap().1.is_empty());
    assert!(
        tokio::time::timeout(QUIET, events.next()).await.is_err(),
        "an object event for an undrain"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drains_subsystem_follows_the_records_into_the_cache_across_a_broken_connection() {
    let etcd = Etcd::start();
    let admin = connect(etcd.endpoint()).await;
    register(&admin, "aaaa", "node-1").await;
    register(&admin, "bbbb", "node-2").await;
    drain(&admin, "node-1").await.unwrap();

    let gate = Gate::new(etcd.addr());
    let mut options = options(&gate.endpoint());
    options.request_timeout = Duration::from_secs(1);
    options.connect_timeout = Duration::from_secs(1);
    let agent_log = EtcdLog::connect(options).await.unwrap();
    let cache = Arc::new(EndpointCache::new());
    let follower = DrainFollower::new(agent_log, cache.clone());
    let cancel = CancellationToken::new();
    follower
        .start(&StartContext::new(cancel.clone(), Mode::Production))
        .await
        .unwrap();
    // The start waited for the first listing.
    assert!(follower.ready().is_ready());
    assert_eq!(cache.drained_nodes(), BTreeSet::from(["node-1".to_owned()]));

    drain(&admin, "node-2").await.unwrap();
    until_drained(&cache, &["node-1", "node-2"], "a drain through the watch").await;

    // Cut off: the last set stays; changes meanwhile arrive once it lists again.
    gate.cut();
    undrain(&admin, "node-1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        cache.drained_nodes().len(),
        2,
        "the last set stays while cut off"
    );
    gate.restore();
    until_drained(&cache, &["node-2"], "an undrain made while cut off").await;

    undrain(&admin, "bbbb").await.unwrap();
    until_drained(&cache, &[], "the last undrain").await;
    cancel.cancel();
    follower.stop().await.unwrap();
}
