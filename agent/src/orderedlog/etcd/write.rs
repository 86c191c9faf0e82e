//! The write side: apply, delete and read-modify-write, each one etcd transaction
//! guarded by compare-and-swap.
//!
//! An attempt reads every key it depends on at one revision (the objects, then the
//! VIP index entries of their old and new VIPs), checks and plans the change, and
//! commits it in one transaction whose every write is conditional on the key's mod
//! revision being the one read (0: still absent). When another writer got there
//! first the transaction does nothing, and the attempt starts again from a fresh
//! read, up to [`super::EtcdOptions::write_attempts`] times
//! ([`LogError::Conflict`] after that). So no update is lost, and VIP ownership,
//! kept in the index in the same transaction, holds across concurrent writers
//! without reading the whole prefix.
//!
//! A change that does not fit in one transaction (etcd's `--max-txn-ops`,
//! `--max-request-bytes`) is refused before anything is sent
//! ([`LogError::TooLarge`]): all or nothing, as with the embedded store.

use super::{
    EtcdLog, Shared, error,
    keys::{self, range_end},
};
use crate::{
    model::{Kind, ModelError, Object, ObjectKey, check_endpoint_ports, parse_stored},
    orderedlog::{
        LogError, Revision,
        store::{
            ApplyError, ApplyOutcome, Change, VipCheckError, check_batch, check_claim_owners,
            claims_of,
        },
    },
};
use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};
use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    time::{Duration, Instant},
};

/// Bytes of a request beyond its keys and values (header, framing), counted
/// generously so that an apply refused by etcd for its size is refused here first.
const REQUEST_OVERHEAD: usize = 256;
/// Framing of one operation or comparison in a transaction, counted generously.
const OP_OVERHEAD: usize = 24;

/// A key's value and mod revision, as read.
#[derive(Clone, Debug)]
struct Stored {
    mod_revision: i64,
    value: Vec<u8>,
}

/// Every key an attempt depends on, read at one revision.
struct Read {
    revision: Revision,
    /// Object keys read that exist.
    objects: HashMap<String, Stored>,
    /// VIP index keys read that exist.
    index: HashMap<String, Stored>,
    /// The Services of the batch's Endpoints that are not in the batch, by key,
    /// as stored (`None`: absent), for the check of their ports.
    services: BTreeMap<String, Option<Stored>>,
}

/// One transaction: its comparisons and operations.
#[derive(Default)]
struct Plan {
    compares: Vec<Compare>,
    ops: Vec<TxnOp>,
    /// Every key compared, with the mod revision it must still have.
    guarded: Vec<(String, i64)>,
    /// The request's size, estimated from above.
    bytes: usize,
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

    fn put(&mut self, key: String, value: String, seen: i64) {
        self.guard(&key, seen);
        self.bytes += key.len() + value.len() + OP_OVERHEAD;
        self.ops.push(TxnOp::put(key, value, None));
    }

    fn delete(&mut self, key: String, seen: i64) {
        self.guard(&key, seen);
        self.bytes += key.len() + OP_OVERHEAD;
        self.ops.push(TxnOp::delete(key, None));
    }
}

/// Why an attempt did not commit.
enum Attempt {
    /// Another writer changed a key it read: read again and retry.
    Conflict(Vec<(String, i64)>),
    /// A failure to report.
    Failed(ApplyError),
}

impl From<LogError> for Attempt {
    fn from(e: LogError) -> Self {
        Attempt::Failed(ApplyError::Log(e))
    }
}

impl From<ModelError> for Attempt {
    fn from(e: ModelError) -> Self {
        Attempt::Failed(ApplyError::Invalid(e))
    }
}

/// The VIP index as an attempt leaves it: index key → owner (`None`: removed).
type IndexAfter = BTreeMap<String, Option<String>>;

