//! What `rune-agent status` shows: mode, identity, readiness of each subsystem,
//! revision, object counts, and the services with their ports and backends.
//!
//! A node may carry 100,000 services: `status` is a summary that lists the services
//! only when there are at most [`SUMMARY_SERVICES`]; `status SERVICE` shows one and
//! `status --all` streams them all. The running agent answers through a
//! [`StatusSource`] ([`LiveStatus`]), whose summary costs the same whatever the
//! node carries and whose service list is one pass over the cache and the data
//! plane's ports. Without a running agent the CLI reads the store instead.

use crate::{
    agent::Agent,
    dataplane::{DataPlane, PortState, ServicePortStatus, TrafficCounters},
    dns::DnsState,
    endpoints::{EndpointCache, ServiceView},
    model::ServiceKey,
    orderedlog::{Revision, embedded::EmbeddedLog},
};
use serde::{Deserialize, Serialize};
use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::{Arc, Weak},
};

pub mod store;

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

/// The running agent's status: the cache, the data plane, DNS and the agent's
/// subsystems.
pub struct LiveStatus {
    /// The agent (readiness, identity, subsystems); weak, so that status does not
    /// keep a stopping agent alive.
    pub agent: Weak<Agent>,
    /// The endpoint cache: revision, counts, services.
    pub cache: Arc<EndpointCache>,
    /// The data plane: mode, programs, each port's state and counters.
    pub plane: Arc<dyn DataPlane>,
    /// The DNS server's state.
    pub dns: Arc<dyn Fn() -> DnsState + Send + Sync>,
    /// The ingress proxy's ACME certificates, when the ingress runs.
    pub acme: Option<Arc<dyn Fn() -> Vec<crate::ingress::AcmeCertStatus> + Send + Sync>>,
    /// The state dir.
    pub state_dir: PathBuf,
    /// Why this data plane (production: preflight's decision at start).
    pub dataplane_reason: Option<String>,
    /// Preflight's checks at start (production mode).
    pub preflight: Vec<crate::preflight::Check>,
    /// The store: which, whether it answers, skipped keys.
    pub store: Arc<store::StoreLink>,
}

impl StatusSource for LiveStatus {
    fn summary(&self) -> Result<AgentStatus, StatusError> {
        let mut st = AgentStatus {
            running: true,
            state_dir: self.state_dir.display().to_string(),
            dataplane: Some(self.plane.mode().to_owned()),
            dataplane_reason: self.dataplane_reason.clone(),
            preflight: self.preflight.clone(),
            programs: self.plane.programs(),
            policies: self.plane.policy(),
            dns: Some((self.dns)().to_string()),
            certificates: self.acme.as_ref().map(|f| f()).unwrap_or_default(),
            revision: self.cache.revision(),
            objects: counts(self.cache.counts()),
            ..AgentStatus::default()
        };
        let store = self.store.state();
        st.store = Some(store.backend);
        st.store_disconnected = store.disconnected;
        st.store_skipped = store.skipped;
        if let Some(agent) = self.agent.upgrade() {
            let id = agent.identity();
            st.mode = Some(agent.mode().to_string());
            st.node = Some(NodeStatus {
                node_id: id.node_id.clone(),
                hostname: id.hostname.clone(),
                labels: id.labels.clone(),
            });
            st.ready = Some(agent.readiness().is_ready());
            st.ready_error = agent.ready_err().map(|e| e.to_string());
            st.subsystems = agent
                .subsystems()
                .into_iter()
                .map(|s| SubsystemLine {
                    name: s.name,
                    state: s.state.to_string(),
                })
                .collect();
        }
        Ok(st)
    }

    fn services(
        &self,
        only: Option<&ServiceKey>,
        each: &mut dyn FnMut(ServiceStatus) -> std::ops::ControlFlow<()>,
    ) -> Result<(), StatusError> {
        let views = match only {
            Some(key) => self.cache.view(key).into_iter().collect(),
            None => self.cache.views(),
        };
        if views.is_empty() {
            return Ok(());
        }
        let ports = self.plane.status();
        let plane = PlaneIndex::new(&ports);
        for view in &views {
            let mut s = ServiceStatus::from_view(view);
            plane.annotate(&mut s);
            if each(s).is_break() {
                break;
            }
        }
        Ok(())
    }

    fn orphans(&self) -> Result<Vec<String>, StatusError> {
        Ok(self
            .cache
            .orphan_endpoints()
            .iter()
            .map(|k| k.to_string())
            .collect())
    }
}

fn counts(by_kind: BTreeMap<crate::model::Kind, usize>) -> BTreeMap<String, usize> {
    by_kind
        .into_iter()
        .map(|(k, n)| (k.to_string(), n))
        .collect()
}

/// The data plane's ports, indexed for [`PlaneIndex::annotate`]: one pass over
/// them, then a lookup per port and backend (a search per port was quadratic, and
/// 100,000 services took minutes).
struct PlaneIndex<'a> {
    /// (service, port, protocol) → the first port status so named.
    ports: HashMap<(&'a str, u16, &'static str), &'a ServicePortStatus>,
    /// (service, backend socket address) → that backend's counters at the first
    /// port of the service that lists it (a backend's counters are shared by the
    /// service ports leading to it).
    backends: HashMap<(&'a str, SocketAddr), Option<TrafficCounters>>,
}

