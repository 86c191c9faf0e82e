//! The ingress proxy against Debian's nginx as a reverse proxy to the same backend,
//! on loopback: requests/s and p99 latency with kept-alive connections, a new
//! connection per request, and TLS with kept-alive connections (`wrk --latency`).
//! Runs alternate (nginx, ingress, nginx, …) and medians are compared as ratios
//! measured in the same run (docs/performance.md). haproxy is not installed on the
//! machines this runs on, so it has no row.
//!
//! Every load loop is bounded in time (`wrk -d`, and a kill after a deadline); all
//! traffic stays on 127.0.0.0/8.

use super::common::{apply, free_port, median, wait_ready};
use anyhow::{Context as _, Result, bail};
use rune_harness::agent::Agent;
use std::{
    fmt::Write as _,
    fs::File,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// Interleaved rounds per scenario (one nginx run and one ingress run each).
const ROUNDS: usize = 5;
/// Seconds of one wrk run.
const RUN_SECS: u64 = 3;
/// Connections wrk keeps open.
const CONNECTIONS: usize = 32;
/// The host of the plain route (wrk sends it as `Host`).
const HOST: &str = "bench.test";
/// The host of the TLS route (a route with TLS redirects plain HTTP, and a route
/// without it answers TLS requests with 421, hence two).
const TLS_HOST: &str = "secure.test";

/// A child process of the bench (nginx), killed and reaped on drop.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The three client scenarios.
#[derive(Clone, Copy)]
enum Scenario {
    KeepAlive,
    NewConnection,
    TlsKeepAlive,
}

impl Scenario {
    fn label(self) -> &'static str {
        match self {
            Scenario::KeepAlive => "HTTP keep-alive",
            Scenario::NewConnection => "HTTP, new connection per request",
            Scenario::TlsKeepAlive => "HTTPS keep-alive",
        }
    }
}

/// One wrk run's figures.
struct Run {
    rate: f64,
    p99_ms: f64,
}

pub fn run_alone() -> Result<()> {
    let bin = crate::util::bench_agent()?;
    println!("{}", section(&bin)?);
    Ok(())
}

