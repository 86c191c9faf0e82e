//! The tc/XDP load-balancing programs (`rune_xdp_lb`, `rune_tc_ingress`,
//! `rune_tc_egress`) on crafted packets through `BPF_PROG_TEST_RUN`: nothing is sent
//! on any network. Needs root (loading programs, bpffs).
//!
//! Each test loads its own copy of the embedded object with its maps pinned in a
//! fresh directory under /sys/fs/bpf (removed on drop), fills the maps by hand
//! (frontend → Maglev slots → backends), runs packets and checks the bytes that come
//! out (checksums recomputed from scratch), the return codes, conntrack and counters.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
};

use agent_common::{
    filter::{VIP_FILTER_WORDS, vip_filter_bit_v4, vip_filter_bit_v6},
    hash::{FLOW_HASH_SEED, flow_hash_v4, flow_hash_v6},
    lb::{
        self, BACKEND_ACTIVE, Backend, CtKeyV4, CtKeyV6, CtReplyV4, CtValue, DropReason, FAMILY_V4,
        FAMILY_V6, PROTO_TCP, PROTO_UDP, ServiceKeyV4, ServiceKeyV6, ServiceValue, TrafficStats,
        addr_from_octets,
    },
};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray},
    programs::{SchedClassifier, Xdp},
};
use rune_agent::dataplane::ebpf::{
    EMBEDDED_OBJECT,
    stats::{self, StatsLayout},
};
use rune_harness::{
    bpffs::PinDir,
    netns::require_root,
    packet::{PacketSpec, TCP_ACK, TCP_RST, TCP_SYN, parse_and_verify, parse_icmp_error},
    prog_test_run::{TestRun, test_run},
};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const TC_ACT_REDIRECT: u32 = 7;
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;

/// Maglev slots the tests' tables use in all.
const MAGLEV_SLOTS: u32 = 64;
/// Entries per CPU of the counters arrays (frontend and backend ids are small).
const STATS_ENTRIES: u32 = 1024;
/// Every table is this long (a prime).
const TABLE: u32 = 7;

const VIP4: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 1);
const VIP4_EMPTY: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 2);
/// A second IPv4 VIP whose backends are those of [`SVC_TCP4`] (shared backends).
const VIP4_SHARED: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 3);
const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x100);
const CLIENT4: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xc, 0, 0, 0, 0, 10);

/// One frontend as the tests define it: its backends take the table's slots in turn.
struct Svc {
    id: u32,
    vip: IpAddr,
    port: u16,
    proto: u8,
    /// Backend ids (empty: `maglev_size` 0, no backend).
    backends: &'static [u32],
}

const SVC_TCP4: Svc = Svc {
    id: 1,
    vip: IpAddr::V4(VIP4),
    port: 80,
    proto: PROTO_TCP,
    backends: &[1, 2, 3],
};
const SVC_UDP4: Svc = Svc {
    id: 2,
    vip: IpAddr::V4(VIP4),
    port: 53,
    proto: PROTO_UDP,
    backends: &[4, 5],
};
const SVC_TCP6: Svc = Svc {
    id: 3,
    vip: IpAddr::V6(VIP6),
    port: 443,
    proto: PROTO_TCP,
    backends: &[6, 7],
};
const SVC_UDP6: Svc = Svc {
    id: 4,
    vip: IpAddr::V6(VIP6),
    port: 53,
    proto: PROTO_UDP,
    backends: &[6, 7],
};
const SVC_EMPTY: Svc = Svc {
    id: 5,
    vip: IpAddr::V4(VIP4_EMPTY),
    port: 80,
    proto: PROTO_TCP,
    backends: &[],
};
const SVC_SHARED: Svc = Svc {
    id: 6,
    vip: IpAddr::V4(VIP4_SHARED),
    port: 8080,
    proto: PROTO_TCP,
    backends: &[1, 2, 3],
};
const SVC_EMPTY6: Svc = Svc {
    id: 7,
    vip: IpAddr::V6(VIP6),
    port: 8443,
    proto: PROTO_TCP,
    backends: &[],
};
const SVC_EMPTY_UDP: Svc = Svc {
    id: 8,
    vip: IpAddr::V4(VIP4_EMPTY),
    port: 53,
    proto: PROTO_UDP,
    backends: &[],
};
const SVC_EMPTY_UDP6: Svc = Svc {
    id: 9,
    vip: IpAddr::V6(VIP6),
    port: 5353,
    proto: PROTO_UDP,
    backends: &[],
};
const ALL_SVCS: [&Svc; 9] = [
    &SVC_TCP4,
    &SVC_UDP4,
    &SVC_TCP6,
    &SVC_UDP6,
    &SVC_EMPTY,
    &SVC_SHARED,
    &SVC_EMPTY6,
    &SVC_EMPTY_UDP,
    &SVC_EMPTY_UDP6,
];

/// A backend of [`SVC_TCP4`] other than `id`.
fn other_backend(id: u32) -> u32 {
    SVC_TCP4
        .backends
        .iter()
        .copied()
        .find(|&b| b != id)
        .unwrap()
}

/// Backend `id`'s address and port: 198.18.1.id / 2001:db8:1::id, port 8000 + id.
fn backend_of(id: u32) -> (IpAddr, u16) {
    let port = 8000 + id as u16;
    if id <= 5 {
        (IpAddr::V4(Ipv4Addr::new(198, 18, 1, id as u8)), port)
    } else {
        (
            IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, id as u16)),
            port,
        )
    }
}

