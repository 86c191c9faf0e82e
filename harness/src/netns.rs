//! Network namespaces for privileged tests and benches.
//!
//! [`NetNs`] creates a uniquely named namespace (`ip netns add`), runs `ip`
//! commands in it, runs closures inside it on a dedicated thread (via `setns`, so
//! the test process's own namespace never changes), starts processes inside it
//! ([`NetNs::command`], via `setns` before `exec`, never `ip netns exec`), and deletes
//! it on drop, also when a test panics. [`veth_pair`] wires two namespaces together.
//!
//! Rules for tests and benches using this: give interfaces addresses from 198.18.0.0/15 (the
//! benchmarking range) and only inside namespaces the test created; never touch the
//! root namespace's interfaces, routes or nftables.

use std::{
    ffi::OsStr,
    fs::File,
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    thread,
};

use anyhow::{Context as _, anyhow, bail};

/// Distinguishes the namespaces one test process creates.
static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A network namespace owned by the test; deleted on drop.
#[derive(Debug)]
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// Creates `rune-<tag>-<pid>-<n>`, without IPv6 duplicate address detection, and
    /// brings its loopback up.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        require_root()?;
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("rune-{tag}-{}-{n}", std::process::id());
        run_ip(&["netns", "add", &name])?;
        // From here on, Drop deletes the namespace even if the next step fails.
        let ns = Self { name };
        // No duplicate address detection: without it an interface's link-local
        // address stays tentative for a second after the link comes up, and a
        // neighbour solicitation waits for it (a reply to a new neighbour stalls).
        for conf in ["all", "default"] {
            ns.sysctl(&format!("net/ipv6/conf/{conf}/accept_dad"), "0")?;
        }
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace's name, as `ip netns` knows it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's file (`/run/netns/NAME`), for `setns` or `nsenter --net=`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Runs `ip -n NAME ARGS` and returns its stdout; fails with stderr on error.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        run_ip(&all)
    }

    /// Runs `f` inside the namespace, on a fresh thread that enters it with `setns`.
    ///
    /// Sockets created in `f` stay in this namespace after it returns, so a test can
    /// create them here and use them from any thread. Interface names resolve here.
    /// A panic in `f` is propagated.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
        run_at(&self.path(), f)
    }

    /// A [`Command`] for `program` whose process starts inside this namespace.
    ///
    /// The child enters the namespace with `setns` just before `exec` (the same
    /// thing `nsenter --net=/run/netns/NAME` does). Unlike `ip netns exec`, it keeps
    /// the caller's mount namespace, so /sys/fs/bpf (pins) and the cgroup2 mount stay
    /// visible.
    pub fn command(&self, program: impl AsRef<OsStr>) -> anyhow::Result<Command> {
        command_at(&self.path(), program)
    }

    /// Sets the sysctl `key` (`net/ipv4/ip_forward` or `net.ipv4.ip_forward`) of this
    /// namespace, never the host's: /proc/sys/net shows the network namespace of the
    /// thread that opens the file, so a thread inside the namespace writes it. Reads
    /// the value back.
    pub fn sysctl(&self, key: &str, value: &str) -> anyhow::Result<()> {
        let path = format!("/proc/sys/{}", key.replace('.', "/"));
        self.run(|| -> anyhow::Result<()> {
            std::fs::write(&path, value).with_context(|| format!("writing {value} to {path}"))?;
            let now = std::fs::read_to_string(&path)?;
            let normal = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
            if normal(&now) != normal(value) {
                bail!("{path} reads {now:?} after writing {value:?}");
            }
            Ok(())
        })?
    }

    /// Turns TX checksum offload of `ifname` (in this namespace) on or off (`ethtool
    /// -K IF tx on|off`, run inside it). Off makes a veth hand its peer full
    /// checksums, which XDP programs that rewrite packets need.
    pub fn set_tx_checksum(&self, ifname: &str, on: bool) -> anyhow::Result<()> {
        let state = if on { "on" } else { "off" };
        let output = match self
            .command("ethtool")?
            .args(["-K", ifname, "tx", state])
            .output()
        {
            Ok(output) => output,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
                "ethtool is missing (it sets TX checksum offload on veths for XDP): \
                 run `cargo xtask setup` (or `apt-get install ethtool`)"
            ),
            Err(e) => return Err(e).context("running ethtool"),
        };
        if !output.status.success() {
            bail!(
                "`ethtool -K {ifname} tx {state}` in {} failed ({}): {}",
                self.name,
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(())
    }
}

/// [`NetNs::run`] for a namespace known by its file (`/run/netns/NAME`), e.g. one a
/// helper remembered after the [`NetNs`] itself went elsewhere.
pub fn run_at<T: Send>(path: &Path, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    thread::scope(|scope| {
        let thread = thread::Builder::new()
            .name(format!("netns-{name}"))
            .spawn_scoped(scope, move || -> anyhow::Result<T> {
                setns(&file, path)?;
                Ok(f())
            })
            .context("spawning the namespace thread")?;
        match thread.join() {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// Moves the calling thread into the namespace at `path` for good: for threads that
/// live in one namespace (a bench's client runtime, a backend server). Prefer
/// [`NetNs::run`], which leaves the caller where it is.
pub fn enter(path: &Path) -> anyhow::Result<()> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    setns(&file, path)
}

/// `setns(2)` of the calling thread into the network namespace open as `file`.
fn setns(file: &File, path: &Path) -> anyhow::Result<()> {
    // SAFETY: `file` is an open namespace file; setns only changes this thread's
    // network namespace.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("setns into {}", path.display()));
    }
    Ok(())
}

/// [`NetNs::command`] for a namespace known by its file (`/run/netns/NAME`).
pub fn command_at(path: &Path, program: impl AsRef<OsStr>) -> anyhow::Result<Command> {
    let mut cmd = Command::new(program);
    join_at(&mut cmd, path)?;
    Ok(cmd)
}

/// Makes `cmd`'s process enter the namespace at `path` (`setns` between fork and
/// exec), in addition to whatever else `cmd` is set up to do (e.g. join a cgroup).
pub fn join_at(cmd: &mut Command, path: &Path) -> anyhow::Result<()> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: the closure runs in the forked child before exec and only makes the
    // setns(2) system call (async-signal-safe) on a descriptor the closure owns, so it
    // stays open until the command is dropped.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Deleting the namespace also removes its interfaces (and veth peers).
        if let Err(e) = run_ip(&["netns", "del", &self.name]) {
            eprintln!("warning: deleting network namespace {}: {e:#}", self.name);
        }
    }
}

/// Creates a veth pair: `a_name` in `a`, `b_name` in `b`, both up, no addresses.
pub fn veth_pair(a: &NetNs, a_name: &str, b: &NetNs, b_name: &str) -> anyhow::Result<()> {
    a.ip(&[
        "link",
        "add",
        a_name,
        "type",
        "veth",
        "peer",
        "name",
        b_name,
        "netns",
        b.name(),
    ])?;
    a.ip(&["link", "set", a_name, "up"])?;
    b.ip(&["link", "set", b_name, "up"])?;
    Ok(())
}

/// Fails with a clear message unless the process runs as root (namespaces, BPF).
pub fn require_root() -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "this test needs root (network namespaces, BPF): run it as root, e.g. via `sudo -E cargo xtask test`"
        );
    }
    Ok(())
}

fn run_ip(args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("ip").args(args).output().map_err(|e| {
        anyhow!(
            "running `ip {}`: {e} (is iproute2 installed?)",
            args.join(" ")
        )
    })?;
    if !output.status.success() {
        bail!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