/// The section: nginx and the ingress, each scenario, as a Markdown table.
pub fn section(bin: &Path) -> Result<String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let work = tempfile::Builder::new()
        .prefix("rune-bench-ingress-")
        .tempdir()?;
    let dir = work.path();
    let port = || rt.block_on(free_port());
    let (backend, nginx_http, nginx_https) = (port()?, port()?, port()?);
    let (ingress_http, ingress_https) = (port()?, port()?);
    let service_ports = (port()?, port()?);
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    self_signed(&cert, &key)?;
    let _backend = nginx(
        &dir.join("backend"),
        &format!(
            "server {{ listen 127.0.0.2:{backend}; keepalive_requests 100000; return 200 \"ok\"; }}"
        ),
    )?;
    let _proxy = nginx(
        &dir.join("proxy"),
        &format!(
            "upstream backend {{ server 127.0.0.2:{backend}; keepalive 64; }}\n\
             server {{\n  listen 127.0.0.1:{nginx_http};\n  listen 127.0.0.1:{nginx_https} ssl;\n\
             ssl_certificate {};\n  ssl_certificate_key {};\n  keepalive_requests 100000;\n\
             location / {{ proxy_pass http://backend; proxy_http_version 1.1;\n\
             proxy_set_header Connection \"\"; proxy_set_header Host $host;\n\
             proxy_set_header X-Forwarded-For $remote_addr; }}\n}}",
            cert.display(),
            key.display()
        ),
    )?;
    let state = tempfile::Builder::new().prefix("rune-bench-").tempdir()?;
    // wrk's address SNI makes rustls warn per handshake: keep those lines out.
    let agent = Agent::command(bin, state.path())
        .args(["--dev"])
        .env("RUST_LOG", "warn,rustls=error")
        .args([
            "--ingress",
            "--ingress-addr",
            &format!("127.0.0.1:{ingress_http}"),
            "--ingress-tls-addr",
            &format!("127.0.0.1:{ingress_https}"),
            "--ingress-default-cert",
            "bench-cert",
        ])
        .spawn()?;
    rt.block_on(wait_ready(&agent))?;
    apply(bin, &agent, &objects(service_ports, backend, &cert, &key)?)?;
    let nginx_urls = (
        format!("http://127.0.0.1:{nginx_http}/"),
        format!("https://127.0.0.1:{nginx_https}/"),
    );
    let ingress_urls = (
        format!("http://127.0.0.1:{ingress_http}/"),
        format!("https://127.0.0.1:{ingress_https}/"),
    );
    for (url, host) in [
        (&nginx_urls.0, HOST),
        (&nginx_urls.1, TLS_HOST),
        (&ingress_urls.0, HOST),
        (&ingress_urls.1, TLS_HOST),
    ] {
        wait_answering(url, host)?;
    }

    let mut rows = Vec::new();
    for scenario in [
        Scenario::KeepAlive,
        Scenario::NewConnection,
        Scenario::TlsKeepAlive,
    ] {
        let url = |u: &(String, String)| match scenario {
            Scenario::TlsKeepAlive => u.1.clone(),
            _ => u.0.clone(),
        };
        let (n_url, i_url) = (url(&nginx_urls), url(&ingress_urls));
        // Warm-up, not counted.
        wrk(scenario, &n_url)?;
        wrk(scenario, &i_url)?;
        let (mut n, mut i) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            n.push(wrk(scenario, &n_url)?);
            i.push(wrk(scenario, &i_url)?);
        }
        let med = |runs: &[Run], f: fn(&Run) -> f64| {
            let mut v: Vec<f64> = runs.iter().map(f).collect();
            median(&mut v)
        };
        rows.push((
            scenario,
            [med(&n, |r| r.rate), med(&i, |r| r.rate)],
            [med(&n, |r| r.p99_ms), med(&i, |r| r.p99_ms)],
        ));
    }
    drop(agent);

    let mut t = String::new();
    writeln!(t, "## Ingress proxy vs nginx (reverse proxy, loopback)")?;
    writeln!(t)?;
    writeln!(
        t,
        "One nginx backend (`return 200 \"ok\"`); nginx 1 worker with an upstream keepalive pool vs the agent's ingress (dev mode); `wrk -t1 -c{CONNECTIONS} -d{RUN_SECS}s --latency` with a `Host` of the route (new connection: plus `Connection: close`; TLS: SNI is the address, answered by the ingress' default certificate). {ROUNDS} interleaved rounds, medians."
    )?;
    writeln!(t)?;
    writeln!(
        t,
        "| scenario | nginx req/s | ingress req/s | ratio | nginx p99 | ingress p99 | target |"
    )?;
    writeln!(t, "|---|---:|---:|---:|---:|---:|---|")?;
    for (s, rate, p99) in rows {
        writeln!(
            t,
            "| {} | {:.0} | {:.0} | {:.2}x | {:.2} ms | {:.2} ms | >= 1.0x, p99 <= nginx's |",
            s.label(),
            rate[0],
            rate[1],
            rate[1] / rate[0],
            p99[0],
            p99[1]
        )?;
    }
    Ok(t)
}

/// The two Services (their port's target the backend), their Endpoints and the TLS
/// Secret.
fn objects(service_ports: (u16, u16), backend: u16, cert: &Path, key: &Path) -> Result<String> {
    let secret = serde_json::json!({
        "apiVersion": "rune/v1",
        "kind": "Secret",
        "metadata": {"name": "bench-cert"},
        "data": {
            "tls.crt": std::fs::read_to_string(cert)?,
            "tls.key": std::fs::read_to_string(key)?,
        },
    });
    // wrk sends the URL's address as SNI, which names no host: the default
    // certificate (the same Secret) answers it.
    let service = |name: &str, port: u16, expose: &str| {
        format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
             spec: {{ports: [{{port: {port}, targetPort: {backend}}}], expose: {{{expose}}}}}\n\
             ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\n\
             spec: {{endpoints: [{{address: 127.0.0.2}}]}}\n"
        )
    };
    Ok(format!(
        "{secret}\n---\n{}---\n{}",
        service("bench", service_ports.0, &format!("host: {HOST}")),
        service(
            "secure",
            service_ports.1,
            &format!("host: {TLS_HOST}, tls: {{secret: bench-cert}}")
        ),
    ))
}

