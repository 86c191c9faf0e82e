//! The drain records: `<prefix>drains/<node-id>`, written by the admin (`rune-agent
//! drain`), deleted by `rune-agent undrain`, read and watched by every agent.
//!
//! This file only stores and reads the records as bytes (what they hold is
//! `crate::node::drain`'s business); the object snapshot and watch skip this
//! subtree.

use super::{EtcdLog, keys::Parsed, subtree::KeyChange};
use crate::orderedlog::{LogError, Revision};
use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use futures::{StreamExt, stream::BoxStream};

/// A drain record as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainEntry {
    /// The node id (the key's last segment).
    pub id: String,
    /// The stored record (JSON).
    pub value: Vec<u8>,
    /// The revision it was written at.
    pub mod_revision: Revision,
}

/// A change to the drains' subtree, as [`EtcdLog::watch_drains`] delivers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DrainChange {
    /// A record was written.
    Put(DrainEntry),
    /// A record was deleted (an undrain), at `revision`.
    Delete {
        /// The node id.
        id: String,
        /// The revision of the deletion.
        revision: Revision,
    },
}

/// The changes under `drains/`, in order; ends with an error when the watch breaks
/// (the caller lists again and watches from there).
pub type DrainStream = BoxStream<'static, Result<DrainChange, LogError>>;

impl EtcdLog {
    /// Writes node `id`'s drain record unless one exists (one transaction): `Ok`
    /// with the revision written, or `Err` with the record already there (which is
    /// kept: a second drain does not move the first one's time).
    pub async fn create_drain(
        &self,
        id: &str,
        value: Vec<u8>,
    ) -> Result<Result<Revision, DrainEntry>, LogError> {
        let key = self.inner.layout.drain(id);
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), value, None)])
            .or_else([TxnOp::get(key.as_str(), None)]);
        let mut kv = self.inner.kv.clone();
        let response = kv.txn(txn).await.map_err(|e| self.inner.error(&e))?;
        if response.succeeded() {
            return Ok(Ok(self.inner.header_revision(response.header())?));
        }
        let existing = response.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(mut get) => get.take_kvs().into_iter().next(),
            _ => None,
        });
        match existing.and_then(|kv| self.drain_entry(kv)) {
            Some(entry) => Ok(Err(entry)),
            // Deleted between the comparison and the read: cannot happen inside one
            // transaction; said plainly should etcd ever answer so.
            None => Err(LogError::Refused {
                endpoints: self.inner.endpoints.clone(),
                message: format!("the drain record of {id} exists but could not be read"),
            }),
        }
    }

    /// Deletes node `id`'s drain record; `false` when there was none.
    pub async fn delete_drain(&self, id: &str) -> Result<bool, LogError> {
        let mut kv = self.inner.kv.clone();
        let response = kv
            .delete(self.inner.layout.drain(id), None)
            .await
            .map_err(|e| self.inner.error(&e))?;
        Ok(response.deleted() > 0)
    }

    /// Every drain record at one revision, ordered by node id.
    pub async fn list_drains(&self) -> Result<(Revision, Vec<DrainEntry>), LogError> {
        let mut entries = Vec::new();
        let revision = self
            .list_subtree(self.inner.layout.drains(), |kv| {
                if let Some(e) = self.drain_entry(kv) {
                    entries.push(e);
                }
            })
            .await?;
        Ok((revision, entries))
    }

    /// The changes to the drain records after revision `from`; ends with the error
    /// when the watch breaks (no reconnection of its own).
    pub async fn watch_drains(&self, from: Revision) -> Result<DrainStream, LogError> {
        let changes = self
            .watch_subtree(self.inner.layout.drains(), from, "drains'")
            .await?;
        let log = self.clone();
        Ok(Box::pin(changes.filter_map(move |change| {
            let change = match change {
                Err(e) => Some(Err(e)),
                Ok(KeyChange::Put(kv)) => log.drain_entry(kv).map(|e| Ok(DrainChange::Put(e))),
                Ok(KeyChange::Delete { key, revision }) => match log.inner.layout.parse(&key) {
                    Parsed::Drain(id) if valid_id(&id) => {
                        Some(Ok(DrainChange::Delete { id, revision }))
                    }
                    _ => None,
                },
            };
            std::future::ready(change)
        })))
    }

    /// A stored key-value as a drain entry; `None` for a key under `drains/` that
    /// is not `drains/<id>`.
    fn drain_entry(&self, kv: etcd_client::KeyValue) -> Option<DrainEntry> {
        let Parsed::Drain(id) = self.inner.layout.parse(kv.key()) else {
            return None;
        };
        valid_id(&id).then(|| DrainEntry {
            id,
            mod_revision: kv.mod_revision().max(0) as Revision,
            value: kv.value().to_vec(),
        })
    }
}

/// Whether `id` is one key segment.
fn valid_id(id: &str) -> bool {
    !id.is_empty() && !id.contains('/')
}
