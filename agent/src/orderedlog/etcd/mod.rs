//! The etcd backend: the ordered log (and the store the CLI writes) of many nodes,
//! kept in one etcd cluster (v3 API).
//!
//! * **Layout** ([`keys`]): `/rune/v1/<kind>/<namespace>/<name>` → the object's JSON
//!   document as the embedded store writes it; `/rune/v1/_index/vip/<vip>` → the
//!   service that owns the VIP. The prefix is configurable
//!   ([`EtcdOptions::prefix`]).
//! * **Revisions** are etcd's own: a snapshot is every object at one etcd revision
//!   (read in pages, all at that revision); a watch delivers etcd's events after
//!   it. The objects one transaction writes share its revision.
//! * **Read side** ([`OrderedLog`]): the watch reconnects by itself (backoff 100 ms
//!   doubling to 1 s) and resumes after the last revision it received, so no event
//!   is lost or repeated across an etcd restart; history etcd compacted meanwhile
//!   ends it with [`LogError::Compacted`] (the consumer takes a new snapshot). A value
//!   another client wrote that is not a valid object, or a key of an unknown kind,
//!   is skipped with an error naming the key (logged, counted in
//!   [`EtcdLog::skipped`]); everything else flows on.
//! * **Write side** ([`ObjectStore`], [`EtcdLog::update`]): every apply or delete is
//!   one etcd transaction guarded by compare-and-swap on each key it read (retried
//!   when another writer got there first), so concurrent writers on many nodes lose
//!   no update; VIP ownership is kept in index keys inside the same transaction.
//!   An apply larger than one transaction allows is refused before anything is
//!   written ([`LogError::TooLarge`]).
//! * **Nodes** ([`nodes`]): each agent's document under `nodes/<node-id>`, held
//!   by a lease it keeps alive; the object readers skip that subtree.
//! * **Drains** ([`drains`]): the admin's drain records under `drains/<node-id>`,
//!   which every agent watches; skipped by the object readers too.
//!
//! The user-facing description is docs/etcd.md.

mod drains;
mod error;
mod keys;
mod nodes;
mod options;
mod read;
mod subtree;
mod watch;
mod write;

pub use drains::{DrainChange, DrainEntry, DrainStream};
pub use error::SkippedKey;
pub use nodes::{Lease, NodeChange, NodeRecord, NodeStream};
pub use options::{
    ConnectError, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TXN_OPS, DEFAULT_PAGE_SIZE,
    DEFAULT_PREFIX, DEFAULT_WRITE_ATTEMPTS, EtcdOptions,
};

use super::{
    EventStream, LogError, OrderedLog, Revision, Snapshot,
    store::{ApplyError, ApplyOutcome, ObjectStore},
};
use crate::{
    lock::lock,
    model::{Kind, Object, ObjectKey},
};
use async_trait::async_trait;
use etcd_client::{Client, GetOptions, KvClient, LeaseClient, WatchClient};
use keys::Layout;
use std::{
    fmt,
    sync::{Arc, Mutex},
};

/// The largest message read from etcd (a page of a snapshot, a batch of watch
/// events): etcd-client's default (4 MiB) is below what one page of large objects
/// or one watch response of many revisions can hold.
const MAX_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

/// The ordered log and object store in etcd.
///
/// Cheap to clone: clones share one client (one HTTP/2 connection per member).
#[derive(Clone)]
pub struct EtcdLog {
    inner: Arc<Shared>,
}

/// What every clone and every watch stream share.
struct Shared {
    kv: KvClient,
    watch: WatchClient,
    /// Leases of the nodes' documents ([`nodes`]).
    lease: LeaseClient,
    layout: Layout,
    /// The endpoints, comma-separated, for messages.
    endpoints: String,
    options: EtcdOptions,
    skipped: Mutex<SkipStats>,
}

/// Keys the readers skipped since the log was opened ([`EtcdLog::skipped`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SkipStats {
    /// How many (a key skipped by several reads counts each time).
    pub count: u64,
    /// The last one, with why.
    pub last: Option<SkippedKey>,
}

impl fmt::Debug for EtcdLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdLog")
            .field("endpoints", &self.inner.endpoints)
            .field("prefix", &self.inner.layout.prefix())
            .finish()
    }
}

