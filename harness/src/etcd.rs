//! A real etcd for tests: [`Etcd`] runs Debian's `/usr/bin/etcd` (installed by
//! `cargo xtask setup`) on free loopback ports with its own data directory,
//! optionally with TLS and client-certificate authentication ([`Pki`], made with
//! the `openssl` CLI); it can be stopped, killed and started again on the same
//! ports and data (an outage), and is killed, its directory removed, on drop.
//! [`Gate`] is a loopback TCP relay a test can cut and restore: a network outage
//! between one client and etcd while other clients still reach it; it can also
//! listen on the loopback of a test's network namespace ([`Gate::in_netns`]), which
//! is how the agents of a [`crate::cluster::Cluster`] reach etcd.
//!
//! Nothing here listens or connects anywhere but 127.0.0.1 (of the host or of a
//! test's namespace).

use std::{
    fs,
    io::{self, Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use crate::{
    agent::{die_with_parent, free_port},
    netns::NetNs,
};

/// Debian's etcd server.
pub const ETCD: &str = "/usr/bin/etcd";
/// Debian's etcd command-line client.
pub const ETCDCTL: &str = "/usr/bin/etcdctl";

/// How long etcd may take to answer after a start.
const START_PATIENCE: Duration = Duration::from_secs(30);

/// A new, empty, private (0700) directory under the temporary directory
/// (`rune-<tag>-<pid>-<n>`), for an etcd's data, a [`Pki`] or a cluster's files.
pub(crate) fn unique_dir(tag: &str) -> PathBuf {
    use std::os::unix::fs::DirBuilderExt as _;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("rune-{tag}-{}-{n}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(&dir)
        .unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

/// A CA and the certificates signed by it, made with the `openssl` CLI: a server
/// certificate for 127.0.0.1 and `localhost`, and a client certificate.
pub struct Pki {
    /// The directory it made (removed on drop), or `None` for files made elsewhere.
    dir: Option<PathBuf>,
    /// The CA's certificate (PEM).
    pub ca: PathBuf,
    /// The server's certificate (PEM), for 127.0.0.1 and localhost.
    pub server_cert: PathBuf,
    /// The server's key (PEM).
    pub server_key: PathBuf,
    /// A client certificate (PEM), `CN=rune-client`.
    pub client_cert: PathBuf,
    /// The client certificate's key (PEM).
    pub client_key: PathBuf,
}

impl Pki {
    /// Certificates made elsewhere (e.g. by `rune-agent certs`), left in place on
    /// drop: the CA, etcd's server certificate and key, and the client certificate
    /// and key `etcdctl` uses.
    pub fn from_files(
        ca: PathBuf,
        server_cert: PathBuf,
        server_key: PathBuf,
        client_cert: PathBuf,
        client_key: PathBuf,
    ) -> Pki {
        Pki {
            dir: None,
            ca,
            server_cert,
            server_key,
            client_cert,
            client_key,
        }
    }

    /// A new CA named `name` and its server and client certificates (P-256 keys,
    /// valid for two days).
    pub fn new(name: &str) -> Pki {
        let dir = unique_dir("pki");
        let ca = dir.join("ca.pem");
        let ca_key = dir.join("ca.key");
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            path_str(&ca_key),
            "-out",
            path_str(&ca),
        ]);
        let leaf = |stem: &str, subject: &str, ext: &str| {
            let key = dir.join(format!("{stem}.key"));
            let csr = dir.join(format!("{stem}.csr"));
            let cert = dir.join(format!("{stem}.pem"));
            let extfile = dir.join(format!("{stem}.ext"));
            fs::write(&extfile, ext).expect("writing an extensions file");
            openssl(&[
                "req",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-subj",
                subject,
                "-keyout",
                path_str(&key),
                "-out",
                path_str(&csr),
            ]);
            openssl(&[
                "x509",
                "-req",
                "-in",
                path_str(&csr),
                "-CA",
                path_str(&ca),
                "-CAkey",
                path_str(&ca_key),
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                path_str(&extfile),
                "-out",
                path_str(&cert),
            ]);
            (cert, key)
        };
        let (server_cert, server_key) = leaf(
            "server",
            "/CN=127.0.0.1",
            "basicConstraints=critical,CA:FALSE\n\
             keyUsage=critical,digitalSignature,keyEncipherment\n\
             extendedKeyUsage=serverAuth\n\
             subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        );
        let (client_cert, client_key) = leaf(
            "client",
            "/CN=rune-client",
            "basicConstraints=critical,CA:FALSE\n\
             keyUsage=critical,digitalSignature,keyEncipherment\n\
             extendedKeyUsage=clientAuth\n",
        );
        Pki {
            dir: Some(dir),
            ca,
            server_cert,
            server_key,
            client_cert,
            client_key,
        }
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = fs::remove_dir_all(dir);
        }
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("temporary paths are UTF-8")
}

fn openssl(args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running openssl (apt install openssl; `cargo xtask setup` does)");
    assert!(
        out.status.success(),
        "openssl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// How to start an [`Etcd`]: plain http by default.
#[derive(Default)]
pub struct EtcdBuilder<'a> {
    tls: Option<&'a Pki>,
    client_cert_auth: bool,
    max_txn_ops: Option<usize>,
    max_request_bytes: Option<usize>,
}

impl<'a> EtcdBuilder<'a> {
    /// Serves clients over TLS with `pki`'s server certificate.
    pub fn tls(mut self, pki: &'a Pki) -> Self {
        self.tls = Some(pki);
        self
    }

    /// Requires a client certificate signed by the TLS [`Pki`]'s CA
    /// (`--client-cert-auth`).
    pub fn client_cert_auth(mut self) -> Self {
        self.client_cert_auth = true;
        self
    }

    /// `--max-txn-ops`.
    pub fn max_txn_ops(mut self, n: usize) -> Self {
        self.max_txn_ops = Some(n);
        self
    }

    /// `--max-request-bytes`.
    pub fn max_request_bytes(mut self, n: usize) -> Self {
        self.max_request_bytes = Some(n);
        self
    }

    /// Starts etcd and waits until it answers. Panics (with etcd's log) when it
    /// does not.
    pub fn start(self) -> Etcd {
        assert!(
            Path::new(ETCD).exists() && Path::new(ETCDCTL).exists(),
            "{ETCD} or {ETCDCTL} is missing: apt install etcd-server etcd-client (`cargo xtask setup` does)"
        );
        let dir = unique_dir("etcd");
        let (client_port, peer_port) = (free_port(), free_port());
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client_url = format!("{scheme}://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let mut args = vec![
            "--name".to_owned(),
            "rune-test".to_owned(),
            "--data-dir".to_owned(),
            path_str(&dir.join("data")).to_owned(),
            "--listen-client-urls".to_owned(),
            client_url.clone(),
            "--advertise-client-urls".to_owned(),
            client_url.clone(),
            "--listen-peer-urls".to_owned(),
            peer_url.clone(),
            "--initial-advertise-peer-urls".to_owned(),
            peer_url.clone(),
            "--initial-cluster".to_owned(),
            format!("rune-test={peer_url}"),
            "--initial-cluster-state".to_owned(),
            "new".to_owned(),
            "--logger".to_owned(),
            "zap".to_owned(),
            "--log-level".to_owned(),
            "warn".to_owned(),
        ];
        let mut ctl_tls = Vec::new();
        if let Some(pki) = self.tls {
            for (flag, path) in [
                ("--cert-file", &pki.server_cert),
                ("--key-file", &pki.server_key),
                ("--trusted-ca-file", &pki.ca),
            ] {
                args.push(flag.to_owned());
                args.push(path_str(path).to_owned());
            }
            ctl_tls = vec![
                format!("--cacert={}", path_str(&pki.ca)),
                format!("--cert={}", path_str(&pki.client_cert)),
                format!("--key={}", path_str(&pki.client_key)),
            ];
        }
        if self.client_cert_auth {
            args.push("--client-cert-auth".to_owned());
        }
        if let Some(n) = self.max_txn_ops {
            args.push(format!("--max-txn-ops={n}"));
        }
        if let Some(n) = self.max_request_bytes {
            args.push(format!("--max-request-bytes={n}"));
        }
        let mut etcd = Etcd {
            child: None,
            log: dir.join("etcd.log"),
            dir,
            endpoint: client_url,
            args,
            ctl_tls,
        };
        etcd.start_again();
        etcd
    }
}

/// A running (or stopped) etcd process; killed, and its directory removed, on drop.
pub struct Etcd {
    child: Option<Child>,
    dir: PathBuf,
    log: PathBuf,
    endpoint: String,
    args: Vec<String>,
    ctl_tls: Vec<String>,
}

impl Etcd {
    /// An etcd over plain http on loopback, with default limits.
    pub fn start() -> Etcd {
        Etcd::builder().start()
    }

    /// How to start one with TLS or other limits.
    pub fn builder<'a>() -> EtcdBuilder<'a> {
        EtcdBuilder::default()
    }

    /// The client URL (`http://127.0.0.1:PORT` or `https://...`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The client address.
    pub fn addr(&self) -> SocketAddr {
        let port = self
            .endpoint
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .expect("the endpoint has a port");
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// What etcd logged (warnings and errors).
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Starts the process again on the same ports and data (after
    /// [`Etcd::stop`] or [`Etcd::kill`]) and waits until it answers.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "etcd is already running");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("opening etcd's log");
        let mut cmd = Command::new(ETCD);
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("etcd's log"))
            .stderr(log);
        die_with_parent(&mut cmd);
        self.child = Some(cmd.spawn().expect("starting etcd"));
        let deadline = Instant::now() + START_PATIENCE;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                panic!("etcd exited ({status}) at start:\n{}", self.log());
            }
            if self.ctl(&["endpoint", "health"]).status.success() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not answer within {START_PATIENCE:?}:\n{}",
                self.log()
            );
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops etcd gracefully (SIGTERM; SIGKILL after 10 s) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: a signal to our own child, whose pid we hold.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills etcd (SIGKILL) and waits for it: a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Removes etcd's data while it is stopped: the next start is a new, empty
    /// cluster whose revisions start again from 1.
    pub fn wipe(&mut self) {
        assert!(self.child.is_none(), "stop etcd before wiping its data");
        let data = self.dir.join("data");
        fs::remove_dir_all(&data).unwrap_or_else(|e| panic!("removing {}: {e}", data.display()));
    }

    /// Runs `etcdctl` against this etcd (with the client certificate when it
    /// serves TLS).
    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(ETCDCTL)
            .arg(format!("--endpoints={}", self.endpoint))
            .arg("--command-timeout=5s")
            .args(&self.ctl_tls)
            .args(args)
            .env("ETCDCTL_API", "3")
            .stdin(Stdio::null())
            .output()
            .expect("running etcdctl")
    }

    /// [`Etcd::ctl`], which must succeed; returns its standard output.
    pub fn ctl_ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert!(
            out.status.success(),
            "etcdctl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// etcd's current revision (`etcdctl endpoint status`).
    pub fn revision(&self) -> u64 {
        let out = self.ctl_ok(&["endpoint", "status", "-w", "json"]);
        let at = out
            .find("\"revision\":")
            .unwrap_or_else(|| panic!("no revision in {out}"));
        out[at + 11..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap_or_else(|e| panic!("revision in {out}: {e}"))
    }

    /// Compacts etcd's history up to `revision`: watches from before it fail.
    pub fn compact(&self, revision: u64) {
        self.ctl_ok(&["compact", &revision.to_string(), "--physical"]);
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A TCP relay on 127.0.0.1 to one target address, which a test can cut (every
/// relayed connection is closed and new ones are dropped at once) and restore.
pub struct Gate {
    addr: SocketAddr,
    shared: Arc<GateShared>,
    accept: Option<thread::JoinHandle<()>>,
}

struct GateShared {
    open: AtomicBool,
    stop: AtomicBool,
    conns: Mutex<Vec<TcpStream>>,
    /// Bytes relayed: [towards the target, back from it].
    bytes: [AtomicU64; 2],
}

impl Gate {
    /// A relay on 127.0.0.1 to `target`, open.
    pub fn new(target: SocketAddr) -> Gate {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binding the gate");
        Gate::from_listener(listener, target)
    }

    /// A relay listening on 127.0.0.1 inside `ns` to `target` in this process's
    /// namespace: a node namespace reaches an etcd on the host's loopback (the
    /// listening socket lives in `ns`, the upstream connections here).
    pub fn in_netns(ns: &NetNs, target: SocketAddr) -> anyhow::Result<Gate> {
        let listener = ns.run(|| TcpListener::bind("127.0.0.1:0"))??;
        Ok(Gate::from_listener(listener, target))
    }

    /// A relay accepting on `listener` (polled, so that a drop stops it without a
    /// connection from the listener's namespace).
    fn from_listener(listener: TcpListener, target: SocketAddr) -> Gate {
        let addr = listener.local_addr().expect("the gate's address");
        listener
            .set_nonblocking(true)
            .expect("a nonblocking gate listener");
        let shared = Arc::new(GateShared {
            open: AtomicBool::new(true),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            bytes: [AtomicU64::new(0), AtomicU64::new(0)],
        });
        let s = shared.clone();
        let accept = thread::spawn(move || {
            while !s.stop.load(Ordering::SeqCst) {
                let client = match listener.accept() {
                    Ok((client, _)) => client,
                    // Nothing to accept, or an error (e.g. out of descriptors):
                    // look again a little later, never spin.
                    Err(_) => {
                        thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                };
                if !s.open.load(Ordering::SeqCst) || client.set_nonblocking(false).is_err() {
                    drop(client);
                    continue;
                }
                let Ok(upstream) = TcpStream::connect(target) else {
                    continue;
                };
                relay(&s, client, upstream);
            }
        });
        Gate {
            addr,
            shared,
            accept: Some(accept),
        }
    }

    /// The relay's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://` and the relay's address.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Closes every relayed connection and drops new ones until [`Gate::restore`].
    pub fn cut(&self) {
        self.shared.open.store(false, Ordering::SeqCst);
        let conns = std::mem::take(&mut *lock(&self.shared.conns));
        for c in conns {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    /// Bytes relayed so far: (towards the target, back from it).
    pub fn bytes(&self) -> (u64, u64) {
        let [up, down] = &self.shared.bytes;
        (up.load(Ordering::Relaxed), down.load(Ordering::Relaxed))
    }

    /// Relays new connections again.
    pub fn restore(&self) {
        self.shared.open.store(true, Ordering::SeqCst);
    }
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("addr", &self.addr)
            .field("open", &self.shared.open.load(Ordering::SeqCst))
            .finish()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.cut();
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Copies both ways between `client` and `upstream` on two threads, registered
/// for [`Gate::cut`].
fn relay(shared: &Arc<GateShared>, client: TcpStream, upstream: TcpStream) {
    // Bytes go on as they come: with Nagle's algorithm each request/answer through
    // the relay could wait for a delayed ACK (tens of ms) that a direct connection
    // never waits for.
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let pairs = [
        (client.try_clone(), upstream.try_clone()),
        (upstream.try_clone(), client.try_clone()),
    ];
    {
        let mut conns = lock(&shared.conns);
        conns.push(client);
        conns.push(upstream);
    }
    for (direction, pair) in pairs.into_iter().enumerate() {
        let (Ok(mut from), Ok(mut to)) = pair else {
            continue;
        };
        let shared = shared.clone();
        thread::spawn(move || {
            let _ = copy(&mut from, &mut to, &shared.bytes[direction]);
            let _ = from.shutdown(Shutdown::Both);
            let _ = to.shutdown(Shutdown::Both);
        });
    }
}

fn copy(from: &mut TcpStream, to: &mut TcpStream, bytes: &AtomicU64) -> io::Result<()> {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        to.write_all(&buf[..n])?;
        bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
}
