//! `cargo xtask bench reuse` (root; also the end of `cargo xtask bench e2e`): short
//! HTTP connections whose client source ports come back within seconds, through two
//! VIPs that share their backend, in each production data plane mode ([`Mode`]), vs
//! straight to the backend.
//!
//! ```text
//! client ns (2 × wrk) ──veth── node ns (production agent) ──veth── backend ns (nginx)
//! ```
//!
//! Two services (VIPs [`VIPS`], port 80) have the same nginx backend, which answers
//! `200 ok` and closes every connection first (TIME_WAIT on the backend). Two
//! `wrk -H 'Connection: close'` run at once from one client address, one per VIP
//! (direct: both to the backend, so that both sides load the same processes the
//! same way: with a backend per wrk directly and a hash's share of several through
//! the VIPs, the sides would differ in how evenly the servers are loaded, not in
//! the data path). The client namespace's ephemeral
//! ports are narrowed to a few hundred with `tcp_tw_reuse`, so through the VIPs the
//! same client address and port soon reach the same backend for either VIP, where an
//! earlier flow's state (the data plane's, the backend's TIME_WAIT) may still be.
//! Besides the rates, the client's SYN retransmits and RSTs sent (nstat in its
//! namespace) and wrk's socket errors show connections that stalled on such state.
//!
//! wrk cannot bind a source address, so the client's default route picks it (`src`):
//! one address per mode and side, kept across that side's rounds (so ports are
//! reused) and never shared with another side or mode (TIME_WAIT). Direct and VIP
//! runs alternate for a few rounds and the medians are compared. Traffic stays in
//! 198.18.0.0/15 inside the bench's own namespaces; nginx and wrk are killed on drop,
//! the namespaces deleted, and every run is bounded in time.

mod client;
mod net;

use super::{
    common::median,
    modes::{Mode, apply_offline},
};
use anyhow::{Context as _, Result};
use client::{Errors, counters, wrk_pair};
use net::{nginx, route_src, topology, wait_answering};
use rune_harness::{bpffs::PinDir, netns::NetNs, topology::CLIENT_IF};
use std::{fmt::Write as _, net::Ipv4Addr, path::Path, time::Duration};

/// Rounds (each: one direct run, then one VIP run).
const ROUNDS: usize = 5;
/// Length of one wrk run, in seconds (`wrk -d`).
const RUN_SECS: u64 = 3;
/// How long a wrk process may take before it is killed and the bench fails.
const WRK_LIMIT: Duration = Duration::from_secs(RUN_SECS + 15);
/// Connections each wrk keeps open (`wrk -c`).
const CONNECTIONS: u32 = 25;
/// The two services' VIPs (port 80 each).
const VIPS: [Ipv4Addr; 2] = [
    Ipv4Addr::new(198, 18, 100, 10),
    Ipv4Addr::new(198, 18, 100, 11),
];
/// The backend (nginx on port 80) both services share, in its own namespace and
/// subnet.
const BACKENDS: [Ipv4Addr; 1] = [Ipv4Addr::new(198, 18, 11, 2)];
/// The client namespace's `net.ipv4.ip_local_port_range`: few enough ports that each
/// is reused within seconds.
const PORT_RANGE: &str = "20000 20299";
/// The node's address on the client's link (the client's gateway).
const GATEWAY: &str = "198.18.1.1";
/// The client's source address for readiness probes (never used by a measured run).
const PROBE_SRC: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 2);
/// The eBPF rows' target.
const EBPF_TARGET: &str = ">= 1.0x nftables and >= 0.95x direct, 0 SYN retransmits";

/// The client source address of mode `mode`'s direct or VIP runs (all rounds).
fn src_addr(mode: usize, via_vip: bool) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 1, 20 + 2 * mode as u8 + u8::from(via_vip))
}

/// Runs the scenario alone: with the release agent built from this tree, or with the
/// binary named by `RUNE_BENCH_AGENT` (to compare two builds under the same load).
pub fn run_alone() -> Result<()> {
    let bin = crate::util::bench_agent()?;
    println!("{}", section(&bin)?);
    Ok(())
}

