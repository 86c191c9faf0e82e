//! The embedded backend: a persistent, single-node ordered log in one redb file.
//!
//! `<state_dir>/store.redb` holds four tables, all written in the same transaction:
//!
//! * `objects`: `Kind/namespace/name` → (revision it was last written at, JSON document);
//! * `log`: revision → the event as JSON (`{"op":"put","object":…}` or
//!   `{"op":"delete","key":…}`), one row per revision, no gaps;
//! * `vips`: VIP → the service that owns it ([`vips`]), so that an apply checks VIP
//!   uniqueness by lookups: an apply costs what it writes, not what is stored;
//! * `meta`: the current revision, the oldest revision one can still watch from, and
//!   the revision the VIP index is current at.
//!
//! The state dir is created 0700 and the store file 0600 (secrets will live there).
//!
//! Writers ([`EmbeddedLog::apply`], [`EmbeddedLog::delete`]) are synchronous (redb is
//! blocking; async callers use `spawn_blocking`). Every changed object gets its own
//! revision, and history older than [`EmbeddedOptions::history`] events is compacted
//! in the same transaction. After each commit a `tokio::sync::watch` carries the new
//! revision to watchers, which then read the next batch from the `log` table: a slow
//! watcher costs no memory, and one that falls behind compaction gets
//! [`LogError::Compacted`].
//!
//! The store is opened in redb's exclusive-writer mode: a second open (another agent,
//! or the CLI while an agent runs) fails with [`LogError::Locked`].
//!
//! Here opening and reading; the writers in `write`, the watchers in `watcher`,
//! the VIP index in [`vips`].

pub use super::store::{ApplyError, ApplyOutcome, Change};
use super::{LogError, Revision};
use crate::model::{Kind, Object, ObjectKey, parse_stored};
use redb::{
    Database, DatabaseError, ReadableDatabase, ReadableTable, Table, TableDefinition,
    WriteTransaction,
};
use serde::{Deserialize, Serialize};
use std::{
    fmt,
    ops::ControlFlow,
    os::unix::fs::{DirBuilderExt, OpenOptionsExt},
    path::{Path, PathBuf},
    sync::Arc,
};

mod object_store;
mod reads;
mod vips;
mod watcher;
mod write;
use tokio::sync::watch;

/// The file name of the store inside the state dir.
pub const STORE_FILE: &str = "store.redb";

/// How many events are kept for watchers by default.
pub const DEFAULT_HISTORY: u64 = 10_000;

/// redb's cache; the store is small, and redb's default (1 GiB) is meant for big ones.
/// The agent reads the whole store once at start and then only the log's tail, so
/// a cache that could hold the store would keep pages nobody reads again.
const CACHE_BYTES: usize = 1024 * 1024;

const OBJECTS: TableDefinition<&str, (u64, &str)> = TableDefinition::new("objects");
const LOG: TableDefinition<u64, &str> = TableDefinition::new("log");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const META_REVISION: &str = "revision";
const META_OLDEST: &str = "oldest";

/// Tuning of the embedded log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddedOptions {
    /// How many events stay watchable; older ones are compacted after each write, and
    /// a watcher asking for them must resync from a snapshot.
    pub history: u64,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        Self {
            history: DEFAULT_HISTORY,
        }
    }
}

/// The embedded, persistent ordered log.
///
/// Cheap to clone: clones share one open database, which closes when the last clone
/// is dropped. Open watch streams do not keep it open; they end with
/// [`LogError::Closed`] once it closes.
#[derive(Clone)]
pub struct EmbeddedLog {
    inner: Arc<Inner>,
}

struct Inner {
    db: Database,
    path: PathBuf,
    history: u64,
    /// The last committed revision, for watchers.
    committed: watch::Sender<Revision>,
}

impl fmt::Debug for EmbeddedLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmbeddedLog")
            .field("path", &self.inner.path)
            .field("history", &self.inner.history)
            .field("revision", &self.revision())
            .finish()
    }
}

/// An event as stored in the `log` table.
#[derive(Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum StoredEvent {
    Put { object: serde_json::Value },
    Delete { key: StoredKey },
}

#[derive(Serialize, Deserialize)]
struct StoredKey {
    kind: Kind,
    namespace: String,
    name: String,
}

