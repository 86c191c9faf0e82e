//! Helpers of the etcd tests (`etcd_log.rs`, `etcd_store.rs`, `etcd_tls.rs`): the
//! ordered log on a harness etcd, objects, and waiting for events.

#![allow(dead_code)]

use futures::StreamExt as _;
use rune_agent::{
    model::{Kind, Object, ObjectKey, parse_documents, parse_stored},
    orderedlog::{
        Event, EventStream, LogError, Revision,
        etcd::{EtcdLog, EtcdOptions},
    },
};
use std::time::Duration;

/// How long a watcher may take to see an event (a reconnect waits up to 5 s).
pub const PATIENCE: Duration = Duration::from_secs(20);
/// How long a watcher must stay silent to count as having nothing more.
pub const QUIET: Duration = Duration::from_millis(500);

/// Options for `endpoint` under a prefix of the test's own.
pub fn options(endpoint: &str) -> EtcdOptions {
    let mut o = EtcdOptions::new([endpoint]);
    o.prefix = "/rune-test/v1/".to_owned();
    o
}

/// The log on `endpoint`, with [`options`].
pub async fn connect(endpoint: &str) -> EtcdLog {
    EtcdLog::connect(options(endpoint)).await.expect("connect")
}

/// A service `default/<name>` on port 80 with `vips` (comma-separated, or empty).
pub fn svc(name: &str, vips: &str) -> Object {
    let text = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
         spec: {{ports: [{{port: 80}}], discovery: {{vips: [{vips}]}}}}\n"
    );
    parse_documents(&text).expect("a valid service").remove(0)
}

/// The endpoints of `default/<name>`: `addrs`, each ready.
pub fn eps(name: &str, addrs: &[&str]) -> Object {
    let list: Vec<String> = addrs.iter().map(|a| format!("{{address: {a}}}")).collect();
    let text = format!(
        "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\n\
         spec: {{endpoints: [{}]}}\n",
        list.join(", ")
    );
    parse_documents(&text).expect("valid endpoints").remove(0)
}

/// A service whose port is 0: invalid, built without the checks that would refuse
/// it at parse time (as a client of the local API could send it).
pub fn invalid_svc(name: &str) -> Object {
    parse_stored(&format!(
        r#"{{"apiVersion":"rune/v1","kind":"Service","metadata":{{"name":"{name}","namespace":"default"}},"spec":{{"ports":[{{"port":0}}]}}}}"#
    ))
    .expect("parses without checks")
}

/// The key of `default/<name>` of `kind`.
pub fn key(kind: Kind, name: &str) -> ObjectKey {
    ObjectKey::new(kind, "default", name)
}

/// The next item of `s`, within [`PATIENCE`].
pub async fn next(s: &mut EventStream) -> Result<Event, LogError> {
    tokio::time::timeout(PATIENCE, s.next())
        .await
        .expect("the watch delivered nothing in time")
        .expect("the watch stream ended")
}

/// The next `n` events, which must not be errors.
pub async fn take(s: &mut EventStream, n: usize) -> Vec<Event> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(next(s).await.expect("an event"));
    }
    out
}

/// Fails when `s` delivers anything within [`QUIET`].
pub async fn assert_quiet(s: &mut EventStream) {
    if let Ok(item) = tokio::time::timeout(QUIET, s.next()).await {
        panic!("expected nothing more, got {item:?}");
    }
}

/// Each event as `put <name>@rev` or `delete <name>@rev` (kind in lower case),
/// for comparing sequences.
pub fn describe(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .map(|e| match e {
            Event::Put { revision, object } => {
                let k = object.key();
                format!(
                    "put {} {}@{revision}",
                    k.kind.as_str().to_lowercase(),
                    k.name
                )
            }
            Event::Delete { revision, key } => {
                format!(
                    "delete {} {}@{revision}",
                    key.kind.as_str().to_lowercase(),
                    key.name
                )
            }
            Event::Skipped { revision, key } => format!("skipped {key}@{revision}"),
        })
        .collect()
}

/// The revisions of `events`.
pub fn revisions(events: &[Event]) -> Vec<Revision> {
    events.iter().map(Event::revision).collect()
}
