//! The same sync figures in nftables mode (`--dataplane nftables`), next to eBPF's.
//!
//! * **Snapshot to programmed table**: the same 10,000 services × 10 endpoints in a
//!   fresh store; the figure is the time from spawning the agent to the moment its
//!   log shows the transaction with every service done (polled every 2 ms; the
//!   agent logs after `nft -f` returned, i.e. after the kernel committed it).
//!   nft 1.0.6 reads every element of every set before `get element` or `list
//!   chain` (~2 s of CPU at 100,000 backends), so polling the kernel would cost
//!   more than what it measures; afterwards (not timed) `service-vips` must hold
//!   all 10,000 services and `backends4-tcp` all 100,000 backends. Three runs,
//!   fresh store and fresh namespace each; median.
//! * **One endpoint change, event to kernel**: 200 times one service's endpoint 0 is
//!   replaced through `rune-agent apply -f -`; the interval runs from the command's
//!   return until the agent's log shows the next transaction done (0 when it already
//!   does at the first look, as in the eBPF figures). After the series (not timed)
//!   one listing of `backends4-tcp` must show every changed service with its new
//!   backend and without the old one. (`nft monitor` would be exact, but with
//!   10,000 services it printed nothing within a minute.)
//!
//! The agent runs in a namespace of its own (`rune-bench-nft-<pid>-<n>`), so its table
//! is created, measured and removed there only.

use super::{
    Agent, CHANGE_LIMIT, CHANGES, CHANGES_LIMIT, Changes, ENDPOINTS, SERVICE_PORT, SERVICES,
    SNAPSHOT_RUNS, SYNC_LIMIT, endpoint_addr, endpoints_yaml, ensure_alive, ms, percentile,
    replacement_addr, service_name, vip,
};
use anyhow::{Context as _, Result, ensure};
use rune_harness::netns::NetNs;
use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    path::Path,
    process::Command,
    thread::sleep,
    time::{Duration, Instant},
};

const TITLE: &str = "## nftables sync (production agent, --dataplane nftables, 10,000 services)";

/// `nft ARGS` inside `netns` (entered with setns before exec).
fn nft(netns: &NetNs, args: &[&str]) -> Result<Command> {
    let mut cmd = netns.command("nft")?;
    cmd.args(args);
    rune_harness::agent::die_with_parent(&mut cmd);
    Ok(cmd)
}

struct Snapshot {
    to_table: Duration,
    agent_apply: Option<Duration>,
    rss_kib: u64,
}

