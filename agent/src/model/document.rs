//! Documents: multi-document YAML (or JSON) in, [`Object`]s out, and back.

use super::{
    API_VERSION, Endpoints, EndpointsSpec, Kind, ModelError, Object, Secret, Service, ServiceSpec,
};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::Value;
use std::collections::BTreeMap;

/// Parses every document of a YAML (or JSON) text, checks each on its own and
/// returns them in order. Empty documents are skipped. The first bad document stops
/// the parse: its error names the document (or object), the field and the value.
pub fn parse_documents(text: &str) -> Result<Vec<Object>, ModelError> {
    let mut out = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let index = i + 1;
        let value = Value::deserialize(doc).map_err(|e| ModelError::Syntax {
            index,
            message: e.to_string(),
        })?;
        if value.is_null() {
            continue;
        }
        let obj = parse_value(index, value)?;
        obj.validate()?;
        out.push(obj);
    }
    Ok(out)
}

/// Parses and checks one JSON document (as sent over the local API).
pub fn parse_json(text: &str) -> Result<Object, ModelError> {
    let obj = parse_stored(text)?;
    obj.validate()?;
    Ok(obj)
}

/// Parses one JSON document the store wrote, without re-checking it: it was checked
/// when written, and a rule that got stricter since must not make the store
/// unreadable (the agent would lose every other object's state).
///
/// One typed pass first ([`Stored`]: no `Value` tree, no path tracking; a third of
/// the time of the two-step parse, which took most of a 10k-service start's store
/// read); only a document it refuses goes through [`parse_value`], whose error
/// names the field.
pub fn parse_stored(text: &str) -> Result<Object, ModelError> {
    if let Ok(Stored(object)) = serde_json::from_str(text) {
        return Ok(object);
    }
    let value: Value = serde_json::from_str(text).map_err(|e| ModelError::Syntax {
        index: 1,
        message: e.to_string(),
    })?;
    parse_value(1, value)
}

/// A stored document read in one pass. The store writes `apiVersion` and `kind`
/// before `metadata` and `spec` (`serde_json::Map` keeps keys sorted), so the body's
/// type is known when it is reached. Accepts exactly what [`parse_value`] accepts
/// in that order; anything else (another order, a duplicate or unknown key) is
/// an error, and the caller takes the slow path.
pub(super) struct Stored(pub(super) Object);

/// The keys of a stored document.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum StoredKey {
    ApiVersion,
    Kind,
    Metadata,
    Spec,
    Data,
}

impl<'de> Deserialize<'de> for Stored {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(StoredVisitor)
    }
}

struct StoredVisitor;

impl<'de> serde::de::Visitor<'de> for StoredVisitor {
    type Value = Stored;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a stored object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Stored, A::Error> {
        use serde::de::Error as _;
        let mut api_version = false;
        let mut kind = None;
        let mut metadata = None;
        let mut spec = None;
        while let Some(key) = map.next_key::<StoredKey>()? {
            match key {
                StoredKey::ApiVersion if !api_version => {
                    let v: String = map.next_value()?;
                    if v != API_VERSION {
                        return Err(A::Error::custom("unsupported apiVersion"));
                    }
                    api_version = true;
                }
                StoredKey::Kind if kind.is_none() => {
                    let name: String = map.next_value()?;
                    kind = Some(
                        Kind::from_document(&name)
                            .ok_or_else(|| A::Error::custom("unknown kind"))?,
                    );
                }
                StoredKey::Metadata if metadata.is_none() => metadata = Some(map.next_value()?),
                StoredKey::Spec if spec.is_none() => {
                    spec = Some(match kind {
                        Some(Kind::Service) => Spec::Service(map.next_value()?),
                        Some(Kind::Endpoints) => Spec::Endpoints(map.next_value()?),
                        Some(Kind::Secret) => return Err(A::Error::custom("a Secret has no spec")),
                        None => return Err(A::Error::custom("spec before kind")),
                    });
                }
                StoredKey::Data if spec.is_none() && kind == Some(Kind::Secret) => {
                    spec = Some(Spec::Data(map.next_value()?));
                }
                _ => return Err(A::Error::custom("a key out of place")),
            }
        }
        let (true, Some(kind), Some(metadata)) = (api_version, kind, metadata) else {
            return Err(A::Error::custom("a key missing"));
        };
        Ok(Stored(match (kind, spec) {
            (Kind::Service, Some(Spec::Service(spec))) => {
                Object::Service(Service { metadata, spec })
            }
            (Kind::Endpoints, Some(Spec::Endpoints(spec))) => {
                Object::Endpoints(Endpoints { metadata, spec })
            }
            (Kind::Endpoints, None) => Object::Endpoints(Endpoints {
                metadata,
                spec: EndpointsSpec::default(),
            }),
            (Kind::Secret, Some(Spec::Data(data))) => Object::Secret(Secret { metadata, data }),
            (Kind::Secret, None) => Object::Secret(Secret {
                metadata,
                data: BTreeMap::new(),
            }),
            _ => return Err(A::Error::custom("no spec")),
        }))
    }
}

