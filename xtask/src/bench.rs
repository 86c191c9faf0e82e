//! `cargo xtask bench`: performance figures measured side by side in one run.
//!
//! Dev-mode proxy vs straight to the backend, on loopback: new TCP connections per
//! second and 1 KiB request/response round trips per second over kept-alive
//! connections. Runs alternate (direct, proxied, direct, …) and the medians are
//! compared as ratios, because on a 2-core machine absolute figures swing with
//! whatever else runs. Direct and proxied runs use different client source addresses
//! so that neither meets the other's TIME_WAIT entries (docs/performance.md). Then
//! the agent's memory with 1,000 services applied. Then the DNS figures
//! ([`crate::bench_dns`]), the eBPF load balancer per packet ([`crate::bench_ebpf`],
//! root only) and the production agent's eBPF map sync ([`crate::bench_sync`], root
//! only).
//!
//! Every load loop is bounded in time and stops by itself; all traffic stays on
//! 127.0.0.0/8.

use anyhow::{Context, Result, bail};
use rune_harness::agent::Agent;
use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpSocket, TcpStream},
};

/// Rounds per scenario (each round: one direct run and one proxied run). Runs on
/// 2 shared cores swing by ±10 %: nine rounds keep the medians steady.
const ROUNDS: usize = 9;
/// Length of one run.
pub(crate) const RUN: Duration = Duration::from_secs(2);
/// Concurrent client connections.
const CONCURRENCY: usize = 16;
/// Request and response size of the round-trip scenario.
const MESSAGE: usize = 1024;
/// Services applied for the memory figure (three endpoints each).
const MEMORY_SERVICES: usize = 1000;

const BACKEND: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// Runs every benchmark and prints the table (also written to target/bench.md);
/// `RUNE_BENCH_AGENT=PATH` measures that agent binary instead of building one.
pub fn run() -> Result<()> {
    let bin = crate::util::bench_agent()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut report = rt.block_on(bench_all(&bin))?;
    report.push_str(&crate::bench_ebpf::section()?);
    report.push_str(&crate::bench_sync::section(&bin)?);
    report.push_str(&crate::bench_e2e::section(&bin)?);
    report.push_str(&crate::bench_apply::section(&bin)?);
    println!("{report}");
    let out = crate::util::target_dir().join("bench.md");
    std::fs::write(&out, &report)?;
    println!("(written to {})", out.display());
    Ok(())
}