fn octets(addr: IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// The loaded object with the three programs loaded and the maps filled.
struct Lb {
    ebpf: Ebpf,
    // Dropped after `ebpf`: unpins once nothing uses the maps.
    _pins: PinDir,
}

impl Lb {
    fn new() -> Self {
        if let Err(e) = require_root() {
            panic!("{e}");
        }
        assert!(!EMBEDDED_OBJECT.is_empty(), "agent built without eBPF");
        let pins = PinDir::create("ebpf-packet").unwrap_or_else(|e| panic!("{e:#}"));
        let layout = StatsLayout::new(pins.path(), STATS_ENTRIES, STATS_ENTRIES).unwrap();
        let mut loader = EbpfLoader::new();
        layout.configure(&mut loader);
        let mut ebpf = loader
            .map_max_entries(lb::MAGLEV, MAGLEV_SLOTS)
            .default_map_pin_directory(pins.path())
            .load(EMBEDDED_OBJECT)
            .unwrap_or_else(|e| panic!("load the object: {e:#}"));
        {
            let xdp: &mut Xdp = ebpf
                .program_mut(lb::PROG_XDP_LB)
                .expect("rune_xdp_lb")
                .try_into()
                .unwrap();
            xdp.load()
                .unwrap_or_else(|e| panic!("load rune_xdp_lb: {e:#?}"));
        }
        for name in [lb::PROG_TC_INGRESS, lb::PROG_TC_EGRESS] {
            let tc: &mut SchedClassifier = ebpf.program_mut(name).expect(name).try_into().unwrap();
            tc.load().unwrap_or_else(|e| panic!("load {name}: {e:#?}"));
        }
        let mut lb = Self { ebpf, _pins: pins };
        for (i, svc) in ALL_SVCS.iter().enumerate() {
            lb.add_service(svc, i as u32 * TABLE);
        }
        lb
    }

    fn add_service(&mut self, svc: &Svc, base: u32) {
        let value = ServiceValue {
            id: svc.id,
            maglev_base: base,
            maglev_size: if svc.backends.is_empty() { 0 } else { TABLE },
            affinity_timeout: 0,
        };
        match svc.vip {
            IpAddr::V4(vip) => {
                let mut m: HashMap<_, ServiceKeyV4, ServiceValue> =
                    HashMap::try_from(self.ebpf.map_mut(lb::SERVICES_V4).unwrap()).unwrap();
                let key = ServiceKeyV4 {
                    addr: u32::from_ne_bytes(vip.octets()),
                    port: svc.port.to_be(),
                    proto: svc.proto,
                    pad: 0,
                };
                m.insert(key, value, 0).unwrap();
            }
            IpAddr::V6(vip) => {
                let mut m: HashMap<_, ServiceKeyV6, ServiceValue> =
                    HashMap::try_from(self.ebpf.map_mut(lb::SERVICES_V6).unwrap()).unwrap();
                let key = ServiceKeyV6 {
                    addr: addr_from_octets(&vip.octets()),
                    port: svc.port.to_be(),
                    proto: svc.proto,
                    pad: 0,
                };
                m.insert(key, value, 0).unwrap();
            }
        }
        for &id in svc.backends {
            self.set_backend(id, true);
        }
        if !svc.backends.is_empty() {
            let mut maglev: Array<_, [u32; 2]> =
                Array::try_from(self.ebpf.map_mut(lb::MAGLEV).unwrap()).unwrap();
            for slot in 0..TABLE {
                let id = svc.backends[slot as usize % svc.backends.len()];
                rune_agent_tests::maps::set_maglev_slot(&mut maglev, base + slot, id);
            }
        }
    }

    /// Writes the VIP prefilter as the agent does, with only the bits of `pass`
    /// clear (a frontend missing from `pass` is filtered out before its lookup).
    fn set_vip_filter(&mut self, pass: &[&Svc]) {
        let mut words = vec![u64::MAX; VIP_FILTER_WORDS as usize];
        for svc in pass {
            let bit = match svc.vip {
                IpAddr::V4(vip) => vip_filter_bit_v4(
                    u32::from_ne_bytes(vip.octets()),
                    svc.port.to_be(),
                    svc.proto,
                ),
                IpAddr::V6(vip) => vip_filter_bit_v6(
                    &addr_from_octets(&vip.octets()),
                    svc.port.to_be(),
                    svc.proto,
                ),
            };
            words[(bit / 64) as usize] &= !(1u64 << (bit % 64));
        }
        let mut filter: Array<_, u64> =
            Array::try_from(self.ebpf.map_mut(lb::VIP_FILTER).unwrap()).unwrap();
        for (i, word) in words.into_iter().enumerate() {
            filter.set(i as u32, word, 0).unwrap();
        }
    }

    /// Fills (or, with `present` false, empties) backend slot `id`.
    fn set_backend(&mut self, id: u32, present: bool) {
        let (addr, port) = backend_of(id);
        let backend = if present {
            Backend {
                addr: addr_from_octets(&octets(addr)),
                port: port.to_be(),
                family: if addr.is_ipv4() { FAMILY_V4 } else { FAMILY_V6 },
                state: BACKEND_ACTIVE,
            }
        } else {
            Backend::default()
        };
        let mut m: Array<_, Backend> =
            Array::try_from(self.ebpf.map_mut(lb::BACKENDS).unwrap()).unwrap();
        m.set(id, backend, 0).unwrap();
    }

    /// The backend id a new flow from `client:sport` to `svc` must get (Maglev slot
    /// of the flow hash, as the agent's tables are read).
    fn expected_backend(&self, svc: &Svc, client: IpAddr, sport: u16) -> u32 {
        let hash = match client {
            IpAddr::V4(c) => flow_hash_v4(u32::from(c), sport, FLOW_HASH_SEED),
            IpAddr::V6(c) => {
                let o = c.octets();
                let w = |i: usize| u32::from_be_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
                flow_hash_v6([w(0), w(4), w(8), w(12)], sport, FLOW_HASH_SEED)
            }
        };
        let base = ALL_SVCS.iter().position(|s| s.id == svc.id).unwrap() as u32 * TABLE;
        let maglev: Array<&MapData, [u32; 2]> =
            Array::try_from(self.ebpf.map(lb::MAGLEV).unwrap()).unwrap();
        rune_agent_tests::maps::maglev_slot(&maglev, base + hash % TABLE)
    }

    fn run(&self, prog: &str, packet: &[u8]) -> anyhow::Result<TestRun> {
        let fd = match prog {
            lb::PROG_XDP_LB => {
                let p: &Xdp = self.ebpf.program(prog).unwrap().try_into().unwrap();
                p.fd().unwrap().try_clone().unwrap()
            }
            _ => {
                let p: &SchedClassifier = self.ebpf.program(prog).unwrap().try_into().unwrap();
                p.fd().unwrap().try_clone().unwrap()
            }
        };
        test_run(&fd, packet, 1)
    }

    fn service_stats(&self, id: u32) -> TrafficStats {
        self.stats(lb::SERVICE_STATS, id)
    }

    fn backend_stats(&self, id: u32) -> TrafficStats {
        self.stats(lb::BACKEND_STATS, id)
    }

    fn stats(&self, name: &str, id: u32) -> TrafficStats {
        let m: Array<&MapData, TrafficStats> =
            Array::try_from(self.ebpf.map(name).unwrap()).unwrap();
        stats::read(&m, id).unwrap()
    }

    fn drops(&self, reason: DropReason) -> u64 {
        let m: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(self.ebpf.map(lb::DROPS).unwrap()).unwrap();
        m.get(&(reason as u32), 0).unwrap().iter().sum()
    }

    fn ct_v4(&self, key: &CtKeyV4) -> Option<CtValue> {
        let m: HashMap<&MapData, CtKeyV4, CtValue> =
            HashMap::try_from(self.ebpf.map(lb::CONNTRACK_V4).unwrap()).unwrap();
        m.get(key, 0).ok()
    }

    /// Conntrack entries of both families.
    fn ct_len(&self) -> usize {
        let v4: HashMap<&MapData, CtKeyV4, CtValue> =
            HashMap::try_from(self.ebpf.map(lb::CONNTRACK_V4).unwrap()).unwrap();
        let v6: HashMap<&MapData, CtKeyV6, CtValue> =
            HashMap::try_from(self.ebpf.map(lb::CONNTRACK_V6).unwrap()).unwrap();
        v4.keys().count() + v6.keys().count()
    }

    fn set_ct_v4(&mut self, key: &CtKeyV4, value: CtValue) {
        let mut m: HashMap<&mut MapData, CtKeyV4, CtValue> =
            HashMap::try_from(self.ebpf.map_mut(lb::CONNTRACK_V4).unwrap()).unwrap();
        m.insert(key, value, 0).unwrap();
    }

    fn ct_v6(&self, key: &CtKeyV6) -> Option<CtValue> {
        let m: HashMap<&MapData, CtKeyV6, CtValue> =
            HashMap::try_from(self.ebpf.map(lb::CONNTRACK_V6).unwrap()).unwrap();
        m.get(key, 0).ok()
    }
}

fn vip_packet(svc: &Svc, client: IpAddr, sport: u16) -> PacketSpec {
    if svc.proto == PROTO_TCP {
        PacketSpec::tcp(client, sport, svc.vip, svc.port)
    } else {
        PacketSpec::udp(client, sport, svc.vip, svc.port)
    }
}

/// A TCP segment with only ACK set: an established flow's packet.
fn tcp_ack(src: IpAddr, sport: u16, dst: IpAddr, dport: u16) -> PacketSpec {
    let mut spec = PacketSpec::tcp(src, sport, dst, dport);
    spec.tcp_flags = TCP_ACK;
    spec
}

/// Runs a VIP packet through `prog` and checks it left translated to the backend
/// its flow hash selects in the table, with valid checksums; returns that backend id.
fn expect_dnat(lb: &Lb, prog: &str, spec: &PacketSpec, svc: &Svc) -> u32 {
    let want_id = lb.expected_backend(svc, spec.src, spec.sport);
    expect_dnat_to(lb, prog, spec, want_id)
}

/// As [`expect_dnat`], to backend `want_id` (e.g. the one conntrack remembers).
fn expect_dnat_to(lb: &Lb, prog: &str, spec: &PacketSpec, want_id: u32) -> u32 {
    let pass = if prog == lb::PROG_XDP_LB {
        XDP_PASS
    } else {
        TC_ACT_OK
    };
    let frame = spec.build();
    let out = lb.run(prog, &frame).unwrap();
    assert_eq!(out.retval, pass, "{prog}: return code");
    assert_eq!(out.data.len(), frame.len(), "{prog}: length changed");
    let got = parse_and_verify(&out.data).unwrap_or_else(|e| panic!("{prog}: {e:#}"));
    let (addr, port) = backend_of(want_id);
    assert_eq!((got.dst, got.dport), (addr, port), "{prog}: backend");
    assert_eq!(
        (got.src, got.sport),
        (spec.src, spec.sport),
        "{prog}: source"
    );
    // Only the destination address, port and checksums changed.
    let l3 = 14;
    let mut want = frame.clone();
    let mut back = out.data.clone();
    let (dst_at, len) = if spec.src.is_ipv4() {
        (l3 + 16, 4)
    } else {
        (l3 + 24, 16)
    };
    for buf in [&mut want, &mut back] {
        buf[dst_at..dst_at + len].fill(0);
        if spec.src.is_ipv4() {
            buf[l3 + 10..l3 + 12].fill(0);
        }
    }
    let l4 = if spec.src.is_ipv4() {
        l3 + 20 + spec.ip_options.len()
    } else {
        l3 + 40
    };
    let check = l4 + if spec.proto == PROTO_TCP { 16 } else { 6 };
    for buf in [&mut want, &mut back] {
        buf[l4 + 2..l4 + 4].fill(0);
        buf[check..check + 2].fill(0);
    }
    assert_eq!(
        want, back,
        "{prog}: bytes other than the translated ones changed"
    );
    want_id
}

#[test]
fn xdp_vip_hit_translates_and_conntrack_keeps_the_backend() {
    let lb = Lb::new();
    let client = IpAddr::V4(CLIENT4);
    let spec = vip_packet(&SVC_TCP4, client, 40000);
    let id = expect_dnat(&lb, lb::PROG_XDP_LB, &spec, &SVC_TCP4);
    // One conntrack entry per flow, keyed as the client sent the packet.
    let fwd = CtKeyV4 {
        saddr: u32::from_ne_bytes(CLIENT4.octets()),
        daddr: u32::from_ne_bytes(VIP4.octets()),
        sport: 40000u16.to_be(),
        dport: 80u16.to_be(),
        proto: PROTO_TCP,
        pad: [0; 3],
    };
    let ct = lb.ct_v4(&fwd).expect("conntrack entry");
    assert_eq!((ct.backend_id, ct.service_id), (id, SVC_TCP4.id));
    assert_eq!(lb.ct_len(), 1, "exactly one entry for the new flow");

    // The second packet of the flow: conntrack hit, same backend, no new flow.
    assert_eq!(expect_dnat(&lb, lb::PROG_XDP_LB, &spec, &SVC_TCP4), id);
    let stats = lb.service_stats(SVC_TCP4.id);
    assert_eq!((stats.flows, stats.packets), (1, 2), "{stats:?}");
    let frame_ip_bytes = (spec.build().len() - 14) as u64;
    assert_eq!(stats.bytes, 2 * frame_ip_bytes);
    assert_eq!(lb.backend_stats(id), stats);

    // Conntrack wins over the table: point every slot at another backend, the
    // established flow stays; a new flow follows the table.
    let other = other_backend(id);
    {
        let mut lb = lb;
        let mut maglev: Array<_, [u32; 2]> =
            Array::try_from(lb.ebpf.map_mut(lb::MAGLEV).unwrap()).unwrap();
        for slot in 0..TABLE {
            rune_agent_tests::maps::set_maglev_slot(&mut maglev, slot, other);
        }
        assert_eq!(expect_dnat_to(&lb, lb::PROG_XDP_LB, &spec, id), id);
        let spec2 = vip_packet(&SVC_TCP4, client, 40001);
        assert_eq!(expect_dnat(&lb, lb::PROG_XDP_LB, &spec2, &SVC_TCP4), other);
        // A flow whose backend slot was emptied is balanced again (as a new flow).
        lb.set_backend(id, false);
        assert_eq!(expect_dnat(&lb, lb::PROG_XDP_LB, &spec, &SVC_TCP4), other);
        let stats = lb.service_stats(SVC_TCP4.id);
        assert_eq!((stats.flows, stats.packets), (3, 5), "{stats:?}");
    }
}

#[test]
fn tc_ingress_translates_and_egress_reply_comes_from_the_vip() {
    let lb = Lb::new();
    let client = IpAddr::V4(CLIENT4);
    let mut spec = vip_packet(&SVC_TCP4, client, 41000);
    // IP options: the transport header is found by IHL (here 8 words).
    spec.ip_options = vec![
        0x94, 0x04, 0, 0, 0x01, 0x01, 0x01, 0x00, 0x01, 0x01, 0x01, 0x00,
    ];
    let id = expect_dnat(&lb, lb::PROG_TC_INGRESS, &spec, &SVC_TCP4);
    assert_eq!(expect_dnat(&lb, lb::PROG_TC_INGRESS, &spec, &SVC_TCP4), id);
    let stats = lb.service_stats(SVC_TCP4.id);
    assert_eq!((stats.flows, stats.packets), (1, 2), "{stats:?}");
    // XDP and tc share conntrack: the same flow through XDP keeps its backend.
    assert_eq!(expect_dnat(&lb, lb::PROG_XDP_LB, &spec, &SVC_TCP4), id);

    // The backend's reply leaves through the client-facing interface's egress.
    let (addr, port) = backend_of(id);
    // The SYN-ACK answering the client's SYN (sequence number + 1).
    let mut reply = PacketSpec::tcp(addr, port, client, 41000);
    reply.tcp_flags = TCP_SYN | TCP_ACK;
    reply.ack = spec.seq.wrapping_add(1);
    let out = lb.run(lb::PROG_TC_EGRESS, &reply.build()).unwrap();
    assert_eq!(out.retval, TC_ACT_OK);
    let got = parse_and_verify(&out.data).unwrap();
    assert_eq!((got.src, got.sport), (IpAddr::V4(VIP4), 80));
    assert_eq!((got.dst, got.dport), (client, 41000));
    assert_eq!(lb.service_stats(SVC_TCP4.id).packets, 4);

    // A packet from the backend to another client port is not a reply of this flow.
    let stray = tcp_ack(addr, port, client, 41001).build();
    let out = lb.run(lb::PROG_TC_EGRESS, &stray).unwrap();
    assert_eq!((out.retval, &out.data), (TC_ACT_OK, &stray));
}

/// The conntrack key of `spec` (IPv4), as the client sent it.
fn ct_key_v4(spec: &PacketSpec) -> CtKeyV4 {
    let word = |a: IpAddr| match a {
        IpAddr::V4(a) => u32::from_ne_bytes(a.octets()),
        IpAddr::V6(_) => panic!("an IPv4 packet"),
    };
    CtKeyV4 {
        saddr: word(spec.src),
        daddr: word(spec.dst),
        sport: spec.sport.to_be(),
        dport: spec.dport.to_be(),
        proto: spec.proto,
        pad: [0; 3],
    }
}

/// Runs a backend's packet through tc egress: `Some((source, source port))` when it
/// was translated (checksums verified), `None` when it left byte-identical.
fn egress(lb: &Lb, spec: &PacketSpec) -> Option<(IpAddr, u16)> {
    let frame = spec.build();
    let out = lb.run(lb::PROG_TC_EGRESS, &frame).unwrap();
    assert_eq!(out.retval, TC_ACT_OK);
    if out.data == frame {
        return None;
    }
    let got = parse_and_verify(&out.data).unwrap();
    assert_eq!((got.dst, got.dport), (spec.dst, spec.dport));
    Some((got.src, got.sport))
}

/// TCP: a SYN through the VIP records the SYN-ACK it expects; only that SYN-ACK (and
/// non-SYN packets) are replies. A SYN-ACK of a later direct connection from the same
/// client address and port to the backend leaves untranslated and ends the stale
/// entry; a new SYN on the tuple re-initialises it. Through XDP and tc ingress.
#[test]
fn tcp_conntrack_follows_the_handshake_and_stale_entries_end() {
    for (n, prog) in [lb::PROG_XDP_LB, lb::PROG_TC_INGRESS]
        .into_iter()
        .enumerate()
    {
        let mut lb = Lb::new();
        let client = IpAddr::V4(CLIENT4);
        let vip = (IpAddr::V4(VIP4), 80);
        let sport = 48000 + n as u16;
        let syn = vip_packet(&SVC_TCP4, client, sport);
        let key = ct_key_v4(&syn);
        let id = expect_dnat(&lb, prog, &syn, &SVC_TCP4);
        let ct = lb.ct_v4(&key).expect("entry");
        assert_eq!(ct.syn_ack, syn.seq.wrapping_add(1).to_be(), "{prog}");
        assert_eq!(ct.last_seen, 0, "{prog}: TCP keeps no time");
        let (addr, port) = backend_of(id);
        let mut syn_ack = PacketSpec::tcp(addr, port, client, sport);
        syn_ack.tcp_flags = TCP_SYN | TCP_ACK;
        syn_ack.ack = syn.seq.wrapping_add(1);
        // The SYN-ACK, and its retransmission, come from the VIP.
        assert_eq!(egress(&lb, &syn_ack), Some(vip), "{prog}");
        assert_eq!(egress(&lb, &syn_ack), Some(vip), "{prog}");
        // A retransmitted SYN is the same flow; the client's ACK and data too.
        assert_eq!(expect_dnat_to(&lb, prog, &syn, id), id);
        let ack = tcp_ack(client, sport, vip.0, vip.1);
        assert_eq!(expect_dnat_to(&lb, prog, &ack, id), id);
        assert_eq!(
            lb.ct_v4(&key),
            Some(ct),
            "{prog}: established packets write nothing"
        );
        assert_eq!(egress(&lb, &tcp_ack(addr, port, client, sport)), Some(vip));
        let stats = lb.service_stats(SVC_TCP4.id);
        assert_eq!((stats.flows, stats.packets), (1, 6), "{prog}: {stats:?}");

        // The flow ended; the client connects directly to the backend from the same
        // address and port: the backend's SYN-ACK answers another SYN.
        let mut direct = syn_ack.clone();
        direct.ack = 0x5555_0001;
        assert_eq!(
            egress(&lb, &direct),
            None,
            "{prog}: direct SYN-ACK untouched"
        );
        assert_eq!(lb.ct_v4(&key), None, "{prog}: the stale entry is gone");
        assert_eq!(egress(&lb, &tcp_ack(addr, port, client, sport)), None);

        // A new connection through the VIP on the same tuple: a new flow.
        let mut syn2 = syn.clone();
        syn2.seq = 0x7777_0000;
        assert_eq!(expect_dnat(&lb, prog, &syn2, &SVC_TCP4), id);
        assert_eq!(lb.service_stats(SVC_TCP4.id).flows, 2, "{prog}");
        // Its entry now expects the new SYN-ACK: the old one is not a reply.
        assert_eq!(egress(&lb, &syn_ack), None, "{prog}: old SYN-ACK");
        assert_eq!(lb.ct_v4(&key), None);
        // A flow picked up mid-stream (no SYN seen) expects no SYN-ACK at all.
        assert_eq!(expect_dnat(&lb, prog, &ack, &SVC_TCP4), id);
        assert_eq!(lb.ct_v4(&key).map(|c| c.syn_ack), Some(0));
        syn_ack.ack = syn2.seq.wrapping_add(1);
        assert_eq!(
            egress(&lb, &syn_ack),
            None,
            "{prog}: SYN-ACK after mid-stream"
        );

        // A new SYN on the tuple of an established flow whose backend is draining
        // goes where the table says; a retransmitted SYN stays.
        assert_eq!(expect_dnat(&lb, prog, &syn, &SVC_TCP4), id);
        let other = other_backend(id);
        {
            let (oaddr, oport) = backend_of(id);
            let mut m: Array<_, Backend> =
                Array::try_from(lb.ebpf.map_mut(lb::BACKENDS).unwrap()).unwrap();
            m.set(
                id,
                Backend {
                    addr: addr_from_octets(&octets(oaddr)),
                    port: oport.to_be(),
                    family: FAMILY_V4,
                    state: lb::BACKEND_DRAINING,
                },
                0,
            )
            .unwrap();
            let mut maglev: Array<_, [u32; 2]> =
                Array::try_from(lb.ebpf.map_mut(lb::MAGLEV).unwrap()).unwrap();
            for slot in 0..TABLE {
                rune_agent_tests::maps::set_maglev_slot(&mut maglev, slot, other);
            }
        }
        assert_eq!(
            expect_dnat_to(&lb, prog, &syn, id),
            id,
            "{prog}: retransmit"
        );
        assert_eq!(
            expect_dnat_to(&lb, prog, &syn2, other),
            other,
            "{prog}: new SYN"
        );
        assert_eq!(lb.ct_v4(&key).map(|c| c.backend_id), Some(other));
        lb.set_backend(id, true);
    }
}

/// UDP: replies are translated while the flow's entry is younger than the UDP
/// timeout (refreshed by packets either way); after it they leave untranslated and
/// the entry goes; the client's next datagram is a new flow.
#[test]
fn udp_replies_stop_after_the_timeout() {
    let mut lb = Lb::new();
    let client = IpAddr::V4(CLIENT4);
    let vip = (IpAddr::V4(VIP4), 53);
    let spec = vip_packet(&SVC_UDP4, client, 49000);
    let key = ct_key_v4(&spec);
    let id = expect_dnat(&lb, lb::PROG_TC_INGRESS, &spec, &SVC_UDP4);
    let ct = lb.ct_v4(&key).expect("entry");
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let now = lb::ct_now(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64);
    assert!(now.wrapping_sub(ct.last_seen) <= 1, "{ct:?} at {now}");
    assert_eq!(ct.syn_ack, 0);
    let (addr, port) = backend_of(id);
    let reply = PacketSpec::udp(addr, port, client, 49000);
    assert_eq!(egress(&lb, &reply), Some(vip));

    // Quiet for a little less than the timeout: still a reply, and refreshed.
    let aged = |units: u32| CtValue {
        last_seen: ct.last_seen.wrapping_sub(units),
        ..ct
    };
    lb.set_ct_v4(&key, aged(lb::CT_UDP_TIMEOUT_UNITS - 2));
    assert_eq!(egress(&lb, &reply), Some(vip));
    let refreshed = lb.ct_v4(&key).expect("entry").last_seen;
    assert!(
        now.wrapping_sub(refreshed) <= 1,
        "refreshed: {refreshed} at {now}"
    );

    // Quiet for longer than the timeout: the backend's datagram is not a reply.
    lb.set_ct_v4(&key, aged(lb::CT_UDP_TIMEOUT_UNITS + 2));
    assert_eq!(egress(&lb, &reply), None);
    assert_eq!(lb.ct_v4(&key), None, "the expired entry is gone");
    // An expired entry seen first by the client's next datagram: a new flow.
    expect_dnat(&lb, lb::PROG_XDP_LB, &spec, &SVC_UDP4);
    lb.set_ct_v4(&key, aged(lb::CT_UDP_TIMEOUT_UNITS + 2));
    assert_eq!(expect_dnat_to(&lb, lb::PROG_XDP_LB, &spec, id), id);
    assert_eq!(lb.service_stats(SVC_UDP4.id).flows, 3);
    assert_eq!(egress(&lb, &reply), Some(vip));
}

#[test]
fn ipv6_vip_hit_and_reply() {
    let lb = Lb::new();
    let client = IpAddr::V6(CLIENT6);
    // TCP through XDP, UDP through tc.
    let tcp = vip_packet(&SVC_TCP6, client, 42000);
    let id = expect_dnat(&lb, lb::PROG_XDP_LB, &tcp, &SVC_TCP6);
    assert_eq!(expect_dnat(&lb, lb::PROG_XDP_LB, &tcp, &SVC_TCP6), id);
    let stats = lb.service_stats(SVC_TCP6.id);
    assert_eq!((stats.flows, stats.packets), (1, 2), "{stats:?}");
    let fwd = CtKeyV6 {
        saddr: addr_from_octets(&CLIENT6.octets()),
        daddr: addr_from_octets(&VIP6.octets()),
        sport: 42000u16.to_be(),
        dport: 443u16.to_be(),
        proto: PROTO_TCP,
        pad: [0; 3],
    };
    assert_eq!(lb.ct_v6(&fwd).expect("conntrack entry").backend_id, id);

    let udp = vip_packet(&SVC_UDP6, client, 42001);
    let uid = expect_dnat(&lb, lb::PROG_TC_INGRESS, &udp, &SVC_UDP6);
    for (proto_spec, id, sport, vport) in [
        (tcp_ack as fn(_, _, _, _) -> _, id, 42000, 443),
        (PacketSpec::udp, uid, 42001, 53),
    ] {
        let (addr, port) = backend_of(id);
        let reply = proto_spec(addr, port, client, sport).build();
        let out = lb.run(lb::PROG_TC_EGRESS, &reply).unwrap();
        assert_eq!(out.retval, TC_ACT_OK);
        let got = parse_and_verify(&out.data).unwrap();
        assert_eq!((got.src, got.sport), (IpAddr::V6(VIP6), vport));
        assert_eq!((got.dst, got.dport), (client, sport));
    }
}

#[test]
fn udp_zero_checksum_stays_zero() {
    let lb = Lb::new();
    let client = IpAddr::V4(CLIENT4);
    let mut spec = vip_packet(&SVC_UDP4, client, 43000);
    spec.udp_zero_checksum = true;
    for prog in [lb::PROG_XDP_LB, lb::PROG_TC_INGRESS] {
        let id = expect_dnat(&lb, prog, &spec, &SVC_UDP4);
        let out = lb.run(prog, &spec.build()).unwrap();
        assert_eq!(
            parse_and_verify(&out.data).unwrap().l4_checksum,
            0,
            "{prog}"
        );
        let (addr, port) = backend_of(id);
        let mut reply = PacketSpec::udp(addr, port, client, 43000);
        reply.udp_zero_checksum = true;
        let out = lb.run(lb::PROG_TC_EGRESS, &reply.build()).unwrap();
        let got = parse_and_verify(&out.data).unwrap();
        assert_eq!(
            (got.src, got.sport, got.l4_checksum),
            (IpAddr::V4(VIP4), 53, 0)
        );
    }
    // With a checksum, UDP is translated with a valid one (checked in expect_dnat).
    let spec = vip_packet(&SVC_UDP4, client, 43001);
    expect_dnat(&lb, lb::PROG_XDP_LB, &spec, &SVC_UDP4);
}

#[test]
fn vip_prefilter_decides_before_the_frontend_lookup() {
    let mut lb = Lb::new();
    let c4 = IpAddr::V4(CLIENT4);
    let c6 = IpAddr::V6(CLIENT6);
    // As the agent writes it: every frontend passes, and is translated.
    lb.set_vip_filter(&ALL_SVCS);
    for prog in [lb::PROG_XDP_LB, lb::PROG_TC_INGRESS] {
        expect_dnat(&lb, prog, &vip_packet(&SVC_TCP4, c4, 41000), &SVC_TCP4);
        expect_dnat(&lb, prog, &vip_packet(&SVC_UDP6, c6, 41000), &SVC_UDP6);
    }
    // With their bits set, the same frontends are not looked up: new flows to them
    // pass untouched and uncounted, while the others are still translated.
    let rest: Vec<&Svc> = ALL_SVCS
        .into_iter()
        .filter(|s| s.id != SVC_TCP4.id && s.id != SVC_UDP6.id)
        .collect();
    lb.set_vip_filter(&rest);
    let before = (lb.service_stats(SVC_TCP4.id), lb.service_stats(SVC_UDP6.id));
    for (prog, pass) in [
        (lb::PROG_XDP_LB, XDP_PASS),
        (lb::PROG_TC_INGRESS, TC_ACT_OK),
    ] {
        for spec in [
            vip_packet(&SVC_TCP4, c4, 42000),
            vip_packet(&SVC_UDP6, c6, 42000),
        ] {
            let frame = spec.build();
            let out = lb.run(prog, &frame).unwrap();
            assert_eq!(out.retval, pass, "{prog}");
            assert_eq!(out.data, frame, "{prog}: a filtered-out packet changed");
        }
        expect_dnat(&lb, prog, &vip_packet(&SVC_TCP6, c6, 42000), &SVC_TCP6);
    }
    let after = (lb.service_stats(SVC_TCP4.id), lb.service_stats(SVC_UDP6.id));
    assert_eq!(before, after, "filtered-out packets were counted");
}

#[test]
fn non_vip_packets_pass_byte_identical() {
    let lb = Lb::new();
    let c4 = IpAddr::V4(CLIENT4);
    let c6 = IpAddr::V6(CLIENT6);
    let other4 = IpAddr::V4(Ipv4Addr::new(198, 18, 200, 1));
    let other6 = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x200));
    let packets = [
        PacketSpec::tcp(c4, 1000, other4, 80), // another address
        PacketSpec::tcp(c4, 1000, IpAddr::V4(VIP4), 81), // the VIP, another port
        PacketSpec::udp(c4, 1000, IpAddr::V4(VIP4), 80), // the VIP, another protocol
        PacketSpec::tcp(c6, 1000, other6, 443),
        PacketSpec::udp(c6, 1000, IpAddr::V6(VIP6), 443),
    ];
    let mut frames: Vec<Vec<u8>> = packets.iter().map(PacketSpec::build).collect();
    // Not IP at all (ARP-like EtherType), and a VLAN-tagged frame.
    let mut arp = frames[0].clone();
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    frames.push(arp);
    let mut vlan = frames[0].clone();
    vlan[12..14].copy_from_slice(&0x8100u16.to_be_bytes());
    frames.push(vlan);
    for frame in &frames {
        for (prog, pass) in [
            (lb::PROG_XDP_LB, XDP_PASS),
            (lb::PROG_TC_INGRESS, TC_ACT_OK),
            (lb::PROG_TC_EGRESS, TC_ACT_OK),
        ] {
            let out = lb.run(prog, frame).unwrap();
            assert_eq!(out.retval, pass, "{prog}");
            assert_eq!(&out.data, frame, "{prog}: packet changed");
        }
    }
    for svc in ALL_SVCS {
        assert_eq!(lb.service_stats(svc.id), TrafficStats::default());
    }
}

