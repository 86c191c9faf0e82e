//! One upstream HTTP/1.1 connection driven by the task of the request using it:
//! its connection future is polled beside the response (then by the response
//! body) instead of running as a task of its own, so a request, its response and
//! its body cross no channel wake between tasks.

use super::super::body::{BoxError, ProxyBody};
use hyper::{
    Request, Response,
    body::{Body, Bytes, Frame, Incoming, SizeHint},
    client::conn::http1::{Connection, SendRequest},
};
use hyper_util::rt::TokioIo;
use std::{
    future::poll_fn,
    net::SocketAddr,
    pin::{Pin, pin},
    sync::Arc,
    task::{Context, Poll, Waker},
    time::Duration,
};
use tokio::{net::TcpStream, time::Sleep};

/// A connection future with upgrades allowed (hyper does not name its type).
type ConnFuture = Pin<Box<dyn Future<Output = hyper::Result<()>> + Send>>;

/// A connection's request handle and the future that runs it, polled only by the
/// task whose request uses the connection (by nobody while it is idle).
pub(super) struct Driven {
    sender: SendRequest<ProxyBody>,
    conn: ConnFuture,
}

/// How a request over a [`Driven`] connection went.
pub(super) enum Sent {
    /// The response headers, with the connection for its body (none once the
    /// connection has ended: closed, broken or upgraded).
    Response(Response<Incoming>, Option<Driven>),
    /// The connection ended before taking the request, given back unsent.
    Back(Request<ProxyBody>),
    /// The connection broke after taking the request.
    Broken,
}

/// A context whose wakes go nowhere, for polls whose progress can only come from
/// the connection this task drives (see [`pass`]).
fn quiet() -> Context<'static> {
    Context::from_waker(Waker::noop())
}

/// One poll of `what` (the response, or its body), whose progress comes only
/// from the connection in `driven`: what earlier drives delivered (when
/// `delivered_first`: a body's frames read with its response), else the
/// connection driven once without a waker (when `quiet_first`) and `what`
/// again, else driven with this task's waker (for its wake-ups) and `what` a
/// last time. Wakers a quiet drive leaves to the connection's channels wake
/// nobody: this task, taking the response or frame they announce, would
/// otherwise wake itself for nothing. Once the connection has ended (`driven` is
/// then emptied), `what` is polled with this task's waker.
fn pass<T>(
    driven: &mut Option<Driven>,
    cx: &mut Context<'_>,
    delivered_first: bool,
    quiet_first: bool,
    mut what: impl FnMut(&mut Context<'_>) -> Poll<T>,
) -> Poll<T> {
    if driven.is_none() {
        return what(cx);
    }
    if delivered_first && let Poll::Ready(v) = what(&mut quiet()) {
        return Poll::Ready(v);
    }
    let drives: &[bool] = if quiet_first { &[false, true] } else { &[true] };
    for &wake_this_task in drives {
        let ended = match driven {
            Some(d) if wake_this_task => d.drive(cx),
            Some(d) => d.drive(&mut quiet()),
            None => true,
        };
        if ended {
            // Dropped, it answers a request it still held and ends its body.
            *driven = None;
            return what(cx);
        }
        if let Poll::Ready(v) = what(&mut quiet()) {
            return Poll::Ready(v);
        }
    }
    // A budgeted receiver (the response's oneshot) out of tokio's cooperative
    // budget answers Pending and defers its wake-up to the quiet waker, which
    // loses it: wake this task, so it is polled again once it has yielded.
    if !tokio::task::coop::has_budget_remaining() {
        cx.waker().wake_by_ref();
    }
    Poll::Pending
}

impl Driven {
    /// A new connection's handle and future.
    pub(super) fn new(
        sender: SendRequest<ProxyBody>,
        conn: Connection<TokioIo<TcpStream>, ProxyBody>,
    ) -> Driven {
        Driven {
            sender,
            conn: Box::pin(conn.with_upgrades()),
        }
    }

    /// Polls the connection once: whether it has ended (closed by the endpoint,
    /// broken, or handed over to an upgrade).
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        match self.conn.as_mut().poll(cx) {
            Poll::Pending => false,
            Poll::Ready(Ok(())) => true,
            Poll::Ready(Err(error)) => {
                tracing::debug!(%error, "ingress: upstream connection ended");
                true
            }
        }
    }

    /// Whether an idle connection has ended meanwhile (a poll that registers no
    /// wake-up: the connection is not watched while idle).
    pub(super) fn ended(&mut self) -> bool {
        self.drive(&mut quiet())
    }

    /// Whether the connection, its response over, can take the next request now:
    /// not when it has ended, nor while it still writes the request's body (an
    /// endpoint may answer before reading an upload; nothing would drive the rest
    /// of it from the pool).
    pub(super) fn reusable(&mut self) -> bool {
        !self.ended() && self.sender.is_ready()
    }

    /// Drives the connection until it waits for a request: false when it ended.
    async fn ready(&mut self) -> bool {
        poll_fn(|cx| {
            // First without a waker: the request sent right after must not wake
            // this task through the connection's request queue.
            if self.ended() {
                return Poll::Ready(false);
            }
            if self.sender.is_ready() {
                return Poll::Ready(true);
            }
            if self.drive(cx) {
                return Poll::Ready(false);
            }
            if self.sender.is_ready() {
                Poll::Ready(true)
            } else {
                Poll::Pending
            }
        })
        .await
    }

    /// Sends `req` and drives the connection until the response headers come.
    /// A `fresh` connection takes its first request without waiting to be ready,
    /// and so does one left wanting its next request (a close meanwhile shows
    /// when it is driven, the request then coming back unsent).
    pub(super) async fn exchange(mut self, req: Request<ProxyBody>, fresh: bool) -> Sent {
        if !fresh && !self.sender.is_ready() && !self.ready().await {
            return Sent::Back(req);
        }
        let mut response = pin!(self.sender.try_send_request(req));
        let mut driven = Some(self);
        // The first drive writes the request: a response can hardly come with it,
        // so it is driven with this task's waker at once.
        let mut first = true;
        let result = poll_fn(|cx| {
            let quiet_first = !std::mem::take(&mut first);
            pass(&mut driven, cx, false, quiet_first, |cx| {
                response.as_mut().poll(cx)
            })
        })
        .await;
        match result {
            Ok(resp) => Sent::Response(resp, driven),
            Err(mut e) => match e.take_message() {
                Some(req) => Sent::Back(req),
                None => {
                    tracing::debug!(error = %e.error(), "ingress: upstream request failed");
                    Sent::Broken
                }
            },
        }
    }

    /// Runs the connection as a task of its own, for an upgrade to complete.
    pub(super) fn spawn(self, addr: SocketAddr) {
        let Driven { sender, conn } = self;
        tokio::spawn(async move {
            if let Err(error) = conn.await {
                tracing::debug!(%addr, %error, "ingress: upstream connection ended");
            }
            drop(sender);
        });
    }
}

