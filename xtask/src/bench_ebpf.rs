//! `cargo xtask bench ebpf` (also the last section of `cargo xtask bench`): the
//! tc/XDP load balancer's per-packet cost through `BPF_PROG_TEST_RUN`, in ns per
//! packet and as a ratio to an `XDP_PASS` program on the same packet.
//!
//! `repeat` runs every iteration on the same buffer (docs/performance.md), so the
//! rewrite paths run under a driver (`rune_bench_{xdp,tc}_driver`) that restores the
//! packet's headers and tail-calls the program under test; the driver with a no-op
//! target is measured the same way and subtracted. "New flow" makes the driver write
//! a per-CPU sequence number into the source address, so every iteration misses
//! conntrack.
//! Return codes and the frontend's counters prove which path each figure ran.
//!
//! Needs root (loading programs); without it the section says so and is skipped.
//! Nothing is attached and nothing is sent on any network.

use std::{
    fmt::Write as _,
    os::fd::{AsFd, AsRawFd as _},
    path::{Path, PathBuf},
};

use agent_common::filter::{VIP_FILTER_WORDS, vip_filter_bit_v4};
use agent_common::lb::{
    self, BACKEND_ACTIVE, Backend, CtKeyV4, CtReplyV4, CtValue, FAMILY_V4, PROTO_TCP, ServiceKeyV4,
    ServiceValue, TrafficStats,
};
use anyhow::{Context as _, Result, bail, ensure};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, ProgramArray},
    programs::{ProgramFd, SchedClassifier, Xdp},
};

/// Iterations per `BPF_PROG_TEST_RUN` (`RUNE_BENCH_EBPF_REPEAT` overrides it, for
/// quick looks).
const REPEAT: u32 = 1_000_000;

fn repeat() -> u32 {
    std::env::var("RUNE_BENCH_EBPF_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(REPEAT)
}
/// Conntrack entries per family (`RUNE_BENCH_CT_ENTRIES` overrides it): the size the
/// `agent-ebpf` declaration has, so that the figures are those of a default node.
const CT_ENTRIES: u32 = 262_144;

fn ct_entries() -> u32 {
    std::env::var("RUNE_BENCH_CT_ENTRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CT_ENTRIES)
}

/// Conntrack entries of the second load, whose full new-flow rows compare with
/// Katran's: its `fallback_cache` LRU holds 1,000 entries.
const SMALL_CT_ENTRIES: u32 = 1_000;

/// Runs per figure (the median is reported).
const RUNS: usize = 7;
/// Bytes the drivers restore (`agent-ebpf/src/bench.rs`, `BENCH_HEADER`).
const BENCH_HEADER: usize = 64;

const XDP_PASS: u32 = 2;
const TC_ACT_OK: u32 = 0;

const VIP: [u8; 4] = [198, 18, 100, 1];
const NON_VIP: [u8; 4] = [198, 18, 200, 1];
const CLIENT: [u8; 4] = [198, 19, 0, 10];
const SERVICE_ID: u32 = 1;
/// Entries per CPU of the counters arrays (the bench uses ids below 16).
const STATS_PER_CPU: u32 = 16;

/// `cargo xtask bench ebpf`: builds the object, measures, prints the table.
pub fn run_alone() -> Result<()> {
    let report = section()?;
    println!("{report}");
    Ok(())
}

/// The benchmark's section of the report (a note when not root).
pub fn section() -> Result<String> {
    if !crate::util::is_root() {
        return Ok("\n## eBPF load balancer per packet\n\nskipped: needs root\n".into());
    }
    // `RUNE_BENCH_EBPF_OBJECT`: another build's object, to compare two builds back
    // to back under the same load (objects with reply entries: their conntrack
    // layout is read here).
    let object = match std::env::var_os("RUNE_BENCH_EBPF_OBJECT") {
        Some(object) => PathBuf::from(object),
        None => crate::build_ebpf::build()?,
    };
    measure(object)
}

struct Bench {
    ebpf: Ebpf,
    pins: PathBuf,
}

impl Drop for Bench {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.pins);
    }
}

