//! `cargo xtask bench sync` (also a section of `cargo xtask bench`): how fast the
//! production agent programs its eBPF maps from the ordered log.
//!
//! * **Snapshot to programmed maps**: 10,000 services × 10 endpoints are written into
//!   a fresh store while no agent runs; then the release agent starts in production
//!   mode and the figure is the time from spawning it to the moment all 10,000
//!   frontends are in the pinned `RUNE_SVC_V4` map with a Maglev table
//!   (`maglev_size != 0`). Three runs, each with a fresh store and fresh pins; the
//!   median is reported, with the agent's RSS once the sync is done.
//! * **One endpoint change, event to map**: with the agent of the last run still up,
//!   200 times one service's endpoint list changes (one address replaced) through
//!   `rune-agent apply -f -`. The interval starts when that command has returned (the
//!   event is committed to the ordered log) and ends when the frontend's Maglev table,
//!   read through a read-only mapping of the pinned `RUNE_MAGLEV` array, no longer
//!   names the replaced backend anywhere; afterwards the table must name a backend
//!   whose `RUNE_BACKENDS` entry is the new address, or the run fails.
//!
//! The agent runs in a network namespace of its own (`rune-bench-sync-<pid>`, only
//! `lo`, up), entered with `setns` before exec so that it still sees the host's
//! bpffs; nothing is attached (`--cgroup none --interfaces ""`), no packet is sent,
//! and DNS never forwards (`RUNE_DNS_RESOLV_CONF=/dev/null`). Pins live in a private
//! directory under /sys/fs/bpf, removed with the namespace on drop.
//!
//! Map sizes: `--lb-max-frontends 10240 --maglev-table-size 1021`. With 10 backends
//! per service, 1021 slots give ~100 slots per backend (Maglev's M ≥ 100·N); the
//! default 16,381 slots × 10,240 frontends would need 640 MiB of kernel memory,
//! 1021 slots need 40 MiB.
//!
//! Needs root; without it the section says so and is skipped.

use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    os::fd::{AsFd as _, AsRawFd as _},
    path::Path,
    thread::sleep,
    time::{Duration, Instant},
};

mod nftables;

use agent_common::lb::{self, BACKEND_ACTIVE, Backend, PROTO_TCP, ServiceKeyV4, ServiceValue};
use anyhow::{Context as _, Result, bail, ensure};
use aya::maps::{Array, HashMap, Map, MapData};

use rune_harness::{bpffs::PinDir, netns::NetNs};

/// Services in the snapshot.
pub(crate) const SERVICES: usize = 10_000;
/// Endpoints per service.
pub(crate) const ENDPOINTS: usize = 10;
/// Snapshot runs (fresh store and pins each); the median is reported.
pub(crate) const SNAPSHOT_RUNS: usize = 3;
/// Endpoint changes measured one after the other.
pub(crate) const CHANGES: usize = 200;
/// Upper bound on the whole change series.
pub(crate) const CHANGES_LIMIT: Duration = Duration::from_secs(120);
/// Upper bound on one snapshot sync or one change reaching the maps.
pub(crate) const SYNC_LIMIT: Duration = Duration::from_secs(60);
pub(crate) const CHANGE_LIMIT: Duration = Duration::from_secs(5);

const MAX_FRONTENDS: u32 = 10_240;
const TABLE_SIZE: u32 = 1021;
const MAX_BACKENDS: u32 = 131_072;
const SERVICE_PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;

/// Endpoint `e` of the snapshot (0..100,000): 198.18.0.1 onwards.
pub(crate) fn endpoint_addr(service: usize, j: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 1)) + (service * ENDPOINTS + j) as u32)
}

/// Service `i`'s VIP: 198.19.160.0 onwards (after the last endpoint, 198.19.134.160).
pub(crate) fn vip(service: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 160, 0)) + service as u32)
}

/// The address that replaces an endpoint in change `k`: 198.19.240.0 onwards.
pub(crate) fn replacement_addr(k: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 240, 0)) + k as u32)
}

