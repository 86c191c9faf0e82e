//! The nodes' documents: `<prefix>nodes/<node-id>`, each written under a lease its
//! agent keeps alive, so that the key vanishes when the agent dies and is deleted
//! when it stops cleanly (lease revoked).
//!
//! This file only stores and reads the documents as bytes (what they hold is
//! `crate::node`'s business); the object snapshot and watch skip this subtree.

use super::{EtcdLog, keys::Parsed, subtree::KeyChange};
use crate::orderedlog::{LogError, Revision};
use etcd_client::{GetOptions, LeaseTimeToLiveOptions, PutOptions};
use futures::{StreamExt, stream::BoxStream};
use std::time::Duration;
use tonic::Code;

/// A lease granted to this agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// etcd's id of the lease.
    pub id: i64,
    /// The time to live etcd granted, in seconds.
    pub ttl: i64,
}

/// A node's document as stored, with what its lease says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRecord {
    /// The node id (the key's last segment).
    pub id: String,
    /// The stored document (JSON, as the node wrote it).
    pub value: Vec<u8>,
    /// The revision the document was last written at.
    pub mod_revision: Revision,
    /// The lease holding the key (0: none, the key would never expire).
    pub lease: i64,
    /// Seconds the lease has left, and the seconds it was granted; `None` when the
    /// listing did not ask or the lease is gone.
    pub ttl: Option<(i64, i64)>,
}

/// A change to the nodes' subtree, as [`EtcdLog::watch_nodes`] delivers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeChange {
    /// A document was written.
    Put(NodeRecord),
    /// A document was deleted (its lease expired or was revoked), at `revision`.
    Delete {
        /// The node id.
        id: String,
        /// The revision of the deletion.
        revision: Revision,
    },
}

/// The changes under `nodes/`, in order; ends with an error when the watch breaks
/// (the caller lists again and watches from there).
pub type NodeStream = BoxStream<'static, Result<NodeChange, LogError>>;

/// Whether etcd said the lease a request named does not exist (expired, revoked).
fn lease_not_found(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            s.code() == Code::NotFound && s.message().contains("lease not found")
        }
        etcd_client::Error::LeaseKeepAliveError(m) => m.contains("lease not found"),
        _ => false,
    }
}

impl EtcdLog {
    /// Grants a lease of `ttl` (whole seconds, at least 1).
    pub async fn grant_lease(&self, ttl: Duration) -> Result<Lease, LogError> {
        let mut lease = self.inner.lease.clone();
        let seconds = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let granted = lease
            .grant(seconds, None)
            .await
            .map_err(|e| self.inner.error(&e))?;
        if !granted.error().is_empty() {
            return Err(LogError::Refused {
                endpoints: self.inner.endpoints.clone(),
                message: format!("lease grant: {}", granted.error()),
            });
        }
        Ok(Lease {
            id: granted.id(),
            ttl: granted.ttl(),
        })
    }

    /// Renews `lease` once (one keep-alive round trip); `false` when etcd no longer
    /// has it (it expired: every key it held is gone).
    pub async fn keep_alive(&self, lease: Lease) -> Result<bool, LogError> {
        let mut client = self.inner.lease.clone();
        match client.keep_alive(lease.id).await {
            // The keeper's first round trip is the renewal; dropping it ends the stream.
            Ok(_) => Ok(true),
            Err(e) if lease_not_found(&e) => Ok(false),
            Err(e) => Err(self.inner.error(&e)),
        }
    }

    /// Revokes `lease`: etcd deletes every key it holds at once. A lease already
    /// gone is not an error.
    pub async fn revoke_lease(&self, lease: Lease) -> Result<(), LogError> {
        let mut client = self.inner.lease.clone();
        match client.revoke(lease.id).await {
            Ok(_) => Ok(()),
            Err(e) if lease_not_found(&e) => Ok(()),
            Err(e) => Err(self.inner.error(&e)),
        }
    }

    /// Writes node `id`'s document under `lease`; `None` when the lease is gone
    /// (grant a new one and write again), else the revision written.
    pub async fn put_node(
        &self,
        id: &str,
        value: Vec<u8>,
        lease: Lease,
    ) -> Result<Option<Revision>, LogError> {
        let mut kv = self.inner.kv.clone();
        let key = self.inner.layout.node(id);
        match kv
            .put(key, value, Some(PutOptions::new().with_lease(lease.id)))
            .await
        {
            Ok(r) => self.inner.header_revision(r.header()).map(Some),
            Err(e) if lease_not_found(&e) => Ok(None),
            Err(e) => Err(self.inner.error(&e)),
        }
    }

