//! `cargo xtask bench policy`: how fast the production agent programs network
//! policy, eBPF and nftables side by side in one run.
//!
//! * **Snapshot to programmed policy**: [`SERVICES`] services, each with
//!   [`ENDPOINTS`] endpoints (half of them on this node, so guarded) and a
//!   [`PEERS`]-peer ingress policy (cidr, service and namespace peers, a named and a
//!   numbered port), are written into a fresh store while no agent runs; the figure
//!   is the time from spawning the agent until its log shows the data plane apply
//!   holding every service (logged after the policy and LB maps were written, or
//!   after `nft` committed the transaction), the signal of the nftables sync bench.
//!   Median of [`SNAPSHOT_RUNS`], fresh store, namespaces and pins each. Afterwards
//!   (not timed) `/metrics` must show `rune_policy_rules` for every service and the
//!   log no policy the agent could not program.
//! * **One policy change, event to kernel**: with the last run's agent up,
//!   [`CHANGES`] times one service's policy is edited (one cidr peer replaced)
//!   through `rune-agent apply -f -`; the interval runs from the command's return
//!   (the event is committed) until the agent logs the next data plane apply (0 when
//!   it already has at the first look, as in the sync bench).
//!
//! eBPF mode runs in the harness topology's node namespace with the load balancer
//! on the client-facing veth and the policy programs on the backend-facing one
//! (`--policy-interfaces`), as the eBPF policy tests start it; nftables mode in a
//! namespace of its own. No packet is sent. Needs root; without it the section says
//! so and is skipped.

use super::sync::{Agent, ensure_alive, ms, percentile};
use anyhow::{Context as _, Result, ensure};
use rune_harness::{bpffs::PinDir, netns::NetNs, topology::Topology};
use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    path::Path,
    process::Command,
    thread::sleep,
    time::{Duration, Instant},
};

/// Services in the snapshot.
const SERVICES: usize = 1_000;
/// Endpoints per service; the even ones are on this node.
const ENDPOINTS: usize = 4;
/// Peers of each service's ingress rule.
const PEERS: usize = 10;
/// Namespaces the services are spread over (service `i` in `ns{i % NAMESPACES}`).
const NAMESPACES: usize = 100;
/// `--policy-max-entries`: each policy's peers expand to their addresses (~60 here:
/// 6 cidrs, 3 services x 4 endpoints, a namespace of 10 x 4), ~60,000 in all.
const POLICY_MAX_ENTRIES: &str = "131072";
/// Snapshot runs per data plane; the median is reported.
const SNAPSHOT_RUNS: usize = 3;
/// Policy changes measured one after the other per data plane.
const CHANGES: usize = 50;
/// Upper bound on one change series.
const CHANGES_LIMIT: Duration = Duration::from_secs(40);
/// Upper bound on one snapshot sync, and on one change reaching the kernel.
const SYNC_LIMIT: Duration = Duration::from_secs(30);
const CHANGE_LIMIT: Duration = Duration::from_secs(5);
/// The agent's node name; endpoints naming it are guarded by this agent.
const NODE: &str = "bench-node";

/// The two data planes, in the table's column order.
#[derive(Clone, Copy)]
enum Plane {
    Ebpf,
    Nftables,
}

impl Plane {
    fn label(self) -> &'static str {
        match self {
            Plane::Ebpf => "eBPF",
            Plane::Nftables => "nftables",
        }
    }

    /// The change p99 target, ms.
    fn change_target(self) -> f64 {
        match self {
            Plane::Ebpf => 5.0,
            Plane::Nftables => 20.0,
        }
    }
}

fn name(i: usize) -> String {
    format!("p{i:04}")
}

fn namespace(i: usize) -> String {
    format!("ns{}", i % NAMESPACES)
}

/// Endpoint `j` of service `i`: 198.18.16.0 onwards.
fn endpoint_addr(i: usize, j: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 16, 0)) + (i * ENDPOINTS + j) as u32)
}

