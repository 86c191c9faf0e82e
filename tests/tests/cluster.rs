//! Several nodes on one etcd (`rune_harness::cluster`): agents in their own node
//! namespaces, eBPF on each node's pod interface, etcd with TLS, client
//! certificates per node and etcd roles. A service whose endpoints are pods on
//! nodes 1 and 2 is reached from the pod on node 3; `apply --wait` returns once
//! every node has the change in its kernel; an agent killed with SIGKILL leaves its
//! data plane serving and its node goes away with its lease; an etcd outage loses
//! no request; compaction while an agent is stopped is resynced on its restart; a
//! drained node takes no new connections but keeps its established ones, and
//! `undrain` brings it back.
//!
//! Needs root. Traffic stays in the cluster's namespaces; etcd is on loopback.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    process::Output,
    time::{Duration, Instant},
};

use rune_harness::{
    agent::{agent_bin, eventually_every, run_cli},
    cluster::{
        POD_TCP_PORT,
        running::{ClusterConfig, RunningCluster},
    },
    netns::require_root,
};

const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 200, 10);
const VIP_PORT: u16 = 80;
/// How long an agent may take to become ready.
const READY: Duration = Duration::from_secs(60);

fn vip() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(VIP), VIP_PORT)
}

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

/// The service on the VIP, with endpoints on the pods of `nodes` (0-based).
fn service_yaml(c: &RunningCluster, nodes: &[usize]) -> String {
    service_yaml_draining(c, nodes, None)
}

/// [`service_yaml`] with `drainSeconds` when given.
fn service_yaml_draining(c: &RunningCluster, nodes: &[usize], drain: Option<u32>) -> String {
    let eps: Vec<String> = nodes
        .iter()
        .map(|&i| {
            let n = &c.topology().nodes()[i];
            format!("{{address: {}, node: {}}}", n.pod_addr(), n.name())
        })
        .collect();
    let drain = drain.map_or(String::new(), |d| format!(", drainSeconds: {d}"));
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: hello}}\n\
         spec: {{ports: [{{port: {VIP_PORT}, targetPort: {POD_TCP_PORT}}}], discovery: {{vips: [{VIP}]}}{drain}}}\n\
         ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: hello}}\n\
         spec: {{endpoints: [{}]}}\n",
        eps.join(", ")
    )
}

/// `apply -f - --wait=20s` as the admin.
fn apply_wait(c: &RunningCluster, yaml: &str) -> String {
    ok(
        &c.cli(&["apply", "-f", "-", "--wait=20s"], Some(yaml)),
        "apply --wait",
    )
}

/// The pods answering `count` new connections to the VIP from node `from`'s pod.
fn answering_pods(c: &RunningCluster, from: usize, count: usize) -> BTreeSet<String> {
    let node = &c.topology().nodes()[from];
    (0..count)
        .map(|i| {
            let reply = node
                .request_from_pod(vip(), &format!("r{i}"))
                .unwrap_or_else(|e| panic!("request {i} from {}: {e:#}", node.name()));
            reply.split(' ').next().unwrap().to_owned()
        })
        .collect()
}

fn start(nodes: usize, lease_seconds: Option<u64>) -> RunningCluster {
    require_root().unwrap();
    let mut config = ClusterConfig::new(nodes, agent_bin());
    config.lease_seconds = lease_seconds;
    RunningCluster::start(config, READY).unwrap()
}

#[test]
fn a_service_with_endpoints_on_two_nodes_is_reached_from_a_third_and_apply_wait_is_live_everywhere()
{
    let c = start(3, None);
    c.topology()
        .wait_connected(Duration::from_secs(10))
        .unwrap();
    apply_wait(&c, &service_yaml(&c, &[0, 1]));
    let pods = answering_pods(&c, 2, 40);
    assert_eq!(
        pods,
        BTreeSet::from(["pod-1".to_owned(), "pod-2".to_owned()]),
        "through the VIP from node-3"
    );

    // A change with --wait: live on every node when the command returns (the
    // clients are pods that are not the backend: a pod reaching itself through a
    // VIP, hairpin, needs source NAT the data plane does not do).
    apply_wait(&c, &service_yaml(&c, &[1]));
    for from in [0, 2] {
        let pods = answering_pods(&c, from, 20);
        assert_eq!(
            pods,
            BTreeSet::from(["pod-2".to_owned()]),
            "from node-{}",
            from + 1
        );
    }

    let nodes = ok(&c.cli(&["get", "nodes"], None), "get nodes");
    for i in 1..=3 {
        assert!(nodes.contains(&format!("node-{i}")), "{nodes}");
    }
    assert_eq!(
        nodes.matches("Ready").count() - nodes.matches("NotReady").count(),
        3,
        "{nodes}"
    );
}

