//! `cargo xtask bench apply` (also a section of `cargo xtask bench`): what an apply
//! costs the embedded store as it fills up to 100,000 services.
//!
//! * **Large applies**: 100,000 services × 10 endpoints (200,000 objects, ~85 MB of
//!   YAML) go into a fresh store in [`BATCHES`] applies of 40,000 objects, with
//!   `rune-agent apply -f` and no agent running (the CLI opens the store itself:
//!   the same `EmbeddedLog::apply` the agent's local API calls). The store's own
//!   time is the `store apply … elapsed_us=` line the store logs at debug level
//!   (`RUST_LOG=rune_agent::orderedlog=debug`): validation against the VIP index,
//!   the writes and the commit, without the CLI's YAML parsing; the CLI's wall time
//!   is shown beside it. The first batch meets an empty store, the last one 80,000
//!   services: an apply must cost what it writes, not what is stored.
//! * **One object into the full store**: [`ONE_RUNS`] applies of one new service
//!   (with a new VIP) into the store of 100,000 services; the median store time,
//!   and the CLI's wall time and peak RSS (which include opening the 280 MB store,
//!   with redb's integrity check).
//!
//! Before the VIP index, every apply read and parsed the whole store: one object
//! into 100,000 services took ~1 s and 220 MB. Needs no root; ~20 s plus the build.

use std::{
    fmt::Write as _,
    io::Read as _,
    net::Ipv4Addr,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};

/// Services in the full store.
const SERVICES: usize = 100_000;
/// Endpoints per service.
const ENDPOINTS: usize = 10;
/// Applies the services are written in.
const BATCHES: usize = 5;
/// Applies of one object into the full store; the median is reported.
const ONE_RUNS: usize = 5;
/// Target: the store's time for one object, whatever it holds.
const ONE_TARGET: Duration = Duration::from_millis(10);
/// Target: objects per second of the store in a large apply.
const RATE_TARGET: f64 = 20_000.0;

const TITLE: &str = "## Apply into the embedded store (up to 100,000 services × 10 endpoints)";

/// `cargo xtask bench apply`: builds the release agent, measures, prints the table.
pub fn run_alone() -> Result<()> {
    let bin = crate::util::bench_agent()?;
    println!("{}", section(&bin)?);
    Ok(())
}

/// One service and its endpoints, as YAML documents.
fn service_yaml(i: usize) -> String {
    let vip = Ipv4Addr::from(0x0a00_0000 + i as u32);
    let mut y = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: svc-{i:06}}}\n\
         spec: {{ports: [{{name: http, port: 80, targetPort: 8080}}], discovery: {{vips: [{vip}]}}}}\n\
         ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: svc-{i:06}}}\nspec:\n  endpoints:\n"
    );
    for e in 0..ENDPOINTS {
        let addr = Ipv4Addr::from(0xac10_0000 + (i * ENDPOINTS + e) as u32);
        let _ = writeln!(y, "    - {{address: {addr}, node: n{e}, ready: true}}");
    }
    y.push_str("---\n");
    y
}

/// What one `rune-agent apply` took.
struct Applied {
    /// The store's time, from its debug line.
    store: Duration,
    /// The whole command.
    wall: Duration,
    /// Its peak RSS, KiB.
    max_rss_kib: u64,
}

/// Runs `rune-agent --state-dir STATE apply -f FILE` with the store's debug line on.
fn apply(bin: &Path, state: &Path, file: &Path) -> Result<Applied> {
    let started = Instant::now();
    let mut child = Command::new(bin)
        .arg("--state-dir")
        .arg(state)
        .args(["apply", "-f"])
        .arg(file)
        .env("RUST_LOG", "warn,rune_agent::orderedlog=debug")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut log = String::new();
    child
        .stderr
        .take()
        .context("the apply's stderr")?
        .read_to_string(&mut log)?;
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: the pid is our child's, not yet waited for; the pointers are valid.
    let rc = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    let wall = started.elapsed();
    ensure!(
        rc > 0,
        "waiting for the apply: {}",
        std::io::Error::last_os_error()
    );
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        bail!("apply -f {} failed ({status}): {log}", file.display());
    }
    Ok(Applied {
        store: store_time(&log).with_context(|| format!("no store apply line in: {log}"))?,
        wall,
        max_rss_kib: usage.ru_maxrss as u64,
    })
}