/// The scenario's part of the report (a note when not root).
pub fn section(bin: &Path) -> Result<String> {
    const TITLE: &str =
        "## Short HTTP connections with source port reuse, two VIPs sharing one backend (netns)";
    if !crate::util::is_root() {
        return Ok(format!("\n{TITLE}\n\nskipped: needs root\n"));
    }
    let net = topology()?;
    let client = net.client();
    client.sysctl("net.ipv4.ip_local_port_range", PORT_RANGE)?;
    client.sysctl("net.ipv4.tcp_tw_reuse", "1")?;
    let work = tempfile::Builder::new()
        .prefix("rune-bench-reuse-")
        .tempdir()?;
    // Declared after the namespaces: the servers are killed before those go.
    let _nginx = net
        .backends()
        .iter()
        .enumerate()
        .map(|(i, b)| nginx(b.ns(), &work.path().join(format!("nginx-{}", i + 1))))
        .collect::<Result<Vec<_>>>()?;
    wait_answering(client, &BACKENDS).with_context(|| {
        format!(
            "the nginx backends (logs: {}/nginx-*/error.log)",
            work.path().display()
        )
    })?;

    let mut rows = Vec::new();
    // Each mode keeps its index in `Mode::ALL`: its client addresses stay its own.
    for (m, mode) in Mode::selected()? {
        let state = tempfile::Builder::new()
            .prefix(&format!("rune-bench-reuse-{m}-"))
            .tempdir()?;
        let pins = PinDir::new(&format!("bench-reuse-{m}"));
        apply_offline(bin, state.path(), &services_yaml())?;
        let xdp = mode == Mode::EbpfXdp;
        if xdp {
            client.set_tx_checksum(CLIENT_IF, false)?;
        }
        let agent = crate::util::spawn_agent(
            bin,
            net.node(),
            state.path(),
            &mode.flags(pins.path()),
            "warn",
        )?;
        let row = measure(client, m, work.path()).with_context(|| {
            format!(
                "measuring the {} mode (agent log: {})",
                mode.label(),
                agent.log_path().unwrap_or(Path::new("?")).display()
            )
        })?;
        // Stops the agent; then the pins go (detaching the eBPF programs).
        drop(agent);
        drop(pins);
        if xdp {
            client.set_tx_checksum(CLIENT_IF, true)?;
        }
        rows.push((mode, row));
    }
    report(TITLE, &rows)
}

/// The report: one table row per mode, then eBPF / nftables via the VIPs (both
/// VIPs, and the slower one: when one VIP stalls the other takes its CPU time).
fn report(title: &str, rows: &[(Mode, Row)]) -> Result<String> {
    let mut t = String::new();
    writeln!(t, "\n{title}\n")?;
    writeln!(
        t,
        "One nginx backend (`return 200 \"ok\"`, nginx closes each connection) behind two services ({}:80, {}:80); two `wrk -t1 -c{CONNECTIONS} -d{RUN_SECS}s -H 'Connection: close'` at once from one client address, one per VIP (direct: both to the backend); client ports {} with tcp_tw_reuse=1. {ROUNDS} interleaved rounds; conns/s: medians of the two wrk's Requests/sec summed (and of each wrk's own); SYN retransmits (TcpExtTCPSynRetrans) and RSTs sent (TcpOutRsts) in the client namespace and wrk's socket errors (connect/read/write/timeout): totals over the rounds.\n",
        VIPS[0],
        VIPS[1],
        PORT_RANGE.replace(' ', "-"),
    )?;
    writeln!(
        t,
        "| mode | direct conns/s | via the VIPs conns/s | ratio | SYN retransmits (VIP / direct) | client RSTs (VIP / direct) | wrk errors | target |"
    )?;
    writeln!(t, "|---|---:|---:|---:|---:|---:|---|---|")?;
    for (mode, row) in rows {
        let (direct, via) = (row.direct.rate(), row.via.rate());
        let target = match mode {
            Mode::Ebpf | Mode::EbpfXdp => EBPF_TARGET,
            Mode::Nftables | Mode::Userspace => "",
        };
        writeln!(
            t,
            "| {} | {} | {} | {:.2}x | {} / {} | {} / {} | VIP {}, direct {} | {target} |",
            mode.label(),
            row.direct.rates_cell(),
            row.via.rates_cell(),
            via / direct,
            row.via.syn_retrans,
            row.direct.syn_retrans,
            row.via.rsts,
            row.direct.rsts,
            row.via.errors,
            row.direct.errors,
        )?;
    }
    let nft = rows.iter().find(|(m, _)| *m == Mode::Nftables);
    let mut first = true;
    for (mode, row) in rows {
        if let (Mode::Ebpf | Mode::EbpfXdp, Some((_, nft))) = (mode, nft) {
            if std::mem::take(&mut first) {
                writeln!(t)?;
            }
            writeln!(
                t,
                "- {} / nftables via the VIPs: {:.2}x (the slower VIP's: {:.2}x)",
                mode.label(),
                row.via.rate() / nft.via.rate(),
                row.via.slower() / nft.via.slower()
            )?;
        }
    }
    Ok(t)
}

