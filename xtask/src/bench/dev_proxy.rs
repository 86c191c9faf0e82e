//! The dev-mode proxy vs straight to the backend, on loopback: new TCP connections per
//! second and 1 KiB request/response round trips per second over kept-alive
//! connections. Runs alternate (direct, proxied, direct, …) and the medians are
//! compared as ratios, because on a 2-core machine absolute figures swing with
//! whatever else runs. Direct and proxied runs use different client source addresses
//! so that neither meets the other's TIME_WAIT entries (docs/performance.md). Then
//! the agent's memory with 1,000 services applied.
//!
//! Every load loop is bounded in time and stops by itself; all traffic stays on
//! 127.0.0.0/8.

use super::common::{
    CONCURRENCY, RUN, Scenario, apply, dev_agent, free_port, free_port_block, load, median,
    start_backend_on, wait_connect, wait_ready,
};
use anyhow::Result;
use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr},
    path::Path,
};

/// Rounds per scenario (each round: one direct run and one proxied run). Runs on
/// 2 shared cores swing by ±10 %: nine rounds keep the medians steady.
const ROUNDS: usize = 9;
/// Services applied for the memory figure (three endpoints each).
const MEMORY_SERVICES: usize = 1000;

const BACKEND: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// The section: the dev-mode proxy's two scenarios and the agent's memory.
pub(crate) async fn section(bin: &Path) -> Result<String> {
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
            target(*s)
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
    Ok(t)
}

/// The backend: answers each read with the same number of bytes (1 B or 1 KiB
/// messages), until the client closes.
async fn start_backend() -> Result<SocketAddr> {
    start_backend_on(BACKEND).await
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

/// The dev proxy's target ratio for `scenario`.
fn target(scenario: Scenario) -> f64 {
    match scenario {
        Scenario::Connections => 0.5,
        Scenario::RoundTrips => 0.6,
    }
}
