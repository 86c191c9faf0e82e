//! The DNS part of `cargo xtask bench`: the agent's embedded DNS server against
//! dnsmasq, both answering the same names from memory, side by side in one run.
//!
//! The agent runs in dev mode with [`SERVICES`] headless services (names only: no
//! dev proxies, no Maglev tables); dnsmasq serves the same names as `--host-record`s
//! on another loopback address, with no upstream servers, so neither ever forwards.
//! A UDP load generator keeps [`WINDOW`] queries in flight on each of [`SOCKETS`]
//! sockets (prebuilt packets, responses matched by id), for interleaved rounds
//! (agent, dnsmasq, agent, …); medians of queries/s and p99 latency are compared as
//! ratios, as is each server's CPU time per answer (from /proc/PID/stat), which
//! stays meaningful when the shared cores, not a server, limit the rate. Then the
//! agent's memory with [`MEMORY_SERVICES`] services.
//!
//! Every load loop is bounded in time; all traffic stays on 127.0.0.0/8.

use super::common::{apply, dev_agent, free_port, median, wait_ready};
use anyhow::{Context, Result, bail, ensure};
use hickory_proto::{
    op::{Message, MessageType, OpCode, Query, ResponseCode},
    rr::{Name, RData, RecordType},
};
use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    process::{Child, Command, Stdio},
    str::FromStr,
    sync::Arc,
    time::{Duration, Instant},
};
use tokio::net::UdpSocket;

/// Services (and so names) in the zone under load.
const SERVICES: usize = 1000;
/// Services applied for the memory figure.
const MEMORY_SERVICES: usize = 10_000;
/// Rounds (each: one agent run and one dnsmasq run).
const ROUNDS: usize = 7;
/// Length of one run.
const RUN: Duration = Duration::from_secs(2);
/// Client sockets, each with its own thread.
const SOCKETS: usize = 4;
/// Queries in flight per socket.
const WINDOW: usize = 32;
/// A query unanswered this long counts as lost and its window slot is refilled.
const LOST_AFTER: Duration = Duration::from_millis(200);
/// Where dnsmasq listens (the agent listens on 127.0.0.1).
const DNSMASQ_ADDR: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 53);
/// Targets from the issue.
const QPS_TARGET: f64 = 1.5;
const MEMORY_TARGET_MIB: f64 = 30.0;

/// The figures of one load run.
#[derive(Clone, Copy, Debug)]
struct Run {
    qps: f64,
    p50_us: f64,
    p99_us: f64,
    /// CPU time the server process spent per answered query (user + system).
    cpu_us: f64,
    lost: u64,
}

/// `cargo xtask bench dns`: builds the release agent and prints this section alone.
pub fn run_alone() -> Result<()> {
    let bin = crate::util::bench_agent()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!("{}", rt.block_on(run(&bin))?);
    Ok(())
}