impl EtcdLog {
    /// Stores `objects` all or nothing, in one etcd transaction. Checks exactly
    /// what the embedded store checks, with the same messages, before anything is
    /// written: each object on its own, no object twice, no VIP owned by another
    /// service (in etcd or in the batch), each Endpoints against its Service's
    /// ports (the Service from the batch, else from etcd). An object equal to the stored one is
    /// [`Change::Unchanged`] and costs no operation; every changed one gets the
    /// transaction's revision.
    pub async fn apply(&self, objects: Vec<Object>) -> Result<ApplyOutcome, ApplyError> {
        let started = Instant::now();
        let keys = check_batch(&objects)?;
        let what = || format!("the apply of {} objects", objects.len());
        let mut retry = Retry::new(&self.inner);
        let outcome = loop {
            match self.inner.try_apply(&objects, &keys, &what).await {
                Ok(outcome) => break outcome,
                Err(e) => retry.after(e, &what).await?,
            }
        };
        tracing::debug!(
            objects = objects.len(),
            revision = outcome.revision,
            attempts = retry.attempt,
            elapsed_us = started.elapsed().as_micros() as u64,
            "etcd apply"
        );
        Ok(outcome)
    }

    /// Deletes one object (and its VIPs' index entries) in one transaction.
    /// Returns the revision, or `None` when there was no such object.
    pub async fn delete(&self, key: &ObjectKey) -> Result<Option<Revision>, LogError> {
        let what = || format!("the delete of {key}");
        let mut retry = Retry::new(&self.inner);
        loop {
            match self.inner.try_delete(key, &what).await {
                Ok(revision) => return Ok(revision),
                Err(e) => match retry.after(e, &what).await {
                    Ok(()) => {}
                    Err(ApplyError::Log(e)) => return Err(e),
                    // A delete checks no object: not reached; reported as a refusal.
                    Err(ApplyError::Invalid(e)) => {
                        return Err(LogError::Refused {
                            endpoints: self.inner.endpoints.clone(),
                            message: e.to_string(),
                        });
                    }
                },
            }
        }
    }

    /// Read-modify-write of one object: `change` gets the stored object (`None`
    /// when absent) and returns the new one (`None`: leave it as it is). Checked
    /// and stored as [`EtcdLog::apply`] does, but only if nobody changed the
    /// object in between; otherwise `change` runs again on the newer version. How
    /// writers on several nodes edit one object (each its own endpoint of a
    /// shared Endpoints object) without losing each other's updates.
    pub async fn update(
        &self,
        key: &ObjectKey,
        mut change: impl FnMut(Option<&Object>) -> Option<Object> + Send,
    ) -> Result<ApplyOutcome, ApplyError> {
        let what = || format!("the update of {key}");
        let mut retry = Retry::new(&self.inner);
        loop {
            match self.inner.try_update(key, &mut change, &what).await {
                Ok(outcome) => return Ok(outcome),
                Err(e) => retry.after(e, &what).await?,
            }
        }
    }
}

/// Counts the attempts of one write and pauses between them.
struct Retry<'a> {
    inner: &'a Shared,
    attempt: u32,
}

impl<'a> Retry<'a> {
    fn new(inner: &'a Shared) -> Self {
        Self { inner, attempt: 1 }
    }

    /// After a failed attempt: `Ok` to try again (after a little pause, random and
    /// growing, so that two writers do not collide again at once), or the error
    /// to report (a failure, or conflicts on every allowed attempt).
    async fn after(&mut self, e: Attempt, what: &impl Fn() -> String) -> Result<(), ApplyError> {
        let guarded = match e {
            Attempt::Failed(e) => return Err(e),
            Attempt::Conflict(guarded) => guarded,
        };
        let limit = self.inner.options.write_attempts.max(1);
        if self.attempt >= limit {
            return Err(ApplyError::Log(LogError::Conflict {
                key: self.inner.changed_key(&guarded).await,
                attempts: limit,
            }));
        }
        tracing::debug!(what = %what(), attempt = self.attempt, "etcd write conflict; retrying");
        let ceiling = 5u64 << self.attempt.min(6);
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..=ceiling))).await;
        self.attempt += 1;
        Ok(())
    }
}

