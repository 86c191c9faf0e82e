//! What the scenario runs and reads in the client namespace: wrk (two at once) and
//! the namespace's TCP counters (nstat).

use super::net::{Reaped, in_netns};
use super::{CONNECTIONS, RUN_SECS, WRK_LIMIT};
use anyhow::{Context as _, Result, bail, ensure};
use rune_harness::netns::NetNs;
use std::{
    fmt,
    io::Read as _,
    net::Ipv4Addr,
    ops::AddAssign,
    path::Path,
    process::Stdio,
    thread::sleep,
    time::{Duration, Instant},
};

/// The client namespace's TCP counters of interest (absolute values).
pub(super) struct Counters {
    /// TcpExtTCPSynRetrans: SYNs sent again.
    pub(super) syn_retrans: u64,
    /// TcpOutRsts: RSTs sent.
    pub(super) rsts: u64,
}

/// Reads [`Counters`] with `nstat -asz` in the client namespace: absolute values of
/// that namespace (its /proc/net), and no history file written (`NSTAT_HISTORY` points
/// into `work` all the same, never at the per-user default other runs share).
pub(super) fn counters(client: &NetNs, work: &Path) -> Result<Counters> {
    let out = in_netns(client, "nstat")?
        .args(["-asz", "TcpExtTCPSynRetrans", "TcpOutRsts"])
        .env("NSTAT_HISTORY", work.join("nstat.history"))
        .stdin(Stdio::null())
        .output()
        .context("running nstat in the client namespace")?;
    ensure!(out.status.success(), "nstat failed: {}", out.status);
    let text = String::from_utf8_lossy(&out.stdout);
    let value = |name: &str| -> Result<u64> {
        text.lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(name)).then(|| f.next()).flatten()
            })
            .with_context(|| format!("no {name} in nstat's output:\n{text}"))?
            .parse()
            .with_context(|| format!("nstat's {name}"))
    };
    Ok(Counters {
        syn_retrans: value("TcpExtTCPSynRetrans")?,
        rsts: value("TcpOutRsts")?,
    })
}

/// wrk's errors: socket errors and answers other than 2xx/3xx.
#[derive(Clone, Copy, Default)]
pub(super) struct Errors {
    /// Connections that failed to open.
    connect: u64,
    /// Failed reads (a reset connection, among others).
    read: u64,
    /// Failed writes.
    write: u64,
    /// Requests without an answer within wrk's timeout (2 s).
    timeout: u64,
    /// Answers other than 2xx or 3xx.
    non_2xx: u64,
}

impl AddAssign for Errors {
    fn add_assign(&mut self, o: Errors) {
        self.connect += o.connect;
        self.read += o.read;
        self.write += o.write;
        self.timeout += o.timeout;
        self.non_2xx += o.non_2xx;
    }
}

impl fmt::Display for Errors {
    /// `connect/read/write/timeout`, then `+N non-2xx` when there were such answers.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}/{}/{}",
            self.connect, self.read, self.write, self.timeout
        )?;
        if self.non_2xx > 0 {
            write!(f, " +{} non-2xx", self.non_2xx)?;
        }
        Ok(())
    }
}

/// One wrk run's requests (here: connections) per second and errors.
pub(super) struct WrkRun {
    pub(super) rate: f64,
    pub(super) errors: Errors,
}

/// Runs one wrk per target at the same time in the client namespace and waits for
/// both (killed, and the bench failed, after [`WRK_LIMIT`]).
pub(super) fn wrk_pair(client: &NetNs, targets: [Ipv4Addr; 2]) -> Result<Vec<WrkRun>> {
    let mut children = Vec::new();
    for target in targets {
        let mut cmd = in_netns(client, "wrk")?;
        cmd.args([
            "-t1",
            &format!("-c{CONNECTIONS}"),
            &format!("-d{RUN_SECS}s"),
        ])
        .args(["-H", "Connection: close", &format!("http://{target}/")])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        let child = cmd
            .spawn()
            .context("starting wrk (cargo xtask setup installs it)")?;
        children.push(Reaped(child));
    }
    let deadline = Instant::now() + WRK_LIMIT;
    let mut runs = Vec::new();
    for (child, target) in children.iter_mut().zip(targets) {
        let status = loop {
            if let Some(status) = child.0.try_wait()? {
                break status;
            }
            if Instant::now() > deadline {
                bail!("wrk to {target} still ran after {WRK_LIMIT:?}");
            }
            sleep(Duration::from_millis(50));
        };
        let mut out = String::new();
        child
            .0
            .stdout
            .take()
            .context("wrk's stdout")?
            .read_to_string(&mut out)?;
        ensure!(
            status.success(),
            "wrk to {target} failed ({status}):\n{out}"
        );
        runs.push(parse_wrk(&out).with_context(|| format!("wrk to {target}:\n{out}"))?);
    }
    Ok(runs)
}

/// The figures of wrk's report: `Requests/sec:`, `Socket errors: connect N, read N,
/// write N, timeout N` (only printed when there were some) and `Non-2xx or 3xx
/// responses: N`.
fn parse_wrk(out: &str) -> Result<WrkRun> {
    let field = |prefix: &str| out.lines().find_map(|l| l.trim().strip_prefix(prefix));
    let rate = field("Requests/sec:")
        .context("no Requests/sec")?
        .trim()
        .parse()
        .context("Requests/sec")?;
    let mut errors = Errors::default();
    if let Some(socket) = field("Socket errors:") {
        for part in socket.split(',') {
            let mut f = part.split_whitespace();
            let (Some(name), Some(n)) = (f.next(), f.next()) else {
                bail!("socket errors: {socket:?}");
            };
            let n: u64 = n
                .parse()
                .with_context(|| format!("socket errors: {socket:?}"))?;
            match name {
                "connect" => errors.connect = n,
                "read" => errors.read = n,
                "write" => errors.write = n,
                "timeout" => errors.timeout = n,
                _ => bail!("socket errors: {socket:?}"),
            }
        }
    }
    if let Some(n) = field("Non-2xx or 3xx responses:") {
        errors.non_2xx = n.trim().parse().context("Non-2xx or 3xx responses")?;
    }
    Ok(WrkRun { rate, errors })
}

#[cfg(test)]
mod tests;
