//! `cargo xtask run`: sets up, then runs the agent from source (release build);
//! `--cluster N` runs a dev cluster of N nodes on one etcd instead.

mod cluster;

use crate::{setup, util};

/// Arguments of `cargo xtask run`.
#[derive(clap::Args)]
pub struct Args {
    /// Run in production mode (without `--dev`): needs root and a real node.
    #[arg(long, conflicts_with = "cluster")]
    production: bool,
    /// Run a cluster of N nodes (network namespaces joined by a bridge, an agent
    /// and a pod in each) on one etcd with TLS, until Ctrl-C; needs root.
    #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "3")]
    cluster: Option<usize>,
    /// Passed through to `rune-agent run` (of every node with `--cluster`).
    #[arg(last = true)]
    args: Vec<String>,
}

/// Runs `cargo run --release -p rune-agent -- run [--dev] ARGS`, or the cluster.
pub fn run(args: Args) -> anyhow::Result<()> {
    setup::run()?;
    if let Some(nodes) = args.cluster {
        return cluster::run(nodes, args.args);
    }
    let mut cmd = util::cargo();
    cmd.args(["run", "--release", "-p", "rune-agent", "--", "run"]);
    if !args.production {
        cmd.arg("--dev");
    }
    cmd.args(&args.args);
    util::run_status("rune-agent", &mut cmd)
}