/// Runs the DNS benchmarks and returns their section of the report (markdown).
pub async fn run(bin: &Path) -> Result<String> {
    let names: Vec<String> = (0..SERVICES)
        .map(|i| format!("s{i}.default.rune."))
        .collect();
    let packets = Arc::new(
        names
            .iter()
            .map(|n| query_packet(n))
            .collect::<Result<Vec<_>>>()?,
    );

    let state = tempfile::Builder::new()
        .prefix("rune-bench-dns-")
        .tempdir()?;
    let agent_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().await?));
    let agent = dev_agent(bin, &state, &["--dns-addr", &agent_addr.to_string()])?;
    wait_ready(&agent).await?;
    apply(bin, &agent, &headless_services(SERVICES))?;
    wait_resolves(agent_addr, &names[SERVICES - 1]).await?;

    let dnsmasq = match Dnsmasq::start(&names, state.path()).await {
        Ok(d) => Some(d),
        Err(e) => {
            println!("bench: dnsmasq comparison skipped: {e:#}");
            None
        }
    };
    let skipped = if dnsmasq.is_none() {
        "dnsmasq could not be started (see above); agent figures only"
    } else {
        ""
    };

    // Warm-up, not counted.
    load(agent_addr, agent.pid(), &packets).await?;
    if let Some(d) = &dnsmasq {
        load(d.addr, d.child.id(), &packets).await?;
    }
    let (mut agent_runs, mut dnsmasq_runs) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        agent_runs.push(load(agent_addr, agent.pid(), &packets).await?);
        if let Some(d) = &dnsmasq {
            dnsmasq_runs.push(load(d.addr, d.child.id(), &packets).await?);
        }
    }
    let rss_under_load = agent.status_kib("VmRSS")?;
    drop(dnsmasq);
    drop(agent);

    // Memory with 10,000 services: headless, no ports, so the figure is the agent
    // with its zone, not 10,000 dev proxies.
    let state2 = tempfile::Builder::new()
        .prefix("rune-bench-dns-mem-")
        .tempdir()?;
    let addr2 = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().await?));
    let agent = dev_agent(bin, &state2, &["--dns-addr", &addr2.to_string()])?;
    wait_ready(&agent).await?;
    let rss_empty = agent.status_kib("VmRSS")?;
    apply(bin, &agent, &headless_services(MEMORY_SERVICES))?;
    wait_resolves(addr2, &format!("s{}.default.rune.", MEMORY_SERVICES - 1)).await?;
    // Let the zone rebuilds triggered by the apply settle before reading.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_10k = agent.status_kib("VmRSS")?;
    drop(agent);

    let a = summarize(&mut agent_runs);
    let mut t = String::new();
    writeln!(t)?;
    writeln!(
        t,
        "## DNS: rune-agent's embedded server vs dnsmasq (zone answers, loopback)"
    )?;
    writeln!(t)?;
    writeln!(
        t,
        "{ROUNDS} interleaved rounds of {} s each, UDP A queries over {SERVICES} names, \
         {SOCKETS} sockets x {WINDOW} in flight, medians.",
        RUN.as_secs()
    )?;
    if !skipped.is_empty() {
        writeln!(t)?;
        writeln!(t, "{skipped}.")?;
    }
    writeln!(t)?;
    writeln!(t, "| scenario | dnsmasq | rune-agent | ratio | target |")?;
    writeln!(t, "|---|---:|---:|---:|---:|")?;
    if dnsmasq_runs.is_empty() {
        writeln!(
            t,
            "| DNS zone answers/s (UDP) | - | {:.0}/s | - | >= {QPS_TARGET:.1}x |",
            a.qps
        )?;
        writeln!(
            t,
            "| DNS p99 latency | - | {:.0} us | - | <= 1.0x |",
            a.p99_us
        )?;
        writeln!(
            t,
            "| DNS server CPU per answer | - | {:.1} us | - | |",
            a.cpu_us
        )?;
    } else {
        let d = summarize(&mut dnsmasq_runs);
        writeln!(
            t,
            "| DNS zone answers/s (UDP) | {:.0}/s | {:.0}/s | {:.2}x | >= {QPS_TARGET:.1}x |",
            d.qps,
            a.qps,
            a.qps / d.qps
        )?;
        writeln!(
            t,
            "| DNS p50 latency | {:.0} us | {:.0} us | {:.2}x | |",
            d.p50_us,
            a.p50_us,
            a.p50_us / d.p50_us
        )?;
        writeln!(
            t,
            "| DNS p99 latency | {:.0} us | {:.0} us | {:.2}x | <= 1.0x |",
            d.p99_us,
            a.p99_us,
            a.p99_us / d.p99_us
        )?;
        writeln!(
            t,
            "| DNS server CPU per answer | {:.1} us | {:.1} us | {:.2}x | |",
            d.cpu_us,
            a.cpu_us,
            a.cpu_us / d.cpu_us
        )?;
        if d.lost > 0 {
            writeln!(t, "| DNS queries lost (all rounds) | {} | | | |", d.lost)?;
        }
    }
    if a.lost > 0 {
        writeln!(t, "| DNS queries lost (all rounds) | | {} | | |", a.lost)?;
    }
    writeln!(
        t,
        "| agent memory (RSS), {SERVICES} headless services, after the DNS load | | {:.1} MiB | | |",
        rss_under_load as f64 / 1024.0
    )?;
    writeln!(
        t,
        "| agent memory (RSS), no services (DNS on) | | {:.1} MiB | | |",
        rss_empty as f64 / 1024.0
    )?;
    writeln!(
        t,
        "| agent memory (RSS), {MEMORY_SERVICES} headless services (names only) | | {:.1} MiB | | < {MEMORY_TARGET_MIB:.0} MiB |",
        rss_10k as f64 / 1024.0
    )?;
    Ok(t)
}