fn frontend_key(service: usize) -> ServiceKeyV4 {
    ServiceKeyV4 {
        addr: u32::from_ne_bytes(vip(service).octets()),
        port: SERVICE_PORT.to_be(),
        proto: PROTO_TCP,
        pad: 0,
    }
}

pub(crate) fn service_name(i: usize) -> String {
    // Zero-padded: the agent walks services in name order, and so does the poller.
    format!("s{i:05}")
}

pub(crate) fn endpoints_yaml(i: usize, addrs: &[Ipv4Addr]) -> String {
    let list: Vec<String> = addrs.iter().map(|a| format!("{{address: {a}}}")).collect();
    format!(
        "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {}}}\nspec: {{endpoints: [{}]}}\n",
        service_name(i),
        list.join(", ")
    )
}

fn snapshot_yaml() -> String {
    let mut y = String::with_capacity(SERVICES * 600);
    for i in 0..SERVICES {
        let _ = write!(
            y,
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {}}}\nspec: {{ports: [{{port: {SERVICE_PORT}, targetPort: {TARGET_PORT}}}], discovery: {{vips: [{}]}}}}\n---\n",
            service_name(i),
            vip(i)
        );
        let addrs: Vec<Ipv4Addr> = (0..ENDPOINTS).map(|j| endpoint_addr(i, j)).collect();
        y.push_str(&endpoints_yaml(i, &addrs));
        y.push_str("---\n");
    }
    y
}

/// `cargo xtask bench sync`: builds the release agent, measures, prints the table.
///
/// `RUNE_BENCH_AGENT=PATH` measures that agent binary instead of building one (to
/// compare two builds back to back); `RUNE_BENCH_SYNC_NFTABLES=0` leaves out the
/// nftables part.
pub fn run_alone() -> Result<()> {
    let bin = crate::util::bench_agent()?;
    let report = section(&bin)?;
    println!("{report}");
    Ok(())
}

