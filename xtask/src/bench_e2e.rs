//! `cargo xtask bench e2e` (root): TCP through the eBPF VIP vs straight to the
//! backend, end to end through network namespaces.
//!
//! ```text
//! client ns ──veth── node ns (production agent, tc on n-client) ──veth── backend ns
//! ```
//!
//! The client (a one-thread tokio runtime whose thread entered the client namespace)
//! runs the same two scenarios as the dev-proxy benchmark: new connections per second
//! (1 B echo, close with RST) and 1 KiB round trips over 16 kept-alive connections.
//! Direct and VIP runs alternate for several rounds, each round from fresh client
//! source addresses never shared between the two sides (TIME_WAIT, FACTS.md), and the
//! medians are compared. Traffic stays in 198.18.0.0/15 inside the bench's own
//! namespaces, which are deleted on drop; every run is bounded in time.

use crate::bench::{Scenario, load, median, start_backend_on};
use crate::bench_sync::{Agent, Netns, PinDir, TempDir};
use anyhow::{Context as _, Result, bail};
use std::{
    fmt::Write as _,
    fs::File,
    net::{Ipv4Addr, SocketAddr},
    os::fd::AsRawFd as _,
    path::Path,
    process::Command,
    sync::mpsc,
    time::{Duration, Instant},
};

/// Rounds (each: one direct run and one VIP run).
const ROUNDS: u8 = 7;
const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 10);
const VIP_PORT: u16 = 80;
const BACKEND: Ipv4Addr = Ipv4Addr::new(198, 18, 10, 2);

/// Runs the section alone.
pub fn run_alone() -> Result<()> {
    crate::util::run_status(
        "build the release agent",
        crate::util::cargo().args(["build", "--release", "-p", "rune-agent"]),
    )?;
    let bin = crate::util::target_dir().join("release/rune-agent");
    println!("{}", section(&bin)?);
    Ok(())
}

