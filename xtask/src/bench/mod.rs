//! `cargo xtask bench`: performance figures, each measured side by side in one run
//! (interleaved rounds, medians, ratios against a reference measured in the same
//! run), one module per section; each section's method is in docs/performance.md.
//!
//! Every load loop is bounded in time and stops by itself; traffic stays on
//! loopback or in the benches' own network namespaces.

mod apply;
mod cluster;
mod common;
mod dev_proxy;
mod dns;
mod e2e;
mod ebpf;
mod ebpf_policy;
mod ingress;
mod modes;
mod policy;
mod reuse;
mod sync;

use anyhow::Result;
use std::path::Path;

/// A section of `cargo xtask bench` that can run alone.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Section {
    /// The eBPF load balancer per packet (BPF_PROG_TEST_RUN).
    Ebpf,
    /// The production agent's eBPF map sync: 10,000 services snapshot to maps, and
    /// one endpoint change from the ordered log to the maps.
    Sync,
    /// TCP end to end through the VIP vs straight to the backend per data plane
    /// mode, then the `reuse` scenario (netns).
    E2e,
    /// Short HTTP connections (nginx, wrk) with quick source port reuse through two
    /// VIPs sharing one backend, per data plane mode vs direct (netns).
    Reuse,
    /// Network policy programming, eBPF and nftables: 1,000 services with 10-peer
    /// policies snapshot to kernel, and one policy change's latency.
    Policy,
    /// The embedded DNS server against dnsmasq, and its memory at 10,000 services.
    Dns,
    /// Applies into the embedded store up to 100,000 services: one object, and large
    /// applies' objects per second.
    Apply,
    /// A cluster on etcd: apply → acknowledged by every node (N = 3 and 20), a new
    /// node joining 10,000 services, etcd traffic per idle node (netns).
    Cluster,
    /// The ingress proxy vs nginx as a reverse proxy: requests/s and p99 with
    /// keep-alive, a new connection per request, and TLS (loopback, wrk).
    Ingress,
}

/// Runs one section, or every one and prints the whole report (also written to
/// target/bench.md); `RUNE_BENCH_AGENT=PATH` measures that agent binary instead of
/// building one.
pub fn run(section: Option<Section>) -> Result<()> {
    match section {
        None => run_all(),
        Some(Section::Ebpf) => ebpf::run_alone(),
        Some(Section::Sync) => sync::run_alone(),
        Some(Section::E2e) => {
            let bin = crate::util::bench_agent()?;
            println!("{}", end_to_end(&bin)?);
            Ok(())
        }
        Some(Section::Reuse) => reuse::run_alone(),
        Some(Section::Policy) => policy::run_alone(),
        Some(Section::Dns) => dns::run_alone(),
        Some(Section::Apply) => apply::run_alone(),
        Some(Section::Cluster) => cluster::run_alone(),
        Some(Section::Ingress) => ingress::run_alone(),
    }
}

/// Every section, in the report's order.
fn run_all() -> Result<()> {
    let bin = crate::util::bench_agent()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut report = rt.block_on(async {
        let mut t = dev_proxy::section(&bin).await?;
        t.push_str(&dns::run(&bin).await?);
        anyhow::Ok(t)
    })?;
    report.push_str(&ebpf::section()?);
    report.push_str(&sync::section(&bin)?);
    report.push_str(&policy::section(&bin)?);
    report.push_str(&end_to_end(&bin)?);
    report.push_str(&apply::section(&bin)?);
    report.push_str(&cluster::section(&bin)?);
    report.push_str(&ingress::section(&bin)?);
    println!("{report}");
    let out = crate::util::target_dir().join("bench.md");
    std::fs::write(&out, &report)?;
    println!("(written to {})", out.display());
    Ok(())
}

/// TCP through one VIP per mode, then short HTTP connections with port reuse
/// through two VIPs.
fn end_to_end(bin: &Path) -> Result<String> {
    let mut t = e2e::section(bin)?;
    t.push_str(&reuse::section(bin)?);
    Ok(t)
}