/// The section of the report; `ebpf` is eBPF mode's median snapshot time and
/// `ebpf_changes` its change series, for the side-by-side lines.
pub(super) fn section(
    bin: &Path,
    snapshot_yaml: &Path,
    ebpf: Duration,
    ebpf_changes: &Changes,
) -> Result<String> {
    if Command::new("nft").arg("--version").output().is_err() {
        return Ok(format!("\n{TITLE}\n\nskipped: no nft binary\n"));
    }
    let work = tempfile::Builder::new()
        .prefix("rune-bench-nft-")
        .tempdir()?;
    let mut runs = Vec::new();
    let mut changes = None;
    for run in 0..SNAPSHOT_RUNS {
        // A fresh namespace each run: no table to adopt.
        let netns = NetNs::new("bench-nft")?;
        let state = work.path().join(format!("state-{run}"));
        crate::bench::common::apply_snapshot(bin, &state, snapshot_yaml)?;
        let agent = Agent::start_with(
            bin,
            &netns,
            &state,
            &["--dataplane".into(), "nftables".into()],
        )?;
        let snap = measure_snapshot(&agent, &netns)?;
        eprintln!(
            "nft sync run {}: snapshot → table {:.0} ms (agent's apply {:.0} ms), RSS {:.1} MiB",
            run + 1,
            ms(snap.to_table),
            snap.agent_apply.map_or(f64::NAN, ms),
            snap.rss_kib as f64 / 1024.0
        );
        runs.push(snap);
        if run + 1 == SNAPSHOT_RUNS {
            changes = Some(measure_changes(bin, &agent, &netns, &state)?);
        }
        drop(agent);
        drop(netns);
    }
    let c = changes.context("no change series")?;
    runs.sort_by_key(|r| r.to_table);
    let m = &runs[runs.len() / 2];
    let all: Vec<String> = runs
        .iter()
        .map(|r| format!("{:.0}", ms(r.to_table)))
        .collect();
    let mut after = c.after_return.clone();
    let mut agent = c.agent.clone();
    let (p50, p99) = (percentile(&mut after, 0.5), percentile(&mut after, 0.99));
    let mut ebpf_after = ebpf_changes.after_return.clone();
    let (e50, e99) = (
        percentile(&mut ebpf_after, 0.5),
        percentile(&mut ebpf_after, 0.99),
    );
    let met = crate::bench::common::verdict;

    let mut t = String::new();
    writeln!(t)?;
    writeln!(t, "{TITLE}")?;
    writeln!(t)?;
    writeln!(
        t,
        "The same {SERVICES} services x {ENDPOINTS} endpoints; agent in its own netns."
    )?;
    writeln!(t)?;
    writeln!(t, "| figure | nftables | eBPF | target (nftables) | |")?;
    writeln!(t, "|---|---:|---:|---:|---|")?;
    writeln!(
        t,
        "| snapshot → programmed, median of {} | {:.0} ms | {:.0} ms | < 3000 ms | {} |",
        runs.len(),
        ms(m.to_table),
        ms(ebpf),
        met(m.to_table < Duration::from_secs(3))
    )?;
    writeln!(
        t,
        "| one endpoint change, apply returned → kernel, p50 ({} changes) | {p50:.2} ms | {e50:.2} ms | | |",
        c.after_return.len()
    )?;
    writeln!(
        t,
        "| one endpoint change, apply returned → kernel, p99 | {p99:.2} ms | {e99:.2} ms | < 20 ms | {} |",
        met(p99 < 20.0)
    )?;
    writeln!(
        t,
        "| agent memory (VmRSS) after the sync | {:.1} MiB | | | |",
        m.rss_kib as f64 / 1024.0
    )?;
    writeln!(t)?;
    writeln!(
        t,
        "Snapshot runs: {} ms; the agent logged {} for its full-delta transaction (building \
         the script and `nft -f -`). Changes: the agent's own apply per delta (plan + netlink batch or `nft -f -`) \
         p50/p99 {:.2}/{:.2} ms ({} deltas); {} of {} changes were already in the kernel at \
         the first look at its log after the apply command returned{}.",
        all.join(", "),
        m.agent_apply
            .map_or_else(|| "nothing".to_owned(), |d| format!("{:.0} ms", ms(d))),
        percentile(&mut agent, 0.5),
        percentile(&mut agent, 0.99),
        c.agent.len(),
        c.before_return,
        c.after_return.len(),
        if c.stopped_early {
            format!(" (stopped at the {} s limit)", CHANGES_LIMIT.as_secs())
        } else {
            String::new()
        }
    )?;
    Ok(t)
}

