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
        if let Err(e) = rune_agent::dataplane::ebpf::pins::remove_pins(&self.path) {
            eprintln!("removing {}: {e}", self.path.display());
        }
    }
}

/// Sets Maglev slot `slot` to backend `id` in `RUNE_MAGLEV` (two slots per entry,
/// see `agent_common::lb::MAGLEV`).
pub fn set_maglev_slot<T: std::borrow::BorrowMut<aya::maps::MapData>>(
    map: &mut aya::maps::Array<T, [u32; 2]>,
    slot: u32,
    id: u32,
) {
    let mut pair = map.get(&(slot / 2), 0).expect("reading a Maglev entry");
    pair[(slot % 2) as usize] = id;
    map.set(slot / 2, pair, 0).expect("writing a Maglev entry");
}

/// Reads Maglev slot `slot` of `RUNE_MAGLEV`.
pub fn maglev_slot<T: std::borrow::Borrow<aya::maps::MapData>>(
    map: &aya::maps::Array<T, [u32; 2]>,
    slot: u32,
) -> u32 {
    map.get(&(slot / 2), 0).expect("reading a Maglev entry")[(slot % 2) as usize]
}
