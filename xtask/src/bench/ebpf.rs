//! `cargo xtask bench ebpf` (also the last section of `cargo xtask bench`): the
//! tc/XDP load balancer's per-packet cost through `BPF_PROG_TEST_RUN`, in ns per
//! packet and as a ratio to an `XDP_PASS` program on the same packet.
//!
//! The maps are those of a default node: [`FRONTENDS`] frontends (the default
//! `--lb-max-frontends`), each with a Maglev table of [`TABLE_SIZE`] slots (the
//! default `--maglev-table-size`; Katran's ring has 65,537) filled with
//! [`BACKENDS_PER_FRONTEND`] backends, the measured flow's frontend among them, and
//! the VIP prefilter written as the agent writes it (every frontend's bit clear).
//!
//! `repeat` runs every iteration on the same buffer (docs/performance.md), so the
//! rewrite paths run under a driver (`rune_bench_{xdp,tc}_driver`, from the test
//! object `agent-ebpf-test`) that restores the packet's headers and tail-calls the
//! program under test (from the agent's object); the driver with a no-op target is
//! measured the same way and subtracted. "New flow" makes the driver write a per-CPU
//! sequence number into the source address, so every iteration misses conntrack.
//! Return codes and the frontend's counters prove which path each figure ran.
//!
//! Needs root (loading programs); without it the section says so and is skipped.
//! Nothing is attached and nothing is sent on any network.

use std::{
    fmt::Write as _,
    net::IpAddr,
    os::fd::{AsFd as _, AsRawFd as _},
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
    maps::{Array, HashMap, Map, MapData, ProgramArray},
    programs::{ProgramFd, SchedClassifier, Xdp},
};
use rune_harness::{
    bpffs::PinDir,
    packet::{PacketSpec, TCP_ACK, TCP_SYN},
    prog_test_run::test_run,
    test_programs::{
        self as tp, BENCH_HEADER, BENCH_TC_DRIVER, BENCH_TC_JMP, BENCH_TC_NOOP, BENCH_XDP_DRIVER,
        BENCH_XDP_JMP, BENCH_XDP_NOOP,
    },
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

/// Frontends in the maps: the default `--lb-max-frontends`.
const FRONTENDS: u32 = 512;
/// Slots of every frontend's Maglev table: the default `--maglev-table-size`.
const TABLE_SIZE: u32 = 16_381;
/// Backends of every frontend (each frontend its own).
const BACKENDS_PER_FRONTEND: u32 = 10;
/// Backend ids the maps hold: the default `--lb-max-backends`.
const MAX_BACKENDS: u32 = 65_536;
/// The measured flow's frontend (its id, as the agent numbers them from 0), one of
/// [`FRONTENDS`] and not the first.
const SERVICE_ID: u32 = 313;
// The row labels name these sizes.
const _: () = assert!(FRONTENDS == 512 && TABLE_SIZE == 16_381);

const XDP_PASS: u32 = 2;
const TC_ACT_OK: u32 = 0;

/// The measured frontend's VIP (port 80, TCP).
const VIP: [u8; 4] = [198, 18, 100, 1];
const NON_VIP: [u8; 4] = [198, 18, 200, 1];
const CLIENT: [u8; 4] = [198, 19, 0, 10];

/// Frontend `id`'s VIP (port 80, TCP): [`VIP`] for the measured one, 198.18.160.0
/// onwards for the others.
fn frontend_vip(id: u32) -> [u8; 4] {
    if id == SERVICE_ID {
        VIP
    } else {
        [198, 18, 160 + (id / 256) as u8, (id % 256) as u8]
    }
}

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
    // The drivers and the floor come from this tree's test object; the programs
    // measured from the agent's object, or from `RUNE_BENCH_EBPF_OBJECT`: another
    // build's agent object, to compare two builds back to back under the same load
    // (objects with reply entries: their conntrack layout is read here).
    let objects = crate::build_ebpf::build()?;
    let object = std::env::var_os("RUNE_BENCH_EBPF_OBJECT").map_or(objects.agent, PathBuf::from);
    // `RUNE_BENCH_EBPF_ONLY=policy`: the policy section alone (a before/after
    // comparison of the policy program need not wait for the load balancer's).
    let policy_only = std::env::var("RUNE_BENCH_EBPF_ONLY").is_ok_and(|v| v == "policy");
    let mut report = if policy_only {
        String::new()
    } else {
        measure(&object, &objects.test)?
    };
    report.push_str(&super::ebpf_policy::measure(&object, repeat())?);
    Ok(report)
}

