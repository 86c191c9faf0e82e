//! An attempt's transaction: the objects' puts, the VIP index moved along, and a
//! comparison guarding every key the attempt relied on.

use super::{
    Attempt,
    reads::{Read, Stored, old_object},
};
use crate::{
    model::{Object, ObjectKey, check_endpoint_ports},
    orderedlog::{
        LogError,
        etcd::{Shared, keys},
        store::{Change, VipCheckError, check_claim_owners, claim_move},
    },
};
use etcd_client::{Compare, CompareOp, TxnOp};
use std::collections::{BTreeMap, HashSet};

/// Framing of one operation or comparison in a transaction, counted generously.
const OP_OVERHEAD: usize = 24;

/// One transaction: its comparisons and operations.
#[derive(Default)]
pub(super) struct Plan {
    pub(super) compares: Vec<Compare>,
    pub(super) ops: Vec<TxnOp>,
    /// Every key compared, with the mod revision it must still have.
    pub(super) guarded: Vec<(String, i64)>,
    /// The request's size, estimated from above.
    pub(super) bytes: usize,
}

impl Plan {
    fn guard(&mut self, key: &str, seen: i64) {
        self.compares
            .push(Compare::mod_revision(key, CompareOp::Equal, seen));
        self.guarded.push((key.to_owned(), seen));
        self.bytes += key.len() + OP_OVERHEAD;
    }

    /// A key whose value the plan relies on without writing it.
    fn expect(&mut self, key: &str, seen: i64) {
        self.guard(key, seen);
    }

    pub(super) fn put(&mut self, key: String, value: String, seen: i64) {
        self.guard(&key, seen);
        self.bytes += key.len() + value.len() + OP_OVERHEAD;
        self.ops.push(TxnOp::put(key, value, None));
    }

    pub(super) fn delete(&mut self, key: String, seen: i64) {
        self.guard(&key, seen);
        self.bytes += key.len() + OP_OVERHEAD;
        self.ops.push(TxnOp::delete(key, None));
    }
}

/// The VIP index as an attempt leaves it: index key → owner (`None`: removed).
pub(super) type IndexAfter = BTreeMap<String, Option<String>>;

impl Shared {
    /// Checks a validated batch against the VIP index and plans its transaction:
    /// one put per changed object, the index moved along. Returns the plan and
    /// each object's change, in the batch's order.
    pub(super) fn plan_apply(
        &self,
        objects: &[Object],
        keys: &HashSet<ObjectKey>,
        read: &Read,
    ) -> Result<(Plan, Vec<(ObjectKey, Change)>), Attempt> {
        check_claim_owners(objects, keys, |claim| {
            self.index_owner(read, &self.layout.claim(claim))
        })
        .map_err(|e| match e {
            VipCheckError::Invalid(e) => Attempt::from(e),
            VipCheckError::Log(e) => Attempt::from(e),
        })?;
        // The Endpoints' ports against their Services: from the batch, else stored.
        let stored_services: Vec<Object> = read
            .services
            .values()
            .flatten()
            .filter_map(|s| old_object(&s.value))
            .collect();
        check_endpoint_ports(objects.iter().chain(&stored_services), objects)?;
        let mut plan = Plan::default();
        let mut index = self.index_before(read);
        let mut results = Vec::with_capacity(objects.len());
        for object in objects {
            let key = object.key();
            let etcd_key = self.layout.object(&key);
            let doc = object.to_json().to_string();
            let stored = read.objects.get(&etcd_key);
            let change = match stored {
                None => Change::Created,
                Some(s) if s.value == doc.as_bytes() => Change::Unchanged,
                // Other text may still parse equal (a document written differently).
                Some(s) if old_object(&s.value).as_ref() == Some(object) => Change::Unchanged,
                Some(_) => Change::Configured,
            };
            if change != Change::Unchanged {
                let owner = keys::relative(&key);
                self.move_vips(&mut index, &owner, stored, Some(object));
                plan.put(etcd_key, doc, stored.map_or(0, |s| s.mod_revision));
            }
            results.push((key, change));
        }
        self.index_ops(&mut plan, read, index);
        if !plan.ops.is_empty() {
            // The ports were checked against these Services as they are now.
            for (k, stored) in &read.services {
                plan.expect(k, stored.as_ref().map_or(0, |s| s.mod_revision));
            }
        }
        Ok((plan, results))
    }

    /// The service the index entry `index_key` names, as read.
    fn index_owner(&self, read: &Read, index_key: &str) -> Result<Option<ObjectKey>, LogError> {
        let Some(stored) = read.index.get(index_key) else {
            return Ok(None);
        };
        std::str::from_utf8(&stored.value)
            .map_err(|e| e.to_string())
            .and_then(keys::parse_relative)
            .map(Some)
            .map_err(|message| LogError::Corrupt {
                what: format!("etcd VIP index entry {index_key}"),
                message: format!("{message} (the entry should name its service)"),
            })
    }

    /// The index entries read, as owner strings.
    pub(super) fn index_before(&self, read: &Read) -> IndexAfter {
        read.index
            .iter()
            .map(|(k, s)| {
                (
                    k.clone(),
                    Some(String::from_utf8_lossy(&s.value).into_owned()),
                )
            })
            .collect()
    }

    /// Moves `owner`'s index entries from its stored version to `new` (absent: a
    /// delete). An old VIP is released only while the index still names `owner`
    /// (another service of the batch may have taken it already); a stored version
    /// that cannot be parsed releases every entry naming `owner`.
    pub(super) fn move_vips(
        &self,
        index: &mut IndexAfter,
        owner: &str,
        stored: Option<&Stored>,
        new: Option<&Object>,
    ) {
        let old = stored.map(|s| old_object(&s.value));
        let moved = claim_move(old.as_ref().and_then(Option::as_ref), new);
        match old {
            Some(Some(_)) => {
                for vip in moved.released {
                    let k = self.layout.claim(&vip);
                    if index.get(&k).is_some_and(|o| o.as_deref() == Some(owner)) {
                        index.insert(k, None);
                    }
                }
            }
            Some(None) => {
                for o in index.values_mut() {
                    if o.as_deref() == Some(owner) {
                        *o = None;
                    }
                }
            }
            None => {}
        }
        for vip in moved.claimed {
            index.insert(self.layout.claim(&vip), Some(owner.to_owned()));
        }
    }

    /// Adds the index entries that differ from what was read to the plan.
    pub(super) fn index_ops(&self, plan: &mut Plan, read: &Read, index: IndexAfter) {
        for (k, after) in index {
            let before = read.index.get(&k);
            let seen = before.map_or(0, |s| s.mod_revision);
            match (before, after) {
                (Some(b), Some(a)) if b.value == a.as_bytes() => {}
                (_, Some(owner)) => plan.put(k, owner, seen),
                (Some(_), None) => plan.delete(k, seen),
                (None, None) => {}
            }
        }
    }
}