/// Service `i`'s VIP: 198.19.16.0 onwards.
fn vip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 16, 0)) + i as u32)
}

/// Service `i`'s ingress rule at version `v`: 6 cidr peers (the first one moves
/// with `v`), 3 service peers (neighbours, some in other namespaces), 1 namespace (10 services).
fn policy_yaml(i: usize, v: usize) -> String {
    let mut peers = Vec::with_capacity(PEERS);
    peers.push(format!("{{cidr: 198.19.{}.{}/32}}", 64 + v / 256, v % 256));
    for c in 1..6 {
        peers.push(format!("{{cidr: 198.19.{}.0/24}}", 128 + (i + c) % 64));
    }
    for s in 1..4 {
        let peer = (i + s * 7) % SERVICES;
        peers.push(format!(
            "{{service: {}, namespace: {}}}",
            name(peer),
            namespace(peer)
        ));
    }
    peers.push(format!("{{namespace: {}}}", namespace(i + 1)));
    format!(
        "  networkPolicy:\n    mode: enforce\n    ingress:\n      - from: [{}]\n        ports: [\"http\", \"443/tcp\"]\n",
        peers.join(", ")
    )
}

fn service_yaml(i: usize, v: usize) -> String {
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{namespace: {}, name: {}}}\nspec:\n  ports: [{{name: http, port: 80, targetPort: 8080}}, {{name: https, port: 443, targetPort: 8443}}]\n  discovery: {{vips: [{}]}}\n{}",
        namespace(i),
        name(i),
        vip(i),
        policy_yaml(i, v)
    )
}

fn snapshot_yaml() -> String {
    let mut y = String::with_capacity(SERVICES * 1200);
    for i in 0..SERVICES {
        y.push_str(&service_yaml(i, 0));
        let eps: Vec<String> = (0..ENDPOINTS)
            .map(|j| {
                let node = if j % 2 == 0 { NODE } else { "other-node" };
                format!(
                    "{{address: {}, node: {node}, ready: true}}",
                    endpoint_addr(i, j)
                )
            })
            .collect();
        let _ = write!(
            y,
            "---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{namespace: {}, name: {}}}\nspec: {{endpoints: [{}]}}\n---\n",
            namespace(i),
            name(i),
            eps.join(", ")
        );
    }
    y
}

/// `cargo xtask bench policy`: builds the release agent, measures, prints the table.
pub fn run_alone() -> Result<()> {
    let bin = crate::util::bench_agent()?;
    println!("{}", section(&bin)?);
    Ok(())
}

/// One data plane's figures.
struct Figures {
    /// Spawn → every service's policy programmed, per run.
    snapshots: Vec<Duration>,
    /// Apply returned → kernel, ms.
    changes: Vec<f64>,
    /// The agent's own apply per change delta, ms.
    agent: Vec<f64>,
    /// Changes already in the kernel at the first look.
    before_return: usize,
}

/// The benchmark's section of the report (a note when not root or without `nft`).
pub fn section(bin: &Path) -> Result<String> {
    const TITLE: &str = "## Network policy programming (production agent, 1,000 services)";
    if !crate::util::is_root() {
        return Ok(format!("\n{TITLE}\n\nskipped: needs root\n"));
    }
    if Command::new("nft").arg("--version").output().is_err() {
        return Ok(format!("\n{TITLE}\n\nskipped: no nft binary\n"));
    }
    let work = tempfile::Builder::new()
        .prefix("rune-bench-policy-")
        .tempdir()?;
    let yaml = work.path().join("snapshot.yaml");
    std::fs::write(&yaml, snapshot_yaml())?;
    let mut figures = Vec::new();
    for plane in [Plane::Ebpf, Plane::Nftables] {
        figures.push(measure(bin, plane, work.path(), &yaml)?);
    }
    report(TITLE, &mut figures)
}