#[test]
fn truncated_packets_pass_or_drop_as_documented() {
    let lb = Lb::new();
    let mut tcp4 = vip_packet(&SVC_TCP4, IpAddr::V4(CLIENT4), 44000);
    tcp4.ip_options = vec![1, 1, 1, 0]; // NOP NOP NOP EOL: IHL 6
    let udp6 = vip_packet(&SVC_UDP6, IpAddr::V6(CLIENT6), 44001);
    for (spec, l4_off, ip_end) in [(&tcp4, 14 + 24, 14 + 20), (&udp6, 14 + 40, 14 + 40)] {
        let full = spec.build();
        for (prog, pass, drop) in [
            (lb::PROG_XDP_LB, XDP_PASS, XDP_DROP),
            (lb::PROG_TC_INGRESS, TC_ACT_OK, TC_ACT_SHOT),
        ] {
            for len in 0..=full.len() {
                let cut = &full[..len];
                let before = lb.drops(DropReason::Malformed);
                let out = match lb.run(prog, cut) {
                    Ok(out) => out,
                    // The kernel itself refuses test packets shorter than Ethernet,
                    // and tc test packets cut inside the fixed IP header (XDP
                    // covers those lengths).
                    Err(e) if len < 14 || (prog != lb::PROG_XDP_LB && len < ip_end) => {
                        assert!(e.to_string().contains("Invalid argument"), "{e:#}");
                        continue;
                    }
                    Err(e) => panic!("{prog} at {len} bytes: {e:#}"),
                };
                let dropped = lb.drops(DropReason::Malformed) - before;
                if len < l4_off + 4 {
                    // The frontend key cannot be read: not a VIP packet, passed.
                    assert_eq!(out.retval, pass, "{prog} at {len} bytes");
                    assert_eq!(out.data, cut, "{prog} at {len} bytes");
                    assert_eq!(dropped, 0);
                } else if len < full.len() {
                    // A VIP packet cut short: dropped and counted.
                    assert_eq!(out.retval, drop, "{prog} at {len} bytes");
                    assert_eq!(dropped, 1, "{prog} at {len} bytes");
                } else {
                    assert_eq!(out.retval, pass, "{prog} at {len} bytes");
                    parse_and_verify(&out.data).unwrap();
                }
            }
        }
    }
}

