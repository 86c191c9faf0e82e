//! HTTP/1.1 connections to endpoints, pooled per worker thread: a free list of
//! idle connections per endpoint, taken and put back under one uncontended lock
//! (the worker's own), with no task or channel per request. A connection goes
//! back once its response body has ended; one idle for [`IDLE_TIMEOUT`], or
//! closed by the endpoint, is dropped.

use super::{
    body::{BoxError, ProxyBody},
    routes::Backend,
};
use http_body_util::BodyExt;
use hyper::{
    Request, Response, StatusCode,
    body::{Body, Bytes, Frame, Incoming, SizeHint},
    client::conn::http1::{self, SendRequest},
};
use hyper::{Uri, http::uri::PathAndQuery};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioIo,
};
use std::{
    collections::HashMap,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
    task::{Context, Poll},
    time::{Duration, Instant},
};
use tokio::net::TcpStream;

/// How long an unused connection is kept.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// One worker's idle HTTP/1.1 connections, by endpoint.
#[derive(Debug)]
pub struct Http1Pool {
    idle: Mutex<HashMap<SocketAddr, Vec<Idle>>>,
    connect_timeout: Duration,
}

/// A connection waiting for its next request, and since when.
#[derive(Debug)]
struct Idle {
    sender: SendRequest<ProxyBody>,
    since: Instant,
}

impl Idle {
    fn usable(&self, now: Instant) -> bool {
        !self.sender.is_closed() && now.duration_since(self.since) < IDLE_TIMEOUT
    }
}

impl Http1Pool {
    /// An empty pool whose new connections get `connect_timeout`.
    pub fn new(connect_timeout: Duration) -> Http1Pool {
        Http1Pool {
            idle: Mutex::default(),
            connect_timeout,
        }
    }

    /// Sends `req` (origin-form, with its `Host`) to `addr` over an idle
    /// connection, else a new one. A request an idle connection did not take (the
    /// endpoint closed it meanwhile) goes on the next one, or a new one: resending
    /// is safe as nothing of it was written.
    pub async fn send(
        self: &Arc<Self>,
        addr: SocketAddr,
        mut req: Request<ProxyBody>,
    ) -> Result<Response<ProxyBody>, Failure> {
        while let Some(mut sender) = self.take(addr) {
            if sender.ready().await.is_err() {
                continue;
            }
            match sender.try_send_request(req).await {
                Ok(resp) => return Ok(self.clone().keep(addr, sender, resp)),
                Err(mut e) => match e.take_message() {
                    Some(back) => req = back,
                    None => return Err(Failure::Protocol),
                },
            }
        }
        let mut sender = self.connect(addr).await?;
        match sender.send_request(req).await {
            Ok(resp) => Ok(self.clone().keep(addr, sender, resp)),
            Err(_) => Err(Failure::Protocol),
        }
    }

    /// Drops the connections idle too long or closed, and endpoints left with none.
    pub fn sweep(&self) {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.retain(|_, list| {
            list.retain(|i| i.usable(now));
            !list.is_empty()
        });
    }

    /// The most recently used usable idle connection to `addr`.
    fn take(&self, addr: SocketAddr) -> Option<SendRequest<ProxyBody>> {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let list = idle.get_mut(&addr)?;
        while let Some(i) = list.pop() {
            if i.usable(now) {
                return Some(i.sender);
            }
        }
        None
    }

    fn give_back(&self, addr: SocketAddr, sender: SendRequest<ProxyBody>) {
        if sender.is_closed() {
            return;
        }
        let since = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.entry(addr).or_default().push(Idle { sender, since });
    }

