//! The backends' echo servers (TCP lines and UDP datagrams, answered with the
//! backend's name), their counters, and the client connect the tests use.

use super::{BackendCounts, CLIENT_TIMEOUT, POLL_INTERVAL, STOP_PATIENCE, TopologyConfig};
use crate::netns::NetNs;
use anyhow::Context as _;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::{
    io::{self, BufRead as _, BufReader, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

/// Counters of one backend's servers.
#[derive(Debug, Default)]
struct Stats {
    tcp_connections: AtomicU64,
    tcp_lines: AtomicU64,
    udp_datagrams: AtomicU64,
}

/// Every backend's server threads; stopped and joined (bounded) on drop. Also
/// the pods' servers of a [`crate::cluster::Cluster`].
#[derive(Debug, Default)]
pub(crate) struct Servers {
    stop: Arc<AtomicBool>,
    /// Connection threads still running.
    active: Arc<AtomicUsize>,
    threads: Vec<JoinHandle<()>>,
    stats: Vec<(String, Arc<Stats>)>,
}

impl Servers {
    /// What each backend served so far, in the order they were started.
    pub(crate) fn counts(&self) -> Vec<BackendCounts> {
        self.stats
            .iter()
            .map(|(name, s)| BackendCounts {
                name: name.clone(),
                tcp_connections: s.tcp_connections.load(Ordering::SeqCst),
                tcp_lines: s.tcp_lines.load(Ordering::SeqCst),
                udp_datagrams: s.udp_datagrams.load(Ordering::SeqCst),
            })
            .collect()
    }

    /// Starts the servers of backend `backend_name` in `ns`: TCP and UDP, IPv4 and
    /// IPv6, on the wildcard addresses of its namespace, as `config` says.
    pub(crate) fn start(
        &mut self,
        backend_name: &str,
        ns: &NetNs,
        config: &TopologyConfig,
    ) -> anyhow::Result<()> {
        let (tcp_port, udp_port) = (config.tcp_port, config.udp_port);
        let close_after_reply = config.tcp_close_after_reply;
        let stats = Arc::new(Stats::default());
        self.stats.push((backend_name.to_owned(), stats.clone()));
        let name: Arc<str> = backend_name.into();
        let wildcards = [
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        ];
        // The main port answers as the backend, extra ones as `<backend>:<port>`.
        let tcp_servers = tcp_port.map(|p| (p, name.clone())).into_iter().chain(
            config
                .extra_tcp_ports
                .iter()
                .map(|p| (*p, Arc::from(format!("{backend_name}:{p}")))),
        );
        for (port, name) in tcp_servers {
            for ip in wildcards {
                let addr = SocketAddr::new(ip, port);
                let listener = ns
                    .run(|| tcp_listener(addr))?
                    .with_context(|| format!("{backend_name}: TCP listen on {addr}"))?;
                let (name, stats) = (name.clone(), stats.clone());
                let (stop, active) = (self.stop.clone(), self.active.clone());
                let serve = move || {
                    serve_tcp(&listener, &name, &stats, &stop, &active, close_after_reply);
                };
                self.threads.push(
                    thread::Builder::new()
                        .name(format!("{backend_name}-tcp"))
                        .spawn(serve)?,
                );
            }
        }
        if let Some(port) = udp_port {
            for ip in wildcards {
                let addr = SocketAddr::new(ip, port);
                let socket = ns
                    .run(|| udp_socket(addr))?
                    .with_context(|| format!("{backend_name}: UDP bind on {addr}"))?;
                let (name, stats, stop) = (name.clone(), stats.clone(), self.stop.clone());
                self.threads.push(
                    thread::Builder::new()
                        .name(format!("{name}-udp"))
                        .spawn(move || serve_udp(&socket, &name, &stats, &stop))?,
                );
            }
        }
        Ok(())
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Every thread looks at the flag at least every POLL_INTERVAL.
        let deadline = Instant::now() + STOP_PATIENCE;
        for t in self.threads.drain(..) {
            while !t.is_finished() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(5));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                eprintln!(
                    "warning: a topology server thread did not stop within {STOP_PATIENCE:?}"
                );
            }
        }
        while self.active.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        let left = self.active.load(Ordering::SeqCst);
        if left > 0 {
            eprintln!(
                "warning: {left} topology connection threads did not stop within {STOP_PATIENCE:?}"
            );
        }
    }
}

