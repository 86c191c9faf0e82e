//! The objects the agent carries out (`apiVersion: rune/v1`): their types, the YAML/JSON
//! documents users write, and validation whose errors name the object, the field and
//! the bad value.
//!
//! A [`Service`] names VIPs and ports; its [`Endpoints`] (same namespace and name) list
//! the backends. Parsing is strict: unknown fields are errors, so typos surface at
//! `apply` instead of silently doing nothing.

mod cidr;
mod document;
mod endpoints;
mod error;
mod expose;
mod policy;
mod secret;
mod service;

pub use cidr::parse_cidr;
pub use document::{parse_documents, parse_json, parse_stored};
pub use endpoints::{Endpoint, Endpoints, EndpointsSpec, PortOverrides, check_endpoint_ports};
pub use error::ModelError;
pub use expose::{ClientCert, Expose, ExposeTls, PortRef, TlsMode};
pub use policy::{
    EgressRule, IngressRule, NetworkPolicy, Peer, PeerSelector, PolicyMode, PortEntry,
};
pub use secret::{CA_CERT_KEY, Secret, TLS_CERT_KEY, TLS_KEY_KEY, load_certified_key};
pub use service::{
    Discovery, LocalityPreference, Protocol, Service, ServicePort, ServiceSpec, SessionAffinity,
};

use serde::{Deserialize, Serialize};
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fmt,
    net::IpAddr,
};

/// The only API version this agent speaks.
pub const API_VERSION: &str = "rune/v1";

/// Namespace of objects that do not name one.
pub const DEFAULT_NAMESPACE: &str = "default";

/// The kinds of object the agent knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Kind {
    /// A load-balanced service: VIPs and ports.
    Service,
    /// The backends of the service with the same namespace and name.
    Endpoints,
    /// Named strings (certificates and keys) other objects refer to.
    Secret,
}

impl Kind {
    /// Every kind, in the order `get` lists them.
    pub const ALL: [Kind; 3] = [Kind::Service, Kind::Endpoints, Kind::Secret];

    /// The kind's name as written in documents.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::Endpoints => "Endpoints",
            Kind::Secret => "Secret",
        }
    }

    /// The kind named exactly as documents write it ([`Kind::as_str`]).
    pub fn from_document(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// Parses a kind as users type it on the command line: `Service`, `service`,
    /// `services`, `svc`, `Endpoints`, `endpoints`, `ep`, `Secret`, `secrets`.
    pub fn parse(s: &str) -> Option<Kind> {
        match s.to_ascii_lowercase().as_str() {
            "service" | "services" | "svc" => Some(Kind::Service),
            "endpoints" | "endpoint" | "ep" => Some(Kind::Endpoints),
            "secret" | "secrets" => Some(Kind::Secret),
            _ => None,
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Identifies one object: kind, namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    /// The object's kind.
    pub kind: Kind,
    /// The object's namespace.
    pub namespace: String,
    /// The object's name.
    pub name: String,
}

impl ObjectKey {
    /// A key from its parts.
    pub fn new(kind: Kind, namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            kind,
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// The key of the service or endpoints object paired with this one.
    pub fn service(&self) -> ServiceKey {
        ServiceKey {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}/{}", self.kind, self.namespace, self.name)
    }
}

/// Names a service (and its endpoints): `namespace/name`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    /// The service's namespace.
    pub namespace: String,
    /// The service's name.
    pub name: String,
}

impl ServiceKey {
    /// A key from its parts.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Name, namespace and labels of an object.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    /// Namespace; `default` when omitted.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Name, a DNS label.
    pub name: String,
    /// Free-form labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

fn default_namespace() -> String {
    DEFAULT_NAMESPACE.to_owned()
}

/// Any object the agent stores and carries out.
#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    /// A service.
    Service(Service),
    /// A service's endpoints.
    Endpoints(Endpoints),
    /// Named strings.
    Secret(Secret),
}

impl Object {
    /// The object's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Object::Service(_) => Kind::Service,
            Object::Endpoints(_) => Kind::Endpoints,
            Object::Secret(_) => Kind::Secret,
        }
    }

    /// The object's metadata.
    pub fn metadata(&self) -> &Metadata {
        match self {
            Object::Service(s) => &s.metadata,
            Object::Endpoints(e) => &e.metadata,
            Object::Secret(s) => &s.metadata,
        }
    }

    /// The object's key.
    pub fn key(&self) -> ObjectKey {
        let m = self.metadata();
        ObjectKey::new(self.kind(), &m.namespace, &m.name)
    }

    /// Checks the object on its own (field ranges, duplicates, names).
    pub fn validate(&self) -> Result<(), ModelError> {
        let object = self.key().to_string();
        validate_metadata(&object, self.metadata())?;
        match self {
            Object::Service(s) => s.validate(&object),
            Object::Endpoints(e) => e.validate(&object),
            Object::Secret(s) => s.validate(&object),
        }
    }

    /// The object as a JSON document (`apiVersion` and `kind` first).
    pub fn to_json(&self) -> serde_json::Value {
        document::to_value(self)
    }
}

