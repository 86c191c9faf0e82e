//! The cap on client connections (`--ingress-max-connections`), shared by both
//! listeners. At the cap, the accept loops stop accepting (new clients wait in the
//! kernel's backlog) and ask connections that sit idle after a request (keep-alive)
//! to close gracefully, so busy connections keep going and waiting clients get the
//! room idle ones held.

use std::{sync::Arc, time::Duration};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, futures::Notified};

/// How often a full proxy asks idle connections again while it waits for room.
const ASK_AGAIN: Duration = Duration::from_millis(100);

/// Room for connections, and the signal to idle ones at the cap.
#[derive(Debug)]
pub struct ConnCap {
    permits: Arc<Semaphore>,
    pressure: Notify,
}

impl ConnCap {
    /// Room for `max` connections (at least 1).
    pub fn new(max: usize) -> ConnCap {
        ConnCap {
            permits: Arc::new(Semaphore::new(max.max(1))),
            pressure: Notify::new(),
        }
    }

    /// A place for one more connection, held until the permit is dropped; at the
    /// cap, waits, asking idle connections to close meanwhile.
    pub async fn room(&self) -> OwnedSemaphorePermit {
        loop {
            if let Ok(permit) = self.permits.clone().try_acquire_owned() {
                return permit;
            }
            self.pressure.notify_waiters();
            let wait = tokio::time::timeout(ASK_AGAIN, self.permits.clone().acquire_owned());
            if let Ok(Ok(permit)) = wait.await {
                return permit;
            }
        }
    }

    /// Completes when the proxy is at the cap and asks idle connections to close.
    pub fn pressure(&self) -> Notified<'_> {
        self.pressure.notified()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn at_the_cap_idle_connections_are_asked_to_make_room() {
        let cap = Arc::new(ConnCap::new(1));
        let first = cap.room().await;
        // The holder of the one place closes when asked.
        let asked = {
            let cap = cap.clone();
            tokio::spawn(async move {
                cap.pressure().await;
                drop(first);
            })
        };
        tokio::task::yield_now().await;
        let second = tokio::time::timeout(Duration::from_secs(5), cap.room()).await;
        assert!(second.is_ok(), "no room was made");
        asked.await.unwrap();
        assert_eq!(cap.permits.available_permits(), 0);
    }
}