impl Shared {
    /// One attempt of [`EtcdLog::apply`].
    async fn try_apply(
        &self,
        objects: &[Object],
        keys: &HashSet<ObjectKey>,
        what: &impl Fn() -> String,
    ) -> Result<ApplyOutcome, Attempt> {
        let read = self.read_for(objects).await?;
        let (plan, results) = self.plan_apply(objects, keys, &read)?;
        self.finish(plan, read.revision, results, what).await
    }

    /// One attempt of [`EtcdLog::delete`].
    async fn try_delete(
        &self,
        key: &ObjectKey,
        what: &impl Fn() -> String,
    ) -> Result<Option<Revision>, Attempt> {
        let etcd_key = self.layout.object(key);
        let (revision, objects) = self
            .read_keys(std::slice::from_ref(&etcd_key), None)
            .await?;
        let Some(seen) = objects.get(&etcd_key).map(|s| s.mod_revision) else {
            return Ok(None);
        };
        let read = self.complete_read(revision, objects, [(key, None)]).await?;
        let mut index = self.index_before(&read);
        self.move_vips(
            &mut index,
            &keys::relative(key),
            read.objects.get(&etcd_key),
            None,
        );
        let mut plan = Plan::default();
        plan.delete(etcd_key, seen);
        self.index_ops(&mut plan, &read, index);
        self.commit(plan, what).await.map(Some)
    }

    /// One attempt of [`EtcdLog::update`].
    async fn try_update(
        &self,
        key: &ObjectKey,
        change: &mut (impl FnMut(Option<&Object>) -> Option<Object> + Send),
        what: &impl Fn() -> String,
    ) -> Result<ApplyOutcome, Attempt> {
        let etcd_key = self.layout.object(key);
        let (revision, objects) = self
            .read_keys(std::slice::from_ref(&etcd_key), None)
            .await?;
        let current = match objects.get(&etcd_key) {
            Some(s) => Some(parse_value(&etcd_key, &s.value)?),
            None => None,
        };
        let Some(new) = change(current.as_ref()) else {
            return Ok(unchanged(revision, key));
        };
        if new.key() != *key {
            return Err(ModelError::invalid(
                new.key().to_string(),
                "metadata",
                format!("an update of {key} must keep its kind, namespace and name"),
            )
            .into());
        }
        let batch = [new];
        let keys = check_batch(&batch)?;
        let read = self
            .complete_read(revision, objects, [(key, Some(&batch[0]))])
            .await?;
        let (plan, results) = self.plan_apply(&batch, &keys, &read)?;
        self.finish(plan, read.revision, results, what).await
    }
}

/// The outcome of an update that changed nothing.
fn unchanged(revision: Revision, key: &ObjectKey) -> ApplyOutcome {
    ApplyOutcome {
        revision,
        results: vec![(key.clone(), Change::Unchanged)],
    }
}

/// A stored value as an object, for a read-modify-write (which must not go on
/// from a value it cannot read).
fn parse_value(key: &str, value: &[u8]) -> Result<Object, LogError> {
    std::str::from_utf8(value)
        .map_err(|e| e.to_string())
        .and_then(|text| parse_stored(text).map_err(|e| e.to_string()))
        .map_err(|message| LogError::Corrupt {
            what: format!("etcd key {key}"),
            message,
        })
}