#[test]
fn malformed_headers_never_crash() {
    let lb = Lb::new();
    let spec = vip_packet(&SVC_TCP4, IpAddr::V4(CLIENT4), 45000);
    let good = spec.build();
    let edit = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut p = good.clone();
        f(&mut p);
        p
    };
    // Passed untouched: the frontend key cannot be read reliably.
    let passed = [
        ("IHL 4", edit(&|p| p[14] = 0x44)),
        ("IHL 15, ports past the end", edit(&|p| p[14] = 0x4f)),
        ("IHL 0", edit(&|p| p[14] = 0x40)),
        ("version 6 in an IPv4 EtherType", edit(&|p| p[14] = 0x65)),
        ("version 4 in an IPv6 EtherType", {
            let mut p = vip_packet(&SVC_TCP6, IpAddr::V6(CLIENT6), 45000).build();
            p[14] = 0x40;
            p
        }),
        (
            "non-first fragment",
            edit(&|p| p[14 + 6..14 + 8].copy_from_slice(&[0x00, 0x10])),
        ),
    ];
    // Dropped and counted: the frontend matches but the packet cannot be translated.
    let dropped = [
        ("TCP data offset 4", edit(&|p| p[14 + 20 + 12] = 0x40)),
        (
            "IP total length < headers",
            edit(&|p| p[16..18].copy_from_slice(&30u16.to_be_bytes())),
        ),
        (
            "IP total length > packet",
            edit(&|p| p[16..18].copy_from_slice(&1500u16.to_be_bytes())),
        ),
    ];
    for (prog, pass, drop) in [
        (lb::PROG_XDP_LB, XDP_PASS, XDP_DROP),
        (lb::PROG_TC_INGRESS, TC_ACT_OK, TC_ACT_SHOT),
    ] {
        for (what, frame) in &passed {
            let out = lb.run(prog, frame).unwrap();
            assert_eq!(out.retval, pass, "{prog}: {what}");
            assert_eq!(&out.data, frame, "{prog}: {what}");
        }
        for (what, frame) in &dropped {
            let before = lb.drops(DropReason::Malformed);
            let out = lb.run(prog, frame).unwrap();
            assert_eq!(out.retval, drop, "{prog}: {what}");
            assert_eq!(
                lb.drops(DropReason::Malformed),
                before + 1,
                "{prog}: {what}"
            );
        }
    }
    // Nothing was balanced.
    assert_eq!(lb.service_stats(SVC_TCP4.id), TrafficStats::default());
}