/// The `elapsed_us=N` of the store's `store apply` line (escape codes removed).
fn store_time(log: &str) -> Option<Duration> {
    let line = log.lines().find(|l| l.contains("store apply"))?;
    let mut plain = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    let rest = plain.split("elapsed_us=").nth(1)?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some(Duration::from_micros(digits.parse().ok()?))
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// The section of the report.
pub fn section(bin: &Path) -> Result<String> {
    let work = tempfile::Builder::new()
        .prefix("rune-bench-apply-")
        .tempdir()?;
    let state = work.path().join("state");
    let per_batch = SERVICES / BATCHES;
    let mut batches = Vec::new();
    for b in 0..BATCHES {
        let file = work.path().join(format!("batch-{b}.yaml"));
        let yaml: String = (b * per_batch..(b + 1) * per_batch)
            .map(service_yaml)
            .collect();
        std::fs::write(&file, yaml)?;
        batches.push(apply(bin, &state, &file)?);
        std::fs::remove_file(&file)?;
    }
    let objects = (per_batch * 2) as f64;
    let rate = |d: Duration| objects / d.as_secs_f64();
    let total_store: Duration = batches.iter().map(|a| a.store).sum();
    let total_rate = (SERVICES * 2) as f64 / total_store.as_secs_f64();

    let mut ones = Vec::new();
    for r in 0..ONE_RUNS {
        let file = work.path().join(format!("one-{r}.yaml"));
        std::fs::write(&file, service_yaml(SERVICES + r))?;
        ones.push(apply(bin, &state, &file)?);
    }
    ones.sort_by_key(|a| a.store);
    let one = &ones[ONE_RUNS / 2];
    let store_mib = std::fs::metadata(state.join("store.redb"))?.len() as f64 / (1 << 20) as f64;

    let mut t = String::new();
    writeln!(t, "\n{TITLE}\n")?;
    writeln!(
        t,
        "`rune-agent apply -f` on the store (no agent), {BATCHES} applies of {} objects, then \
         {ONE_RUNS} of one object (median). Store: its own debug line (validation with the VIP \
         index, writes, commit); CLI: the whole command (YAML parse, store open). Store file at \
         the end: {store_mib:.0} MiB.\n",
        per_batch * 2
    )?;
    writeln!(t, "| measurement | store | CLI | target |")?;
    writeln!(t, "|---|---:|---:|---:|")?;
    writeln!(
        t,
        "| one object into {SERVICES} services | {} | {}, {:.0} MiB RSS | store < {} |",
        ms(one.store),
        ms(one.wall),
        one.max_rss_kib as f64 / 1024.0,
        ms(ONE_TARGET)
    )?;
    for (i, b) in [(0, &batches[0]), (BATCHES - 1, &batches[BATCHES - 1])] {
        writeln!(
            t,
            "| {} objects into {} services | {:.0} objects/s ({}) | {:.0} objects/s | store >= {RATE_TARGET:.0}/s |",
            per_batch * 2,
            i * per_batch,
            rate(b.store),
            ms(b.store),
            rate(b.wall),
        )?;
    }
    writeln!(
        t,
        "| all {} objects, {BATCHES} applies | {total_rate:.0} objects/s | | store >= {RATE_TARGET:.0}/s |",
        SERVICES * 2
    )?;
    let missed: Vec<&str> = [
        (one.store >= ONE_TARGET, "one object"),
        (
            batches.iter().any(|b| rate(b.store) < RATE_TARGET),
            "large applies",
        ),
    ]
    .into_iter()
    .filter_map(|(m, what)| m.then_some(what))
    .collect();
    if !missed.is_empty() {
        writeln!(t, "\nmissed: {}", missed.join(", "))?;
    }
    Ok(t)
}

#[cfg(test)]
mod tests;
