//! The write side shared by the backends: [`ObjectStore`] (apply, delete, get), and
//! the checks every backend makes before it writes anything, so that both refuse the
//! same batches with the same messages.

use super::{LogError, OrderedLog, Revision};
use crate::model::{Kind, ModelError, Object, ObjectKey};
use async_trait::async_trait;
use std::fmt;
use std::{
    collections::{HashMap, HashSet},
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

/// Something only one service may hold: a VIP, or an exposed host and path. Stores
/// index claims by [`Claim::index_key`] (the VIP index holds both).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The key in a store's index: a VIP's text (`198.18.0.1`, `fd00::1`), or
    /// `route:HOST/PATH` (no VIP's text starts with `route:`).
    pub index_key: String,
    /// The claiming field, for errors: `spec.discovery.vips[0]`, `spec.expose`.
    field: String,
    /// The claim in words, for errors: `VIP 198.18.0.1`, `host a.example path /`.
    what: String,
}

/// How an object's index entries change when it goes from `old` to `new` (either
/// absent: a create or a delete), for both stores' indexes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ClaimMove {
    /// Index keys `old` held and `new` does not: released where the index still
    /// names the owner (another service of the same batch may have taken one).
    pub released: Vec<String>,
    /// Index keys `new` holds, to point at the owner.
    pub claimed: Vec<String>,
}

/// The [`ClaimMove`] from `old` to `new`.
pub fn claim_move(old: Option<&Object>, new: Option<&Object>) -> ClaimMove {
    let keys = |o: Option<&Object>| -> Vec<String> {
        o.map(claims_of)
            .unwrap_or_default()
            .into_iter()
            .map(|c| c.index_key)
            .collect()
    };
    let claimed = keys(new);
    let released = keys(old)
        .into_iter()
        .filter(|k| !claimed.contains(k))
        .collect();
    ClaimMove { released, claimed }
}

/// What an object claims (nothing for anything but a service).
pub fn claims_of(object: &Object) -> Vec<Claim> {
    let Object::Service(s) = object else {
        return Vec::new();
    };
    let mut claims: Vec<Claim> = s
        .spec
        .discovery
        .vips
        .iter()
        .enumerate()
        .map(|(i, vip)| Claim {
            index_key: vip.to_string(),
            field: format!("spec.discovery.vips[{i}]"),
            what: format!("VIP {vip}"),
        })
        .collect();
    if let Some(e) = &s.spec.expose {
        claims.push(Claim {
            index_key: format!("route:{}{}", e.host, e.path()),
            field: "spec.expose".to_owned(),
            what: format!("host {} path {}", e.host, e.path()),
        });
    }
    claims
}

/// Why [`check_claim_owners`] refused a batch.
#[derive(Debug)]
pub enum VipCheckError {
    /// A conflict, reported on the batch's service.
    Invalid(ModelError),
    /// The stored owners could not be read.
    Log(LogError),
}

/// Refuses a batch in which a service claims a VIP (or an exposed host and path)
/// that another service owns, either in the store (`stored_owner`: the service the
/// backend's index names for a claim's index key, if any; a stored owner the batch
/// rewrites is judged by its new claims) or elsewhere in the batch. Services of the
/// batch are taken in key order, and a conflict names the batch's service and the
/// claim's other owner: every backend reports the same error on the same object.
pub fn check_claim_owners(
    batch: &[Object],
    batch_keys: &HashSet<ObjectKey>,
    mut stored_owner: impl FnMut(&str) -> Result<Option<ObjectKey>, LogError>,
) -> Result<(), VipCheckError> {
    let mut services: Vec<(ObjectKey, Vec<Claim>)> = batch
        .iter()
        .map(|o| (o.key(), claims_of(o)))
        .filter(|(_, c)| !c.is_empty())
        .collect();
    services.sort_by(|a, b| a.0.cmp(&b.0));
    let mut owner: HashMap<&str, &ObjectKey> = HashMap::new();
    for (key, claims) in &services {
        for claim in claims {
            let stored = stored_owner(&claim.index_key).map_err(VipCheckError::Log)?;
            let prev = match stored {
                Some(o) if o != *key && !batch_keys.contains(&o) => Some(o),
                _ => owner
                    .insert(&claim.index_key, key)
                    .filter(|p| *p != key)
                    .map(|p| (*p).clone()),
            };
            if let Some(prev) = prev {
                return Err(VipCheckError::Invalid(ModelError::invalid(
                    key.to_string(),
                    claim.field.clone(),
                    format!("{} is already used by {prev}", claim.what),
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