#[test]
fn a_killed_agent_leaves_its_data_plane_serving_its_node_goes_and_it_rejoins() {
    let lease = 4;
    let mut c = start(3, Some(lease));
    c.topology()
        .wait_connected(Duration::from_secs(10))
        .unwrap();
    apply_wait(&c, &service_yaml(&c, &[0, 1]));

    c.kill_agent(2);
    // Node-3's pinned data plane keeps serving its pod without its agent.
    let pods = answering_pods(&c, 2, 20);
    assert_eq!(pods.len(), 2, "{pods:?}");
    // Its node key goes with its lease.
    let deadline = Instant::now() + Duration::from_secs(lease * 3 + 5);
    let id = c.node_id(2).to_owned();
    loop {
        let nodes = ok(&c.cli(&["get", "nodes", "-o", "json"], None), "get nodes");
        if !nodes.contains(&id) {
            break;
        }
        assert!(Instant::now() < deadline, "node-3 still listed: {nodes}");
        std::thread::sleep(Duration::from_millis(500));
    }
    // A change while it is away: --wait waits for the Ready nodes only.
    apply_wait(&c, &service_yaml(&c, &[0]));

    c.start_agent(2).unwrap();
    c.agent(2).try_wait_ready(READY).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let nodes = ok(&c.cli(&["get", "nodes", "-o", "json"], None), "get nodes");
        if nodes.contains(&id) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not re-registered with the same id: {nodes}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // It caught up with the change made while it was away.
    let pods = answering_pods(&c, 2, 10);
    assert_eq!(pods, BTreeSet::from(["pod-1".to_owned()]));
}

#[test]
fn an_etcd_outage_loses_no_request_and_a_change_after_it_is_live_within_two_seconds() {
    let mut c = start(3, None);
    c.topology()
        .wait_connected(Duration::from_secs(10))
        .unwrap();
    apply_wait(&c, &service_yaml(&c, &[0, 1]));
    // A connection established before the outage must live through it.
    let mut long = c.topology().nodes()[2].open_from_pod(vip()).unwrap();
    long.exchange("before").unwrap();

    c.etcd().stop();
    let until = Instant::now() + Duration::from_secs(10);
    let (mut sent, mut failed) = (0, Vec::new());
    while Instant::now() < until && sent < 5_000 {
        if let Err(e) = c.topology().nodes()[2].request_from_pod(vip(), "during") {
            failed.push(format!("{e:#}"));
        }
        sent += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        failed.is_empty(),
        "{} of {sent} requests failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    for i in 0..3 {
        let (code, _) = c.agent(i).http_get("/readyz").unwrap();
        assert_eq!(
            code,
            200,
            "node-{} must stay ready while etcd is away",
            i + 1
        );
    }
    c.etcd().start_again();
    long.exchange("after").unwrap();

    // The first change after etcd returns reaches every node once its watch is
    // back (a retry at most a second apart); its time is printed, not asserted.
    let t = Instant::now();
    apply_wait(&c, &service_yaml(&c, &[0]));
    eprintln!(
        "first change after the outage live everywhere after {:?}",
        t.elapsed()
    );
    // With every watch back, a change is live everywhere within 2 s.
    ok(
        &c.cli(
            &["apply", "-f", "-", "--wait=2s"],
            Some(&service_yaml(&c, &[1])),
        ),
        "apply --wait=2s after the outage",
    );
    let pods = answering_pods(&c, 0, 10);
    assert_eq!(pods, BTreeSet::from(["pod-2".to_owned()]));
}

