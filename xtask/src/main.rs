//! Project tasks: `cargo xtask setup | build-ebpf | test | run | bench`.
//!
//! Each subcommand lives in its own module with a `run` function; adding one is a
//! `mod` line, an enum variant and a match arm.

mod bench;
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
        section: Option<bench::Section>,
    },
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Setup => setup::run(),
        Command::BuildEbpf => build_ebpf::run(),
        Command::Test => test::run(),
        Command::Run(args) => run::run(args),
        Command::Bench { section } => setup::run().and_then(|()| bench::run(section)),
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
