//! bpffs: whether it is mounted at `/sys/fs/bpf`, mounting it, and [`PinDir`], a
//! private pin directory per test or bench run, removed with everything pinned in it
//! on drop, so that nothing pins into `/sys/fs/bpf` itself or shares state.

use std::{
    ffi::CString,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{Context as _, bail};

/// Where bpffs is mounted.
pub const BPFFS: &str = "/sys/fs/bpf";

/// bpffs's `f_type` (statfs).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Whether `path` is on a bpf filesystem.
pub fn is_bpffs(path: &Path) -> bool {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs fills the zeroed struct; the path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c.as_ptr(), &raw mut st) };
    rc == 0 && st.f_type as i64 == BPF_FS_MAGIC
}

/// Mounts bpffs at [`BPFFS`] unless it is there already; returns whether it mounted.
/// Needs root.
pub fn ensure_mounted() -> anyhow::Result<bool> {
    if is_bpffs(Path::new(BPFFS)) {
        return Ok(false);
    }
    let status = Command::new("mount")
        .args(["-t", "bpf", "bpf", BPFFS])
        .status()
        .context("running mount")?;
    if !status.success() {
        bail!("mounting bpffs at {BPFFS} failed ({status}): are you root?");
    }
    Ok(true)
}

/// `/sys/fs/bpf/rune-test-<tag>-<pid>-<n>`, removed on drop with everything in it
/// (subdirectories such as the agent's `links/` first, which detaches their
/// programs; then the map pins).
#[derive(Debug)]
pub struct PinDir {
    path: PathBuf,
}

impl PinDir {
    /// A fresh, unique path, not created: the agent or loader that pins into it
    /// creates it.
    pub fn new(tag: &str) -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        Self {
            path: PathBuf::from(format!(
                "{BPFFS}/rune-test-{tag}-{}-{n}",
                std::process::id()
            )),
        }
    }

    /// [`PinDir::new`], created (bpffs mounted first when it is not).
    pub fn create(tag: &str) -> anyhow::Result<Self> {
        ensure_mounted()?;
        let dir = Self::new(tag);
        std::fs::create_dir(&dir.path)
            .with_context(|| format!("creating {}", dir.path.display()))?;
        Ok(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every pin in the directory, subdirectories included (paths), sorted.
    pub fn pins(&self) -> Vec<PathBuf> {
        fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let path = e.path();
                if path.is_dir() {
                    walk(&path, out);
                } else {
                    out.push(path);
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.path, &mut out);
        out.sort();
        out
    }

    fn remove(&self) -> std::io::Result<()> {
        if !self.path.exists() {
            return Ok(());
        }
        // Link pins (in subdirectories) before map pins: unpinning a link detaches
        // its program while the maps it uses are still there.
        for e in std::fs::read_dir(&self.path)?.flatten() {
            if e.path().is_dir() {
                std::fs::remove_dir_all(e.path())?;
            }
        }
        std::fs::remove_dir_all(&self.path)
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Err(e) = self.remove() {
            eprintln!("warning: removing {}: {e}", self.path.display());
        }
    }
}
