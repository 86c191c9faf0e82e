//! The CLI's node commands against etcd: `get nodes` (a table, with each node's
//! drain state), `get node NAME` (the whole document as YAML or JSON), and
//! [`wait_applied`], what `apply --wait` waits with until every Ready node has the
//! apply in its kernel.

use crate::{
    node::{
        NodeDocument, Timestamp,
        drain::{DrainRecord, DrainState, longest_drain},
        format_age,
    },
    orderedlog::{
        LogError,
        etcd::{EtcdLog, NodeRecord},
    },
};
use serde::Serialize;
use std::{collections::BTreeSet, io::Write, time::Duration};

mod wait;

pub use wait::{
    Laggard, LaggingNodes, WaitError, parse_timeout, revision_to_wait_for, wait_applied,
};

/// Pause before listing again after the nodes' watch broke.
const REWATCH: Duration = Duration::from_millis(500);

/// A node as stored: its document, or why it could not be read, and its lease.
#[derive(Clone, Debug)]
pub struct NodeEntry {
    /// The node id (the key's last segment).
    pub id: String,
    /// The document, or why the stored value is not one.
    pub document: Result<NodeDocument, String>,
    /// Seconds since the last keep-alive (granted TTL minus remaining), when the
    /// lease is known.
    pub heartbeat_age: Option<Duration>,
    /// Whether the node's key exists (its agent runs); `false` for a drained node
    /// that is not registered, listed for its drain.
    pub registered: bool,
    /// The node's drain, when it is drained.
    pub drain: Option<NodeDrain>,
}

/// A drained node's record and where its drain stands.
#[derive(Clone, Debug)]
pub struct NodeDrain {
    /// The record.
    pub record: DrainRecord,
    /// Draining, or Drained once older than the longest `drainSeconds` among the
    /// services with endpoints on the node.
    pub state: DrainState,
}

impl NodeEntry {
    fn from_record(r: NodeRecord) -> Self {
        Self {
            document: NodeDocument::parse(&r.id, &r.value),
            heartbeat_age: r
                .ttl
                .map(|(left, granted)| Duration::from_secs((granted - left).max(0) as u64)),
            id: r.id,
            registered: true,
            drain: None,
        }
    }

    /// The name shown: the host name, else the drain record's, else the id.
    pub fn name(&self) -> &str {
        match (&self.document, &self.drain) {
            (Ok(d), _) if !d.identity.hostname.is_empty() => &d.identity.hostname,
            (_, Some(drain)) => &drain.record.hostname,
            _ => &self.id,
        }
    }

    /// The STATE column: `Ready`, `NotReady`, `Unknown` (the document cannot be
    /// read) or `Absent` (not registered), then `,Draining` or `,Drained`.
    pub fn state(&self) -> String {
        let base = match &self.document {
            _ if !self.registered => "Absent",
            Ok(d) if d.is_ready() => "Ready",
            Ok(_) => "NotReady",
            Err(_) => "Unknown",
        };
        match &self.drain {
            Some(drain) => format!("{base},{}", drain.state.as_str()),
            None => base.to_owned(),
        }
    }
}

/// Every registered node, and every drained one (registered or not), ordered by
/// name then id. With drains, the objects are read too (the services'
/// `drainSeconds` say when a drain is over).
pub async fn list_nodes(log: &EtcdLog) -> Result<Vec<NodeEntry>, LogError> {
    let (_, records) = log.list_nodes(true).await?;
    let mut entries: Vec<NodeEntry> = records.into_iter().map(NodeEntry::from_record).collect();
    let (_, drains) = log.list_drains().await?;
    if !drains.is_empty() {
        let drains: Vec<DrainRecord> = drains
            .iter()
            .filter_map(|d| match DrainRecord::parse(&d.id, &d.value) {
                Ok(r) => Some(r),
                Err(why) => {
                    eprintln!("warning: {why}");
                    None
                }
            })
            .collect();
        let (_, objects) = log.get(None, None, None).await?;
        let hostnames: BTreeSet<&str> = drains.iter().map(|d| d.hostname.as_str()).collect();
        let longest = longest_drain(&objects, &hostnames);
        for record in drains {
            let limit = longest.get(&record.hostname).copied().unwrap_or_default();
            let drain = NodeDrain {
                state: DrainState::of(record.since.age(), limit),
                record,
            };
            match entries.iter_mut().find(|e| e.id == drain.record.node_id) {
                Some(e) => e.drain = Some(drain),
                None => entries.push(NodeEntry {
                    id: drain.record.node_id.clone(),
                    document: Err(format!(
                        "node {} is not registered (its agent does not run)",
                        drain.record.node_id
                    )),
                    heartbeat_age: None,
                    registered: false,
                    drain: Some(drain),
                }),
            }
        }
    }
    entries.sort_by(|a, b| (a.name(), &a.id).cmp(&(b.name(), &b.id)));
    Ok(entries)
}

