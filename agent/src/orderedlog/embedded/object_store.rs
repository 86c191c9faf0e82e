//! The embedded store as an [`ObjectStore`]: each call runs the store's blocking
//! method on tokio's blocking pool.

use super::EmbeddedLog;
use crate::{
    model::{Kind, Object, ObjectKey},
    orderedlog::{
        LogError, Revision,
        store::{ApplyError, ApplyOutcome, ObjectStore, ScanFn, task_failed},
    },
};
use async_trait::async_trait;

#[async_trait]
impl ObjectStore for EmbeddedLog {
    async fn apply(&self, objects: Vec<Object>) -> Result<ApplyOutcome, ApplyError> {
        let store = self.clone();
        match tokio::task::spawn_blocking(move || EmbeddedLog::apply(&store, objects)).await {
            Ok(r) => r,
            Err(e) => Err(ApplyError::Log(task_failed(e))),
        }
    }

    async fn delete(&self, key: &ObjectKey) -> Result<Option<Revision>, LogError> {
        let (store, key) = (self.clone(), key.clone());
        tokio::task::spawn_blocking(move || EmbeddedLog::delete(&store, &key))
            .await
            .map_err(task_failed)?
    }

    async fn get(
        &self,
        kind: Option<Kind>,
        namespace: Option<&str>,
        name: Option<&str>,
    ) -> Result<(Revision, Vec<Object>), LogError> {
        let store = self.clone();
        let (namespace, name) = (namespace.map(str::to_owned), name.map(str::to_owned));
        tokio::task::spawn_blocking(move || {
            EmbeddedLog::get(&store, kind, namespace.as_deref(), name.as_deref())
        })
        .await
        .map_err(task_failed)?
    }

    async fn current_revision(&self) -> Result<Revision, LogError> {
        Ok(EmbeddedLog::revision(self))
    }

    async fn scan(
        &self,
        kind: Option<Kind>,
        namespace: Option<String>,
        name: Option<String>,
        each: ScanFn,
    ) -> Result<Revision, LogError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || {
            EmbeddedLog::scan(&store, kind, namespace.as_deref(), name.as_deref(), each)
        })
        .await
        .map_err(task_failed)?
    }
}
