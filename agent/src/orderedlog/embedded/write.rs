//! Writing the embedded log: an apply or a delete is one redb transaction that
//! changes the objects, the VIP index and the log together.

use super::{
    EmbeddedLog, LOG, META, META_REVISION, OBJECTS, StoredEvent, StoredKey, key_string, put_event,
    read_meta, vips,
};
use crate::{
    model::{Kind, Object, ObjectKey},
    orderedlog::{
        LogError, Revision,
        store::{ApplyError, ApplyOutcome, Change},
    },
};
use redb::ReadableTable;
use std::time::Instant;

impl EmbeddedLog {
    /// Stores `objects` all or nothing, in one transaction. Each object is checked on
    /// its own and against the rest of the batch and the store's VIP index (a VIP
    /// another service owns is refused); an object equal to the stored one is
    /// [`Change::Unchanged`]; every other one gets its own, strictly increasing
    /// revision and a `Put` event.
    ///
    /// Costs what the batch writes: one lookup per object and per VIP, whatever the
    /// store holds. Events that the history limit would compact in this same
    /// transaction are not written to the log at all.
    pub fn apply(&self, objects: Vec<Object>) -> Result<ApplyOutcome, ApplyError> {
        let started = Instant::now();
        let count = objects.len();
        let keys = crate::orderedlog::store::check_batch(&objects)?;
        let inner = &self.inner;
        let txn = inner.begin_write()?;
        let (start, revision, results) = {
            let mut table = txn.open_table(OBJECTS).map_err(|e| inner.storage(e))?;
            let mut index = txn.open_table(vips::VIPS).map_err(|e| inner.storage(e))?;
            vips::check(&index, &objects, &keys, &inner.path).map_err(|e| match e {
                vips::CheckError::Invalid(e) => ApplyError::Invalid(e),
                vips::CheckError::Log(e) => ApplyError::Log(e),
            })?;
            // The Services of the batch's Endpoints: from the batch, else stored
            // (looked up in the batch's key set: a scan of the batch per Endpoints
            // would make a large apply quadratic).
            let mut services = Vec::new();
            for o in objects.iter().filter(|o| o.kind() == Kind::Endpoints) {
                let key = ObjectKey::new(Kind::Service, &o.key().namespace, &o.key().name);
                if keys.contains(&key) {
                    continue;
                }
                let stored = table
                    .get(key_string(&key).as_str())
                    .map_err(|e| inner.storage(e))?
                    .and_then(|v| vips::parse_old(v.value().1));
                services.extend(stored);
            }
            drop(keys);
            crate::model::check_endpoint_ports(objects.iter().chain(&services), &objects)?;
            let mut meta = txn.open_table(META).map_err(|e| inner.storage(e))?;
            let start = read_meta(&meta, META_REVISION, &inner.path)?;
            let mut revision = start;
            let mut results = Vec::with_capacity(count);
            // (revision, document) of each change, for the log.
            let mut events: Vec<(Revision, String)> = Vec::new();
            for object in objects {
                let key = object.key();
                let owner = key_string(&key);
                let doc = object.to_json().to_string();
                let old_doc = table
                    .get(owner.as_str())
                    .map_err(|e| inner.storage(e))?
                    .map(|v| v.value().1.to_owned());
                // Equal text is an equal object; other text may still parse equal
                // (a document an older agent wrote differently).
                let old = old_doc
                    .as_deref()
                    .filter(|d| *d != doc)
                    .map(|d| (d, vips::parse_old(d)));
                let change = match (&old_doc, &old) {
                    (None, _) => Change::Created,
                    (Some(_), None) => Change::Unchanged,
                    (Some(_), Some((_, Some(o)))) if *o == object => Change::Unchanged,
                    (Some(_), Some(_)) => Change::Configured,
                };
                if change != Change::Unchanged {
                    revision += 1;
                    table
                        .insert(owner.as_str(), (revision, doc.as_str()))
                        .map_err(|e| inner.storage(e))?;
                    match &old {
                        Some((_, None)) => {
                            vips::forget_owner(&mut index, &owner, &inner.path)?;
                            vips::update(&mut index, &owner, None, Some(&object), &inner.path)?;
                        }
                        Some((_, Some(o))) => {
                            vips::update(&mut index, &owner, Some(o), Some(&object), &inner.path)?
                        }
                        None => vips::update(&mut index, &owner, None, Some(&object), &inner.path)?,
                    }
                    events.push((revision, doc));
                }
                results.push((key, change));
            }
            if revision != start {
                let mut log = txn.open_table(LOG).map_err(|e| inner.storage(e))?;
                // Only the events the history keeps: older ones would be compacted by
                // finish_write in this same transaction, unseen by any watcher.
                let cut = revision.saturating_sub(inner.history);
                for (rev, doc) in events.iter().filter(|(rev, _)| *rev > cut) {
                    log.insert(*rev, put_event(doc).as_str())
                        .map_err(|e| inner.storage(e))?;
                }
                inner.finish_write(&mut meta, &mut log, revision)?;
            }
            (start, revision, results)
        };
        if revision == start {
            txn.abort().map_err(|e| inner.storage(e))?;
        } else {
            inner.commit(txn, revision)?;
        }
        tracing::debug!(
            objects = count,
            changed = revision - start,
            revision,
            elapsed_us = started.elapsed().as_micros() as u64,
            "store apply"
        );
        Ok(ApplyOutcome { revision, results })
    }

    /// Deletes one object, leaving a `Delete` event. Returns its revision, or `None`
    /// when there was no such object (not an error: the caller can tell).
    pub fn delete(&self, key: &ObjectKey) -> Result<Option<Revision>, LogError> {
        let inner = &self.inner;
        let txn = inner.begin_write()?;
        let revision = {
            let mut table = txn.open_table(OBJECTS).map_err(|e| inner.storage(e))?;
            let owner = key_string(key);
            let removed = table
                .remove(owner.as_str())
                .map_err(|e| inner.storage(e))?
                .map(|v| v.value().1.to_owned());
            if let Some(doc) = removed {
                let mut index = txn.open_table(vips::VIPS).map_err(|e| inner.storage(e))?;
                if key.kind == Kind::Service {
                    match vips::parse_old(&doc) {
                        Some(old) => {
                            vips::update(&mut index, &owner, Some(&old), None, &inner.path)?
                        }
                        None => vips::forget_owner(&mut index, &owner, &inner.path)?,
                    }
                }
                let mut log = txn.open_table(LOG).map_err(|e| inner.storage(e))?;
                let mut meta = txn.open_table(META).map_err(|e| inner.storage(e))?;
                let revision = read_meta(&meta, META_REVISION, &inner.path)? + 1;
                let event = StoredEvent::Delete {
                    key: StoredKey {
                        kind: key.kind,
                        namespace: key.namespace.clone(),
                        name: key.name.clone(),
                    },
                };
                inner.append(&mut log, revision, &event)?;
                inner.finish_write(&mut meta, &mut log, revision)?;
                Some(revision)
            } else {
                None
            }
        };
        match revision {
            Some(r) => inner.commit(txn, r)?,
            None => txn.abort().map_err(|e| inner.storage(e))?,
        }
        Ok(revision)
    }
}
