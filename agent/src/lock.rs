//! Mutex locking that survives a panicking holder: the one way the agent takes a lock.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, taking the data even when a panicking thread poisoned the lock.
///
/// Every guarded structure in the agent is updated by single operations (an insert,
/// a remove, a swap), so a panic cannot leave it half-changed: the data is still
/// consistent, and refusing it would turn one panic into a dead subsystem.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
