//! The data planes: what carries services out on this node, and the trait they share.
//!
//! A data plane takes [`Delta`]s from the endpoint cache (the whole state first, then
//! only what changed) and makes connections to each service port land on one of its
//! ready endpoints. [`ebpf`] does it in the kernel; [`proxy`] in userspace (dev mode,
//! and the last-resort fallback). Whatever the mode, `status` shows each service
//! port the same way, and a port that fails never stops the others.

pub mod ebpf;
pub mod leftovers;
pub mod nftables;
pub mod proxy;
pub mod reconciler;
pub mod vip;

use crate::{endpoints::Delta, model::Protocol};
use async_trait::async_trait;
use serde::Serialize;
use std::net::{IpAddr, SocketAddr};

/// What every data plane offers the agent: take in changes, report, stop.
#[async_trait]
pub trait DataPlane: Send + Sync {
    /// The mode's stable name, as in `status` and the metrics (`userspace`, `ebpf`).
    fn mode(&self) -> &'static str;

    /// Brings the data plane to the state `delta` describes (with `delta.full`,
    /// dropping every service not in it). Per-port problems (a port that cannot be
    /// bound) are not errors: they show in [`status`](Self::status) and are retried.
    async fn apply(&self, delta: &Delta) -> Result<(), DataPlaneError>;

    /// Every service port handled, ordered by service and port.
    fn status(&self) -> Vec<ServicePortStatus>;

    /// The kernel programs the data plane runs, one line each (`status` shows them).
    fn programs(&self) -> Vec<String> {
        Vec::new()
    }

    /// Each service with a network policy and how this data plane enforces it
    /// (`status` shows them); empty where the mode has no policy support yet.
    fn policy(&self) -> Vec<crate::policy::ServicePolicyStatus> {
        Vec::new()
    }

    /// The data plane's fixed-size maps with their capacity and fill (`count` says
    /// whether the flow tables are walked too); `None` where the mode keeps no
    /// fixed-size maps (nftables and the userspace proxies grow as needed).
    fn maps(&self, count: MapCount) -> Option<Vec<MapUsage>> {
        let _ = count;
        None
    }

    /// Stops everything the data plane runs and waits until it has stopped.
    async fn shutdown(&self);
}

/// How much of a data plane's maps [`DataPlane::maps`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapCount {
    /// Only the maps whose fill the data plane knows from its own bookkeeping
    /// (cheap: asked after every change).
    Tables,
    /// Those and the flow tables, whose entries the kernel adds and evicts: their
    /// keys are walked (bounded by their capacity; asked with the facts).
    WithFlows,
}

/// One fixed-size map of a data plane: how many entries it holds and can hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapUsage {
    /// The map's name in the node's facts (`frontends`, `conntrack_v4`).
    pub name: &'static str,
    /// Entries it can hold.
    pub capacity: u64,
    /// Entries it holds; `None` when counting them failed.
    pub used: Option<u64>,
}

/// One service port as the `status` command shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ServicePortStatus {
    /// `namespace/name`.
    pub service: String,
    /// The service port (before any dev-mode offset).
    pub port: u16,
    /// TCP or UDP.
    pub protocol: Protocol,
    /// Where connections are taken: the proxy's listening address; `None` when the
    /// port has none (its listen port is out of range).
    pub listen: Option<SocketAddr>,
    /// Whether the port is carried out.
    pub state: PortState,
    /// False when no Endpoints object exists for the service ("unknown"); true with
    /// an empty `backends` means "known, no backends: refuse".
    pub endpoints_known: bool,
    /// The service's endpoints for this port.
    pub backends: Vec<BackendStatus>,
    /// Traffic through the port, where the data plane counts it per port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub counters: Option<TrafficCounters>,
}

/// Traffic counters of a service port or backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TrafficCounters {
    /// New flows (connections, UDP flows).
    pub flows: u64,
    /// Packets translated in the kernel (0 where sockets are rewritten instead).
    pub packets: u64,
    /// Bytes of those packets.
    pub bytes: u64,
}

/// Whether a service port is carried out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum PortState {
    /// Connections are taken.
    Listening,
    /// They are not, for `reason` (e.g. the OS's bind error); retried.
    Failed {
        /// Why, in words a user can act on.
        reason: String,
    },
}

/// One endpoint of a service port, as `status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BackendStatus {
    /// The endpoint's address.
    pub address: IpAddr,
    /// The port connections go to (the endpoint's override or the target port).
    pub port: u16,
    /// The node the endpoint runs on (empty when unknown).
    pub node: String,
    /// Whether it gets new connections.
    pub state: BackendState,
    /// Traffic to the backend, where the data plane counts it per backend.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub counters: Option<TrafficCounters>,
}

/// Whether an endpoint gets new connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendState {
    /// Ready and eligible for new connections (subject to locality preference).
    Active,
    /// Terminating: keeps the connections it has, gets no new ones.
    Terminating,
    /// Not ready: gets no new connections.
    NotReady,
}

impl std::ops::Add for TrafficCounters {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            flows: self.flows.saturating_add(other.flows),
            packets: self.packets.saturating_add(other.packets),
            bytes: self.bytes.saturating_add(other.bytes),
        }
    }
}

impl std::fmt::Display for TrafficCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "flows {}, packets {}, bytes {}",
            self.flows, self.packets, self.bytes
        )
    }
}

impl BackendState {
    /// The state of `endpoint` as the data planes treat it.
    #[must_use]
    pub fn of(endpoint: &crate::model::Endpoint) -> Self {
        if endpoint.accepts_new() {
            Self::Active
        } else if endpoint.terminating {
            Self::Terminating
        } else {
            Self::NotReady
        }
    }
}

/// Why a data plane could not be built or could not take a delta in.
#[derive(Debug, thiserror::Error)]
pub enum DataPlaneError {
    /// A configuration value is unusable.
    #[error("invalid data plane configuration: {field}: {reason}")]
    InvalidConfig {
        /// The configuration field.
        field: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// The kernel programs could not be loaded or attached.
    #[error(transparent)]
    Ebpf(#[from] ebpf::EbpfError),
    /// A change could not be carried out (retried with a full resync).
    #[error("the {mode} data plane could not apply the change: {reason}")]
    Apply {
        /// The data plane's mode.
        mode: &'static str,
        /// Why.
        reason: String,
    },
    /// The data plane was shut down and takes no more changes.
    #[error("the {mode} data plane is shut down")]
    ShutDown {
        /// The data plane's mode.
        mode: &'static str,
    },
}
