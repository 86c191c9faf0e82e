//! This node as the cluster sees it: a document under `<prefix>nodes/<node-id>` in
//! etcd, held by a lease the agent keeps alive (the heartbeat), so that the key
//! exists exactly while the agent runs.
//!
//! * [`NodeDocument`]: what the key holds (JSON, camelCase): identity, addresses,
//!   facts, conditions, the applied revision, and when it was written.
//! * [`facts`]: what the node is (kernel, CPUs, memory, data plane), gathered from
//!   the host and from the agent through a [`facts::FactsSource`].
//! * [`conditions`]: `Ready`, `DataplaneDegraded`, `StoreDisconnected`,
//!   `MapPressure`, `MemoryPressure`, `DiskPressure`, each with the time of its last
//!   transition.
//! * [`registrar`]: the `node` subsystem that keeps the key.
//! * [`drain`]: the admin's drain records (`<prefix>drains/<node-id>`), and
//!   [`drain_follower`], the `drains` subsystem that hands them to the endpoint
//!   cache.
//!
//! The user-facing description is the "Nodes" section of docs/etcd.md.

pub mod conditions;
pub mod drain;
pub mod drain_follower;
pub mod facts;
pub mod registrar;
pub mod time;

pub use time::{Timestamp, format_age};

use crate::orderedlog::Revision;
use conditions::Condition;
use facts::Facts;
use serde::{Deserialize, Serialize};
use std::{collections::BTreeMap, net::IpAddr};

/// A node's document, as stored under `nodes/<node-id>`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeDocument {
    /// Who the node is.
    pub identity: NodeIdentity,
    /// The node's addresses (every non-loopback interface address).
    pub addresses: Vec<IpAddr>,
    /// What the node is and runs.
    pub facts: Facts,
    /// The node's conditions, in a fixed order (see [`conditions::ALL`]).
    pub conditions: Vec<Condition>,
    /// The highest log revision whose effect is in the node's kernel
    /// ([`crate::applied`]).
    pub applied_revision: Revision,
    /// When the document was last written. Only changes are written: the lease's
    /// keep-alives are the heartbeat (a key whose lease lapsed is gone).
    pub heartbeat_time: Timestamp,
}

/// The node's identity ([`crate::identity::Identity`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeIdentity {
    /// The node id: the key's last segment.
    pub id: String,
    /// The host name.
    pub hostname: String,
    /// Operator-set labels (may be empty).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

impl NodeDocument {
    /// The condition `kind`, if present.
    pub fn condition(&self, kind: conditions::Kind) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.kind == kind)
    }

    /// Whether the node says it is Ready.
    pub fn is_ready(&self) -> bool {
        self.condition(conditions::Kind::Ready)
            .is_some_and(|c| c.status == conditions::Status::True)
    }

    /// The document without its write time: two documents that differ only there
    /// need not be written.
    fn content(&self) -> (&NodeIdentity, &[IpAddr], &Facts, &[Condition], Revision) {
        (
            &self.identity,
            &self.addresses,
            &self.facts,
            &self.conditions,
            self.applied_revision,
        )
    }

    /// Whether `self` says something `other` does not (the write time aside).
    pub fn differs_from(&self, other: &NodeDocument) -> bool {
        self.content() != other.content()
    }

    /// Parses a stored document, saying which node's it is when it is not one.
    pub fn parse(id: &str, bytes: &[u8]) -> Result<NodeDocument, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("node {id}: not a node document: {e}"))
    }
}
