//! `kind: Endpoints`: the backends of the service with the same namespace and name.

use super::{
    Kind, Metadata, ModelError, Object, Service, ServiceKey, ServicePort, check_dns_label,
};
use serde::{Deserialize, Serialize};
use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, SocketAddr},
};

/// The backends of one service. An empty list means "known, no backends": the service
/// refuses connections.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoints {
    /// Same namespace and name as the service.
    pub metadata: Metadata,
    /// The backends.
    #[serde(default)]
    pub spec: EndpointsSpec,
}

/// The body of an [`Endpoints`] object.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointsSpec {
    /// One entry per backend: an address and its ports. Several entries may share
    /// an address when their ports differ (several processes on one host).
    #[serde(default, deserialize_with = "super::exact_vec")]
    pub endpoints: Vec<Endpoint>,
}

/// One backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// The backend's address.
    pub address: IpAddr,
    /// The node the backend runs on (for locality preference); empty when not given.
    /// Boxed, not a `String`: one word less in every endpoint of a large cluster.
    #[serde(default, skip_serializing_if = "str::is_empty")]
    pub node: Box<str>,
    /// Passing its readiness checks; only ready, non-terminating endpoints get new
    /// connections.
    #[serde(default = "yes")]
    pub ready: bool,
    /// Able to serve even while terminating; defaults to `ready`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving: Option<bool>,
    /// Shutting down: no new connections, established ones may finish.
    #[serde(default)]
    pub terminating: bool,
    /// Target-port overrides by service port name.
    #[serde(default, skip_serializing_if = "PortOverrides::is_empty")]
    pub ports: PortOverrides,
}

/// An endpoint's target-port overrides by service port name: none (nearly always)
/// in one word, else a boxed map (a `BTreeMap` field would take three words in
/// every endpoint). (De)serialized as the map.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortOverrides(
    #[expect(
        clippy::box_collection,
        reason = "a thin pointer keeps the field at 8 bytes"
    )]
    Option<Box<BTreeMap<String, u16>>>,
);

/// The overrides of an endpoint that has none.
static NO_OVERRIDES: BTreeMap<String, u16> = BTreeMap::new();

impl PortOverrides {
    /// The override of service port `name`.
    pub fn get(&self, name: &str) -> Option<&u16> {
        self.0.as_ref().and_then(|m| m.get(name))
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// Every override, by port name.
    pub fn iter(&self) -> std::collections::btree_map::Iter<'_, String, u16> {
        self.0.as_deref().unwrap_or(&NO_OVERRIDES).iter()
    }

    /// Removes every override.
    pub fn clear(&mut self) {
        self.0 = None;
    }
}

impl From<BTreeMap<String, u16>> for PortOverrides {
    fn from(map: BTreeMap<String, u16>) -> Self {
        Self((!map.is_empty()).then(|| Box::new(map)))
    }
}

impl<'a> IntoIterator for &'a PortOverrides {
    type Item = (&'a String, &'a u16);
    type IntoIter = std::collections::btree_map::Iter<'a, String, u16>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl Serialize for PortOverrides {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0
            .as_deref()
            .unwrap_or(&NO_OVERRIDES)
            .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for PortOverrides {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        BTreeMap::deserialize(deserializer).map(Self::from)
    }
}

fn yes() -> bool {
    true
}

impl Endpoint {
    /// Whether this endpoint may receive new connections.
    pub fn accepts_new(&self) -> bool {
        self.ready && !self.terminating
    }

    /// Whether the endpoint can still serve traffic (its `serving` flag, or `ready`).
    pub fn is_serving(&self) -> bool {
        self.serving.unwrap_or(self.ready)
    }

    /// The port this endpoint serves service port `port` on: its override by the
    /// port's name, else the port's target port.
    pub fn port_for(&self, port: &ServicePort) -> u16 {
        self.ports.get(&port.name).copied().unwrap_or(port.target())
    }
}

