//! Drains: a node taken out of service by the admin (`rune-agent drain NODE`)
//! without stopping it. The record lives under `<prefix>drains/<node-id>` (written
//! only by the admin; every agent reads it), names the node by id **and** host
//! name, and says since when and by whom.
//!
//! Endpoints name their node by host name (`node: node-1`), so agents match a
//! record's [`DrainRecord::hostname`] against [`crate::model::Endpoint::node`]; the
//! id is the key, so that two records cannot name one node. Every agent treats
//! those endpoints as terminating ([`crate::endpoints`]) until the record is
//! deleted (`rune-agent undrain NODE`).
//!
//! A drain is [`DrainState::Draining`] until it is older than the longest
//! `drainSeconds` among the services with endpoints on the node (the longest any
//! data plane keeps an established flow to them) plus [`DRAIN_MARGIN`], then
//! [`DrainState::Drained`].

use super::Timestamp;
use crate::model::{Object, ServiceKey};
use serde::{Deserialize, Serialize};
use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

/// What a drain waits beyond the longest `drainSeconds` before it counts as
/// Drained: its age counts whole seconds (a second may be missing from it), and the
/// eBPF data plane ends drains on a one-second tick.
pub const DRAIN_MARGIN: Duration = Duration::from_secs(2);

/// What `<prefix>drains/<node-id>` holds (JSON, camelCase).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DrainRecord {
    /// The drained node's id (also the key's last segment).
    pub node_id: String,
    /// Its host name when drained: what endpoints name it by.
    pub hostname: String,
    /// When the drain began.
    pub since: Timestamp,
    /// Who drained it (`user@host` of the command; informational).
    #[serde(default)]
    pub by: String,
}

impl DrainRecord {
    /// Parses a stored record, saying which node's it is when it is not one.
    pub fn parse(id: &str, bytes: &[u8]) -> Result<DrainRecord, String> {
        let record: DrainRecord = serde_json::from_slice(bytes)
            .map_err(|e| format!("drain record of node {id}: not a drain record: {e}"))?;
        if record.hostname.is_empty() {
            return Err(format!("drain record of node {id}: no hostname"));
        }
        Ok(record)
    }

    /// The record as stored.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// Where a drain stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainState {
    /// New flows avoid the node; established ones may still be running.
    Draining,
    /// Older than the longest `drainSeconds` of its services and
    /// [`DRAIN_MARGIN`]: the data planes that end draining flows have ended them.
    Drained,
}

impl DrainState {
    /// The state of a drain `age` old (whole seconds) whose node's services keep
    /// flows at most `longest`.
    pub fn of(age: Duration, longest: Duration) -> DrainState {
        if age >= longest + DRAIN_MARGIN {
            DrainState::Drained
        } else {
            DrainState::Draining
        }
    }

    /// `Draining` or `Drained`.
    pub fn as_str(self) -> &'static str {
        match self {
            DrainState::Draining => "Draining",
            DrainState::Drained => "Drained",
        }
    }
}

/// For each of `hostnames`, the longest `drainSeconds` among the services (in
/// `objects`: Services and Endpoints) with an endpoint on that node; nodes without
/// any are absent.
pub fn longest_drain(objects: &[Object], hostnames: &BTreeSet<&str>) -> BTreeMap<String, Duration> {
    let mut drain: BTreeMap<ServiceKey, u32> = BTreeMap::new();
    for o in objects {
        if let Object::Service(s) = o {
            drain.insert(s.key(), s.spec.drain_seconds);
        }
    }
    let mut longest: BTreeMap<String, Duration> = BTreeMap::new();
    for o in objects {
        let Object::Endpoints(eps) = o else { continue };
        let Some(seconds) = drain.get(&o.key().service()) else {
            continue;
        };
        for e in &eps.spec.endpoints {
            if hostnames.contains(&*e.node) {
                let d = Duration::from_secs(u64::from(*seconds));
                let slot = longest.entry(e.node.to_string()).or_default();
                *slot = (*slot).max(d);
            }
        }
    }
    longest
}

/// `user@host` of this process, for [`DrainRecord::by`].
pub fn operator() -> String {
    let user = std::env::var("SUDO_USER")
        .or_else(|_| std::env::var("USER"))
        .unwrap_or_else(|_| format!("uid {}", real_uid()));
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    if host.is_empty() {
        user
    } else {
        format!("{user}@{host}")
    }
}

/// This process's real user id, from `/proc/self/status`.
fn real_uid() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|rest| rest.split_whitespace().next().map(str::to_owned))
        })
        .unwrap_or_else(|| "?".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::parse_documents;

    #[test]
    fn a_record_round_trips_and_needs_a_hostname() {
        let record = DrainRecord {
            node_id: "abc".into(),
            hostname: "node-1".into(),
            since: Timestamp(1_796_000_000),
            by: "ops@admin".into(),
        };
        let json = String::from_utf8(record.to_json()).unwrap();
        assert!(json.contains("\"nodeId\":\"abc\""), "{json}");
        assert!(json.contains("\"since\":\"2026-"), "RFC 3339: {json}");
        assert_eq!(DrainRecord::parse("abc", json.as_bytes()).unwrap(), record);
        let err = DrainRecord::parse(
            "abc",
            br#"{"nodeId":"abc","hostname":"","since":"2026-12-02T05:00:00Z"}"#,
        )
        .unwrap_err();
        assert!(err.contains("no hostname"), "{err}");
        let err = DrainRecord::parse("abc", b"{}").unwrap_err();
        assert!(err.contains("drain record of node abc"), "{err}");
    }

    #[test]
    fn the_state_turns_drained_after_the_longest_drain_of_the_nodes_services() {
        let objects = parse_documents(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {name: a}\nspec: {ports: [{port: 80}], drainSeconds: 2}\n\
             ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: a}\n\
             spec: {endpoints: [{address: 198.18.1.1, node: node-1}, {address: 198.18.2.1, node: node-2}]}\n\
             ---\napiVersion: rune/v1\nkind: Service\nmetadata: {name: b}\nspec: {ports: [{port: 80}], drainSeconds: 9}\n\
             ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: b}\n\
             spec: {endpoints: [{address: 198.18.2.2, node: node-2}]}\n\
             ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: orphan}\n\
             spec: {endpoints: [{address: 198.18.1.9, node: node-1}]}\n",
        )
        .unwrap();
        let longest = longest_drain(&objects, &BTreeSet::from(["node-1", "node-2", "node-3"]));
        assert_eq!(longest.get("node-1"), Some(&Duration::from_secs(2)));
        assert_eq!(longest.get("node-2"), Some(&Duration::from_secs(9)));
        assert_eq!(
            longest.get("node-3"),
            None,
            "no endpoints: nothing to wait for"
        );

        let secs = Duration::from_secs;
        assert_eq!(DrainState::of(secs(3), secs(2)), DrainState::Draining);
        assert_eq!(DrainState::of(secs(4), secs(2)), DrainState::Drained);
        assert_eq!(DrainState::of(secs(1), secs(0)), DrainState::Draining);
        assert_eq!(DrainState::of(secs(2), secs(0)), DrainState::Drained);
    }
}