/// A TCP packet to a service without backends comes back as the RST that refuses
/// it (XDP_TX in XDP, redirected back out of the ingress interface in tc): MACs,
/// addresses and ports swapped, no options or payload, valid checksums, sequence
/// numbers as RFC 9293 asks of a closed port. Counted as `no_backend`; a RST is
/// never answered (dropped, counted).
#[test]
fn no_backend_tcp_is_refused_with_a_rst_and_counted() {
    let lb = Lb::new();
    let mut refusals = 0;
    for (svc, client) in [
        (&SVC_EMPTY, IpAddr::V4(CLIENT4)),
        (&SVC_EMPTY6, IpAddr::V6(CLIENT6)),
    ] {
        let syn = PacketSpec::tcp(client, 46000, svc.vip, svc.port);
        let mut ack = syn.clone();
        ack.tcp_flags = TCP_ACK;
        ack.ack = 0xdead_beef;
        let mut ack_opts = ack.clone();
        // IP options: the reply is built without them.
        ack_opts.ip_options = vec![1, 1, 1, 0];
        let want_len = if client.is_ipv4() {
            14 + 20 + 20
        } else {
            14 + 40 + 20
        };
        for (prog, tx) in [
            (lb::PROG_XDP_LB, XDP_TX),
            (lb::PROG_TC_INGRESS, TC_ACT_REDIRECT),
        ] {
            for (what, spec) in [
                ("SYN", &syn),
                ("ACK", &ack),
                ("ACK + IP options", &ack_opts),
            ] {
                if client.is_ipv6() && what == "ACK + IP options" {
                    continue;
                }
                let frame = spec.build();
                let out = lb.run(prog, &frame).unwrap();
                refusals += 1;
                assert_eq!(out.retval, tx, "{prog} {what}: return code");
                assert_eq!(out.data.len(), want_len, "{prog} {what}: length");
                assert_eq!(&out.data[0..6], &frame[6..12], "{prog} {what}: dst MAC");
                assert_eq!(&out.data[6..12], &frame[0..6], "{prog} {what}: src MAC");
                let got =
                    parse_and_verify(&out.data).unwrap_or_else(|e| panic!("{prog} {what}: {e:#}"));
                assert_eq!(
                    (got.src, got.sport, got.dst, got.dport, got.payload_len),
                    (svc.vip, svc.port, client, 46000, 0),
                    "{prog} {what}"
                );
                if spec.tcp_flags & TCP_ACK != 0 {
                    // <SEQ=SEG.ACK><CTL=RST>
                    assert_eq!(
                        (got.tcp_flags, got.seq),
                        (TCP_RST, spec.ack),
                        "{prog} {what}"
                    );
                } else {
                    // <SEQ=0><ACK=SEG.SEQ+SEG.LEN (+1 for the SYN)><CTL=RST,ACK>
                    let len = spec.payload.len() as u32 + u32::from(spec.tcp_flags & TCP_SYN != 0);
                    assert_eq!(
                        (got.tcp_flags, got.seq, got.ack),
                        (TCP_RST | TCP_ACK, 0, spec.seq.wrapping_add(len)),
                        "{prog} {what}"
                    );
                }
                assert_eq!(lb.drops(DropReason::NoBackend), refusals, "{prog} {what}");
            }
            // A RST to the empty service is not answered: dropped and counted.
            let mut rst = syn.clone();
            rst.tcp_flags = TCP_RST;
            let out = lb.run(prog, &rst.build()).unwrap();
            refusals += 1;
            let drop = if prog == lb::PROG_XDP_LB {
                XDP_DROP
            } else {
                TC_ACT_SHOT
            };
            assert_eq!(out.retval, drop, "{prog}: RST");
            assert_eq!(lb.drops(DropReason::NoBackend), refusals);
        }
        assert_eq!(lb.service_stats(svc.id), TrafficStats::default());
    }
}

