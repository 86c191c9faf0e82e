//! Small helpers shared by the tasks: paths and running commands.

use std::{
    env,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};
use rune_harness::{agent::Agent, netns::NetNs};

/// The workspace root (the parent of the xtask crate).
pub fn workspace_root() -> PathBuf {
    let xtask_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    xtask_dir.parent().map_or(xtask_dir.clone(), PathBuf::from)
}

/// The cargo target directory (`$CARGO_TARGET_DIR` or `<root>/target`).
pub fn target_dir() -> PathBuf {
    env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace_root().join("target"), PathBuf::from)
}

/// A `cargo` command (the cargo running xtask) in the workspace root.
pub fn cargo() -> Command {
    let mut cmd = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

/// Runs `cmd` with inherited stdio; fails with `what` when it does not succeed.
pub fn run_status(what: &str, cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("{what}: could not start {cmd:?}"))?;
    if !status.success() {
        bail!("{what} failed ({status}): {}", describe(cmd));
    }
    Ok(())
}

/// Runs `cmd` and returns its stdout when it succeeds, `None` when it fails or
/// cannot start (used for checks, where "no" is an answer, not an error).
pub fn output(cmd: &mut Command) -> Option<String> {
    cmd.output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
}

/// The command line of `cmd`, for messages.
pub fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|s| s.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `BIN --state-dir STATE apply -f -` with `yaml` on its stdin; fails unless the
/// command succeeds. Used by every bench that stores objects (into a stopped
/// agent's store, or through a running agent's socket).
pub fn rune_apply(bin: &Path, state: &Path, yaml: &str) -> anyhow::Result<()> {
    let out = rune_harness::agent::run_cli(bin, None, state, &["apply", "-f", "-"], Some(yaml));
    if !out.status.success() {
        bail!(
            "rune-agent apply failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The production agent `bin` as a bench's child in `netns` (entered with setns
/// before exec, so it still sees the host's bpffs): `rune-agent run --state-dir
/// STATE ARGS` with the metrics and DNS listeners on the namespace's loopback (a
/// fresh namespace: every port is free), DNS never forwarded, `RUST_LOG=rust_log`,
/// its log in `STATE.log`; it dies with the xtask, and is stopped (SIGTERM, then
/// SIGKILL after 10 s) on drop.
pub fn spawn_agent(
    bin: &Path,
    netns: &NetNs,
    state: &Path,
    args: &[String],
    rust_log: &str,
) -> anyhow::Result<Agent> {
    Agent::command(bin, state)
        .netns(netns)
        .metrics(SocketAddr::from(([127, 0, 0, 1], 9464)))
        .args(args)
        .args(["--dns-addr", "127.0.0.1:15353"])
        .env("RUST_LOG", rust_log)
        .log_file(state.with_extension("log"))
        .stop_gracefully()
        .die_with_parent()
        .spawn()
}

/// The agent binary a bench measures: the one named by `RUNE_BENCH_AGENT` (to
/// compare two builds back to back under the same load), else the release agent
/// built from this tree.
pub fn bench_agent() -> anyhow::Result<PathBuf> {
    if let Some(bin) = env::var_os("RUNE_BENCH_AGENT") {
        return Ok(PathBuf::from(bin));
    }
    run_status(
        "build the release agent",
        cargo().args(["build", "--release", "-p", "rune-agent"]),
    )?;
    Ok(target_dir().join("release/rune-agent"))
}

/// The user + system CPU time, in seconds, of the process whose `stat` file is
/// `path` (`/proc/PID/stat` or `/proc/self/stat`; all its threads, clock-tick
/// resolution).
pub fn cpu_seconds(path: &str) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    // The fields after the command name, which may itself contain spaces.
    let (_, rest) = stat
        .rsplit_once(')')
        .with_context(|| format!("{path}: no command name"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of proc(5): indices 11 and 12 here
    // (field 3 is the first after the name).
    let ticks = |i: usize| -> anyhow::Result<f64> {
        let f = fields
            .get(i)
            .with_context(|| format!("{path}: too few fields"))?;
        Ok(f.parse::<u64>()? as f64)
    };
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    anyhow::ensure!(hz > 0, "sysconf(_SC_CLK_TCK) failed");
    Ok((ticks(11)? + ticks(12)?) / hz as f64)
}
