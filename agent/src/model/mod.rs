//! The objects the agent carries out (`apiVersion: rune/v1`): their types, the YAML/JSON
//! documents users write, and validation whose errors name the object, the field and
//! the bad value.
//!
//! A [`Service`] names VIPs and ports; its [`Endpoints`] (same namespace and name) list
//! the backends. Parsing is strict: unknown fields are errors, so typos surface at
//! `apply` instead of silently doing nothing.

mod document;
mod endpoints;
mod error;
mod service;

pub use document::{parse_documents, parse_json, parse_stored};
pub use endpoints::{Endpoint, Endpoints, EndpointsSpec, PortOverrides};
pub use error::ModelError;
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
}

impl Kind {
    /// Every kind, in the order `get` lists them.
    pub const ALL: [Kind; 2] = [Kind::Service, Kind::Endpoints];

    /// The kind's name as written in documents.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::Endpoints => "Endpoints",
        }
    }

    /// The kind named exactly as documents write it ([`Kind::as_str`]).
    pub fn from_document(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// Parses a kind as users type it on the command line: `Service`, `service`,
    /// `services`, `svc`, `Endpoints`, `endpoints`, `ep`.
    pub fn parse(s: &str) -> Option<Kind> {
        match s.to_ascii_lowercase().as_str() {
            "service" | "services" | "svc" => Some(Kind::Service),
            "endpoints" | "endpoint" | "ep" => Some(Kind::Endpoints),
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
}

impl Object {
    /// The object's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Object::Service(_) => Kind::Service,
            Object::Endpoints(_) => Kind::Endpoints,
        }
    }

    /// The object's metadata.
    pub fn metadata(&self) -> &Metadata {
        match self {
            Object::Service(s) => &s.metadata,
            Object::Endpoints(e) => &e.metadata,
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
/// one-pass read): 10,000 services' lists then kept ~5 MiB of spare capacity, and
/// shrinking them afterwards left as much in holes between the objects.
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
mod tests {
    use super::*;

    const WEB: &str = r#"
apiVersion: rune/v1
kind: Service
metadata: {namespace: default, name: web, labels: {app: web}}
spec:
  ports:
    - {name: http, port: 80, protocol: TCP, targetPort: 8080}
    - {name: dns, port: 53, protocol: UDP}
  discovery:
    vips: [198.18.100.10, "fd00:100::10"]
  sessionAffinity: {type: ClientIP, timeoutSeconds: 60}
  drainSeconds: 10
---
apiVersion: rune/v1
kind: Endpoints
metadata: {name: web}
spec:
  endpoints:
    - {address: 198.18.1.2, node: node-a}
    - {address: "fd00:1::3", node: node-b.example, ready: true, terminating: true, ports: {http: 8081}}
"#;

    #[test]
    fn parses_the_design_example() {
        let objs = parse_documents(WEB).unwrap();
        assert_eq!(objs.len(), 2);
        let Object::Service(s) = &objs[0] else {
            panic!("not a service")
        };
        assert_eq!(s.spec.ports[0].target(), 8080);
        assert_eq!(s.spec.ports[1].target(), 53);
        assert_eq!(s.spec.ports[1].protocol, Protocol::Udp);
        assert_eq!(s.spec.discovery.vips.len(), 2);
        assert_eq!(
            s.spec.session_affinity,
            SessionAffinity::ClientIp {
                timeout_seconds: 60
            }
        );
        let Object::Endpoints(e) = &objs[1] else {
            panic!("not endpoints")
        };
        assert_eq!(e.metadata.namespace, "default");
        assert!(e.spec.endpoints[0].accepts_new());
        assert!(!e.spec.endpoints[1].accepts_new());
        assert!(e.spec.endpoints[1].is_serving());
        assert_eq!(e.spec.endpoints[1].ports.get("http"), Some(&8081));
    }

    /// Port overrides are written as the map they were given, and an empty map reads
    /// as none and is not written.
    #[test]
    fn port_overrides_serialize_as_a_map_and_empty_ones_are_left_out() {
        let objs = parse_documents(WEB).unwrap();
        let Object::Endpoints(e) = &objs[1] else {
            panic!("not endpoints")
        };
        let json = objs[1].to_json();
        assert_eq!(json["spec"]["endpoints"][1]["ports"]["http"], 8081);
        assert!(json["spec"]["endpoints"][0].get("ports").is_none());
        assert!(e.spec.endpoints[0].ports.is_empty());
        let empty = "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: web}\nspec: {endpoints: [{address: 198.18.1.2, ports: {}}]}\n";
        let Object::Endpoints(e) = &parse_documents(empty).unwrap()[0] else {
            panic!("not endpoints")
        };
        assert!(e.spec.endpoints[0].ports.is_empty());
        assert_eq!(e.spec.endpoints[0].ports.iter().count(), 0);
    }

    #[test]
    fn json_round_trip_keeps_every_field() {
        for obj in parse_documents(WEB).unwrap() {
            let json = obj.to_json();
            assert_eq!(json["apiVersion"], "rune/v1");
            let back = parse_json(&json.to_string()).unwrap();
            assert_eq!(back, obj);
        }
    }

    #[test]
    fn defaults_apply() {
        let objs = parse_documents(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: a}\nspec: {ports: [{port: 80}]}\n",
    )
    .unwrap();
        let Object::Service(s) = &objs[0] else {
            panic!()
        };
        assert_eq!(s.metadata.namespace, "default");
        assert_eq!(s.spec.ports[0].protocol, Protocol::Tcp);
        assert_eq!(s.spec.session_affinity, SessionAffinity::None);
        assert_eq!(s.spec.drain_seconds, 30);
        assert_eq!(
            s.spec.discovery.locality_preference,
            LocalityPreference::Any
        );
    }

    fn svc(spec: &str) -> String {
        format!("apiVersion: rune/v1\nkind: Service\nmetadata: {{name: web}}\nspec: {spec}\n")
    }

    fn eps(spec: &str) -> String {
        format!("apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: web}}\nspec: {spec}\n")
    }

    /// Each bad input with the object, field and a fragment of the message it must name.
    #[test]
    fn bad_inputs_are_refused_with_object_field_and_value() {
        let cases: Vec<(String, &str, &str, &str)> = vec![
        (svc("{ports: [{port: 0}]}"), "Service default/web", "spec.ports[0].port", "port 0"),
        (svc("{ports: [{port: 70000}]}"), "Service default/web", "spec.ports[0].port", "70000"),
        (svc("{ports: [{port: -1}]}"), "Service default/web", "spec.ports[0].port", "-1"),
        (svc("{ports: [{port: 80, targetPort: 0}]}"), "Service default/web", "spec.ports[0].targetPort", "port 0"),
        (svc("{ports: [{name: a, port: 80}, {name: b, port: 80}]}"), "Service default/web", "spec.ports[1].port", "duplicate port 80/TCP"),
        (svc("{ports: [{name: a, port: 80}, {name: a, port: 81}]}"), "Service default/web", "spec.ports[1].name", "duplicate port name \"a\""),
        (svc("{ports: [{port: 80}, {port: 81}]}"), "Service default/web", "spec.ports[0].name", "needs a name"),
        (svc("{ports: [{port: 80, protocol: SCTP}]}"), "Service default/web", "spec.ports[0].protocol", "SCTP"),
        (svc("{ports: [{port: 80}], discovery: {vips: [300.1.2.3]}}"), "Service default/web", "spec.discovery.vips[0]", "300.1.2.3"),
        (svc("{ports: [{port: 80}], discovery: {vips: [0.0.0.0]}}"), "Service default/web", "spec.discovery.vips[0]", "0.0.0.0"),
        (svc("{ports: [{port: 80}], discovery: {vips: [198.18.0.1, 198.18.0.2]}}"), "Service default/web", "spec.discovery.vips[1]", "198.18.0.2"),
        (svc("{ports: [{port: 80}], discovery: {vips: [\"::ffff:198.18.0.1\"]}}"), "Service default/web", "spec.discovery.vips[0]", "write 198.18.0.1"),
        (svc("{ports: [{port: 80}], discovery: {vips: [255.255.255.255]}}"), "Service default/web", "spec.discovery.vips[0]", "broadcast"),
        (eps("{endpoints: [{address: \"::ffff:127.0.0.2\"}]}"), "Endpoints default/web", "spec.endpoints[0].address", "IPv4-mapped"),
        (svc("{ports: [{port: 80}], discovery: {vips: [198.18.0.1], headless: true}}"), "Service default/web", "spec.discovery.vips", "headless"),
        (svc("{ports: [{port: 80}], discovery: {localityPreference: nearby}}"), "Service default/web", "spec.discovery.localityPreference", "nearby"),
        (svc("{ports: [{port: 80}], sessionAffinity: {type: ClientIP, timeoutSeconds: 0}}"), "Service default/web", "spec.sessionAffinity.timeoutSeconds", "0 is out of range"),
        (svc("{ports: [{port: 80}], sessionAffinity: {type: Sticky}}"), "Service default/web", "spec.sessionAffinity.type", "Sticky"),
        (svc("{ports: [{port: 80}], drainSeconds: 99999}"), "Service default/web", "spec.drainSeconds", "99999"),
        (svc("{ports: []}"), "Service default/web", "spec.ports", "at least one port"),
        (svc("{ports: [{port: 80, tragetPort: 8080}]}"), "Service default/web", "spec.ports[0].tragetPort", "unknown field `tragetPort`"),
        (eps("{endpoints: [{address: 198.18.1.300}]}"), "Endpoints default/web", "spec.endpoints[0].address", "198.18.1.300"),
        (eps("{endpoints: [{address: 198.18.1.2}, {address: 198.18.1.2}]}"), "Endpoints default/web", "spec.endpoints[1].address", "duplicate endpoint address 198.18.1.2"),
        (eps("{endpoints: [{address: 198.18.1.2, ports: {http: 0}}]}"), "Endpoints default/web", "spec.endpoints[0].ports.http", "port 0"),
        (eps("{endpoints: [{address: 198.18.1.2, node: Node_A}]}"), "Endpoints default/web", "spec.endpoints[0].node", "Node_A"),
        (eps("{endpoints: [{address: 224.0.0.1}]}"), "Endpoints default/web", "spec.endpoints[0].address", "multicast"),
        ("apiVersion: rune/v1\nkind: Gateway\nmetadata: {name: x}\n".into(), "document 1", "kind", "unknown kind \"Gateway\""),
        ("apiVersion: rune/v2\nkind: Service\nmetadata: {name: x}\n".into(), "document 1", "apiVersion", "rune/v2"),
        ("kind: Service\nmetadata: {name: x}\n".into(), "document 1", "apiVersion", "missing"),
        ("apiVersion: rune/v1\nkind: Service\nmetadata: {namespace: a}\nspec: {ports: [{port: 80}]}\n".into(), "Service in document 1", "metadata.name", "missing"),
        ("apiVersion: rune/v1\nkind: Service\nmetadata: {name: Web_1}\nspec: {ports: [{port: 80}]}\n".into(), "Service default/Web_1", "metadata.name", "Web_1"),
        ("apiVersion: rune/v1\nkind: Service\nmetadata: {name: web, namespace: \"\"}\nspec: {ports: [{port: 80}]}\n".into(), "Service /web", "metadata.namespace", "must not be empty"),
    ];
        assert!(cases.len() >= 15);
        for (input, object, field, fragment) in cases {
            // The same document as JSON (keys sorted, as the store writes them) takes the
            // one-pass read first and must fail the same way.
            let json: serde_json::Value = serde_yaml_ng::from_str(&input).unwrap();
            for result in [
                parse_documents(&input),
                parse_json(&json.to_string()).map(|o| vec![o]),
            ] {
                match result {
                    Err(ModelError::Invalid {
                        object: o,
                        field: f,
                        message,
                    }) => {
                        assert_eq!(
                            (o.as_str(), f.as_str()),
                            (object, field),
                            "input:\n{input}\nmessage: {message}"
                        );
                        assert!(
                            message.contains(fragment),
                            "input:\n{input}\nmessage {message:?} lacks {fragment:?}"
                        );
                    }
                    other => panic!("input:\n{input}\nexpected an Invalid error, got {other:?}"),
                }
            }
        }
    }

    /// The store's one-pass read gives the object the two-step parse gives; documents
    /// it does not take (keys in another order, a duplicate key) are read by the two-step
    /// parse as before.
    #[test]
    fn stored_documents_are_read_in_one_pass() {
        let mut objs = parse_documents(WEB).unwrap();
        objs.extend(
            parse_documents("apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: bare}\n")
                .unwrap(),
        );
        for obj in objs {
            let text = obj.to_json().to_string();
            let one_pass: document::Stored = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("one pass refused {text}: {e}"));
            assert_eq!(one_pass.0, obj);
            assert_eq!(parse_stored(&text).unwrap(), obj);
        }
        // Lists are sized to their length, whichever way they were read.
        let many: Vec<String> = (1..=20)
            .map(|i| format!(r#"{{"address":"198.18.1.{i}"}}"#))
            .collect();
        let text = format!(
            r#"{{"apiVersion":"rune/v1","kind":"Endpoints","metadata":{{"name":"web"}},"spec":{{"endpoints":[{}]}}}}"#,
            many.join(",")
        );
        for n in [3, 20] {
            let text = text.replacen(
                &many[n..]
                    .iter()
                    .map(|m| format!(",{m}"))
                    .collect::<String>(),
                "",
                1,
            );
            let Object::Endpoints(e) = parse_stored(&text).unwrap() else {
                panic!("not endpoints")
            };
            assert_eq!(e.spec.endpoints.len(), n);
            assert_eq!(e.spec.endpoints.capacity(), n, "spare capacity kept");
        }
        let reordered = r#"{"spec":{"endpoints":[{"address":"198.18.1.2"}]},"metadata":{"name":"web"},"kind":"Endpoints","apiVersion":"rune/v1"}"#;
        let duplicate = r#"{"apiVersion":"rune/v1","kind":"Endpoints","kind":"Endpoints","metadata":{"name":"web"},"spec":{"endpoints":[{"address":"198.18.1.2"}]}}"#;
        for text in [reordered, duplicate] {
            assert!(
                serde_json::from_str::<document::Stored>(text).is_err(),
                "{text}"
            );
            let Object::Endpoints(e) = parse_stored(text).unwrap() else {
                panic!("not endpoints: {text}")
            };
            assert_eq!(e.spec.endpoints.len(), 1, "{text}");
        }
    }

    #[test]
    fn syntax_errors_name_the_document() {
        let text = format!("{}---\n[unclosed", svc("{ports: [{port: 80}]}"));
        let err = parse_documents(&text).unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::Syntax { index: 1, .. } | ModelError::Syntax { index: 2, .. }
            ),
            "{err}"
        );
        let err = parse_documents("- a\n- b\n").unwrap_err();
        assert_eq!(
            err,
            ModelError::Syntax {
                index: 1,
                message: "expected a mapping, got a list".into()
            }
        );
    }

    #[test]
    fn a_vip_used_by_two_services_is_refused() {
        let a = &parse_documents(&svc(
            "{ports: [{port: 80}], discovery: {vips: [198.18.100.10]}}",
        ))
        .unwrap()[0];
        let b = &parse_documents(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: other}\nspec: {ports: [{port: 81}], discovery: {vips: [198.18.100.10]}}\n",
    )
    .unwrap()[0];
        let err = check_vips([a, b], std::slice::from_ref(b)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Service default/other: spec.discovery.vips[0]: VIP 198.18.100.10 is already used by Service default/web"
        );
        // Its own earlier version is no conflict.
        check_vips([a], std::slice::from_ref(a)).unwrap();
        // The error lands on the object being written, whichever order the state has.
        let err = check_vips([b, a], std::slice::from_ref(a)).unwrap_err();
        assert!(err.to_string().starts_with("Service default/web:"), "{err}");
    }

    #[test]
    fn kinds_parse_as_users_type_them() {
        assert_eq!(Kind::parse("svc"), Some(Kind::Service));
        assert_eq!(Kind::parse("Endpoints"), Some(Kind::Endpoints));
        assert_eq!(Kind::parse("pods"), None);
    }
}
