//! The write side shared by the backends: [`ObjectStore`] (apply, delete, get), and
//! the checks every backend makes before it writes anything, so that both refuse the
//! same batches with the same messages.

use super::{LogError, OrderedLog, Revision};
use crate::model::{Kind, ModelError, Object, ObjectKey};
use async_trait::async_trait;
use std::fmt;
use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    ops::ControlFlow,
};
use thiserror::Error;

/// What [`ObjectStore::scan`] hands each object to: called on the blocking pool, so
/// it may block (e.g. send into a bounded channel); breaking stops the scan.
pub type ScanFn = Box<dyn FnMut(Revision, Object) -> ControlFlow<()> + Send>;

/// What the CLI and the local API write and read through, whichever backend holds
/// the objects: an [`OrderedLog`] that can also be written.
#[async_trait]
pub trait ObjectStore: OrderedLog {
    /// Stores `objects` all or nothing, after checking each on its own, against the
    /// rest of the batch and against the stored VIP owners.
    async fn apply(&self, objects: Vec<Object>) -> Result<ApplyOutcome, ApplyError>;

    /// Deletes one object; `None` when there was no such object.
    async fn delete(&self, key: &ObjectKey) -> Result<Option<Revision>, LogError>;

    /// The objects matching the filters (each `None` matches all), ordered by key,
    /// with the revision they were read at.
    async fn get(
        &self,
        kind: Option<Kind>,
        namespace: Option<&str>,
        name: Option<&str>,
    ) -> Result<(Revision, Vec<Object>), LogError>;

    /// The store's current revision (what a delete of a missing object answers).
    async fn current_revision(&self) -> Result<Revision, LogError>;

    /// The objects matching the filters, in key order, handed to `each` on the
    /// blocking pool until it breaks; returns the revision they were read at. By
    /// default one [`ObjectStore::get`] and then each object; a store that can read
    /// one object at a time streams instead (the embedded store: a large store never
    /// sits in memory whole).
    async fn scan(
        &self,
        kind: Option<Kind>,
        namespace: Option<String>,
        name: Option<String>,
        mut each: ScanFn,
    ) -> Result<Revision, LogError> {
        let (revision, objects) = self
            .get(kind, namespace.as_deref(), name.as_deref())
            .await?;
        tokio::task::spawn_blocking(move || {
            for o in objects {
                if each(revision, o).is_break() {
                    break;
                }
            }
        })
        .await
        .map_err(task_failed)?;
        Ok(revision)
    }
}

/// What `apply` did to one object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// The object did not exist; it got a new revision.
    Created,
    /// The object existed and differed; it got a new revision.
    Configured,
    /// The object was equal to the stored one: no event, no revision.
    Unchanged,
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Change::Created => "created",
            Change::Configured => "configured",
            Change::Unchanged => "unchanged",
        })
    }
}

/// The result of a successful [`ObjectStore::apply`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// The store's revision after the apply: the last change's revision, or the
    /// current one when nothing changed.
    pub revision: Revision,
    /// One entry per applied object, in the order given.
    pub results: Vec<(ObjectKey, Change)>,
}

/// Why an apply stored nothing.
#[derive(Debug, Error)]
pub enum ApplyError {
    /// An object is invalid on its own, conflicts with another (e.g. a VIP used by two
    /// services), or appears twice in the batch.
    #[error(transparent)]
    Invalid(#[from] ModelError),
    /// The store failed.
    #[error(transparent)]
    Log(#[from] LogError),
}

/// Checks every object of a batch on its own and refuses a batch that names one
/// object twice. Returns the batch's keys. The first check of every backend's apply.
pub fn check_batch(objects: &[Object]) -> Result<HashSet<ObjectKey>, ModelError> {
    let mut keys = HashSet::with_capacity(objects.len());
    for o in objects {
        o.validate()?;
        let key = o.key();
        if !keys.insert(key.clone()) {
            return Err(ModelError::invalid(
                key.to_string(),
                "metadata.name",
                "the same object appears twice in one apply",
            ));
        }
    }
    Ok(keys)
}

/// The VIPs of an object (none for anything but a service).
pub fn vips_of(object: &Object) -> &[IpAddr] {
    match object {
        Object::Service(s) => &s.spec.discovery.vips,
        Object::Endpoints(_) => &[],
    }
}

/// Why [`check_vip_owners`] refused a batch.
#[derive(Debug)]
pub enum VipCheckError {
    /// A VIP conflict, reported on the batch's service.
    Invalid(ModelError),
    /// The stored owners could not be read.
    Log(LogError),
}

/// Refuses a batch in which a service uses a VIP that another service owns, either
/// in the store (`stored_owner`: the service the backend's VIP index names, if any;
/// a stored owner the batch rewrites is judged by its new VIPs) or elsewhere in the
/// batch. Services of the batch are taken in key order, and a conflict names the
/// batch's service and the VIP's other owner: every backend reports the same error
/// on the same object.
pub fn check_vip_owners(
    batch: &[Object],
    batch_keys: &HashSet<ObjectKey>,
    mut stored_owner: impl FnMut(&IpAddr) -> Result<Option<ObjectKey>, LogError>,
) -> Result<(), VipCheckError> {
    let mut services: Vec<(ObjectKey, &Object)> = batch
        .iter()
        .filter(|o| !vips_of(o).is_empty())
        .map(|o| (o.key(), o))
        .collect();
    services.sort_by(|a, b| a.0.cmp(&b.0));
    let mut owner: HashMap<IpAddr, &ObjectKey> = HashMap::new();
    for (key, object) in &services {
        for (i, vip) in vips_of(object).iter().enumerate() {
            let stored = stored_owner(vip).map_err(VipCheckError::Log)?;
            let prev = match stored {
                Some(o) if o != *key && !batch_keys.contains(&o) => Some(o),
                _ => owner
                    .insert(*vip, key)
                    .filter(|p| *p != key)
                    .map(|p| (*p).clone()),
            };
            if let Some(prev) = prev {
                return Err(VipCheckError::Invalid(ModelError::invalid(
                    key.to_string(),
                    format!("spec.discovery.vips[{i}]"),
                    format!("VIP {vip} is already used by {prev}"),
                )));
            }
        }
    }
    Ok(())
}

/// A blocking store task that panicked or was cancelled, as an error to report.
pub(super) fn task_failed(e: tokio::task::JoinError) -> LogError {
    if e.is_panic() {
        LogError::Storage {
            path: "store task".into(),
            message: format!("panicked: {e}"),
        }
    } else {
        LogError::Closed
    }
}

#[cfg(test)]
mod tests;
