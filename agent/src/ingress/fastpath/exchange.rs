//! One request forwarded on the fast path: an endpoint connection (pooled, else
//! new; a connect failure retried once on another endpoint when resending is
//! safe), the request written in one piece, the response head read within the
//! response timeout, and the body relayed as it comes.

use super::{
    chunks::Chunks,
    io::{Deadline, TimedOut, read_more, room, write_all_within},
    request::Plan,
    response::{self, Framing, Head},
};
use crate::ingress::{
    access_log::{self, AccessLog},
    answers::TEXT_PLAIN,
    proxy::Proxy,
    routes::Backend,
    upstream::{Failure, Origin},
};
use bytes::Buf;
use hyper::StatusCode;
use std::{
    io::Write as _,
    net::SocketAddr,
    pin::Pin,
    time::{Duration, Instant},
};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    time::Sleep,
};

/// Largest response head an endpoint may send (else 502).
const MAX_RESPONSE_HEAD: usize = 64 << 10;

/// Bodies up to this size go out in the same write as their head.
const SMALL_BODY: usize = 16 << 10;

/// Whether the client's connection can take its next request.
pub enum After {
    KeepGoing,
    Close,
}

/// Why the exchange with one endpoint connection did not give a response head.
enum Miss {
    /// The connection ended before any of a response: a pooled connection the
    /// endpoint closed meanwhile.
    Unanswered,
    Failed(Failure),
}

/// One request's buffers and the connection's timer.
pub struct Forward<'a, C> {
    pub proxy: &'a Proxy,
    pub client: &'a mut C,
    pub peer: SocketAddr,
    pub tls: bool,
    /// The endpoint's request (head and body), then reused for the response head.
    pub out: &'a mut Vec<u8>,
    pub timer: Pin<&'a mut Sleep>,
}

