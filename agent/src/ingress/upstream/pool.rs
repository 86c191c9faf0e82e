//! HTTP/1.1 connections to endpoints, pooled per worker thread: a free list of
//! idle connections per endpoint, taken and put back under one uncontended lock
//! (the worker's own), with no task of their own. A connection goes back once its
//! response body has ended and it can take the next request; one idle for
//! [`IDLE_TIMEOUT`], or found closed by the endpoint (when taken, or by the
//! sweep), is dropped.

use super::{
    super::body::ProxyBody,
    Failure, IDLE_TIMEOUT,
    driven::{Driven, Home, Returning, Sent},
};
use http_body_util::BodyExt;
use hyper::{Request, Response, StatusCode, body::Incoming, client::conn::http1};
use hyper_util::rt::TokioIo;
use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};
use tokio::net::TcpStream;

/// One worker's idle HTTP/1.1 connections, by endpoint.
pub struct Http1Pool {
    idle: Mutex<HashMap<SocketAddr, Vec<Idle>>>,
    connect_timeout: Duration,
    /// Longest wait for the next piece of a response body.
    stall_timeout: Duration,
}

impl std::fmt::Debug for Http1Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Http1Pool")
            .field("connect_timeout", &self.connect_timeout)
            .finish_non_exhaustive()
    }
}

/// A connection waiting for its next request, and since when.
struct Idle {
    driven: Driven,
    since: Instant,
}

impl Home for Http1Pool {
    /// Puts a connection whose response has ended back in the free list.
    fn give_back(&self, addr: SocketAddr, driven: Driven) {
        let since = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.entry(addr).or_default().push(Idle { driven, since });
    }
}

impl Http1Pool {
    /// An empty pool whose new connections get `connect_timeout`, and whose
    /// response bodies are cut after `stall_timeout` without a piece.
    pub fn new(connect_timeout: Duration, stall_timeout: Duration) -> Http1Pool {
        Http1Pool {
            idle: Mutex::default(),
            connect_timeout,
            stall_timeout,
        }
    }

    /// Sends `req` (origin-form, with its `Host`) to `addr` over an idle
    /// connection, else a new one, driving the connection in the calling task. A
    /// request an idle connection did not take (the endpoint closed it meanwhile)
    /// goes on the next one, or a new one: resending is safe as nothing of it was
    /// written.
    pub async fn send(
        self: &Arc<Self>,
        addr: SocketAddr,
        mut req: Request<ProxyBody>,
    ) -> Result<Response<ProxyBody>, Failure> {
        while let Some(driven) = self.take(addr) {
            match driven.exchange(req, false).await {
                Sent::Response(resp, driven) => return Ok(self.keep(addr, resp, driven)),
                Sent::Back(back) => req = back,
                Sent::Broken => return Err(Failure::Protocol),
            }
        }
        let driven = self.connect(addr).await?;
        match driven.exchange(req, true).await {
            Sent::Response(resp, driven) => Ok(self.keep(addr, resp, driven)),
            Sent::Back(_) | Sent::Broken => Err(Failure::Protocol),
        }
    }

    /// Drops the connections idle too long or closed by their endpoint, and
    /// endpoints left with none.
    pub fn sweep(&self) {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.retain(|_, list| {
            list.retain_mut(|i| now.duration_since(i.since) < IDLE_TIMEOUT && !i.driven.ended());
            !list.is_empty()
        });
    }

    /// The most recently used idle connection to `addr` not idle too long (it
    /// may have been closed meanwhile: that shows once it is driven).
    fn take(&self, addr: SocketAddr) -> Option<Driven> {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let list = idle.get_mut(&addr)?;
        while let Some(i) = list.pop() {
            if now.duration_since(i.since) < IDLE_TIMEOUT {
                return Some(i.driven);
            }
        }
        None
    }

    /// How many connections to `addr` are idle.
    #[cfg(test)]
    pub(super) fn idle_count(&self, addr: SocketAddr) -> usize {
        let idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.get(&addr).map_or(0, Vec::len)
    }

    /// A new connection to `addr` within the connect timeout (upgrades allowed).
    async fn connect(&self, addr: SocketAddr) -> Result<Driven, Failure> {
        let stream =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(_)) | Err(_) => return Err(Failure::Connect),
            };
        let _ = stream.set_nodelay(true);
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|_| Failure::Connect)?;
        Ok(Driven::new(sender, conn))
    }

    /// The response, its body driving the connection and putting it back in the
    /// pool when it ends; after a protocol switch the connection runs as a task
    /// of its own until the upgrade takes it over.
    fn keep(
        self: &Arc<Self>,
        addr: SocketAddr,
        resp: Response<Incoming>,
        driven: Option<Driven>,
    ) -> Response<ProxyBody> {
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            if let Some(driven) = driven {
                driven.spawn(addr);
            }
            return resp.map(|b| b.map_err(Into::into).boxed_unsync());
        }
        resp.map(|body| {
            Returning::new(body, driven, self.clone(), addr, self.stall_timeout).boxed_unsync()
        })
    }
}
