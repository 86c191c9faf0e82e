//! One `wrk --latency` run of `bench ingress`: requests/s and the p99 latency.

use super::servers::Reaped;
use anyhow::{Context as _, Result, bail};
use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

/// Seconds of one wrk run.
const RUN_SECS: u64 = 3;
/// Connections wrk keeps open.
pub(super) const CONNECTIONS: usize = 32;
/// Connections of the handshake flood, each a new TLS handshake per request.
pub(super) const FLOOD_CONNECTIONS: usize = 64;

/// The three client scenarios.
#[derive(Clone, Copy)]
pub(super) enum Scenario {
    KeepAlive,
    NewConnection,
    TlsKeepAlive,
    /// HTTPS keep-alive while a second wrk floods the same listener with new TLS
    /// handshakes: how well good clients are served under a handshake flood.
    TlsUnderFlood,
}

impl Scenario {
    pub(super) const ALL: [Scenario; 4] = [
        Scenario::KeepAlive,
        Scenario::NewConnection,
        Scenario::TlsKeepAlive,
        Scenario::TlsUnderFlood,
    ];

    pub(super) fn label(self) -> &'static str {
        match self {
            Scenario::KeepAlive => "HTTP keep-alive",
            Scenario::NewConnection => "HTTP, new connection per request",
            Scenario::TlsKeepAlive => "HTTPS keep-alive",
            Scenario::TlsUnderFlood => "HTTPS keep-alive beside a flood of new TLS handshakes",
        }
    }

    /// Whether the scenario runs over TLS.
    pub(super) fn tls(self) -> bool {
        matches!(self, Scenario::TlsKeepAlive | Scenario::TlsUnderFlood)
    }
}

/// One wrk run's figures.
pub(super) struct Run {
    pub(super) rate: f64,
    pub(super) p99_ms: f64,
}

/// The wrk command line of the table's caption.
pub(super) fn describe() -> String {
    format!("`wrk -t1 -c{CONNECTIONS} -d{RUN_SECS}s --latency`")
}

/// One wrk run against `url` with `Host: host`; killed if it outlives its run by
/// 10 s. Under a flood, a second wrk makes a new TLS connection per request to
/// the same URL for the whole run (its answers are not counted).
pub(super) fn wrk(scenario: Scenario, url: &str, host: &str) -> Result<Run> {
    let _flood = match scenario {
        Scenario::TlsUnderFlood => Some(spawn(
            url,
            host,
            FLOOD_CONNECTIONS,
            RUN_SECS + 1,
            true,
            false,
        )?),
        _ => None,
    };
    let close = matches!(scenario, Scenario::NewConnection);
    let child = spawn(url, host, CONNECTIONS, RUN_SECS, close, true)?;
    let deadline = Instant::now() + Duration::from_secs(RUN_SECS + 10);
    let mut child = child;
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

/// `wrk -t1 -cCONNECTIONS -dSECS` against `url` with `Host: host` (and
/// `Connection: close` when `close`), its report piped when `report`.
fn spawn(
    url: &str,
    host: &str,
    connections: usize,
    secs: u64,
    close: bool,
    report: bool,
) -> Result<Reaped> {
    let mut cmd = Command::new("wrk");
    cmd.args(["-t1", &format!("-c{connections}"), &format!("-d{secs}s")])
        .arg("--latency")
        .args(["-H", &format!("Host: {host}")]);
    if close {
        cmd.args(["-H", "Connection: close"]);
    }
    let child = cmd
        .arg(url)
        .stdin(Stdio::null())
        .stdout(if report {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stderr(Stdio::null())
        .spawn()
        .context("starting wrk (cargo xtask setup installs it)")?;
    Ok(Reaped(child))
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