/// A UDP datagram to a service without backends comes back as an ICMP (IPv4: type
/// 3 code 3) or ICMPv6 (type 1 code 4) port unreachable from the VIP to the client,
/// quoting the datagram's IP header and first 8 bytes unchanged, with valid
/// checksums; XDP_TX in XDP, redirected back out in tc; counted as `no_backend`.
#[test]
fn no_backend_udp_is_refused_with_port_unreachable_and_counted() {
    let lb = Lb::new();
    let mut refusals = 0;
    let mut with_options = PacketSpec::udp(IpAddr::V4(CLIENT4), 48001, SVC_EMPTY_UDP.vip, 53);
    with_options.ip_options = vec![1, 1, 1, 0];
    let cases = [
        (
            PacketSpec::udp(IpAddr::V4(CLIENT4), 48000, SVC_EMPTY_UDP.vip, 53),
            (3, 3),
        ),
        (with_options, (3, 3)),
        (
            PacketSpec::udp(IpAddr::V6(CLIENT6), 48002, SVC_EMPTY_UDP6.vip, 5353),
            (1, 4),
        ),
    ];
    for (spec, (icmp_type, code)) in &cases {
        let frame = spec.build();
        let ihl = if spec.src.is_ipv4() {
            20 + spec.ip_options.len()
        } else {
            40
        };
        for (prog, tx) in [
            (lb::PROG_XDP_LB, XDP_TX),
            (lb::PROG_TC_INGRESS, TC_ACT_REDIRECT),
        ] {
            let out = lb.run(prog, &frame).unwrap();
            refusals += 1;
            let what = format!("{prog} {}:{}", spec.src, spec.sport);
            assert_eq!(out.retval, tx, "{what}: return code");
            assert_eq!(&out.data[0..6], &frame[6..12], "{what}: dst MAC");
            assert_eq!(&out.data[6..12], &frame[0..6], "{what}: src MAC");
            let got = parse_icmp_error(&out.data).unwrap_or_else(|e| panic!("{what}: {e:#}"));
            assert_eq!(
                (got.src, got.dst, got.icmp_type, got.code),
                (spec.dst, spec.src, *icmp_type, *code),
                "{what}"
            );
            assert_eq!(got.quote, frame[14..14 + ihl + 8], "{what}: quote");
            assert_eq!(lb.drops(DropReason::NoBackend), refusals, "{what}");
        }
    }
    assert_eq!(lb.service_stats(SVC_EMPTY_UDP.id), TrafficStats::default());
}

/// Backends behind two VIPs: each reply from a shared backend goes back from the
/// VIP and port its own flow used; another backend of the service writing to the
/// client's port is not a reply of the flow and passes untouched. One conntrack
/// entry per flow (and its reply entry).
#[test]
fn shared_backend_replies_come_from_the_vip_of_their_flow() {
    let lb = Lb::new();
    let client = IpAddr::V4(CLIENT4);
    for (n, (svc, sport)) in [(&SVC_TCP4, 47010), (&SVC_SHARED, 47011)]
        .into_iter()
        .enumerate()
    {
        let id = expect_dnat(
            &lb,
            lb::PROG_TC_INGRESS,
            &vip_packet(svc, client, sport),
            svc,
        );
        assert_eq!(lb.ct_len(), n + 1, "one conntrack entry per flow");
        let (addr, port) = backend_of(id);
        let out = lb
            .run(
                lb::PROG_TC_EGRESS,
                &tcp_ack(addr, port, client, sport).build(),
            )
            .unwrap();
        assert_eq!(out.retval, TC_ACT_OK);
        let got = parse_and_verify(&out.data).unwrap();
        assert_eq!(
            (got.src, got.sport),
            (svc.vip, svc.port),
            "reply of {sport}"
        );
        assert_eq!((got.dst, got.dport), (client, sport));
        assert_eq!(lb.service_stats(svc.id).packets, 2, "the reply is counted");
        // Another backend of the service writing to that client port: untouched.
        let other = svc.backends.iter().copied().find(|&o| o != id).unwrap();
        let (oaddr, oport) = backend_of(other);
        let stray = tcp_ack(oaddr, oport, client, sport).build();
        let out = lb.run(lb::PROG_TC_EGRESS, &stray).unwrap();
        assert_eq!(
            (out.retval, &out.data),
            (TC_ACT_OK, &stray),
            "stray from {other}"
        );
    }
}

/// Runs a client's VIP packet through `prog` and checks it left for backend
/// `want_id` with valid checksums, the client's address unchanged; returns the
/// source port the backend sees.
fn dnat_port(lb: &Lb, prog: &str, spec: &PacketSpec, want_id: u32) -> u16 {
    let frame = spec.build();
    let out = lb.run(prog, &frame).unwrap();
    let pass = if prog == lb::PROG_XDP_LB {
        XDP_PASS
    } else {
        TC_ACT_OK
    };
    assert_eq!(out.retval, pass, "{prog}: return code");
    let got = parse_and_verify(&out.data).unwrap_or_else(|e| panic!("{prog}: {e:#}"));
    assert_eq!((got.dst, got.dport), backend_of(want_id), "{prog}: backend");
    assert_eq!(got.src, spec.src, "{prog}: client address");
    got.sport
}

