//! Cgroup v2 children for privileged tests: [`TestCgroup`] creates a uniquely named
//! cgroup, hands out [`Command`]s whose processes join it before they exec (so that
//! programs attached to the cgroup see every socket they open), and removes it on
//! drop, also when a test panics.
//!
//! The cgroup v2 hierarchy is at `/sys/fs/cgroup/unified` on these machines (hybrid
//! layout; see docs/testing.md), with `/sys/fs/cgroup` as the fallback for pure v2
//! systems.

use std::{
    ffi::OsStr,
    fs::File,
    os::{
        fd::{AsFd as _, BorrowedFd},
        unix::process::CommandExt as _,
    },
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

/// Where cgroup v2 is mounted: the hybrid layout's `unified` first.
const ROOTS: [&str; 2] = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"];

/// A cgroup v2 child created for one test; removed on drop.
#[derive(Debug)]
pub struct TestCgroup {
    path: PathBuf,
    dir: File,
}

impl TestCgroup {
    /// Creates `rune-test-TAG-PID-N` under the cgroup v2 root. Needs root.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let root = ROOTS
            .iter()
            .map(Path::new)
            .find(|p| p.join("cgroup.procs").is_file() && p.join("cgroup.controllers").is_file())
            .context("no cgroup v2 hierarchy at /sys/fs/cgroup/unified or /sys/fs/cgroup")?;
        let name = format!(
            "rune-test-{tag}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let path = root.join(name);
        std::fs::create_dir(&path)
            .with_context(|| format!("creating cgroup {}", path.display()))?;
        let dir = match File::open(&path) {
            Ok(dir) => dir,
            Err(e) => {
                let _ = std::fs::remove_dir(&path);
                return Err(e).with_context(|| format!("opening cgroup {}", path.display()));
            }
        };
        Ok(Self { path, dir })
    }

    /// The cgroup's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The cgroup directory, open: what BPF attachments (e.g. aya's
    /// `CgroupSockAddr::attach`) take.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.dir.as_fd()
    }

    /// A command for `program` whose process moves itself into this cgroup (writes
    /// "0" to `cgroup.procs`) between fork and exec; spawning fails if it cannot.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let procs = std::ffi::CString::new(
            self.path
                .join("cgroup.procs")
                .into_os_string()
                .into_encoded_bytes(),
        )
        .expect("cgroup path without NUL bytes");
        let mut cmd = Command::new(program);
        // SAFETY: the closure only calls async-signal-safe functions (open, write,
        // close) on memory prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                if written != 1 {
                    return Err(err);
                }
                Ok(())
            });
        }
        cmd
    }

    /// The pids currently in the cgroup.
    pub fn pids(&self) -> anyhow::Result<Vec<u32>> {
        let text = std::fs::read_to_string(self.path.join("cgroup.procs"))?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    fn remove(&self) -> anyhow::Result<()> {
        // A process that has just exited may linger in the cgroup for a moment (until
        // it is reaped): retry briefly.
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match std::fs::remove_dir(&self.path) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) if Instant::now() >= deadline => {
                    bail!("removing cgroup {}: {e}", self.path.display())
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            eprintln!("warning: {e:#}");
        }
    }
}
