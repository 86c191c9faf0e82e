//! The etcd ordered log's read side against a real etcd (no root needed): snapshot
//! and watch order, resuming across an etcd restart and a cut connection,
//! compaction, a store that went back in time, values another client broke.

mod etcd_common;

use etcd_common::*;
use rune_agent::{
    model::{Kind, Object},
    orderedlog::{Event, LogError, OrderedLog},
};
use rune_harness::etcd::{Etcd, Gate};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_and_watch_deliver_puts_and_deletes_in_order() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let empty = log.snapshot().await.unwrap();
    assert!(empty.objects.is_empty());

    let web = svc("web", "198.18.100.1");
    let web_eps = eps("web", &["198.18.11.2"]);
    let first = log.apply(vec![web.clone(), web_eps.clone()]).await.unwrap();
    let snap = log.snapshot().await.unwrap();
    assert_eq!(snap.revision, first.revision);
    assert_eq!(snap.objects, vec![web.clone(), web_eps.clone()]);

    let mut stream = log.watch(empty.revision).await.unwrap();
    let api = svc("api", "198.18.100.2");
    let second = log.apply(vec![api.clone()]).await.unwrap();
    let deleted = log
        .delete(&key(Kind::Endpoints, "web"))
        .await
        .unwrap()
        .expect("existed");
    let web_eps2 = eps("web", &["198.18.11.3"]);
    let third = log.apply(vec![web_eps2.clone()]).await.unwrap();
    assert!(first.revision < second.revision && second.revision < deleted);
    assert!(deleted < third.revision);

    // One apply is one transaction: its objects share its revision and arrive
    // one after the other, in the order they were given.
    let events = take(&mut stream, 5).await;
    assert_eq!(
        describe(&events),
        [
            format!("put service web@{}", first.revision),
            format!("put endpoints web@{}", first.revision),
            format!("put service api@{}", second.revision),
            format!("delete endpoints web@{deleted}"),
            format!("put endpoints web@{}", third.revision),
        ]
    );
    assert_eq!(
        events[4],
        Event::Put {
            revision: third.revision,
            object: web_eps2.clone()
        }
    );
    assert_quiet(&mut stream).await;

    // A watch from the middle gets exactly the rest.
    let mut rest = log.watch(second.revision).await.unwrap();
    assert_eq!(
        revisions(&take(&mut rest, 2).await),
        [deleted, third.revision]
    );
    assert_quiet(&mut rest).await;

    let snap = log.snapshot().await.unwrap();
    assert_eq!(snap.revision, third.revision);
    assert_eq!(snap.objects, vec![api, web, web_eps2]);
    // The VIP index lives under the same prefix and never shows as an object.
    let keys = etcd.ctl_ok(&["get", "--prefix", "--keys-only", "/rune-test/v1/"]);
    assert!(
        keys.contains("/rune-test/v1/_index/vip/198.18.100.1"),
        "{keys}"
    );
    assert_eq!(log.skipped().count, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paged_snapshot_is_read_at_one_revision_while_writers_go_on() {
    let etcd = Etcd::start();
    let mut o = options(etcd.endpoint());
    o.page_size = 3;
    let log = rune_agent::orderedlog::etcd::EtcdLog::connect(o)
        .await
        .unwrap();
    for i in 0..40 {
        log.apply(vec![eps(&format!("svc-{i:02}"), &["198.18.11.2"])])
            .await
            .unwrap();
    }
    // A writer adds and removes objects while snapshots are read in pages of 3.
    let writer = {
        let log = log.clone();
        tokio::spawn(async move {
            for i in 0..60 {
                let name = format!("new-{i:02}");
                log.apply(vec![eps(&name, &["198.18.11.3"])]).await.unwrap();
                log.delete(&key(Kind::Endpoints, &format!("svc-{:02}", i % 40)))
                    .await
                    .unwrap();
            }
        })
    };
    let mut checked = 0;
    while !writer.is_finished() || checked == 0 {
        let snap = log.snapshot().await.unwrap();
        let names: Vec<String> = snap
            .objects
            .iter()
            .map(|o| format!("/rune-test/v1/endpoints/default/{}", o.key().name))
            .collect();
        // What etcd itself holds at that revision.
        let at = etcd.ctl_ok(&[
            "get",
            "--prefix",
            "--keys-only",
            &format!("--rev={}", snap.revision),
            "/rune-test/v1/endpoints/",
        ]);
        let expected: Vec<&str> = at.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(names, expected, "snapshot at {}", snap.revision);
        checked += 1;
    }
    writer.await.unwrap();
    assert!(
        checked > 1,
        "only {checked} snapshot(s) overlapped the writer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_resumes_after_an_etcd_restart_without_losing_or_repeating_events() {
    let mut etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let start = log.snapshot().await.unwrap().revision;
    let mut stream = log.watch(start).await.unwrap();
    let mut written = Vec::new();
    for i in 0..5 {
        written.push(
            log.apply(vec![eps(&format!("a-{i}"), &["198.18.11.2"])])
                .await
                .unwrap()
                .revision,
        );
    }
    assert_eq!(revisions(&take(&mut stream, 5).await), written);

    // A crash, then a restart on the same data: the stream comes back by itself.
    etcd.kill();
    etcd.start_again();
    written.clear();
    for i in 0..5 {
        written.push(
            log.apply(vec![eps(&format!("b-{i}"), &["198.18.11.2"])])
                .await
                .unwrap()
                .revision,
        );
    }
    assert_eq!(revisions(&take(&mut stream, 5).await), written);

    // A graceful stop, writes after the restart, and the watcher resumes again.
    etcd.stop();
    etcd.start_again();
    let last = log.delete(&key(Kind::Endpoints, "a-0")).await.unwrap();
    assert_eq!(
        describe(&take(&mut stream, 1).await),
        [format!("delete endpoints a-0@{}", last.expect("existed"))]
    );
    assert_quiet(&mut stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_resumes_from_the_last_revision_received() {
    let etcd = Etcd::start();
    let gate = Gate::new(etcd.addr());
    let watcher = connect(&gate.endpoint()).await;
    let writer = connect(etcd.endpoint()).await;
    let start = watcher.snapshot().await.unwrap().revision;
    let mut stream = watcher.watch(start).await.unwrap();
    let r1 = writer
        .apply(vec![svc("web", "198.18.100.1")])
        .await
        .unwrap();
    assert_eq!(revisions(&take(&mut stream, 1).await), [r1.revision]);

    // The watcher's network is down while others write.
    gate.cut();
    let mut written = Vec::new();
    for i in 0..4 {
        written.push(
            writer
                .apply(vec![eps("web", &[&format!("198.18.11.{}", i + 2)])])
                .await
                .unwrap()
                .revision,
        );
    }
    gate.restore();
    assert_eq!(revisions(&take(&mut stream, 4).await), written);
    assert_quiet(&mut stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_while_cut_off_ends_the_watch_with_compacted_and_a_new_snapshot_resumes() {
    let etcd = Etcd::start();
    let gate = Gate::new(etcd.addr());
    let watcher = connect(&gate.endpoint()).await;
    let writer = connect(etcd.endpoint()).await;
    writer
        .apply(vec![svc("web", "198.18.100.1")])
        .await
        .unwrap();
    let snap = watcher.snapshot().await.unwrap();
    let mut stream = watcher.watch(snap.revision).await.unwrap();

    gate.cut();
    writer
        .apply(vec![
            eps("web", &["198.18.11.2"]),
            svc("api", "198.18.100.2"),
        ])
        .await
        .unwrap();
    writer.delete(&key(Kind::Service, "web")).await.unwrap();
    let compacted = etcd.revision();
    etcd.compact(compacted);
    gate.restore();

    // The history the watcher needs is gone: it must resync.
    let err = next(&mut stream).await.unwrap_err();
    assert!(err.needs_resync(), "{err}");
    match &err {
        LogError::Compacted { requested, oldest } => {
            assert_eq!(*requested, snap.revision);
            assert_eq!(*oldest, compacted);
        }
        other => panic!("expected Compacted, got {other:?}"),
    }
    assert!(futures::StreamExt::next(&mut stream).await.is_none());

    // A new snapshot has everything as it is now, and a watch goes on from it.
    let fresh = watcher.snapshot().await.unwrap();
    assert_eq!(fresh.revision, compacted);
    let names: Vec<String> = fresh.objects.iter().map(|o| o.key().to_string()).collect();
    assert_eq!(names, ["Service default/api", "Endpoints default/web"]);
    let mut stream = watcher.watch(fresh.revision).await.unwrap();
    let r = writer.delete(&key(Kind::Endpoints, "web")).await.unwrap();
    assert_eq!(
        describe(&take(&mut stream, 1).await),
        [format!("delete endpoints web@{}", r.expect("existed"))]
    );
    // Asking for compacted history at once is refused the same way.
    let err = match watcher.watch(snap.revision).await {
        Ok(mut s) => next(&mut s).await.unwrap_err(),
        Err(e) => e,
    };
    assert!(err.needs_resync(), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_went_back_in_time_ends_the_watch() {
    let mut etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    for i in 0..5 {
        log.apply(vec![eps(&format!("e-{i}"), &["198.18.11.2"])])
            .await
            .unwrap();
    }
    let snap = log.snapshot().await.unwrap();
    let mut stream = log.watch(snap.revision).await.unwrap();
    // etcd comes back empty (a new cluster, or restored from an old backup).
    etcd.kill();
    etcd.wipe();
    etcd.start_again();
    let err = next(&mut stream).await.unwrap_err();
    assert!(
        matches!(err, LogError::FutureRevision { requested, current } if requested == snap.revision && current < requested),
        "{err:?}"
    );
    let err = log.watch(snap.revision).await.err().expect("refused");
    assert!(matches!(err, LogError::FutureRevision { .. }), "{err:?}");
    assert!(log.snapshot().await.unwrap().objects.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_value_is_skipped_with_an_error_naming_the_key_and_the_rest_flows() {
    let etcd = Etcd::start();
    let log = connect(etcd.endpoint()).await;
    let web = svc("web", "198.18.100.1");
    log.apply(vec![web.clone()]).await.unwrap();
    let start = log.snapshot().await.unwrap().revision;
    let mut stream = log.watch(start).await.unwrap();

    // Another client writes garbage, a document under the wrong name, a value of a
    // kind this agent does not know, and an invalid service.
    let bad = "/rune-test/v1/service/default/bad";
    etcd.ctl_ok(&["put", bad, "{not json"]);
    let renamed = "/rune-test/v1/service/default/other";
    etcd.ctl_ok(&["put", renamed, &web.to_json().to_string()]);
    etcd.ctl_ok(&["put", "/rune-test/v1/secret/default/tls", "{}"]);
    let port0 = invalid_svc("zero").to_json().to_string();
    etcd.ctl_ok(&["put", "/rune-test/v1/service/default/zero", &port0]);
    let api = svc("api", "198.18.100.2");
    let r = log.apply(vec![api.clone()]).await.unwrap();

    // Each is a skipped event naming its key (consumers acknowledge its
    // revision), and the stream goes on with the next valid event.
    let skipped: Vec<String> = take(&mut stream, 4)
        .await
        .iter()
        .map(|e| match e {
            Event::Skipped { key, .. } => key.clone(),
            other => panic!("expected a skipped value, got {other:?}"),
        })
        .collect();
    assert_eq!(
        skipped,
        [
            bad,
            renamed,
            "/rune-test/v1/secret/default/tls",
            "/rune-test/v1/service/default/zero"
        ]
    );
    assert_eq!(
        next(&mut stream).await.unwrap(),
        Event::Put {
            revision: r.revision,
            object: api.clone()
        }
    );
    let skipped = log.skipped();
    assert_eq!(skipped.count, 4, "{skipped:?}");
    let last = skipped.last.expect("the last skipped key");
    assert_eq!(last.key, "/rune-test/v1/service/default/zero");
    assert!(last.reason.contains("spec.ports[0].port"), "{last}");
    assert!(
        last.to_string()
            .starts_with("etcd key /rune-test/v1/service/default/zero (revision "),
        "{last}"
    );

    // A snapshot skips the same keys and keeps everything else.
    let snap = log.snapshot().await.unwrap();
    assert_eq!(snap.objects, vec![api, web]);
    assert_eq!(log.skipped().count, 8);
    // Deleting the garbage passes through as a delete of that key.
    etcd.ctl_ok(&["del", bad]);
    match next(&mut stream).await.unwrap() {
        Event::Delete { key, .. } => assert_eq!(key.to_string(), "Service default/bad"),
        other => panic!("expected the delete of bad, got {other:?}"),
    }
    // The listing skips them too.
    let (_, listed) = log.get(Some(Kind::Service), None, None).await.unwrap();
    let names: Vec<String> = listed.iter().map(|o: &Object| o.key().name).collect();
    assert_eq!(names, ["api", "web"]);
}