/// The agent's object loaded with a default node's maps (pinned in a private
/// directory), and the test object with the drivers and the floor.
struct Bench {
    ebpf: Ebpf,
    test: Ebpf,
    _pins: PinDir,
}

/// A 70-byte IPv4 TCP frame (16-byte payload) from `src:sport` to `dst:dport`.
fn tcp_frame(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, flags: u8) -> Vec<u8> {
    let mut spec = PacketSpec::tcp(IpAddr::from(src), sport, IpAddr::from(dst), dport);
    spec.tcp_flags = flags;
    spec.build()
}

fn measure(object: &Path, test_object: &Path) -> Result<String> {
    let mut b = Bench::load(object, test_object, ct_entries())?;

    let vip = tcp_frame(CLIENT, 40000, VIP, 80, TCP_ACK);
    let vip_syn = tcp_frame(CLIENT, 40000, VIP, 80, TCP_SYN);
    let non_vip = tcp_frame(CLIENT, 40000, NON_VIP, 80, TCP_ACK);
    b.set_saved(&vip)?;
    b.set_vary(false)?;

    let floor = b.median(tp::XDP_PASS, &vip, XDP_PASS)?;
    let miss = b.median(lb::PROG_XDP_LB, &non_vip, XDP_PASS)?;
    let out = test_run(b.fd(lb::PROG_XDP_LB)?, &non_vip, 1)?;
    ensure!(out.data == non_vip, "the non-VIP packet was changed");
    let tc_miss = b.median(lb::PROG_TC_INGRESS, &non_vip, TC_ACT_OK)?;

    // Established flow: the first iteration creates the entry, the rest hit it.
    b.set_jump(BENCH_XDP_JMP, BENCH_XDP_NOOP)?;
    let xdp_driver = b.median(BENCH_XDP_DRIVER, &vip, XDP_PASS)?;
    b.set_jump(BENCH_XDP_JMP, lb::PROG_XDP_LB)?;
    let before = b.stats()?;
    let xdp_hit = b.median(BENCH_XDP_DRIVER, &vip, XDP_PASS)?;
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
    b.set_jump(BENCH_XDP_JMP, BENCH_XDP_NOOP)?;
    let xdp_driver_vary = b.median(BENCH_XDP_DRIVER, &vip, XDP_PASS)?;
    let xdp_driver_fresh = b.median_n(BENCH_XDP_DRIVER, &vip, XDP_PASS, fresh)?;
    b.set_jump(BENCH_XDP_JMP, lb::PROG_XDP_LB)?;
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
    let out = test_run(b.fd(BENCH_XDP_DRIVER)?, &vip, 1)?;
    ensure!(out.retval == XDP_PASS, "re-establishing the flow failed");

    // The same full runs on a conntrack of 1,000 entries: the size of the LRU that
    // takes Katran's new flows when no per-CPU LRU is set up for the CPU (its
    // `fallback_cache`), as in a BPF_PROG_TEST_RUN measurement of Katran. The table
    // fits in the caches, which the default size does not.
    let (small_syn, small_ack) = {
        let mut k = Bench::load(object, test_object, SMALL_CT_ENTRIES)?;
        k.set_saved(&vip)?;
        k.set_vary(true)?;
        k.set_jump(BENCH_XDP_JMP, BENCH_XDP_NOOP)?;
        let driver = k.median(BENCH_XDP_DRIVER, &vip, XDP_PASS)?;
        k.set_jump(BENCH_XDP_JMP, lb::PROG_XDP_LB)?;
        let ack = k.new_flows(&vip, repeat(), Conntrack::AsIs)?;
        k.set_saved(&vip_syn)?;
        let syn = k.new_flows(&vip_syn, repeat(), Conntrack::AsIs)?;
        (syn - driver, ack - driver)
    };

    // tc, established flow.
    b.set_jump(BENCH_TC_JMP, BENCH_TC_NOOP)?;
    let tc_driver = b.median(BENCH_TC_DRIVER, &vip, TC_ACT_OK)?;
    b.set_jump(BENCH_TC_JMP, lb::PROG_TC_INGRESS)?;
    let before = b.stats()?;
    let tc_hit = b.median(BENCH_TC_DRIVER, &vip, TC_ACT_OK)?;
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
    b.set_jump(BENCH_TC_JMP, BENCH_TC_NOOP)?;
    let tc_reply_driver = b.median(BENCH_TC_DRIVER, &reply, TC_ACT_OK)?;
    b.set_jump(BENCH_TC_JMP, lb::PROG_TC_EGRESS)?;
    let before = b.stats()?;
    let tc_reply = b.median(BENCH_TC_DRIVER, &reply, TC_ACT_OK)?;
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
            "XDP VIP hit, established flow (conntrack hit), 512 frontends",
            xdp_hit - xdp_driver,
            "driver subtracted",
            None,
        ),
        (
            "XDP VIP hit, new flow (SYN), conntrack not full (Maglev 16,381 slots, 2 inserts: forward and reply)",
            xdp_syn_fresh - xdp_driver_fresh,
            "driver subtracted",
            None,
        ),
        (
            "XDP VIP hit, new flow (SYN), conntrack full (Maglev 16,381 slots, every insert evicts)",
            xdp_syn - xdp_driver_vary,
            "driver subtracted",
            None,
        ),
        (
            "XDP VIP hit, flow picked up mid-stream (ACK), conntrack not full (miss, Maglev 16,381 slots, 2 inserts)",
            xdp_new_fresh - xdp_driver_fresh,
            "driver subtracted",
            None,
        ),
        (
            "XDP VIP hit, flow picked up mid-stream (ACK), conntrack full (Maglev 16,381 slots)",
            xdp_new - xdp_driver_vary,
            "driver subtracted",
            None,
        ),
        (
            "XDP VIP hit, new flow (SYN), conntrack of 1,000 entries, full (Maglev 16,381 slots)",
            small_syn,
            "driver subtracted; Katran's fallback LRU size",
            None,
        ),
        (
            "XDP VIP hit, flow picked up mid-stream (ACK), conntrack of 1,000 entries, full (Maglev 16,381 slots)",
            small_ack,
            "driver subtracted; Katran's fallback LRU size",
            None,
        ),
        (
            "tc VIP hit, established flow, 512 frontends",
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
         {cpus} possible CPUs. Maps of a default node: 512 frontends with a \
         Maglev table of 16,381 slots each ({BACKENDS_PER_FRONTEND} backends; \
         Katran's ring: 65,537 slots), the measured VIP one of them, the VIP \
         prefilter as the agent writes it. \
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

/// Backend `id`'s address and port, as `Bench::fill_maps` writes them: 198.18.16.0
/// onwards.
fn backend_of(id: u32) -> ([u8; 4], u16) {
    (
        [198, 18, 16 + (id / 256) as u8, (id % 256) as u8],
        8000 + (id % 1000) as u16,
    )
}

/// A 64-bit mix (splitmix64's finalizer): where a slot's backend falls.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Bench {
    /// Loads `object` (the agent's) with a default node's map sizes and a conntrack
    /// of `ct_entries` per family, its maps pinned in a private directory, and
    /// `test_object` (drivers and floor); loads every program the bench runs and
    /// fills the maps.
    fn load(object: &Path, test_object: &Path, ct_entries: u32) -> Result<Self> {
        let pins = PinDir::create("bench-ebpf")?;
        let cpus = u32::try_from(
            aya::util::nr_cpus().map_err(|(what, e)| anyhow::anyhow!("{what}: {e}"))?,
        )?;
        // The counters arrays as the agent sizes them: a region per CPU, one entry
        // per frontend or backend id.
        let mut loader = EbpfLoader::new();
        loader
            .override_global(lb::SERVICE_STATS_PER_CPU, &FRONTENDS, true)
            .override_global(lb::BACKEND_STATS_PER_CPU, &MAX_BACKENDS, true)
            .map_max_entries(lb::SERVICE_STATS, FRONTENDS * cpus)
            .map_max_entries(lb::BACKEND_STATS, MAX_BACKENDS * cpus);
        let mut ebpf = loader
            .map_max_entries(lb::SERVICES_V4, FRONTENDS)
            .map_max_entries(lb::SERVICES_V6, FRONTENDS)
            .map_max_entries(lb::BACKENDS, MAX_BACKENDS)
            .map_max_entries(
                lb::MAGLEV,
                (FRONTENDS * TABLE_SIZE).div_ceil(lb::MAGLEV_SLOTS_PER_ENTRY),
            )
            .map_max_entries(lb::CONNTRACK_V4, ct_entries)
            .map_max_entries(lb::CONNTRACK_REPLY_V4, ct_entries)
            .default_map_pin_directory(pins.path())
            .load_file(object)
            .with_context(|| format!("loading {}", object.display()))?;
        let mut test = Ebpf::load_file(test_object)
            .with_context(|| format!("loading {}", test_object.display()))?;
        // (object, program, XDP or tc)
        let programs = [
            (false, lb::PROG_XDP_LB, true),
            (true, tp::XDP_PASS, true),
            (true, BENCH_XDP_DRIVER, true),
            (true, BENCH_XDP_NOOP, true),
            (false, lb::PROG_TC_INGRESS, false),
            (false, lb::PROG_TC_EGRESS, false),
            (true, BENCH_TC_DRIVER, false),
            (true, BENCH_TC_NOOP, false),
        ];
        for (in_test, name, xdp) in programs {
            let obj = if in_test { &mut test } else { &mut ebpf };
            let prog = obj.program_mut(name).context(name)?;
            if xdp {
                let p: &mut Xdp = prog.try_into()?;
                p.load()
            } else {
                let p: &mut SchedClassifier = prog.try_into()?;
                p.load()
            }
            .with_context(|| format!("loading {name}"))?;
        }
        let mut b = Bench {
            ebpf,
            test,
            _pins: pins,
        };
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

    /// The maps as the agent fills them for [`FRONTENDS`] frontends: each frontend
    /// (id `i`, VIP [`frontend_vip`], port 80, TCP) with its own
    /// [`BACKENDS_PER_FRONTEND`] backends spread over its [`TABLE_SIZE`] slots at
    /// `maglev_base = i * TABLE_SIZE`, and the VIP prefilter with every frontend's
    /// bit clear.
    fn fill_maps(&mut self) -> Result<()> {
        let mut svc: HashMap<_, ServiceKeyV4, ServiceValue> =
            HashMap::try_from(self.ebpf.map_mut(lb::SERVICES_V4).context("services")?)?;
        for id in 0..FRONTENDS {
            svc.insert(
                ServiceKeyV4 {
                    addr: u32::from_ne_bytes(frontend_vip(id)),
                    port: 80u16.to_be(),
                    proto: PROTO_TCP,
                    pad: 0,
                },
                ServiceValue {
                    id,
                    maglev_base: id * TABLE_SIZE,
                    maglev_size: TABLE_SIZE,
                    affinity_timeout: 0,
                },
                0,
            )?;
        }
        let mut backends: Array<_, Backend> =
            Array::try_from(self.ebpf.map_mut(lb::BACKENDS).context("backends")?)?;
        for id in 1..=FRONTENDS * BACKENDS_PER_FRONTEND {
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
        // The VIP prefilter as the agent writes it: every frontend's bit clear (an
        // object without the map, as another build's, is measured without it).
        if let Some(map) = self.ebpf.map_mut(lb::VIP_FILTER) {
            let mut words = vec![u64::MAX; VIP_FILTER_WORDS as usize];
            for id in 0..FRONTENDS {
                let bit = vip_filter_bit_v4(
                    u32::from_ne_bytes(frontend_vip(id)),
                    80u16.to_be(),
                    PROTO_TCP,
                );
                words[(bit / 64) as usize] &= !(1u64 << (bit % 64));
            }
            let mut filter: Array<_, u64> = Array::try_from(map)?;
            for (i, word) in words.into_iter().enumerate() {
                filter.set(i as u32, word, 0)?;
            }
        }
        // The tables, written through a mapping of the array (as the agent does;
        // BPF_F_MMAPABLE): frontend i's slots are i * TABLE_SIZE onwards, each naming
        // one of its own backends, spread as Maglev spreads them (pseudo-randomly,
        // each backend about TABLE_SIZE / BACKENDS_PER_FRONTEND slots).
        let maglev = self.ebpf.map(lb::MAGLEV).context("maglev")?;
        let Map::Array(data) = maglev else {
            bail!("{} is not an array", lb::MAGLEV);
        };
        let slots = data.info()?.max_entries() as usize * lb::MAGLEV_SLOTS_PER_ENTRY as usize;
        ensure!(
            slots >= (FRONTENDS * TABLE_SIZE) as usize,
            "{} too small",
            lb::MAGLEV
        );
        // SAFETY: the array's fd maps shared (BPF_F_MMAPABLE), `slots * 4` bytes; the
        // mapping is checked before use and unmapped below, and nothing else holds it.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                slots * 4,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                data.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            bail!(
                "mmap of {}: {}",
                lb::MAGLEV,
                std::io::Error::last_os_error()
            );
        }
        // SAFETY: `ptr` is a live, writable mapping of `slots` u32s, aligned.
        let table = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<u32>(), slots) };
        for id in 0..FRONTENDS {
            for slot in 0..TABLE_SIZE {
                let pick =
                    mix(u64::from(id) << 32 | u64::from(slot)) % u64::from(BACKENDS_PER_FRONTEND);
                table[(id * TABLE_SIZE + slot) as usize] =
                    1 + id * BACKENDS_PER_FRONTEND + pick as u32;
            }
        }
        // SAFETY: exactly the mapping made above; `table` is not used after this.
        unsafe { libc::munmap(ptr, slots * 4) };
        Ok(())
    }

    fn set_saved(&mut self, frame: &[u8]) -> Result<()> {
        let mut words = [0u64; BENCH_HEADER / 8];
        for (i, w) in words.iter_mut().enumerate() {
            *w = u64::from_ne_bytes(frame[i * 8..i * 8 + 8].try_into()?);
        }
        let mut m: Array<_, [u64; BENCH_HEADER / 8]> =
            Array::try_from(self.test.map_mut(tp::BENCH_PKT).context(tp::BENCH_PKT)?)?;
        m.set(0, words, 0)?;
        Ok(())
    }

    fn set_vary(&mut self, vary: bool) -> Result<()> {
        let mut m: Array<_, u32> =
            Array::try_from(self.test.map_mut(tp::BENCH_VARY).context(tp::BENCH_VARY)?)?;
        m.set(0, u32::from(vary), 0)?;
        Ok(())
    }

    /// Puts program `target` (of either object) at index 0 of the driver's jump
    /// table `map`.
    fn set_jump(&mut self, map: &str, target: &str) -> Result<()> {
        let fd = self.fd(target)?;
        let mut jmp = ProgramArray::try_from(self.test.map_mut(map).context("jump map")?)?;
        jmp.set(0, &fd, 0)?;
        Ok(())
    }

    /// Program `name`, from the agent's object or the test object.
    fn fd(&self, name: &str) -> Result<ProgramFd> {
        let prog = self
            .ebpf
            .program(name)
            .or_else(|| self.test.program(name))
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
        let cpus = m.len() / FRONTENDS;
        (0..cpus).try_fold(TrafficStats::default(), |sum, cpu| {
            Ok(sum.add(m.get(&lb::stats_slot(cpu, FRONTENDS, SERVICE_ID), 0)?))
        })
    }

    /// Median ns per iteration of `RUNS` runs of the XDP driver on `frame` (saved,
    /// varied) with `repeat` iterations each; every iteration must be a new flow.
    fn new_flows(&mut self, frame: &[u8], repeat: u32, conntrack: Conntrack) -> Result<f64> {
        let before = self.stats()?;
        let ns = self.runs(BENCH_XDP_DRIVER, frame, XDP_PASS, repeat, conntrack)?;
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
            ns.push(f64::from(out.duration_ns));
        }
        Ok(super::common::median(&mut ns))
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
