//! What one client connection is doing: its requests in flight, how many it has
//! had, and when it last did something (for the idle timeout and the connection
//! cap); and when its bytes last moved ([`ClientStream`](super::client_stream)),
//! so a connection asked to close does not wait forever for a client that
//! stopped reading.

use std::{
    sync::atomic::{AtomicU64, AtomicUsize, Ordering},
    time::{Duration, Instant},
};

/// A connection's requests in flight and when it last did something.
pub struct Activity {
    start: Instant,
    in_flight: AtomicUsize,
    /// Requests answered.
    served: AtomicU64,
    /// Milliseconds after `start` of the last request's start or end.
    last_ms: AtomicU64,
    /// Milliseconds after `start` when bytes last moved either way.
    io_ms: AtomicU64,
}

impl Activity {
    /// A connection that has done nothing yet.
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            in_flight: AtomicUsize::new(0),
            served: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
            io_ms: AtomicU64::new(0),
        }
    }

    /// Bytes moved either way.
    pub fn moved(&self) {
        self.io_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn touch(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// How long no byte has moved either way.
    pub fn io_idle_for(&self) -> Duration {
        let last = Duration::from_millis(self.io_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }

    /// A request starts.
    pub fn begin(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.touch();
    }

    /// A request ends.
    pub fn end(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.served.fetch_add(1, Ordering::Relaxed);
        self.touch();
    }

    /// Whether the connection waits for its next request (keep-alive) after
    /// answering at least one: the kind a full proxy closes to make room.
    pub fn idle_after_requests(&self) -> bool {
        self.in_flight.load(Ordering::Relaxed) == 0 && self.served.load(Ordering::Relaxed) > 0
    }

    /// Whether a request is in flight.
    pub fn busy(&self) -> bool {
        self.in_flight.load(Ordering::Relaxed) > 0
    }

    /// How long no request has been in flight (zero while one is).
    pub fn idle_for(&self) -> Duration {
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return Duration::ZERO;
        }
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}
