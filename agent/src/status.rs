//! What `rune-agent status` shows: mode, identity, readiness of each subsystem,
//! revision, object counts, and the services with their ports and backends.
//!
//! A node may carry 100,000 services: `status` is a summary that lists the services
//! only when there are at most [`SUMMARY_SERVICES`]; `status SERVICE` shows one and
//! `status --all` streams them all. The running agent answers through a
//! [`StatusSource`] ([`LiveStatus`]), whose summary costs the same whatever the
//! node carries and whose service list is one pass over the cache and the data
//! plane's ports. Without a running agent the CLI reads the store instead.
//!
//! Here the status's shape; where it comes from in `sources`, its text form in
//! `render`, the store link in [`store`].

use crate::{
    endpoints::{EndpointCache, ServiceView},
    model::ServiceKey,
    orderedlog::Revision,
};
use serde::{Deserialize, Serialize};
use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::Path,
};

mod render;
mod sources;
pub mod store;

pub use render::render_orphan;
pub use sources::{LiveStatus, StoreStatus};

/// The most services (and, apart, orphan endpoints) the summary lists; beyond it
/// they are counted only, and `status --all` or `status SERVICE` shows them. Twenty
/// services with ten backends each make ~250 lines: what still reads at a glance.
pub const SUMMARY_SERVICES: usize = 20;

/// The status document.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentStatus {
    /// Whether an agent answered (false: read from the store directly).
    pub running: bool,
    /// The state dir.
    pub state_dir: String,
    /// `production` or `dev`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// The data plane carrying services (`userspace`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataplane: Option<String>,
    /// Why this data plane (production: preflight's decision at start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataplane_reason: Option<String>,
    /// Preflight's checks at start (production mode).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preflight: Vec<crate::preflight::Check>,
    /// The kernel programs the data plane runs, one line each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub programs: Vec<String>,
    /// Each service's network policy as the data plane enforces it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<crate::policy::ServicePolicyStatus>,
    /// The ingress proxy's ACME certificates: host, issuer, expiry, last error.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub certificates: Vec<crate::ingress::AcmeCertStatus>,
    /// The ingress proxy's routes, with what keeps each from serving.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<crate::ingress::RouteStatus>,
    /// The embedded DNS server: `serving on ADDR, ...`, or `off: <reason>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<String>,
    /// Where the objects live: `embedded <path>` or `etcd <endpoints> (prefix …)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
    /// While the store does not answer: `since <time>, <why>` (the data plane
    /// serves the last state applied meanwhile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_disconnected: Option<String>,
    /// etcd keys skipped (not valid objects): how many, and the last with why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_skipped: Option<String>,
    /// The node's identity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeStatus>,
    /// Whether every subsystem reported ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<bool>,
    /// Which subsystems were not ready, when not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_error: Option<String>,
    /// Each subsystem's state, in start order.
    #[serde(default)]
    pub subsystems: Vec<SubsystemLine>,
    /// The last ordered-log revision applied (or stored).
    pub revision: Revision,
    /// Objects by kind.
    pub objects: BTreeMap<String, usize>,
    /// How many services the summary leaves out: all of them when there are more
    /// than [`SUMMARY_SERVICES`] (`status --all` lists them), else 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub services_omitted: usize,
    /// How many orphan endpoints the summary leaves out, likewise.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub orphans_omitted: usize,
    /// Services with their ports and backends.
    #[serde(default)]
    pub services: Vec<ServiceStatus>,
    /// Endpoints objects whose service does not exist.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub orphan_endpoints: Vec<String>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The node's identity, as status shows it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// Stable node id.
    pub node_id: String,
    /// Hostname.
    pub hostname: String,
    /// Labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// One subsystem's state.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SubsystemLine {
    /// Its name.
    pub name: String,
    /// `ready`, `starting`, `failed: ...`, ...
    pub state: String,
}

/// One service.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceStatus {
    /// `namespace/name`.
    pub service: String,
    /// Its VIPs.
    #[serde(default)]
    pub vips: Vec<String>,
    /// Headless (DNS only).
    #[serde(default)]
    pub headless: bool,
    /// `unknown` (no Endpoints object), or the endpoint count.
    pub endpoints: String,
    /// Each port, with the data plane's view of it when an agent runs.
    pub ports: Vec<PortStatus>,
    /// Each endpoint.
    pub backends: Vec<BackendStatus>,
}

/// One service port.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortStatus {
    /// Port name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// Service port.
    pub port: u16,
    /// `TCP`/`UDP`.
    pub protocol: String,
    /// Backend port before per-endpoint overrides.
    pub target_port: u16,
    /// Where the data plane serves it (e.g. `127.0.0.1:10080`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// `listening`, or `failed: <reason>`; absent without a running agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Traffic counters, where the data plane keeps them per port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<String>,
}

/// One endpoint of a service.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BackendStatus {
    /// Its address.
    pub address: String,
    /// Its node.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,
    /// `accepting` (gets new connections), `terminating` or `not-ready`.
    pub state: String,
    /// Its port for each service port (its override, else the target port), in the
    /// order of the service's ports: endpoints sharing an address differ here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    /// Traffic counters, where the data plane keeps them per backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<String>,
}

