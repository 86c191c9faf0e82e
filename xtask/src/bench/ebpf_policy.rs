//! The network policy program's per-packet cost (`rune_tc_policy_to`, the check of
//! a local endpoint's ingress rules) through `BPF_PROG_TEST_RUN`: part of
//! `cargo xtask bench ebpf`.
//!
//! The program never rewrites the packet, so `repeat` runs every iteration on the
//! same packet and path, and no driver is needed: an established flow hits the
//! policy conntrack each time (looked up before the guarded address, so an
//! unguarded destination's non-SYN packet misses it first), a SYN is checked against the rules each time (a
//! SYN always is; the allowed one rewrites its conntrack entry), a denied SYN is
//! dropped each time. The verdict counters prove which path ran. The guarded
//! endpoint's rule set has [`PEERS`] peer prefixes (a 10-peer policy) and two
//! ports.

use std::{fmt::Write as _, net::IpAddr, path::Path};

use agent_common::lb::{FAMILY_V4, PROTO_TCP};
use agent_common::policy::{
    self as pol, EndpointKey, EndpointPolicy, MODE_ENFORCE, PeerV4, PeerValue, PolicyDirection,
    PortKey, Verdict, verdict_slot,
};
use anyhow::{Context as _, Result, ensure};
use aya::{
    EbpfLoader,
    maps::{HashMap, MapData, PerCpuArray, lpm_trie::Key, lpm_trie::LpmTrie},
    programs::SchedClassifier,
};
use rune_harness::{
    bpffs::PinDir,
    packet::{PacketSpec, TCP_ACK, TCP_SYN},
    prog_test_run::test_run,
};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
/// Runs per figure (the median is reported).
const RUNS: usize = 7;
/// Peer prefixes of the guarded endpoint's rule set.
const PEERS: u8 = 10;
/// The guarded endpoint.
const ENDPOINT: [u8; 4] = [198, 18, 11, 2];
/// An endpoint no policy guards.
const OPEN: [u8; 4] = [198, 18, 12, 2];
/// A client the rules allow (the last of the peers).
const ALLOWED: [u8; 4] = [198, 19, 0, PEERS];
/// A client no rule names.
const DENIED: [u8; 4] = [198, 20, 0, 1];
/// The rule set's and the counter's id.
const ID: u32 = 1;

