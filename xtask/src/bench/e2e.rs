//! `cargo xtask bench e2e` (root): TCP through the VIP, in each production data plane
//! mode ([`Mode`]), vs straight to the backend, end to end through network namespaces.
//!
//! ```text
//! client ns ──veth── node ns (production agent) ──veth── backend ns
//! ```
//!
//! The modes run one after the other, each with a fresh agent and state, and leave
//! nothing behind for the next (userspace: the agent removes its VIP addresses on
//! stop; eBPF: its pins are removed, which detaches its programs).
//!
//! The client (a one-thread tokio runtime whose thread entered the client namespace)
//! runs the same two scenarios as the dev-proxy benchmark: new connections per second
//! (1 B echo, close with RST) and 1 KiB round trips over 16 kept-alive connections.
//! Direct and VIP runs alternate for several rounds, each round from fresh client
//! source addresses never shared between the two sides (TIME_WAIT,
//! docs/performance.md), and the medians are compared, with the CPU time per
//! transaction of the bench process (client and backend) and of the agent, a figure
//! other load disturbs less than the rates. Traffic stays in 198.18.0.0/15 inside the
//! bench's own namespaces, which are deleted on drop; every run is bounded in time.

use super::{
    common::{RUN, Scenario, load, median, start_backend_on},
    modes::{Mode, apply_offline, topology},
};
use anyhow::{Context as _, Result, bail};
use rune_harness::{
    bpffs::PinDir,
    netns::{NetNs, enter},
    topology::CLIENT_IF,
};
use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    sync::mpsc,
    time::{Duration, Instant},
};

/// Rounds (each: one direct run and one VIP run).
const ROUNDS: u8 = 7;
const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 10);
const VIP_PORT: u16 = 80;
/// The topology's backend-1 (`rune_harness::topology`).
const BACKEND: Ipv4Addr = Ipv4Addr::new(198, 18, 11, 2);

/// Client source addresses per mode (198.18.1.x blocks; see [`src_addr`]).
const ADDRS_PER_MODE: u8 = 4 * ROUNDS + 2;

/// The target ratio of `mode` for `scenario`, if any.
fn target(mode: Mode, scenario: Scenario) -> &'static str {
    match (mode, scenario) {
        (Mode::Ebpf | Mode::EbpfXdp, _) => ">= 0.95x",
        (Mode::Nftables, _) => ">= 0.85x",
        (Mode::Userspace, Scenario::RoundTrips) => ">= 0.6x",
        (Mode::Userspace, Scenario::Connections) => "",
    }
}

/// The client source address of one run: a block of [`ADDRS_PER_MODE`] per mode,
/// never shared between direct and VIP runs, scenarios or modes (TIME_WAIT,
/// docs/performance.md). `run` is the round, or `ROUNDS` for the warm-up.
fn src_addr(mode: usize, scenario: Scenario, via_vip: bool, run: u8) -> Ipv4Addr {
    let scenario = match scenario {
        Scenario::Connections => 0,
        Scenario::RoundTrips => 1,
    };
    // Rounds take 0..4*ROUNDS of the block, the two warm-ups the last two.
    let offset = if run >= ROUNDS {
        4 * ROUNDS + u8::from(via_vip)
    } else {
        (scenario * 2 + u8::from(via_vip)) * ROUNDS + run
    };
    Ipv4Addr::new(198, 18, 1, 10 + ADDRS_PER_MODE * mode as u8 + offset)
}