/// The body of a [`Stored`] document.
enum Spec {
    Service(ServiceSpec),
    Endpoints(EndpointsSpec),
    Data(BTreeMap<String, String>),
}

/// The typed object of one document, before the semantic checks of `validate`.
fn parse_value(index: usize, mut value: Value) -> Result<Object, ModelError> {
    let doc = format!("document {index}");
    let Some(map) = value.as_object_mut() else {
        return Err(ModelError::Syntax {
            index,
            message: format!("expected a mapping, got {}", kind_of(&value)),
        });
    };
    match map.remove("apiVersion") {
        Some(Value::String(v)) if v == API_VERSION => {}
        Some(v) => {
            return Err(ModelError::invalid(
                doc,
                "apiVersion",
                format!("unsupported apiVersion {v} (expected {API_VERSION})"),
            ));
        }
        None => return Err(ModelError::invalid(doc, "apiVersion", "missing")),
    }
    let kind = match map.remove("kind") {
        Some(Value::String(k)) => match Kind::from_document(&k) {
            Some(kind) => kind,
            None => {
                return Err(ModelError::invalid(
                    doc,
                    "kind",
                    format!("unknown kind {k:?} (known: Service, Endpoints, Secret)"),
                ));
            }
        },
        Some(v) => {
            return Err(ModelError::invalid(
                doc,
                "kind",
                format!("expected a string, got {v}"),
            ));
        }
        None => return Err(ModelError::invalid(doc, "kind", "missing")),
    };
    // Name the object in later errors as soon as its name is readable.
    let meta = map.get("metadata");
    let name = meta.and_then(|m| m.get("name")).and_then(Value::as_str);
    let namespace = meta
        .and_then(|m| m.get("namespace"))
        .and_then(Value::as_str)
        .unwrap_or(super::DEFAULT_NAMESPACE);
    let object = match name {
        Some(n) => format!("{kind} {namespace}/{n}"),
        None if meta.is_some_and(Value::is_object) => {
            return Err(ModelError::invalid(
                format!("{kind} in {doc}"),
                "metadata.name",
                "missing",
            ));
        }
        None => {
            return Err(ModelError::invalid(
                format!("{kind} in {doc}"),
                "metadata",
                "missing (metadata.name is required)",
            ));
        }
    };
    Ok(match kind {
        Kind::Service => Object::Service(typed::<Service>(&object, value)?),
        Kind::Endpoints => Object::Endpoints(typed::<Endpoints>(&object, value)?),
        Kind::Secret => Object::Secret(typed::<Secret>(&object, value)?),
    })
}

/// Deserializes the body, turning serde's error into one that names the field path
/// and shows the offending value.
fn typed<T: DeserializeOwned>(object: &str, value: Value) -> Result<T, ModelError> {
    serde_path_to_error::deserialize::<_, T>(&value).map_err(|e| {
        let field = e.path().to_string();
        let mut message = e.inner().to_string();
        if let Some(bad) = value_at(&value, e.path())
            && !bad.is_object()
            && !bad.is_array()
            && !message.starts_with("unknown field")
        {
            let shown = bad.to_string();
            if !message.contains(shown.trim_matches('"')) {
                message = format!("{message}: got {shown}");
            }
        }
        let field = if field == "." {
            "(document)".into()
        } else {
            field
        };
        ModelError::invalid(object, field, message)
    })
}

fn value_at<'a>(root: &'a Value, path: &serde_path_to_error::Path) -> Option<&'a Value> {
    use serde_path_to_error::Segment;
    let mut v = root;
    for seg in path.iter() {
        v = match seg {
            Segment::Seq { index } => v.get(*index)?,
            Segment::Map { key } => v.get(key)?,
            Segment::Enum { .. } | Segment::Unknown => return None,
        };
    }
    Some(v)
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "nothing",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

#[derive(Serialize)]
struct Doc<'a, T> {
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    kind: &'static str,
    #[serde(flatten)]
    body: &'a T,
}

/// The object as a JSON value with `apiVersion` and `kind`.
pub(super) fn to_value(obj: &Object) -> Value {
    let kind = obj.kind().as_str();
    let r = match obj {
        Object::Service(s) => serde_json::to_value(Doc {
            api_version: API_VERSION,
            kind,
            body: s,
        }),
        Object::Endpoints(e) => serde_json::to_value(Doc {
            api_version: API_VERSION,
            kind,
            body: e,
        }),
        Object::Secret(s) => serde_json::to_value(Doc {
            api_version: API_VERSION,
            kind,
            body: s,
        }),
    };
    // Serializing plain structs of strings, numbers and maps with string keys into a
    // Value cannot fail.
    r.unwrap_or(Value::Null)
}
