use std::time::Duration;

use super::*;

const PATIENCE: Duration = Duration::from_secs(2);

#[tokio::test]
async fn readiness_is_a_level_observers_can_wait_on() {
    let (setter, readiness) = Readiness::new();
    assert!(!readiness.is_ready());
    let waiting = tokio::time::timeout(Duration::from_millis(20), readiness.wait()).await;
    assert!(waiting.is_err(), "wait resolved before ready");
    let waiter = tokio::spawn({
        let readiness = readiness.clone();
        async move { readiness.wait().await }
    });
    setter.set_ready();
    tokio::time::timeout(PATIENCE, waiter)
        .await
        .expect("waiter not woken")
        .unwrap();
    assert!(setter.readiness().is_ready());
    setter.set_not_ready();
    assert!(!readiness.is_ready());
    assert!(Readiness::ready().is_ready());
}