/// The benchmark's section of the report (a note when not root).
pub fn section(bin: &Path) -> Result<String> {
    const TITLE: &str = "## eBPF map sync (production agent, 10,000 services)";
    if !crate::util::is_root() {
        return Ok(format!("\n{TITLE}\n\nskipped: needs root\n"));
    }
    let netns = NetNs::new("bench-sync")?;
    let work = tempfile::Builder::new()
        .prefix("rune-bench-sync-")
        .tempdir()?;
    let yaml = work.path().join("snapshot.yaml");
    std::fs::write(&yaml, snapshot_yaml())?;

    let mut runs = Vec::new();
    let mut changes = None;
    for run in 0..SNAPSHOT_RUNS {
        let state = work.path().join(format!("state-{run}"));
        let t = Instant::now();
        super::common::apply_snapshot(bin, &state, &yaml)?;
        let store_apply = t.elapsed();
        let pins = PinDir::new("bench-sync");
        let agent = Agent::start(bin, &netns, &state, pins.path(), "")?;
        let mut snap = measure_snapshot(&agent, pins.path())?;
        snap.store_apply = store_apply;
        eprintln!(
            "sync run {}: snapshot → maps {:.0} ms (agent's apply {:.0} ms), RSS {:.1} MiB",
            run + 1,
            ms(snap.to_maps),
            snap.agent_apply.map_or(f64::NAN, ms),
            snap.rss.vm as f64 / 1024.0
        );
        runs.push(snap);
        if run + 1 == SNAPSHOT_RUNS {
            changes = Some(measure_changes(bin, &agent, &state, pins.path())?);
        }
        drop(agent);
        drop(pins);
    }
    let changes = changes.context("no change series")?;
    let ebpf_median = {
        let mut t: Vec<Duration> = runs.iter().map(|r| r.to_maps).collect();
        t.sort();
        t[t.len() / 2]
    };
    let mut out = report(TITLE, &mut runs, &changes)?;
    if std::env::var_os("RUNE_BENCH_SYNC_NFTABLES").is_none_or(|v| v != "0") {
        out.push_str(&nftables::section(bin, &yaml, ebpf_median, &changes)?);
    }
    Ok(out)
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The release agent in production mode inside the bench's namespace; stopped
/// (SIGTERM, then SIGKILL) on drop.
pub(crate) struct Agent {
    pub(crate) process: rune_harness::agent::Agent,
}

impl Agent {
    pub(crate) fn start(
        bin: &Path,
        netns: &NetNs,
        state: &Path,
        pins: &Path,
        interfaces: &str,
    ) -> Result<Self> {
        let args: Vec<String> = [
            "--cgroup",
            "none",
            "--interfaces",
            interfaces,
            "--bpf-pin-dir",
            &pins.display().to_string(),
            "--lb-max-frontends",
            &MAX_FRONTENDS.to_string(),
            "--maglev-table-size",
            &TABLE_SIZE.to_string(),
            "--lb-max-backends",
            &MAX_BACKENDS.to_string(),
        ]
        .iter()
        .map(|a| (*a).to_owned())
        .collect();
        Self::start_with(bin, netns, state, &args)
    }

    /// The agent in production mode with `args` after `run` (see
    /// [`crate::util::spawn_agent`]), logging the data planes' and reconciler's debug
    /// lines that [`Agent::applies`] reads.
    pub(crate) fn start_with(
        bin: &Path,
        netns: &NetNs,
        state: &Path,
        args: &[String],
    ) -> Result<Self> {
        crate::util::spawn_agent(
            bin,
            netns,
            state,
            args,
            "warn,rune_agent::dataplane::ebpf=debug,rune_agent::dataplane::nftables=debug,rune_agent::dataplane::reconciler=debug",
        )
        .map(|process| Self { process })
    }

    pub(crate) fn rss(&self) -> Result<Rss> {
        let field = |name: &str| self.process.status_kib(name);
        Ok(Rss {
            vm: field("VmRSS")?,
            anon: field("RssAnon")?,
            file: field("RssFile")?,
        })
    }

    /// The agent's applies so far: `elapsed_us` of each "eBPF maps updated" line
    /// with `upserted` of the reconciler's "data plane updated" line that follows it.
    pub(crate) fn applies(&self) -> Vec<(Duration, usize)> {
        fn field(line: &str, name: &str) -> Option<u64> {
            let v = line.split(name).nth(1)?;
            let digits: String = v.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        }
        let log = self.process.log();
        let mut out = Vec::new();
        let mut elapsed = None;
        for l in log.lines() {
            if l.contains("eBPF maps updated") || l.contains("nftables table updated") {
                elapsed = field(l, "elapsed_us=");
            } else if l.contains("data plane updated")
                && let (Some(us), Some(n)) = (elapsed.take(), field(l, "upserted="))
            {
                out.push((Duration::from_micros(us), n as usize));
            }
        }
        out
    }

    /// How long the agent's apply of the whole snapshot took, by its log (waits up
    /// to 10 s for the line); the first full delta may come before the cache holds
    /// the store (empty), so the one with every service counts.
    pub(crate) fn full_apply(&self) -> Option<Duration> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some((d, _)) = self.applies().iter().find(|(_, n)| *n == SERVICES) {
                return Some(*d);
            }
            sleep(Duration::from_millis(10));
        }
        None
    }
}

#[derive(Clone, Copy, Default)]
pub(crate) struct Rss {
    /// VmRSS, KiB.
    pub(crate) vm: u64,
    /// RssAnon, KiB (the agent's own heap and stacks).
    pub(crate) anon: u64,
    /// RssFile, KiB (the binary's pages, and those of the mmapped Maglev array the
    /// agent wrote).
    pub(crate) file: u64,
}

struct Snapshot {
    /// Spawn → all frontends programmed.
    to_maps: Duration,
    /// Spawn → the services map is pinned and opened.
    pinned: Duration,
    /// Spawn → the first frontend is programmed.
    first: Duration,
    /// The agent's own time for the delta holding the services ("eBPF maps updated").
    agent_apply: Option<Duration>,
    /// Writing the snapshot into the stopped agent's store (not part of the figure).
    store_apply: Duration,
    rss: Rss,
}

