//! An attempt's reads: every key it depends on, at one revision.

use super::Attempt;
use crate::{
    model::{Kind, Object, ObjectKey, parse_stored},
    orderedlog::{
        Revision,
        etcd::{Shared, error, keys::range_end},
        store::claims_of,
    },
};
use etcd_client::{GetOptions, Txn, TxnOp, TxnOpResponse};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// A key's value and mod revision, as read.
#[derive(Clone, Debug)]
pub(super) struct Stored {
    pub(super) mod_revision: i64,
    pub(super) value: Vec<u8>,
}

/// Every key an attempt depends on, read at one revision.
pub(super) struct Read {
    pub(super) revision: Revision,
    /// Object keys read that exist.
    pub(super) objects: HashMap<String, Stored>,
    /// VIP index keys read that exist.
    pub(super) index: HashMap<String, Stored>,
    /// The Services of the batch's Endpoints that are not in the batch, by key,
    /// as stored (`None`: absent), for the check of their ports.
    pub(super) services: BTreeMap<String, Option<Stored>>,
}

impl Shared {
    /// The first of `guarded` whose mod revision is no longer the one expected (or
    /// the first at all): which key the writers fought over.
    pub(super) async fn changed_key(&self, guarded: &[(String, i64)]) -> String {
        let Some(first) = guarded.first().map(|(k, _)| k.clone()) else {
            // The last attempt's read was cut short by a compaction.
            return format!("what it read under {}", self.layout.prefix());
        };
        let keys: Vec<String> = guarded.iter().map(|(k, _)| k.clone()).collect();
        let Ok((_, now)) = self.read_keys(&keys, None).await else {
            return first;
        };
        guarded
            .iter()
            .find(|(k, seen)| now.get(k).map_or(0, |s| s.mod_revision) != *seen)
            .map_or(first, |(k, _)| k.clone())
    }

    /// Reads `keys` at `at` (or at the revision of the first request), in
    /// read-only transactions of at most `max_txn_ops` gets. Returns the revision
    /// and the keys that exist.
    pub(super) async fn read_keys(
        &self,
        keys: &[String],
        at: Option<Revision>,
    ) -> Result<(Revision, HashMap<String, Stored>), Attempt> {
        let mut kv = self.kv.clone();
        let mut at = at;
        let mut found = HashMap::new();
        let chunks: Vec<&[String]> = if keys.is_empty() {
            vec![&[]]
        } else {
            keys.chunks(self.options.max_txn_ops).collect()
        };
        for chunk in chunks {
            let gets: Vec<TxnOp> = chunk
                .iter()
                .map(|k| {
                    let options = at.map(|r| GetOptions::new().with_revision(r as i64));
                    TxnOp::get(k.as_str(), options)
                })
                .collect();
            let response = match kv.txn(Txn::new().and_then(gets)).await {
                Ok(r) => r,
                // The revision read at was compacted meanwhile: read everything again.
                Err(e) if error::is_compacted(&e) => return Err(Attempt::Conflict(Vec::new())),
                Err(e) => return Err(self.error(&e).into()),
            };
            if at.is_none() {
                at = Some(self.header_revision(response.header())?);
            }
            for op in response.op_responses() {
                if let TxnOpResponse::Get(mut get) = op {
                    for kv in get.take_kvs() {
                        let mod_revision = kv.mod_revision();
                        let (key, value) = kv.into_key_value();
                        if let Ok(key) = String::from_utf8(key) {
                            found.insert(
                                key,
                                Stored {
                                    mod_revision,
                                    value,
                                },
                            );
                        }
                    }
                }
            }
        }
        Ok((at.unwrap_or_default(), found))
    }

    /// Reads the batch's objects, then their VIPs' index entries, at one revision.
    pub(super) async fn read_for(&self, objects: &[Object]) -> Result<Read, Attempt> {
        let keys: Vec<String> = objects
            .iter()
            .map(|o| self.layout.object(&o.key()))
            .collect();
        let (revision, stored) = self.read_keys(&keys, None).await?;
        let pairs: Vec<(ObjectKey, &Object)> = objects.iter().map(|o| (o.key(), o)).collect();
        self.complete_read(revision, stored, pairs.iter().map(|(k, o)| (k, Some(*o))))
            .await
    }

    /// Adds to what was read of the objects at `revision` what checking them
    /// needs, at the same revision: the index entries of the VIPs of their new
    /// versions (`Some`) and of their stored ones (services only), and the
    /// Services of new Endpoints whose Service is not among them. When a stored
    /// service cannot be parsed (its VIPs unknown), the whole index is read (rare:
    /// a value another client broke).
    pub(super) async fn complete_read<'a>(
        &self,
        revision: Revision,
        objects: HashMap<String, Stored>,
        wanted: impl IntoIterator<Item = (&'a ObjectKey, Option<&'a Object>)>,
    ) -> Result<Read, Attempt> {
        let wanted: Vec<(&ObjectKey, Option<&Object>)> = wanted.into_iter().collect();
        let wanted_keys: HashSet<&ObjectKey> = wanted.iter().map(|(k, _)| *k).collect();
        let mut keys = BTreeSet::new();
        let mut services = BTreeMap::new();
        let mut whole_index = false;
        for (key, new) in &wanted {
            if let Some(new) = new {
                keys.extend(
                    claims_of(new)
                        .iter()
                        .map(|c| self.layout.claim(&c.index_key)),
                );
                if key.kind == Kind::Endpoints {
                    let service = ObjectKey::new(Kind::Service, &key.namespace, &key.name);
                    if !wanted_keys.contains(&service) {
                        let etcd_key = self.layout.object(&service);
                        keys.insert(etcd_key.clone());
                        services.insert(etcd_key, None);
                    }
                }
            }
            if key.kind != Kind::Service {
                continue;
            }
            if let Some(stored) = objects.get(&self.layout.object(key)) {
                match old_object(&stored.value) {
                    Some(old) => keys.extend(
                        claims_of(&old)
                            .iter()
                            .map(|c| self.layout.claim(&c.index_key)),
                    ),
                    None => whole_index = true,
                }
            }
        }
        let mut found = if keys.is_empty() {
            HashMap::new()
        } else {
            let keys: Vec<String> = keys.into_iter().collect();
            self.read_keys(&keys, Some(revision)).await?.1
        };
        for (k, slot) in services.iter_mut() {
            *slot = found.remove(k);
        }
        let index = if whole_index {
            let start = self.layout.vip_index().into_bytes();
            let mut index = HashMap::new();
            self.read_range(&start, &range_end(&start), Some(revision), |kv| {
                let mod_revision = kv.mod_revision();
                let (key, value) = kv.into_key_value();
                if let Ok(key) = String::from_utf8(key) {
                    index.insert(
                        key,
                        Stored {
                            mod_revision,
                            value,
                        },
                    );
                }
            })
            .await
            .map_err(|e| match e {
                crate::orderedlog::etcd::read::Paged::Compacted => Attempt::Conflict(Vec::new()),
                crate::orderedlog::etcd::read::Paged::Failed(e) => e.into(),
            })?;
            index
        } else {
            found
        };
        Ok(Read {
            revision,
            objects,
            index,
            services,
        })
    }
}

/// A stored value as an object, leniently (as written, without today's checks);
/// `None` when it cannot be parsed.
pub(super) fn old_object(value: &[u8]) -> Option<Object> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|text| parse_stored(text).ok())
}
