use super::{fake::FakeOps, *};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[tokio::test]
async fn an_address_stays_while_any_holder_remains() {
    let fake = FakeOps::default();
    let vips = VipAddrs::new(Box::new(fake.clone()));
    let (a, b) = (ip("198.18.100.10"), ip("fd00:100::10"));
    vips.acquire("web/80/TCP", &[a, b]).await;
    vips.acquire("web/53/UDP", &[a]).await;
    assert_eq!(vips.holders(a).await, 2);
    assert_eq!(fake.on_interface(), BTreeMap::from([(a, true), (b, true)]));

    vips.retain(|h, _| h != "web/80/TCP").await;
    assert_eq!(vips.holders(a).await, 1);
    assert_eq!(fake.on_interface(), BTreeMap::from([(a, true)]));

    vips.retain(|_, _| false).await;
    assert!(fake.on_interface().is_empty());
}

#[tokio::test]
async fn acquiring_twice_counts_once() {
    let fake = FakeOps::default();
    let vips = VipAddrs::new(Box::new(fake.clone()));
    let a = ip("198.18.100.10");
    vips.acquire("web/80/TCP", &[a]).await;
    vips.acquire("web/80/TCP", &[a]).await;
    assert_eq!(vips.holders(a).await, 1);
    vips.retain(|h, _| h != "web/80/TCP").await;
    assert!(fake.on_interface().is_empty());
}

#[tokio::test]
async fn addresses_of_a_crashed_agent_are_adopted_or_removed() {
    let fake = FakeOps::default();
    let (kept, stale) = (ip("198.18.100.10"), ip("198.18.100.11"));
    fake.addrs
        .lock()
        .unwrap()
        .extend([(kept, true), (stale, true)]);
    let vips = VipAddrs::new(Box::new(fake.clone()));
    vips.acquire("web/80/TCP", &[kept]).await;
    // Adopted, not reported as somebody else's.
    assert!(vips.present().await.contains(&(kept, true)));
    vips.retain(|_, _| true).await;
    assert_eq!(fake.on_interface(), BTreeMap::from([(kept, true)]));
    vips.release_all().await;
    assert!(fake.on_interface().is_empty());
}

#[tokio::test]
async fn an_address_somebody_else_configured_is_used_and_never_removed() {
    let fake = FakeOps::default();
    let theirs = ip("198.18.100.10");
    fake.addrs.lock().unwrap().insert(theirs, false);
    let vips = VipAddrs::new(Box::new(fake.clone()));
    vips.acquire("web/80/TCP", &[theirs]).await;
    assert_eq!(vips.present().await, vec![(theirs, false)]);
    assert_eq!(vips.failure(theirs), None);
    vips.release_all().await;
    assert_eq!(fake.on_interface(), BTreeMap::from([(theirs, false)]));
}

#[tokio::test]
async fn a_failed_add_is_reported_and_retried() {
    let fake = FakeOps::default();
    *fake.fail_adds.lock().unwrap() = true;
    let vips = VipAddrs::new(Box::new(fake.clone()));
    let a = ip("198.18.100.10");
    vips.acquire("web/80/TCP", &[a]).await;
    let why = vips.failure(a).unwrap();
    assert!(why.contains("Operation not permitted"), "{why}");
    assert!(fake.on_interface().is_empty());

    *fake.fail_adds.lock().unwrap() = false;
    vips.retry().await;
    assert_eq!(vips.failure(a), None);
    assert_eq!(fake.on_interface(), BTreeMap::from([(a, true)]));

    // A failure for an address nobody holds any more is forgotten.
    *fake.fail_adds.lock().unwrap() = true;
    let b = ip("198.18.100.11");
    vips.acquire("db/5432/TCP", &[b]).await;
    vips.retain(|h, _| h != "db/5432/TCP").await;
    assert_eq!(vips.failure(b), None);
}