    /// Whether node `id`'s key exists (a count, no value sent back: the
    /// registrar asks at every heartbeat, to write again a key someone deleted).
    pub async fn node_exists(&self, id: &str) -> Result<bool, LogError> {
        let mut kv = self.inner.kv.clone();
        let response = kv
            .get(
                self.inner.layout.node(id),
                Some(GetOptions::new().with_count_only()),
            )
            .await
            .map_err(|e| self.inner.error(&e))?;
        Ok(response.count() > 0)
    }

    /// Every node's document at one revision, ordered by id; `with_ttl` asks each
    /// lease's remaining and granted TTL too (one more request per node).
    pub async fn list_nodes(
        &self,
        with_ttl: bool,
    ) -> Result<(Revision, Vec<NodeRecord>), LogError> {
        let mut records = Vec::new();
        let revision = self
            .list_subtree(self.inner.layout.nodes(), |kv| {
                if let Some(r) = self.record(kv) {
                    records.push(r);
                }
            })
            .await?;
        if with_ttl {
            for r in &mut records {
                r.ttl = self.lease_ttl(r.lease).await?;
            }
        }
        Ok((revision, records))
    }

    /// Node `id`'s document with its lease's TTL, or `None` when there is none.
    pub async fn get_node(&self, id: &str) -> Result<Option<NodeRecord>, LogError> {
        let mut kv = self.inner.kv.clone();
        let mut response = kv
            .get(self.inner.layout.node(id), None)
            .await
            .map_err(|e| self.inner.error(&e))?;
        let Some(mut record) = response
            .take_kvs()
            .into_iter()
            .next()
            .and_then(|kv| self.record(kv))
        else {
            return Ok(None);
        };
        record.ttl = self.lease_ttl(record.lease).await?;
        Ok(Some(record))
    }

    /// The changes to the nodes' documents after revision `from`. Unlike the object
    /// watch it does not reconnect by itself: it ends with the error.
    pub async fn watch_nodes(&self, from: Revision) -> Result<NodeStream, LogError> {
        let changes = self
            .watch_subtree(self.inner.layout.nodes(), from, "nodes'")
            .await?;
        let log = self.clone();
        Ok(Box::pin(changes.filter_map(move |change| {
            let change = match change {
                Err(e) => Some(Err(e)),
                Ok(KeyChange::Put(kv)) => log.record(kv).map(|r| Ok(NodeChange::Put(r))),
                Ok(KeyChange::Delete { key, revision }) => match log.inner.layout.parse(&key) {
                    Parsed::Node(id) => Some(Ok(NodeChange::Delete { id, revision })),
                    _ => None,
                },
            };
            std::future::ready(change)
        })))
    }

    /// A stored key-value as a node record (TTL not asked); `None` for a key under
    /// `nodes/` that is not `nodes/<id>`.
    fn record(&self, kv: etcd_client::KeyValue) -> Option<NodeRecord> {
        let Parsed::Node(id) = self.inner.layout.parse(kv.key()) else {
            return None;
        };
        if id.is_empty() || id.contains('/') {
            return None;
        }
        Some(NodeRecord {
            id,
            mod_revision: kv.mod_revision().max(0) as Revision,
            lease: kv.lease(),
            value: kv.value().to_vec(),
            ttl: None,
        })
    }

    /// The remaining and granted TTL of `lease`; `None` for no lease or one gone.
    async fn lease_ttl(&self, lease: i64) -> Result<Option<(i64, i64)>, LogError> {
        if lease == 0 {
            return Ok(None);
        }
        let mut client = self.inner.lease.clone();
        match client
            .time_to_live(lease, Some(LeaseTimeToLiveOptions::new()))
            .await
        {
            Ok(r) if r.ttl() >= 0 => Ok(Some((r.ttl(), r.granted_ttl()))),
            Ok(_) => Ok(None),
            Err(e) if lease_not_found(&e) => Ok(None),
            Err(e) => Err(self.inner.error(&e)),
        }
    }
}