async fn bench_all(bin: &Path) -> Result<String> {
    let state = tempfile::Builder::new().prefix("rune-bench-").tempdir()?;
    let backend = start_backend().await?;
    let service_port = free_port().await?;
    let agent = dev_agent(bin, &state, &[])?;
    wait_ready(&agent).await?;
    apply(
        bin,
        &agent,
        &service_yaml("bench", service_port, backend.port(), &[BACKEND]),
    )?;
    let proxied = SocketAddr::from((Ipv4Addr::LOCALHOST, service_port));
    wait_connect(proxied).await?;

    let mut rows = Vec::new();
    for scenario in [Scenario::Connections, Scenario::RoundTrips] {
        let (mut direct, mut via) = (Vec::new(), Vec::new());
        // Warm-up, not counted: first connections, caches, CPU frequency.
        load(scenario, backend, Ipv4Addr::new(127, 0, 9, 1)).await?;
        load(scenario, proxied, Ipv4Addr::new(127, 0, 19, 1)).await?;
        for round in 0..ROUNDS {
            // Fresh client source addresses per round and side (never shared between
            // direct and proxied runs: TIME_WAIT reuse stalls, docs/performance.md).
            let d_src = Ipv4Addr::new(127, 0, 10, round as u8 + 1);
            let p_src = Ipv4Addr::new(127, 0, 20, round as u8 + 1);
            direct.push(load(scenario, backend, d_src).await?);
            via.push(load(scenario, proxied, p_src).await?);
        }
        rows.push((scenario, median(&mut direct), median(&mut via)));
    }
    let rss_idle = agent.status_kib("VmRSS")?;
    drop(agent);

    // Memory with 1,000 services (dev mode binds one listener per service port).
    let state2 = tempfile::Builder::new()
        .prefix("rune-bench-mem-")
        .tempdir()?;
    let agent = dev_agent(bin, &state2, &["--dev-port-offset", "0"])?;
    wait_ready(&agent).await?;
    let base = free_port_block(MEMORY_SERVICES).await?;
    let mut yaml = String::new();
    for i in 0..MEMORY_SERVICES {
        // Three endpoints each, as a small replicated service has.
        let endpoints = [2, 3, 4].map(|h| Ipv4Addr::new(127, 0, 0, h));
        yaml.push_str(&service_yaml(
            &format!("s{i}"),
            base + i as u16,
            8080,
            &endpoints,
        ));
        yaml.push_str("---\n");
    }
    apply(bin, &agent, &yaml)?;
    wait_connect(SocketAddr::from((
        Ipv4Addr::LOCALHOST,
        base + MEMORY_SERVICES as u16 - 1,
    )))
    .await?;
    let rss_1000 = agent.status_kib("VmRSS")?;
    drop(agent);

    let mut t = String::new();
    writeln!(
        t,
        "## rune-agent benchmarks (dev-mode proxy vs direct, loopback)"
    )?;
    writeln!(t)?;
    writeln!(
        t,
        "{ROUNDS} interleaved rounds of {} s each, {CONCURRENCY} concurrent clients, medians.",
        RUN.as_secs()
    )?;
    writeln!(t)?;
    writeln!(t, "| scenario | direct | via dev proxy | ratio | target |")?;
    writeln!(t, "|---|---:|---:|---:|---:|")?;
    for (s, d, v) in &rows {
        writeln!(
            t,
            "| {} | {:.0}/s | {:.0}/s | {:.2}x | >= {:.1}x |",
            s.label(),
            d,
            v,
            v / d,
            s.target()
        )?;
    }
    writeln!(
        t,
        "| agent memory (RSS), 1 service | | {:.1} MiB | | |",
        rss_idle as f64 / 1024.0
    )?;
    writeln!(
        t,
        "| agent memory (RSS), {MEMORY_SERVICES} services x 3 endpoints | | {:.1} MiB | | < 50 MiB |",
        rss_1000 as f64 / 1024.0
    )?;
    t.push_str(&crate::bench_dns::run(bin).await?);
    Ok(t)
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Scenario {
    /// New connection, 1-byte request and answer, close.
    Connections,
    /// 1 KiB request / 1 KiB response over kept-alive connections.
    RoundTrips,
}

impl Scenario {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Scenario::Connections => "TCP connections/s (connect, 1 B echo, close)",
            Scenario::RoundTrips => "1 KiB request/response round trips/s (keepalive)",
        }
    }

    fn target(self) -> f64 {
        match self {
            Scenario::Connections => 0.5,
            Scenario::RoundTrips => 0.6,
        }
    }
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs one scenario against `target` from source address `src` for [`RUN`];
/// returns operations per second. Any failed operation fails the benchmark.
pub(crate) async fn load(scenario: Scenario, target: SocketAddr, src: Ipv4Addr) -> Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..CONCURRENCY {
        let (done, stop) = (done.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            match scenario {
                Scenario::Connections => {
                    while !stop.load(Ordering::Relaxed) {
                        let mut s = connect_from(src, target).await?;
                        s.write_all(b"x").await?;
                        let mut b = [0u8; 1];
                        s.read_exact(&mut b).await?;
                        // RST instead of FIN: no TIME_WAIT pile-up on the client side.
                        s.set_zero_linger()?;
                        drop(s);
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Scenario::RoundTrips => {
                    let mut s = connect_from(src, target).await?;
                    let req = [7u8; MESSAGE];
                    let mut resp = [0u8; MESSAGE];
                    while !stop.load(Ordering::Relaxed) {
                        s.write_all(&req).await?;
                        s.read_exact(&mut resp).await?;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            anyhow::Ok(())
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(RUN).await;
    stop.store(true, Ordering::Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    let count = done.load(Ordering::Relaxed);
    for w in workers {
        tokio::time::timeout(Duration::from_secs(10), w)
            .await
            .context("a load worker did not stop")???;
    }
    Ok(count as f64 / elapsed)
}

async fn connect_from(src: Ipv4Addr, target: SocketAddr) -> Result<TcpStream> {
    let sock = TcpSocket::new_v4()?;
    sock.bind(SocketAddr::from((src, 0)))?;
    let s = tokio::time::timeout(Duration::from_secs(5), sock.connect(target))
        .await
        .with_context(|| format!("connect {target} timed out"))??;
    s.set_nodelay(true)?;
    Ok(s)
}

/// The backend: answers each read with the same number of bytes (1 B or 1 KiB
/// messages), until the client closes.
async fn start_backend() -> Result<SocketAddr> {
    start_backend_on(BACKEND).await
}

/// [`start_backend`] on address `ip` (any free port).
pub(crate) async fn start_backend_on(ip: Ipv4Addr) -> Result<SocketAddr> {
    let listener = TcpListener::bind((ip, 0)).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let mut buf = vec![0u8; MESSAGE];
                let mut have = 0usize;
                loop {
                    match s.read(&mut buf[have..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => have += n,
                    }
                    // 1-byte probes answer at once; 1 KiB requests once complete.
                    if have == 1 || have == MESSAGE {
                        if s.write_all(&buf[..have]).await.is_err() {
                            return;
                        }
                        have = 0;
                    }
                }
            });
        }
    });
    Ok(addr)
}

fn service_yaml(name: &str, port: u16, backend_port: u16, backends: &[Ipv4Addr]) -> String {
    let endpoints: Vec<String> = backends
        .iter()
        .map(|a| format!("{{address: {a}}}"))
        .collect();
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: {port}, targetPort: {backend_port}}}]}}\n---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\nspec: {{endpoints: [{}]}}\n",
        endpoints.join(", ")
    )
}