/// The section's rows, measured on `object` (the agent's) with `repeat` iterations.
pub fn measure(object: &Path, repeat: u32) -> Result<String> {
    let pins = PinDir::create("bench-ebpf-policy")?;
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(pins.path())
        .load_file(object)
        .with_context(|| format!("loading {}", object.display()))?;
    let prog: &mut SchedClassifier = ebpf
        .program_mut(pol::PROG_POLICY_TO)
        .context(pol::PROG_POLICY_TO)?
        .try_into()?;
    prog.load().context("loading the policy program")?;
    let fd = prog.fd()?.try_clone()?;
    {
        let mut eps: HashMap<&mut MapData, EndpointKey, EndpointPolicy> =
            HashMap::try_from(ebpf.map_mut(pol::ENDPOINTS).context(pol::ENDPOINTS)?)?;
        let key = EndpointKey {
            addr: [u32::from_ne_bytes(ENDPOINT), 0, 0, 0],
            family: FAMILY_V4,
            pad: [0; 3],
        };
        let ingress = PolicyDirection {
            rules: ID,
            counter: ID,
            mode: MODE_ENFORCE,
            pad: [0; 3],
        };
        let value = EndpointPolicy {
            ingress,
            egress: PolicyDirection::default(),
        };
        eps.insert(key, value, 0)?;
    }
    {
        let mut ports: HashMap<&mut MapData, PortKey, u32> =
            HashMap::try_from(ebpf.map_mut(pol::PORTS).context(pol::PORTS)?)?;
        for port in [8080u16, 8443] {
            let key = PortKey {
                set: 1,
                port: port.to_be(),
                proto: PROTO_TCP,
                pad: 0,
            };
            ports.insert(key, 1, 0)?;
        }
    }
    {
        let mut peers: LpmTrie<&mut MapData, PeerV4, PeerValue> =
            LpmTrie::try_from(ebpf.map_mut(pol::PEERS_V4).context(pol::PEERS_V4)?)?;
        for i in 1..=PEERS {
            let data = PeerV4 {
                rules: ID.to_be(),
                addr: u32::from_ne_bytes([198, 19, 0, i]),
            };
            peers.insert(&Key::new(64, data), PeerValue { ports: 1 }, 0)?;
        }
    }
    let allows = |ebpf: &aya::Ebpf, verdict: Verdict| -> Result<u64> {
        let m: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(ebpf.map(pol::VERDICTS).context(pol::VERDICTS)?)?;
        Ok(m.get(&verdict_slot(ID, verdict), 0)?.iter().sum())
    };
    let frame = |src: [u8; 4], dst: [u8; 4], flags: u8| {
        let mut spec = PacketSpec::tcp(IpAddr::from(src), 40000, IpAddr::from(dst), 8080);
        spec.tcp_flags = flags;
        spec.build()
    };
    let median = |packet: &[u8], want: u32| -> Result<f64> {
        let mut ns = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            let out = test_run(&fd, packet, repeat)?;
            ensure!(
                out.retval == want,
                "returned {} instead of {want}",
                out.retval
            );
            ns.push(f64::from(out.duration_ns));
        }
        Ok(super::common::median(&mut ns))
    };
    let runs = RUNS as u64 * u64::from(repeat);

    let unguarded = median(&frame(ALLOWED, OPEN, TCP_ACK), TC_ACT_OK)?;
    let unguarded_syn = median(&frame(ALLOWED, OPEN, TCP_SYN), TC_ACT_OK)?;
    let before = allows(&ebpf, Verdict::Allow)?;
    let allowed_new = median(&frame(ALLOWED, ENDPOINT, TCP_SYN), TC_ACT_OK)?;
    let after = allows(&ebpf, Verdict::Allow)?;
    ensure!(
        after - before == runs,
        "not every SYN was checked and allowed"
    );
    // The SYN left the flow's entry: its ACKs are established.
    let established = median(&frame(ALLOWED, ENDPOINT, TCP_ACK), TC_ACT_OK)?;
    ensure!(
        allows(&ebpf, Verdict::Allow)? == after,
        "established packets were checked against the rules"
    );
    let denied_new = median(&frame(DENIED, ENDPOINT, TCP_SYN), TC_ACT_SHOT)?;
    ensure!(
        allows(&ebpf, Verdict::DropNoMatchingRule)? == runs,
        "not every denied SYN was counted"
    );

    let mut t = String::new();
    writeln!(t)?;
    writeln!(t, "## eBPF network policy per packet (BPF_PROG_TEST_RUN)")?;
    writeln!(t)?;
    writeln!(
        t,
        "`rune_tc_policy_to` (tc egress toward a local endpoint), IPv4 TCP, 70-byte \
         frame; repeat {repeat}, median of {RUNS} runs; the endpoint guarded by a \
         {PEERS}-peer rule set with two ports."
    )?;
    writeln!(t)?;
    writeln!(t, "| path | ns/packet | ratio | note |")?;
    writeln!(t, "|---|---:|---:|---|")?;
    let rows = [
        (
            "unguarded destination (no policy)",
            unguarded,
            1.0,
            "the path without policy: a conntrack miss, then the guarded-address miss",
        ),
        (
            "unguarded destination, SYN",
            unguarded_syn,
            unguarded_syn / unguarded,
            "vs unguarded; a SYN skips the conntrack: the guarded-address miss alone",
        ),
        (
            "established allowed flow (policy conntrack hit, one lookup)",
            established,
            established / unguarded,
            "vs unguarded; target <= 1.2x",
        ),
        (
            "allowed new flow (SYN: rules, port set, conntrack write)",
            allowed_new,
            allowed_new / unguarded,
            "vs unguarded",
        ),
        (
            "denied new flow (SYN: no matching peer, dropped)",
            denied_new,
            denied_new / allowed_new,
            "vs allowed new flow; target <= 1.0x",
        ),
    ];
    for (label, ns, ratio, note) in rows {
        writeln!(t, "| {label} | {ns:.1} | {ratio:.2}x | {note} |")?;
    }
    Ok(t)
}