/// Runs a backend's packet through tc egress and checks it was translated (valid
/// checksums); returns its source, source port and destination port.
fn egress_translated(lb: &Lb, spec: &PacketSpec) -> (IpAddr, u16, u16) {
    let out = lb.run(lb::PROG_TC_EGRESS, &spec.build()).unwrap();
    assert_eq!(out.retval, TC_ACT_OK);
    let got = parse_and_verify(&out.data).unwrap();
    assert_eq!(got.dst, spec.dst, "the client's address stays");
    (got.src, got.sport, got.dport)
}

/// One client address and port to two frontends that share a backend (a backend
/// behind many services, a client reusing ports): the second flow must not meet
/// the first at the backend on one 4-tuple (the backend's TIME_WAIT or live socket
/// would refuse its SYN), so it reaches the backend from another unprivileged port,
/// which stays its own while its entry lives. Replies of each flow come back from
/// its own VIP to the client's own port; restarting either flow on its tuple keeps
/// its port. Through tc ingress and XDP.
#[test]
fn a_client_port_another_frontend_holds_at_the_backend_is_replaced() {
    for (n, prog) in [lb::PROG_TC_INGRESS, lb::PROG_XDP_LB]
        .into_iter()
        .enumerate()
    {
        let lb = Lb::new();
        let client = IpAddr::V4(CLIENT4);
        let sport = 46000 + n as u16;
        let first = vip_packet(&SVC_TCP4, client, sport);
        let id = lb.expected_backend(&SVC_TCP4, client, sport);
        assert_eq!(
            lb.expected_backend(&SVC_SHARED, client, sport),
            id,
            "the two tables give the flow one backend"
        );
        assert_eq!(dnat_port(&lb, prog, &first, id), sport, "{prog}: own port");
        let mut second = vip_packet(&SVC_SHARED, client, sport);
        second.seq = 0x0102_0304;
        let nat = dnat_port(&lb, prog, &second, id);
        assert!(nat != sport && nat >= 1024, "{prog}: replaced by {nat}");
        // Its further packets keep the port.
        let ack = tcp_ack(client, sport, SVC_SHARED.vip, SVC_SHARED.port);
        assert_eq!(dnat_port(&lb, prog, &ack, id), nat, "{prog}");

        let (addr, port) = backend_of(id);
        let syn_ack = |dport: u16, ack: u32| {
            let mut spec = PacketSpec::tcp(addr, port, client, dport);
            spec.tcp_flags = TCP_SYN | TCP_ACK;
            spec.ack = ack;
            spec
        };
        assert_eq!(
            egress_translated(&lb, &syn_ack(sport, first.seq.wrapping_add(1))),
            (SVC_TCP4.vip, SVC_TCP4.port, sport),
            "{prog}: the first flow's reply"
        );
        assert_eq!(
            egress_translated(&lb, &syn_ack(nat, second.seq.wrapping_add(1))),
            (SVC_SHARED.vip, SVC_SHARED.port, sport),
            "{prog}: the second flow's reply"
        );
        assert_eq!(
            egress_translated(&lb, &tcp_ack(addr, port, client, nat)),
            (SVC_SHARED.vip, SVC_SHARED.port, sport),
            "{prog}"
        );
        assert_eq!(
            egress_translated(&lb, &tcp_ack(addr, port, client, sport)),
            (SVC_TCP4.vip, SVC_TCP4.port, sport),
            "{prog}"
        );

        // New connections on both tuples (new sequence numbers): each keeps the
        // port the backend knows it by, so the backend sees one client per tuple.
        let mut again = second.clone();
        again.seq = 0x0a0b_0c0d;
        assert_eq!(dnat_port(&lb, prog, &again, id), nat, "{prog}");
        let mut again_first = first.clone();
        again_first.seq = 0x0d0c_0b0a;
        assert_eq!(dnat_port(&lb, prog, &again_first, id), sport, "{prog}");
        assert_eq!(lb.service_stats(SVC_SHARED.id).flows, 2, "{prog}");
        assert_eq!(lb.drops(DropReason::NoNatPort), 0, "{prog}");
    }
}

/// Creates a map of `map_type` with the given key and value sizes and pins it at
/// `path` (as an agent of an earlier layout left it).
fn pin_raw_map(path: &Path, map_type: u32, key_size: u32, value_size: u32) {
    #[repr(C)]
    #[derive(Default)]
    struct MapCreate {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
        pad: [u32; 27],
    }
    #[repr(C)]
    #[derive(Default)]
    struct ObjPin {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        pad: [u32; 27],
    }
    let create = MapCreate {
        map_type,
        key_size,
        value_size,
        max_entries: 16,
        ..MapCreate::default()
    };
    // SAFETY: a valid BPF_MAP_CREATE attribute of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            0,
            &create as *const MapCreate,
            size_of::<MapCreate>(),
        )
    };
    assert!(
        fd >= 0,
        "BPF_MAP_CREATE: {}",
        std::io::Error::last_os_error()
    );
    let path = std::ffi::CString::new(path.to_str().expect("a UTF-8 path")).unwrap();
    let pin = ObjPin {
        pathname: path.as_ptr() as u64,
        bpf_fd: fd as u32,
        ..ObjPin::default()
    };
    // SAFETY: a valid BPF_OBJ_PIN attribute; `path` outlives the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, 6, &pin as *const ObjPin, size_of::<ObjPin>()) };
    assert_eq!(rc, 0, "BPF_OBJ_PIN: {}", std::io::Error::last_os_error());
    // SAFETY: the descriptor came from BPF_MAP_CREATE above and is not used again.
    unsafe { libc::close(fd as i32) };
}

/// Map sizes small enough for the layout tests.
const SMALL_SIZES: rune_agent::dataplane::ebpf::MapSizes = rune_agent::dataplane::ebpf::MapSizes {
    frontends: 4,
    backends: 16,
    table_size: 7,
    flows: 16,
    affinity: 16,
    policy_entries: 16,
};

