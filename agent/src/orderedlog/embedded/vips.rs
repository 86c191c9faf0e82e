//! The store's VIP index: VIP (or exposed host and path) → the service that owns it
//! (table `vips`; see [`claims_of`]).
//!
//! Every apply must refuse a VIP another service already uses. Reading and parsing
//! the whole store for that would make an apply cost what is stored; with the
//! index it costs one lookup per VIP of the batch. The index is written in the same transaction as the
//! objects, so it can never disagree with them after a commit.
//!
//! `meta.vipIndex` records the revision the index is current at. A store written by
//! an older agent (no index, or objects written after it by a downgraded agent) has
//! a different revision there, and [`ensure`] rebuilds the index when the store
//! opens.

use super::{key_string, parse_key_string, storage_err};
use crate::{
    model::{Object, ObjectKey, parse_stored},
    orderedlog::{
        LogError, Revision,
        store::{VipCheckError, check_claim_owners, claim_move, claims_of},
    },
};
use redb::{ReadableTable, Table, TableDefinition, WriteTransaction};
use std::{collections::HashSet, path::Path, time::Instant};

/// VIP (its canonical text, e.g. `198.18.0.1`, `fd00::1`) → owner (`Service/ns/name`).
pub(super) const VIPS: TableDefinition<&str, &str> = TableDefinition::new("vips");

/// `meta` key: the revision at which the index matches the objects.
pub(super) const META_VIP_INDEX: &str = "vipIndex";

/// Refuses a batch in which a service uses a VIP that another service owns, either
/// in the store (and that service is not rewritten by the batch) or elsewhere in the
/// batch: [`check_claim_owners`] with the owners this index names.
pub(super) fn check(
    index: &impl ReadableTable<&'static str, &'static str>,
    batch: &[Object],
    batch_keys: &HashSet<ObjectKey>,
    path: &Path,
) -> Result<(), CheckError> {
    check_claim_owners(batch, batch_keys, |vip| {
        let stored = index.get(vip).map_err(|e| storage_err(path, e))?;
        match stored {
            Some(v) => parse_key_string(v.value())
                .map(Some)
                .ok_or_else(|| LogError::Corrupt {
                    what: format!("VIP index entry {vip}"),
                    message: format!("owner {:?} is not a key", v.value()),
                }),
            None => Ok(None),
        }
    })
}

/// Why [`check`] refused a batch.
pub(super) type CheckError = VipCheckError;

/// Moves the index from `old` to `new` for the object stored under `owner` (either
/// may be absent: a create or a delete). An old VIP is removed only while the index
/// still names `owner`: another service of the same batch may have taken it already.
pub(super) fn update(
    index: &mut Table<&str, &str>,
    owner: &str,
    old: Option<&Object>,
    new: Option<&Object>,
    path: &Path,
) -> Result<(), LogError> {
    let moved = claim_move(old, new);
    for text in moved.released {
        let ours = index
            .get(text.as_str())
            .map_err(|e| storage_err(path, e))?
            .is_some_and(|v| v.value() == owner);
        if ours {
            index
                .remove(text.as_str())
                .map_err(|e| storage_err(path, e))?;
        }
    }
    for vip in moved.claimed {
        index
            .insert(vip.as_str(), owner)
            .map_err(|e| storage_err(path, e))?;
    }
    Ok(())
}

/// Removes every entry naming `owner`, by a scan of the index: for an object whose
/// stored document cannot be read, so its VIPs are unknown (rare; costs one pass
/// over the index, not over the objects).
pub(super) fn forget_owner(
    index: &mut Table<&str, &str>,
    owner: &str,
    path: &Path,
) -> Result<(), LogError> {
    index
        .retain(|_, v| v != owner)
        .map_err(|e| storage_err(path, e))
}

/// The object stored as `doc`, for [`update`]; `None` when it cannot be parsed
/// (the caller then uses [`forget_owner`]).
pub(super) fn parse_old(doc: &str) -> Option<Object> {
    parse_stored(doc).ok()
}

/// Rebuilds the index from the stored services when it does not match the store's
/// revision (a store written by an older agent). Returns whether it did.
pub(super) fn ensure(
    txn: &WriteTransaction,
    revision: Revision,
    path: &Path,
) -> Result<bool, LogError> {
    let mut meta = txn
        .open_table(super::META)
        .map_err(|e| storage_err(path, e))?;
    let at = meta
        .get(META_VIP_INDEX)
        .map_err(|e| storage_err(path, e))?
        .map(|v| v.value());
    if at == Some(revision) {
        return Ok(false);
    }
    let started = Instant::now();
    let mut index = txn.open_table(VIPS).map_err(|e| storage_err(path, e))?;
    index
        .retain(|_, _| false)
        .map_err(|e| storage_err(path, e))?;
    let objects = txn
        .open_table(super::OBJECTS)
        .map_err(|e| storage_err(path, e))?;
    let prefix = format!("{}/", crate::model::Kind::Service);
    let (mut services, mut vips, mut conflicts) = (0usize, 0usize, 0usize);
    for row in objects
        .range(prefix.as_str()..)
        .map_err(|e| storage_err(path, e))?
    {
        let (k, v) = row.map_err(|e| storage_err(path, e))?;
        let k = k.value();
        if !k.starts_with(&prefix) {
            break;
        }
        let object = parse_stored(v.value().1).map_err(|e| LogError::Corrupt {
            what: format!("object {k}"),
            message: e.to_string(),
        })?;
        services += 1;
        for vip in claims_of(&object) {
            let text = vip.index_key;
            // The first owner in key order keeps a VIP that an older agent let two
            // services share.
            if index
                .get(text.as_str())
                .map_err(|e| storage_err(path, e))?
                .is_some()
            {
                conflicts += 1;
                continue;
            }
            index
                .insert(text.as_str(), key_string(&object.key()).as_str())
                .map_err(|e| storage_err(path, e))?;
            vips += 1;
        }
    }
    meta.insert(META_VIP_INDEX, revision)
        .map_err(|e| storage_err(path, e))?;
    // A new store (revision 0) has nothing to index: no line for it.
    if revision > 0 {
        tracing::info!(
            store = %path.display(),
            services,
            vips,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "built the store's VIP index (store written by an older agent)"
        );
    }
    if conflicts > 0 {
        tracing::warn!(
            store = %path.display(),
            conflicts,
            "stored services share VIPs (written by an older agent): the first in key order owns each"
        );
    }
    Ok(true)
}
