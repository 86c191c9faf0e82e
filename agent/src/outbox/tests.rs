use std::{sync::Arc, time::Duration};

use super::*;

fn outbox(capacity: usize) -> (Outbox, Gauge, Counter) {
    let depth = Gauge::default();
    let dropped = Counter::default();
    (
        Outbox::new(capacity, depth.clone(), dropped.clone()),
        depth,
        dropped,
    )
}

#[test]
fn entries_come_out_in_push_order() {
    let (outbox, _, _) = outbox(10);
    for i in 0..5 {
        assert!(outbox.push(OutboxEntry::log("dns", format!("m{i}"))));
    }
    let first = outbox.drain_batch(2);
    let rest = outbox.drain_batch(100);
    let messages: Vec<String> = first.into_iter().chain(rest).map(|e| e.message).collect();
    assert_eq!(messages, ["m0", "m1", "m2", "m3", "m4"]);
    assert!(outbox.is_empty());
}

#[test]
fn drops_are_counted_at_capacity_and_metrics_match() {
    let (outbox, depth, dropped) = outbox(3);
    let accepted: Vec<bool> = (0..5)
        .map(|i| outbox.push(OutboxEntry::event("dataplane", format!("e{i}"))))
        .collect();
    assert_eq!(accepted, [true, true, true, false, false]);
    assert_eq!(outbox.len(), 3);
    assert_eq!(outbox.dropped(), 2);
    assert_eq!(depth.get(), 3);
    assert_eq!(dropped.get(), 2);
    // The oldest entries were kept, the newest dropped.
    let kept: Vec<String> = outbox
        .drain_batch(10)
        .into_iter()
        .map(|e| e.message)
        .collect();
    assert_eq!(kept, ["e0", "e1", "e2"]);
    assert_eq!(depth.get(), 0);
    // Room again after draining.
    assert!(outbox.push(OutboxEntry::log("dns", "again")));
    assert_eq!(depth.get(), 1);
    assert_eq!(dropped.get(), 2);
}

#[test]
fn metrics_struct_handles_follow_the_outbox() {
    let metrics = Metrics::new();
    let outbox = Outbox::from_metrics(1, &metrics);
    outbox.push(OutboxEntry::log("a", "1"));
    outbox.push(OutboxEntry::log("a", "2"));
    assert_eq!(metrics.outbox_depth.get(), 1);
    assert_eq!(metrics.outbox_dropped.get(), 1);
    let text = metrics.encode();
    assert!(text.contains("rune_outbox_depth 1"), "{text}");
    assert!(text.contains("rune_outbox_dropped_total 1"), "{text}");
}

#[test]
fn zero_capacity_drops_everything() {
    let (outbox, _, dropped) = outbox(0);
    assert!(!outbox.push(OutboxEntry::log("a", "1")));
    assert_eq!(dropped.get(), 1);
    assert!(outbox.is_empty());
}

#[tokio::test]
async fn producers_never_block_while_nobody_consumes() {
    let (outbox, _, _) = outbox(100);
    let outbox = Arc::new(outbox);
    let producers: Vec<_> = (0..4)
        .map(|p| {
            let outbox = outbox.clone();
            tokio::spawn(async move {
                for i in 0..1000 {
                    outbox.push(OutboxEntry::log(format!("p{p}"), format!("{i}")));
                }
            })
        })
        .collect();
    tokio::time::timeout(Duration::from_secs(2), futures::future::join_all(producers))
        .await
        .expect("producers blocked on a full outbox");
    assert_eq!(outbox.len(), 100);
    assert_eq!(outbox.dropped(), 3900);
}

#[tokio::test]
async fn recv_waits_for_a_push_and_keeps_order() {
    use futures::FutureExt;

    let (outbox, depth, _) = outbox(10);
    let first = outbox.recv();
    tokio::pin!(first);
    // Nothing queued yet: the consumer is waiting.
    assert!(first.as_mut().now_or_never().is_none());
    for m in ["a", "b", "c"] {
        assert!(outbox.push(OutboxEntry::log("x", m)));
    }
    let first = tokio::time::timeout(Duration::from_secs(2), first)
        .await
        .expect("waiting consumer was not woken by a push");
    assert_eq!(first.message, "a");
    assert_eq!(outbox.recv().await.message, "b");
    assert_eq!(outbox.recv().await.message, "c");
    assert_eq!(depth.get(), 0);
}

#[tokio::test]
async fn recv_batch_returns_what_is_waiting_up_to_max() {
    let (outbox, _, _) = outbox(10);
    for m in ["a", "b", "c"] {
        outbox.push(OutboxEntry::log("x", m));
    }
    let batch = outbox.recv_batch(2).await;
    assert_eq!(batch.len(), 2);
    assert_eq!(outbox.recv_batch(10).await.len(), 1);
    // Nothing waiting: recv_batch waits.
    let waited = tokio::time::timeout(Duration::from_millis(50), outbox.recv_batch(10)).await;
    assert!(waited.is_err());
}
