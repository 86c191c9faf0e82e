//! What the benchmark sections share: the TCP load scenarios and their backend,
//! medians, free ports, and the dev-mode agent the loopback sections start.

use anyhow::{Context, Result, bail};
use rune_harness::agent::Agent;
use std::{
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

/// Length of one load run.
pub(crate) const RUN: Duration = Duration::from_secs(2);
/// Concurrent client connections of a load run.
pub(crate) const CONCURRENCY: usize = 16;
/// Request and response size of the round-trip scenario.
pub(crate) const MESSAGE: usize = 1024;

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
}

/// A figure's verdict against its target, for the report's tables.
pub(crate) fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "not met" }
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

/// The benches' TCP backend on address `ip` (any free port): answers each read with
/// the same number of bytes (1 B or 1 KiB messages), until the client closes.
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

pub(crate) async fn free_port() -> Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await?
        .local_addr()?
        .port())
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

/// `rune-agent --state-dir STATE apply -f FILE`: writes a bench's snapshot into a
/// stopped agent's store before the agent under measure starts on it.
pub(crate) fn apply_snapshot(bin: &Path, state: &Path, file: &Path) -> Result<()> {
    let mut apply = std::process::Command::new(bin);
    apply
        .arg("--state-dir")
        .arg(state)
        .args(["apply", "-f"])
        .arg(file)
        .stdout(std::process::Stdio::null());
    crate::util::run_status(
        "apply the snapshot to the stopped agent's store",
        &mut apply,
    )
}

/// The first of `n` consecutive ports that are free on 127.0.0.1 right now.
pub(crate) async fn free_port_block(n: usize) -> Result<u16> {
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

/// Waits (up to 30 s) until `addr` accepts a TCP connection.
pub(crate) async fn wait_connect(addr: SocketAddr) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("{addr} did not accept connections within 30 s")
}