fn measure(object: PathBuf) -> Result<String> {
    let mut b = Bench::load(&object, ct_entries(), "")?;

    let vip = tcp_frame(CLIENT, 40000, VIP, 80, TCP_ACK);
    let vip_syn = tcp_frame(CLIENT, 40000, VIP, 80, TCP_SYN);
    let non_vip = tcp_frame(CLIENT, 40000, NON_VIP, 80, TCP_ACK);
    b.set_saved(&vip)?;
    b.set_vary(false)?;

    let floor = b.median("rune_xdp_pass", &vip, XDP_PASS)?;
    let miss = b.median(lb::PROG_XDP_LB, &non_vip, XDP_PASS)?;
    let out = test_run(b.fd(lb::PROG_XDP_LB)?, &non_vip, 1)?;
    ensure!(out.data == non_vip, "the non-VIP packet was changed");
    let tc_miss = b.median(lb::PROG_TC_INGRESS, &non_vip, TC_ACT_OK)?;

    // Established flow: the first iteration creates the entry, the rest hit it.
    b.set_jump("RUNE_BENCH_XDP_JMP", "rune_bench_xdp_noop")?;
    let xdp_driver = b.median("rune_bench_xdp_driver", &vip, XDP_PASS)?;
    b.set_jump("RUNE_BENCH_XDP_JMP", lb::PROG_XDP_LB)?;
    let before = b.stats()?;
    let xdp_hit = b.median("rune_bench_xdp_driver", &vip, XDP_PASS)?;
    let after = b.stats()?;
    let runs = RUNS as u64 * u64::from(repeat());
    ensure!(
        after.packets - before.packets == runs && after.flows - before.flows <= 1,
        "established-flow runs did not translate every packet as one flow: {before:?} → {after:?}"
    );

    // New flows: every iteration another source address, with a mid-stream ACK (a
    // flow picked up without its SYN: lookup, miss, pick, insert) and with a SYN (a
    // connection's first packet: pick, one insert). First into a conntrack with free
    // entries: emptied before each run, and a run inserts at most 90 % of the entries
    // divided by the possible CPUs, so that nothing is evicted even with per-CPU LRU
    // lists (`BPF_F_NO_COMMON_LRU`, which split the entries over the CPUs: objects of
    // builds before 2026-12-01 evening). Then the full runs, which fill the table and
    // from then on evict on every insert, as a node at capacity does.
    let cpus = aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))?;
    let fresh = (u64::from(ct_entries()) / cpus as u64 * 9 / 10).min(u64::from(repeat())) as u32;
    ensure!(fresh > 0, "conntrack too small for the not-full run");
    b.set_vary(true)?;
    b.set_jump("RUNE_BENCH_XDP_JMP", "rune_bench_xdp_noop")?;
    let xdp_driver_vary = b.median("rune_bench_xdp_driver", &vip, XDP_PASS)?;
    let xdp_driver_fresh = b.median_n("rune_bench_xdp_driver", &vip, XDP_PASS, fresh)?;
    b.set_jump("RUNE_BENCH_XDP_JMP", lb::PROG_XDP_LB)?;
    let xdp_new_fresh = b.new_flows(&vip, fresh, Conntrack::Emptied)?;
    b.set_saved(&vip_syn)?;
    let xdp_syn_fresh = b.new_flows(&vip_syn, fresh, Conntrack::Emptied)?;
    b.set_saved(&vip)?;
    let xdp_new = b.new_flows(&vip, repeat(), Conntrack::AsIs)?;
    b.set_saved(&vip_syn)?;
    let xdp_syn = b.new_flows(&vip_syn, repeat(), Conntrack::AsIs)?;
    b.set_saved(&vip)?;
    b.set_vary(false)?;
    // The established flow's entry again (emptied or evicted above), for tc.
    let out = test_run(b.fd("rune_bench_xdp_driver")?, &vip, 1)?;
    ensure!(out.retval == XDP_PASS, "re-establishing the flow failed");

    // The same full runs on a conntrack of 1,000 entries: the size of the LRU that
    // takes Katran's new flows when no per-CPU LRU is set up for the CPU (its
    // `fallback_cache`), as in a BPF_PROG_TEST_RUN measurement of Katran. The table
    // fits in the caches, which the default size does not.
    let (small_syn, small_ack) = {
        let mut k = Bench::load(&object, SMALL_CT_ENTRIES, "-small")?;
        k.set_saved(&vip)?;
        k.set_vary(true)?;
        k.set_jump("RUNE_BENCH_XDP_JMP", "rune_bench_xdp_noop")?;
        let driver = k.median("rune_bench_xdp_driver", &vip, XDP_PASS)?;
        k.set_jump("RUNE_BENCH_XDP_JMP", lb::PROG_XDP_LB)?;
        let ack = k.new_flows(&vip, repeat(), Conntrack::AsIs)?;
        k.set_saved(&vip_syn)?;
        let syn = k.new_flows(&vip_syn, repeat(), Conntrack::AsIs)?;
        (syn - driver, ack - driver)
    };

    // tc, established flow.
    b.set_jump("RUNE_BENCH_TC_JMP", "rune_bench_tc_noop")?;
    let tc_driver = b.median("rune_bench_tc_driver", &vip, TC_ACT_OK)?;
    b.set_jump("RUNE_BENCH_TC_JMP", lb::PROG_TC_INGRESS)?;
    let before = b.stats()?;
    let tc_hit = b.median("rune_bench_tc_driver", &vip, TC_ACT_OK)?;
    let after = b.stats()?;
    ensure!(
        after.packets - before.packets == runs && after.flows == before.flows,
        "tc established-flow runs did not all hit conntrack: {before:?} → {after:?}"
    );

    // tc egress, the backend's reply to the established flow: its reply entry (keyed
    // by the reply's own tuple) names the flow's forward entry, which is looked up.
    let backend_id = b.flow_backend(CLIENT, 40000)?;
    let backend = backend_of(backend_id);
    let reply = tcp_frame(backend.0, backend.1, CLIENT, 40000, TCP_ACK);
    b.set_saved(&reply)?;
    b.set_jump("RUNE_BENCH_TC_JMP", "rune_bench_tc_noop")?;
    let tc_reply_driver = b.median("rune_bench_tc_driver", &reply, TC_ACT_OK)?;
    b.set_jump("RUNE_BENCH_TC_JMP", lb::PROG_TC_EGRESS)?;
    let before = b.stats()?;
    let tc_reply = b.median("rune_bench_tc_driver", &reply, TC_ACT_OK)?;
    let after = b.stats()?;
    ensure!(
        after.packets - before.packets == runs && after.flows == before.flows,
        "tc egress runs did not all reverse-translate: {before:?} → {after:?}"
    );
    let out = test_run(b.fd(lb::PROG_TC_EGRESS)?, &reply, 1)?;
    ensure!(
        out.data[26..30] == VIP && out.data[34..36] == 80u16.to_be_bytes(),
        "the reply did not leave from the VIP"
    );

    let rows = [
        ("XDP_PASS floor (rune_xdp_pass)", floor, "", None),
        ("XDP non-VIP miss (rune_xdp_lb)", miss, "", Some(31.0)),
        ("tc non-VIP miss (rune_tc_ingress)", tc_miss, "", None),
        (
            "XDP VIP hit, established flow (conntrack hit)",
            xdp_hit - xdp_driver,
            "driver subtracted",
            None,
        ),
        (
            "XDP VIP hit, new flow (SYN), conntrack not full (Maglev, 2 inserts: forward and reply)",
            xdp_syn_fresh - xdp_driver_fresh,
            "driver subtracted",
            None,
        ),
        (
            "XDP VIP hit, new flow (SYN), conntrack full (every insert evicts)",
            xdp_syn - xdp_driver_vary,
            "driver subtracted",
            None,
        ),
        (
            "XDP VIP hit, flow picked up mid-stream (ACK), conntrack not full (miss, Maglev, 2 inserts)",
            xdp_new_fresh - xdp_driver_fresh,
            "driver subtracted",
            None,
        ),
        (
            "XDP VIP hit, flow picked up mid-stream (ACK), conntrack full",
            xdp_new - xdp_driver_vary,
            "driver subtracted",
            None,
        ),
        (
            "XDP VIP hit, new flow (SYN), conntrack of 1,000 entries, full",
            small_syn,
            "driver subtracted; Katran's fallback LRU size",
            None,
        ),
        (
            "XDP VIP hit, flow picked up mid-stream (ACK), conntrack of 1,000 entries, full",
            small_ack,
            "driver subtracted; Katran's fallback LRU size",
            None,
        ),
        (
            "tc VIP hit, established flow",
            tc_hit - tc_driver,
            "driver subtracted",
            None,
        ),
        (
            "tc egress reply, reverse NAT (reply entry + conntrack lookup)",
            tc_reply - tc_reply_driver,
            "driver subtracted",
            None,
        ),
    ];
    let mut t = String::new();
    writeln!(t)?;
    writeln!(t, "## eBPF load balancer per packet (BPF_PROG_TEST_RUN)")?;
    writeln!(t)?;
    writeln!(
        t,
        "IPv4 TCP, 70-byte frame; repeat {} ({fresh} into an emptied conntrack for the \
         not-full rows), median of {RUNS} runs; conntrack {} entries per family, \
         {cpus} possible CPUs. \
         Drivers alone: XDP {xdp_driver:.1} ns, XDP new-flow {xdp_driver_vary:.1} ns, \
         tc {tc_driver:.1} ns.",
        repeat(),
        ct_entries()
    )?;
    writeln!(t)?;
    writeln!(t, "| path | ns/packet | vs XDP_PASS | note |")?;
    writeln!(t, "|---|---:|---:|---|")?;
    for (label, ns, note, target) in rows {
        let note = match target {
            Some(max) => format!("target <= {max:.0} ns"),
            None => note.to_owned(),
        };
        writeln!(t, "| {label} | {ns:.1} | {:.2}x | {note} |", ns / floor)?;
    }
    Ok(t)
}

