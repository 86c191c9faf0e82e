//! `kind: Service`: VIPs, ports, session affinity and drain time.

use super::{Metadata, ModelError, check_dns_label};
use serde::{Deserialize, Serialize};
use std::{collections::HashSet, fmt, net::IpAddr};

/// A load-balanced service.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Service {
    /// Name, namespace and labels.
    pub metadata: Metadata,
    /// What the service offers.
    pub spec: ServiceSpec,
}

/// The body of a [`Service`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ServiceSpec {
    /// The ports the service listens on.
    #[serde(default, deserialize_with = "super::exact_vec")]
    pub ports: Vec<ServicePort>,
    /// VIPs and how clients find the service.
    #[serde(default)]
    pub discovery: Discovery,
    /// Whether one client keeps its backend.
    #[serde(default)]
    pub session_affinity: SessionAffinity,
    /// How long terminating endpoints keep their established flows.
    #[serde(default = "default_drain_seconds")]
    pub drain_seconds: u32,
    /// Who may reach the endpoints and what they may reach; none: no restriction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<super::NetworkPolicy>,
}

fn default_drain_seconds() -> u32 {
    30
}

/// Longest accepted `drainSeconds` (one hour).
pub const MAX_DRAIN_SECONDS: u32 = 3600;

/// One port of a service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ServicePort {
    /// Port name (a DNS label); required when a service has several ports, since
    /// endpoints override target ports by name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// The port clients connect to.
    pub port: u16,
    /// Transport protocol; TCP when omitted.
    #[serde(default)]
    pub protocol: Protocol,
    /// The backends' port; `port` when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_port: Option<u16>,
}

impl ServicePort {
    /// The backend port for this service port, before per-endpoint overrides.
    pub fn target(&self) -> u16 {
        self.target_port.unwrap_or(self.port)
    }
}

/// Transport protocol of a service port.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum Protocol {
    /// TCP.
    #[default]
    #[serde(rename = "TCP")]
    Tcp,
    /// UDP.
    #[serde(rename = "UDP")]
    Udp,
}

impl Protocol {
    /// `TCP` or `UDP`, as in documents and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How clients find a service.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Discovery {
    /// Virtual IPs, at most one per address family.
    #[serde(
        default,
        deserialize_with = "super::exact_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub vips: Vec<IpAddr>,
    /// Whether to prefer or require endpoints on this node.
    #[serde(default)]
    pub locality_preference: LocalityPreference,
    /// Headless: DNS returns the endpoints themselves and there is no VIP.
    #[serde(default)]
    pub headless: bool,
}

/// Whether backends on the client's own node are preferred.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum LocalityPreference {
    /// Any ready endpoint.
    #[default]
    #[serde(rename = "")]
    Any,
    /// Endpoints on this node when there are any, else any.
    #[serde(rename = "prefer-local")]
    PreferLocal,
    /// Only endpoints on this node.
    #[serde(rename = "local-only")]
    LocalOnly,
}

/// Whether a client keeps its backend across connections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", deny_unknown_fields)]
pub enum SessionAffinity {
    /// Every connection is balanced on its own.
    #[default]
    None,
    /// Connections from one client IP go to one backend for `timeout_seconds` after
    /// its last use.
    #[serde(rename = "ClientIP", rename_all = "camelCase")]
    ClientIp {
        /// Idle time after which the client may move; 10800 (3 h) when omitted.
        #[serde(default = "default_affinity_timeout")]
        timeout_seconds: u32,
    },
}

fn default_affinity_timeout() -> u32 {
    10800
}

/// Longest accepted ClientIP affinity timeout (one day).
pub const MAX_AFFINITY_TIMEOUT_SECONDS: u32 = 86400;

impl Service {
    /// The service's key.
    pub fn key(&self) -> super::ServiceKey {
        super::ServiceKey::new(&self.metadata.namespace, &self.metadata.name)
    }

    pub(super) fn validate(&self, object: &str) -> Result<(), ModelError> {
        let spec = &self.spec;
        if spec.ports.is_empty() && !spec.discovery.headless {
            return Err(ModelError::invalid(
                object,
                "spec.ports",
                "must list at least one port (only headless services may have none)",
            ));
        }
        let mut seen_ports = HashSet::new();
        let mut seen_names = HashSet::new();
        for (i, p) in spec.ports.iter().enumerate() {
            let field = |f: &str| format!("spec.ports[{i}].{f}");
            if p.port == 0 {
                return Err(ModelError::invalid(
                    object,
                    field("port"),
                    "port 0 is out of range 1-65535",
                ));
            }
            if p.target_port == Some(0) {
                return Err(ModelError::invalid(
                    object,
                    field("targetPort"),
                    "port 0 is out of range 1-65535",
                ));
            }
            if !seen_ports.insert((p.port, p.protocol)) {
                return Err(ModelError::invalid(
                    object,
                    field("port"),
                    format!("duplicate port {}/{}", p.port, p.protocol),
                ));
            }
            if p.name.is_empty() {
                if spec.ports.len() > 1 {
                    return Err(ModelError::invalid(
                        object,
                        field("name"),
                        "every port needs a name when a service has several ports",
                    ));
                }
            } else {
                check_dns_label(object, &field("name"), &p.name)?;
                if !seen_names.insert(p.name.as_str()) {
                    return Err(ModelError::invalid(
                        object,
                        field("name"),
                        format!("duplicate port name {:?}", p.name),
                    ));
                }
            }
        }
        let d = &spec.discovery;
        if d.headless && !d.vips.is_empty() {
            return Err(ModelError::invalid(
                object,
                "spec.discovery.vips",
                "a headless service has no VIPs",
            ));
        }
        let (mut v4, mut v6) = (false, false);
        for (i, vip) in d.vips.iter().enumerate() {
            let field = format!("spec.discovery.vips[{i}]");
            super::check_plain_address(object, &field, *vip)?;
            if vip.is_unspecified() || vip.is_multicast() || vip.is_loopback() {
                return Err(ModelError::invalid(
                    object,
                    field,
                    format!("{vip} cannot be a VIP (unspecified, loopback or multicast)"),
                ));
            }
            let seen = if vip.is_ipv4() { &mut v4 } else { &mut v6 };
            if std::mem::replace(seen, true) {
                return Err(ModelError::invalid(
                    object,
                    field,
                    format!("{vip} is a second VIP of the same address family (one per family)"),
                ));
            }
        }
        if let SessionAffinity::ClientIp { timeout_seconds } = spec.session_affinity
            && !(1..=MAX_AFFINITY_TIMEOUT_SECONDS).contains(&timeout_seconds)
        {
            return Err(ModelError::invalid(
                object,
                "spec.sessionAffinity.timeoutSeconds",
                format!("{timeout_seconds} is out of range 1-{MAX_AFFINITY_TIMEOUT_SECONDS}"),
            ));
        }
        if spec.drain_seconds > MAX_DRAIN_SECONDS {
            return Err(ModelError::invalid(
                object,
                "spec.drainSeconds",
                format!(
                    "{} is out of range 0-{MAX_DRAIN_SECONDS}",
                    spec.drain_seconds
                ),
            ));
        }
        if let Some(policy) = &spec.network_policy {
            policy.check(object, spec)?;
        }
        Ok(())
    }
}
