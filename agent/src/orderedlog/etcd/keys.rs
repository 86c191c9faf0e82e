//! The key layout under the prefix (`/rune/v1/` by default):
//!
//! * `<prefix><kind>/<namespace>/<name>` → the object's JSON document, exactly as the
//!   embedded store writes it (`kind` in lower case: `service`, `endpoints`);
//! * `<prefix>_index/vip/<vip>` → the service that owns the VIP, as
//!   `service/<namespace>/<name>`;
//! * `<prefix>nodes/<node-id>` → a node's document (JSON, under the node's lease:
//!   see `crate::node`);
//! * `<prefix>drains/<node-id>` → a drain record (JSON, written by the admin: see
//!   `crate::node::drain`).
//!
//! Segments that start with `_` are the store's own bookkeeping, and `nodes/` and
//! `drains/` hold nodes and drains, not objects: the object readers skip them
//! silently. Names and
//! namespaces are DNS labels, so a key splits unambiguously.

use crate::model::{Kind, ObjectKey};
#[cfg(test)]
use std::net::IpAddr;

/// The first segment of the VIP index's keys.
const INDEX: &str = "_index/vip/";
/// The first segment of the nodes' keys. Not a kind's segment (those are
/// `service` and `endpoints`), so no object key can fall under it.
const NODES: &str = "nodes/";
/// The first segment of the drain records' keys; not a kind's segment either.
const DRAINS: &str = "drains/";

/// The segment naming `kind` in a key.
pub(super) fn kind_segment(kind: Kind) -> &'static str {
    match kind {
        Kind::Service => "service",
        Kind::Endpoints => "endpoints",
        Kind::Secret => "secrets",
    }
}

/// The kind a key segment names.
fn segment_kind(segment: &str) -> Option<Kind> {
    Kind::ALL.into_iter().find(|k| kind_segment(*k) == segment)
}

/// What a key under the prefix is.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Parsed {
    /// An object's key.
    Object(ObjectKey),
    /// The store's own bookkeeping (the VIP index): not an object.
    Internal,
    /// A key under `nodes/`: a node's document (the id after `nodes/`, possibly
    /// malformed), not an object.
    Node(String),
    /// A key under `drains/`: a drain record (the node id after `drains/`, possibly
    /// malformed), not an object.
    Drain(String),
    /// Not a key this agent understands: the reason, for the log.
    Unknown(String),
}

/// Builds and parses the keys under one prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Layout {
    prefix: String,
}

impl Layout {
    /// The layout under `prefix`, which ends with `/`.
    pub fn new(prefix: String) -> Self {
        debug_assert!(prefix.ends_with('/'));
        Self { prefix }
    }

    /// The prefix, ending with `/`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The key of an object.
    pub fn object(&self, key: &ObjectKey) -> String {
        format!("{}{}", self.prefix, relative(key))
    }

    /// The prefix of every object of `kind`, or of `kind` in `namespace`.
    pub fn objects_of(&self, kind: Kind, namespace: Option<&str>) -> String {
        match namespace {
            Some(ns) => format!("{}{}/{ns}/", self.prefix, kind_segment(kind)),
            None => format!("{}{}/", self.prefix, kind_segment(kind)),
        }
    }

    /// The index key of a VIP.
    #[cfg(test)]
    pub fn vip(&self, vip: &IpAddr) -> String {
        self.claim(&vip.to_string())
    }

    /// The index key of a claim ([`crate::orderedlog::store::Claim::index_key`]).
    pub fn claim(&self, index_key: &str) -> String {
        format!("{}{INDEX}{index_key}", self.prefix)
    }

    /// The prefix of the whole VIP index.
    pub fn vip_index(&self) -> String {
        format!("{}{INDEX}", self.prefix)
    }

    /// The key of node `id`'s document.
    pub fn node(&self, id: &str) -> String {
        format!("{}{NODES}{id}", self.prefix)
    }

    /// The prefix of every node's key.
    pub fn nodes(&self) -> String {
        format!("{}{NODES}", self.prefix)
    }

    /// The key of node `id`'s drain record.
    pub fn drain(&self, id: &str) -> String {
        format!("{}{DRAINS}{id}", self.prefix)
    }

    /// The prefix of every drain record's key.
    pub fn drains(&self) -> String {
        format!("{}{DRAINS}", self.prefix)
    }

    /// What `key` is; keys outside the prefix are [`Parsed::Unknown`].
    pub fn parse(&self, key: &[u8]) -> Parsed {
        let Ok(key) = std::str::from_utf8(key) else {
            return Parsed::Unknown("the key is not UTF-8".to_owned());
        };
        let Some(rest) = key.strip_prefix(&self.prefix) else {
            return Parsed::Unknown(format!("not under the prefix {}", self.prefix));
        };
        if rest.starts_with('_') {
            return Parsed::Internal;
        }
        if let Some(id) = rest.strip_prefix(NODES) {
            return Parsed::Node(id.to_owned());
        }
        if let Some(id) = rest.strip_prefix(DRAINS) {
            return Parsed::Drain(id.to_owned());
        }
        match parse_relative(rest) {
            Ok(key) => Parsed::Object(key),
            Err(reason) => Parsed::Unknown(reason),
        }
    }
}

/// `<kind>/<namespace>/<name>`: an object's key below the prefix, and how the VIP
/// index names a VIP's owner.
pub(super) fn relative(key: &ObjectKey) -> String {
    format!("{}/{}/{}", kind_segment(key.kind), key.namespace, key.name)
}

/// The object a [`relative`] key names, or why it names none.
pub(super) fn parse_relative(rest: &str) -> Result<ObjectKey, String> {
    let mut parts = rest.split('/');
    let (Some(kind), Some(namespace), Some(name), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("not <kind>/<namespace>/<name>".to_owned());
    };
    let Some(kind) = segment_kind(kind) else {
        return Err(format!("unknown kind {kind:?}"));
    };
    if namespace.is_empty() || name.is_empty() {
        return Err("empty namespace or name".to_owned());
    }
    Ok(ObjectKey::new(kind, namespace, name))
}

/// The end of the range of every key starting with `prefix` (etcd's `range_end`).
pub(super) fn range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: to the end of the key space.
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_and_drain_keys_are_not_objects_of_an_unknown_kind() {
        let layout = Layout::new("/rune/v1/".to_owned());
        assert_eq!(layout.node("abc"), "/rune/v1/nodes/abc");
        assert_eq!(layout.nodes(), "/rune/v1/nodes/");
        assert_eq!(
            layout.parse(b"/rune/v1/nodes/abc"),
            Parsed::Node("abc".to_owned())
        );
        assert_eq!(
            layout.parse(b"/rune/v1/nodes/a/b"),
            Parsed::Node("a/b".to_owned())
        );
        assert!(matches!(
            layout.parse(b"/rune/v1/node/abc"),
            Parsed::Unknown(_)
        ));
        assert_eq!(layout.drain("abc"), "/rune/v1/drains/abc");
        assert_eq!(
            layout.parse(b"/rune/v1/drains/abc"),
            Parsed::Drain("abc".to_owned())
        );
        assert!(matches!(
            layout.parse(b"/rune/v1/drain/abc"),
            Parsed::Unknown(_)
        ));
        assert_eq!(
            layout.parse(b"/rune/v1/service/default/web"),
            Parsed::Object(ObjectKey::new(Kind::Service, "default", "web"))
        );
    }
}