impl EtcdLog {
    /// Checks `options` (see [`ConnectError`]) and makes a client. Sends nothing:
    /// etcd-client connects on the first request, and reconnects by itself, so an
    /// agent can start while etcd is down. [`EtcdLog::revision`] checks that etcd
    /// answers.
    pub async fn connect(options: EtcdOptions) -> Result<EtcdLog, ConnectError> {
        let prefix = options.normalized_prefix()?;
        let connect = options.connect_options()?;
        let endpoints = options.endpoints_text();
        let client = Client::connect(&options.endpoints, Some(connect))
            .await
            .map_err(|e| ConnectError::Client {
                endpoints: endpoints.clone(),
                message: error::describe(&e),
            })?;
        Ok(EtcdLog {
            inner: Arc::new(Shared {
                kv: client
                    .kv_client()
                    .max_decoding_message_size(MAX_MESSAGE_BYTES),
                watch: client
                    .watch_client()
                    .max_decoding_message_size(MAX_MESSAGE_BYTES),
                lease: client.lease_client(),
                layout: Layout::new(prefix),
                endpoints,
                options,
                skipped: Mutex::new(SkipStats::default()),
            }),
        })
    }

    /// The key prefix every object lives under (ends with `/`).
    pub fn prefix(&self) -> &str {
        self.inner.layout.prefix()
    }

    /// The endpoints, comma-separated.
    pub fn endpoints(&self) -> &str {
        &self.inner.endpoints
    }

    /// etcd's current revision, asked with one request: also shows that etcd
    /// answers and accepts this client (TLS, permissions).
    pub async fn revision(&self) -> Result<Revision, LogError> {
        let mut kv = self.inner.kv.clone();
        // The prefix itself is never a key: a read of it is the cheapest request
        // that carries the revision (counting the prefix would visit every key).
        let prefix = self.inner.layout.prefix().to_owned();
        let response = kv
            .get(prefix, Some(GetOptions::new().with_keys_only()))
            .await
            .map_err(|e| self.inner.error(&e))?;
        self.inner.header_revision(response.header())
    }

    /// The keys the readers skipped so far (values that are not valid objects,
    /// unknown kinds), and the last of them.
    pub fn skipped(&self) -> SkipStats {
        lock(&self.inner.skipped).clone()
    }
}

impl Shared {
    /// `e` as a [`LogError`] naming the endpoints. Over TLS, a refused client
    /// certificate gets a hint (often all the client sees of it is a closed
    /// connection: the TLS alert is lost under HTTP/2).
    fn error(&self, e: &etcd_client::Error) -> LogError {
        let mut err = error::log_error(&self.endpoints, e);
        if self.options.ca_file.is_some()
            && let LogError::Unavailable { message, .. } = &mut err
            && let Some(hint) = error::tls_hint(message)
        {
            message.push_str(&hint);
        }
        err
    }

    /// The revision of a response's header (etcd always sends one).
    fn header_revision(
        &self,
        header: Option<&etcd_client::ResponseHeader>,
    ) -> Result<Revision, LogError> {
        match header {
            Some(h) if h.revision() >= 0 => Ok(h.revision() as Revision),
            _ => Err(LogError::Refused {
                endpoints: self.endpoints.clone(),
                message: "a response without a revision".to_owned(),
            }),
        }
    }

    /// Logs and counts a skipped key.
    fn skip(&self, key: &[u8], revision: Revision, reason: String) {
        let skipped = SkippedKey {
            key: String::from_utf8_lossy(key).into_owned(),
            revision,
            reason,
        };
        tracing::error!(key = %skipped.key, revision, error = %skipped, "etcd value skipped");
        let mut stats = lock(&self.skipped);
        stats.count += 1;
        stats.last = Some(skipped);
    }
}

#[async_trait]
impl OrderedLog for EtcdLog {
    async fn snapshot(&self) -> Result<Snapshot, LogError> {
        self.read_snapshot().await
    }

    async fn watch(&self, from: Revision) -> Result<EventStream, LogError> {
        watch::start(self.inner.clone(), from).await
    }
}

#[async_trait]
impl ObjectStore for EtcdLog {
    async fn apply(&self, objects: Vec<Object>) -> Result<ApplyOutcome, ApplyError> {
        EtcdLog::apply(self, objects).await
    }

    async fn delete(&self, key: &ObjectKey) -> Result<Option<Revision>, LogError> {
        EtcdLog::delete(self, key).await
    }

    async fn get(
        &self,
        kind: Option<Kind>,
        namespace: Option<&str>,
        name: Option<&str>,
    ) -> Result<(Revision, Vec<Object>), LogError> {
        EtcdLog::get(self, kind, namespace, name).await
    }

    async fn current_revision(&self) -> Result<Revision, LogError> {
        EtcdLog::revision(self).await
    }
}

#[cfg(test)]
mod tests;