/// The section of the report (a note when not root).
pub fn section(bin: &Path) -> Result<String> {
    const TITLE: &str = "## End to end through the eBPF VIP (netns, tc)";
    if !crate::util::is_root() {
        return Ok(format!("\n{TITLE}\n\nskipped: needs root\n"));
    }
    let pid = std::process::id();
    let client = Netns::create(&format!("rune-bench-e2e-c-{pid}"))?;
    let node = Netns::create(&format!("rune-bench-e2e-n-{pid}"))?;
    let backend = Netns::create(&format!("rune-bench-e2e-b-{pid}"))?;
    wire(&client, &node, &backend)?;

    // The backend server lives on a thread inside the backend namespace.
    let (tx, rx) = mpsc::channel();
    let backend_path = backend.path();
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

    let state = TempDir::new(&format!("rune-bench-e2e-{pid}"))?;
    let pins = PinDir(format!("/sys/fs/bpf/rune-bench-e2e-{pid}").into());
    let yaml = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: bench}}\nspec: {{ports: [{{port: {VIP_PORT}, targetPort: {}}}], discovery: {{vips: [\"{VIP}\"]}}}}\n---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: bench}}\nspec: {{endpoints: [{{address: \"{BACKEND}\"}}]}}\n",
        backend_addr.port()
    );
    // Written into the store before the agent starts (no agent: the CLI writes the
    // store directly), so the two never race for it.
    let mut apply = Command::new(bin);
    apply
        .arg("--state-dir")
        .arg(&state.0)
        .args(["apply", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null());
    let mut child = apply.spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        use std::io::Write as _;
        stdin.write_all(yaml.as_bytes())?;
    }
    if !child.wait()?.success() {
        bail!("applying the bench service failed");
    }
    let agent = Agent::start(bin, &node, &state.0, &pins.0, "n-client")?;
    let vip = SocketAddr::from((VIP, VIP_PORT));

    // The client: one thread in the client namespace runs every load.
    let client_path = client.path();
    let rows = std::thread::spawn(move || -> Result<Vec<(Scenario, f64, f64)>> {
        enter(&client_path)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            // Wait until the VIP answers (maps programmed).
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
                load(scenario, backend_addr, Ipv4Addr::new(198, 18, 1, 100)).await?;
                load(scenario, vip, Ipv4Addr::new(198, 18, 1, 200)).await?;
                for round in 0..ROUNDS {
                    let base = if matches!(scenario, Scenario::Connections) {
                        10
                    } else {
                        50
                    };
                    let d_src = Ipv4Addr::new(198, 18, 1, base + round);
                    let v_src = Ipv4Addr::new(198, 18, 1, base + 20 + round);
                    direct.push(load(scenario, backend_addr, d_src).await?);
                    via.push(load(scenario, vip, v_src).await?);
                }
                rows.push((scenario, median(&mut direct), median(&mut via)));
            }
            Ok(rows)
        })
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the client thread panicked"))??;
    drop(agent);

    let mut t = String::new();
    writeln!(t, "\n{TITLE}\n")?;
    writeln!(
        t,
        "One TCP backend in its own namespace, the production agent (tc on the node's client-facing veth) in the node namespace; {ROUNDS} interleaved rounds of 2 s, 16 concurrent clients, medians.\n"
    )?;
    writeln!(t, "| scenario | direct | via eBPF VIP | ratio | target |")?;
    writeln!(t, "|---|---:|---:|---:|---:|")?;
    for (scenario, direct, via) in rows {
        let name = match scenario {
            Scenario::Connections => "TCP connections/s (connect, 1 B echo, close)",
            Scenario::RoundTrips => "1 KiB request/response round trips/s (keepalive)",
        };
        writeln!(
            t,
            "| {name} | {direct:.0}/s | {via:.0}/s | {:.2}x | >= 0.95x |",
            via / direct
        )?;
    }
    Ok(t)
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

/// Moves the calling thread into the namespace at `path`.
fn enter(path: &Path) -> Result<()> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: setns on an open namespace file changes only this thread's namespace.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error()).context("setns");
    }
    Ok(())
}

fn ip(args: &[&str]) -> Result<()> {
    crate::util::run_status(
        "configure the bench's namespaces",
        Command::new("ip").args(args),
    )
}

/// Veths, addresses (client: 198.18.1.2 plus one source address per run), routes,
/// forwarding in the node.
fn wire(client: &Netns, node: &Netns, backend: &Netns) -> Result<()> {
    let (c, n, b) = (
        &client_name(client),
        &client_name(node),
        &client_name(backend),
    );
    ip(&[
        "link", "add", "c-node", "netns", c, "type", "veth", "peer", "n-client", "netns", n,
    ])?;
    ip(&[
        "link", "add", "b-node", "netns", b, "type", "veth", "peer", "n-back", "netns", n,
    ])?;
    ip(&["-n", c, "addr", "add", "198.18.1.2/24", "dev", "c-node"])?;
    for host in (10..10 + ROUNDS)
        .chain(30..30 + ROUNDS)
        .chain(50..50 + ROUNDS)
        .chain(70..70 + ROUNDS)
        .chain([100, 200])
    {
        ip(&[
            "-n",
            c,
            "addr",
            "add",
            &format!("198.18.1.{host}/24"),
            "dev",
            "c-node",
        ])?;
    }
    ip(&["-n", n, "addr", "add", "198.18.1.1/24", "dev", "n-client"])?;
    ip(&["-n", n, "addr", "add", "198.18.10.1/24", "dev", "n-back"])?;
    ip(&["-n", b, "addr", "add", "198.18.10.2/24", "dev", "b-node"])?;
    for (ns, dev) in [(c, "c-node"), (n, "n-client"), (n, "n-back"), (b, "b-node")] {
        ip(&["-n", ns, "link", "set", dev, "up"])?;
    }
    ip(&["-n", c, "route", "add", "default", "via", "198.18.1.1"])?;
    ip(&["-n", b, "route", "add", "default", "via", "198.18.10.1"])?;
    crate::util::run_status(
        "enable forwarding in the node namespace",
        Command::new("ip").args(["netns", "exec", n, "sysctl", "-qw", "net.ipv4.ip_forward=1"]),
    )
}

fn client_name(ns: &Netns) -> String {
    ns.path()
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default()
}