/// Medians over the runs; losses summed.
fn summarize(runs: &mut [Run]) -> Run {
    let lost = runs.iter().map(|r| r.lost).sum();
    let mut qps: Vec<f64> = runs.iter().map(|r| r.qps).collect();
    let mut p50: Vec<f64> = runs.iter().map(|r| r.p50_us).collect();
    let mut p99: Vec<f64> = runs.iter().map(|r| r.p99_us).collect();
    let mut cpu: Vec<f64> = runs.iter().map(|r| r.cpu_us).collect();
    Run {
        qps: median(&mut qps),
        p50_us: median(&mut p50),
        p99_us: median(&mut p99),
        cpu_us: median(&mut cpu),
        lost,
    }
}

/// `n` headless services without ports, `s0` … `s{n-1}` in `default`.
fn headless_services(n: usize) -> String {
    let mut yaml = String::new();
    for i in 0..n {
        writeln!(
            yaml,
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: s{i}}}\n\
             spec: {{discovery: {{headless: true}}}}\n---"
        )
        .ok();
    }
    yaml
}

/// A query for `name` A, id 0 (the load generator writes the id in place).
fn query_packet(name: &str) -> Result<Vec<u8>> {
    let mut m = Message::new(0, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(
        Name::from_str(name).with_context(|| format!("query name {name}"))?,
        RecordType::A,
    ));
    m.to_vec().context("encode a query")
}

/// Asks `server` for `name` A once (bounded); the answer, if any.
async fn ask(server: SocketAddr, name: &str) -> Result<Message> {
    ensure!(
        server.ip().is_loopback(),
        "DNS benchmarks query loopback only"
    );
    let sock = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let mut q = query_packet(name)?;
    q[..2].copy_from_slice(&0x5a5au16.to_be_bytes());
    sock.send_to(&q, server).await?;
    let mut buf = [0u8; 1500];
    let (n, _) = tokio::time::timeout(Duration::from_millis(500), sock.recv_from(&mut buf))
        .await
        .with_context(|| format!("no answer from {server} for {name}"))??;
    let m = Message::from_vec(&buf[..n]).context("decode an answer")?;
    ensure!(m.metadata.id == 0x5a5a, "answer with a foreign id");
    Ok(m)
}

/// Waits (bounded) until `server` answers `name` with A 127.0.0.1.
async fn wait_resolves(server: SocketAddr, name: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::from("nothing asked yet");
    while Instant::now() < deadline {
        match ask(server, name).await {
            Ok(m) if m.metadata.response_code == ResponseCode::NoError => {
                let loopback = m
                    .answers
                    .iter()
                    .any(|r| matches!(&r.data, RData::A(a) if a.0 == Ipv4Addr::LOCALHOST));
                if loopback {
                    return Ok(());
                }
                last = format!("answers {:?}", m.answers);
            }
            Ok(m) => last = format!("rcode {:?}", m.metadata.response_code),
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{server} did not resolve {name} within 60 s: {last}")
}

/// One run of [`RUN`] against `server` (process `pid`), cycling through `packets`:
/// [`SOCKETS`] client threads, each with [`WINDOW`] queries in flight, sent and
/// received in batches (`sendmmsg`/`recvmmsg`) so that the generator costs less CPU
/// per query than the servers and the rate shows the servers' capacity.
async fn load(server: SocketAddr, pid: u32, packets: &Arc<Vec<Vec<u8>>>) -> Result<Run> {
    ensure!(
        server.ip().is_loopback(),
        "DNS benchmarks query loopback only"
    );
    let stat = format!("/proc/{pid}/stat");
    let cpu_before = crate::util::cpu_seconds(&stat)?;
    let start = Instant::now();
    let deadline = start + RUN;
    let results = tokio::task::block_in_place(|| {
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..SOCKETS)
                .map(|s| scope.spawn(move || worker(server, packets, s, deadline)))
                .collect();
            workers
                .into_iter()
                .map(|w| {
                    w.join()
                        .map_err(|_| anyhow::anyhow!("a DNS load worker panicked"))?
                })
                .collect::<Result<Vec<_>>>()
        })
    })?;
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = crate::util::cpu_seconds(&stat)? - cpu_before;
    let mut latencies = Vec::new();
    let mut lost = 0;
    for (l, n) in results {
        latencies.extend(l);
        lost += n;
    }
    ensure!(!latencies.is_empty(), "{server} answered no query");
    latencies.sort_unstable();
    let pct = |p: f64| latencies[((latencies.len() - 1) as f64 * p) as usize] as f64;
    Ok(Run {
        qps: latencies.len() as f64 / elapsed,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        cpu_us: cpu * 1e6 / latencies.len() as f64,
        lost,
    })
}

