//! `rune-agent`: parse the command line, check the settings before anything is
//! bound, then run the command. Bad settings exit with status 2; a command whose
//! standard output was closed by its reader (`rune-agent get | head -1`) stops
//! quietly with status 141 (128 + SIGPIPE, as a shell reports `yes | head -1`).

use clap::Parser;
use rune_agent::cli::{self, Cli, Command};
use std::process::ExitCode;

/// The log filter without `RUST_LOG`: hickory-server logs every DNS query at
/// `info`, which would drown the agent's own lines.
const DEFAULT_LOG_FILTER: &str = "info,hickory_server=warn";

fn main() -> ExitCode {
    rune_agent::heap::limit_arenas();
    let cli = Cli::parse();
    // The version needs no settings: a bad config must not hide it.
    if let Command::Version = cli.command {
        return exit_code(cli::print_all(&format!(
            "rune-agent {}\n",
            env!("CARGO_PKG_VERSION")
        )));
    }
    let config = match cli.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER)),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match &cli.command {
            Command::Run(_) => rune_agent::run::run(config).await,
            Command::Apply { file, wait, .. } => cli::apply(&config, file, *wait).await,
            Command::Get {
                kind,
                name,
                namespace,
                output,
                ..
            } => {
                cli::get(
                    &config,
                    kind.as_deref(),
                    name.as_deref(),
                    namespace.as_deref(),
                    *output,
                )
                .await
            }
            Command::Delete {
                kind,
                name,
                namespace,
                ..
            } => cli::delete(&config, kind, name, namespace).await,
            Command::Drain { node, .. } => cli::drain(&config, node, false).await,
            Command::Undrain { node, .. } => cli::drain(&config, node, true).await,
            Command::Status(args) => cli::status(&config, args).await,
            Command::Observe(args) => cli::observe::observe(&config, args).await,
            Command::Cleanup { .. } => cli::cleanup(&config).await,
            Command::Preflight { json, .. } => cli::preflight(&config, *json),
            Command::Certs { command } => cli::certs::run(command, &config).await,
            Command::Version => Ok(()),
        }
    });
    exit_code(result)
}

/// Exit status 141 (128 + SIGPIPE), without a message: what a shell reports for a
/// command whose output pipe was closed.
const STDOUT_CLOSED: u8 = 141;

/// The command's exit status; prints its error.
fn exit_code(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.chain().any(|c| c.is::<cli::StdoutClosed>()) => ExitCode::from(STDOUT_CLOSED),
        // Settings checked when a command uses them (the etcd settings together).
        Err(e) if e.chain().any(|c| c.is::<rune_agent::config::ConfigError>()) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