/// Snapshot runs, then the change series on the last run's agent.
fn measure(bin: &Path, plane: Plane, work: &Path, yaml: &Path) -> Result<Figures> {
    let mut f = Figures {
        snapshots: Vec::new(),
        changes: Vec::new(),
        agent: Vec::new(),
        before_return: 0,
    };
    for run in 0..SNAPSHOT_RUNS {
        let state = work.join(format!("{}-{run}", plane.label()));
        super::common::apply_snapshot(bin, &state, yaml)?;
        std::fs::write(
            state.join("node-identity.json"),
            format!("{{\"node_id\":\"{:032x}\",\"hostname\":\"{NODE}\"}}\n", 11),
        )?;
        // Fresh namespaces and pins each run: nothing to adopt. The agent stops
        // before its namespace and pins go.
        let (agent, topo, netns, pins) = match plane {
            Plane::Ebpf => {
                let topo = Topology::new(1)?;
                let pins = PinDir::new("bench-policy");
                let args: Vec<String> = [
                    "--cgroup",
                    "none",
                    "--interfaces",
                    topo.node_client_if(),
                    "--policy-interfaces",
                    &topo.node_backend_ifs().join(","),
                    "--bpf-pin-dir",
                    &pins.path().display().to_string(),
                    "--maglev-table-size",
                    "1021",
                    "--lb-max-frontends",
                    "2048",
                    "--policy-max-entries",
                    POLICY_MAX_ENTRIES,
                ]
                .iter()
                .map(|a| (*a).to_owned())
                .collect();
                let agent = Agent::start_with(bin, topo.node(), &state, &args)?;
                (agent, Some(topo), None, Some(pins))
            }
            Plane::Nftables => {
                let netns = NetNs::new("bench-policy")?;
                let args = ["--dataplane".to_owned(), "nftables".to_owned()];
                let agent = Agent::start_with(bin, &netns, &state, &args)?;
                (agent, None, Some(netns), None)
            }
        };
        let to_kernel = wait_for_apply(&agent, |(_, n)| *n == SERVICES, agent.process.started)?;
        check_programmed(&agent)?;
        eprintln!(
            "policy {} run {}: snapshot → programmed {:.0} ms",
            plane.label(),
            run + 1,
            ms(to_kernel)
        );
        f.snapshots.push(to_kernel);
        if run + 1 == SNAPSHOT_RUNS {
            measure_changes(bin, &agent, &state, &mut f)?;
        }
        drop(agent);
        drop((pins, netns, topo));
    }
    Ok(f)
}

/// Waits until an apply in the agent's log matches `done`; returns the time since
/// `since`.
fn wait_for_apply(
    agent: &Agent,
    done: impl Fn(&(Duration, usize)) -> bool,
    since: Instant,
) -> Result<Duration> {
    loop {
        if agent.applies().iter().any(&done) {
            return Ok(since.elapsed());
        }
        ensure_alive(agent)?;
        ensure!(
            since.elapsed() < SYNC_LIMIT,
            "the policy was not programmed within {SYNC_LIMIT:?}"
        );
        sleep(Duration::from_millis(1));
    }
}

/// Not timed: every service reports its rules and none failed to program.
fn check_programmed(agent: &Agent) -> Result<()> {
    let (code, metrics) = agent.process.http_get("/metrics")?;
    ensure!(code == 200, "GET /metrics answered {code}");
    let rules = metrics
        .lines()
        .filter(|l| l.starts_with("rune_policy_rules{") && !l.ends_with(" 0"))
        .count();
    ensure!(
        rules == SERVICES,
        "{rules} services with policy rules in /metrics, expected {SERVICES}"
    );
    let log = agent.process.log();
    for failure in [
        "network policy not programmed",
        "the kernel refused the policy",
    ] {
        if let Some(line) = log.lines().find(|l| l.contains(failure)) {
            anyhow::bail!("the agent could not program a policy: {line}");
        }
    }
    Ok(())
}

