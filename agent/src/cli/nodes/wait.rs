//! What `apply --wait` waits with: until every Ready node reports the apply's
//! revision in its kernel, or the timeout names the nodes behind.

use super::REWATCH;
use crate::{
    node::NodeDocument,
    orderedlog::{
        LogError, Revision,
        etcd::{EtcdLog, NodeChange},
        store::{ApplyOutcome, Change},
    },
};
use futures::StreamExt;
use std::{
    collections::BTreeMap,
    fmt,
    time::{Duration, Instant},
};

/// Parses `apply --wait`'s timeout: `90`, `90s`, `500ms`, `2m`.
pub fn parse_timeout(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let (number, unit) = match t.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => t.split_at(i),
        None => (t, "s"),
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (e.g. 30s, 500ms, 2m)"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        _ => return Err(format!("{text:?}: unit {unit:?} is not ms, s or m")),
    };
    if d.is_zero() {
        return Err(format!("{text:?}: the timeout must be above zero"));
    }
    Ok(d)
}

/// A Ready node that had not applied the revision when the wait ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Laggard {
    /// Its host name (else its id).
    pub name: String,
    /// Its id.
    pub id: String,
    /// Its applied revision.
    pub applied: Revision,
}

/// The Ready nodes that had not applied `revision` within the timeout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaggingNodes {
    /// The revision waited for.
    pub revision: Revision,
    /// How long it waited.
    pub timeout: Duration,
    /// The nodes behind, ordered by name.
    pub lagging: Vec<Laggard>,
}

impl fmt::Display for LaggingNodes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<String> = self
            .lagging
            .iter()
            .map(|l| format!("{} ({}) at {}", l.name, l.id, l.applied))
            .collect();
        write!(
            f,
            "revision {} is not applied on every Ready node after {:?}: {} behind: {}",
            self.revision,
            self.timeout,
            self.lagging.len(),
            nodes.join(", ")
        )
    }
}

impl std::error::Error for LaggingNodes {}

/// Why [`wait_applied`] gave up.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// Ready nodes were still behind at the timeout.
    #[error(transparent)]
    Lagging(#[from] LaggingNodes),
    /// etcd could not be read until the timeout.
    #[error("waiting for the nodes: {0}")]
    Log(#[from] LogError),
    /// No node was Ready until the timeout: nothing can have applied the change.
    #[error(
        "revision {revision} was written, but no node was Ready within {timeout:?} to apply \
         it (`rune-agent get nodes` lists them)"
    )]
    NoReadyNode {
        /// The revision waited for.
        revision: Revision,
        /// How long it waited.
        timeout: Duration,
    },
}

/// The revision `apply --wait` waits for after `outcome`: `None` when the apply
/// changed nothing. Its revision is then etcd's current one, which may be a node
/// document's write that no object watch ever applies (the nodes' subtree is
/// skipped), so waiting for it could only time out.
pub fn revision_to_wait_for(outcome: &ApplyOutcome) -> Option<Revision> {
    outcome
        .results
        .iter()
        .any(|(_, change)| *change != Change::Unchanged)
        .then_some(outcome.revision)
}

