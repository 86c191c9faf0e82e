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
//!
//! Here the entry points and the retries; the reads in `reads`, the transaction's
//! plan in `plan`, sending it in `commit`.

mod commit;
mod plan;
mod reads;

use super::{EtcdLog, Shared, keys};
use crate::{
    model::{ModelError, Object, ObjectKey, parse_stored},
    orderedlog::{
        LogError, Revision,
        store::{ApplyError, ApplyOutcome, Change, check_batch},
    },
};
use plan::Plan;
use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

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
