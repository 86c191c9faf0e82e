//! The `dataplane` subsystem: feeds a [`DataPlane`] from the endpoint cache.
//!
//! One loop per data plane: take the next coalesced [`Delta`](crate::endpoints::Delta)
//! from a cache subscription and apply it. Ready after the first full delta is
//! applied. A failed apply is retried with a full delta after a pause, so a transient
//! error can never leave the data plane permanently out of date.

use super::DataPlane;
use crate::{
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
        }
    }
}

async fn reconcile(
    plane: Arc<dyn DataPlane>,
    cache: Arc<EndpointCache>,
    applied: ReadySetter,
    cancel: CancellationToken,
) {
    let mut sub = cache.subscribe();
    loop {
        let delta = tokio::select! {
            () = cancel.cancelled() => return,
            d = sub.next() => d,
        };
        match plane.apply(&delta).await {
            Ok(()) => {
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
