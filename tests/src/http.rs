//! Helpers of the ingress tests: HTTP/1.1 backends on loopback that say who they are,
//! test certificate authorities (rcgen), and `curl` as the client.

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use std::{
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

/// A backend on loopback; stops (its port then refuses connections) when dropped
/// or [`HttpBackend::stop`]ped.
pub struct HttpBackend {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl HttpBackend {
    /// Closes the listener and every connection.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        // Let the accept loop see the flag and drop the listener.
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Drop for HttpBackend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Starts a backend on `ip:port` (0: any free port) that answers every request with
/// `NAME PATH xff=X-Forwarded-For proto=X-Forwarded-Proto host=Host forwarded=Forwarded`, or never
/// answers (`hang`); a request with `Upgrade: echo` is switched to echoing bytes.
pub fn http_backend(ip: IpAddr, port: u16, name: &'static str, hang: bool) -> HttpBackend {
    let listener = TcpListener::bind((ip, port)).expect("bind a test backend");
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    std::thread::spawn(move || {
        while !flag.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((stream, _)) => {
                    let flag = flag.clone();
                    std::thread::spawn(move || serve(stream, name, hang, &flag));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    HttpBackend { addr, stop }
}

/// Answers requests on one connection until it closes or the backend stops.
fn serve(mut stream: TcpStream, name: &str, hang: bool, stop: &AtomicBool) {
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !stop.load(Ordering::SeqCst) {
        match stream.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => continue,
            Err(_) => return,
        }
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end + 4);
        if hang {
            continue;
        }
        let header = |h: &str| {
            head.lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case(h).then(|| v.trim().to_owned())
                })
                .unwrap_or_default()
        };
        if header("upgrade") == "echo" {
            // Switch to a protocol that echoes bytes (WebSocket takes the same path).
            let switch =
                "HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n";
            if stream.write_all(switch.as_bytes()).is_err() || stream.write_all(&buf).is_err() {
                return;
            }
            echo(stream, stop);
            return;
        }
        let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
        let body = format!(
            "{name} {path} xff={} proto={} host={} forwarded={}\n",
            header("x-forwarded-for"),
            header("x-forwarded-proto"),
            header("host"),
            header("forwarded")
        );
        let response = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: text/plain\r\n\r\n{body}",
            body.len()
        );
        if stream.write_all(response.as_bytes()).is_err() {
            return;
        }
    }
}

/// Echoes bytes until the connection closes or the backend stops.
fn echo(mut stream: TcpStream, stop: &AtomicBool) {
    let mut chunk = [0u8; 4096];
    while !stop.load(Ordering::SeqCst) {
        match stream.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => {
                if stream.write_all(&chunk[..n]).is_err() {
                    return;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
    }
}

/// What `curl` got: the status (0 when no response), the HTTP version, the body,
/// and curl's exit code.
#[derive(Debug)]
pub struct Curled {
    /// The status code, 0 without a response.
    pub code: u16,
    /// `1.1` or `2`.
    pub version: String,
    /// The response body.
    pub body: String,
    /// curl's exit code (0: a response was read).
    pub exit: i32,
    /// curl's error message.
    pub stderr: String,
}

/// Runs `curl -sS ARGS` (10 s at most) and reads status, version and body.
pub fn curl(args: &[&str]) -> Curled {
    let out = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "-w",
            "\n%{http_code} %{http_version}",
        ])
        .args(args)
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, tail) = text.rsplit_once('\n').unwrap_or(("", &text));
    let mut tail = tail.split_whitespace();
    Curled {
        code: tail.next().and_then(|c| c.parse().ok()).unwrap_or(0),
        version: tail.next().unwrap_or("").to_owned(),
        body: body.to_owned(),
        exit: out.status.code().unwrap_or(-1),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A certificate authority for one test.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    /// Its certificate (PEM): what clients trust.
    pub pem: String,
}

impl TestCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> TestCa {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        TestCa {
            issuer: Issuer::new(params, key),
            pem: cert.pem(),
        }
    }

    /// A certificate for `host` and its key (PEM).
    pub fn leaf(&self, host: &str) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(vec![host.to_owned()]).unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// A `kind: Secret` document (JSON, which `apply` reads as YAML) named `NAME` (in
/// `default`) or `NAMESPACE/NAME`, with `tls.crt` and `tls.key`.
pub fn tls_secret(name: &str, cert: &str, key: &str) -> String {
    let (namespace, name) = name.split_once('/').unwrap_or(("default", name));
    serde_json::json!({
        "apiVersion": "rune/v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "data": {"tls.crt": cert, "tls.key": key},
    })
    .to_string()
}

/// A `kind: Secret` document named like [`tls_secret`]'s with one key, `ca.crt`.
pub fn ca_secret(name: &str, ca_pem: &str) -> String {
    let (namespace, name) = name.split_once('/').unwrap_or(("default", name));
    serde_json::json!({
        "apiVersion": "rune/v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "data": {"ca.crt": ca_pem},
    })
    .to_string()
}

/// Writes `text` to `dir/name` and returns the path (certificates for curl).
pub fn write_file(dir: &std::path::Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write a test file");
    path
}