impl EmbeddedLog {
    /// Opens (creating when missing) the store `<state_dir>/store.redb`. Fails with
    /// [`LogError::Locked`] when another process holds it open. A missing state dir
    /// is created 0700 and a new store file 0600. Builds the VIP index when the store
    /// was written by an older agent (one pass over the stored services).
    pub fn open(state_dir: &Path, options: EmbeddedOptions) -> Result<EmbeddedLog, LogError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(state_dir)
            .map_err(|e| LogError::Storage {
                path: state_dir.display().to_string(),
                message: format!("cannot create the state dir: {e}"),
            })?;
        let path = state_dir.join(STORE_FILE);
        let shown = path.display().to_string();
        // redb creates a missing file with the process's umask (0644 as a rule) and
        // initialises an empty one: create it 0600 first.
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(storage(&path, format!("cannot create the store file: {e}"))),
        }
        // Integrity check on open: a damaged file fails with an error instead of
        // possibly panicking later (redb trusts a cleanly closed file otherwise).
        let db = Database::builder()
            .set_cache_size(CACHE_BYTES)
            .set_check_integrity_on_open(true)
            .create(&path)
            .map_err(|e| match e {
                DatabaseError::DatabaseAlreadyOpen | DatabaseError::LockProtocolMismatch => {
                    LogError::Locked {
                        path: shown.clone(),
                    }
                }
                other => storage(&path, other),
            })?;
        // Create the tables so readers never meet a missing one.
        let txn = db.begin_write().map_err(|e| storage(&path, e))?;
        let current = {
            txn.open_table(OBJECTS).map_err(|e| storage(&path, e))?;
            txn.open_table(LOG).map_err(|e| storage(&path, e))?;
            let meta = txn.open_table(META).map_err(|e| storage(&path, e))?;
            read_meta(&meta, META_REVISION, &path)?
        };
        vips::ensure(&txn, current, &path)?;
        txn.commit().map_err(|e| storage(&path, e))?;
        let (committed, _) = watch::channel(current);
        Ok(EmbeddedLog {
            inner: Arc::new(Inner {
                db,
                path,
                history: options.history,
                committed,
            }),
        })
    }

    /// The store file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The last committed revision (0 for an empty log).
    pub fn revision(&self) -> Revision {
        *self.inner.committed.borrow()
    }

    /// The objects matching the filters (each `None` matches all), ordered by key,
    /// with the revision they were read at.
    pub fn get(
        &self,
        kind: Option<Kind>,
        namespace: Option<&str>,
        name: Option<&str>,
    ) -> Result<(Revision, Vec<Object>), LogError> {
        let mut out = Vec::new();
        let revision = self.scan(kind, namespace, name, |_, o| {
            out.push(o);
            ControlFlow::Continue(())
        })?;
        Ok((revision, out))
    }

    /// Passes each object matching the filters (each `None` matches all) to `each`,
    /// in key order, with the revision of the one read transaction they come from;
    /// stops early when `each` breaks. Returns that revision. Holds one object at a
    /// time: how `get` streams a large store.
    pub fn scan(
        &self,
        kind: Option<Kind>,
        namespace: Option<&str>,
        name: Option<&str>,
        mut each: impl FnMut(Revision, Object) -> ControlFlow<()>,
    ) -> Result<Revision, LogError> {
        let inner = &self.inner;
        let txn = inner.db.begin_read().map_err(|e| inner.storage(e))?;
        let meta = txn.open_table(META).map_err(|e| inner.storage(e))?;
        let table = txn.open_table(OBJECTS).map_err(|e| inner.storage(e))?;
        let revision = read_meta(&meta, META_REVISION, &inner.path)?;
        inner.scan_ordered(&table, kind, namespace, |key, object| {
            if name.is_none_or(|x| x == key.name) {
                each(revision, object)
            } else {
                ControlFlow::Continue(())
            }
        })?;
        Ok(revision)
    }
}

impl Inner {
    fn storage(&self, e: impl fmt::Display) -> LogError {
        storage(&self.path, e)
    }

    fn begin_write(&self) -> Result<WriteTransaction, LogError> {
        self.db.begin_write().map_err(|e| self.storage(e))
    }

    fn commit(&self, txn: WriteTransaction, revision: Revision) -> Result<(), LogError> {
        txn.commit().map_err(|e| self.storage(e))?;
        // Concurrent writers may notify out of order: keep the highest.
        self.committed.send_if_modified(|r| {
            let newer = revision > *r;
            if newer {
                *r = revision;
            }
            newer
        });
        Ok(())
    }