impl Shared {
    /// The first of `guarded` whose mod revision is no longer the one expected (or
    /// the first at all): which key the writers fought over.
    async fn changed_key(&self, guarded: &[(String, i64)]) -> String {
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
    async fn read_keys(
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
    async fn read_for(&self, objects: &[Object]) -> Result<Read, Attempt> {
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
    async fn complete_read<'a>(
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
                super::read::Paged::Compacted => Attempt::Conflict(Vec::new()),
                super::read::Paged::Failed(e) => e.into(),
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

    /// Checks a validated batch against the VIP index and plans its transaction:
    /// one put per changed object, the index moved along. Returns the plan and
    /// each object's change, in the batch's order.
    fn plan_apply(
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
    fn index_before(&self, read: &Read) -> IndexAfter {
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
    fn move_vips(
        &self,
        index: &mut IndexAfter,
        owner: &str,
        stored: Option<&Stored>,
        new: Option<&Object>,
    ) {
        let new_vips: Vec<String> = new
            .map(claims_of)
            .unwrap_or_default()
            .into_iter()
            .map(|c| c.index_key)
            .collect();
        match stored.map(|s| old_object(&s.value)) {
            Some(Some(old)) => {
                let old = claims_of(&old);
                for vip in old.iter().filter(|c| !new_vips.contains(&c.index_key)) {
                    let k = self.layout.claim(&vip.index_key);
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
        for vip in new_vips {
            index.insert(self.layout.claim(&vip), Some(owner.to_owned()));
        }
    }

    /// Adds the index entries that differ from what was read to the plan.
    fn index_ops(&self, plan: &mut Plan, read: &Read, index: IndexAfter) {
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

    /// Commits a planned apply (nothing to commit: the read's revision).
    async fn finish(
        &self,
        plan: Plan,
        read_revision: Revision,
        results: Vec<(ObjectKey, Change)>,
        what: &impl Fn() -> String,
    ) -> Result<ApplyOutcome, Attempt> {
        let revision = if plan.ops.is_empty() {
            read_revision
        } else {
            self.commit(plan, what).await?
        };
        Ok(ApplyOutcome { revision, results })
    }

    /// Sends `plan` as one transaction after checking it against etcd's limits.
    /// Returns its revision; [`Attempt::Conflict`] when a compared key changed.
    async fn commit(&self, plan: Plan, what: &impl Fn() -> String) -> Result<Revision, Attempt> {
        let limits = [
            (
                plan.ops.len(),
                self.options.max_txn_ops,
                "operations",
                "--max-txn-ops",
            ),
            (
                plan.compares.len(),
                self.options.max_txn_ops,
                "comparisons",
                "--max-txn-ops",
            ),
            (
                plan.bytes + REQUEST_OVERHEAD,
                self.options.max_request_bytes,
                "bytes",
                "--max-request-bytes",
            ),
        ];
        for (needed, allowed, unit, setting) in limits {
            if needed > allowed {
                return Err(LogError::TooLarge {
                    what: what(),
                    needed: needed as u64,
                    allowed: allowed as u64,
                    unit,
                    setting,
                }
                .into());
            }
        }
        let (ops, bytes) = (plan.ops.len(), plan.bytes + REQUEST_OVERHEAD);
        let txn = Txn::new().when(plan.compares).and_then(plan.ops);
        let mut kv = self.kv.clone();
        match kv.txn(txn).await {
            Ok(r) if r.succeeded() => Ok(self.header_revision(r.header())?),
            Ok(_) => Err(Attempt::Conflict(plan.guarded)),
            Err(e) => Err(self.limit_error(&e, what, ops, bytes).into()),
        }
    }

    /// etcd's refusal of a transaction, naming the limit when it is one (etcd's
    /// limits are lower than the options say): never a raw transport error.
    fn limit_error(
        &self,
        e: &etcd_client::Error,
        what: &impl Fn() -> String,
        ops: usize,
        bytes: usize,
    ) -> LogError {
        let message = error::describe(e);
        let limit = if message.contains("too many operations") {
            Some(format!(
                "{} needs {ops} operations, more than etcd's --max-txn-ops allows (rune-agent was told {})",
                what(),
                self.options.max_txn_ops
            ))
        } else if message.contains("too large") || message.contains("larger than max") {
            Some(format!(
                "{} is a request of about {bytes} bytes, more than etcd's --max-request-bytes allows (rune-agent was told {})",
                what(),
                self.options.max_request_bytes
            ))
        } else {
            None
        };
        match limit {
            Some(limit) => LogError::Refused {
                endpoints: self.endpoints.clone(),
                message: format!("{message}: {limit}; nothing was written"),
            },
            None => self.error(e),
        }
    }
}

/// A stored value as an object, leniently (as written, without today's checks);
/// `None` when it cannot be parsed.
fn old_object(value: &[u8]) -> Option<Object> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|text| parse_stored(text).ok())
}