fn open_pinned(pins: &Path, name: &str) -> Result<MapData> {
    MapData::from_pin(pins.join(name)).with_context(|| format!("opening the pinned {name}"))
}

fn measure_snapshot(agent: &Agent, pins: &Path) -> Result<Snapshot> {
    let deadline = agent.process.started + SYNC_LIMIT;
    let keys: Vec<ServiceKeyV4> = (0..SERVICES).map(frontend_key).collect();
    let svc_path = pins.join(lb::SERVICES_V4);
    let services: HashMap<MapData, ServiceKeyV4, ServiceValue> = loop {
        // The pin appears while the agent loads the object; opening may race with it.
        if let Ok(data) = MapData::from_pin(&svc_path)
            && let Ok(m) = HashMap::try_from(Map::HashMap(data))
        {
            break m;
        }
        ensure_alive(agent)?;
        ensure!(
            Instant::now() < deadline,
            "{} was not pinned within {SYNC_LIMIT:?}",
            svc_path.display()
        );
        sleep(Duration::from_micros(200));
    };
    let pinned = agent.process.started.elapsed();
    let mut done = 0;
    let mut first = None;
    while done < keys.len() {
        while done < keys.len() {
            match services.get(&keys[done], 0) {
                Ok(v) if v.maglev_size != 0 => done += 1,
                _ => break,
            }
        }
        if done > 0 && first.is_none() {
            first = Some(agent.process.started.elapsed());
        }
        if done == keys.len() {
            break;
        }
        ensure_alive(agent)?;
        ensure!(
            Instant::now() < deadline,
            "only {done} of {SERVICES} frontends were programmed within {SYNC_LIMIT:?}"
        );
        sleep(Duration::from_micros(200));
    }
    let to_maps = agent.process.started.elapsed();
    // Not timed: every frontend really has a table of the configured size.
    let mut programmed = 0;
    for item in services.iter() {
        let (_, v) = item?;
        ensure!(
            v.maglev_size == TABLE_SIZE,
            "a frontend has {} slots",
            v.maglev_size
        );
        programmed += 1;
    }
    ensure!(
        programmed == SERVICES,
        "{programmed} frontends in the map, expected {SERVICES}"
    );
    // The agent logs its apply once the whole delta is written (stale backends
    // released): wait for that line, then read its memory.
    let agent_apply = agent.full_apply();
    Ok(Snapshot {
        to_maps,
        pinned,
        first: first.unwrap_or(to_maps),
        agent_apply,
        store_apply: Duration::ZERO,
        rss: agent.rss()?,
    })
}

pub(crate) fn ensure_alive(agent: &Agent) -> Result<()> {
    agent.process.ensure_alive()
}

/// The pinned Maglev array, mapped read-only into this process.
struct MaglevView {
    ptr: *const u32,
    len: usize,
    _map: MapData,
}

impl MaglevView {
    fn open(pins: &Path) -> Result<Self> {
        let map = open_pinned(pins, lb::MAGLEV)?;
        // Two u32 slots per entry (agent_common::lb::MAGLEV).
        let len = map.info()?.max_entries() as usize * lb::MAGLEV_SLOTS_PER_ENTRY as usize;
        // SAFETY: a BPF_F_MMAPABLE array's fd maps shared; read-only here, and the
        // result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len * 4,
                libc::PROT_READ,
                libc::MAP_SHARED,
                map.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            bail!("mmap of RUNE_MAGLEV: {}", std::io::Error::last_os_error());
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
            _map: map,
        })
    }

    /// Slot `i` as the kernel sees it now (the agent writes it concurrently).
    fn slot(&self, i: usize) -> u32 {
        assert!(i < self.len);
        // SAFETY: in bounds of the live mapping; a volatile read of an aligned u32.
        unsafe { self.ptr.add(i).read_volatile() }
    }

    fn table(&self, v: &ServiceValue) -> Vec<u32> {
        let base = v.maglev_base as usize;
        (base..base + v.maglev_size as usize)
            .map(|i| self.slot(i))
            .collect()
    }
}

