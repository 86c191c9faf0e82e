//! The pin directory under bpffs: making it ready for a load (bpffs mounted, maps
//! of earlier layouts set aside, see `upgrade`), telling what was pinned before a
//! load, and removing every pin.

mod upgrade;

use super::error::EbpfError;
use agent_common::lb;
use std::{
    fs,
    path::{Path, PathBuf},
};

pub(super) use upgrade::Legacy;

/// bpffs's `f_type`.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Makes sure `pin_dir` can hold pins: mounts bpffs on `/sys/fs/bpf` when nothing is
/// mounted there, then creates the directory.
pub fn ensure_pin_dir(pin_dir: &Path) -> Result<(), EbpfError> {
    let pin_error = |reason: String| EbpfError::pin(pin_dir, reason);
    let bpffs = Path::new("/sys/fs/bpf");
    if pin_dir.starts_with(bpffs) && fs_type(bpffs) != Some(BPF_FS_MAGIC) {
        let mounted = std::ffi::CString::new("bpf").ok().and_then(|source| {
            let target = std::ffi::CString::new("/sys/fs/bpf").ok()?;
            // SAFETY: valid NUL-terminated strings; mount does not keep the pointers.
            let rc = unsafe {
                libc::mount(
                    source.as_ptr(),
                    target.as_ptr(),
                    source.as_ptr(),
                    0,
                    std::ptr::null(),
                )
            };
            (rc == 0).then_some(())
        });
        if mounted.is_none() {
            return Err(pin_error(format!(
                "mounting bpffs on /sys/fs/bpf failed: {}",
                std::io::Error::last_os_error()
            )));
        }
        tracing::info!("mounted bpffs on /sys/fs/bpf");
    }
    fs::create_dir_all(pin_dir).map_err(|e| pin_error(e.to_string()))?;
    if fs_type(pin_dir) != Some(BPF_FS_MAGIC) {
        return Err(pin_error("not on a bpf filesystem (bpffs)".into()));
    }
    Ok(())
}

/// The `f_type` of the filesystem holding `path` (bpffs, cgroup2, …), if `statfs`
/// answers.
pub(crate) fn fs_type(path: &Path) -> Option<i64> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs fills the zeroed struct; the path is NUL-terminated.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c.as_ptr(), &raw mut buf) };
    (rc == 0).then_some(buf.f_type)
}

/// Which of the maps a sync adopts from were pinned under `pin_dir` before a load:
/// the others are created empty by it, and reading them back would find nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedBefore {
    /// The IPv4 or IPv6 services map.
    pub frontends: bool,
    /// The backends array.
    pub backends: bool,
}

impl PinnedBefore {
    /// Looks under `pin_dir` (call it before [`super::load_lb`], which pins what it creates).
    #[must_use]
    pub fn probe(pin_dir: &Path) -> Self {
        let pinned = |name: &str| pin_dir.join(name).exists();
        Self {
            frontends: pinned(lb::SERVICES_V4) || pinned(lb::SERVICES_V6),
            backends: pinned(lb::BACKENDS),
        }
    }
}

/// Removes the VIP prefilter's pin, so this load creates the map afresh: all zeros,
/// which filters nothing (`agent_common::filter`), until the first sync writes
/// every word. A pinned filter may not match the pinned frontends (an older agent
/// added services without it, or this one died between a frontend write and the
/// filter's), and the new programs run before the first sync, which waits for the
/// store: a stale set bit there would stop translating an established flow. The
/// programs still attached keep the old map until they are replaced.
fn unpin_vip_filter(pin_dir: &Path) -> Result<(), EbpfError> {
    let path = pin_dir.join(lb::VIP_FILTER);
    match fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(EbpfError::pin(&path, e)),
        _ => Ok(()),
    }
}

/// Readies `pin_dir` for a load of this agent's maps: bpffs mounted and the
/// directory made, a pinned map of a layout this agent neither has nor carries over
/// refused ([`EbpfError::PinnedLayout`]), the VIP prefilter unpinned, and maps of an
/// earlier layout unpinned but held open ([`Legacy`]), for the caller to carry over
/// after the load or pin back should it fail.
pub(super) fn prepare_load(pin_dir: &Path) -> Result<Legacy, EbpfError> {
    ensure_pin_dir(pin_dir)?;
    upgrade::check_pinned_layouts(pin_dir)?;
    upgrade::note_per_cpu_lru_conntrack(pin_dir);
    unpin_vip_filter(pin_dir)?;
    Legacy::unpin(pin_dir)
}

/// The directory holding the link pins.
pub(super) fn links_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("links")
}

/// Removes every pin under `pin_dir` (links first, which detaches the programs, then
/// maps) and the directory itself. Returns how many pins were removed; a missing
/// directory is not an error.
pub fn remove_pins(pin_dir: &Path) -> Result<usize, EbpfError> {
    if !pin_dir.exists() {
        return Ok(0);
    }
    let mut removed = 0;
    let links = links_dir(pin_dir);
    if let Ok(entries) = fs::read_dir(&links) {
        for entry in entries.flatten() {
            fs::remove_file(entry.path()).map_err(|e| EbpfError::pin(&entry.path(), e))?;
            removed += 1;
        }
        fs::remove_dir(&links).map_err(|e| EbpfError::pin(&links, e))?;
    }
    for entry in fs::read_dir(pin_dir)
        .map_err(|e| EbpfError::pin(pin_dir, e))?
        .flatten()
    {
        fs::remove_file(entry.path()).map_err(|e| EbpfError::pin(&entry.path(), e))?;
        removed += 1;
    }
    fs::remove_dir(pin_dir).map_err(|e| EbpfError::pin(pin_dir, e))?;
    Ok(removed)
}