/// The section: TCP through one VIP vs straight to its backend, per mode (a note
/// when not root).
pub(crate) fn section(bin: &Path) -> Result<String> {
    const TITLE: &str = "## End to end through the VIP per data plane mode (netns)";
    if !crate::util::is_root() {
        return Ok(format!("\n{TITLE}\n\nskipped: needs root\n"));
    }
    let topo = topology()?;
    let (client, node) = (topo.client(), topo.node());
    for host in 10..10 + ADDRS_PER_MODE * Mode::ALL.len() as u8 {
        client.ip(&[
            "addr",
            "add",
            &format!("198.18.1.{host}/24"),
            "dev",
            CLIENT_IF,
        ])?;
    }

    // The backend server lives on a thread inside the backend namespace.
    let (tx, rx) = mpsc::channel();
    let backend_path = topo.backends()[0].ns().path();
    std::thread::spawn(move || {
        let result = (|| -> Result<()> {
            enter(&backend_path)?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let addr = start_backend_on(BACKEND).await?;
                let _ = tx.send(Ok(addr));
                // Serves until the process ends (the namespace goes with the bench).
                std::future::pending::<()>().await;
                anyhow::Ok(())
            })
        })();
        if let Err(e) = result {
            let _ = tx.send(Err(e));
        }
    });
    let backend_addr: SocketAddr = rx
        .recv_timeout(Duration::from_secs(10))
        .context("the backend did not start")??;

    let yaml = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: bench}}\nspec: {{ports: [{{port: {VIP_PORT}, targetPort: {}}}], discovery: {{vips: [\"{VIP}\"]}}}}\n---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: bench}}\nspec: {{endpoints: [{{address: \"{BACKEND}\"}}]}}\n",
        backend_addr.port()
    );
    let mut rows = Vec::new();
    // Each mode keeps its index in `Mode::ALL`: its client addresses stay its own.
    for (m, mode) in Mode::selected()? {
        let state = tempfile::Builder::new()
            .prefix(&format!("rune-bench-e2e-{m}-"))
            .tempdir()?;
        let pins = PinDir::new(&format!("bench-e2e-{m}"));
        apply_offline(bin, state.path(), &yaml)?;
        let xdp = mode == Mode::EbpfXdp;
        if xdp {
            client.set_tx_checksum(CLIENT_IF, false)?;
        }
        let agent =
            crate::util::spawn_agent(bin, node, state.path(), &mode.flags(pins.path()), "warn")?;
        let measured = measure(client, backend_addr, m, agent.pid()).with_context(|| {
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
        rows.extend(measured.into_iter().map(|row| (mode, row)));
    }

    let mut t = String::new();
    writeln!(t, "\n{TITLE}\n")?;
    writeln!(
        t,
        "One TCP backend in its own namespace, the production agent in the node namespace (one mode after the other, each with its own direct runs); {ROUNDS} interleaved rounds of 2 s, 16 concurrent clients, medians.\n"
    )?;
    writeln!(
        t,
        "| scenario | mode | direct | via the VIP | ratio | target |"
    )?;
    writeln!(t, "|---|---|---:|---:|---:|---:|")?;
    for (mode, row) in &rows {
        writeln!(
            t,
            "| {} | {} | {:.0}/s | {:.0}/s | {:.2}x | {} |",
            row.scenario.label(),
            mode.label(),
            row.direct.rate,
            row.via.rate,
            row.via.rate / row.direct.rate,
            target(*mode, row.scenario)
        )?;
    }
    writeln!(
        t,
        "\nCPU time per transaction (user + system from /proc, medians of the same runs; less sensitive to other load than the rates): the bench process (client and backend threads; the kernel's forwarding or DNAT work runs in their softirqs) and the agent. The CPU-bound ratio is direct / (client+backend via the VIP + agent): the ratio the rates tend to once every side is CPU-bound on the shared cores.\n"
    )?;
    writeln!(
        t,
        "| scenario | mode | client+backend direct | client+backend via the VIP | agent via the VIP | CPU-bound ratio |"
    )?;
    writeln!(t, "|---|---|---:|---:|---:|---:|")?;
    for (mode, row) in &rows {
        writeln!(
            t,
            "| {} | {} | {:.1} µs | {:.1} µs | {:.1} µs | {:.2}x |",
            row.scenario.label(),
            mode.label(),
            row.direct.bench_us,
            row.via.bench_us,
            row.via.agent_us,
            row.direct.bench_us / (row.via.bench_us + row.via.agent_us)
        )?;
    }
    Ok(t)
}

/// One scenario's medians in one mode.
struct Row {
    scenario: Scenario,
    direct: Run,
    via: Run,
}

/// A run's transactions per second and the CPU time per transaction spent by the
/// bench process (client and backend) and by the agent (medians across rounds).
#[derive(Clone, Copy)]
struct Run {
    rate: f64,
    bench_us: f64,
    agent_us: f64,
}

impl Run {
    /// The median of each figure on its own.
    fn median(runs: &[Run]) -> Run {
        let of = |f: fn(&Run) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
        Run {
            rate: of(|r| r.rate),
            bench_us: of(|r| r.bench_us),
            agent_us: of(|r| r.agent_us),
        }
    }
}

/// The scenarios against the VIP and straight to the backend, interleaved, from a
/// thread in the client namespace, with the CPU time of this process and of the
/// agent (`agent_pid`) around every run.
fn measure(
    client: &NetNs,
    backend_addr: SocketAddr,
    mode: usize,
    agent_pid: u32,
) -> Result<Vec<Row>> {
    let vip = SocketAddr::from((VIP, VIP_PORT));
    let client_path = client.path();
    std::thread::spawn(move || -> Result<Vec<Row>> {
        enter(&client_path)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            // Wait until the VIP answers (maps programmed, or proxies listening).
            let until = Instant::now() + Duration::from_secs(20);
            while load_once(vip).await.is_err() {
                if Instant::now() > until {
                    bail!("{vip} does not answer");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let mut rows = Vec::new();
            for scenario in [Scenario::Connections, Scenario::RoundTrips] {
                let (mut direct, mut via) = (Vec::new(), Vec::new());
                // Warm-up (both scenarios share the two warm-up addresses).
                load(
                    scenario,
                    backend_addr,
                    src_addr(mode, scenario, false, ROUNDS),
                )
                .await?;
                load(scenario, vip, src_addr(mode, scenario, true, ROUNDS)).await?;
                for round in 0..ROUNDS {
                    let d_src = src_addr(mode, scenario, false, round);
                    let v_src = src_addr(mode, scenario, true, round);
                    direct.push(load_with_cpu(scenario, backend_addr, d_src, agent_pid).await?);
                    via.push(load_with_cpu(scenario, vip, v_src, agent_pid).await?);
                }
                rows.push(Row {
                    scenario,
                    direct: Run::median(&direct),
                    via: Run::median(&via),
                });
            }
            Ok(rows)
        })
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the client thread panicked"))?
}

/// One [`load`] run, with the CPU time this process and the agent spent during it,
/// per transaction (the run's rate times [`RUN`] transactions).
async fn load_with_cpu(
    scenario: Scenario,
    target: SocketAddr,
    src: Ipv4Addr,
    agent_pid: u32,
) -> Result<Run> {
    let agent = format!("/proc/{agent_pid}/stat");
    let (bench0, agent0) = (
        crate::util::cpu_seconds("/proc/self/stat")?,
        crate::util::cpu_seconds(&agent)?,
    );
    let rate = load(scenario, target, src).await?;
    let (bench1, agent1) = (
        crate::util::cpu_seconds("/proc/self/stat")?,
        crate::util::cpu_seconds(&agent)?,
    );
    let transactions = (rate * RUN.as_secs_f64()).max(1.0);
    Ok(Run {
        rate,
        bench_us: (bench1 - bench0) * 1e6 / transactions,
        agent_us: (agent1 - agent0) * 1e6 / transactions,
    })
}

/// One short connection to `target` (readiness probe).
async fn load_once(target: SocketAddr) -> Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::time::timeout(
        Duration::from_secs(1),
        tokio::net::TcpStream::connect(target),
    )
    .await??;
    s.write_all(b"x").await?;
    let mut b = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(1), s.read_exact(&mut b)).await??;
    Ok(())
}