impl<C: AsyncRead + AsyncWrite + Unpin> Forward<'_, C> {
    /// Forwards `plan` to its endpoint (or another of its route) and relays the
    /// answer to the client.
    pub async fn run(mut self, plan: &Plan) -> After {
        let start = Instant::now();
        let mut backend = plan.backend.clone();
        let mut result = self.exchange(plan, &backend).await;
        if let Err(Failure::Connect) = result
            && plan.retryable
            && let Some(second) = plan.route.pick(plan.turn, Some(&backend))
        {
            backend = second;
            result = self.exchange(plan, &backend).await;
        }
        match result {
            Ok((mut origin, head)) => {
                self.log(plan, head.status, start, backend.addr);
                let after = self.relay(&mut origin, &head).await;
                if let Ok(true) = after {
                    self.proxy.origins.give_back(backend.addr, origin);
                }
                if head.closes || after.is_err() {
                    After::Close
                } else {
                    After::KeepGoing
                }
            }
            Err(failure) => {
                let (status, text) = failure.answer();
                self.log(plan, status.as_u16(), start, backend.addr);
                answer(self.out, status, text, plan.close, plan.head);
                let stall = self.proxy.limits.response_timeout;
                let written = self.send_client(None, stall).await.is_ok();
                if plan.close || !written {
                    After::Close
                } else {
                    After::KeepGoing
                }
            }
        }
    }

    /// Counts the request and writes its access-log line, once its response head
    /// is known.
    fn log(&self, plan: &Plan, status: u16, start: Instant, upstream: SocketAddr) {
        let duration = start.elapsed();
        self.proxy.count(Some(&plan.route), status, duration);
        self.proxy.metrics.fast_path_requests.inc();
        if let Some((method, path, host)) = &plan.logged {
            AccessLog::record(&access_log::Entry {
                client: self.peer,
                method,
                host,
                path,
                version: "HTTP/1.1",
                tls: self.tls,
                status,
                service: &plan.route.service,
                upstream: Some(upstream),
                duration,
            });
        }
    }

    /// The response head of `backend` to the request in `out`, with the connection
    /// it came on; `out` then holds the client's response head.
    async fn exchange(
        &mut self,
        plan: &Plan,
        backend: &Backend,
    ) -> Result<(Origin, Head), Failure> {
        let in_flight = backend.in_flight();
        let result = self.exchange_on(plan, backend.addr).await;
        drop(in_flight);
        if let Err(failure) = &result {
            self.proxy.upstream_failed(backend.addr, failure);
        }
        result
    }

    async fn exchange_on(
        &mut self,
        plan: &Plan,
        addr: SocketAddr,
    ) -> Result<(Origin, Head), Failure> {
        let origins = &self.proxy.origins;
        let mut deadline = Deadline::after(self.proxy.limits.response_timeout);
        let mut pooled = origins.take(addr);
        loop {
            let reused = pooled.is_some();
            let mut origin = match pooled.take() {
                Some(origin) => origin,
                None => origins.connect(addr).await.map_err(|_| Failure::Connect)?,
            };
            match self.ask(&mut origin, plan, &mut deadline).await {
                Ok(head) => return Ok((origin, head)),
                Err(Miss::Unanswered) if reused && plan.retryable => {}
                Err(Miss::Unanswered) => return Err(Failure::Protocol),
                Err(Miss::Failed(failure)) => return Err(failure),
            }
        }
    }

    /// Writes the request on `origin` and reads its final response head.
    async fn ask(
        &mut self,
        origin: &mut Origin,
        plan: &Plan,
        deadline: &mut Deadline,
    ) -> Result<Head, Miss> {
        match write_all_within(&mut origin.stream, self.out, self.timer.as_mut(), deadline).await {
            Ok(()) => {}
            Err(TimedOut::No) => return Err(Miss::Unanswered),
            Err(TimedOut::Yes) => return Err(Miss::Failed(Failure::Timeout)),
        }
        let mut heard = false;
        loop {
            match response::parse(&origin.buf, plan.head, plan.close, self.out) {
                response::Parsed::Final(head) => {
                    origin.buf.advance(head.len);
                    return Ok(head);
                }
                response::Parsed::Interim(len) => {
                    origin.buf.advance(len);
                    heard = true;
                    continue;
                }
                response::Parsed::Bad => return Err(Miss::Failed(Failure::Protocol)),
                response::Parsed::Partial if origin.buf.len() > MAX_RESPONSE_HEAD => {
                    return Err(Miss::Failed(Failure::Protocol));
                }
                response::Parsed::Partial => {}
            }
            room(&mut origin.buf);
            match read_more(
                &mut origin.stream,
                &mut origin.buf,
                self.timer.as_mut(),
                deadline,
            )
            .await
            {
                Ok(0) | Err(TimedOut::No) if !heard && origin.buf.is_empty() => {
                    return Err(Miss::Unanswered);
                }
                Ok(0) | Err(TimedOut::No) => return Err(Miss::Failed(Failure::Protocol)),
                Ok(_) => {}
                Err(TimedOut::Yes) => return Err(Miss::Failed(Failure::Timeout)),
            }
        }
    }

    /// Relays the response (its head in `out`, its body from `origin`) to the
    /// client: whether the connection can serve another request; an error when the
    /// client's response was cut (the client's connection must close).
    async fn relay(&mut self, origin: &mut Origin, head: &Head) -> Result<bool, ()> {
        let stall = self.proxy.limits.response_timeout;
        let mut chunks = Chunks::new();
        let mut left = match head.framing {
            Framing::Length(n) => n,
            _ => u64::MAX,
        };
        let mut first = true;
        loop {
            // The part of what was read that belongs to the body.
            let take = match head.framing {
                Framing::Empty => 0,
                Framing::Length(_) => usize::try_from(left)
                    .unwrap_or(usize::MAX)
                    .min(origin.buf.len()),
                Framing::Chunked => chunks.advance(&origin.buf).map_err(|_| ())?,
                Framing::UntilClose => origin.buf.len(),
            };
            if first && take <= SMALL_BODY {
                self.out.extend_from_slice(&origin.buf[..take]);
                self.send_client(None, stall).await?;
            } else {
                if first {
                    self.send_client(None, stall).await?;
                }
                self.send_client(Some(&origin.buf[..take]), stall).await?;
            }
            first = false;
            origin.buf.advance(take);
            left -= take as u64;
            let done = match head.framing {
                Framing::Empty => true,
                Framing::Length(_) => left == 0,
                Framing::Chunked => chunks.done(),
                Framing::UntilClose => false,
            };
            if done {
                return Ok(head.keeps && origin.buf.is_empty());
            }
            room(&mut origin.buf);
            let mut deadline = Deadline::after(stall);
            match read_more(
                &mut origin.stream,
                &mut origin.buf,
                self.timer.as_mut(),
                &mut deadline,
            )
            .await
            {
                Ok(0) if head.framing == Framing::UntilClose => return Ok(false),
                Ok(0) | Err(_) => {
                    tracing::debug!("ingress: the endpoint's response body ended early or stalled");
                    return Err(());
                }
                Ok(_) => {}
            }
        }
    }
}

impl<C: AsyncWrite + Unpin> Forward<'_, C> {
    /// Writes `bytes` (else the output buffer) to the client, flushed; a client
    /// that takes none of it for `stall` is given up on.
    async fn send_client(&mut self, bytes: Option<&[u8]>, stall: Duration) -> Result<(), ()> {
        let bytes = bytes.unwrap_or(self.out);
        let mut deadline = Deadline::after(stall);
        write_all_within(self.client, bytes, self.timer.as_mut(), &mut deadline)
            .await
            .map_err(|_| tracing::debug!("ingress: the client stopped taking its response"))
    }
}

/// The proxy's own short answer: `status` with `text` (its length only, to a
/// `HEAD` request when `head`).
pub fn answer(out: &mut Vec<u8>, status: StatusCode, text: &str, close: bool, head: bool) {
    out.clear();
    let date = httpdate::fmt_http_date(std::time::SystemTime::now());
    // Writing to a Vec cannot fail.
    let _ = write!(
        out,
        "HTTP/1.1 {status}\r\ncontent-type: {TEXT_PLAIN}\r\ncontent-length: {}\r\ndate: {date}\r\n{}\r\n{}",
        text.len(),
        if close { "connection: close\r\n" } else { "" },
        if head { "" } else { text },
    );
}
