//! The processes `bench ingress` compares the ingress proxy with: Debian's nginx
//! (also the backend) and haproxy, each in the foreground with its own config on
//! loopback, and the self-signed certificate all three serve.

use anyhow::{Context as _, Result, bail};
use std::{
    fs::File,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A child process of the bench, killed and reaped on drop.
pub(super) struct Reaped(pub(super) Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A self-signed certificate and key (openssl, EC P-256) for every proxy, with
/// `cn` as its name.
pub(super) fn self_signed(cert: &Path, key: &Path, cn: &str) -> Result<()> {
    let status = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ])
        .args(["-nodes", "-days", "2", "-subj", &format!("/CN={cn}")])
        .arg("-keyout")
        .arg(key)
        .arg("-out")
        .arg(cert)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("running openssl")?;
    if !status.success() {
        bail!("openssl req failed: {status}");
    }
    Ok(())
}

/// nginx in the foreground as one process, config and logs under `dir`, with
/// `server` inside `http`.
pub(super) fn nginx(dir: &Path, server: &str) -> Result<Reaped> {
    let mut cmd = Command::new("nginx");
    rune_harness::nginx::configure(&mut cmd, dir, server)?;
    let child = cmd
        .spawn()
        .context("starting nginx (cargo xtask setup installs nginx-light)")?;
    Ok(Reaped(child))
}

/// The TLS 1.3 cipher suites of nginx and haproxy, in the server's order that
/// decides: the ingress's own (docs/ingress.md), so every proxy negotiates
/// TLS 1.3 with TLS_AES_128_GCM_SHA256 with wrk, which lists AES-256 first
/// (Debian's nginx 1.22 also needs TLS 1.3 turned on: its default is up to 1.2).
const SUITES: &str = "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256";

/// The addresses one reference proxy listens on and proxies to.
pub(super) struct ProxyPorts {
    /// Plain HTTP, on 127.0.0.1.
    pub(super) http: u16,
    /// HTTPS, on 127.0.0.1.
    pub(super) https: u16,
    /// The backend, on 127.0.0.2.
    pub(super) backend: u16,
}

/// nginx as a reverse proxy (one worker: [`super::WORKERS`], an upstream keepalive
/// pool), plain and TLS ([`SUITES`] in its order).
pub(super) fn nginx_proxy(
    dir: &Path,
    ports: &ProxyPorts,
    cert: &Path,
    key: &Path,
) -> Result<Reaped> {
    let ProxyPorts {
        http,
        https,
        backend,
    } = ports;
    nginx(
        dir,
        &format!(
            "upstream backend {{ server 127.0.0.2:{backend}; keepalive 64; }}\n\
             server {{\n  listen 127.0.0.1:{http};\n  listen 127.0.0.1:{https} ssl;\n\
             ssl_certificate {};\n  ssl_certificate_key {};\n  keepalive_requests 100000;\n\
             ssl_protocols TLSv1.2 TLSv1.3;\n  ssl_prefer_server_ciphers on;\n  ssl_conf_command Ciphersuites {SUITES};\n\
             location / {{ proxy_pass http://backend; proxy_http_version 1.1;\n\
             proxy_set_header Connection \"\"; proxy_set_header Host $host;\n\
             proxy_set_header X-Forwarded-For $remote_addr; }}\n}}",
            cert.display(),
            key.display()
        ),
    )
}

/// haproxy in HTTP mode as a reverse proxy ([`super::WORKERS`] threads, connection reuse to the
/// backend, `X-Forwarded-For` set), plain and TLS ([`SUITES`], its own order by
/// default), in the foreground (`-db`).
pub(super) fn haproxy(dir: &Path, ports: &ProxyPorts, cert: &Path, key: &Path) -> Result<Reaped> {
    std::fs::create_dir_all(dir)?;
    let ProxyPorts {
        http,
        https,
        backend,
    } = ports;
    // haproxy reads the certificate and its key from one file.
    let pem = dir.join("cert-and-key.pem");
    std::fs::write(
        &pem,
        std::fs::read_to_string(cert)? + &std::fs::read_to_string(key)?,
    )?;
    let workers = super::WORKERS;
    let config = format!(
        "global\n  nbthread {workers}\n  maxconn 8192\n  ssl-default-bind-ciphersuites {SUITES}\n\
         defaults\n  mode http\n  option forwardfor\n  http-reuse always\n\
         timeout connect 5s\n  timeout client 30s\n  timeout server 30s\n\
         frontend bench\n  bind 127.0.0.1:{http}\n  bind 127.0.0.1:{https} ssl crt {}\n\
         default_backend backend\n\
         backend backend\n  server b1 127.0.0.2:{backend}\n",
        pem.display()
    );
    let conf = dir.join("haproxy.cfg");
    std::fs::write(&conf, config)?;
    let child = Command::new("haproxy")
        .arg("-db")
        .arg("-f")
        .arg(&conf)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(dir.join("stderr.log"))?)
        .spawn()
        .context("starting haproxy (cargo xtask setup installs it)")?;
    Ok(Reaped(child))
}

/// Waits (up to 20 s) until `url` answers 200 with `Host: host`.
pub(super) fn wait_answering(url: &str, host: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = Command::new("curl")
            .args([
                "-sk",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "2",
            ])
            .args(["-H", &format!("Host: {host}"), url])
            .output()?;
        if out.stdout == b"200" {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{url} does not answer 200: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The TLS 1.3 cipher suite `openssl s_client` (AES-256 first in its list, as
/// wrk's) negotiates with the proxy on 127.0.0.1:`port`, so every proxy is known
/// to run the same one.
pub(super) fn negotiated_suite(port: u16) -> Result<String> {
    let out = Command::new("timeout")
        .args(["5", "openssl", "s_client", "-brief", "-tls1_3"])
        .args(["-connect", &format!("127.0.0.1:{port}")])
        .args(["-servername", "bench.test"])
        .stdin(Stdio::null())
        .output()
        .context("running openssl s_client")?;
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.trim().strip_prefix("Ciphersuite:"))
        .map(|s| s.trim().to_owned())
        .with_context(|| format!("no cipher suite from 127.0.0.1:{port}: {text}"))
}
