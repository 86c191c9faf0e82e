//! The Maglev array mapped into the agent's memory, a window of pages at a time, so
//! that tables are read and written without a syscall per slot.

use crate::dataplane::ebpf::error::MapsError;
use agent_common::lb;
use aya::maps::MapData;
use std::os::fd::{AsFd as _, AsRawFd as _};

/// The Maglev array (`BPF_F_MMAPABLE`), reached through windows mapped into the
/// agent's memory: a table is read and written with plain loads and stores instead
/// of one syscall per slot. Only the pages of the tables in use are mapped, and only
/// until [`LbMaps::release`](super::LbMaps::release): the kernel maps a BPF array's every page at `mmap`
/// time, so keeping the whole array mapped would add its size to the agent's
/// resident memory for nothing.
pub(super) struct MaglevArray {
    map: MapData,
    /// Slots in the whole array.
    pub(super) len: usize,
    page: usize,
    /// Mapped windows. Only `&mut self` methods unmap them, so a slice handed out by
    /// `&self` stays valid for as long as it is borrowed.
    windows: std::cell::RefCell<Vec<Window>>,
}

/// Pages per window into the Maglev array (256 KiB with 4 KiB pages).
const WINDOW_PAGES: usize = 64;

/// Windows kept before a write unmaps them all (a sync's reads may map more; they
/// all go at [`LbMaps::release`](super::LbMaps::release)).
const MAX_WINDOWS: usize = 8;

/// One mapping of whole pages of the array.
struct Window {
    ptr: *mut u32,
    /// First slot mapped.
    first: usize,
    /// Slots mapped.
    slots: usize,
}

// SAFETY: the mappings are owned by this value; `&self` only ever adds mappings and
// hands out slices into them, `&mut self` is needed to write or unmap. The RefCell is
// never borrowed across calls.
unsafe impl Send for MaglevArray {}

impl Drop for MaglevArray {
    fn drop(&mut self) {
        self.unmap_all();
    }
}

impl MaglevArray {
    pub(super) fn new(map: MapData) -> Result<Self, MapsError> {
        let info = map
            .info()
            .map_err(|e| MapsError::new(lb::MAGLEV, "info", e))?;
        // Two u32 slots per 8-byte element, no padding: the mapping is a plain u32
        // array of `2 × max_entries` slots.
        if info.value_size() != 4 * lb::MAGLEV_SLOTS_PER_ENTRY || info.map_flags() & 1024 == 0 {
            return Err(MapsError::new(
                lb::MAGLEV,
                "mmap",
                "not an mmapable array of u32 pairs (a pinned map from an incompatible build? \
                 run `rune-agent cleanup`)",
            ));
        }
        let len = info.max_entries() as usize * lb::MAGLEV_SLOTS_PER_ENTRY as usize;
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .ok()
            .filter(|p| *p >= 4 && p.is_power_of_two())
            .unwrap_or(4096);
        Ok(Self {
            map,
            len,
            page,
            windows: std::cell::RefCell::new(Vec::new()),
        })
    }

    /// The slots `start..start + size`, mapping the pages that hold them unless a
    /// window already covers them.
    fn window(&self, start: usize, size: usize, op: &'static str) -> Result<*mut u32, MapsError> {
        let end = start
            .checked_add(size)
            .filter(|end| *end <= self.len)
            .ok_or_else(|| MapsError::new(lb::MAGLEV, op, format!("no slots {start}+{size}")))?;
        let mut windows = self.windows.borrow_mut();
        if let Some(w) = windows
            .iter()
            .find(|w| w.first <= start && end <= w.first + w.slots)
        {
            // SAFETY: `start - w.first` is within the window (checked just above).
            return Ok(unsafe { w.ptr.add(start - w.first) });
        }
        // Whole chunks of pages: frontend ids are handed out in order, so the next
        // tables a sync touches are usually in the chunk already mapped.
        let slots_per_page = self.page / 4;
        let total_pages = self.len.div_ceil(slots_per_page);
        let first_page = start / slots_per_page / WINDOW_PAGES * WINDOW_PAGES;
        let last_page = ((end - 1) / slots_per_page / WINDOW_PAGES * WINDOW_PAGES + WINDOW_PAGES)
            .min(total_pages)
            - 1;
        let pages = last_page - first_page + 1;
        // SAFETY: mapping whole pages of a BPF_F_MMAPABLE array fd, shared, at a page
        // offset inside the array, is how such arrays are meant to be used; the result
        // is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * self.page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.map.fd().as_fd().as_raw_fd(),
                libc::off_t::try_from(first_page * self.page).unwrap_or(libc::off_t::MAX),
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(MapsError::new(
                lb::MAGLEV,
                "mmap",
                std::io::Error::last_os_error(),
            ));
        }
        let window = Window {
            ptr: ptr.cast(),
            first: first_page * slots_per_page,
            slots: (pages * slots_per_page).min(self.len - first_page * slots_per_page),
        };
        // SAFETY: `start` lies in the window just mapped.
        let at = unsafe { window.ptr.add(start - window.first) };
        windows.push(window);
        Ok(at)
    }

    pub(super) fn table(&self, start: usize, size: usize) -> Result<&[u32], MapsError> {
        let ptr = self.window(start, size, "read")?;
        // SAFETY: `size` slots from `ptr` are mapped, and stay mapped while `&self` is
        // borrowed (only `&mut self` unmaps).
        Ok(unsafe { std::slice::from_raw_parts(ptr, size) })
    }

    pub(super) fn table_mut(&mut self, start: usize, size: usize) -> Result<&mut [u32], MapsError> {
        if self.windows.get_mut().len() > MAX_WINDOWS {
            self.unmap_all();
        }
        let ptr = self.window(start, size, "write")?;
        // SAFETY: as in `table`; `&mut self` makes this the only reference. The kernel
        // reads it concurrently, which is the point: every slot is a plain u32
        // written whole.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, size) })
    }

    pub(super) fn unmap_all(&mut self) {
        for w in self.windows.get_mut().drain(..) {
            let bytes = (w.slots * 4).div_ceil(self.page) * self.page;
            // SAFETY: `ptr` and the page-rounded length are what mmap mapped; no
            // slice into it outlives `&mut self`.
            unsafe { libc::munmap(w.ptr.cast(), bytes) };
        }
    }
}