/// Where a connection goes back once its response body has ended (the pool).
pub(super) trait Home: Send + Sync {
    /// Takes back the connection to `addr`, ready for its next request.
    fn give_back(&self, addr: SocketAddr, driven: Driven);
}

/// A response body that drives its connection while it streams and puts the
/// connection back in its [`Home`] once it has ended. An endpoint that sends
/// nothing of it for `stall` ends it with an error (the client's response is
/// cut): a backend hanging mid-body does not hold the client forever.
pub(super) struct Returning {
    body: Incoming,
    /// The connection while it can still be reused.
    driven: Option<Driven>,
    ended: bool,
    home: Arc<dyn Home>,
    addr: SocketAddr,
    stall: Duration,
    /// Armed when the body first waits, re-armed when it waits after progress.
    timer: Option<Pin<Box<Sleep>>>,
    /// A frame came since the timer was armed.
    progressed: bool,
}

impl Returning {
    pub(super) fn new(
        body: Incoming,
        driven: Option<Driven>,
        home: Arc<dyn Home>,
        addr: SocketAddr,
        stall: Duration,
    ) -> Returning {
        Returning {
            body,
            driven,
            ended: false,
            home,
            addr,
            stall,
            timer: None,
            progressed: false,
        }
    }

    /// The body waits for the endpoint: whether it has waited `stall` since the
    /// last frame (the clock is read only when the body waits, not per frame).
    fn stalled(&mut self, cx: &mut Context<'_>) -> bool {
        let stall = self.stall;
        let deadline = || tokio::time::Instant::now() + stall;
        let timer = match &mut self.timer {
            Some(timer) if self.progressed => {
                timer.as_mut().reset(deadline());
                timer
            }
            Some(timer) => timer,
            None => self
                .timer
                .insert(Box::pin(tokio::time::sleep_until(deadline()))),
        };
        self.progressed = false;
        timer.as_mut().poll(cx).is_ready()
    }
}

impl Body for Returning {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let body = &mut this.body;
        let frame = pass(&mut this.driven, cx, true, true, |cx| {
            Pin::new(&mut *body).poll_frame(cx)
        });
        match &frame {
            Poll::Ready(Some(Ok(_))) => this.progressed = true,
            Poll::Ready(None) => this.ended = true,
            // A broken body leaves the connection unusable.
            Poll::Ready(Some(Err(_))) => this.driven = None,
            Poll::Pending => {
                if this.stalled(cx) {
                    tracing::debug!(addr = %this.addr, "ingress: endpoint stalled mid-body");
                    this.driven = None;
                    return Poll::Ready(Some(Err("the endpoint stalled mid-body".into())));
                }
            }
        }
        frame.map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Returning {
    fn drop(&mut self) {
        // A body dropped before its end (the client went away) closes the
        // connection, and so does one still sending the request's body.
        if (self.ended || self.body.is_end_stream())
            && let Some(mut driven) = self.driven.take()
            && driven.reusable()
        {
            self.home.give_back(self.addr, driven);
        }
    }
}