impl<'a> PlaneIndex<'a> {
    fn new(ports: &'a [ServicePortStatus]) -> Self {
        let mut index = PlaneIndex {
            ports: HashMap::with_capacity(ports.len()),
            backends: HashMap::new(),
        };
        for d in ports {
            index
                .ports
                .entry((d.service.as_str(), d.port, d.protocol.as_str()))
                .or_insert(d);
            for b in &d.backends {
                index
                    .backends
                    .entry((d.service.as_str(), SocketAddr::new(b.address, b.port)))
                    .or_insert(b.counters);
            }
        }
        index
    }

    /// Fills in the data plane's state of `s`'s ports and its backends' counters.
    fn annotate(&self, s: &mut ServiceStatus) {
        for p in &mut s.ports {
            if let Some(dp) = self
                .ports
                .get(&(s.service.as_str(), p.port, p.protocol.as_str()))
            {
                p.listen = dp.listen.map(|a| a.to_string());
                p.state = Some(match &dp.state {
                    PortState::Listening => "listening".to_owned(),
                    PortState::Failed { reason } => format!("failed: {reason}"),
                });
                p.counters = dp.counters.map(|c| c.to_string());
            }
        }
        for b in &mut s.backends {
            let Ok(address) = b.address.parse::<IpAddr>() else {
                continue;
            };
            // The sum over the endpoint's own socket addresses, each once: endpoints
            // sharing an address are told apart by their ports.
            let mut ports = b.ports.clone();
            ports.sort_unstable();
            ports.dedup();
            b.counters = ports
                .iter()
                .filter_map(|port| {
                    let key = (s.service.as_str(), SocketAddr::new(address, *port));
                    self.backends.get(&key).copied().flatten()
                })
                .reduce(|sum, c| sum + c)
                .map(|c| c.to_string());
        }
    }
}

/// The status readable without an agent: the store's revision and objects.
pub struct StoreStatus<'a> {
    /// The state dir.
    pub state_dir: &'a Path,
    /// The store, opened by the CLI.
    pub store: &'a EmbeddedLog,
}

impl StoreStatus<'_> {
    fn view(&self, key: &ServiceKey) -> Result<Option<ServiceView>, StatusError> {
        use crate::model::{Kind, Object};
        let one = |kind| {
            self.store
                .get(Some(kind), Some(&key.namespace), Some(&key.name))
                .map(|(_, mut v)| v.pop())
        };
        let Some(Object::Service(service)) = one(Kind::Service)? else {
            return Ok(None);
        };
        let endpoints = match one(Kind::Endpoints)? {
            Some(Object::Endpoints(e)) => Some(Arc::new(e)),
            _ => None,
        };
        Ok(Some(ServiceView {
            service: Arc::new(service),
            endpoints,
        }))
    }
}