/// Deserializes a list into a vector of exactly its length (`deserialize_with` of
/// the model's lists). Serde's own `Vec` grows by doubling when the format does not
/// tell the length up front, as JSON read straight from text does (the store's
/// one-pass read): a large store's lists would then keep spare capacity, and
/// shrinking them afterwards leaves as much in holes between the objects.
fn exact_vec<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Exact<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Exact<T> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a list")
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            // Short lists (nearly all) gather on the stack, then move into one
            // allocation of their length.
            let mut items = smallvec::SmallVec::<[T; 16]>::new();
            while let Some(item) = seq.next_element()? {
                items.push(item);
            }
            let mut exact = Vec::with_capacity(items.len());
            exact.extend(items);
            Ok(exact)
        }
    }
    deserializer.deserialize_seq(Exact(std::marker::PhantomData))
}

/// Checks what objects cannot check alone: that no VIP is used by two services in
/// `state` (every object as it will be stored, the batch included). A conflict is
/// reported on the object of `batch` involved. One pass with an index, so applying
/// to a large store stays fast.
pub fn check_vips<'a>(
    state: impl IntoIterator<Item = &'a Object>,
    batch: &[Object],
) -> Result<(), ModelError> {
    let batch_keys: HashSet<ObjectKey> = batch.iter().map(Object::key).collect();
    // Objects outside the batch first, so that the error names the one being written.
    let (mut order, mine): (Vec<&Object>, Vec<&Object>) = state
        .into_iter()
        .partition(|o| !batch_keys.contains(&o.key()));
    order.extend(mine);
    let mut owner: HashMap<IpAddr, ObjectKey> = HashMap::new();
    for o in order {
        let Object::Service(s) = o else { continue };
        let key = o.key();
        for (i, vip) in s.spec.discovery.vips.iter().enumerate() {
            if let Some(prev) = owner.insert(*vip, key.clone())
                && prev != key
            {
                return Err(ModelError::invalid(
                    key.to_string(),
                    format!("spec.discovery.vips[{i}]"),
                    format!("VIP {vip} is already used by {prev}"),
                ));
            }
        }
    }
    Ok(())
}

/// Refuses addresses that would reach the data planes in a confusing form: an
/// IPv4-mapped IPv6 address (the same host as its IPv4 form, so it would dodge the
/// duplicate and family checks) and the IPv4 broadcast address.
pub(crate) fn check_plain_address(object: &str, field: &str, a: IpAddr) -> Result<(), ModelError> {
    match a {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => Err(ModelError::invalid(
                object,
                field,
                format!("{a} is an IPv4-mapped address: write {v4}"),
            )),
            None => Ok(()),
        },
        IpAddr::V4(v4) if v4.is_broadcast() => Err(ModelError::invalid(
            object,
            field,
            format!("{a} is the broadcast address"),
        )),
        IpAddr::V4(_) => Ok(()),
    }
}

fn validate_metadata(object: &str, m: &Metadata) -> Result<(), ModelError> {
    check_dns_label(object, "metadata.name", &m.name)?;
    check_dns_label(object, "metadata.namespace", &m.namespace)
}

/// Checks that `value` is an RFC 1123 DNS label: 1–63 of `a-z0-9-`, alphanumeric at
/// both ends. Names become DNS names (`<name>.<namespace>.rune`), hence the rule.
pub(crate) fn check_dns_label(object: &str, field: &str, value: &str) -> Result<(), ModelError> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !value.starts_with('-')
        && !value.ends_with('-');
    if ok {
        Ok(())
    } else if value.is_empty() {
        Err(ModelError::invalid(object, field, "must not be empty"))
    } else {
        Err(ModelError::invalid(
            object,
            field,
            format!(
                "{value:?} is not a DNS label (1-63 characters of a-z, 0-9 and '-', \
                 starting and ending with a letter or digit)"
            ),
        ))
    }
}

#[cfg(test)]
mod tests;
