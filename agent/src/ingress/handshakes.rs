//! TLS handshakes, on threads of their own (`--ingress-handshake-threads`) so a
//! flood of new TLS clients spends the handshake threads' CPU and not the
//! workers' that serve the clients already connected; 0 threads does them on the
//! worker that accepted the connection.
//!
//! A worker hands an accepted connection to a handshake thread and gets the
//! established TLS stream back. The socket moves between the threads' runtimes in
//! a [`Movable`], which re-registers it with the runtime that takes it.

use super::{
    client_cert::{TlsConfigs, TlsSession},
    routes::RouteTable,
};
use arc_swap::ArcSwap;
use std::{
    io,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
    sync::{mpsc, oneshot},
};
use tokio_rustls::server::TlsStream;
use tokio_util::task::TaskTracker;

/// Connections each handshake thread's queue holds before workers wait to hand
/// more over (their tasks hold connection-cap places while they wait).
const QUEUE: usize = 256;

/// An established TLS connection and what its handshake told.
pub(super) type Established = (TlsStream<Movable>, TlsSession);

/// Why a handshake produced no connection.
#[derive(Debug)]
pub(super) enum HandshakeError {
    /// Not done within the header timeout.
    Timeout,
    /// Refused or broken (the client's or ours).
    Failed(io::Error),
}

/// Where the TLS handshakes run: the threads' queues, or inline.
pub(super) struct Handshakes {
    settings: Arc<Settings>,
    threads: Vec<mpsc::Sender<Job>>,
    next: AtomicUsize,
}

/// What a handshake needs, wherever it runs.
struct Settings {
    configs: Arc<TlsConfigs>,
    routes: Arc<ArcSwap<RouteTable>>,
    timeout: Duration,
}

/// One connection for a handshake thread, and where its outcome goes.
struct Job {
    stream: std::net::TcpStream,
    reply: oneshot::Sender<Result<Established, HandshakeError>>,
}

impl Handshakes {
    /// `threads` handshake threads (0: inline), each with a current-thread
    /// runtime, tracked by `tasks` until they end (when every worker has dropped
    /// its `Handshakes`). A handshake takes at most `timeout`, its wait for a
    /// thread included.
    pub(super) fn start(
        threads: usize,
        configs: Arc<TlsConfigs>,
        routes: Arc<ArcSwap<RouteTable>>,
        timeout: Duration,
        tasks: &TaskTracker,
    ) -> io::Result<Handshakes> {
        let settings = Arc::new(Settings {
            configs,
            routes,
            timeout,
        });
        let mut senders = Vec::with_capacity(threads);
        for i in 0..threads {
            let (tx, rx) = mpsc::channel(QUEUE);
            let (done, finished) = oneshot::channel::<()>();
            let settings = settings.clone();
            // The runtime is built on its thread (one dropped by a failed spawn
            // here, in the caller's runtime, would panic), which says how it went.
            let (started, start) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name(format!("ingress-tls-{i}"))
                .spawn(move || {
                    let built = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build();
                    let runtime = match built {
                        Ok(runtime) => runtime,
                        Err(e) => {
                            let _ = started.send(Err(e));
                            return;
                        }
                    };
                    let _ = started.send(Ok(()));
                    runtime.block_on(serve(rx, settings));
                    drop(runtime);
                    drop(done);
                })?;
            start
                .recv()
                .unwrap_or_else(|_| Err(io::Error::other("handshake thread ended at start")))?;
            tasks.spawn(async move {
                let _ = finished.await;
            });
            senders.push(tx);
        }
        Ok(Handshakes {
            settings,
            threads: senders,
            next: AtomicUsize::new(0),
        })
    }

    /// Completes the TLS handshake of `stream`, accepted on the calling worker,
    /// and returns the connection registered with the worker's runtime.
    pub(super) async fn handshake(&self, stream: TcpStream) -> Result<Established, HandshakeError> {
        if self.threads.is_empty() {
            return self.settings.handshake(stream).await;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.threads.len();
        let handed = async {
            let stream = stream.into_std().map_err(HandshakeError::Failed)?;
            let (reply, answer) = oneshot::channel();
            self.threads[i]
                .send(Job { stream, reply })
                .await
                .map_err(|_| stopped())?;
            answer.await.map_err(|_| stopped())?
        };
        let (mut tls, session) = tokio::time::timeout(self.settings.timeout, handed)
            .await
            .map_err(|_| HandshakeError::Timeout)??;
        tls.get_mut().0.rebind().map_err(HandshakeError::Failed)?;
        Ok((tls, session))
    }
}

impl Settings {
    /// The handshake on this thread, within the timeout.
    async fn handshake(&self, stream: TcpStream) -> Result<Established, HandshakeError> {
        let wanted = |host: &str| self.routes.load().requests_client_cert(host);
        let handshake = self.configs.accept(Movable::new(stream), wanted);
        match tokio::time::timeout(self.timeout, handshake).await {
            Ok(Ok(established)) => Ok(established),
            Ok(Err(e)) => Err(HandshakeError::Failed(e)),
            Err(_) => Err(HandshakeError::Timeout),
        }
    }
}

/// A handshake thread: one task per connection handed over, each given up as
/// soon as the worker stopped waiting for it (timed out, or stopping).
async fn serve(mut jobs: mpsc::Receiver<Job>, settings: Arc<Settings>) {
    while let Some(Job { stream, mut reply }) = jobs.recv().await {
        let settings = settings.clone();
        tokio::spawn(async move {
            let outcome = tokio::select! {
                () = reply.closed() => return,
                r = async {
                    let stream = TcpStream::from_std(stream).map_err(HandshakeError::Failed)?;
                    settings.handshake(stream).await
                } => r,
            };
            let _ = reply.send(outcome);
        });
    }
    // The workers are gone: handshakes still under way, which no one waits
    // for, end with the runtime.
}

/// The handshake thread took no job or gave no answer: stopping, or gone.
fn stopped() -> HandshakeError {
    HandshakeError::Failed(io::Error::other("no handshake thread answered"))
}

/// A TCP stream that can move to another thread's runtime: [`Movable::rebind`]
/// deregisters it from the runtime that registered it and registers it with the
/// caller's.
#[derive(Debug)]
pub(super) struct Movable(Option<TcpStream>);

impl Movable {
    pub(super) fn new(stream: TcpStream) -> Movable {
        Movable(Some(stream))
    }

    /// Re-registers the stream with the calling thread's runtime.
    fn rebind(&mut self) -> io::Result<()> {
        let stream = self.0.take().ok_or_else(gone)?.into_std()?;
        self.0 = Some(TcpStream::from_std(stream)?);
        Ok(())
    }

    fn stream(self: Pin<&mut Self>) -> io::Result<Pin<&mut TcpStream>> {
        match &mut self.get_mut().0 {
            Some(s) => Ok(Pin::new(s)),
            None => Err(gone()),
        }
    }
}

/// Only a failed [`Movable::rebind`] leaves no stream, and the connection is then
/// dropped, so this is never seen by a client.
fn gone() -> io::Error {
    io::Error::new(
        io::ErrorKind::NotConnected,
        "stream lost moving between threads",
    )
}

impl AsyncRead for Movable {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.stream() {
            Ok(s) => s.poll_read(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl AsyncWrite for Movable {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.stream() {
            Ok(s) => s.poll_write(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.stream() {
            Ok(s) => s.poll_write_vectored(cx, bufs),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.stream() {
            Ok(s) => s.poll_flush(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.stream() {
            Ok(s) => s.poll_shutdown(cx),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

#[cfg(test)]
mod tests;
