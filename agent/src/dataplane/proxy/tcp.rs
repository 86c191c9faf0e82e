//! The TCP side of the proxy: accept, pick a backend, dial, splice.

use super::{backends::PortShared, policy_gate::PolicyGate};
use crate::model::Protocol;
use prometheus_client::metrics::counter::Counter;
use std::{
    io,
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf, copy_bidirectional},
    net::{TcpListener, TcpStream},
    time::timeout,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// How long a backend may take to accept a connection.
pub(super) const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// Accepts connections until `stop`; each connection runs in its own task under
/// `tracker` and ends only on `conns` (shutdown) or when either side closes, so that
/// removing the service does not cut connections already open.
pub(super) async fn serve(
    listener: TcpListener,
    port: Arc<PortShared>,
    policy: Arc<PolicyGate>,
    stop: CancellationToken,
    conns: CancellationToken,
    tracker: TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => r,
        };
        let (client, peer) = match accepted {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(service = %port.service, error = %e, "accept failed");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
                }
            }
        };
        let Some(backend) = port.pick(peer) else {
            port.m.no_backend.inc();
            reset(client);
            continue;
        };
        if !policy.admit(peer.ip(), backend, Protocol::Tcp) {
            reset(client);
            continue;
        }
        tracker.spawn(connection(client, backend, port.clone(), conns.clone()));
    }
}

/// Closes with a RST, so the client sees a refusal rather than an empty answer.
fn reset(sock: TcpStream) {
    // Best effort: without SO_LINGER 0 the drop is a FIN, still a close.
    let _ = sock.set_zero_linger();
}

async fn connection(
    client: TcpStream,
    backend: SocketAddr,
    port: Arc<PortShared>,
    cancel: CancellationToken,
) {
    let dialed = tokio::select! {
        _ = cancel.cancelled() => return,
        r = timeout(DIAL_TIMEOUT, TcpStream::connect(backend)) => r,
    };
    let server = match dialed {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!(service = %port.service, %backend, error = %e, "dial failed");
            port.m.dial_error.inc();
            return reset(client);
        }
        Err(_) => {
            tracing::debug!(service = %port.service, %backend, "dial timed out");
            port.m.dial_error.inc();
            return reset(client);
        }
    };
    port.m.ok.inc();
    // Request/response traffic: do not hold small writes back (best effort).
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let drained = port.drain_token(backend);
    // Bytes are counted as they are read, so the counters are current while the
    // connection lives and nothing is lost when it ends in an error.
    let mut client = Counted::new(client, port.m.to_backend.clone());
    let mut server = Counted::new(server, port.m.to_client.clone());
    let relayed = tokio::select! {
        _ = cancel.cancelled() => Ok((0, 0)),
        _ = drained.cancelled() => {
            tracing::debug!(service = %port.service, %backend, "drain time over: closing");
            Ok((0, 0))
        }
        r = copy_bidirectional(&mut client, &mut server) => r,
    };
    // One side aborted (a reset): abort the other too instead of closing it with a
    // FIN. Besides passing on what happened, this keeps the proxy's connections to
    // the backend out of TIME_WAIT, which would otherwise exhaust the node's
    // ephemeral ports towards one backend under many short connections.
    if relayed.is_err() {
        let _ = client.inner.set_zero_linger();
        let _ = server.inner.set_zero_linger();
    }
}

/// A stream that adds every byte read from it to a counter.
struct Counted<S> {
    inner: S,
    read: Counter,
}

impl<S> Counted<S> {
    fn new(inner: S, read: Counter) -> Self {
        Self { inner, read }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            self.read.inc_by(n as u64);
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
