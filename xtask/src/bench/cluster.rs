//! `cargo xtask bench cluster` (root): the multi-node figures on a dev cluster
//! (`rune_harness::cluster::running`: etcd with TLS on loopback, agents in node
//! namespaces, each reaching etcd through a relay that counts its bytes).
//!
//! * **apply → acknowledged by every node**: [`CHANGES`] endpoint changes, each
//!   `rune-agent apply -f - --wait` (the CLI writes the change to etcd, then watches
//!   the node keys until every Ready node's `appliedRevision` reaches the write's
//!   revision); the command's wall time, p50 and p99, at N = 3 (eBPF data plane) and
//!   N = 20 (the userspace data plane: twenty eBPF loads do not fit two cores'
//!   start-up budget; the acknowledgement path is the same).
//! * **a new node joins a cluster of 10,000 services × 10 endpoints**: etcd is
//!   filled through the CLI (applies of [`JOIN_CHUNK`] services), then the agent of
//!   a node that never ran starts (eBPF): spawn → its `rune_applied_revision`
//!   reaches etcd's revision.
//! * **steady-state etcd traffic per node per heartbeat**: three idle agents for
//!   [`IDLE`]; the bytes through each node's relay (TLS records both ways) divided
//!   by the heartbeats in that time.

use std::{
    fmt::Write as _,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use rune_harness::cluster::{
    POD_TCP_PORT,
    running::{ClusterConfig, RunningCluster},
};

/// Endpoint changes per cluster size.
const CHANGES: usize = 40;
/// Services of the join figure.
const JOIN_SERVICES: usize = 10_000;
/// Endpoints per service of the join figure.
const JOIN_ENDPOINTS: usize = 10;
/// Services per apply when filling etcd (etcd's default limit is 128 operations
/// per transaction: a service, its endpoints and its VIP index key are three).
const JOIN_CHUNK: usize = 40;
/// How long the idle agents are watched for the traffic figure.
const IDLE: Duration = Duration::from_secs(40);
/// The agents' heartbeat interval (their default).
const HEARTBEAT: Duration = Duration::from_secs(10);
/// Targets: p99 of apply → acknowledged at N = 3 and N = 20.
const TARGET_3: Duration = Duration::from_millis(100);
const TARGET_20: Duration = Duration::from_millis(500);
/// Target: a new node's start → applied with 10,000 services.
const JOIN_TARGET: Duration = Duration::from_secs(2);

/// `cargo xtask bench cluster`: builds the release agent, measures, prints.
pub fn run_alone() -> Result<()> {
    let bin = crate::util::bench_agent()?;
    println!("{}", section(&bin)?);
    Ok(())
}

/// The section of the report (a note when not root).
pub fn section(bin: &Path) -> Result<String> {
    let mut out =
        String::from("\n## Cluster on etcd (agents in node namespaces, etcd with TLS)\n\n");
    if rune_harness::netns::require_root().is_err() {
        out.push_str("Skipped: needs root (network namespaces).\n");
        return Ok(out);
    }
    let (p3, traffic) = {
        let c = start(bin, 3, "ebpf")?;
        let p = acknowledged(&c)?;
        let t = idle_traffic(&c)?;
        (p, t)
    };
    let p20 = acknowledged(&start(bin, 20, "userspace")?)?;
    let (join, steps) = join(bin)?;
    let _ = writeln!(out, "| figure | value | target | |");
    let _ = writeln!(out, "|---|---:|---:|---|");
    for (n, mode, (p50, p99, alone), target) in
        [(3, "eBPF", p3, TARGET_3), (20, "userspace", p20, TARGET_20)]
    {
        let _ = writeln!(
            out,
            "| apply --wait → acknowledged by all {n} nodes ({mode}), p50 / p99 of {CHANGES} (the CLI alone: {} ms) | {} / {} ms | p99 < {} ms | {} |",
            ms(alone),
            ms(p50),
            ms(p99),
            target.as_millis(),
            super::common::verdict(p99 < target)
        );
    }
    let _ = writeln!(
        out,
        "| a new node joins 10,000 services × 10 endpoints: spawn → applied | {} ms | < {} ms | {} |",
        ms(join),
        JOIN_TARGET.as_millis(),
        super::common::verdict(join < JOIN_TARGET)
    );
    let _ = writeln!(
        out,
        "| etcd traffic per idle node per heartbeat (both ways, TLS) | {:.0} B | | |",
        traffic
    );
    let _ = writeln!(out, "\nThe new node (eBPF): {steps}.");
    Ok(out)
}

fn start(bin: &Path, nodes: usize, dataplane: &str) -> Result<RunningCluster> {
    let mut config = ClusterConfig::new(nodes, bin);
    config.dataplane = dataplane.to_owned();
    config.log_files = true;
    let c = RunningCluster::start(config, Duration::from_secs(180))
        .with_context(|| format!("starting a cluster of {nodes} ({dataplane})"))?;
    Ok(c)
}

/// p50 and p99 of `apply --wait` of an endpoint change, and the median of the
/// CLI alone (`get svc`: its start, TLS to etcd, one read) for reference.
fn acknowledged(c: &RunningCluster) -> Result<(Duration, Duration, Duration)> {
    let nodes = c.topology().nodes();
    let mut times = Vec::with_capacity(CHANGES);
    for i in 0..=CHANGES {
        // Alternate between two endpoint sets so that every apply changes something.
        let node = &nodes[i % nodes.len()];
        let yaml = format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: bench}}\n\
             spec: {{ports: [{{port: 80, targetPort: {POD_TCP_PORT}}}], discovery: {{vips: [198.18.200.20]}}}}\n\
             ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: bench}}\n\
             spec: {{endpoints: [{{address: {}, node: {}}}]}}\n",
            node.pod_addr(),
            node.name()
        );
        let t = Instant::now();
        let out = c.cli(&["apply", "-f", "-", "--wait=30s"], Some(&yaml));
        let took = t.elapsed();
        if !out.status.success() {
            bail!(
                "apply --wait failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // The first apply creates the service (not a change): not counted.
        if i > 0 {
            times.push(took);
        }
    }
    times.sort();
    let mut alone = Vec::new();
    for _ in 0..9 {
        let t = Instant::now();
        let out = c.cli(&["get", "svc"], None);
        alone.push(t.elapsed());
        if !out.status.success() {
            bail!("get svc failed: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    alone.sort();
    Ok((
        times[times.len() / 2],
        times[times.len() * 99 / 100],
        alone[alone.len() / 2],
    ))
}

/// Bytes per node per heartbeat while the cluster is idle.
fn idle_traffic(c: &RunningCluster) -> Result<f64> {
    let nodes = c.topology().nodes();
    let before: Vec<(u64, u64)> = nodes.iter().map(|n| n.etcd_bytes()).collect();
    std::thread::sleep(IDLE);
    let total: u64 = nodes
        .iter()
        .zip(&before)
        .map(|(n, (up, down))| {
            let (u, d) = n.etcd_bytes();
            (u - up) + (d - down)
        })
        .sum();
    let heartbeats = IDLE.as_secs_f64() / HEARTBEAT.as_secs_f64();
    Ok(total as f64 / nodes.len() as f64 / heartbeats)
}

/// A new node's spawn → applied with 10,000 services × 10 endpoints in etcd, and
/// when (after the spawn) its log said the cache was synced, the data plane chosen
/// and the agent ready.
fn join(bin: &Path) -> Result<(Duration, String)> {
    let mut config = ClusterConfig::new(1, bin);
    config.log_files = true;
    config.start_agents = false;
    config.extra_args = vec![
        "--lb-max-frontends".into(),
        "10240".into(),
        "--maglev-table-size".into(),
        "1021".into(),
        "--lb-max-backends".into(),
        "131072".into(),
    ];
    let mut c = RunningCluster::start(config, Duration::from_secs(180))?;
    for chunk in 0..JOIN_SERVICES / JOIN_CHUNK {
        let yaml: String = (chunk * JOIN_CHUNK..(chunk + 1) * JOIN_CHUNK)
            .map(join_service)
            .collect();
        let out = c.cli(&["apply", "-f", "-"], Some(&yaml));
        if !out.status.success() {
            bail!("filling etcd: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    let revision = c.etcd().revision();
    let t = Instant::now();
    let spawned = seconds_of_day(std::time::SystemTime::now());
    c.start_agent(0)?;
    let deadline = t + Duration::from_secs(120);
    loop {
        if let Ok((200, text)) = c.agent(0).http_get("/metrics")
            && applied(&text) >= revision
        {
            let took = t.elapsed();
            std::thread::sleep(Duration::from_millis(200));
            return Ok((took, log_steps(&c.agent(0).log(), spawned)));
        }
        if Instant::now() > deadline {
            bail!("the new node did not apply revision {revision} within 120 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Seconds since midnight UTC of `t`.
fn seconds_of_day(t: std::time::SystemTime) -> f64 {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    (d.as_secs() % 86_400) as f64 + f64::from(d.subsec_micros()) / 1e6
}

/// When the agent's log (lines starting `2026-12-02T04:54:12.708390Z`) said each
/// step, in ms after `spawned` (seconds of day).
fn log_steps(log: &str, spawned: f64) -> String {
    let steps = [
        ("data plane chosen", "data plane chosen"),
        ("cache synced", "snapshot in the cache"),
        ("agent ready", "ready"),
    ];
    let mut out = Vec::new();
    for (needle, what) in steps {
        let at = log.lines().find(|l| l.contains(needle)).and_then(|l| {
            let clock = l.get(11..26)?;
            let mut parts = clock.split(':');
            let h: f64 = parts.next()?.parse().ok()?;
            let m: f64 = parts.next()?.parse().ok()?;
            let s: f64 = parts.next()?.parse().ok()?;
            Some(h * 3600.0 + m * 60.0 + s)
        });
        if let Some(at) = at {
            out.push(format!("{what} after {:.0} ms", (at - spawned) * 1e3));
        }
    }
    out.join(", ")
}

/// `rune_applied_revision` in a metrics text (0 when absent).
fn applied(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("rune_applied_revision "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

fn join_service(i: usize) -> String {
    let vip = std::net::Ipv4Addr::from(0xc613_0000 + i as u32); // 198.19.0.0/16
    let eps: Vec<String> = (0..JOIN_ENDPOINTS)
        .map(|j| {
            let a = std::net::Ipv4Addr::from(
                0xc612_0000 + ((i * JOIN_ENDPOINTS + j) as u32 % 0xffff) + 1,
            );
            format!("{{address: {a}}}")
        })
        .collect();
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: s{i:05}}}\n\
         spec: {{ports: [{{port: 80, targetPort: 8080}}], discovery: {{vips: [{vip}]}}}}\n---\n\
         apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: s{i:05}}}\n\
         spec: {{endpoints: [{}]}}\n---\n",
        eps.join(", ")
    )
}

fn ms(d: Duration) -> String {
    format!("{:.1}", super::sync::ms(d))
}