impl StatusSource for StoreStatus<'_> {
    fn summary(&self) -> Result<AgentStatus, StatusError> {
        let (revision, by_kind) = self.store.count()?;
        Ok(AgentStatus {
            running: false,
            state_dir: self.state_dir.display().to_string(),
            revision,
            objects: counts(by_kind),
            ..AgentStatus::default()
        })
    }

    fn services(
        &self,
        only: Option<&ServiceKey>,
        each: &mut dyn FnMut(ServiceStatus) -> std::ops::ControlFlow<()>,
    ) -> Result<(), StatusError> {
        if let Some(key) = only {
            if let Some(view) = self.view(key)? {
                let _ = each(ServiceStatus::from_view(&view));
            }
            return Ok(());
        }
        let (revision, objects) = self.store.get(None, None, None)?;
        let cache = EndpointCache::new();
        cache.apply_snapshot(&crate::orderedlog::Snapshot { revision, objects });
        for view in cache.views() {
            if each(ServiceStatus::from_view(&view)).is_break() {
                break;
            }
        }
        Ok(())
    }

    fn orphans(&self) -> Result<Vec<String>, StatusError> {
        Ok(self
            .store
            .orphan_endpoints()?
            .iter()
            .map(|k| k.to_string())
            .collect())
    }
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

    /// The human-readable form.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let _ = self.render_into(&mut o);
        o
    }

    fn render_into(&self, o: &mut String) -> std::fmt::Result {
        self.render_head_into(o)?;
        if self.services_omitted > 0 {
            writeln!(
                o,
                "  {} services, not listed (more than {SUMMARY_SERVICES}): `rune-agent status --all` lists them, `rune-agent status NAME` shows one",
                self.services_omitted
            )?;
        } else if self.services.is_empty() {
            writeln!(o, "  (none)")?;
        }
        for s in &self.services {
            o.push_str(&s.render());
        }
        o.push_str(&self.render_orphans());
        Ok(())
    }

    fn render_head_into(&self, o: &mut String) -> std::fmt::Result {
        if self.running {
            writeln!(o, "agent:      running")?;
        } else {
            writeln!(o, "agent:      not running (read from the store)")?;
        }
        writeln!(o, "state dir:  {}", self.state_dir)?;
        if let Some(m) = &self.mode {
            writeln!(o, "mode:       {m}")?;
        }
        if let Some(d) = &self.dataplane {
            match &self.dataplane_reason {
                Some(why) => writeln!(o, "data plane: {d} ({why})")?,
                None => writeln!(o, "data plane: {d}")?,
            }
        }
        if !self.preflight.is_empty() {
            let failed: Vec<&crate::preflight::Check> =
                self.preflight.iter().filter(|c| !c.passed).collect();
            writeln!(
                o,
                "preflight:  {} of {} checks passed",
                self.preflight.len() - failed.len(),
                self.preflight.len()
            )?;
            for c in failed {
                writeln!(o, "  failed {}: {}", c.name, c.detail)?;
            }
        }
        for (i, p) in self.programs.iter().enumerate() {
            let label = if i == 0 { "programs:" } else { "" };
            writeln!(o, "{label:12}{p}")?;
        }
        for (i, p) in self.policies.iter().enumerate() {
            let label = if i == 0 { "policies:" } else { "" };
            writeln!(o, "{label:12}{p}")?;
        }
        if let Some(d) = &self.dns {
            writeln!(o, "dns:        {d}")?;
        }
        for (i, c) in self.certificates.iter().enumerate() {
            let label = if i == 0 { "certs:" } else { "" };
            writeln!(o, "{label:12}{c}")?;
        }
        if let Some(s) = &self.store {
            writeln!(o, "store:      {s}")?;
        }
        if let Some(down) = &self.store_disconnected {
            writeln!(o, "            StoreDisconnected {down}")?;
        }
        if let Some(skipped) = &self.store_skipped {
            writeln!(o, "            {skipped}")?;
        }
        if let Some(n) = &self.node {
            writeln!(o, "node:       {} ({})", n.node_id, n.hostname)?;
        }
        if let Some(r) = self.ready {
            match &self.ready_error {
                Some(e) if !r => writeln!(o, "ready:      no ({e})")?,
                _ => writeln!(o, "ready:      {}", if r { "yes" } else { "no" })?,
            }
        }
        writeln!(o, "revision:   {}", self.revision)?;
        let objects: Vec<String> = self
            .objects
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(o, "objects:    {}", objects.join(", "))?;
        if !self.subsystems.is_empty() {
            writeln!(o, "subsystems:")?;
            let w = self
                .subsystems
                .iter()
                .map(|s| s.name.len())
                .max()
                .unwrap_or(0);
            for s in &self.subsystems {
                writeln!(o, "  {:w$}  {}", s.name, s.state)?;
            }
        }
        writeln!(o, "services:")
    }

    /// The text form's lines up to and including `services:`: what `status --all`
    /// prints before it streams the services.
    pub fn render_head(&self) -> String {
        let mut o = String::new();
        let _ = self.render_head_into(&mut o);
        o
    }

    /// The text form's orphan endpoint lines (after the services).
    pub fn render_orphans(&self) -> String {
        let mut o = String::new();
        for e in &self.orphan_endpoints {
            o.push_str(&render_orphan(e));
        }
        if self.orphans_omitted > 0 {
            let _ = writeln!(
                o,
                "  {} endpoints objects without a service, not listed (more than {SUMMARY_SERVICES}): `rune-agent status --all` lists them",
                self.orphans_omitted
            );
        }
        o
    }
}

/// The text line of an orphan endpoints object (`Endpoints namespace/name`).
pub fn render_orphan(e: &str) -> String {
    format!("  {e}: no such service\n")
}

impl ServiceStatus {
    /// The text form of one service: its line, then one line per port and backend.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let _ = self.render_into(&mut o);
        o
    }

    fn render_into(&self, o: &mut String) -> std::fmt::Result {
        let s = self;
        let vips = if s.headless {
            "headless".to_owned()
        } else if s.vips.is_empty() {
            "no VIP".to_owned()
        } else {
            s.vips.join(", ")
        };
        writeln!(o, "  {}  [{vips}]  endpoints: {}", s.service, s.endpoints)?;
        for p in &s.ports {
            write!(o, "    {}/{} -> {}", p.port, p.protocol, p.target_port)?;
            if let Some(l) = &p.listen {
                write!(o, "  on {l}")?;
            }
            if let Some(st) = &p.state {
                write!(o, "  {st}")?;
            }
            if let Some(c) = &p.counters {
                write!(o, "  ({c})")?;
            }
            writeln!(o)?;
        }
        for b in &s.backends {
            write!(o, "    backend {}  {}", b.endpoint(), b.state)?;
            if !b.node.is_empty() {
                write!(o, "  (node {})", b.node)?;
            }
            if let Some(c) = &b.counters {
                write!(o, "  ({c})")?;
            }
            writeln!(o)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
