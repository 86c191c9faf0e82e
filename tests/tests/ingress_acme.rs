//! ACME (`tls.mode: acme`) end to end: a real pebble (Let's Encrypt's test ACME
//! server) and pebble-challtestsrv (its DNS, answering every name with 127.0.0.1)
//! on loopback, the agent in dev mode with the ingress on loopback; pebble
//! validates HTTP-01 against the ingress's plain port. Needs no root.

use rune_agent_tests::{
    http::{HttpBackend, http_backend},
    ingress::{Ingress, PATIENCE, exposed},
    pebble::Pebble,
};
use rune_harness::agent::eventually;
use std::{
    io::{Read, Write},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

const HOST: &str = "shop.acme.test";

/// pebble, the agent using it, and a service exposed with `tls: {mode: acme}`.
struct Scene {
    ingress: Ingress,
    /// pebble's issuing root (PEM file).
    root: PathBuf,
    flags: Vec<String>,
    pebble: Pebble,
    _backend: HttpBackend,
}

impl Scene {
    /// pebble issuing certificates valid `validity_seconds`, and the agent with
    /// [`HOST`] exposed.
    fn start(validity_seconds: u64) -> Scene {
        let backend = http_backend("127.0.0.1".parse().unwrap(), 0, "shop", false);
        let mut pebble = Pebble::new(validity_seconds);
        let flags = pebble.flags();
        let ingress = Ingress::start_with(&flags.iter().map(String::as_str).collect::<Vec<_>>());
        let root = pebble.start(ingress.http);
        let expose = format!("host: {HOST}, tls: {{mode: acme}}");
        ingress.apply(&exposed("shop", &expose, &[&backend]));
        Scene {
            ingress,
            root,
            flags,
            pebble,
            _backend: backend,
        }
    }
}

/// The serial number (hex) of the certificate served for `host` on `port`, when
/// the handshake succeeds and the chain verifies against `root`.
fn served_serial(port: u16, host: &str, root: &Path) -> Option<String> {
    serial_of(port, host, Some(root))
}

/// The serial number of the certificate served for `host` on `port`, verified
/// against `root` when given (else whatever it is, expired or not).
fn serial_of(port: u16, host: &str, root: Option<&Path>) -> Option<String> {
    let connect = format!("127.0.0.1:{port}");
    let mut s_client = Command::new("openssl");
    s_client.args(["s_client", "-connect", &connect, "-servername", host]);
    if let Some(root) = root {
        s_client
            .args(["-verify_return_error", "-verify_hostname", host, "-CAfile"])
            .arg(root);
    }
    let hello = s_client
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .unwrap();
    if !hello.status.success() {
        return None;
    }
    let mut x509 = Command::new("openssl")
        .args(["x509", "-noout", "-serial"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    x509.stdin.take().unwrap().write_all(&hello.stdout).unwrap();
    let out = x509.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    Some(text.trim().strip_prefix("serial=")?.to_owned())
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[test]
fn a_certificate_is_issued_served_stored_privately_and_reused_after_a_restart() {
    let mut s = Scene::start(3600);
    let (ingress, root) = (&mut s.ingress, &s.root);

    let r = eventually(PATIENCE, "a certificate by pebble's root served", || {
        let r = ingress.get_tls(HOST, "/x", root, &[]);
        (r.code == 200).then_some(r)
    });
    assert!(r.body.starts_with("shop /x"), "{r:?}");
    let serial = served_serial(ingress.https, HOST, root).expect("a verified handshake");

    // Plain HTTP still redirects; an unknown challenge token is routed like any path.
    assert_eq!(ingress.get(HOST, "/", &[]).code, 308);
    let token = ingress.get(HOST, "/.well-known/acme-challenge/not-a-token", &[]);
    assert_eq!(token.code, 308, "{token:?}");

    // The account and the certificate are private files in a private directory.
    let acme = ingress.state_dir().join("acme");
    assert_eq!(mode(&acme), 0o700);
    assert_eq!(mode(&acme.join("account.json")), 0o600);
    assert_eq!(mode(&acme.join(format!("{HOST}.pem"))), 0o600);

    // Status names the certificate's issuer and expiry; the metric has the expiry.
    let out = ingress.agent.cli(&["status"], None);
    let status = String::from_utf8_lossy(&out.stdout);
    let line = status
        .lines()
        .find(|l| l.contains(&format!("{HOST} acme")))
        .unwrap_or_else(|| panic!("no certificate line in status:\n{status}"));
    assert!(line.contains("issuer CN=Pebble Intermediate"), "{line}");
    assert!(line.contains("expires 20"), "{line}");
    assert!(!line.contains("last error"), "{line}");
    let expiry = ingress.metric(&format!(
        "rune_ingress_certificate_expiry_seconds{{host=\"{HOST}\"}}"
    ));
    let validity = s.pebble.validity_seconds as f64;
    assert!(expiry > now() && expiry <= now() + validity, "{expiry}");

    // A restart serves the stored certificate: no new order.
    let flags: Vec<&str> = s.flags.iter().map(String::as_str).collect();
    ingress.restart(&flags);
    let again = eventually(PATIENCE, "a certificate served after the restart", || {
        served_serial(ingress.https, HOST, root)
    });
    assert_eq!(again, serial);
}

/// One HTTP/1.1 keep-alive connection over TLS (openssl s_client), read aside.
struct Held {
    child: Child,
    reader: std::thread::JoinHandle<String>,
    sent: usize,
}

impl Held {
    fn open(port: u16, host: &str, root: &Path) -> Held {
        let connect = format!("127.0.0.1:{port}");
        let mut child = Command::new("openssl")
            .args([
                "s_client",
                "-quiet",
                "-connect",
                &connect,
                "-servername",
                host,
            ])
            .args(["-verify_return_error", "-CAfile"])
            .arg(root)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stdout.read_to_string(&mut text);
            text
        });
        Held {
            child,
            reader,
            sent: 0,
        }
    }

    fn request(&mut self, close: bool) {
        let connection = if close { "close" } else { "keep-alive" };
        let req = format!("GET /held HTTP/1.1\r\nHost: {HOST}\r\nConnection: {connection}\r\n\r\n");
        self.child
            .stdin
            .as_mut()
            .unwrap()
            .write_all(req.as_bytes())
            .unwrap();
        self.sent += 1;
    }

    /// Sends the last request, then the answers read (bounded by the proxy's
    /// timeouts: it closes the connection after answering).
    fn finish(mut self) -> (usize, String) {
        self.request(true);
        let deadline = Instant::now() + PATIENCE;
        while self.child.try_wait().unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        (self.sent, self.reader.join().unwrap())
    }
}

#[test]
fn a_certificate_is_renewed_before_expiry_without_dropping_connections() {
    // Certificates live 20 s: renewal is due after half of that (the
    // renew-before default, 30 days, is capped at half the lifetime).
    let mut s = Scene::start(20);
    let (ingress, root) = (&s.ingress, &s.root);
    let first = eventually(PATIENCE, "a certificate served", || {
        served_serial(ingress.https, HOST, root)
    });

    // A connection opened on the first certificate keeps being served while the
    // renewed one is swapped in for new handshakes.
    let mut held = Held::open(ingress.https, HOST, root);
    let renewed = eventually(3 * PATIENCE, "a renewed certificate served", || {
        held.request(false);
        std::thread::sleep(Duration::from_millis(200));
        served_serial(ingress.https, HOST, root).filter(|s| *s != first)
    });
    assert_ne!(renewed, first);
    let (sent, answers) = held.finish();
    assert_eq!(
        answers.matches("HTTP/1.1 200").count(),
        sent,
        "every request on the held connection answered: {answers}"
    );
    let r = ingress.get_tls(HOST, "/after", root, &[]);
    assert!(r.code == 200 && r.body.starts_with("shop /after"), "{r:?}");

    // Without its ACME server the next renewal fails: status says why, and the
    // certificate in hand stays served.
    s.pebble.stop();
    let last = serial_of(s.ingress.https, HOST, None).expect("a handshake");
    let line = eventually(3 * PATIENCE, "a failed renewal in status", || {
        let out = s.ingress.agent.cli(&["status"], None);
        let status = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = status
            .lines()
            .find(|l| l.contains(&format!("{HOST} acme")))?;
        line.contains("last error").then(|| line.to_owned())
    });
    let listed = line
        .split("serial ")
        .nth(1)
        .and_then(|r| r.split(',').next());
    assert_eq!(
        listed.map(|l| l.replace(':', "").to_lowercase()),
        Some(last.to_lowercase()),
        "{line}"
    );
    assert_eq!(serial_of(s.ingress.https, HOST, None), Some(last));

    // A new pebble (a new root, and no memory of the agent's account): the agent
    // registers anew and renews from it.
    let new_root = s.pebble.start(s.ingress.http);
    eventually(
        3 * PATIENCE,
        "a certificate by the new pebble's root",
        || served_serial(s.ingress.https, HOST, &new_root),
    );
}