    /// A new connection to `addr` within the connect timeout, served by a task on
    /// this worker (upgrades allowed).
    async fn connect(&self, addr: SocketAddr) -> Result<SendRequest<ProxyBody>, Failure> {
        let stream =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(_)) | Err(_) => return Err(Failure::Connect),
            };
        let _ = stream.set_nodelay(true);
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|_| Failure::Connect)?;
        tokio::spawn(async move {
            if let Err(error) = conn.with_upgrades().await {
                tracing::debug!(%addr, %error, "ingress: upstream connection ended");
            }
        });
        Ok(sender)
    }

    /// The response, its connection going back to the pool when its body ends
    /// (not after a protocol switch: the connection is then the client's).
    fn keep(
        self: Arc<Self>,
        addr: SocketAddr,
        sender: SendRequest<ProxyBody>,
        resp: Response<Incoming>,
    ) -> Response<ProxyBody> {
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            return resp.map(|b| b.map_err(Into::into).boxed_unsync());
        }
        resp.map(|body| {
            Returning {
                body,
                ended: false,
                back: Some((self, addr, sender)),
            }
            .boxed_unsync()
        })
    }
}

/// A response body that puts its connection back in the pool once it has ended.
struct Returning {
    body: Incoming,
    ended: bool,
    back: Option<(Arc<Http1Pool>, SocketAddr, SendRequest<ProxyBody>)>,
}

impl Body for Returning {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = Pin::new(&mut self.body).poll_frame(cx);
        match &frame {
            Poll::Ready(None) => self.ended = true,
            // A broken body leaves the connection unusable.
            Poll::Ready(Some(Err(_))) => self.back = None,
            _ => {}
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
        // connection with the sender.
        if (self.ended || self.body.is_end_stream())
            && let Some((pool, addr, sender)) = self.back.take()
        {
            pool.give_back(addr, sender);
        }
    }
}

/// Why an upstream exchange failed.
pub enum Failure {
    /// No connection could be made (nothing was sent).
    Connect,
    /// No response headers within the response timeout.
    Timeout,
    /// The connection broke or the response was not HTTP.
    Protocol,
}

/// The pooled h2c client to endpoints (one multiplexed connection each), each
/// connected within `connect_timeout`.
pub fn h2c_client(connect_timeout: Duration) -> Client<HttpConnector, ProxyBody> {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .pool_idle_timeout(IDLE_TIMEOUT)
        .http2_only(true)
        .timer(hyper_util::rt::TokioTimer::new())
        .build(connector)
}

/// `http://ADDR/path?query`, from the backend's authority and the request's
/// path (both shared, not copied).
pub fn upstream_uri(backend: &Backend, uri: &Uri) -> Uri {
    let mut parts = hyper::http::uri::Parts::default();
    parts.scheme = Some(hyper::http::uri::Scheme::HTTP);
    parts.authority = Some(backend.authority.clone());
    parts.path_and_query = Some(path_and_query(uri));
    Uri::from_parts(parts).unwrap_or_default()
}

/// The request's path and query (`/` when it has none: `OPTIONS *` aside, only an
/// authority-form `CONNECT` lacks one).
pub fn path_and_query(uri: &Uri) -> PathAndQuery {
    uri.path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingress::answers::empty;
    use http_body_util::Full;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// An HTTP/1.1 server on loopback answering `ok`, counting its connections.
    async fn server() -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::Relaxed);
                let service = hyper::service::service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(
                        b"ok",
                    ))))
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        (addr, accepted)
    }

    fn get() -> Request<ProxyBody> {
        Request::builder()
            .uri("/")
            .header(hyper::header::HOST, "a.example")
            .body(empty())
            .unwrap()
    }

    #[tokio::test]
    async fn a_connection_is_reused_once_its_body_was_read_and_not_before() {
        let (addr, accepted) = server().await;
        let pool = Arc::new(Http1Pool::new(Duration::from_secs(1)));
        for _ in 0..3 {
            let Ok(resp) = pool.send(addr, get()).await else {
                panic!("no response")
            };
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"ok");
        }
        assert_eq!(accepted.load(Ordering::Relaxed), 1);
        // A response whose body is still unread holds its connection.
        let Ok(_unread) = pool.send(addr, get()).await else {
            panic!("no response")
        };
        let Ok(resp) = pool.send(addr, get()).await else {
            panic!("no response")
        };
        drop(resp);
        assert_eq!(accepted.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn nothing_listening_is_a_connect_failure() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let pool = Arc::new(Http1Pool::new(Duration::from_secs(1)));
        assert!(matches!(
            pool.send(addr, get()).await,
            Err(Failure::Connect)
        ));
    }
}