/// Long-lived connections from node `from`'s pod through the VIP, until some
/// reach each of `pods` (at most 64).
fn long_lived_to_each(
    c: &RunningCluster,
    from: usize,
    pods: &[&str],
) -> Vec<(String, rune_harness::topology::LongLived)> {
    let mut conns = Vec::new();
    for i in 0..64 {
        let mut conn = c.topology().nodes()[from].open_from_pod(vip()).unwrap();
        let reply = conn.exchange(&format!("open {i}")).unwrap();
        let pod = reply.split(' ').next().unwrap().to_owned();
        conns.push((pod, conn));
        if pods.iter().all(|p| conns.iter().any(|(q, _)| q == p)) {
            return conns;
        }
    }
    panic!("64 connections did not reach each of {pods:?}");
}

/// Every connection still answers, from its own pod.
fn all_answer(conns: &mut [(String, rune_harness::topology::LongLived)], when: &str) {
    for (pod, conn) in conns.iter_mut() {
        let reply = conn
            .exchange(when)
            .unwrap_or_else(|e| panic!("a connection to {pod} {when}: {e:#}"));
        assert_eq!(reply, format!("{pod} {when}"));
    }
}

#[test]
fn compaction_of_history_agents_need_is_resynced_with_no_flow_dropped() {
    let mut c = start(3, None);
    c.topology()
        .wait_connected(Duration::from_secs(10))
        .unwrap();
    apply_wait(&c, &service_yaml(&c, &[0, 1]));
    // The clients are node-3's pod; node-3's agent is stopped, and node-1's is cut
    // off etcd while it runs (its watch must resume from compacted history).
    let mut conns = long_lived_to_each(&c, 2, &["pod-1", "pod-2"]);

    c.stop_agent(2, Duration::from_secs(20));
    c.topology().nodes()[0].cut_etcd();
    for round in 0..5 {
        let nodes: &[usize] = if round % 2 == 0 { &[0] } else { &[0, 1] };
        ok(
            &c.cli(&["apply", "-f", "-"], Some(&service_yaml(&c, nodes))),
            "apply",
        );
    }
    all_answer(&mut conns, "after-the-changes");
    let rev = c.etcd().revision();
    c.etcd().compact(rev);

    c.topology().nodes()[0].reconnect_etcd();
    // The last change (round 4) left pod-1 only: node-3's agent, restarted on its
    // pinned maps, lets the flows to pod-2 drain as a running agent would have.
    c.start_agent(2).unwrap();
    c.agent(2).try_wait_ready(READY).unwrap();
    all_answer(&mut conns, "after-the-restart");
    // A change every node applies, node-1 after a resync from a new snapshot.
    apply_wait(&c, &service_yaml(&c, &[0, 1]));
    let log = c.agent(0).log();
    assert!(
        log.contains("compacted") && log.contains("taking a new snapshot"),
        "node-1 did not resync after the compaction: {log}"
    );
    let pods = answering_pods(&c, 2, 30);
    assert_eq!(pods.len(), 2, "{pods:?}");
    all_answer(&mut conns, "at-the-end");
}

/// The line of `get nodes` naming `node`.
fn node_line(c: &RunningCluster, node: &str) -> String {
    let table = ok(&c.cli(&["get", "nodes"], None), "get nodes");
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(node))
        .unwrap_or_else(|| panic!("no line for {node} in:\n{table}"))
        .to_owned()
}

/// Polls `check` every 200 ms (each is a CLI run) until it returns `Some`, at
/// most `patience`.
fn eventually<T>(patience: Duration, what: &str, check: impl FnMut() -> Option<T>) -> T {
    eventually_every(Duration::from_millis(200), patience, what, check)
}

