//! The watch of one small subtree beside the objects (`nodes/`, `drains/`): etcd's
//! raw puts and deletes under it after a revision. Unlike the object watch it does
//! not reconnect by itself: it ends with the error, and the caller lists the
//! subtree again and watches from there (a listing of a few keys is cheap).

use super::{EtcdLog, error, keys::range_end};
use crate::orderedlog::{LogError, Revision};
use etcd_client::{EventType, KeyValue, WatchOptions};
use futures::stream::BoxStream;
use std::collections::VecDeque;

/// One change under a subtree, as etcd delivered it.
pub(super) enum KeyChange {
    /// A key was written: the key-value as stored.
    Put(KeyValue),
    /// A key was deleted, at `revision`.
    Delete {
        /// The key.
        key: Vec<u8>,
        /// The revision of the deletion.
        revision: Revision,
    },
}

impl EtcdLog {
    /// Every key-value under `subtree` (a whole key, prefix included) at one
    /// revision, in key order, each passed to `each`; returns the revision.
    pub(super) async fn list_subtree(
        &self,
        subtree: String,
        each: impl FnMut(KeyValue),
    ) -> Result<Revision, LogError> {
        let start = subtree.into_bytes();
        let end = range_end(&start);
        self.inner
            .read_range(&start, &end, None, each)
            .await
            .map_err(|e| match e {
                super::read::Paged::Failed(e) => e,
                super::read::Paged::Compacted => LogError::Unavailable {
                    endpoints: self.inner.endpoints.clone(),
                    message: "etcd compacted the listing's revision before it was read".to_owned(),
                },
            })
    }

    /// The changes to every key starting with `subtree` (a whole key, prefix
    /// included) after revision `from`, in order; `what` names the subtree in
    /// errors (`nodes'`, `drains'`).
    pub(super) async fn watch_subtree(
        &self,
        subtree: String,
        from: Revision,
        what: &'static str,
    ) -> Result<BoxStream<'static, Result<KeyChange, LogError>>, LogError> {
        let prefix = subtree.into_bytes();
        let options = WatchOptions::new()
            .with_range(range_end(&prefix))
            .with_start_revision(from as i64 + 1);
        let mut watch = self.inner.watch.clone();
        let stream = watch
            .watch(prefix, Some(options))
            .await
            .map_err(|e| self.inner.error(&e))?;
        let log = self.clone();
        let changes = futures::stream::unfold(
            (log, stream, VecDeque::new(), false),
            move |(log, mut stream, mut pending, done)| async move {
                if done {
                    return None;
                }
                loop {
                    if let Some(change) = pending.pop_front() {
                        return Some((Ok(change), (log, stream, pending, false)));
                    }
                    let response = match stream.message().await {
                        Ok(Some(r)) => r,
                        Ok(None) => {
                            let e = LogError::Unavailable {
                                endpoints: log.inner.endpoints.clone(),
                                message: format!("etcd closed the {what} watch"),
                            };
                            return Some((Err(e), (log, stream, pending, true)));
                        }
                        Err(e) => {
                            let e = if error::is_compacted(&e) {
                                LogError::Compacted {
                                    requested: from,
                                    oldest: from + 1,
                                }
                            } else {
                                log.inner.error(&e)
                            };
                            return Some((Err(e), (log, stream, pending, true)));
                        }
                    };
                    if response.canceled() {
                        let e = LogError::Unavailable {
                            endpoints: log.inner.endpoints.clone(),
                            message: format!(
                                "etcd cancelled the {what} watch {}",
                                response.cancel_reason()
                            ),
                        };
                        return Some((Err(e), (log, stream, pending, true)));
                    }
                    for event in response.events() {
                        let Some(kv) = event.kv() else { continue };
                        pending.push_back(match event.event_type() {
                            EventType::Put => KeyChange::Put(kv.clone()),
                            EventType::Delete => KeyChange::Delete {
                                key: kv.key().to_vec(),
                                revision: kv.mod_revision().max(0) as Revision,
                            },
                        });
                    }
                }
            },
        );
        Ok(Box::pin(changes))
    }
}
