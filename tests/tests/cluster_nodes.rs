//! What a node's document in etcd says about the node, with a real agent on eBPF
//! (`rune_harness::cluster`): its maps' fill and the `MapPressure` condition.
//!
//! Needs root. Traffic stays in the cluster's namespaces; etcd is on loopback.

use std::{process::Output, time::Duration};

use rune_harness::{
    agent::{agent_bin, eventually_every},
    cluster::{
        POD_TCP_PORT,
        running::{ClusterConfig, RunningCluster},
    },
    netns::require_root,
};
use serde_json::Value;

/// How long an agent may take to become ready.
const READY: Duration = Duration::from_secs(60);
/// The frontends the agent's eBPF maps hold in these tests.
const FRONTENDS: usize = 10;

fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `count` services, one VIP and port each (one frontend each), with an endpoint
/// on node 1's pod.
fn services(c: &RunningCluster, count: usize) -> String {
    let pod = c.topology().nodes()[0].pod_addr();
    (0..count)
        .map(|i| {
            format!(
                "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: s{i}}}\n\
                 spec: {{ports: [{{port: 80, targetPort: {POD_TCP_PORT}}}], discovery: {{vips: [198.18.201.{}]}}}}\n\
                 ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: s{i}}}\n\
                 spec: {{endpoints: [{{address: {pod}}}]}}\n---\n",
                i + 1
            )
        })
        .collect()
}

/// Node 1's document as `get node node-1 -o json` prints it.
fn document(c: &RunningCluster) -> Value {
    let text = ok(
        &c.cli(&["get", "node", "node-1", "-o", "json"], None),
        "get node",
    );
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// The condition `kind` of `doc`: (status, message).
fn condition(doc: &Value, kind: &str) -> (String, String) {
    let c = doc["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == kind))
        .unwrap_or_else(|| panic!("no condition {kind} in {doc}"));
    (
        c["status"].as_str().unwrap().to_owned(),
        c["message"].as_str().unwrap().to_owned(),
    )
}

/// The map `name` of `doc`'s facts: (used, capacity).
fn map(doc: &Value, name: &str) -> (u64, u64) {
    let m = doc["facts"]["maps"]
        .as_array()
        .and_then(|ms| ms.iter().find(|m| m["name"] == name))
        .unwrap_or_else(|| panic!("no map {name} in {doc}"));
    (m["used"].as_u64().unwrap(), m["capacity"].as_u64().unwrap())
}

/// Polls `check` every 200 ms (each is a CLI run) until it returns `Some`, at
/// most `patience`.
fn eventually<T>(patience: Duration, what: &str, check: impl FnMut() -> Option<T>) -> T {
    eventually_every(Duration::from_millis(200), patience, what, check)
}

#[test]
fn map_pressure_follows_the_fill_of_the_ebpf_maps() {
    require_root().unwrap();
    let mut config = ClusterConfig::new(1, agent_bin());
    config.extra_args = vec!["--lb-max-frontends".into(), FRONTENDS.to_string()];
    let c = RunningCluster::start(config, READY).unwrap();

    // 8 of 10 frontends: below 90 %.
    ok(
        &c.cli(&["apply", "-f", "-", "--wait=20s"], Some(&services(&c, 8))),
        "apply 8",
    );
    let doc = eventually(Duration::from_secs(10), "8 frontends in the facts", || {
        let doc = document(&c);
        (map(&doc, "frontends") == (8, FRONTENDS as u64)).then_some(doc)
    });
    let (status, message) = condition(&doc, "MapPressure");
    assert_eq!(status, "False", "{message}");
    let (_, v4_capacity) = map(&doc, "conntrack_v4");
    assert!(v4_capacity > 0, "{doc}");

    // 9 of 10: MapPressure names the map.
    ok(
        &c.cli(&["apply", "-f", "-", "--wait=20s"], Some(&services(&c, 9))),
        "apply 9",
    );
    let (status, message) = eventually(Duration::from_secs(10), "MapPressure True", || {
        let doc = document(&c);
        let (status, message) = condition(&doc, "MapPressure");
        (status == "True").then_some((status, message))
    });
    assert!(message.contains("frontends 9/10"), "{status}: {message}");
    let yaml = ok(
        &c.cli(&["get", "node", "node-1", "-o", "yaml"], None),
        "get node -o yaml",
    );
    assert!(yaml.contains("name: frontends"), "{yaml}");

    // Back to 8: False again.
    ok(&c.cli(&["delete", "service", "s8"], None), "delete s8");
    eventually(Duration::from_secs(10), "MapPressure False again", || {
        let doc = document(&c);
        (condition(&doc, "MapPressure").0 == "False").then_some(())
    });
}