/// One socket keeping [`WINDOW`] queries in flight until `deadline` (a thread);
/// returns the latency of every answered query (µs) and the number lost. A wrong
/// answer (not NOERROR with at least one record) fails the benchmark.
fn worker(
    server: SocketAddr,
    packets: &[Vec<u8>],
    index: usize,
    deadline: Instant,
) -> Result<(Vec<u32>, u64)> {
    use std::os::fd::AsRawFd;
    let sock = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))?;
    sock.connect(server)?;
    sock.set_read_timeout(Some(LOST_AFTER))?;
    let fd = sock.as_raw_fd();
    let mut packets: Vec<Vec<u8>> = packets.to_vec();
    let count = packets.len();
    let mut sent_at: Vec<Option<Instant>> = vec![None; 1 << 16];
    let mut id = (index as u16).wrapping_mul(16_381);
    let mut next = index * count / SOCKETS;
    let mut latencies = Vec::with_capacity(1 << 18);
    let mut lost = 0u64;
    let mut in_flight = 0usize;
    let mut answers = vec![[0u8; 1500]; WINDOW];
    let mut batch: Vec<usize> = Vec::with_capacity(WINDOW);
    while Instant::now() < deadline {
        // Fill the window with one sendmmsg.
        batch.clear();
        while in_flight + batch.len() < WINDOW {
            let i = next % count;
            next += 1;
            id = id.wrapping_add(1);
            packets[i][..2].copy_from_slice(&id.to_be_bytes());
            batch.push(i);
        }
        let now = Instant::now();
        let mut sent = 0;
        while sent < batch.len() {
            let n = send_batch(fd, &packets, &batch[sent..])?;
            for &i in &batch[sent..sent + n] {
                let qid = u16::from_be_bytes([packets[i][0], packets[i][1]]);
                sent_at[qid as usize] = Some(now);
            }
            sent += n;
        }
        in_flight += sent;
        // Take whatever has arrived, waiting for at least one answer.
        let received = match receive_batch(fd, &mut answers) {
            Ok(r) => r,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if Instant::now() >= deadline {
                    break;
                }
                // Nothing for LOST_AFTER: whatever is in flight is lost.
                lost += in_flight as u64;
                in_flight = 0;
                sent_at.iter_mut().for_each(|s| *s = None);
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let arrived = Instant::now();
        for (buf, n) in answers.iter().zip(received) {
            ensure!(n >= 12, "a {n}-byte answer from {server}");
            let rid = u16::from_be_bytes([buf[0], buf[1]]);
            let Some(sent) = sent_at[rid as usize].take() else {
                // A late answer to a query already counted as lost.
                continue;
            };
            in_flight -= 1;
            let rcode = buf[3] & 0x0f;
            let count = u16::from_be_bytes([buf[6], buf[7]]);
            ensure!(
                rcode == 0 && count > 0,
                "{server}: rcode {rcode}, {count} answers"
            );
            if arrived < deadline {
                let us = arrived.duration_since(sent).as_micros();
                latencies.push(u32::try_from(us).unwrap_or(u32::MAX));
            }
        }
    }
    Ok((latencies, lost))
}