impl Endpoints {
    pub(super) fn validate(&self, object: &str) -> Result<(), ModelError> {
        let mut seen: HashMap<(IpAddr, &PortOverrides), usize> = HashMap::new();
        for (i, e) in self.spec.endpoints.iter().enumerate() {
            let field = |f: &str| format!("spec.endpoints[{i}].{f}");
            let a = e.address;
            super::check_plain_address(object, &field("address"), a)?;
            if a.is_unspecified() || a.is_multicast() {
                return Err(ModelError::invalid(
                    object,
                    field("address"),
                    format!("{a} cannot be an endpoint (unspecified or multicast)"),
                ));
            }
            // The same address with the same overrides is the same backend on every
            // service port, whatever the Service says; with other overrides it may
            // be another process on that host (`check_endpoint_ports` resolves the
            // ports once the Service is known).
            if let Some(first) = seen.insert((a, &e.ports), i) {
                let ports: Vec<String> = e
                    .ports
                    .iter()
                    .map(|(name, port)| format!("{} ({name})", SocketAddr::new(a, *port)))
                    .collect();
                let what = if ports.is_empty() {
                    format!("{a} (on the service's target ports)")
                } else {
                    ports.join(", ")
                };
                return Err(duplicate(object, i, &what, first));
            }
            if !e.node.is_empty() && !is_node_name(&e.node) {
                return Err(ModelError::invalid(
                    object,
                    field("node"),
                    format!("{:?} is not a node name (dot-separated DNS labels)", e.node),
                ));
            }
            for (name, port) in &e.ports {
                check_dns_label(object, &field("ports"), name)?;
                if *port == 0 {
                    return Err(ModelError::invalid(
                        object,
                        field(&format!("ports.{name}")),
                        "port 0 is out of range 1-65535",
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The error for `spec.endpoints[i]`, the same backend (`what`: its address and
/// ports) as `spec.endpoints[first]`.
fn duplicate(object: &str, i: usize, what: &str, first: usize) -> ModelError {
    ModelError::invalid(
        object,
        format!("spec.endpoints[{i}]"),
        format!(
            "duplicate endpoint {what}: spec.endpoints[{first}] has the same address and \
             ports (endpoints on one address need different ports)"
        ),
    )
}

/// Checks what an Endpoints object cannot check alone: that no two of its endpoints
/// reach the same address and port for every port of their Service (an override
/// equal to the target port, or one for a port the Service lacks, makes two
/// endpoints with different overrides the same backend). `state` is every object
/// as it will be stored, the batch included; only the Endpoints objects of `batch`
/// with a Service in `state` are checked. A later change of the Service that makes
/// two endpoints meet is not refused: the data planes count them as one backend
/// (`ServiceView::port_backends`).
pub fn check_endpoint_ports<'a>(
    state: impl IntoIterator<Item = &'a Object>,
    batch: &[Object],
) -> Result<(), ModelError> {
    // Only the services of the batch's Endpoints are looked at.
    let mut services: HashMap<ServiceKey, Option<&Service>> = batch
        .iter()
        .filter(|o| o.kind() == Kind::Endpoints)
        .map(|o| (o.key().service(), None))
        .collect();
    for o in state {
        if let Object::Service(s) = o
            && let Some(slot) = services.get_mut(&o.key().service())
        {
            *slot = Some(s);
        }
    }
    for o in batch {
        let Object::Endpoints(eps) = o else { continue };
        let key = o.key();
        let Some(Some(service)) = services.get(&key.service()) else {
            continue;
        };
        let ports = &service.spec.ports;
        let mut seen: HashMap<(IpAddr, Vec<u16>), usize> = HashMap::new();
        for (i, e) in eps.spec.endpoints.iter().enumerate() {
            let resolved: Vec<u16> = ports.iter().map(|p| e.port_for(p)).collect();
            if let Some(first) = seen.insert((e.address, resolved), i) {
                let what: Vec<String> = ports
                    .iter()
                    .map(|p| {
                        let addr = SocketAddr::new(e.address, e.port_for(p));
                        if p.name.is_empty() {
                            addr.to_string()
                        } else {
                            format!("{addr} ({})", p.name)
                        }
                    })
                    .collect();
                let what = if what.is_empty() {
                    e.address.to_string()
                } else {
                    what.join(", ")
                };
                return Err(duplicate(&key.to_string(), i, &what, first));
            }
        }
    }
    Ok(())
}

/// Node names are hostnames: dot-separated DNS labels, 253 characters at most.
fn is_node_name(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}