/// Pins left by an agent whose conntrack had another layout are reported with the
/// command that fixes them, instead of a verifier error.
#[test]
fn pinned_conntrack_of_another_layout_is_reported() {
    if let Err(e) = require_root() {
        panic!("{e}");
    }
    let pins = PinDir::create("ebpf-packet").unwrap_or_else(|e| panic!("{e:#}"));
    // A hash map with the earlier 32-byte conntrack value, pinned as RUNE_CT_V4.
    pin_raw_map(&pins.path().join(lb::CONNTRACK_V4), 1, 16, 32);
    let err = match rune_agent::dataplane::ebpf::load_lb(pins.path(), &SMALL_SIZES) {
        Ok(_) => panic!("loading over a pinned map of another layout must fail"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(lb::CONNTRACK_V4) && err.contains("(16, 32)") && err.contains("(16, 20)"),
        "{err}"
    );
    assert!(err.contains("rune-agent cleanup --bpf-pin-dir"), "{err}");
}

/// Conntrack pinned by agents of earlier layouts (8-byte values: before entries
/// had a lifetime; 16-byte: before reply entries) is replaced by maps of this
/// layout with its flows copied over, each keeping the client's own port, and
/// every flow gets the reply entry it lacked (from the pinned backend it names),
/// so that its replies stay translated.
#[test]
fn pinned_conntrack_of_earlier_layouts_is_carried_over() {
    if let Err(e) = require_root() {
        panic!("{e}");
    }
    for (value_size, old) in [
        (8u32, [2, SVC_TCP4.id, 0, 0]),
        (16, [2, SVC_TCP4.id, 77, 0]),
    ] {
        let pins = PinDir::create("ebpf-packet").unwrap_or_else(|e| panic!("{e:#}"));
        // The earlier agent's backends (pinned; the load reuses them).
        {
            let mut ebpf = rune_agent::dataplane::ebpf::load_lb(pins.path(), &SMALL_SIZES).unwrap();
            let (addr, port) = backend_of(2);
            let mut backends: Array<_, Backend> =
                Array::try_from(ebpf.map_mut(lb::BACKENDS).unwrap()).unwrap();
            let backend = Backend {
                addr: addr_from_octets(&octets(addr)),
                port: port.to_be(),
                family: FAMILY_V4,
                state: BACKEND_ACTIVE,
            };
            backends.set(2, backend, 0).unwrap();
        }
        for name in [
            lb::CONNTRACK_V4,
            lb::CONNTRACK_REPLY_V4,
            lb::CONNTRACK_REPLY_V6,
        ] {
            std::fs::remove_file(pins.path().join(name)).unwrap();
        }
        let path = pins.path().join(lb::CONNTRACK_V4);
        pin_raw_map(&path, 9, 16, value_size); // BPF_MAP_TYPE_LRU_HASH
        let key = ct_key_v4(&vip_packet(&SVC_TCP4, IpAddr::V4(CLIENT4), 50000));
        {
            let old_map = aya::maps::Map::LruHashMap(MapData::from_pin(&path).unwrap());
            if value_size == 8 {
                let mut m: HashMap<MapData, CtKeyV4, [u32; 2]> =
                    HashMap::try_from(old_map).unwrap();
                m.insert(key, [old[0], old[1]], 0).unwrap();
            } else {
                let mut m: HashMap<MapData, CtKeyV4, [u32; 4]> =
                    HashMap::try_from(old_map).unwrap();
                m.insert(key, [old[0], old[1], old[2], old[3]], 0).unwrap();
            }
        }
        let ebpf = rune_agent::dataplane::ebpf::load_lb(pins.path(), &SMALL_SIZES)
            .unwrap_or_else(|e| panic!("load over the {value_size}-byte layout: {e:#}"));
        let ct: HashMap<&MapData, CtKeyV4, CtValue> =
            HashMap::try_from(ebpf.map(lb::CONNTRACK_V4).unwrap()).unwrap();
        let value = ct.get(&key, 0).expect("the flow carried over");
        let syn_ack = if value_size == 8 { 0 } else { 77 };
        assert_eq!(
            (
                value.backend_id,
                value.service_id,
                value.syn_ack,
                value.nat_port
            ),
            (2, SVC_TCP4.id, syn_ack, 50000u16.to_be()),
            "{value_size}-byte layout"
        );
        let info = aya::maps::MapInfo::from_pin(&path).unwrap();
        assert_eq!((info.key_size(), info.value_size()), (16, 20), "re-pinned");
        let replies: HashMap<&MapData, CtKeyV4, CtReplyV4> =
            HashMap::try_from(ebpf.map(lb::CONNTRACK_REPLY_V4).unwrap()).unwrap();
        let (addr, port) = backend_of(2);
        let rkey = CtKeyV4 {
            saddr: addr_from_octets(&octets(addr))[0],
            daddr: key.saddr,
            sport: port.to_be(),
            dport: key.sport,
            proto: PROTO_TCP,
            pad: [0; 3],
        };
        let reply = replies.get(&rkey, 0).expect("the flow's reply entry");
        assert_eq!(
            reply,
            CtReplyV4 {
                vip: key.daddr,
                vport: key.dport,
                cport: key.sport,
                backend_id: 2
            },
            "{value_size}-byte layout"
        );
        assert!(
            !pins.path().join("RUNE_REVNAT").exists(),
            "the old reverse-NAT index is unpinned"
        );
    }
}

/// Counters pinned by an agent with per-CPU arrays are replaced by arrays of this
/// layout (a region per possible CPU), their counts summed over CPUs; a later start
/// re-opens the new arrays with the size they were created with.
#[test]
fn pinned_per_cpu_counters_are_carried_over() {
    if let Err(e) = require_root() {
        panic!("{e}");
    }
    let pins = PinDir::create("ebpf-packet").unwrap_or_else(|e| panic!("{e:#}"));
    let path = pins.path().join(lb::SERVICE_STATS);
    pin_raw_map(&path, 6, 4, 24); // BPF_MAP_TYPE_PERCPU_ARRAY of TrafficStats
    let cpus = aya::util::nr_cpus().unwrap();
    let one = TrafficStats {
        flows: 1,
        packets: 2,
        bytes: 300,
    };
    {
        let old = MapData::from_pin(&path).unwrap();
        let mut old: PerCpuArray<MapData, TrafficStats> =
            PerCpuArray::try_from(aya::maps::Map::PerCpuArray(old)).unwrap();
        let values = aya::maps::PerCpuValues::try_from(vec![one; cpus]).unwrap();
        old.set(3, values, 0).unwrap();
    }
    let n = cpus as u64;
    let want = TrafficStats {
        flows: n,
        packets: 2 * n,
        bytes: 300 * n,
    };
    let ebpf = rune_agent::dataplane::ebpf::load_lb(pins.path(), &SMALL_SIZES)
        .unwrap_or_else(|e| panic!("load over per-CPU counters: {e:#}"));
    let read = |ebpf: &Ebpf| {
        let m: Array<&MapData, TrafficStats> =
            Array::try_from(ebpf.map(lb::SERVICE_STATS).unwrap()).unwrap();
        (
            m.len(),
            stats::read(&m, 3).unwrap(),
            stats::read(&m, 2).unwrap(),
        )
    };
    let regions = SMALL_SIZES.frontends * cpus as u32;
    assert_eq!(read(&ebpf), (regions, want, TrafficStats::default()));
    let info = aya::maps::MapInfo::from_pin(&path).unwrap();
    assert_eq!(
        info.map_type().unwrap(),
        aya::maps::MapType::Array,
        "re-pinned as a plain array"
    );
    drop(ebpf);
    let bigger = rune_agent::dataplane::ebpf::MapSizes {
        frontends: 2 * SMALL_SIZES.frontends,
        ..SMALL_SIZES
    };
    let ebpf = rune_agent::dataplane::ebpf::load_lb(pins.path(), &bigger)
        .unwrap_or_else(|e| panic!("re-open: {e:#}"));
    assert_eq!(
        read(&ebpf),
        (regions, want, TrafficStats::default()),
        "a pinned array keeps its size and counts"
    );
}

/// Every load creates the VIP prefilter afresh (all zeros: nothing filtered until
/// the agent's first sync writes it): a filter pinned by an earlier agent, which may
/// not match the pinned frontends, never hides one from the new programs.
#[test]
fn a_load_creates_the_vip_prefilter_afresh() {
    if let Err(e) = require_root() {
        panic!("{e}");
    }
    let pins = PinDir::create("ebpf-packet").unwrap_or_else(|e| panic!("{e:#}"));
    fn words(ebpf: &mut Ebpf) -> Array<&mut MapData, u64> {
        Array::try_from(ebpf.map_mut(lb::VIP_FILTER).unwrap()).unwrap()
    }
    let mut ebpf = rune_agent::dataplane::ebpf::load_lb(pins.path(), &SMALL_SIZES)
        .unwrap_or_else(|e| panic!("first load: {e:#}"));
    let mut filter = words(&mut ebpf);
    for i in 0..filter.len() {
        filter.set(i, u64::MAX, 0).unwrap();
    }
    assert!(
        pins.path().join(lb::VIP_FILTER).exists(),
        "the filter is pinned"
    );
    drop(ebpf);
    let mut ebpf = rune_agent::dataplane::ebpf::load_lb(pins.path(), &SMALL_SIZES)
        .unwrap_or_else(|e| panic!("second load: {e:#}"));
    let filter = words(&mut ebpf);
    let set: Vec<u32> = (0..filter.len())
        .filter(|i| filter.get(i, 0).unwrap() != 0)
        .collect();
    assert!(
        set.is_empty(),
        "words left from the earlier filter: {set:?}"
    );
}

/// A frontend and a backend whose ids lie beyond the counters' regions (the agent
/// sizes a region by the map that hands out the ids, so only a layout mismatch
/// makes this happen): the packet is still translated and counted nowhere, in
/// particular not in CPU 1's region, where `cpu × per_cpu + id` lands for CPU 0.
#[test]
fn ids_beyond_the_counters_regions_are_translated_but_not_counted() {
    const SVC_BEYOND: Svc = Svc {
        id: STATS_ENTRIES,
        vip: IpAddr::V6(VIP6),
        port: 9000,
        proto: PROTO_TCP,
        backends: &[STATS_ENTRIES],
    };
    // On CPU 0, whose region an unbounded slot would overrun into CPU 1's.
    // SAFETY: a zeroed cpu_set_t with one bit set, for this test's own thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set),
            0
        );
    }
    let mut lb = Lb::new();
    lb.add_service(&SVC_BEYOND, ALL_SVCS.len() as u32 * TABLE);
    let totals = |lb: &Lb| {
        [lb::SERVICE_STATS, lb::BACKEND_STATS].map(|name| {
            let m: Array<&MapData, TrafficStats> =
                Array::try_from(lb.ebpf.map(name).unwrap()).unwrap();
            (0..m.len()).fold(TrafficStats::default(), |sum, i| {
                sum.add(m.get(&i, 0).unwrap())
            })
        })
    };
    let before = totals(&lb);
    for prog in [lb::PROG_XDP_LB, lb::PROG_TC_INGRESS] {
        let spec = vip_packet(&SVC_BEYOND, IpAddr::V6(CLIENT6), 40000);
        // The table's only backend.
        expect_dnat_to(&lb, prog, &spec, STATS_ENTRIES);
    }
    assert_eq!(totals(&lb), before, "counted outside the regions");
}