/// The services: one per VIP, port 80 → 80, each with the backend.
fn services_yaml() -> String {
    let endpoints = BACKENDS
        .iter()
        .map(|a| format!("{{address: \"{a}\"}}"))
        .collect::<Vec<_>>()
        .join(", ");
    VIPS.iter()
        .enumerate()
        .map(|(i, vip)| {
            format!(
                "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: reuse-{i}}}\nspec: {{ports: [{{port: 80, targetPort: 80}}], discovery: {{vips: [\"{vip}\"]}}}}\n---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: reuse-{i}}}\nspec: {{endpoints: [{endpoints}]}}\n"
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

/// One mode's direct and VIP sides.
#[derive(Default)]
struct Row {
    /// Straight to the backend (both wrk).
    direct: Side,
    /// Through the two VIPs.
    via: Side,
}

/// One side's figures over the rounds: each run's conns/s (both wrk's summed, and
/// each wrk's own), and the counters summed.
#[derive(Default)]
struct Side {
    /// Each run's conns/s, both wrk's summed.
    rates: Vec<f64>,
    /// Each run's conns/s per wrk (per target).
    each: [Vec<f64>; 2],
    /// The client's SYN retransmits, all runs.
    syn_retrans: u64,
    /// The client's RSTs sent, all runs.
    rsts: u64,
    /// wrk's errors, all runs.
    errors: Errors,
}

impl Side {
    /// The median conns/s.
    fn rate(&self) -> f64 {
        median(&mut self.rates.clone())
    }

    /// Each wrk's median conns/s.
    fn each_rate(&self) -> [f64; 2] {
        self.each.clone().map(|mut v| median(&mut v))
    }

    /// The median conns/s of the slower target.
    fn slower(&self) -> f64 {
        let [a, b] = self.each_rate();
        a.min(b)
    }

    /// The median conns/s, then each wrk's own median (a collapse of one target
    /// shows even when the other takes up the slack): `12000/s (6000 + 6000)`.
    fn rates_cell(&self) -> String {
        let [a, b] = self.each_rate();
        format!("{:.0}/s ({a:.0} + {b:.0})", self.rate())
    }

    /// One run: `src` as the client's address, a wrk per target at once, and the
    /// client namespace's counters before and after (`work`: nstat's history file).
    fn run(
        &mut self,
        client: &NetNs,
        src: Ipv4Addr,
        targets: [Ipv4Addr; 2],
        work: &Path,
    ) -> Result<()> {
        route_src(client, src)?;
        let before = counters(client, work)?;
        let runs = wrk_pair(client, targets)?;
        let after = counters(client, work)?;
        self.rates.push(runs.iter().map(|r| r.rate).sum());
        for (each, r) in self.each.iter_mut().zip(&runs) {
            each.push(r.rate);
        }
        for r in runs {
            self.errors += r.errors;
        }
        self.syn_retrans += after.syn_retrans.saturating_sub(before.syn_retrans);
        self.rsts += after.rsts.saturating_sub(before.rsts);
        Ok(())
    }
}

/// Direct and VIP runs, interleaved, from the mode's own client addresses (`mode`:
/// its index in [`Mode::ALL`]), once both VIPs answer.
fn measure(client: &NetNs, mode: usize, work: &Path) -> Result<Row> {
    wait_answering(client, &VIPS)?;
    let mut row = Row::default();
    for _ in 0..ROUNDS {
        let direct = [BACKENDS[0], BACKENDS[0]];
        row.direct
            .run(client, src_addr(mode, false), direct, work)?;
        row.via.run(client, src_addr(mode, true), VIPS, work)?;
    }
    Ok(row)
}
