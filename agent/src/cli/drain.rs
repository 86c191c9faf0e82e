//! `rune-agent drain NODE` and `rune-agent undrain NODE` (etcd only): write or
//! delete the node's drain record (`<prefix>drains/<node-id>`, see
//! [`crate::node::drain`]). NODE is matched as `get node NAME` matches it: a node
//! id, else a host name that names exactly one node.

use crate::{
    node::{
        NodeDocument, Timestamp,
        drain::{self, DrainRecord},
    },
    orderedlog::{LogError, etcd::EtcdLog},
};

/// A node `drain` or `undrain` may name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnownNode {
    /// Its id.
    pub id: String,
    /// Its host name.
    pub hostname: String,
}

/// Why a drain or undrain did nothing.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// etcd failed.
    #[error(transparent)]
    Log(#[from] LogError),
    /// No node has that id or host name.
    #[error("no node named {name}: {known}")]
    NotFound {
        /// The name asked for.
        name: String,
        /// The known nodes, or that there is none.
        known: String,
    },
    /// Several nodes have that host name.
    #[error("{name} names several nodes ({ids}): give the node id instead")]
    Ambiguous {
        /// The name asked for.
        name: String,
        /// Their ids, comma-separated.
        ids: String,
    },
}

/// The node `name` names among `known`: the one with that id, else the only one
/// with that host name.
pub fn resolve<'k>(name: &str, known: &'k [KnownNode]) -> Result<&'k KnownNode, DrainError> {
    if let Some(node) = known.iter().find(|n| n.id == name) {
        return Ok(node);
    }
    let matches: Vec<&KnownNode> = known.iter().filter(|n| n.hostname == name).collect();
    match matches[..] {
        [node] => Ok(node),
        [] => {
            let known = if known.is_empty() {
                "no node is registered (a node registers while its agent runs)".to_owned()
            } else {
                let names: Vec<String> = known
                    .iter()
                    .map(|n| format!("{} ({})", n.hostname, n.id))
                    .collect();
                format!("the known nodes are {}", names.join(", "))
            };
            Err(DrainError::NotFound {
                name: name.to_owned(),
                known,
            })
        }
        _ => {
            let ids: Vec<&str> = matches.iter().map(|n| n.id.as_str()).collect();
            Err(DrainError::Ambiguous {
                name: name.to_owned(),
                ids: ids.join(", "),
            })
        }
    }
}

/// The registered nodes whose documents can be read, ordered by host name.
async fn registered(log: &EtcdLog) -> Result<Vec<KnownNode>, LogError> {
    let (_, records) = log.list_nodes(false).await?;
    let mut known: Vec<KnownNode> = records
        .into_iter()
        .filter_map(|r| {
            let doc = NodeDocument::parse(&r.id, &r.value).ok()?;
            Some(KnownNode {
                hostname: if doc.identity.hostname.is_empty() {
                    r.id.clone()
                } else {
                    doc.identity.hostname
                },
                id: r.id,
            })
        })
        .collect();
    known.sort_by(|a, b| (&a.hostname, &a.id).cmp(&(&b.hostname, &b.id)));
    Ok(known)
}

/// `drain NODE`: writes the drain record of a registered node; a node drained
/// already keeps its record (and its time). Returns the line to print.
pub async fn drain(log: &EtcdLog, name: &str) -> Result<String, DrainError> {
    let known = registered(log).await?;
    let node = resolve(name, &known)?;
    let record = DrainRecord {
        node_id: node.id.clone(),
        hostname: node.hostname.clone(),
        since: Timestamp::now(),
        by: drain::operator(),
    };
    Ok(match log.create_drain(&node.id, record.to_json()).await? {
        Ok(revision) => format!(
            "node {} ({}) draining (revision {revision}): its endpoints take no new \
             connections on any node; established ones end within their services' \
             drainSeconds",
            node.hostname, node.id
        ),
        Err(existing) => match DrainRecord::parse(&existing.id, &existing.value) {
            Ok(r) => format!(
                "node {} ({}) is drained already, since {} by {}",
                node.hostname,
                node.id,
                r.since,
                if r.by.is_empty() { "?" } else { &r.by }
            ),
            Err(why) => format!(
                "node {} ({}) has a drain record already, which is not valid ({why}): \
                 undrain it, then drain it again",
                node.hostname, node.id
            ),
        },
    })
}

/// `undrain NODE`: deletes the node's drain record. NODE may also name a drained
/// node that is not registered (its record names it). Returns the line to print.
pub async fn undrain(log: &EtcdLog, name: &str) -> Result<String, DrainError> {
    let mut known = registered(log).await?;
    let (_, drains) = log.list_drains().await?;
    for entry in drains {
        if known.iter().any(|n| n.id == entry.id) {
            continue;
        }
        let hostname = DrainRecord::parse(&entry.id, &entry.value)
            .map(|r| r.hostname)
            .unwrap_or_else(|_| entry.id.clone());
        known.push(KnownNode {
            id: entry.id,
            hostname,
        });
    }
    let node = resolve(name, &known)?;
    Ok(if log.delete_drain(&node.id).await? {
        format!(
            "node {} ({}) undrained: its endpoints take new connections again",
            node.hostname, node.id
        )
    } else {
        format!("node {} ({}) was not drained", node.hostname, node.id)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, hostname: &str) -> KnownNode {
        KnownNode {
            id: id.to_owned(),
            hostname: hostname.to_owned(),
        }
    }

    #[test]
    fn a_node_is_named_by_id_or_by_a_unique_host_name() {
        let known = [
            node("a1", "node-1"),
            node("b2", "node-2"),
            node("c3", "node-2"),
        ];
        assert_eq!(resolve("a1", &known).unwrap().id, "a1");
        assert_eq!(resolve("node-1", &known).unwrap().id, "a1");
        assert_eq!(resolve("c3", &known).unwrap().id, "c3");
        let err = resolve("node-2", &known).unwrap_err().to_string();
        assert_eq!(
            err,
            "node-2 names several nodes (b2, c3): give the node id instead"
        );
        let err = resolve("unknown", &known).unwrap_err().to_string();
        assert_eq!(
            err,
            "no node named unknown: the known nodes are node-1 (a1), node-2 (b2), node-2 (c3)"
        );
        let err = resolve("node-1", &[]).unwrap_err().to_string();
        assert!(err.contains("no node is registered"), "{err}");
    }
}
