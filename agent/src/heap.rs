//! The process heap: glibc malloc tuned for a long-running agent whose memory is
//! mostly a few large structures built at start (the cache, the data plane's state,
//! the DNS zone) and small changes after.
//!
//! glibc's default of up to 8 arenas per core keeps the memory freed after the start
//! scattered over arenas it never returns; one arena and a trim after the initial
//! sync give most of it back (docs/performance.md, the sync section).

/// Limits glibc to one malloc arena unless `MALLOC_ARENA_MAX` says otherwise. Call
/// before any thread starts. Per-thread caches (tcache) still serve small
/// allocations without the arena lock, and the agent's hot paths allocate little.
pub fn limit_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets a glibc tunable; M_ARENA_MAX takes a count.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

/// Hands freed heap memory back to the OS, after the big changes (the data plane's
/// first full sync, a DNS zone change of over 1,000 services): glibc would otherwise
/// keep what their temporaries freed.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own arenas; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The heap as glibc sees it: bytes in live allocations (small chunks in the
/// arena plus large ones mapped on their own) and bytes free inside the arena
/// (held, not returned to the OS), for the logs.
#[must_use]
pub fn usage() -> Option<(usize, usize)> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads glibc's own counters; it has no preconditions.
        let info = unsafe { libc::mallinfo2() };
        Some((info.uordblks + info.hblkhd, info.fordblks))
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    None
}
