//! The HTTP/1.1 fast path's connections to endpoints: raw TCP with a read buffer, pooled per
//! worker thread (a free list per endpoint under the worker's own uncontended
//! lock). A connection goes back once its response has been relayed whole and the
//! endpoint keeps it open; one idle for [`IDLE_TIMEOUT`], or found closed by the
//! endpoint, is dropped.

use super::IDLE_TIMEOUT;
use bytes::BytesMut;
use std::{
    collections::HashMap,
    io,
    net::SocketAddr,
    sync::{Mutex, PoisonError},
    time::{Duration, Instant},
};
use tokio::net::TcpStream;

/// A new connection's read buffer.
const READ_BUFFER: usize = 8 << 10;

/// One connection to an endpoint and what was read from it but not yet used.
pub struct Origin {
    pub stream: TcpStream,
    pub buf: BytesMut,
}

impl Origin {
    /// Whether the endpoint has closed the connection (or sent something unasked)
    /// while it was idle: a read that does not wait.
    pub fn closed(&self) -> bool {
        let mut probe = [0u8; 1];
        !matches!(self.stream.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

/// A worker's idle connections to endpoints, by endpoint.
pub struct Origins {
    idle: Mutex<HashMap<SocketAddr, Vec<(Origin, Instant)>>>,
    connect_timeout: Duration,
}

impl Origins {
    /// No connections yet; new ones get `connect_timeout`.
    pub fn new(connect_timeout: Duration) -> Origins {
        Origins {
            idle: Mutex::default(),
            connect_timeout,
        }
    }

    /// The most recently used idle connection to `addr` not idle too long nor
    /// closed by the endpoint meanwhile, nor holding bytes it was not asked for
    /// (a read that does not wait; tokio answers it from the readiness it knows
    /// without a system call when nothing came).
    pub fn take(&self, addr: SocketAddr) -> Option<Origin> {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let list = idle.get_mut(&addr)?;
        while let Some((origin, since)) = list.pop() {
            if now.duration_since(since) < IDLE_TIMEOUT && !origin.closed() {
                return Some(origin);
            }
        }
        None
    }

    /// A new connection to `addr` within the connect timeout.
    pub async fn connect(&self, addr: SocketAddr) -> io::Result<Origin> {
        let stream = tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
        let _ = stream.set_nodelay(true);
        Ok(Origin {
            stream,
            buf: BytesMut::with_capacity(READ_BUFFER),
        })
    }

    /// Takes back a connection whose response has been relayed whole.
    pub fn give_back(&self, addr: SocketAddr, origin: Origin) {
        let since = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.entry(addr).or_default().push((origin, since));
    }

    /// Drops the connections idle too long or closed by their endpoint, and
    /// endpoints left with none.
    pub fn sweep(&self) {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.retain(|_, list| {
            list.retain(|(o, since)| now.duration_since(*since) < IDLE_TIMEOUT && !o.closed());
            !list.is_empty()
        });
    }
}