impl BackendStatus {
    /// How `status` names the endpoint: `ADDR:PORT` (`[ADDR]:PORT` for IPv6) when
    /// all its ports are one, `ADDR ports P,Q` when they differ, the address alone
    /// when the service has no port.
    fn endpoint(&self) -> String {
        let mut ports = self.ports.clone();
        ports.sort_unstable();
        ports.dedup();
        match (ports.as_slice(), self.address.parse::<IpAddr>()) {
            ([port], Ok(ip)) => SocketAddr::new(ip, *port).to_string(),
            ([], _) | ([_], Err(_)) => self.address.clone(),
            (many, _) => {
                let list: Vec<String> = many.iter().map(u16::to_string).collect();
                format!("{} ports {}", self.address, list.join(","))
            }
        }
    }
}

impl ServiceStatus {
    /// The status of a service from its cache view (ports without data plane state).
    pub fn from_view(view: &ServiceView) -> ServiceStatus {
        let s = &view.service;
        let backends = view
            .endpoints
            .iter()
            .flat_map(|e| e.spec.endpoints.iter())
            .map(|e| BackendStatus {
                address: e.address.to_string(),
                node: e.node.to_string(),
                state: if e.accepts_new() {
                    "accepting"
                } else if e.terminating {
                    "terminating"
                } else {
                    "not-ready"
                }
                .to_owned(),
                ports: s.spec.ports.iter().map(|p| e.port_for(p)).collect(),
                counters: None,
            })
            .collect();
        ServiceStatus {
            service: s.key().to_string(),
            vips: s
                .spec
                .discovery
                .vips
                .iter()
                .map(|v| v.to_string())
                .collect(),
            headless: s.spec.discovery.headless,
            endpoints: match &view.endpoints {
                None => "unknown".to_owned(),
                Some(e) => e.spec.endpoints.len().to_string(),
            },
            ports: s
                .spec
                .ports
                .iter()
                .map(|p| PortStatus {
                    name: p.name.clone(),
                    port: p.port,
                    protocol: p.protocol.to_string(),
                    target_port: p.target(),
                    listen: None,
                    state: None,
                    counters: None,
                })
                .collect(),
            backends,
        }
    }
}

/// Why a status could not be built.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// The store could not be read (no agent running).
    #[error(transparent)]
    Store(#[from] crate::orderedlog::LogError),
    /// A status document could not be read.
    #[error("reading the status document: {0}")]
    Document(String),
}

/// Where `status` comes from: the running agent ([`LiveStatus`]), the store when no
/// agent runs ([`StoreStatus`]), or an older agent's whole document.
pub trait StatusSource: Send + Sync {
    /// Everything but the services and orphan endpoints (both left empty): mode,
    /// identity, readiness, subsystems, revision, object counts. Costs the same
    /// whatever the node carries.
    fn summary(&self) -> Result<AgentStatus, StatusError>;

    /// The service `only`, or every service in key order, each with the data
    /// plane's view of its ports and backends, handed to `each` until it breaks.
    fn services(
        &self,
        only: Option<&ServiceKey>,
        each: &mut dyn FnMut(ServiceStatus) -> std::ops::ControlFlow<()>,
    ) -> Result<(), StatusError>;

    /// Endpoints objects whose service does not exist (`namespace/name`).
    fn orphans(&self) -> Result<Vec<String>, StatusError>;
}

/// What `rune-agent status` shows by default: the summary, with the services and
/// the orphan endpoints listed when there are at most [`SUMMARY_SERVICES`] of each
/// (`servicesOmitted`/`orphansOmitted` otherwise).
pub fn summarize(source: &dyn StatusSource) -> Result<AgentStatus, StatusError> {
    let mut st = source.summary()?;
    let services = st
        .objects
        .get(crate::model::Kind::Service.as_str())
        .copied()
        .unwrap_or(0);
    if services > SUMMARY_SERVICES {
        st.services_omitted = services;
    } else {
        let mut listed = Vec::new();
        source.services(None, &mut |s| {
            listed.push(s);
            if listed.len() > SUMMARY_SERVICES {
                std::ops::ControlFlow::Break(())
            } else {
                std::ops::ControlFlow::Continue(())
            }
        })?;
        if listed.len() > SUMMARY_SERVICES {
            // More than counted a moment ago: an apply in between.
            st.services_omitted = services.max(listed.len());
        } else {
            st.services = listed;
        }
    }
    let orphans = source.orphans()?;
    if orphans.len() > SUMMARY_SERVICES {
        st.orphans_omitted = orphans.len();
    } else {
        st.orphan_endpoints = orphans;
    }
    Ok(st)
}

/// The whole status document, every service and orphan listed: what the unary
/// `Status` call of older CLIs gets.
pub fn whole(source: &dyn StatusSource) -> Result<AgentStatus, StatusError> {
    let mut st = source.summary()?;
    source.services(None, &mut |s| {
        st.services.push(s);
        std::ops::ControlFlow::Continue(())
    })?;
    st.orphan_endpoints = source.orphans()?;
    Ok(st)
}

impl AgentStatus {
    /// What the cache alone says: revision, object counts, services with their
    /// endpoints (no data plane state) and orphan endpoints.
    pub fn from_cache(state_dir: &Path, cache: &EndpointCache) -> AgentStatus {
        let c = cache.summary();
        AgentStatus {
            running: false,
            state_dir: state_dir.display().to_string(),
            revision: c.revision,
            objects: counts(c.counts),
            services: c.views.iter().map(ServiceStatus::from_view).collect(),
            orphan_endpoints: c.orphans.iter().map(|k| k.to_string()).collect(),
            ..AgentStatus::default()
        }
    }
}

fn counts(by_kind: BTreeMap<crate::model::Kind, usize>) -> BTreeMap<String, usize> {
    by_kind
        .into_iter()
        .map(|(k, n)| (k.to_string(), n))
        .collect()
}

#[cfg(test)]
mod tests;
