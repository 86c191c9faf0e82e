//! Running the real `rune-agent` binary from tests: a process guard that kills it on
//! drop, the CLI, and small HTTP/metrics helpers. Everything talks to loopback only
//! (the test process's own, or that of a network namespace the test created: see
//! [`Agent::start_in`] and [`http_get_in`]).

use std::{
    io::{BufRead as _, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::netns::{self, NetNs};

/// The agent binary built by `cargo build` (which `cargo xtask test` runs first).
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

/// A free TCP port on 127.0.0.1 (free when asked; tests retry on the rare race).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// A running agent; killed (SIGKILL) on drop if still running.
pub struct Agent {
    child: Option<Child>,
    /// Its state dir.
    pub state_dir: PathBuf,
    /// Its metrics listener (in [`Agent::netns`] when that is set).
    pub metrics: SocketAddr,
    /// The network namespace file it runs in (`/run/netns/NAME`), if not the test
    /// process's own.
    pub netns: Option<PathBuf>,
    /// What it wrote to stderr so far, when started by [`Agent::start_logged_in`].
    log: Option<Arc<Mutex<String>>>,
}

impl Agent {
    /// Starts `rune-agent run --state-dir DIR --metrics-addr ADDR ARGS...`.
    pub fn start(state_dir: &Path, args: &[&str]) -> Agent {
        let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let mut all = vec!["--metrics-addr".to_owned(), metrics.to_string()];
        all.extend(args.iter().map(|a| a.to_string()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        Self::start_with(state_dir, &all, &[], metrics)
    }

    /// Starts `rune-agent run --state-dir DIR ARGS...` with extra environment
    /// variables; `metrics` is where the test expects the metrics listener.
    pub fn start_with(
        state_dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        metrics: SocketAddr,
    ) -> Agent {
        Self::spawn(
            Command::new(agent_bin()),
            None,
            state_dir,
            args,
            env,
            metrics,
        )
    }

    /// [`Agent::start`] inside the network namespace `ns`: the metrics listener is on
    /// a free port of that namespace's 127.0.0.1, and [`Agent::wait_ready`] and
    /// [`Agent::metrics_text`] reach it there.
    pub fn start_in(ns: &NetNs, state_dir: &Path, args: &[&str]) -> Agent {
        Self::start_in_piped(ns, state_dir, args, false)
    }

    /// [`Agent::start_in`], keeping what the agent writes to stderr (its log) for
    /// [`Agent::log`]. Every line is also copied to the test's stderr as it comes
    /// (`eprintln!`, so the test harness shows it with the test's own output).
    pub fn start_logged_in(ns: &NetNs, state_dir: &Path, args: &[&str]) -> Agent {
        let mut agent = Self::start_in_piped(ns, state_dir, args, true);
        let stderr = agent.child.as_mut().and_then(|c| c.stderr.take());
        let log = Arc::new(Mutex::new(String::new()));
        let kept = log.clone();
        // Ends at EOF, when the agent (and whatever it started) is gone.
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
        agent.log = Some(log);
        agent
    }

    /// The agent's log so far, without its colours (see [`Agent::start_logged_in`]);
    /// panics for an agent started otherwise.
    pub fn log(&self) -> String {
        let log = self
            .log
            .as_ref()
            .expect("the agent's log is kept only with Agent::start_logged_in");
        log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// [`Agent::start_in`], with stderr piped when `pipe_stderr`.
    fn start_in_piped(ns: &NetNs, state_dir: &Path, args: &[&str], pipe_stderr: bool) -> Agent {
        let port = ns.run(free_port).expect("a free port in the namespace");
        let metrics: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut all = vec!["--metrics-addr".to_owned(), metrics.to_string()];
        all.extend(args.iter().map(|a| a.to_string()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let mut cmd = ns.command(agent_bin()).unwrap_or_else(|e| panic!("{e:#}"));
        if pipe_stderr {
            cmd.stderr(Stdio::piped());
        }
        Self::spawn(cmd, Some(ns.path()), state_dir, &all, &[], metrics)
    }

    /// [`Agent::start_with`] inside the network namespace `ns`. The process enters it
    /// with `setns` before `exec` (not `ip netns exec`, which would hide /sys/fs/bpf
    /// and the cgroup2 mount); it is killed on drop like any other [`Agent`].
    /// `metrics` is an address in `ns`.
    pub fn start_with_in(
        ns: &NetNs,
        state_dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        metrics: SocketAddr,
    ) -> Agent {
        let cmd = ns.command(agent_bin()).unwrap_or_else(|e| panic!("{e:#}"));
        Self::spawn(cmd, Some(ns.path()), state_dir, args, env, metrics)
    }

    fn spawn(
        mut cmd: Command,
        netns: Option<PathBuf>,
        state_dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        metrics: SocketAddr,
    ) -> Agent {
        let child = cmd
            .arg("run")
            .arg("--state-dir")
            .arg(state_dir)
            .args(args)
            // Network rule: a test agent never forwards DNS to the machine's
            // resolvers. No upstreams unless a test passes its own loopback one.
            .env("RUNE_DNS_RESOLV_CONF", "/dev/null")
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn rune-agent");
        Agent {
            child: Some(child),
            state_dir: state_dir.to_owned(),
            metrics,
            netns,
            log: None,
        }
    }

    /// `GET path` on the metrics listener, from the agent's network namespace.
    pub fn http_get(&self, path: &str) -> std::io::Result<(u16, String)> {
        match &self.netns {
            None => http_get(self.metrics, path),
            Some(ns) => netns::run_at(ns, || http_get(self.metrics, path))
                .unwrap_or_else(|e| Err(std::io::Error::other(format!("{e:#}")))),
        }
    }

    /// Waits until `/readyz` answers 200.
    pub fn wait_ready(&mut self, patience: Duration) {
        let deadline = Instant::now() + patience;
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!("agent exited before it was ready: {status}");
            }
            if matches!(self.http_get("/readyz"), Ok((200, _))) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "agent not ready after {patience:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs a CLI command against this agent's state dir, in the agent's network
    /// namespace (what `cleanup` removes from `lo` is per namespace).
    pub fn cli(&self, args: &[&str], stdin: Option<&str>) -> Output {
        cli_at(self.netns.as_deref(), &self.state_dir, args, stdin)
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
    pub fn terminate(&mut self, patience: Duration) -> Option<i32> {
        let mut child = self.child.take()?;
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + patience;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status.code();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("agent did not stop within {patience:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// How long one CLI command may take before it is killed (a hang fails the test
/// instead of stalling the suite).
pub const CLI_PATIENCE: Duration = Duration::from_secs(30);

/// Runs `rune-agent ARGS --state-dir DIR`, feeding `stdin` when given; killed after
/// [`CLI_PATIENCE`].
pub fn cli(state_dir: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    cli_at(None, state_dir, args, stdin)
}

/// [`cli`] in the network namespace `ns` (a test's own).
pub fn cli_in(ns: &NetNs, state_dir: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    cli_at(Some(&ns.path()), state_dir, args, stdin)
}

fn cli_at(netns: Option<&Path>, state_dir: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    let mut cmd = Command::new(agent_bin());
    if let Some(path) = netns {
        netns::join_at(&mut cmd, path).expect("joining the test's network namespace");
    }
    let mut child = cmd
        .args(args)
        .arg("--state-dir")
        .arg(state_dir)
        // As in `Agent::start_with`: never the machine's resolvers.
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
fn without_ansi_escapes(line: &str) -> String {
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
pub fn eventually<T>(patience: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + patience;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "not within {patience:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
