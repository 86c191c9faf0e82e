//! Where a status comes from: the running agent ([`LiveStatus`]) or, without one,
//! the store ([`StoreStatus`]).

use super::{
    AgentStatus, NodeStatus, ServiceStatus, StatusError, StatusSource, SubsystemLine, counts, store,
};
use crate::{
    agent::Agent,
    dataplane::{DataPlane, PortState, ServicePortStatus, TrafficCounters},
    dns::DnsState,
    endpoints::{EndpointCache, ServiceView},
    model::ServiceKey,
    orderedlog::embedded::EmbeddedLog,
};
use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::{Arc, Weak},
};

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
    /// The ingress proxy's routes, when the ingress runs.
    pub routes: Option<Arc<dyn Fn() -> Vec<crate::ingress::RouteStatus> + Send + Sync>>,
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
            routes: self.routes.as_ref().map(|f| f()).unwrap_or_default(),
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

/// The data plane's ports, indexed for [`PlaneIndex::annotate`]: one pass over
/// them, then a lookup per port and backend (a search per port was quadratic, and
/// 100,000 services took minutes).
pub(super) struct PlaneIndex<'a> {
    /// (service, port, protocol) → the first port status so named.
    ports: HashMap<(&'a str, u16, &'static str), &'a ServicePortStatus>,
    /// (service, backend socket address) → that backend's counters at the first
    /// port of the service that lists it (a backend's counters are shared by the
    /// service ports leading to it).
    backends: HashMap<(&'a str, SocketAddr), Option<TrafficCounters>>,
}

impl<'a> PlaneIndex<'a> {
    pub(super) fn new(ports: &'a [ServicePortStatus]) -> Self {
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
    pub(super) fn annotate(&self, s: &mut ServiceStatus) {
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
