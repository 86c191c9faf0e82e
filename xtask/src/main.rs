//! Project tasks: `cargo xtask setup | build-ebpf | test | run | bench`.
//!
//! Each subcommand lives in its own module with a `run` function; adding one is a
//! `mod` line, an enum variant and a match arm.

mod bench;
mod bench_apply;
mod bench_dns;
mod bench_e2e;
mod bench_ebpf;
mod bench_reuse;
mod bench_sync;
mod build_ebpf;
mod run;
mod setup;
mod test;
mod util;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Project tasks for rune-agent.
#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install what the project needs (apt packages, nightly rust-src, bpf-linker,
    /// bpffs); idempotent, and offline when nothing is missing.
    Setup,
    /// Build only the eBPF programs and print the object's path.
    BuildEbpf,
    /// Setup, then fmt, clippy, build, unit tests and the end-to-end tests (serially).
    Test,
    /// Setup, then run the agent (`rune-agent run --dev ARGS` unless `--production`).
    Run(run::Args),
    /// Setup, then measure the dev-mode proxy against direct connections, the
    /// embedded DNS server against dnsmasq, the agent's memory (side by side in one
    /// run), the eBPF load balancer's per-packet cost and the eBPF map sync of
    /// 10,000 services, and TCP and short HTTP connections end to end through the
    /// VIPs per data plane mode, and applies into the store; prints a table. `bench
    /// ebpf`, `bench sync`, `bench e2e`, `bench reuse` (they need root), `bench dns`
    /// and `bench apply` run one section alone.
    Bench {
        /// Only this section.
        #[arg(value_enum)]
        section: Option<BenchSection>,
    },
}

/// A section of `cargo xtask bench` that can run alone.
#[derive(Clone, Copy, clap::ValueEnum)]
enum BenchSection {
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
    /// The embedded DNS server against dnsmasq, and its memory at 10,000 services.
    Dns,
    /// Applies into the embedded store up to 100,000 services: one object, and large
    /// applies' objects per second.
    Apply,
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Setup => setup::run(),
        Command::BuildEbpf => build_ebpf::run(),
        Command::Test => test::run(),
        Command::Run(args) => run::run(args),
        Command::Bench { section: None } => setup::run().and_then(|()| bench::run()),
        Command::Bench {
            section: Some(BenchSection::Ebpf),
        } => setup::run().and_then(|()| bench_ebpf::run_alone()),
        Command::Bench {
            section: Some(BenchSection::Sync),
        } => setup::run().and_then(|()| bench_sync::run_alone()),
        Command::Bench {
            section: Some(BenchSection::E2e),
        } => setup::run().and_then(|()| bench_e2e::run_alone()),
        Command::Bench {
            section: Some(BenchSection::Reuse),
        } => setup::run().and_then(|()| bench_reuse::run_alone()),
        Command::Bench {
            section: Some(BenchSection::Dns),
        } => setup::run().and_then(|()| bench_dns::run_alone()),
        Command::Bench {
            section: Some(BenchSection::Apply),
        } => setup::run().and_then(|()| bench_apply::run_alone()),
    };
    // One line per cause, no backtrace: the failing step's own output is above.
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