    fn append(
        &self,
        log: &mut Table<u64, &str>,
        revision: Revision,
        event: &StoredEvent,
    ) -> Result<(), LogError> {
        let text = serde_json::to_string(event).map_err(|e| self.storage(e))?;
        log.insert(revision, text.as_str())
            .map_err(|e| self.storage(e))?;
        Ok(())
    }

    /// Records the new revision (also as the VIP index's) and drops history beyond
    /// `self.history` events.
    fn finish_write(
        &self,
        meta: &mut Table<&str, u64>,
        log: &mut Table<u64, &str>,
        revision: Revision,
    ) -> Result<(), LogError> {
        meta.insert(META_REVISION, revision)
            .map_err(|e| self.storage(e))?;
        // Every writer keeps the VIP index in the same transaction.
        meta.insert(vips::META_VIP_INDEX, revision)
            .map_err(|e| self.storage(e))?;
        let oldest = read_meta(meta, META_OLDEST, &self.path)?;
        let cut = revision.saturating_sub(self.history);
        if cut > oldest {
            log.retain_in::<u64, _>(..=cut, |_, _| false)
                .map_err(|e| self.storage(e))?;
            meta.insert(META_OLDEST, cut).map_err(|e| self.storage(e))?;
        }
        Ok(())
    }

    /// Passes each stored object whose key string starts with `prefix` to `each`
    /// (key, revision it was written at, object), in key order, until `each` breaks.
    fn scan_objects(
        &self,
        table: &impl ReadableTable<&'static str, (u64, &'static str)>,
        prefix: &str,
        mut each: impl FnMut(&ObjectKey, Revision, Object) -> ControlFlow<()>,
    ) -> Result<(), LogError> {
        for row in table.range(prefix..).map_err(|e| self.storage(e))? {
            let (k, v) = row.map_err(|e| self.storage(e))?;
            let k = k.value();
            if !k.starts_with(prefix) {
                break;
            }
            let (revision, doc) = v.value();
            let object = parse_stored(doc).map_err(|e| LogError::Corrupt {
                what: format!("object {k}"),
                message: e.to_string(),
            })?;
            let key = object.key();
            if key_string(&key) != k {
                return Err(LogError::Corrupt {
                    what: format!("object {k}"),
                    message: format!("the stored document is {key}"),
                });
            }
            if each(&key, revision, object).is_break() {
                break;
            }
        }
        Ok(())
    }

    /// The current revision and every object, in key order, from one read
    /// transaction.
    fn read_all(&self) -> Result<(Revision, Vec<Object>), LogError> {
        let txn = self.db.begin_read().map_err(|e| self.storage(e))?;
        let meta = txn.open_table(META).map_err(|e| self.storage(e))?;
        let table = txn.open_table(OBJECTS).map_err(|e| self.storage(e))?;
        let revision = read_meta(&meta, META_REVISION, &self.path)?;
        let mut objects = Vec::new();
        self.scan_ordered(&table, None, None, |_, object| {
            objects.push(object);
            ControlFlow::Continue(())
        })?;
        Ok((revision, objects))
    }
}

fn storage(path: &Path, e: impl fmt::Display) -> LogError {
    LogError::Storage {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// [`storage`], for the submodules.
fn storage_err(path: &Path, e: impl fmt::Display) -> LogError {
    storage(path, e)
}

/// The `log` row of a put: what serializing [`StoredEvent::Put`] gives, made from
/// the document's text without building its JSON tree again.
fn put_event(doc: &str) -> String {
    let mut s = String::with_capacity(doc.len() + 24);
    s.push_str(r#"{"op":"put","object":"#);
    s.push_str(doc);
    s.push('}');
    s
}

fn read_meta(
    meta: &impl ReadableTable<&'static str, u64>,
    key: &str,
    path: &Path,
) -> Result<u64, LogError> {
    Ok(meta
        .get(key)
        .map_err(|e| storage(path, e))?
        .map_or(0, |v| v.value()))
}

/// `Kind/namespace/name`: unambiguous, since names and namespaces are DNS labels.
fn key_string(key: &ObjectKey) -> String {
    format!("{}/{}/{}", key.kind, key.namespace, key.name)
}

/// The key a [`key_string`] names; `None` when it is not one.
fn parse_key_string(s: &str) -> Option<ObjectKey> {
    let mut parts = s.splitn(3, '/');
    let kind = Kind::from_document(parts.next()?)?;
    let namespace = parts.next()?;
    let name = parts.next()?;
    Some(ObjectKey::new(kind, namespace, name))
}

#[cfg(test)]
mod tests;
