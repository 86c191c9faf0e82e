//! `cargo xtask run`: sets up, then runs the agent from source (release build).

use crate::{setup, util};

/// Arguments of `cargo xtask run`.
#[derive(clap::Args)]
pub struct Args {
    /// Run in production mode (without `--dev`): needs root and a real node.
    #[arg(long)]
    production: bool,
    /// Passed through to `rune-agent run`.
    #[arg(last = true)]
    args: Vec<String>,
}

/// Runs `cargo run --release -p rune-agent -- run [--dev] ARGS`.
pub fn run(args: Args) -> anyhow::Result<()> {
    setup::run()?;
    let mut cmd = util::cargo();
    cmd.args(["run", "--release", "-p", "rune-agent", "--", "run"]);
    if !args.production {
        cmd.arg("--dev");
    }
    cmd.args(&args.args);
    util::run_status("rune-agent", &mut cmd)
}