/// Waits until every Ready node's applied revision is at least `revision`
/// (`apply --wait`), following the nodes' keys with a watch (no polling). Nodes
/// that are not Ready, and nodes that register meanwhile, count only while Ready;
/// a node whose key vanishes (stopped, or dead for a lease's TTL) no longer
/// counts. Returns how many Ready nodes have it.
pub async fn wait_applied(
    log: &EtcdLog,
    revision: Revision,
    timeout: Duration,
) -> Result<usize, WaitError> {
    let deadline = Instant::now() + timeout;
    let mut nodes: BTreeMap<String, NodeDocument> = BTreeMap::new();
    let mut last_error: Option<LogError> = None;
    loop {
        let listed = tokio::time::timeout_at(deadline.into(), log.list_nodes(false)).await;
        let at = match listed {
            Err(_) => return Err(give_up(&nodes, revision, timeout, last_error)),
            Ok(Err(e)) => {
                last_error = Some(e);
                if !pause(deadline).await {
                    return Err(give_up(&nodes, revision, timeout, last_error));
                }
                continue;
            }
            Ok(Ok((at, records))) => {
                nodes = records
                    .into_iter()
                    .filter_map(|r| {
                        Some((r.id.clone(), NodeDocument::parse(&r.id, &r.value).ok()?))
                    })
                    .collect();
                at
            }
        };
        if let Some(n) = settled(&nodes, revision) {
            return Ok(n);
        }
        let mut changes = match log.watch_nodes(at).await {
            Ok(s) => s,
            Err(e) => {
                last_error = Some(e);
                if !pause(deadline).await {
                    return Err(give_up(&nodes, revision, timeout, last_error));
                }
                continue;
            }
        };
        loop {
            let next = tokio::time::timeout_at(deadline.into(), changes.next()).await;
            match next {
                Err(_) => return Err(give_up(&nodes, revision, timeout, None)),
                Ok(Some(Ok(NodeChange::Put(r)))) => {
                    if let Ok(doc) = NodeDocument::parse(&r.id, &r.value) {
                        nodes.insert(r.id, doc);
                    }
                }
                Ok(Some(Ok(NodeChange::Delete { id, .. }))) => {
                    nodes.remove(&id);
                }
                Ok(Some(Err(e))) => {
                    last_error = Some(e);
                    break;
                }
                Ok(None) => break,
            }
            if let Some(n) = settled(&nodes, revision) {
                return Ok(n);
            }
        }
        if !pause(deadline).await {
            return Err(give_up(&nodes, revision, timeout, last_error));
        }
    }
}

/// Waits [`REWATCH`] before the next try: false when `deadline` comes first.
async fn pause(deadline: Instant) -> bool {
    tokio::time::timeout_at(deadline.into(), tokio::time::sleep(REWATCH))
        .await
        .is_ok()
}

/// How many Ready nodes there are, when none of them is behind `revision`.
fn settled(nodes: &BTreeMap<String, NodeDocument>, revision: Revision) -> Option<usize> {
    let ready = nodes.values().filter(|d| d.is_ready());
    let mut count = 0;
    for d in ready {
        if d.applied_revision < revision {
            return None;
        }
        count += 1;
    }
    // No Ready node is not "every node has it": wait for one (or the timeout).
    (count > 0).then_some(count)
}

/// The error at the timeout: the laggards, or etcd's failure when nothing could
/// be read.
fn give_up(
    nodes: &BTreeMap<String, NodeDocument>,
    revision: Revision,
    timeout: Duration,
    error: Option<LogError>,
) -> WaitError {
    let mut lagging: Vec<Laggard> = nodes
        .iter()
        .filter(|(_, d)| d.is_ready() && d.applied_revision < revision)
        .map(|(id, d)| Laggard {
            name: if d.identity.hostname.is_empty() {
                id.clone()
            } else {
                d.identity.hostname.clone()
            },
            id: id.clone(),
            applied: d.applied_revision,
        })
        .collect();
    lagging.sort_by(|a, b| (&a.name, &a.id).cmp(&(&b.name, &b.id)));
    match error {
        Some(e) if lagging.is_empty() => WaitError::Log(e),
        None if lagging.is_empty() => WaitError::NoReadyNode { revision, timeout },
        _ => WaitError::Lagging(LaggingNodes {
            revision,
            timeout,
            lagging,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Kind, ObjectKey};

    #[test]
    fn an_apply_that_changed_nothing_is_not_waited_for() {
        let key = ObjectKey::new(Kind::Service, "default", "web");
        let mut outcome = ApplyOutcome {
            revision: 42,
            results: vec![(key.clone(), Change::Unchanged)],
        };
        assert_eq!(revision_to_wait_for(&outcome), None);
        outcome.results.push((key, Change::Configured));
        assert_eq!(revision_to_wait_for(&outcome), Some(42));
    }

    #[test]
    fn no_ready_node_is_not_every_node_having_it() {
        let none = BTreeMap::new();
        assert_eq!(settled(&none, 7), None);
        let err = give_up(&none, 7, Duration::from_secs(1), None);
        assert!(
            matches!(err, WaitError::NoReadyNode { revision: 7, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("no node was Ready"), "{err}");
    }
}