/// Sends `packets[i]` for each `i` in `which` on connected socket `fd`; how many
/// went out.
fn send_batch(fd: i32, packets: &[Vec<u8>], which: &[usize]) -> Result<usize> {
    // SAFETY: zeroed iovec/mmsghdr are valid; every pointer below points into
    // `packets`, which outlives the call.
    let mut iov: Vec<libc::iovec> = which
        .iter()
        .map(|&i| libc::iovec {
            iov_base: packets[i].as_ptr() as *mut _,
            iov_len: packets[i].len(),
        })
        .collect();
    let mut headers: Vec<libc::mmsghdr> = iov
        .iter_mut()
        .map(|io| {
            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
            h.msg_hdr.msg_iov = io;
            h.msg_hdr.msg_iovlen = 1;
            h
        })
        .collect();
    // SAFETY: `headers` describes `which.len()` valid buffers.
    let n = unsafe { libc::sendmmsg(fd, headers.as_mut_ptr(), headers.len() as u32, 0) };
    ensure!(n > 0, "sendmmsg: {}", std::io::Error::last_os_error());
    Ok(n as usize)
}

/// Receives up to `bufs.len()` datagrams on `fd`, blocking (up to the socket's read
/// timeout) for the first only; the length of each.
fn receive_batch(fd: i32, bufs: &mut [[u8; 1500]]) -> std::io::Result<Vec<usize>> {
    let mut iov: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    let mut headers: Vec<libc::mmsghdr> = iov
        .iter_mut()
        .map(|io| {
            // SAFETY: a zeroed mmsghdr is valid.
            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
            h.msg_hdr.msg_iov = io;
            h.msg_hdr.msg_iovlen = 1;
            h
        })
        .collect();
    // SAFETY: `headers` describes `bufs`, which outlives the call.
    let n = unsafe {
        libc::recvmmsg(
            fd,
            headers.as_mut_ptr(),
            headers.len() as u32,
            libc::MSG_WAITFORONE,
            std::ptr::null_mut(),
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(headers[..n as usize]
        .iter()
        .map(|h| h.msg_len as usize)
        .collect())
}

/// dnsmasq serving the same names, from memory only; killed on drop.
struct Dnsmasq {
    child: Child,
    addr: SocketAddr,
}

impl Dnsmasq {
    async fn start(names: &[String], dir: &Path) -> Result<Dnsmasq> {
        let port = {
            let s = std::net::UdpSocket::bind((DNSMASQ_ADDR, 0))
                .with_context(|| format!("bind {DNSMASQ_ADDR}:0"))?;
            s.local_addr()?.port()
        };
        let addr = SocketAddr::from((DNSMASQ_ADDR, port));
        let log = std::fs::File::create(dir.join("dnsmasq.log"))?;
        let mut cmd = Command::new("dnsmasq");
        cmd.args([
            "--keep-in-foreground",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            "--conf-file=/dev/null",
            "--bind-interfaces",
            "--local=/rune/",
            "--local-ttl=5",
            "--log-facility=-",
        ])
        .arg(format!("--port={port}"))
        .arg(format!("--listen-address={DNSMASQ_ADDR}"))
        .arg(format!("--pid-file={}", dir.join("dnsmasq.pid").display()));
        for n in names {
            cmd.arg(format!(
                "--host-record={},127.0.0.1",
                n.trim_end_matches('.')
            ));
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("run dnsmasq (Debian: dnsmasq-base; `cargo xtask setup` installs it)")?;
        let mut d = Dnsmasq { child, addr };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = d.child.try_wait()? {
                let log = std::fs::read_to_string(dir.join("dnsmasq.log")).unwrap_or_default();
                bail!("dnsmasq exited: {status}: {}", log.trim());
            }
            if let Ok(m) = ask(addr, &names[0]).await
                && m.metadata.response_code == ResponseCode::NoError
                && !m.answers.is_empty()
            {
                return Ok(d);
            }
            ensure!(
                Instant::now() < deadline,
                "dnsmasq did not answer on {addr} within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