/// Backend `id`'s address and port, as `Bench::fill_maps` writes them.
fn backend_of(id: u32) -> ([u8; 4], u16) {
    ([198, 18, 1, id as u8], 8000 + id as u16)
}

impl Bench {
    /// Loads `object` with a conntrack of `ct_entries` per family, its maps pinned in
    /// a private directory (`tag` tells two loads of one run apart), every program
    /// the bench runs loaded and the maps filled.
    fn load(object: &Path, ct_entries: u32, tag: &str) -> Result<Self> {
        let pins = PathBuf::from(format!(
            "/sys/fs/bpf/rune-bench-ebpf-{}{tag}",
            std::process::id()
        ));
        std::fs::create_dir_all(&pins)
            .with_context(|| format!("creating {} (is bpffs mounted?)", pins.display()))?;
        let cpus = u32::try_from(
            aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))?,
        )?;
        let mut loader = EbpfLoader::new();
        loader
            .override_global(lb::SERVICE_STATS_PER_CPU, &STATS_PER_CPU, true)
            .override_global(lb::BACKEND_STATS_PER_CPU, &STATS_PER_CPU, true)
            .map_max_entries(lb::SERVICE_STATS, STATS_PER_CPU * cpus)
            .map_max_entries(lb::BACKEND_STATS, STATS_PER_CPU * cpus);
        let ebpf = loader
            .map_max_entries(lb::MAGLEV, 16)
            .map_max_entries(lb::CONNTRACK_V4, ct_entries)
            .map_max_entries(lb::CONNTRACK_REPLY_V4, ct_entries)
            .default_map_pin_directory(&pins)
            .load_file(object)
            .with_context(|| format!("loading {}", object.display()));
        let mut b = Bench {
            ebpf: match ebpf {
                Ok(e) => e,
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&pins);
                    return Err(e);
                }
            },
            pins,
        };
        for name in [
            agent_common::XDP_PASS_PROGRAM,
            lb::PROG_XDP_LB,
            "rune_bench_xdp_driver",
            "rune_bench_xdp_noop",
        ] {
            let p: &mut Xdp = b.ebpf.program_mut(name).context(name)?.try_into()?;
            p.load().with_context(|| format!("loading {name}"))?;
        }
        for name in [
            lb::PROG_TC_INGRESS,
            lb::PROG_TC_EGRESS,
            "rune_bench_tc_driver",
            "rune_bench_tc_noop",
        ] {
            let p: &mut SchedClassifier = b.ebpf.program_mut(name).context(name)?.try_into()?;
            p.load().with_context(|| format!("loading {name}"))?;
        }
        b.fill_maps()?;
        Ok(b)
    }

    /// Removes every IPv4 conntrack entry, both directions, giving the entries back
    /// to the LRU lists' free lists (so that the next run inserts without evicting).
    fn clear_conntrack(&mut self) -> Result<()> {
        let mut ct: HashMap<&mut MapData, CtKeyV4, CtValue> =
            HashMap::try_from(self.ebpf.map_mut(lb::CONNTRACK_V4).context("conntrack")?)?;
        let keys = ct.keys().collect::<Result<Vec<_>, _>>()?;
        for key in &keys {
            ct.remove(key)?;
        }
        let mut replies: HashMap<&mut MapData, CtKeyV4, CtReplyV4> = HashMap::try_from(
            self.ebpf
                .map_mut(lb::CONNTRACK_REPLY_V4)
                .context("reply entries")?,
        )?;
        let keys = replies.keys().collect::<Result<Vec<_>, _>>()?;
        for key in &keys {
            replies.remove(key)?;
        }
        Ok(())
    }

    /// The backend id conntrack holds for the flow `client:sport` → VIP:80.
    fn flow_backend(&self, client: [u8; 4], sport: u16) -> Result<u32> {
        let ct: HashMap<&MapData, CtKeyV4, CtValue> =
            HashMap::try_from(self.ebpf.map(lb::CONNTRACK_V4).context("conntrack")?)?;
        let key = CtKeyV4 {
            saddr: u32::from_ne_bytes(client),
            daddr: u32::from_ne_bytes(VIP),
            sport: sport.to_be(),
            dport: 80u16.to_be(),
            proto: PROTO_TCP,
            pad: [0; 3],
        };
        Ok(ct
            .get(&key, 0)
            .context("no conntrack entry for the flow")?
            .backend_id)
    }

    fn fill_maps(&mut self) -> Result<()> {
        let mut svc: HashMap<_, ServiceKeyV4, ServiceValue> =
            HashMap::try_from(self.ebpf.map_mut(lb::SERVICES_V4).context("services")?)?;
        svc.insert(
            ServiceKeyV4 {
                addr: u32::from_ne_bytes(VIP),
                port: 80u16.to_be(),
                proto: PROTO_TCP,
                pad: 0,
            },
            ServiceValue {
                id: SERVICE_ID,
                maglev_base: 0,
                maglev_size: 7,
                affinity_timeout: 0,
            },
            0,
        )?;
        let mut backends: Array<_, Backend> =
            Array::try_from(self.ebpf.map_mut(lb::BACKENDS).context("backends")?)?;
        for id in 1..=3u32 {
            let (addr, port) = backend_of(id);
            backends.set(
                id,
                Backend {
                    addr: [u32::from_ne_bytes(addr), 0, 0, 0],
                    port: port.to_be(),
                    family: FAMILY_V4,
                    state: BACKEND_ACTIVE,
                },
                0,
            )?;
        }
        // The VIP prefilter as the agent writes it: only the VIP's bit clear (an
        // object without the map, as another build's, is measured without it).
        if let Some(map) = self.ebpf.map_mut(lb::VIP_FILTER) {
            let mut filter: Array<_, u64> = Array::try_from(map)?;
            let bit = vip_filter_bit_v4(u32::from_ne_bytes(VIP), 80u16.to_be(), PROTO_TCP);
            for word in 0..VIP_FILTER_WORDS {
                let clear = if word == bit / 64 {
                    1u64 << (bit % 64)
                } else {
                    0
                };
                filter.set(word, !clear, 0)?;
            }
        }
        // Two slots per entry (agent_common::lb::MAGLEV): slots 0..8.
        let mut maglev: Array<_, [u32; 2]> =
            Array::try_from(self.ebpf.map_mut(lb::MAGLEV).context("maglev")?)?;
        for entry in 0..4u32 {
            let slot = entry * 2;
            maglev.set(entry, [1 + slot % 3, 1 + (slot + 1) % 3], 0)?;
        }
        Ok(())
    }

    fn set_saved(&mut self, frame: &[u8]) -> Result<()> {
        let mut words = [0u64; BENCH_HEADER / 8];
        for (i, w) in words.iter_mut().enumerate() {
            *w = u64::from_ne_bytes(frame[i * 8..i * 8 + 8].try_into()?);
        }
        let mut m: Array<_, [u64; BENCH_HEADER / 8]> = Array::try_from(
            self.ebpf
                .map_mut("RUNE_BENCH_PKT")
                .context("RUNE_BENCH_PKT")?,
        )?;
        m.set(0, words, 0)?;
        Ok(())
    }

    fn set_vary(&mut self, vary: bool) -> Result<()> {
        let mut m: Array<_, u32> = Array::try_from(
            self.ebpf
                .map_mut("RUNE_BENCH_VARY")
                .context("RUNE_BENCH_VARY")?,
        )?;
        m.set(0, u32::from(vary), 0)?;
        Ok(())
    }

    fn set_jump(&mut self, map: &str, target: &str) -> Result<()> {
        let fd = self.fd(target)?;
        let mut jmp = ProgramArray::try_from(self.ebpf.map_mut(map).context("jump map")?)?;
        jmp.set(0, &fd, 0)?;
        Ok(())
    }

    fn fd(&self, name: &str) -> Result<ProgramFd> {
        let prog = self
            .ebpf
            .program(name)
            .with_context(|| format!("no program {name}"))?;
        let fd = match prog {
            aya::programs::Program::Xdp(p) => p.fd()?,
            aya::programs::Program::SchedClassifier(p) => p.fd()?,
            _ => bail!("{name}: unexpected program type"),
        };
        Ok(fd.try_clone()?)
    }

    /// The service's counters, summed over the CPU regions of `RUNE_SVC_STATS`.
    fn stats(&self) -> Result<TrafficStats> {
        let m: Array<&MapData, TrafficStats> =
            Array::try_from(self.ebpf.map(lb::SERVICE_STATS).context("stats")?)?;
        let cpus = m.len() / STATS_PER_CPU;
        (0..cpus).try_fold(TrafficStats::default(), |sum, cpu| {
            Ok(sum.add(m.get(&lb::stats_slot(cpu, STATS_PER_CPU, SERVICE_ID), 0)?))
        })
    }

    /// Median ns per iteration of `RUNS` runs of the XDP driver on `frame` (saved,
    /// varied) with `repeat` iterations each; every iteration must be a new flow.
    fn new_flows(&mut self, frame: &[u8], repeat: u32, conntrack: Conntrack) -> Result<f64> {
        let before = self.stats()?;
        let ns = self.runs("rune_bench_xdp_driver", frame, XDP_PASS, repeat, conntrack)?;
        let after = self.stats()?;
        let runs = RUNS as u64 * u64::from(repeat);
        ensure!(
            after.flows - before.flows == runs && after.packets - before.packets == runs,
            "new-flow runs were not all new flows: {before:?} → {after:?}"
        );
        Ok(ns)
    }

    /// Median ns per iteration of `RUNS` runs of `prog` on `frame`; every run must
    /// return `want`.
    fn median(&mut self, prog: &str, frame: &[u8], want: u32) -> Result<f64> {
        self.median_n(prog, frame, want, repeat())
    }

    /// As [`Self::median`], `repeat` iterations per run.
    fn median_n(&mut self, prog: &str, frame: &[u8], want: u32, repeat: u32) -> Result<f64> {
        self.runs(prog, frame, want, repeat, Conntrack::AsIs)
    }

    /// As [`Self::median_n`], with the conntrack emptied before each run or not.
    fn runs(
        &mut self,
        prog: &str,
        frame: &[u8],
        want: u32,
        repeat: u32,
        conntrack: Conntrack,
    ) -> Result<f64> {
        let fd = self.fd(prog)?;
        let mut ns = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            if conntrack == Conntrack::Emptied {
                self.clear_conntrack()?;
            }
            let out = test_run(&fd, frame, repeat)?;
            ensure!(
                out.retval == want,
                "{prog} returned {} instead of {want}",
                out.retval
            );
            ns.push(out.ns_per_run);
        }
        Ok(crate::bench::median(&mut ns))
    }
}