fn measure_changes(bin: &Path, agent: &Agent, state: &Path, f: &mut Figures) -> Result<()> {
    let first_change = agent.applies().len();
    let series = Instant::now();
    for k in 0..CHANGES {
        if series.elapsed() > CHANGES_LIMIT {
            break;
        }
        // 37 is prime to 1,000: different services spread over the range.
        let i = (k * 37) % SERVICES;
        let seen = agent.applies().len();
        crate::util::rune_apply(bin, state, &service_yaml(i, k + 1))?;
        let returned = Instant::now();
        let mut first_look = true;
        loop {
            if agent.applies().len() > seen {
                break;
            }
            first_look = false;
            // Each look reads the whole log: a pause leaves the agent its core.
            sleep(Duration::from_micros(500));
            ensure_alive(agent)?;
            ensure!(
                returned.elapsed() < CHANGE_LIMIT,
                "the policy change of {} did not reach the kernel within {CHANGE_LIMIT:?}",
                name(i)
            );
        }
        if first_look {
            f.before_return += 1;
            f.changes.push(0.0);
        } else {
            f.changes.push(ms(returned.elapsed()));
        }
    }
    f.agent = agent.applies()[first_change..]
        .iter()
        .map(|(d, _)| ms(*d))
        .collect();
    check_programmed(agent).context("after the policy changes")
}

fn report(title: &str, figures: &mut [Figures]) -> Result<String> {
    let met = super::common::verdict;
    let planes = [Plane::Ebpf, Plane::Nftables];
    let mut t = String::new();
    writeln!(t)?;
    writeln!(t, "{title}")?;
    writeln!(t)?;
    writeln!(
        t,
        "{SERVICES} services x {ENDPOINTS} endpoints (2 on this node, guarded), each with a \
         {PEERS}-peer ingress rule (6 cidr, 3 service, 1 namespace peers; 2 ports); eBPF with \
         --policy-interfaces on the topology's backend-facing veth, nftables in its own netns."
    )?;
    writeln!(t)?;
    writeln!(t, "| figure | data plane | value | target | |")?;
    writeln!(t, "|---|---|---:|---:|---|")?;
    for (plane, f) in planes.iter().zip(figures.iter_mut()) {
        f.snapshots.sort();
        let m = f.snapshots[f.snapshots.len() / 2];
        writeln!(
            t,
            "| snapshot → programmed, median of {} | {} | {:.0} ms | < 1000 ms | {} |",
            f.snapshots.len(),
            plane.label(),
            ms(m),
            met(m < Duration::from_secs(1))
        )?;
    }
    for (plane, f) in planes.iter().zip(figures.iter_mut()) {
        let n = f.changes.len();
        let (p50, p99) = (
            percentile(&mut f.changes, 0.5),
            percentile(&mut f.changes, 0.99),
        );
        writeln!(
            t,
            "| one policy change, apply returned → kernel, p50 / p99 ({n} changes) | {} | {p50:.2} / {p99:.2} ms | p99 < {} ms | {} |",
            plane.label(),
            plane.change_target(),
            met(p99 < plane.change_target())
        )?;
    }
    writeln!(t)?;
    for (plane, f) in planes.iter().zip(figures.iter_mut()) {
        let runs: Vec<String> = f
            .snapshots
            .iter()
            .map(|d| format!("{:.0}", ms(*d)))
            .collect();
        writeln!(
            t,
            "{}: snapshot runs {} ms; the agent's own apply per change delta p50/p99 \
             {:.2}/{:.2} ms ({} deltas); {} of {} changes were already in the kernel at the \
             first look after the apply command returned.",
            plane.label(),
            runs.join(", "),
            percentile(&mut f.agent, 0.5),
            percentile(&mut f.agent, 0.99),
            f.agent.len(),
            f.before_return,
            f.changes.len()
        )?;
    }
    Ok(t)
}
