//! The `dataplane` subsystem: feeds a [`DataPlane`] from the endpoint cache.
//!
//! One loop per data plane: take the next coalesced [`Delta`](crate::endpoints::Delta)
//! from a cache subscription and apply it. Ready after the first full delta is
//! applied. A failed apply is retried with a full delta after a pause, so a transient
//! error can never leave the data plane permanently out of date. With an [`Acker`]
//! ([`Reconciler::with_applied`]) it acknowledges each delta's revision once the
//! data plane took it in (a delta that only moves the revision at once).

use super::DataPlane;
use crate::{
    applied::Acker,
    endpoints::EndpointCache,
    subsystem::{Readiness, ReadySetter, StartContext, Subsystem, SubsystemError},
};
use std::{sync::Arc, time::Duration};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// Pause before retrying a failed apply.
const RETRY: Duration = Duration::from_secs(1);

/// The subsystem running one data plane.
pub struct Reconciler {
    plane: Arc<dyn DataPlane>,
    cache: Arc<EndpointCache>,
    applied: ReadySetter,
    readiness: Readiness,
    tasks: TaskTracker,
    acker: Option<Acker>,
}

impl Reconciler {
    /// Runs `plane` from `cache`.
    pub fn new(plane: Arc<dyn DataPlane>, cache: Arc<EndpointCache>) -> Self {
        let (applied, readiness) = Readiness::new();
        Self {
            plane,
            cache,
            applied,
            readiness,
            tasks: TaskTracker::new(),
            acker: None,
        }
    }

    /// Acknowledges every revision the data plane took in to `acker` (the node's
    /// applied revision).
    #[must_use]
    pub fn with_applied(mut self, acker: Acker) -> Self {
        self.acker = Some(acker);
        self
    }
}

async fn reconcile(
    plane: Arc<dyn DataPlane>,
    cache: Arc<EndpointCache>,
    applied: ReadySetter,
    acker: Option<Acker>,
    cancel: CancellationToken,
) {
    let mut sub = cache.subscribe();
    loop {
        let delta = tokio::select! {
            () = cancel.cancelled() => return,
            d = sub.next() => d,
        };
        if delta.only_revision() {
            // Nothing for the data plane: what it holds is right at this revision.
            if let Some(a) = &acker {
                a.ack(delta.revision);
            }
            continue;
        }
        match plane.apply(&delta).await {
            Ok(()) => {
                if let Some(a) = &acker {
                    a.ack(delta.revision);
                }
                tracing::debug!(
                    revision = delta.revision,
                    upserted = delta.upserted.len(),
                    removed = delta.removed.len(),
                    "data plane updated"
                );
                if delta.full {
                    applied.set_ready();
                    drop(delta);
                    crate::heap::trim();
                    if let Some((live, free)) = crate::heap::usage() {
                        tracing::debug!(live, free, "heap after the full sync (bytes)");
                    }
                }
            }
            Err(e) => {
                tracing::error!(mode = plane.mode(), error = %e, "data plane update failed; retrying with a full resync");
                sub.request_full();
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(RETRY) => {}
                }
            }
        }
    }
}

#[async_trait::async_trait]
impl Subsystem for Reconciler {
    fn name(&self) -> &str {
        "dataplane"
    }

    async fn start(&self, ctx: &StartContext) -> Result<(), SubsystemError> {
        self.tasks.spawn(reconcile(
            self.plane.clone(),
            self.cache.clone(),
            self.applied.clone(),
            self.acker.clone(),
            ctx.cancel.clone(),
        ));
        Ok(())
    }

    fn ready(&self) -> Readiness {
        self.readiness.clone()
    }

    async fn stop(&self) -> Result<(), SubsystemError> {
        self.tasks.close();
        self.tasks.wait().await;
        self.plane.shutdown().await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        applied::AppliedRevision,
        dataplane::{DataPlaneError, ServicePortStatus},
        endpoints::Delta,
        lock::lock,
        model::{Object, parse_documents},
        orderedlog::{Event, Snapshot},
    };
    use std::sync::Mutex;

    /// A data plane that records the revisions it was given and fails while told to.
    #[derive(Default)]
    struct Recorder {
        applied: Mutex<Vec<u64>>,
        fail: Mutex<bool>,
    }

    #[async_trait::async_trait]
    impl DataPlane for Recorder {
        fn mode(&self) -> &'static str {
            "test"
        }
        async fn apply(&self, delta: &Delta) -> Result<(), DataPlaneError> {
            if *lock(&self.fail) {
                return Err(DataPlaneError::Apply {
                    mode: "test",
                    reason: "told to fail".into(),
                });
            }
            lock(&self.applied).push(delta.revision);
            Ok(())
        }
        fn status(&self) -> Vec<ServicePortStatus> {
            Vec::new()
        }
        async fn shutdown(&self) {}
    }

    fn service(name: &str) -> Object {
        let text = format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: 80}}]}}\n"
        );
        parse_documents(&text).unwrap().remove(0)
    }

    async fn applied_reaches(rx: &mut tokio::sync::watch::Receiver<u64>, revision: u64) {
        tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|r| *r == revision))
            .await
            .unwrap_or_else(|_| panic!("revision {revision} not acknowledged"))
            .unwrap();
    }

    #[tokio::test]
    async fn revisions_are_acknowledged_once_the_data_plane_has_them() {
        let cache = Arc::new(EndpointCache::new());
        cache.apply_snapshot(&Snapshot {
            revision: 4,
            objects: vec![service("web")],
        });
        let plane = Arc::new(Recorder::default());
        let applied = AppliedRevision::new();
        let mut rx = applied.subscribe();
        let reconciler = Reconciler::new(plane.clone(), cache.clone())
            .with_applied(applied.consumer("dataplane"));
        let cancel = CancellationToken::new();
        reconciler
            .start(&StartContext::new(cancel.clone(), crate::config::Mode::Dev))
            .await
            .unwrap();
        applied_reaches(&mut rx, 4).await;

        // A revision that changes nothing for the data plane is acknowledged
        // without an apply.
        cache.apply_snapshot(&Snapshot {
            revision: 6,
            objects: vec![service("web")],
        });
        applied_reaches(&mut rx, 6).await;
        assert_eq!(*lock(&plane.applied), vec![4]);

        // A failed apply is not acknowledged; its retry is.
        *lock(&plane.fail) = true;
        cache.apply_event(&Event::Put {
            revision: 7,
            object: service("db"),
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(applied.get(), 6, "a failed apply is not in the kernel");
        *lock(&plane.fail) = false;
        applied_reaches(&mut rx, 7).await;
        assert_eq!(*lock(&plane.applied), vec![4, 7]);

        cancel.cancel();
        reconciler.stop().await.unwrap();
    }
}
