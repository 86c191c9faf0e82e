//! The real `rune-agent` binary as a child process: [`Agent`] (killed or stopped on
//! drop), started through [`AgentCommand`] (tests: the debug build, [`agent_bin`];
//! benches: the release build), the CLI ([`cli`]), and small HTTP/metrics helpers.
//! Everything talks to loopback only (the caller's own, or that of a network
//! namespace the caller created: see [`AgentCommand::netns`] and [`http_get_in`]).
//!
//! Whatever the caller passes, an agent started here never forwards DNS to the
//! machine's resolvers (`RUNE_DNS_RESOLV_CONF=/dev/null`).

use std::{
    ffi::OsString,
    fs::File,
    io::{BufRead as _, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::netns::{self, NetNs};

/// The agent binary built by `cargo build` (which `cargo xtask test` runs first):
/// `target/debug/rune-agent` (or under `$CARGO_TARGET_DIR`). Panics when missing.
pub fn agent_bin() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let bin = target.join("debug/rune-agent");
    assert!(
        bin.exists(),
        "{} is missing: build it first (`cargo build -p rune-agent`; `cargo xtask test` does)",
        bin.display()
    );
    bin
}

/// A free TCP port on 127.0.0.1 (free when asked; callers retry on the rare race).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// Makes `cmd`'s process die with the thread that spawns it (`PR_SET_PDEATHSIG`),
/// so that no bench child outlives an interrupted bench.
pub fn die_with_parent(cmd: &mut Command) {
    // SAFETY: between fork and exec only prctl, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// Where the agent's stderr (its log) goes.
enum LogTo {
    /// The caller's stderr.
    Inherit,
    /// Kept in memory for [`Agent::log`], each line also copied to the caller's
    /// stderr (`eprintln!`, so a test harness shows it with the test's output).
    Kept,
    /// A file; [`Agent::log`] reads it.
    File(PathBuf),
}

/// How to start `rune-agent run --state-dir DIR --metrics-addr ADDR ARGS...`
/// ([`Agent::command`]); [`AgentCommand::spawn`] starts it.
pub struct AgentCommand {
    bin: PathBuf,
    state_dir: PathBuf,
    netns: Option<PathBuf>,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    metrics: Option<(SocketAddr, bool)>,
    log: LogTo,
    graceful: bool,
    die_with_parent: bool,
}

impl AgentCommand {
    /// Runs the agent in the network namespace `ns`: the process enters it with
    /// `setns` before `exec` (not `ip netns exec`, which would hide /sys/fs/bpf and
    /// the cgroup2 mount), and the metrics listener is on that namespace's loopback.
    pub fn netns(mut self, ns: &NetNs) -> Self {
        self.netns = Some(ns.path());
        self
    }

    /// Arguments after the state dir and metrics address.
    pub fn args<S: Into<OsString>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// An environment variable (after the defaults: `RUST_LOG=info`).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// The metrics listener's address (`--metrics-addr`); by default a free port on
    /// 127.0.0.1 of the agent's namespace.
    pub fn metrics(mut self, addr: SocketAddr) -> Self {
        self.metrics = Some((addr, true));
        self
    }

    /// Where the metrics listener will be when the arguments, environment or a
    /// config file set it: no `--metrics-addr` is added.
    pub fn metrics_set_elsewhere(mut self, addr: SocketAddr) -> Self {
        self.metrics = Some((addr, false));
        self
    }

    /// Keeps the agent's log for [`Agent::log`] (and copies it to stderr).
    pub fn keep_log(mut self) -> Self {
        self.log = LogTo::Kept;
        self
    }

    /// Writes the agent's log to `path` (without colours) instead of stderr.
    pub fn log_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.log = LogTo::File(path.into());
        self
    }

    /// On drop, SIGTERM and up to 10 s for a clean exit (then SIGKILL), instead of
    /// SIGKILL at once.
    pub fn stop_gracefully(mut self) -> Self {
        self.graceful = true;
        self
    }

    /// The agent dies with the thread that spawns it ([`die_with_parent`]).
    pub fn die_with_parent(mut self) -> Self {
        self.die_with_parent = true;
        self
    }

    /// Starts the agent.
    pub fn spawn(self) -> anyhow::Result<Agent> {
        let (metrics, add_flag) = match self.metrics {
            Some(m) => m,
            None => {
                let port = match &self.netns {
                    Some(ns) => netns::run_at(ns, free_port)?,
                    None => free_port(),
                };
                (SocketAddr::from(([127, 0, 0, 1], port)), true)
            }
        };
        let mut cmd = match &self.netns {
            Some(ns) => netns::command_at(ns, &self.bin)?,
            None => Command::new(&self.bin),
        };
        if self.die_with_parent {
            die_with_parent(&mut cmd);
        }
        cmd.arg("run").arg("--state-dir").arg(&self.state_dir);
        if add_flag {
            cmd.arg("--metrics-addr").arg(metrics.to_string());
        }
        cmd.args(&self.args)
            .env("RUST_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            // Network rule: an agent started here never forwards DNS to the
            // machine's resolvers. No upstreams unless the caller passes a loopback one.
            .env("RUNE_DNS_RESOLV_CONF", "/dev/null")
            .stdin(Stdio::null());
        match &self.log {
            LogTo::Inherit => {}
            LogTo::Kept => {
                cmd.stderr(Stdio::piped());
            }
            LogTo::File(path) => {
                let file =
                    File::create(path).with_context(|| format!("creating {}", path.display()))?;
                cmd.env("NO_COLOR", "1").stdout(Stdio::null()).stderr(file);
            }
        }
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        let log = match self.log {
            LogTo::Inherit => Log::None,
            LogTo::Kept => Log::Kept(keep_lines(child.stderr.take())),
            LogTo::File(path) => Log::File(path),
        };
        Ok(Agent {
            child: Some(child),
            bin: self.bin,
            state_dir: self.state_dir,
            metrics,
            netns: self.netns,
            started,
            log,
            graceful: self.graceful,
        })
    }
}

/// Reads `stderr` line by line on a thread (until EOF, when the agent and whatever
/// it started are gone), copying each line to ours and keeping it without colours.
fn keep_lines(stderr: Option<std::process::ChildStderr>) -> Arc<Mutex<String>> {
    let log = Arc::new(Mutex::new(String::new()));
    let kept = log.clone();
    std::thread::Builder::new()
        .name("agent-log".to_owned())
        .spawn(move || {
            let Some(stderr) = stderr else { return };
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                eprintln!("{line}");
                let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
                kept.push_str(&without_ansi_escapes(&line));
                kept.push('\n');
            }
        })
        .expect("spawn the agent log reader");
    log
}

/// The agent's log, where [`AgentCommand`] sent it.
enum Log {
    None,
    Kept(Arc<Mutex<String>>),
    File(PathBuf),
}

/// A running agent; killed (SIGKILL) on drop if still running, or stopped with
/// SIGTERM first ([`AgentCommand::stop_gracefully`]).
pub struct Agent {
    child: Option<Child>,
    bin: PathBuf,
    /// Its state dir.
    pub state_dir: PathBuf,
    /// Its metrics listener (in [`Agent::netns`] when that is set).
    pub metrics: SocketAddr,
    /// The network namespace file it runs in (`/run/netns/NAME`), if not the
    /// caller's own.
    pub netns: Option<PathBuf>,
    /// When it was spawned.
    pub started: Instant,
    log: Log,
    graceful: bool,
}

impl Agent {
    /// How to start `bin` on `state_dir` (see [`AgentCommand`]).
    pub fn command(bin: impl Into<PathBuf>, state_dir: &Path) -> AgentCommand {
        AgentCommand {
            bin: bin.into(),
            state_dir: state_dir.to_owned(),
            netns: None,
            args: Vec::new(),
            env: Vec::new(),
            metrics: None,
            log: LogTo::Inherit,
            graceful: false,
            die_with_parent: false,
        }
    }

    /// Starts the debug agent ([`agent_bin`]): `rune-agent run --state-dir DIR
    /// --metrics-addr ADDR ARGS...` (a free port on 127.0.0.1). Panics when it
    /// cannot start.
    pub fn start(state_dir: &Path, args: &[&str]) -> Agent {
        Self::command(agent_bin(), state_dir)
            .args(args)
            .spawn()
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// [`Agent::start`] with extra environment variables and without
    /// `--metrics-addr`: `metrics` is where the test set the listener (in `args`,
    /// `env` or a config file).
    pub fn start_with(
        state_dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        metrics: SocketAddr,
    ) -> Agent {
        Self::started_with(None, state_dir, args, env, metrics)
    }

    /// [`Agent::start`] inside the network namespace `ns` (see
    /// [`AgentCommand::netns`]).
    pub fn start_in(ns: &NetNs, state_dir: &Path, args: &[&str]) -> Agent {
        Self::command(agent_bin(), state_dir)
            .netns(ns)
            .args(args)
            .spawn()
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// [`Agent::start_in`], keeping the agent's log for [`Agent::log`].
    pub fn start_logged_in(ns: &NetNs, state_dir: &Path, args: &[&str]) -> Agent {
        Self::command(agent_bin(), state_dir)
            .netns(ns)
            .args(args)
            .keep_log()
            .spawn()
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// [`Agent::start_with`] inside the network namespace `ns`; `metrics` is an
    /// address in `ns`.
    pub fn start_with_in(
        ns: &NetNs,
        state_dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        metrics: SocketAddr,
    ) -> Agent {
        Self::started_with(Some(ns), state_dir, args, env, metrics)
    }

    /// [`Agent::start_with`] and [`Agent::start_with_in`].
    fn started_with(
        ns: Option<&NetNs>,
        state_dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        metrics: SocketAddr,
    ) -> Agent {
        let mut command = Self::command(agent_bin(), state_dir);
        if let Some(ns) = ns {
            command = command.netns(ns);
        }
        env.iter()
            .fold(command, |c, (k, v)| c.env(k, v))
            .args(args)
            .metrics_set_elsewhere(metrics)
            .spawn()
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// The agent's log so far, without its colours; panics for an agent whose log
    /// went to the caller's stderr.
    pub fn log(&self) -> String {
        match &self.log {
            Log::Kept(log) => log.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            Log::File(path) => std::fs::read_to_string(path).unwrap_or_default(),
            Log::None => panic!("the agent's log is kept only with keep_log or log_file"),
        }
    }

    /// Where the log goes, when in a file.
    pub fn log_path(&self) -> Option<&Path> {
        match &self.log {
            Log::File(path) => Some(path),
            _ => None,
        }
    }

    /// The process id (0 once it was killed or stopped).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Fails, with the log when kept, once the process has exited (a zombie counts:
    /// it is not reaped here).
    pub fn ensure_alive(&self) -> anyhow::Result<()> {
        if self.child.is_none() {
            bail!("the agent was stopped");
        }
        // /proc/PID/stat of a zombie says Z; of a reaped process, nothing.
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|s| s.split_whitespace().next());
        if matches!(state, None | Some("Z" | "X")) {
            let log = match self.log {
                Log::None => String::new(),
                _ => format!("; its log:\n{}", self.log()),
            };
            bail!("the agent exited{log}");
        }
        Ok(())
    }

    /// A `VmRSS:`-style field of `/proc/PID/status`, in KiB.
    pub fn status_kib(&self, field: &str) -> anyhow::Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .with_context(|| format!("no {field} in /proc/PID/status"))
    }

    /// `GET path` on the metrics listener, from the agent's network namespace.
    pub fn http_get(&self, path: &str) -> std::io::Result<(u16, String)> {
        match &self.netns {
            None => http_get(self.metrics, path),
            Some(ns) => netns::run_at(ns, || http_get(self.metrics, path))
                .unwrap_or_else(|e| Err(std::io::Error::other(format!("{e:#}")))),
        }
    }

    /// Waits until `/readyz` answers 200; fails when the agent exits first or
    /// `patience` runs out.
    pub fn try_wait_ready(&self, patience: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + patience;
        loop {
            self.ensure_alive()?;
            if matches!(self.http_get("/readyz"), Ok((200, _))) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("agent not ready after {patience:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// [`Agent::try_wait_ready`], panicking on failure.
    pub fn wait_ready(&mut self, patience: Duration) {
        if let Err(e) = self.try_wait_ready(patience) {
            panic!("{e:#}");
        }
    }

    /// Runs a CLI command against this agent's state dir, in the agent's network
    /// namespace (what `cleanup` removes from `lo` is per namespace), with this
    /// agent's binary.
    pub fn cli(&self, args: &[&str], stdin: Option<&str>) -> Output {
        run_cli(
            &self.bin,
            self.netns.as_deref(),
            &self.state_dir,
            args,
            stdin,
        )
    }

    /// `/metrics` as text.
    pub fn metrics_text(&self) -> String {
        let (code, body) = self.http_get("/metrics").expect("GET /metrics");
        assert_eq!(code, 200);
        body
    }

    /// Kills the agent with SIGKILL (no chance to clean up) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGTERM and waits (bounded) for a clean exit; returns its status code.
    /// Panics (after SIGKILL) when it does not stop within `patience`.
    pub fn terminate(&mut self, patience: Duration) -> Option<i32> {
        match self.stop(patience) {
            Ok(code) => code,
            Err(e) => panic!("{e:#}"),
        }
    }

    /// SIGTERM, then up to `patience` for the exit (SIGKILL after that, and an
    /// error); the exit code.
    fn stop(&mut self, patience: Duration) -> anyhow::Result<Option<i32>> {
        let Some(mut child) = self.child.take() else {
            return Ok(None);
        };
        // SAFETY: kill(2) on our own child's pid (not reaped yet, so not reused).
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + patience;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status.code());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("agent did not stop within {patience:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.graceful {
            let _ = self.stop(Duration::from_secs(10));
        }
        self.kill();
    }
}

/// How long one CLI command may take before it is killed (a hang fails the test
/// instead of stalling the suite).
pub const CLI_PATIENCE: Duration = Duration::from_secs(30);

/// Runs `rune-agent ARGS --state-dir DIR`, feeding `stdin` when given; killed after
/// [`CLI_PATIENCE`].
pub fn cli(state_dir: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    run_cli(&agent_bin(), None, state_dir, args, stdin)
}

/// [`cli`] in the network namespace `ns` (a test's own).
pub fn cli_in(ns: &NetNs, state_dir: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    run_cli(&agent_bin(), Some(&ns.path()), state_dir, args, stdin)
}

/// Runs `BIN ARGS --state-dir DIR` (in the network namespace at `netns`, when
/// given), feeding `stdin` when given; killed after [`CLI_PATIENCE`].
pub fn run_cli(
    bin: &Path,
    netns: Option<&Path>,
    state_dir: &Path,
    args: &[&str],
    stdin: Option<&str>,
) -> Output {
    let mut cmd = Command::new(bin);
    if let Some(path) = netns {
        netns::join_at(&mut cmd, path).expect("joining the test's network namespace");
    }
    let mut child = cmd
        .args(args)
        .arg("--state-dir")
        .arg(state_dir)
        // As for the agent: never the machine's resolvers.
        .env("RUNE_DNS_RESOLV_CONF", "/dev/null")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rune-agent");
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    let pid = child.id() as i32;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watchdog = {
        let done = done.clone();
        std::thread::spawn(move || {
            let deadline = Instant::now() + CLI_PATIENCE;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                if Instant::now() > deadline {
                    // SAFETY: kill(2) on our own child, which has not been reaped yet.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    return true;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            false
        })
    };
    let out = child.wait_with_output().unwrap();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(
        !watchdog.join().unwrap(),
        "rune-agent {args:?} did not finish within {CLI_PATIENCE:?}"
    );
    out
}

/// `line` without ANSI escape sequences (`ESC [ ... letter`: the log's colours).
pub fn without_ansi_escapes(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC, '[', parameters, then one final letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A minimal HTTP/1.0 GET (no client library needed): status code and body.
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let code = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((code, body))
}

/// [`http_get`] from inside the network namespace `ns` (e.g. an agent's /metrics on
/// that namespace's 127.0.0.1).
pub fn http_get_in(ns: &NetNs, addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    ns.run(|| http_get(addr, path))
        .unwrap_or_else(|e| Err(std::io::Error::other(format!("{e:#}"))))
}

/// The value of one sample in Prometheus text (`name{labels}` exactly as printed,
/// labels in the agent's order), if present.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

/// Polls `f` until it returns `Some`, for at most `patience`.
pub fn eventually<T>(patience: Duration, what: &str, f: impl FnMut() -> Option<T>) -> T {
    eventually_every(Duration::from_millis(50), patience, what, f)
}

/// [`eventually`] polling every `interval` (slower for checks that are costly,
/// such as a CLI run against a cluster).
pub fn eventually_every<T>(
    interval: Duration,
    patience: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + patience;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "not within {patience:?}: {what}");
        std::thread::sleep(interval);
    }
}