/// A listener on `addr` (IPv6 wildcard: IPv6 only, so IPv4 gets its own).
fn tcp_listener(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_reuse_address(true)?;
    socket.bind(&SockAddr::from(addr))?;
    socket.listen(4096)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// A UDP socket on `addr` (IPv6 wildcard: IPv6 only), receiving with a short timeout.
fn udp_socket(addr: SocketAddr) -> io::Result<UdpSocket> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.bind(&SockAddr::from(addr))?;
    socket.set_read_timeout(Some(POLL_INTERVAL))?;
    Ok(socket.into())
}

/// A client connection from `src` (port chosen by the kernel) to `addr`.
/// Connects to `addr` from `src` (a port 0 lets the kernel choose; a fixed port is
/// bound with SO_REUSEADDR, so it can be bound again while its last connection is
/// in TIME_WAIT).
pub(crate) fn connect(src: Option<SocketAddr>, addr: SocketAddr) -> io::Result<TcpStream> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if let Some(src) = src {
        if src.port() != 0 {
            socket.set_reuse_address(true)?;
        }
        socket.bind(&SockAddr::from(src))?;
    }
    socket.connect_timeout(&SockAddr::from(addr), CLIENT_TIMEOUT)?;
    Ok(socket.into())
}

/// Waits up to [`POLL_INTERVAL`] for `fd` to be readable.
fn readable(fd: i32) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, and the descriptor stays open during the call.
    let n = unsafe { libc::poll(&mut pfd, 1, POLL_INTERVAL.as_millis() as i32) };
    n > 0
}

fn serve_tcp(
    listener: &TcpListener,
    name: &Arc<str>,
    stats: &Arc<Stats>,
    stop: &Arc<AtomicBool>,
    active: &Arc<AtomicUsize>,
    close_after_reply: bool,
) {
    while !stop.load(Ordering::SeqCst) {
        if !readable(listener.as_raw_fd()) {
            continue;
        }
        // Nonblocking: a connection gone before accept is just skipped.
        let Ok((stream, _)) = listener.accept() else {
            continue;
        };
        stats.tcp_connections.fetch_add(1, Ordering::SeqCst);
        active.fetch_add(1, Ordering::SeqCst);
        let (name, stats, stop, active_in) =
            (name.clone(), stats.clone(), stop.clone(), active.clone());
        let spawned = thread::Builder::new()
            .name(format!("{name}-conn"))
            .spawn(move || {
                serve_connection(stream, &name, &stats, &stop, close_after_reply);
                active_in.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            // The stream went with the closure: the connection is closed.
            active.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Answers each line with `"<name> <line>\n"` until the client closes or `stop`;
/// with `close_after_reply`, closes after the first answer instead.
fn serve_connection(
    stream: TcpStream,
    name: &str,
    stats: &Stats,
    stop: &AtomicBool,
    close_after_reply: bool,
) {
    let setup = (|| -> io::Result<(BufReader<TcpStream>, TcpStream)> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(POLL_INTERVAL))?;
        stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
        stream.set_nodelay(true)?;
        Ok((BufReader::new(stream.try_clone()?), stream))
    })();
    let Ok((mut reader, mut writer)) = setup else {
        return;
    };
    let mut line = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        // A timeout keeps what was read so far in `line`; the next call goes on.
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) if line.ends_with(b"\n") => {
                line.pop();
                let mut reply = Vec::with_capacity(name.len() + line.len() + 2);
                reply.extend_from_slice(name.as_bytes());
                reply.push(b' ');
                reply.extend_from_slice(&line);
                reply.push(b'\n');
                if writer.write_all(&reply).is_err() {
                    return;
                }
                stats.tcp_lines.fetch_add(1, Ordering::SeqCst);
                if close_after_reply {
                    return; // the close sends a FIN: the server closes first
                }
                line.clear();
            }
            Ok(_) => return, // EOF in the middle of a line
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

fn serve_udp(socket: &UdpSocket, name: &str, stats: &Stats, stop: &AtomicBool) {
    let mut buf = vec![0u8; 65536];
    let mut reply = Vec::with_capacity(65536 + name.len() + 1);
    while !stop.load(Ordering::SeqCst) {
        let Ok((n, from)) = socket.recv_from(&mut buf) else {
            continue; // timeout: look at the flag again
        };
        reply.clear();
        reply.extend_from_slice(name.as_bytes());
        reply.push(b' ');
        reply.extend_from_slice(&buf[..n]);
        if socket.send_to(&reply, from).is_ok() {
            stats.udp_datagrams.fetch_add(1, Ordering::SeqCst);
        }
    }
}
