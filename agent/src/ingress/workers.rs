//! The ingress proxy's worker threads (`--ingress-workers`). Each runs its own
//! current-thread runtime with its own listeners (`SO_REUSEPORT`, so the kernel
//! spreads new clients over the workers) and its own upstream clients: a client
//! connection, its requests and their upstream connections stay on one thread, as
//! in nginx's worker processes (only a TLS connection's handshake is handed to a
//! thread of [`super::handshakes`] and back). Routes, metrics,
//! ACME tokens, TLS configurations and the connection cap are shared.

use super::{handshakes::Handshakes, serve::Serve};
use crate::subsystem::SubsystemError;
use socket2::{Domain, Protocol, Socket, Type};
use std::{io, net::SocketAddr, sync::Arc};
use tokio_util::task::TaskTracker;

/// Pending connections each listener's kernel queue holds (tokio's default).
const BACKLOG: i32 = 1024;

/// The listeners of every worker on `addr`, one each; the first binds the
/// configured address (port 0: any) and the others the same address it got. With
/// more than one worker they share the port through `SO_REUSEPORT`.
pub fn bind(
    addr: SocketAddr,
    workers: usize,
) -> Result<Vec<std::net::TcpListener>, SubsystemError> {
    let failed = |e| SubsystemError::io(format!("ingress: bind TCP {addr}"), e);
    let shared = workers > 1;
    let first = bind_one(addr, shared).map_err(failed)?;
    let bound = first.local_addr().map_err(failed)?;
    let mut listeners = vec![first];
    for _ in 1..workers {
        listeners.push(bind_one(bound, shared).map_err(failed)?);
    }
    Ok(listeners)
}

/// One non-blocking listener on `addr`, with `SO_REUSEADDR` (as tokio's own bind)
/// and `SO_REUSEPORT` when `shared`.
fn bind_one(addr: SocketAddr, shared: bool) -> io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    if shared {
        socket.set_reuse_port(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

/// Starts one worker thread per `Serve` with its plain and TLS listener, handing
/// TLS connections to `tls`; each thread's end is tracked by `tasks`, so the
/// subsystem's stop waits for its connections to finish.
pub fn spawn(
    workers: Vec<(Serve, std::net::TcpListener, std::net::TcpListener)>,
    tls: &Arc<Handshakes>,
    tasks: &TaskTracker,
) -> Result<(), SubsystemError> {
    for (i, (serve, plain, secure)) in workers.into_iter().enumerate() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| SubsystemError::io("ingress: worker runtime", e))?;
        let (done, finished) = tokio::sync::oneshot::channel::<()>();
        let tls = tls.clone();
        std::thread::Builder::new()
            .name(format!("ingress-{i}"))
            .spawn(move || {
                runtime.block_on(Arc::new(serve).run(plain, secure, tls));
                // Tasks left (pooled upstream connections) end with the runtime.
                drop(runtime);
                drop(done);
            })
            .map_err(|e| SubsystemError::io("ingress: worker thread", e))?;
        tasks.spawn(async move {
            let _ = finished.await;
        });
    }
    Ok(())
}