/// The elements of map `map` of our table as `(key, value)` texts (`a . b . c`).
fn map_elements(netns: &NetNs, map: &str) -> Result<Vec<(String, String)>> {
    let out = nft(netns, &["-j", "list", "map", "inet", "rune", map])?.output()?;
    ensure!(out.status.success(), "nft list map {map} failed");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let text = |v: &serde_json::Value| -> String {
        match v.get("concat").and_then(|c| c.as_array()) {
            Some(parts) => parts
                .iter()
                .map(|p| p.as_str().map_or_else(|| p.to_string(), str::to_owned))
                .collect::<Vec<_>>()
                .join(" . "),
            None => v.to_string(),
        }
    };
    Ok(json["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o.get("map")?.get("elem")?.as_array())
        .flatten()
        .map(|el| {
            // Elements of a map with counters come wrapped with theirs.
            let key = el[0].get("elem").map_or(&el[0], |e| &e["val"]);
            (text(key), text(&el[1]))
        })
        .collect())
}

fn measure_snapshot(agent: &Agent, netns: &NetNs) -> Result<Snapshot> {
    let deadline = agent.process.started + SYNC_LIMIT;
    loop {
        if agent.applies().iter().any(|(_, n)| *n == SERVICES) {
            break;
        }
        ensure_alive(agent)?;
        ensure!(
            Instant::now() < deadline,
            "the table was not programmed within {SYNC_LIMIT:?}"
        );
        sleep(Duration::from_millis(2));
    }
    let to_table = agent.process.started.elapsed();
    // Not timed: every service and every backend is in the kernel.
    let services = map_elements(netns, "service-vips")?.len();
    ensure!(
        services == SERVICES,
        "{services} elements in service-vips, expected {SERVICES}"
    );
    let backends = map_elements(netns, "backends4-tcp")?.len();
    ensure!(
        backends == SERVICES * ENDPOINTS,
        "{backends} elements in backends4-tcp, expected {}",
        SERVICES * ENDPOINTS
    );
    let agent_apply = agent.full_apply();
    Ok(Snapshot {
        to_table,
        agent_apply,
        rss_kib: agent.rss()?.vm,
    })
}

fn measure_changes(bin: &Path, agent: &Agent, netns: &NetNs, state: &Path) -> Result<Changes> {
    let applies_before = agent.applies().len();
    let mut c = Changes {
        after_return: Vec::new(),
        from_spawn: Vec::new(),
        cli: Vec::new(),
        agent: Vec::new(),
        before_return: 0,
        stopped_early: false,
    };
    let series = Instant::now();
    let mut changed = Vec::new();
    for k in 0..CHANGES {
        if series.elapsed() > CHANGES_LIMIT {
            c.stopped_early = true;
            break;
        }
        let i = (k * 47) % SERVICES;
        let new = replacement_addr(k);
        let old = endpoint_addr(i, 0);
        let mut addrs: Vec<Ipv4Addr> = (1..ENDPOINTS).map(|j| endpoint_addr(i, j)).collect();
        addrs.push(new);
        let yaml = endpoints_yaml(i, &addrs);
        let applies = agent.applies().len();
        let spawned = Instant::now();
        crate::util::rune_apply(bin, state, &yaml)?;
        let returned = Instant::now();
        // In the kernel once the agent logged its next transaction.
        let mut polls = 0;
        let announced = loop {
            let done = agent.applies().len() > applies;
            polls += 1;
            let at = Instant::now();
            if done {
                break if polls == 1 { returned } else { at };
            }
            ensure!(
                returned.elapsed() < CHANGE_LIMIT,
                "change {k} (service {i}) did not reach the kernel within {CHANGE_LIMIT:?}"
            );
        };
        if announced == returned {
            c.before_return += 1;
        }
        c.after_return
            .push(ms(announced.saturating_duration_since(returned)));
        c.from_spawn.push(ms(announced - spawned));
        c.cli.push(ms(returned - spawned));
        ensure_alive(agent)?;
        changed.push((i, old, new));
    }
    // Not timed: every change is in the kernel.
    let elements = map_elements(netns, "backends4-tcp")?;
    for (i, old, new) in changed {
        let prefix = format!("{} . {SERVICE_PORT} . ", vip(i));
        let backends: Vec<&str> = elements
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .map(|(_, v)| v.as_str())
            .collect();
        let has = |a: Ipv4Addr| backends.iter().any(|b| b.starts_with(&format!("{a} . ")));
        ensure!(
            has(new) && !has(old) && backends.len() == ENDPOINTS,
            "service {} ({}): backends {backends:?} after replacing {old} with {new}",
            i,
            service_name(i)
        );
    }
    c.agent = agent.applies()[applies_before..]
        .iter()
        .map(|(d, _)| ms(*d))
        .collect();
    Ok(c)
}
