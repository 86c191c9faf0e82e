//! The production agent as a bench's child process, in a network namespace of the
//! bench's own: one way to start it (flags, environment, log) and to stop it.

use crate::bench_sync::Netns;
use anyhow::{Context as _, Result};
use std::{
    fs::File,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

/// A running `rune-agent run` in a bench namespace; SIGTERM (then SIGKILL after
/// 10 s) and reaped on drop.
pub(crate) struct AgentProcess {
    pub(crate) child: Child,
    /// When it was spawned.
    pub(crate) started: Instant,
    /// Its stderr: `STATE.log` beside the state directory.
    pub(crate) log: PathBuf,
}

impl AgentProcess {
    /// Spawns `BIN --state-dir STATE run ARGS` in `netns` (entered with setns before
    /// exec, so it still sees the host's bpffs) with the metrics and DNS listeners on
    /// the namespace's loopback, DNS never forwarded, `RUST_LOG=rust_log`, and its
    /// stderr in `STATE.log`.
    pub(crate) fn spawn(
        bin: &Path,
        netns: &Netns,
        state: &Path,
        args: &[String],
        rust_log: &str,
    ) -> Result<Self> {
        let ns = File::open(netns.path())
            .with_context(|| format!("opening {}", netns.path().display()))?;
        let log = state.with_extension("log");
        let stderr = File::create(&log)?;
        let mut cmd = Command::new(bin);
        cmd.arg("--state-dir")
            .arg(state)
            .arg("run")
            .args(args)
            // A fresh namespace: every port on its loopback is free.
            .args(["--metrics-addr", "127.0.0.1:9464"])
            .args(["--dns-addr", "127.0.0.1:15353"])
            // Never forward DNS to this machine's resolvers.
            .env("RUNE_DNS_RESOLV_CONF", "/dev/null")
            .env("RUST_LOG", rust_log)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        crate::util::enter_netns_on_exec(&mut cmd, ns);
        let started = Instant::now();
        let child = cmd.spawn().context("starting the agent")?;
        Ok(Self {
            child,
            started,
            log,
        })
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        // SAFETY: kill with our own child's pid (not reaped yet, so not reused).
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
