//! Reads beyond one key: ranges read in pages, every page at the revision of the
//! first (a consistent snapshot or listing however large), and the decoding of
//! stored values into objects, skipping what is not one.

use super::{EtcdLog, Shared, error, keys::Parsed, keys::range_end};
use crate::{
    model::{Kind, Object, parse_json},
    orderedlog::{LogError, Revision, Snapshot},
};
use etcd_client::{GetOptions, KeyValue};

/// How many times a snapshot starts again when etcd compacts the revision it is
/// reading at before its last page (only when compaction runs every few seconds).
const SNAPSHOT_ATTEMPTS: u32 = 3;

impl EtcdLog {
    /// Every object under the prefix at one revision, ordered by key; values that
    /// are not valid objects are skipped ([`EtcdLog::skipped`]).
    pub(super) async fn read_snapshot(&self) -> Result<Snapshot, LogError> {
        let inner = &self.inner;
        let start = inner.layout.prefix().as_bytes().to_vec();
        let end = range_end(&start);
        let mut attempt = 1;
        loop {
            let mut objects = Vec::new();
            let read = inner
                .read_range(&start, &end, None, |kv| {
                    if let Some(o) = inner.decode(kv) {
                        objects.push(o);
                    }
                })
                .await;
            match read {
                Ok(revision) => {
                    objects.sort_by_key(Object::key);
                    return Ok(Snapshot { revision, objects });
                }
                Err(Paged::Compacted) if attempt < SNAPSHOT_ATTEMPTS => attempt += 1,
                Err(e) => return Err(e.into_log(inner)),
            }
        }
    }

    /// The objects matching the filters (each `None` matches all), ordered by key,
    /// with the revision they were read at (one revision for all).
    pub async fn get(
        &self,
        kind: Option<Kind>,
        namespace: Option<&str>,
        name: Option<&str>,
    ) -> Result<(Revision, Vec<Object>), LogError> {
        let inner = &self.inner;
        let kinds = match kind {
            Some(k) => vec![k],
            None => Kind::ALL.to_vec(),
        };
        let mut revision = None;
        let mut objects = Vec::new();
        for kind in kinds {
            let start = inner.layout.objects_of(kind, namespace).into_bytes();
            let end = range_end(&start);
            let read = inner
                .read_range(&start, &end, revision, |kv| {
                    if let Some(o) = inner.decode(kv)
                        && name.is_none_or(|n| n == o.metadata().name)
                    {
                        objects.push(o);
                    }
                })
                .await
                .map_err(|e| e.into_log(inner))?;
            revision = Some(read);
        }
        objects.sort_by_key(Object::key);
        Ok((revision.unwrap_or_default(), objects))
    }
}

/// Why a paged read stopped.
pub(super) enum Paged {
    /// The revision of the first page was compacted before the last.
    Compacted,
    /// Another failure.
    Failed(LogError),
}

impl Paged {
    fn into_log(self, inner: &Shared) -> LogError {
        match self {
            Paged::Compacted => LogError::Unavailable {
                endpoints: inner.endpoints.clone(),
                message: "etcd compacted the snapshot's revision before it was read: \
                          compaction runs too often for a snapshot this large"
                    .to_owned(),
            },
            Paged::Failed(e) => e,
        }
    }
}

impl Shared {
    /// Passes every key-value in `[start, end)` to `each`, in key order, reading
    /// [`super::EtcdOptions::page_size`] keys per request, every page at
    /// `revision` (or, when `None`, at the revision of the first page). Returns
    /// that revision.
    pub(super) async fn read_range(
        &self,
        start: &[u8],
        end: &[u8],
        revision: Option<Revision>,
        mut each: impl FnMut(KeyValue),
    ) -> Result<Revision, Paged> {
        let mut kv = self.kv.clone();
        let mut from = start.to_vec();
        let mut at = revision;
        let page = i64::try_from(self.options.page_size).unwrap_or(i64::MAX);
        loop {
            let mut options = GetOptions::new().with_range(end.to_vec()).with_limit(page);
            if let Some(r) = at {
                options = options.with_revision(r as i64);
            }
            let mut response = match kv.get(from.clone(), Some(options)).await {
                Ok(r) => r,
                Err(e) if error::is_compacted(&e) => return Err(Paged::Compacted),
                Err(e) => return Err(Paged::Failed(self.error(&e))),
            };
            let revision = match at {
                Some(r) => r,
                None => *at.insert(
                    self.header_revision(response.header())
                        .map_err(Paged::Failed)?,
                ),
            };
            let more = response.more();
            let kvs = response.take_kvs();
            let next = kvs.last().map(|kv| {
                let mut k = kv.key().to_vec();
                k.push(0);
                k
            });
            kvs.into_iter().for_each(&mut each);
            match next {
                Some(k) if more => from = k,
                _ => return Ok(revision),
            }
        }
    }

    /// The object a stored key-value holds; `None` for the store's own keys and
    /// for values that are not a valid object of the key's kind and name (skipped:
    /// logged and counted).
    pub(super) fn decode(&self, kv: KeyValue) -> Option<Object> {
        let revision = kv.mod_revision().max(0) as Revision;
        let key = match self.layout.parse(kv.key()) {
            Parsed::Object(key) => key,
            // Bookkeeping, node documents and drain records are not objects:
            // skipped silently.
            Parsed::Internal | Parsed::Node(_) | Parsed::Drain(_) => return None,
            Parsed::Unknown(reason) => {
                self.skip(kv.key(), revision, reason);
                return None;
            }
        };
        let object = std::str::from_utf8(kv.value())
            .map_err(|_| "the value is not UTF-8".to_owned())
            .and_then(|text| parse_json(text).map_err(|e| e.to_string()))
            .and_then(|o| {
                if o.key() == key {
                    Ok(o)
                } else {
                    Err(format!("the value is {}, not {key}", o.key()))
                }
            });
        match object {
            Ok(o) => Some(o),
            Err(reason) => {
                self.skip(kv.key(), revision, reason);
                None
            }
        }
    }
}