pub(crate) async fn free_port() -> Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await?
        .local_addr()?
        .port())
}

/// The first of `n` consecutive ports that are free on 127.0.0.1 right now.
async fn free_port_block(n: usize) -> Result<u16> {
    'next: for base in (20000u16..60000).step_by(n + 500) {
        for p in base..base + n as u16 {
            if std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, p)).is_err() {
                continue 'next;
            }
        }
        return Ok(base);
    }
    bail!("no block of {n} free ports on 127.0.0.1")
}

async fn wait_connect(addr: SocketAddr) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{addr} did not accept connections within 30 s")
}

/// The release agent in dev mode (`run --dev`) on the state directory `state`
/// (removed with it), `extra` flags after; killed on drop.
pub(crate) fn dev_agent(bin: &Path, state: &tempfile::TempDir, extra: &[&str]) -> Result<Agent> {
    Agent::command(bin, state.path())
        .args(["--dev"])
        .args(extra)
        .env("RUST_LOG", "warn")
        .spawn()
}

/// Waits (up to 30 s) until the agent answers `/readyz` with 200.
pub(crate) async fn wait_ready(agent: &Agent) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        agent.ensure_alive()?;
        if matches!(agent.http_get("/readyz"), Ok((200, _))) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("the agent was not ready within 30 s")
}

/// `rune-agent apply -f -` of `yaml` against `agent`'s state directory.
pub(crate) fn apply(bin: &Path, agent: &Agent, yaml: &str) -> Result<()> {
    crate::util::rune_apply(bin, &agent.state_dir, yaml)
}
