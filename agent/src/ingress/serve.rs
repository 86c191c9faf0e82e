//! One ingress worker's listeners and client connections: the accept loops (plain
//! and TLS), the TLS handshake, and hyper serving each connection (HTTP/1.1 or h2)
//! until it ends, idles out or the subsystem stops.

use super::{
    IngressConfig, IngressMetrics,
    activity::Activity,
    client_cert::TlsSession,
    client_stream::ClientStream,
    conn_cap::ConnCap,
    fastpath::{self, Ended},
    handshakes::{HandshakeError, Handshakes},
    metrics::ReasonLabels,
    proxy::Proxy,
    upstream::IDLE_TIMEOUT,
};
use hyper::{
    Request,
    body::{Bytes, Incoming},
    service::service_fn,
};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::conn::auto,
};
use std::{net::SocketAddr, sync::Arc, time::Duration};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpListener,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// What one worker's accept loops and connections share.
pub(super) struct Serve {
    /// The worker's own proxy (its own upstream clients, the shared routes).
    pub(super) proxy: Arc<Proxy>,
    pub(super) config: IngressConfig,
    pub(super) metrics: IngressMetrics,
    /// The worker's connections, waited for when it stops.
    pub(super) tasks: TaskTracker,
    pub(super) cancel: CancellationToken,
    /// Room for client connections, shared by every worker's listeners.
    pub(super) cap: Arc<ConnCap>,
}

impl Serve {
    /// Serves the worker's two listeners until cancelled, then waits for its
    /// connections to finish (each bounded by the header timeout).
    pub(super) async fn run(
        self: Arc<Self>,
        plain: std::net::TcpListener,
        secure: std::net::TcpListener,
        tls: Arc<Handshakes>,
    ) {
        let sweeper = {
            let (proxy, cancel) = (self.proxy.clone(), self.cancel.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(IDLE_TIMEOUT / 4);
                loop {
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        _ = tick.tick() => proxy.sweep_idle(),
                    }
                }
            })
        };
        match (TcpListener::from_std(plain), TcpListener::from_std(secure)) {
            (Ok(plain), Ok(secure)) => {
                tokio::join!(
                    self.clone().accept(plain, None),
                    self.clone().accept(secure, Some(tls))
                );
            }
            (Err(error), _) | (_, Err(error)) => {
                tracing::error!(%error, "ingress: a worker could not use its listeners");
            }
        }
        sweeper.abort();
        self.tasks.close();
        self.tasks.wait().await;
    }

    /// Accepts connections until cancelled; each is served in its own task.
    async fn accept(self: Arc<Self>, listener: TcpListener, tls: Option<Arc<Handshakes>>) {
        loop {
            let (stream, peer) = tokio::select! {
                () = self.cancel.cancelled() => return,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(error) => {
                        // Out of file descriptors and the like: pause, then go on.
                        tracing::warn!(%error, "ingress: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            // At the cap, the accepted client waits (and later ones in the
            // backlog) until a connection closes; idle ones are asked to. A place
            // is taken only for a connection in hand, so the listeners waiting
            // for clients hold none.
            let permit = tokio::select! {
                () = self.cancel.cancelled() => return,
                p = self.cap.room() => p,
            };
            let _ = stream.set_nodelay(true);
            let this = self.clone();
            let tls = tls.clone();
            self.tasks.spawn(async move {
                let _permit = permit;
                match tls {
                    None => this.connection(stream, peer, None).await,
                    Some(handshakes) => match handshakes.handshake(stream).await {
                        Ok((stream, session)) => {
                            this.connection(stream, peer, Some(Arc::new(session))).await
                        }
                        Err(HandshakeError::Failed(e)) => this.handshake_failed(peer, &e),
                        Err(HandshakeError::Timeout) => this.count_tls_error("timeout"),
                    },
                }
            });
        }
    }

    fn handshake_failed(&self, peer: SocketAddr, e: &std::io::Error) {
        let text = e.to_string();
        let reason = if text.contains("no server certificate") {
            "unknown_sni"
        } else {
            "handshake"
        };
        tracing::debug!(%peer, error = %text, "ingress: TLS handshake failed");
        self.count_tls_error(reason);
    }

    fn count_tls_error(&self, reason: &'static str) {
        self.metrics
            .tls_handshake_errors
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Serves one client connection: HTTP/1.1 on the fast path while its requests
    /// are the fast path's, else (and h2 always) hyper.
    async fn connection<S>(&self, stream: S, peer: SocketAddr, tls: Option<Arc<TlsSession>>)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (stream, read) = if !self.config.fast_path || tls.as_ref().is_some_and(|t| t.h2) {
            (stream, Bytes::new())
        } else {
            let settings = fastpath::Settings {
                proxy: &self.proxy,
                header_timeout: self.config.header_timeout,
                idle_timeout: self.config.idle_timeout,
                max_header_bytes: self.config.max_header_bytes,
                cancel: &self.cancel,
                cap: &self.cap,
            };
            match fastpath::serve(&settings, stream, peer, tls.as_deref()).await {
                Ended::Closed => return,
                Ended::HandOver(stream, read) => (stream, read),
            }
        };
        self.hyper(stream, read, peer, tls).await;
    }

    /// Serves one client connection with hyper (HTTP/1.1 or h2), `read` the bytes
    /// of it the fast path already read, until it ends, idles out or the subsystem
    /// stops (then gracefully).
    async fn hyper<S>(&self, stream: S, read: Bytes, peer: SocketAddr, tls: Option<Arc<TlsSession>>)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let activity = Arc::new(Activity::new());
        let service = {
            let (proxy, activity) = (self.proxy.clone(), activity.clone());
            service_fn(move |req: Request<Incoming>| {
                let (proxy, activity, tls) = (proxy.clone(), activity.clone(), tls.clone());
                async move {
                    activity.begin();
                    let resp = proxy.handle(req, peer, tls.as_deref()).await;
                    activity.end();
                    Ok::<_, std::convert::Infallible>(resp)
                }
            })
        };
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(self.config.header_timeout)
            .max_buf_size(self.config.max_header_bytes);
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_header_list_size(u32::try_from(self.config.max_header_bytes).unwrap_or(u32::MAX));
        let stream = ClientStream::new(stream, read, activity.clone());
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
        tokio::pin!(conn);
        let idle = self.config.idle_timeout;
        let mut tick = tokio::time::interval(idle / 4);
        let stopping = loop {
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(error) = r {
                        tracing::debug!(%peer, %error, "ingress: connection ended");
                    }
                    return;
                }
                () = self.cancel.cancelled() => break true,
                _ = tick.tick() => if activity.idle_for() >= idle { break false },
                () = self.cap.pressure() => if activity.idle_after_requests() { break false },
            }
        };
        // Responses under way finish (a body still streaming after an idle tick
        // too), as long as their bytes move; the agent's stop waits for them a
        // bounded time only.
        conn.as_mut().graceful_shutdown();
        if stopping {
            let _ = tokio::time::timeout(self.config.header_timeout, conn).await;
            return;
        }
        loop {
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = tick.tick() => if activity.io_idle_for() >= idle {
                    tracing::debug!(%peer, "ingress: closing a connection whose client stopped reading");
                    return;
                },
            }
        }
    }
}