/// `get nodes`: NAME, STATE (Ready/NotReady, then Draining/Drained when drained),
/// DATAPLANE, APPLIED and HEARTBEAT (time since the last keep-alive), one node a
/// line.
pub fn write_table(entries: &[NodeEntry], out: &mut dyn Write) -> std::io::Result<()> {
    let mut rows = vec![[
        "NAME".to_owned(),
        "STATE".to_owned(),
        "DATAPLANE".to_owned(),
        "APPLIED".to_owned(),
        "HEARTBEAT".to_owned(),
    ]];
    for e in entries {
        let age = e.heartbeat_age.map_or("-".to_owned(), format_age);
        rows.push(match &e.document {
            Ok(d) => [
                e.name().to_owned(),
                e.state(),
                d.facts.dataplane.mode.clone(),
                d.applied_revision.to_string(),
                age,
            ],
            Err(_) => [
                e.name().to_owned(),
                e.state(),
                "-".to_owned(),
                "-".to_owned(),
                age,
            ],
        });
    }
    let widths: Vec<usize> = (0..5)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        writeln!(out, "{}", line.join("   ").trim_end())?;
    }
    Ok(())
}

/// The shapes `get node NAME -o` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DocumentFormat {
    /// YAML.
    Yaml,
    /// Pretty JSON.
    Json,
}

/// Why `get node NAME` printed nothing.
#[derive(Debug, thiserror::Error)]
pub enum GetNodeError {
    /// etcd failed.
    #[error(transparent)]
    Log(#[from] LogError),
    /// No node has that id or host name.
    #[error("no node named {0} (get nodes lists them)")]
    NotFound(String),
    /// Several nodes have that host name.
    #[error("{name} names several nodes ({ids}): give the node id instead")]
    Ambiguous {
        /// The name asked for.
        name: String,
        /// Their ids, comma-separated.
        ids: String,
    },
    /// The stored value is not a node document.
    #[error("{0}")]
    Invalid(String),
    /// The output could not be written.
    #[error("writing the output: {0}")]
    Output(String),
}

/// A node as `get node(s) -o yaml|json` prints it: its own document, and the
/// admin's drain of it when it is drained.
#[derive(Serialize)]
struct ShownNode<'a> {
    #[serde(flatten)]
    document: &'a NodeDocument,
    #[serde(skip_serializing_if = "Option::is_none")]
    drain: Option<ShownDrain<'a>>,
}

/// A drain as `get node NAME -o yaml|json` prints it.
#[derive(Serialize)]
struct ShownDrain<'a> {
    /// `Draining` or `Drained`, as the table's STATE column says.
    state: &'static str,
    since: Timestamp,
    by: &'a str,
}

