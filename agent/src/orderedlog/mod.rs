//! The ordered log: the agent's one seam to the control plane's desired state.
//!
//! A consumer takes a [`Snapshot`] at revision R, then [`OrderedLog::watch`]es from R
//! and receives every later [`Event`] in order. Revisions never go down; events that
//! share one revision were written by one transaction and arrive one after another
//! (the embedded store gives every change a revision of its own; etcd gives all the
//! changes of one transaction its revision).
//! A consumer that asks for history the log no longer holds (compacted away) gets
//! [`LogError::Compacted`] and must take a new snapshot: the explicit resync signal.
//!
//! Backends: [`embedded`] (single node, the default: a persistent local store in the
//! state dir) and [`etcd`] (many nodes against one etcd cluster). Both also implement
//! the write side, [`store::ObjectStore`]. A relay (gRPC watch) would implement the
//! same traits.

pub mod embedded;
pub mod etcd;
mod feed;
pub mod store;

use crate::model::{Object, ObjectKey};
use async_trait::async_trait;
use futures::stream::BoxStream;
use thiserror::Error;

/// A position in the log. Revision 0 is the empty log; the first event has revision 1.
pub type Revision = u64;

/// One change to the desired state.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// An object was created or changed.
    Put {
        /// The revision of this change.
        revision: Revision,
        /// The object as it is now.
        object: Object,
    },
    /// An object was removed.
    Delete {
        /// The revision of this change.
        revision: Revision,
        /// Which object.
        key: ObjectKey,
    },
    /// A value at this revision is not an object (another client wrote it under
    /// the prefix: malformed, or a kind this agent does not know). It was skipped
    /// with an error naming the key; nothing changes, but the log reached the
    /// revision, so that consumers acknowledge it as applied (`apply --wait`
    /// and `appliedRevision` must not stall below it).
    Skipped {
        /// The revision of the value.
        revision: Revision,
        /// The key, as stored.
        key: String,
    },
}

impl Event {
    /// The revision of the event.
    pub fn revision(&self) -> Revision {
        match self {
            Event::Put { revision, .. }
            | Event::Delete { revision, .. }
            | Event::Skipped { revision, .. } => *revision,
        }
    }
}

/// Every object at one revision.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// The revision the snapshot reflects; watch from here.
    pub revision: Revision,
    /// The objects, ordered by key.
    pub objects: Vec<Object>,
}

/// A stream of events in revision order (events of one transaction may share a
/// revision; see the module's doc). It ends with an error (e.g.
/// [`LogError::Compacted`] when the consumer fell too far behind); it does not end on
/// its own otherwise.
pub type EventStream = BoxStream<'static, Result<Event, LogError>>;

/// Errors of ordered-log backends.
#[derive(Debug, Error)]
pub enum LogError {
    /// The history after `requested` was compacted: take a new snapshot (resync).
    #[error(
        "revision {requested} was compacted (oldest watchable revision is {oldest}): resync from a new snapshot"
    )]
    Compacted {
        /// The revision the consumer asked to watch from.
        requested: Revision,
        /// The oldest revision that can still be watched from.
        oldest: Revision,
    },
    /// The consumer asked to watch from a revision the log has not reached.
    #[error("revision {requested} is in the future (the log is at {current})")]
    FutureRevision {
        /// The revision asked for.
        requested: Revision,
        /// The log's current revision.
        current: Revision,
    },
    /// A stored record could not be read back.
    #[error("corrupt record at {what}: {message}")]
    Corrupt {
        /// Which record (a revision or a key).
        what: String,
        /// Why it could not be read.
        message: String,
    },
    /// The backend's storage failed.
    #[error("store {path}: {message}")]
    Storage {
        /// Where the store lives.
        path: String,
        /// What the storage layer said.
        message: String,
    },
    /// Another process (or another handle in this one) holds the store open: only one
    /// writer may own it at a time.
    #[error(
        "store {path} is in use by another process (is a rune-agent already running? use its local API)"
    )]
    Locked {
        /// Where the store lives.
        path: String,
    },
    /// The log was closed (agent stopping).
    #[error("the ordered log is closed")]
    Closed,
    /// A networked backend could not be reached (or did not answer in time).
    #[error("etcd at {endpoints} is unavailable: {message}")]
    Unavailable {
        /// The endpoints tried, comma-separated.
        endpoints: String,
        /// What failed, without the transport's internals.
        message: String,
    },
    /// A networked backend answered, but refused the request (permissions, a
    /// request it will not carry out).
    #[error("etcd at {endpoints} refused the request: {message}")]
    Refused {
        /// The endpoints asked, comma-separated.
        endpoints: String,
        /// What the backend said.
        message: String,
    },
    /// A write does not fit in one transaction of the backend: nothing was written.
    #[error(
        "{what} needs {needed} {unit} in one etcd transaction, but etcd allows {allowed} \
         ({setting}): nothing was written. Split it into smaller applies, or raise {setting} \
         on every etcd member and give rune-agent the same limit"
    )]
    TooLarge {
        /// What was refused (e.g. `the apply of 300 objects`).
        what: String,
        /// How much of the limited thing the write needs.
        needed: u64,
        /// What etcd allows.
        allowed: u64,
        /// The unit (`operations`, `bytes`).
        unit: &'static str,
        /// etcd's setting that sets the limit (`--max-txn-ops`, `--max-request-bytes`).
        setting: &'static str,
    },
    /// Other writers kept changing an object between this write's read and its
    /// commit: nothing was written.
    #[error(
        "{key} kept changing under this write ({attempts} attempts): nothing was written; try again"
    )]
    Conflict {
        /// The object (or index entry) that changed, as stored.
        key: String,
        /// How many times the write was tried.
        attempts: u32,
    },
}

impl LogError {
    /// Whether the consumer must take a new snapshot to continue.
    pub fn needs_resync(&self) -> bool {
        matches!(self, LogError::Compacted { .. })
    }
}

/// The read side every consumer uses: snapshot, then watch.
#[async_trait]
pub trait OrderedLog: Send + Sync + 'static {
    /// Every object at the current revision.
    async fn snapshot(&self) -> Result<Snapshot, LogError>;

    /// Events with revisions greater than `from`, in order, then live ones as they
    /// happen. Fails with [`LogError::Compacted`] when that history is gone.
    async fn watch(&self, from: Revision) -> Result<EventStream, LogError>;
}
