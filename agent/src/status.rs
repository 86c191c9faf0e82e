//! What `rune-agent status` shows: mode, identity, readiness of each subsystem,
//! revision, and every service with its ports and backends.
//!
//! The running agent builds an [`AgentStatus`] and sends it over the local API as
//! JSON; without a running agent the CLI builds a smaller one from the store.

use crate::{
    endpoints::{EndpointCache, ServiceView},
    orderedlog::{Revision, embedded::EmbeddedLog},
};
use serde::{Deserialize, Serialize};
use std::{collections::BTreeMap, fmt::Write as _, path::Path};

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
    /// The embedded DNS server: `serving on ADDR, ...`, or `off: <reason>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<String>,
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
    /// Services with their ports and backends.
    pub services: Vec<ServiceStatus>,
    /// Endpoints objects whose service does not exist.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub orphan_endpoints: Vec<String>,
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
    /// Traffic counters, where the data plane keeps them per backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<String>,
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

impl AgentStatus {
    /// The status readable without an agent: the store's revision and objects.
    pub fn from_store(state_dir: &Path, store: &EmbeddedLog) -> anyhow::Result<AgentStatus> {
        let (revision, objects) = store.get(None, None, None)?;
        let cache = EndpointCache::new();
        cache.apply_snapshot(&crate::orderedlog::Snapshot { revision, objects });
        Ok(AgentStatus::from_cache(state_dir, &cache))
    }

    /// What the cache alone says: revision, object counts, services with their
    /// endpoints (no data plane state) and orphan endpoints.
    pub fn from_cache(state_dir: &Path, cache: &EndpointCache) -> AgentStatus {
        let c = cache.summary();
        AgentStatus {
            running: false,
            state_dir: state_dir.display().to_string(),
            revision: c.revision,
            objects: c
                .counts
                .into_iter()
                .map(|(k, n)| (k.to_string(), n))
                .collect(),
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
        if let Some(d) = &self.dns {
            writeln!(o, "dns:        {d}")?;
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
        writeln!(o, "services:")?;
        if self.services.is_empty() {
            writeln!(o, "  (none)")?;
        }
        for s in &self.services {
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
                write!(o, "    backend {}  {}", b.address, b.state)?;
                if !b.node.is_empty() {
                    write!(o, "  (node {})", b.node)?;
                }
                if let Some(c) = &b.counters {
                    write!(o, "  ({c})")?;
                }
                writeln!(o)?;
            }
        }
        for e in &self.orphan_endpoints {
            writeln!(o, "  {e}: no such service")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preflight::{Check, DataplaneMode};

    #[test]
    fn render_shows_the_data_plane_reason_and_failed_preflight_checks() {
        let st = AgentStatus {
            running: true,
            dataplane: Some("nftables".into()),
            dataplane_reason: Some("auto: ebpf unavailable: btf (missing)".into()),
            preflight: vec![
                Check::new("btf", false, "missing", &[DataplaneMode::Ebpf]),
                Check::new("nft", true, "nftables v1.0.6", &[DataplaneMode::Nftables]),
            ],
            ..AgentStatus::default()
        };
        let text = st.render();
        assert!(
            text.contains("data plane: nftables (auto: ebpf unavailable: btf (missing))\n"),
            "{text}"
        );
        assert!(
            text.contains("preflight:  1 of 2 checks passed\n"),
            "{text}"
        );
        assert!(text.contains("  failed btf: missing\n"), "{text}");
        assert!(!text.contains("failed nft"), "{text}");
        let json = serde_json::to_value(&st).unwrap();
        assert_eq!(
            json["dataplaneReason"],
            "auto: ebpf unavailable: btf (missing)"
        );
        assert_eq!(json["preflight"][0]["neededBy"][0], "ebpf");
        let back: AgentStatus = serde_json::from_value(json).unwrap();
        assert_eq!(back, st);
    }
}