impl<'a> ShownNode<'a> {
    /// `entry` as printed, when it has a document.
    fn of(entry: &'a NodeEntry) -> Result<Self, &'a str> {
        let document = entry.document.as_ref().map_err(String::as_str)?;
        Ok(Self {
            document,
            drain: entry.drain.as_ref().map(|d| ShownDrain {
                state: d.state.as_str(),
                since: d.record.since,
                by: &d.record.by,
            }),
        })
    }
}

/// `get node NAME -o yaml|json`: the whole document of the registered node with
/// that id, or else that host name, with its drain when drained.
pub async fn get_node(
    log: &EtcdLog,
    name: &str,
    format: DocumentFormat,
    out: &mut dyn Write,
) -> Result<(), GetNodeError> {
    let entries = list_nodes(log).await?;
    let by_id = entries.iter().find(|e| e.registered && e.id == name);
    let entry = match by_id {
        Some(e) => e,
        None => {
            let matches: Vec<&NodeEntry> = entries
                .iter()
                .filter(|e| {
                    e.document
                        .as_ref()
                        .is_ok_and(|d| d.identity.hostname == name)
                })
                .collect();
            match matches[..] {
                [] => return Err(GetNodeError::NotFound(name.to_owned())),
                [e] => e,
                _ => {
                    let ids: Vec<&str> = matches.iter().map(|e| e.id.as_str()).collect();
                    return Err(GetNodeError::Ambiguous {
                        name: name.to_owned(),
                        ids: ids.join(", "),
                    });
                }
            }
        }
    };
    let shown = ShownNode::of(entry).map_err(|why| GetNodeError::Invalid(why.to_owned()))?;
    let text = match format {
        DocumentFormat::Yaml => serde_yaml_ng::to_string(&shown).map_err(|e| e.to_string()),
        DocumentFormat::Json => serde_json::to_string_pretty(&shown)
            .map(|t| t + "\n")
            .map_err(|e| e.to_string()),
    }
    .map_err(GetNodeError::Output)?;
    out.write_all(text.as_bytes())
        .map_err(|e| GetNodeError::Output(e.to_string()))
}

/// `get nodes -o yaml|json`: every node's whole document with its drain (a JSON
/// array, or YAML documents one after another); a value that is not a node
/// document is named on standard error and left out.
pub fn write_documents(
    entries: &[NodeEntry],
    format: DocumentFormat,
    out: &mut dyn Write,
) -> Result<(), GetNodeError> {
    let mut documents = Vec::with_capacity(entries.len());
    for e in entries.iter().filter(|e| e.registered) {
        match ShownNode::of(e) {
            Ok(d) => documents.push(d),
            Err(why) => eprintln!("warning: node {}: {why}", e.id),
        }
    }
    let text = match format {
        DocumentFormat::Json => serde_json::to_string_pretty(&documents)
            .map(|t| t + "\n")
            .map_err(|e| e.to_string()),
        DocumentFormat::Yaml => documents
            .iter()
            .map(|d| serde_yaml_ng::to_string(d).map(|t| format!("---\n{t}")))
            .collect::<Result<String, _>>()
            .map_err(|e| e.to_string()),
    }
    .map_err(GetNodeError::Output)?;
    out.write_all(text.as_bytes())
        .map_err(|e| GetNodeError::Output(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn the_table_aligns_columns_and_marks_unreadable_documents() {
        let entries = vec![NodeEntry {
            id: "abc".into(),
            document: Err("node abc: not a node document: EOF".into()),
            heartbeat_age: Some(Duration::from_secs(4)),
            registered: true,
            drain: None,
        }];
        let mut out = Vec::new();
        write_table(&entries, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "NAME   STATE     DATAPLANE   APPLIED   HEARTBEAT");
        assert_eq!(lines[1], "abc    Unknown   -           -         4s");
    }

    #[test]
    fn drained_nodes_show_their_drain_state_and_unregistered_ones_their_host_name() {
        let drain = |id: &str, hostname: &str, state| NodeDrain {
            record: DrainRecord {
                node_id: id.into(),
                hostname: hostname.into(),
                since: Timestamp(1_796_000_000),
                by: String::new(),
            },
            state,
        };
        let entries = vec![
            NodeEntry {
                id: "abc".into(),
                document: Err("node abc: not a node document: EOF".into()),
                heartbeat_age: None,
                registered: true,
                drain: Some(drain("abc", "node-1", DrainState::Draining)),
            },
            NodeEntry {
                id: "def".into(),
                document: Err("not registered".into()),
                heartbeat_age: None,
                registered: false,
                drain: Some(drain("def", "node-9", DrainState::Drained)),
            },
        ];
        assert_eq!(entries[0].state(), "Unknown,Draining");
        let mut out = Vec::new();
        write_table(&entries, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[1],
            "node-1   Unknown,Draining   -           -         -"
        );
        assert_eq!(
            lines[2],
            "node-9   Absent,Drained     -           -         -"
        );
        // `-o yaml|json` prints registered nodes' documents only.
        let mut out = Vec::new();
        write_documents(&entries[1..], DocumentFormat::Json, &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "[]\n");
    }

    #[test]
    fn documents_show_the_drain_of_a_drained_node() {
        let document = NodeDocument {
            identity: crate::node::NodeIdentity {
                id: "abc".into(),
                hostname: "node-1".into(),
                labels: BTreeMap::new(),
            },
            addresses: Vec::new(),
            facts: crate::node::facts::Facts::default(),
            conditions: Vec::new(),
            applied_revision: 12,
            heartbeat_time: Timestamp(1_796_000_000),
        };
        let mut entry = NodeEntry {
            id: "abc".into(),
            document: Ok(document),
            heartbeat_age: None,
            registered: true,
            drain: None,
        };
        let json = |entry: &NodeEntry| {
            let mut out = Vec::new();
            write_documents(std::slice::from_ref(entry), DocumentFormat::Json, &mut out).unwrap();
            serde_json::from_slice::<serde_json::Value>(&out).unwrap()[0].clone()
        };
        let shown = json(&entry);
        assert_eq!(shown["appliedRevision"], 12, "{shown}");
        assert!(shown.get("drain").is_none(), "{shown}");
        entry.drain = Some(NodeDrain {
            record: DrainRecord {
                node_id: "abc".into(),
                hostname: "node-1".into(),
                since: Timestamp(1_796_000_000),
                by: "ops@admin".into(),
            },
            state: DrainState::Draining,
        });
        let shown = json(&entry);
        assert_eq!(shown["drain"]["state"], "Draining", "{shown}");
        assert_eq!(shown["drain"]["by"], "ops@admin", "{shown}");
        assert_eq!(shown["identity"]["hostname"], "node-1", "{shown}");
        let mut yaml = Vec::new();
        write_documents(&[entry], DocumentFormat::Yaml, &mut yaml).unwrap();
        let yaml = String::from_utf8(yaml).unwrap();
        assert!(yaml.contains("drain:\n  state: Draining"), "{yaml}");
    }
}