impl Drop for MaglevView {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `open`.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len * 4) };
    }
}

pub(crate) struct Changes {
    /// Apply returned → table rewritten.
    pub(crate) after_return: Vec<f64>,
    /// Apply spawned → table rewritten.
    from_spawn: Vec<f64>,
    /// The apply command alone (spawn → exit).
    cli: Vec<f64>,
    /// The agent's own apply of each delta ("eBPF maps updated").
    pub(crate) agent: Vec<f64>,
    /// Changes whose table was already rewritten when the command returned.
    before_return: usize,
    stopped_early: bool,
}

fn measure_changes(bin: &Path, agent: &Agent, state: &Path, pins: &Path) -> Result<Changes> {
    let services: HashMap<MapData, ServiceKeyV4, ServiceValue> =
        HashMap::try_from(Map::HashMap(open_pinned(pins, lb::SERVICES_V4)?))?;
    let backends: Array<MapData, Backend> =
        Array::try_from(Map::Array(open_pinned(pins, lb::BACKENDS)?))?;
    let maglev = MaglevView::open(pins)?;
    let applies_before = agent.applies().len();
    let mut c = Changes {
        after_return: Vec::new(),
        from_spawn: Vec::new(),
        cli: Vec::new(),
        agent: Vec::new(),
        before_return: 0,
        stopped_early: false,
    };
    let series = Instant::now();
    for k in 0..CHANGES {
        if series.elapsed() > CHANGES_LIMIT {
            c.stopped_early = true;
            break;
        }
        // 47 is prime to 10,000: 200 different services spread over the range.
        let i = (k * 47) % SERVICES;
        let value = services
            .get(&frontend_key(i), 0)
            .with_context(|| format!("frontend of service {i}"))?;
        let old = endpoint_addr(i, 0);
        let new = replacement_addr(k);
        let old_id = maglev
            .table(&value)
            .into_iter()
            .find(|id| {
                backends
                    .get(id, 0)
                    .is_ok_and(|b| b.addr[0] == u32::from_ne_bytes(old.octets()))
            })
            .with_context(|| format!("{old} is not in service {i}'s table"))?;
        let mut addrs: Vec<Ipv4Addr> = (1..ENDPOINTS).map(|j| endpoint_addr(i, j)).collect();
        addrs.push(new);
        let yaml = endpoints_yaml(i, &addrs);

        let spawned = Instant::now();
        crate::util::rune_apply(bin, state, &yaml)?;
        let returned = Instant::now();
        // The table is rewritten once no slot names the replaced backend.
        let gone = |t: &[u32]| !t.contains(&old_id) && !t.contains(&0);
        if gone(&maglev.table(&value)) {
            c.before_return += 1;
        }
        loop {
            if gone(&maglev.table(&value)) {
                break;
            }
            ensure!(
                returned.elapsed() < CHANGE_LIMIT,
                "change {k} (service {i}) did not reach the maps within {CHANGE_LIMIT:?}"
            );
            sleep(Duration::from_micros(50));
        }
        let done = Instant::now();
        // Not timed: the table now leads to the new address.
        let has_new = maglev.table(&value).into_iter().any(|id| {
            backends.get(&id, 0).is_ok_and(|b| {
                b.addr[0] == u32::from_ne_bytes(new.octets()) && b.state == BACKEND_ACTIVE
            })
        });
        ensure!(has_new, "service {i}'s table does not lead to {new}");
        c.after_return.push(ms(done - returned));
        c.from_spawn.push(ms(done - spawned));
        c.cli.push(ms(returned - spawned));
    }
    // The agent's own time per delta (one delta per change, unless two coalesced).
    c.agent = agent.applies()[applies_before..]
        .iter()
        .map(|(d, _)| ms(*d))
        .collect();
    Ok(c)
}

pub(crate) fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