/// A self-signed certificate and key (openssl, EC P-256) for both proxies.
fn self_signed(cert: &Path, key: &Path) -> Result<()> {
    let status = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ])
        .args(["-nodes", "-days", "2", "-subj", &format!("/CN={HOST}")])
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
fn nginx(dir: &Path, server: &str) -> Result<Reaped> {
    std::fs::create_dir_all(dir)?;
    let d = dir.display();
    let config = format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\n\
         error_log {d}/error.log warn;\nevents {{ worker_connections 4096; }}\nhttp {{\n\
         access_log off;\nclient_body_temp_path {d}/body;\nproxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fastcgi;\nuwsgi_temp_path {d}/uwsgi;\nscgi_temp_path {d}/scgi;\n\
         {server}\n}}\n"
    );
    let conf = dir.join("nginx.conf");
    std::fs::write(&conf, config)?;
    let child = Command::new("nginx")
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(&conf)
        .arg("-e")
        .arg(dir.join("error.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(dir.join("stderr.log"))?)
        .spawn()
        .context("starting nginx (cargo xtask setup installs nginx-light)")?;
    Ok(Reaped(child))
}

/// Waits (up to 20 s) until `url` answers 200 with `Host: host`.
fn wait_answering(url: &str, host: &str) -> Result<()> {
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

/// One wrk run against `url`; killed if it outlives its run by 10 s.
fn wrk(scenario: Scenario, url: &str) -> Result<Run> {
    let mut cmd = Command::new("wrk");
    cmd.args([
        "-t1",
        &format!("-c{CONNECTIONS}"),
        &format!("-d{RUN_SECS}s"),
    ])
    .arg("--latency");
    let host = match scenario {
        Scenario::TlsKeepAlive => TLS_HOST,
        _ => HOST,
    };
    cmd.args(["-H", &format!("Host: {host}")]);
    if let Scenario::NewConnection = scenario {
        cmd.args(["-H", "Connection: close"]);
    }
    let child = cmd
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting wrk (cargo xtask setup installs it)")?;
    let deadline = Instant::now() + Duration::from_secs(RUN_SECS + 10);
    let mut child = Reaped(child);
    loop {
        if child.0.try_wait()?.is_some() {
            break;
        }
        if Instant::now() > deadline {
            bail!("wrk against {url} did not finish");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut out = String::new();
    if let Some(mut stdout) = child.0.stdout.take() {
        std::io::Read::read_to_string(&mut stdout, &mut out)?;
    }
    parse_wrk(&out).with_context(|| format!("wrk against {url}: {out}"))
}

/// `Requests/sec:` and the `99%` latency line of wrk's report; a run with
/// non-2xx answers is refused (it did not measure the proxying).
fn parse_wrk(out: &str) -> Result<Run> {
    let field = |prefix: &str| out.lines().find_map(|l| l.trim().strip_prefix(prefix));
    if field("Non-2xx").is_some() {
        bail!("answers that were not 2xx");
    }
    let rate: f64 = field("Requests/sec:")
        .context("no Requests/sec")?
        .trim()
        .parse()?;
    let p99 = field("99%").context("no 99% latency")?.trim();
    let (number, unit) = p99.split_at(p99.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(0));
    let number: f64 = number.parse().context("99% latency")?;
    let p99_ms = match unit {
        "us" => number / 1000.0,
        "ms" => number,
        "s" => number * 1000.0,
        _ => bail!("99% latency unit {unit:?}"),
    };
    Ok(Run { rate, p99_ms })
}
