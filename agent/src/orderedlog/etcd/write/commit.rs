//! Sending an attempt's transaction, within etcd's limits, and naming the limit
//! when etcd refuses it for its size.

use super::{Attempt, plan::Plan};
use crate::{
    model::ObjectKey,
    orderedlog::{
        LogError, Revision,
        etcd::{Shared, error},
        store::{ApplyOutcome, Change},
    },
};
use etcd_client::Txn;

/// Bytes of a request beyond its keys and values (header, framing), counted
/// generously so that an apply refused by etcd for its size is refused here first.
const REQUEST_OVERHEAD: usize = 256;
impl Shared {
    /// Commits a planned apply (nothing to commit: the read's revision).
    pub(super) async fn finish(
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
    pub(super) async fn commit(
        &self,
        plan: Plan,
        what: &impl Fn() -> String,
    ) -> Result<Revision, Attempt> {
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
