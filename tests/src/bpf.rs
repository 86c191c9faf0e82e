//! A private bpffs pin directory per test, removed (with everything pinned in it)
//! on drop, so tests never pin into `/sys/fs/bpf` itself or share state.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// `/sys/fs/bpf/rune-test-<tag>-<pid>-<n>`; created by whoever loads into it,
/// removed on drop (links first, which detaches their programs).
#[derive(Debug)]
pub struct PinDir {
    path: PathBuf,
}

impl PinDir {
    /// A fresh, unique path (not created yet).
    pub fn new(tag: &str) -> Self {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        Self {
            path: PathBuf::from(format!(
                "/sys/fs/bpf/rune-test-{tag}-{}-{n}",
                std::process::id()
            )),
        }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Err(e) = rune_agent::dataplane::ebpf::attach::remove_pins(&self.path) {
            eprintln!("removing {}: {e}", self.path.display());
        }
    }
}
