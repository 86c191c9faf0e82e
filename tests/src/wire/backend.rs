//! The scripted backends of the wire tests: raw-TCP servers on 127.0.0.1 that
//! answer each request with bytes chosen by the test and record what they received.

use super::{Head, Wire};
use crate::ingress::{Ingress, exposed_at};
use std::{
    io::Write,
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

/// The longest a scripted backend holds a connection it was told to hang.
const HANG_AT_MOST: Duration = Duration::from_secs(30);

/// A request as a scripted backend received it.
#[derive(Clone, Debug)]
pub struct Received {
    /// Which accepted connection carried it (0, 1, ...).
    pub conn: usize,
    /// The request line and headers.
    pub head: Head,
    /// The body (Content-Length or chunked, decoded).
    pub body: Vec<u8>,
}

impl Received {
    /// The method.
    pub fn method(&self) -> &str {
        self.head.start.split(' ').next().unwrap_or_default()
    }

    /// The request target, as sent.
    pub fn target(&self) -> &str {
        self.head.start.split(' ').nth(1).unwrap_or_default()
    }
}

/// What a scripted backend does after writing its bytes.
#[derive(Clone, Copy, Debug)]
pub enum Then {
    /// Reads the next request on the connection.
    KeepOpen,
    /// Closes the connection.
    Close,
    /// Waits, then closes.
    CloseAfter(Duration),
    /// Keeps the connection open without reading or writing (until stopped).
    Hang,
}

/// A scripted backend's answer to one request: bytes written as is, then [`Then`].
pub struct Reply {
    /// The raw response bytes.
    pub bytes: Vec<u8>,
    /// What the connection does next.
    pub then: Then,
}

impl Reply {
    /// `bytes`, then the next request.
    pub fn keep(bytes: impl Into<Vec<u8>>) -> Reply {
        Reply {
            bytes: bytes.into(),
            then: Then::KeepOpen,
        }
    }

    /// `bytes`, then [`Then`] `then`.
    pub fn then(bytes: impl Into<Vec<u8>>, then: Then) -> Reply {
        Reply {
            bytes: bytes.into(),
            then,
        }
    }
}

/// `200 OK` with `body` and its Content-Length.
pub fn ok(body: impl AsRef<[u8]>) -> Vec<u8> {
    let body = body.as_ref();
    let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
    [head.as_bytes(), body].concat()
}

/// The script: the reply to each request received.
type Script = dyn Fn(&Received) -> Reply + Send + Sync;

/// A raw-TCP backend on 127.0.0.1 that answers each request with its script's
/// bytes and records what it received; stops when dropped.
pub struct ScriptedBackend {
    /// Where it listens.
    pub addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    received: Arc<Mutex<Vec<Received>>>,
    stop: Arc<AtomicBool>,
}

impl ScriptedBackend {
    /// Starts a backend that answers with `script`, a thread per connection.
    pub fn start(script: impl Fn(&Received) -> Reply + Send + Sync + 'static) -> ScriptedBackend {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a scripted backend");
        listener.set_nonblocking(true).unwrap();
        let backend = ScriptedBackend {
            addr: listener.local_addr().unwrap(),
            accepted: Arc::default(),
            received: Arc::default(),
            stop: Arc::default(),
        };
        let script: Arc<Script> = Arc::new(script);
        let (accepted, received) = (backend.accepted.clone(), backend.received.clone());
        let stop = backend.stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let Ok((stream, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let conn = accepted.fetch_add(1, Ordering::SeqCst);
                let (script, received, stop) = (script.clone(), received.clone(), stop.clone());
                std::thread::spawn(move || serve(stream, conn, &*script, &received, stop));
            }
        });
        backend
    }

    /// How many connections it accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// The requests received so far, in order.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// Forgets the requests received so far (those of the readiness checks).
    pub fn clear(&self) {
        self.received.lock().unwrap().clear();
    }
}

impl Drop for ScriptedBackend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Serves requests on one connection with `script` until it closes, the script
/// closes it, or the backend stops.
fn serve(
    stream: TcpStream,
    conn: usize,
    script: &Script,
    received: &Mutex<Vec<Received>>,
    stop: Arc<AtomicBool>,
) {
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut wire = Wire {
        stream,
        buf: Vec::new(),
        stop: Some(stop.clone()),
    };
    while let Ok(Some(head)) = wire.head() {
        let body = if head.lists("transfer-encoding", "chunked") {
            wire.chunked().map(|(body, _)| body)
        } else {
            let length = head
                .header("content-length")
                .map_or(0, |l| l.parse().unwrap_or(0));
            wire.take(length)
        };
        let Ok(body) = body else { return };
        let request = Received { conn, head, body };
        received.lock().unwrap().push(request.clone());
        let reply = script(&request);
        if wire.stream.write_all(&reply.bytes).is_err() {
            return;
        }
        match reply.then {
            Then::KeepOpen => {}
            Then::Close => return,
            Then::CloseAfter(wait) => {
                std::thread::sleep(wait);
                return;
            }
            Then::Hang => {
                let since = Instant::now();
                while !stop.load(Ordering::SeqCst) && since.elapsed() < HANG_AT_MOST {
                    std::thread::sleep(Duration::from_millis(20));
                }
                return;
            }
        }
    }
}

/// A scripted backend behind `host`, routed and ready: `GET /ready` is answered
/// `200 ready` (the readiness checks), every other request by `script`; the
/// requests of the readiness checks are forgotten.
pub fn scripted(
    ingress: &Ingress,
    host: &str,
    script: impl Fn(&Received) -> Reply + Send + Sync + 'static,
) -> ScriptedBackend {
    let backend = ScriptedBackend::start(move |r| match r.target() {
        "/ready" => Reply::keep(ok("ready")),
        _ => script(r),
    });
    let name = host.split('.').next().unwrap_or(host);
    ingress.apply(&exposed_at(name, &format!("host: {host}"), &[backend.addr]));
    ingress.until(host, "/ready", 200);
    backend.clear();
    backend
}
