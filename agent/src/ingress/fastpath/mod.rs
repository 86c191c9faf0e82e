//! The HTTP/1.1 fast path: the plain proxied request, served on raw sockets both
//! ways. The client's request head is parsed in place (httparse) and written to the
//! endpoint as one buffer with the forwarded headers; the endpoint's response head
//! likewise; bodies are relayed as they come (by length, chunked as they came, or
//! until close). Nothing is copied into header maps, and a request, its response
//! and its body take no task hand-over: a proxied keep-alive request costs little
//! more than its four system calls.
//!
//! Everything else is hyper's, as before: HTTP/2 (ALPN or prior knowledge),
//! `Upgrade`, `Expect`, chunked or not yet received request bodies, and every
//! request the proxy answers itself (no route, allow-list, client certificates,
//! redirects, ACME challenges, no ready endpoint). The first such request hands the
//! connection, with the bytes read of it, to hyper for the rest of its life
//! ([`Ended::HandOver`]); the decision is made before anything of the request is
//! acted on, so the two paths answer the same request the same way.

mod chunks;
mod exchange;
mod io;
mod request;
mod response;
#[cfg(test)]
mod tests;

use super::{activity::Activity, client_cert::TlsSession, conn_cap::ConnCap, proxy::Proxy};
use bytes::{Buf, Bytes, BytesMut};
use exchange::{After, Forward};
use io::{Deadline, read_more};
use request::{Context, Parsed};
use std::{
    net::SocketAddr,
    pin::{Pin, pin},
    time::Duration,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, AsyncWriteExt},
    time::Sleep,
};
use tokio_util::sync::CancellationToken;

/// How a connection left the fast path.
pub enum Ended<S> {
    /// It is over.
    Closed,
    /// Hyper serves the rest of it, starting with these bytes already read.
    HandOver(S, Bytes),
}

/// What the fast path holds a client connection to.
pub struct Settings<'a> {
    pub proxy: &'a Proxy,
    /// Time for a request head, from its first byte (a new connection's first
    /// request: from the connection's start).
    pub header_timeout: Duration,
    /// Time a connection may wait for its next request.
    pub idle_timeout: Duration,
    /// Largest request head (hyper answers 431 beyond).
    pub max_header_bytes: usize,
    pub cancel: &'a CancellationToken,
    pub cap: &'a ConnCap,
}

/// Serves the requests of `stream` from `peer` the fast path can, until the
/// connection ends or it hands the connection over to hyper. `tls` is the
/// connection's handshake; a connection that agreed on h2 is not for the fast path.
pub async fn serve<S>(
    settings: &Settings<'_>,
    stream: S,
    peer: SocketAddr,
    tls: Option<&TlsSession>,
) -> Ended<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let activity = Activity::new();
    let mut requests = pin!(requests(settings, stream, peer, tls, &activity));
    let idle = settings.idle_timeout;
    let mut tick = tokio::time::interval(idle / 4);
    loop {
        tokio::select! {
            biased;
            ended = requests.as_mut() => return ended,
            () = settings.cancel.cancelled() => break,
            _ = tick.tick() => if activity.idle_for() >= idle { return Ended::Closed },
            () = settings.cap.pressure() => if activity.idle_after_requests() {
                return Ended::Closed;
            },
        }
    }
    // Stopping: a response under way finishes within the header timeout, and the
    // connection closes after it.
    if !activity.busy() {
        return Ended::Closed;
    }
    match tokio::time::timeout(settings.header_timeout, requests).await {
        Ok(ended) => ended,
        Err(_) => Ended::Closed,
    }
}

/// The connection's request loop: read a head, forward it, relay the response.
async fn requests<S>(
    settings: &Settings<'_>,
    mut stream: S,
    peer: SocketAddr,
    tls: Option<&TlsSession>,
    activity: &Activity,
) -> Ended<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let proxy = settings.proxy;
    let mut buf = BytesMut::with_capacity(4096);
    let mut out = Vec::with_capacity(1024);
    let mut timer: Pin<Box<Sleep>> = Box::pin(tokio::time::sleep(Duration::ZERO));
    // The first request's head is due within the header timeout of the start;
    // a later one's from its first byte.
    let mut head_deadline = Deadline::after(settings.header_timeout);
    let mut head_started = true;
    loop {
        let parsed = loop {
            if !buf.is_empty() {
                let routes = proxy.routes.load();
                let cx = Context {
                    routes: &routes,
                    peer,
                    tls,
                    max_head_bytes: settings.max_header_bytes,
                    max_body_bytes: proxy.limits.max_body_bytes,
                    trusted_proxies: &proxy.limits.trusted_proxies,
                    access_log: &proxy.access_log,
                    turn: &proxy.turn,
                };
                match request::parse(&buf, &cx, &mut out) {
                    Parsed::Partial if buf.len() >= settings.max_header_bytes => {
                        break Parsed::HandOver;
                    }
                    Parsed::Partial => {}
                    parsed => break parsed,
                }
            }
            if !head_started && !buf.is_empty() {
                head_deadline = Deadline::after(settings.header_timeout);
                head_started = true;
            }
            io::room(&mut buf);
            match read_more(&mut stream, &mut buf, timer.as_mut(), &mut head_deadline).await {
                Ok(0) | Err(_) => return Ended::Closed,
                Ok(_) => {}
            }
        };
        let plan = match parsed {
            Parsed::Forward(plan) => plan,
            Parsed::Partial | Parsed::HandOver => return Ended::HandOver(stream, buf.freeze()),
        };
        buf.advance(plan.len);
        activity.begin();
        let forward = Forward {
            proxy,
            client: &mut stream,
            peer,
            tls: tls.is_some(),
            out: &mut out,
            timer: timer.as_mut(),
        };
        let after = forward.run(&plan).await;
        activity.end();
        if matches!(after, After::Close) || settings.cancel.is_cancelled() {
            // TLS says close_notify first; a client that stopped reading gets no wait.
            let _ = tokio::time::timeout(settings.header_timeout, stream.shutdown()).await;
            return Ended::Closed;
        }
        // The next request may wait as long as the connection may idle.
        head_deadline = Deadline::never();
        head_started = false;
    }
}