#[test]
fn a_drained_node_takes_no_new_connections_keeps_established_ones_and_undrain_restores_it() {
    let c = start(3, None);
    c.topology()
        .wait_connected(Duration::from_secs(10))
        .unwrap();
    apply_wait(&c, &service_yaml_draining(&c, &[0, 1], Some(2)));
    // From node-3's pod, a connection that reached pod-1 before the drain.
    let client = &c.topology().nodes()[2];
    let mut long = (0..100)
        .find_map(|i| {
            let mut conn = client.open_from_pod(vip()).unwrap();
            let reply = conn.exchange(&format!("open {i}")).unwrap();
            reply.starts_with("pod-1 ").then_some(conn)
        })
        .expect("no connection of 100 reached pod-1");

    // Unknown nodes are refused, naming the known ones.
    let out = c.cli(&["drain", "unknown"], None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "drain unknown succeeded: {stderr}");
    assert!(
        stderr.contains("no node named unknown")
            && (1..=3).all(|i| stderr.contains(&format!("node-{i} ("))),
        "{stderr}"
    );

    // Only the admin writes drains: a node's certificate is refused by etcd.
    let mut as_node: Vec<String> = vec!["drain".into(), "node-1".into()];
    as_node.extend(c.admin_etcd_args());
    let certs = c.certs_dir();
    let (cert, key) = (as_node.len() - 3, as_node.len() - 1);
    as_node[cert] = certs
        .join(format!("node-{}.pem", c.node_id(2)))
        .display()
        .to_string();
    as_node[key] = certs
        .join(format!("node-{}-key.pem", c.node_id(2)))
        .display()
        .to_string();
    let tmp = tempfile::tempdir().unwrap();
    let as_node: Vec<&str> = as_node.iter().map(String::as_str).collect();
    let out = run_cli(&agent_bin(), None, tmp.path(), &as_node, None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("permission denied"),
        "a node's certificate drained a node: {stderr}"
    );

    let said = ok(&c.cli(&["drain", "node-1"], None), "drain node-1");
    assert!(
        said.contains("node-1") && said.contains("draining"),
        "{said}"
    );
    // Draining for drainSeconds (2) and a margin.
    let line = node_line(&c, "node-1");
    assert!(line.contains("Ready,Draining"), "{line}");
    let yaml = ok(
        &c.cli(&["get", "node", "node-1", "-o", "yaml"], None),
        "get node -o yaml",
    );
    assert!(yaml.contains("\ndrain:\n  state: Drain"), "{yaml}");
    // New connections all go to pod-2 once node-3 has the drain, while the
    // established one stays on pod-1 (within the service's drainSeconds: 2).
    eventually(
        Duration::from_secs(2),
        "new connections avoid pod-1",
        || (answering_pods(&c, 2, 5) == BTreeSet::from(["pod-2".to_owned()])).then_some(()),
    );
    let reply = long.exchange("during the drain").unwrap();
    assert!(reply.starts_with("pod-1 "), "{reply}");
    let pods = answering_pods(&c, 2, 40);
    assert_eq!(
        pods,
        BTreeSet::from(["pod-2".to_owned()]),
        "after the drain"
    );

    for other in ["node-2", "node-3"] {
        let line = node_line(&c, other);
        assert!(!line.contains("Drain"), "{line}");
    }
    // A second drain keeps the first one's time.
    let again = ok(&c.cli(&["drain", "node-1"], None), "drain node-1 again");
    assert!(again.contains("drained already"), "{again}");

    // Drained once older than drainSeconds (and a margin): the flow is gone.
    eventually(Duration::from_secs(10), "node-1 Drained", || {
        node_line(&c, "node-1")
            .contains("Ready,Drained")
            .then_some(())
    });
    assert!(
        long.exchange("after the drain").is_err(),
        "the flow to the drained pod outlived drainSeconds"
    );

    let said = ok(&c.cli(&["undrain", "node-1"], None), "undrain node-1");
    assert!(said.contains("undrained"), "{said}");
    eventually(
        Duration::from_secs(10),
        "new connections reach pod-1 again",
        || answering_pods(&c, 2, 20).contains("pod-1").then_some(()),
    );
    let line = node_line(&c, "node-1");
    assert!(!line.contains("Drain"), "{line}");
    let yaml = ok(
        &c.cli(&["get", "node", "node-1", "-o", "yaml"], None),
        "get node -o yaml",
    );
    assert!(!yaml.contains("drain:"), "{yaml}");
    let again = ok(&c.cli(&["undrain", "node-1"], None), "undrain node-1 again");
    assert!(again.contains("was not drained"), "{again}");
}