/// The conntrack a run starts with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Conntrack {
    /// As the previous runs left it.
    AsIs,
    /// Emptied: every entry free again.
    Emptied,
}

/// TCP flag SYN.
const TCP_SYN: u8 = 0x02;
/// TCP flag ACK.
const TCP_ACK: u8 = 0x10;

/// An Ethernet + IPv4 + TCP frame (16-byte payload, 70 bytes) with valid checksums
/// and TCP flags `flags`.
fn tcp_frame(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, flags: u8) -> Vec<u8> {
    let payload = [0x55u8; 16];
    let mut f = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x08, 0x00];
    let total = (20 + 20 + payload.len()) as u16;
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&total.to_be_bytes());
    ip.extend_from_slice(&[0, 1, 0x40, 0, 64, PROTO_TCP, 0, 0]);
    ip.extend_from_slice(&src);
    ip.extend_from_slice(&dst);
    let c = checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let mut tcp = Vec::new();
    tcp.extend_from_slice(&sport.to_be_bytes());
    tcp.extend_from_slice(&dport.to_be_bytes());
    tcp.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
    tcp.extend_from_slice(&payload);
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&src);
    pseudo.extend_from_slice(&dst);
    pseudo.extend_from_slice(&[0, PROTO_TCP]);
    pseudo.extend_from_slice(&(tcp.len() as u16).to_be_bytes());
    pseudo.extend_from_slice(&tcp);
    let c = checksum(&pseudo);
    tcp[16..18].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&tcp);
    f
}

fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The `test` member of `union bpf_attr`, zero-padded (as tests/src/prog_test_run.rs).
#[repr(C, align(8))]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    pad: u32,
}

struct TestRun {
    retval: u32,
    data: Vec<u8>,
    /// The kernel's mean per iteration (whole ns).
    ns_per_run: f64,
}

/// `BPF_PROG_TEST_RUN` of `prog` on `packet`, `repeat` times.
fn test_run(prog: impl AsFd, packet: &[u8], repeat: u32) -> Result<TestRun> {
    let mut out = vec![0u8; packet.len() + 256];
    let mut attr = TestRunAttr {
        prog_fd: prog.as_fd().as_raw_fd() as u32,
        data_size_in: packet.len() as u32,
        data_size_out: out.len() as u32,
        data_in: packet.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat,
        ..TestRunAttr::default()
    };
    // SAFETY: `attr` is a valid `bpf_attr` prefix of the size passed; the buffers it
    // points to outlive the call and `out` is writable for `data_size_out` bytes.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            10 as libc::c_long, // BPF_PROG_TEST_RUN
            &mut attr as *mut TestRunAttr,
            size_of::<TestRunAttr>(),
        )
    };
    if rc < 0 {
        bail!(
            "BPF_PROG_TEST_RUN failed: {}",
            std::io::Error::last_os_error()
        );
    }
    out.truncate(attr.data_size_out as usize);
    Ok(TestRun {
        retval: attr.retval,
        data: out,
        ns_per_run: f64::from(attr.duration),
    })
}