fn report(title: &str, runs: &mut [Snapshot], c: &Changes) -> Result<String> {
    runs.sort_by_key(|r| r.to_maps);
    let m = &runs[runs.len() / 2];
    let all: Vec<String> = runs
        .iter()
        .map(|r| format!("{:.0}", ms(r.to_maps)))
        .collect();
    let mut after = c.after_return.clone();
    let mut spawn = c.from_spawn.clone();
    let mut cli = c.cli.clone();
    let mut agent = c.agent.clone();
    let (p50, p99) = (percentile(&mut after, 0.5), percentile(&mut after, 0.99));
    let met = super::common::verdict;
    let mib = |kib: u64| kib as f64 / 1024.0;

    let mut t = String::new();
    writeln!(t)?;
    writeln!(t, "{title}")?;
    writeln!(t)?;
    writeln!(
        t,
        "{SERVICES} services x {ENDPOINTS} endpoints (one TCP port, one IPv4 VIP each), \
         --lb-max-frontends {MAX_FRONTENDS} --maglev-table-size {TABLE_SIZE} \
         --lb-max-backends {MAX_BACKENDS}; agent in its own netns, nothing attached."
    )?;
    writeln!(t)?;
    writeln!(t, "| figure | value | target | |")?;
    writeln!(t, "|---|---:|---:|---|")?;
    writeln!(
        t,
        "| snapshot → programmed maps (spawn → all frontends with a table), median of {} | {:.0} ms | < 1000 ms | {} |",
        runs.len(),
        ms(m.to_maps),
        met(m.to_maps < Duration::from_secs(1))
    )?;
    writeln!(
        t,
        "| agent memory (VmRSS) after the sync | {:.1} MiB | < 50 MiB | {} |",
        mib(m.rss.vm),
        met(m.rss.vm < 50 * 1024)
    )?;
    writeln!(
        t,
        "| one endpoint change, apply returned → map, p50 ({} changes) | {p50:.2} ms | | |",
        c.after_return.len()
    )?;
    writeln!(
        t,
        "| one endpoint change, apply returned → map, p99 | {p99:.2} ms | < 5 ms | {} |",
        met(p99 < 5.0)
    )?;
    writeln!(t)?;
    writeln!(
        t,
        "Snapshot runs: {} ms; in the median run the services map was pinned after {:.0} ms, \
         the first frontend programmed after {:.0} ms, and the agent logged {} for the full delta. \
         Writing the snapshot into the stopped agent's store (not counted): {:.1} s. \
         Memory: RssAnon {:.1} MiB (the agent's heap), RssFile {:.1} MiB (the binary, and the \
         Maglev array's pages the agent wrote: {} frontends x {TABLE_SIZE} slots x 4 B = 39 MiB \
         of kernel memory, counted in VmRSS because the array is mmapped).",
        all.join(", "),
        ms(m.pinned),
        ms(m.first),
        m.agent_apply
            .map_or_else(|| "nothing".to_owned(), |d| format!("{:.0} ms", ms(d))),
        m.store_apply.as_secs_f64(),
        mib(m.rss.anon),
        mib(m.rss.file),
        SERVICES
    )?;
    writeln!(t)?;
    writeln!(
        t,
        "Endpoint changes: p50/p99 {:.2}/{:.2} ms from spawning `rune-agent apply -f -`; the \
         command alone takes {:.2}/{:.2} ms; the agent's own apply per delta {:.2}/{:.2} ms \
         ({} deltas); {} of {} tables were already rewritten when the command returned{}.",
        percentile(&mut spawn, 0.5),
        percentile(&mut spawn, 0.99),
        percentile(&mut cli, 0.5),
        percentile(&mut cli, 0.99),
        percentile(&mut agent, 0.5),
        percentile(&mut agent, 0.99),
        c.agent.len(),
        c.before_return,
        c.after_return.len(),
        if c.stopped_early {
            format!(" (stopped at the {} s limit)", CHANGES_LIMIT.as_secs())
        } else {
            String::new()
        }
    )?;
    Ok(t)
}
