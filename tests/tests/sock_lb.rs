//! The socket-level load balancer (cgroup v2 `sock_addr` programs, `agent-ebpf/src/
//! sock.rs`): the embedded object loads with its maps pinned in a fresh directory per
//! test, the maps are filled by hand, all eight programs are attached to a test cgroup
//! and `rune-test-client` processes run inside it.
//!
//! Needs root. Network rule: clients only address loopback or VIPs from
//! 198.18.0.0/15 (and fd00::/8) that the programs rewrite to loopback backends; every
//! VIP used here has a frontend, so nothing ever leaves the machine. The backends are
//! threads of the test on 127.0.0.1 / ::1; the test process itself is not in the
//! cgroup, so its sockets are never translated.

use std::{
    io::{BufRead as _, BufReader, ErrorKind, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, UdpSocket},
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use agent_common::lb::{
    self, AffinityKey, AffinityValue, BACKEND_ACTIVE, Backend, DropReason, FAMILY_V4, FAMILY_V6,
    PROTO_TCP, PROTO_UDP, ServiceKeyV4, ServiceKeyV6, ServiceValue, SockRevKey, SockRevValue,
    TrafficStats,
};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, PerCpuArray},
    programs::{CgroupAttachMode, CgroupSockAddr, ProgramError},
};
use rune_agent::dataplane::ebpf::stats::{self, StatsLayout};
use rune_harness::{bpffs::PinDir, cgroup::TestCgroup, netns::require_root};
use serde_json::Value;

/// Slots of the test's Maglev array (`RUNE_MAGLEV`).
const MAGLEV_SLOTS: u32 = 256;
/// Capacity of every other map: small, so each test's maps are cheap to create.
const MAP_ENTRIES: u32 = 1024;
/// How long a client process may take before the test kills it.
const CLIENT_PATIENCE: Duration = Duration::from_secs(30);

const SOCK_PROGRAMS: [&str; 8] = [
    lb::PROG_CONNECT4,
    lb::PROG_CONNECT6,
    lb::PROG_SENDMSG4,
    lb::PROG_SENDMSG6,
    lb::PROG_RECVMSG4,
    lb::PROG_RECVMSG6,
    lb::PROG_GETPEERNAME4,
    lb::PROG_GETPEERNAME6,
];

// ---------------------------------------------------------------------------------
// Fixture: pinned maps, programs attached to a test cgroup.

/// One test's world. Fields drop in order: programs detach and maps close first,
/// then the pins go, then the cgroup (whose client processes have exited).
struct Fixture {
    bpf: Ebpf,
    _pins: PinDir,
    cgroup: TestCgroup,
}

impl Fixture {
    fn new(tag: &str) -> Self {
        if let Err(e) = require_root() {
            panic!("{e}");
        }
        assert!(
            rune_agent::dataplane::ebpf::programs_embedded(),
            "rune-agent was built without eBPF programs (AYA_BUILD_SKIP)"
        );
        let pins = PinDir::create("sock").unwrap_or_else(|e| panic!("{e:#}"));
        let layout = StatsLayout::new(pins.path(), MAP_ENTRIES, MAP_ENTRIES).unwrap();
        let mut loader = EbpfLoader::new();
        layout.configure(&mut loader);
        loader.default_map_pin_directory(pins.path());
        loader.map_max_entries(lb::MAGLEV, MAGLEV_SLOTS);
        for name in [
            lb::SERVICES_V4,
            lb::SERVICES_V6,
            lb::BACKENDS,
            lb::CONNTRACK_V4,
            lb::CONNTRACK_V6,
            lb::AFFINITY,
            lb::SOCK_REVERSE,
        ] {
            loader.map_max_entries(name, MAP_ENTRIES);
        }
        let mut bpf = loader
            .load(rune_agent::dataplane::ebpf::EMBEDDED_OBJECT)
            .unwrap_or_else(|e| panic!("loading the embedded object: {e:#?}"));
        let cgroup = TestCgroup::new(tag).unwrap();
        for name in SOCK_PROGRAMS {
            let program: &mut CgroupSockAddr = bpf
                .program_mut(name)
                .unwrap_or_else(|| panic!("program {name} missing from the object"))
                .try_into()
                .unwrap_or_else(|e| panic!("program {name}: {e}"));
            if let Err(e) = program.load() {
                match e {
                    ProgramError::LoadError { verifier_log, .. } => {
                        panic!("the verifier rejected {name}:\n{verifier_log}")
                    }
                    e => panic!("loading {name}: {e}"),
                }
            }
            program
                .attach(cgroup.fd(), CgroupAttachMode::Single)
                .unwrap_or_else(|e| panic!("attaching {name}: {e}"));
        }
        Self {
            bpf,
            _pins: pins,
            cgroup,
        }
    }

    fn add_service(&mut self, vip: SocketAddr, proto: u8, svc: ServiceValue) {
        match vip.ip() {
            IpAddr::V4(ip) => {
                let mut map: HashMap<_, ServiceKeyV4, ServiceValue> =
                    HashMap::try_from(self.bpf.map_mut(lb::SERVICES_V4).unwrap()).unwrap();
                let key = ServiceKeyV4 {
                    addr: u32::from_ne_bytes(ip.octets()),
                    port: vip.port().to_be(),
                    proto,
                    pad: 0,
                };
                map.insert(key, svc, 0).unwrap();
            }
            IpAddr::V6(ip) => {
                let mut map: HashMap<_, ServiceKeyV6, ServiceValue> =
                    HashMap::try_from(self.bpf.map_mut(lb::SERVICES_V6).unwrap()).unwrap();
                let key = ServiceKeyV6 {
                    addr: lb::addr_from_octets(&ip.octets()),
                    port: vip.port().to_be(),
                    proto,
                    pad: 0,
                };
                map.insert(key, svc, 0).unwrap();
            }
        }
    }

    fn set_backend(&mut self, id: u32, addr: SocketAddr) {
        let (octets, family) = match addr.ip() {
            IpAddr::V4(ip) => (ip.octets().to_vec(), FAMILY_V4),
            IpAddr::V6(ip) => (ip.octets().to_vec(), FAMILY_V6),
        };
        let backend = Backend {
            addr: lb::addr_from_octets(&octets),
            port: addr.port().to_be(),
            family,
            state: BACKEND_ACTIVE,
        };
        let mut map: Array<_, Backend> =
            Array::try_from(self.bpf.map_mut(lb::BACKENDS).unwrap()).unwrap();
        map.set(id, backend, 0).unwrap();
    }

    /// Writes a Maglev table of backend ids at `base`.
    fn set_table(&mut self, base: u32, ids: &[u32]) {
        let mut map: Array<_, [u32; 2]> =
            Array::try_from(self.bpf.map_mut(lb::MAGLEV).unwrap()).unwrap();
        for (i, id) in ids.iter().enumerate() {
            rune_agent_tests::maps::set_maglev_slot(&mut map, base + i as u32, *id);
        }
    }

    /// A service `id` at `vip` balanced over `backends` (ids `first_backend_id`..):
    /// a table of 7 slots (prime) filled round-robin at `id * 8`.
    fn service(
        &mut self,
        id: u32,
        vip: SocketAddr,
        proto: u8,
        first_backend_id: u32,
        backends: &[SocketAddr],
    ) {
        let ids: Vec<u32> = (0..backends.len() as u32)
            .map(|i| first_backend_id + i)
            .collect();
        for (backend_id, addr) in ids.iter().zip(backends) {
            self.set_backend(*backend_id, *addr);
        }
        let table: Vec<u32> = (0..7).map(|slot| ids[slot % ids.len()]).collect();
        self.set_table(id * 8, &table);
        self.add_service(
            vip,
            proto,
            ServiceValue {
                id,
                maglev_base: id * 8,
                maglev_size: table.len() as u32,
                affinity_timeout: 0,
            },
        );
    }

    fn service_stats(&self, id: u32) -> TrafficStats {
        self.stats(lb::SERVICE_STATS, id)
    }

    fn backend_flows(&self, id: u32) -> u64 {
        self.stats(lb::BACKEND_STATS, id).flows
    }

    fn stats(&self, name: &str, id: u32) -> TrafficStats {
        let map: Array<_, TrafficStats> = Array::try_from(self.bpf.map(name).unwrap()).unwrap();
        stats::read(&map, id).unwrap()
    }

    fn drops(&self, reason: DropReason) -> u64 {
        let map: PerCpuArray<_, u64> =
            PerCpuArray::try_from(self.bpf.map(lb::DROPS).unwrap()).unwrap();
        map.get(&(reason as u32), 0).unwrap().iter().sum()
    }

    fn all_drops(&self) -> u64 {
        DropReason::ALL.iter().map(|r| self.drops(*r)).sum()
    }

    fn reverse_entries(&self) -> usize {
        let map: HashMap<_, SockRevKey, SockRevValue> =
            HashMap::try_from(self.bpf.map(lb::SOCK_REVERSE).unwrap()).unwrap();
        map.keys().count()
    }

    /// Runs `rune-test-client MODE ADDR COUNT` inside the cgroup: its JSON lines on
    /// success, its stderr on failure.
    fn client(&self, mode: &str, addr: SocketAddr, count: u32) -> Result<Vec<Value>, String> {
        let mut child = self
            .cgroup
            .command(env!("CARGO_BIN_EXE_rune-test-client"))
            .args([mode, &addr.to_string(), &count.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning rune-test-client in the test cgroup");
        let deadline = Instant::now() + CLIENT_PATIENCE;
        while child.try_wait().unwrap().is_none() {
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("rune-test-client {mode} {addr} ran longer than {CLIENT_PATIENCE:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let output = child.wait_with_output().unwrap();
        if !output.status.success() {
            return Err(String::from_utf8_lossy(&output.stderr).into_owned());
        }
        Ok(String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
            .collect())
    }

    fn client_ok(&self, mode: &str, addr: SocketAddr, count: u32) -> Vec<Value> {
        let lines = self
            .client(mode, addr, count)
            .unwrap_or_else(|e| panic!("rune-test-client {mode} {addr} failed: {e}"));
        assert_eq!(lines.len(), count as usize, "{lines:?}");
        lines
    }
}

// ---------------------------------------------------------------------------------
// Backends: threads answering with their name until dropped.

struct TestBackend {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl TestBackend {
    /// A TCP backend on `ip`: reads a line per connection, answers `NAME\n`.
    fn tcp(name: &'static str, ip: IpAddr) -> Self {
        let listener = TcpListener::bind((ip, 0)).unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        Self::spawn(addr, move |stop| {
            while !stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let _ = stream.set_nonblocking(false);
                        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                        let mut line = String::new();
                        if BufReader::new(&stream).read_line(&mut line).is_ok() {
                            let _ = (&stream).write_all(format!("{name}\n").as_bytes());
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(e) => panic!("backend {name}: accept: {e}"),
                }
            }
        })
    }

    /// A UDP backend on `ip`: answers every datagram with `NAME`.
    fn udp(name: &'static str, ip: IpAddr) -> Self {
        let socket = UdpSocket::bind((ip, 0)).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let addr = socket.local_addr().unwrap();
        Self::spawn(addr, move |stop| {
            let mut buf = [0u8; 1500];
            while !stop.load(Ordering::Relaxed) {
                match socket.recv_from(&mut buf) {
                    Ok((_, from)) => {
                        let _ = socket.send_to(name.as_bytes(), from);
                    }
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                    Err(e) => panic!("backend {name}: recv: {e}"),
                }
            }
        })
    }

    fn spawn(addr: SocketAddr, serve: impl FnOnce(&AtomicBool) + Send + 'static) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || serve(&flag));
        Self {
            addr,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for TestBackend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn v4(a: u8, b: u8, c: u8, d: u8, port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::new(a, b, c, d), port))
}

const LOOPBACK4: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const LOOPBACK6: IpAddr = IpAddr::V6(Ipv6Addr::LOCALHOST);

fn field<'a>(line: &'a Value, name: &str) -> &'a str {
    line[name]
        .as_str()
        .unwrap_or_else(|| panic!("no {name} in {line}"))
}

// ---------------------------------------------------------------------------------
// Tests.

#[test]
fn tcp_connect_to_vip_reaches_backend_and_getpeername_shows_vip() {
    let mut fx = Fixture::new("sock-tcp");
    let backend = TestBackend::tcp("b1", LOOPBACK4);
    let vip = v4(198, 18, 0, 10, 80);
    fx.service(1, vip, PROTO_TCP, 1, &[backend.addr]);

    let lines = fx.client_ok("tcp", vip, 3);
    for line in &lines {
        assert_eq!(field(line, "reply"), "b1");
        assert_eq!(field(line, "peer"), vip.to_string(), "getpeername: {line}");
        assert!(field(line, "local").starts_with("127.0.0.1:"), "{line}");
    }
    let stats = fx.service_stats(1);
    assert_eq!(stats.flows, 3, "one flow per connect: {stats:?}");
    assert_eq!(stats.packets, 0, "socket LB translates no packets");
    assert_eq!(fx.backend_flows(1), 3);
    assert_eq!(fx.all_drops(), 0);
    assert_eq!(fx.reverse_entries(), 3, "one reverse entry per socket");
}

#[test]
fn connected_udp_to_vip_sees_vip_as_peer_and_sender() {
    let mut fx = Fixture::new("sock-udpc");
    let backend = TestBackend::udp("u1", LOOPBACK4);
    let vip = v4(198, 18, 0, 11, 53);
    fx.service(2, vip, PROTO_UDP, 1, &[backend.addr]);

    let lines = fx.client_ok("udp-connected", vip, 2);
    for line in &lines {
        assert_eq!(field(line, "reply"), "u1");
        assert_eq!(field(line, "peer"), vip.to_string(), "getpeername: {line}");
        assert_eq!(field(line, "from"), vip.to_string(), "recvfrom: {line}");
    }
    assert_eq!(fx.service_stats(2).flows, 2);
    assert_eq!(fx.all_drops(), 0);
}

#[test]
fn unconnected_udp_reply_comes_from_vip() {
    let mut fx = Fixture::new("sock-udpu");
    let backend = TestBackend::udp("u2", LOOPBACK4);
    let vip = v4(198, 18, 0, 12, 5353);
    fx.service(3, vip, PROTO_UDP, 1, &[backend.addr]);

    let lines = fx.client_ok("udp-unconnected", vip, 2);
    for line in &lines {
        assert_eq!(field(line, "reply"), "u2");
        assert_eq!(field(line, "peer"), vip.to_string(), "recvfrom: {line}");
    }
    // One flow per datagram sent (sendmsg balances each one).
    assert_eq!(fx.service_stats(3).flows, 2);
    assert_eq!(fx.all_drops(), 0);
}

#[test]
fn vip_without_backends_is_refused_and_counted() {
    let mut fx = Fixture::new("sock-nobe");
    let tcp_vip = v4(198, 18, 0, 13, 80);
    let udp_vip = v4(198, 18, 0, 13, 53);
    let empty = ServiceValue {
        id: 4,
        maglev_base: 0,
        maglev_size: 0,
        affinity_timeout: 0,
    };
    fx.add_service(tcp_vip, PROTO_TCP, empty);
    fx.add_service(udp_vip, PROTO_UDP, ServiceValue { id: 5, ..empty });

    let err = fx.client("tcp", tcp_vip, 1).unwrap_err();
    assert!(
        err.contains("connect") && err.contains("not permitted"),
        "{err}"
    );
    assert_eq!(fx.drops(DropReason::NoBackend), 1);

    let err = fx.client("udp-unconnected", udp_vip, 1).unwrap_err();
    assert!(
        err.contains("sendto") && err.contains("not permitted"),
        "{err}"
    );
    let err = fx.client("udp-connected", udp_vip, 1).unwrap_err();
    assert!(
        err.contains("connect") && err.contains("not permitted"),
        "{err}"
    );
    assert_eq!(fx.drops(DropReason::NoBackend), 3);
    assert_eq!(fx.all_drops(), 3);
    assert_eq!(fx.service_stats(4).flows + fx.service_stats(5).flows, 0);
    assert_eq!(fx.reverse_entries(), 0);
}

#[test]
fn missing_or_wrong_family_backend_is_refused_and_counted() {
    let mut fx = Fixture::new("sock-miss");
    let backend6 = TestBackend::tcp("b6", LOOPBACK6);
    let vip_missing = v4(198, 18, 0, 14, 80);
    let vip_family = v4(198, 18, 0, 14, 81);
    // Table slot naming backend id 9, which was never set.
    fx.set_table(6 * 8, &[9]);
    fx.add_service(
        vip_missing,
        PROTO_TCP,
        ServiceValue {
            id: 6,
            maglev_base: 6 * 8,
            maglev_size: 1,
            affinity_timeout: 0,
        },
    );
    // An IPv4 frontend whose table names an IPv6 backend.
    fx.service(7, vip_family, PROTO_TCP, 1, &[backend6.addr]);

    let err = fx.client("tcp", vip_missing, 1).unwrap_err();
    assert!(err.contains("not permitted"), "{err}");
    let err = fx.client("tcp", vip_family, 1).unwrap_err();
    assert!(err.contains("not permitted"), "{err}");
    assert_eq!(fx.drops(DropReason::BackendMissing), 2);
    assert_eq!(fx.all_drops(), 2);
    assert_eq!(fx.service_stats(6).flows + fx.service_stats(7).flows, 0);
}

#[test]
fn non_vip_connect_is_untouched() {
    let mut fx = Fixture::new("sock-novip");
    let tcp = TestBackend::tcp("direct", LOOPBACK4);
    let udp = TestBackend::udp("direct-udp", LOOPBACK4);
    // A service exists (on another address), so the maps are not empty.
    fx.service(8, v4(198, 18, 0, 15, 80), PROTO_TCP, 1, &[tcp.addr]);

    let lines = fx.client_ok("tcp", tcp.addr, 2);
    for line in &lines {
        assert_eq!(field(line, "reply"), "direct");
        assert_eq!(field(line, "peer"), tcp.addr.to_string());
    }
    let lines = fx.client_ok("udp-unconnected", udp.addr, 1);
    assert_eq!(field(&lines[0], "peer"), udp.addr.to_string());
    let lines = fx.client_ok("udp-connected", udp.addr, 1);
    assert_eq!(field(&lines[0], "from"), udp.addr.to_string());

    assert_eq!(fx.service_stats(8), TrafficStats::default());
    assert_eq!(fx.backend_flows(1), 0);
    assert_eq!(fx.all_drops(), 0);
    assert_eq!(
        fx.reverse_entries(),
        0,
        "no reverse entry for non-VIP traffic"
    );
}

#[test]
fn ipv6_vip_reaches_ipv6_backend() {
    let mut fx = Fixture::new("sock-v6");
    let tcp = TestBackend::tcp("b6", LOOPBACK6);
    let udp = TestBackend::udp("u6", LOOPBACK6);
    let vip_ip: Ipv6Addr = "fd00::10".parse().unwrap();
    let tcp_vip = SocketAddr::from((vip_ip, 80));
    let udp_vip = SocketAddr::from((vip_ip, 53));
    fx.service(9, tcp_vip, PROTO_TCP, 1, &[tcp.addr]);
    fx.service(10, udp_vip, PROTO_UDP, 2, &[udp.addr]);

    let line = &fx.client_ok("tcp", tcp_vip, 1)[0];
    assert_eq!(field(line, "reply"), "b6");
    assert_eq!(field(line, "peer"), tcp_vip.to_string(), "{line}");
    assert!(field(line, "local").starts_with("[::1]:"), "{line}");

    let line = &fx.client_ok("udp-connected", udp_vip, 1)[0];
    assert_eq!(field(line, "reply"), "u6");
    assert_eq!(field(line, "peer"), udp_vip.to_string(), "{line}");
    assert_eq!(field(line, "from"), udp_vip.to_string(), "{line}");

    let line = &fx.client_ok("udp-unconnected", udp_vip, 1)[0];
    assert_eq!(field(line, "reply"), "u6");
    assert_eq!(field(line, "peer"), udp_vip.to_string(), "{line}");

    assert_eq!(fx.service_stats(9).flows, 1);
    assert_eq!(fx.service_stats(10).flows, 2);
    assert_eq!(fx.all_drops(), 0);
}

#[test]
fn v4_mapped_vip_on_ipv6_socket_uses_ipv4_frontend() {
    let mut fx = Fixture::new("sock-mapped");
    let tcp = TestBackend::tcp("m4", LOOPBACK4);
    let udp = TestBackend::udp("mu4", LOOPBACK4);
    let tcp_vip = v4(198, 18, 0, 16, 80);
    let udp_vip = v4(198, 18, 0, 16, 53);
    fx.service(11, tcp_vip, PROTO_TCP, 1, &[tcp.addr]);
    fx.service(12, udp_vip, PROTO_UDP, 2, &[udp.addr]);
    let mapped = |vip: SocketAddr| match vip.ip() {
        IpAddr::V4(ip) => SocketAddr::from((ip.to_ipv6_mapped(), vip.port())),
        IpAddr::V6(_) => unreachable!(),
    };

    let line = &fx.client_ok("tcp", mapped(tcp_vip), 1)[0];
    assert_eq!(field(line, "reply"), "m4");
    assert_eq!(field(line, "peer"), mapped(tcp_vip).to_string(), "{line}");

    let line = &fx.client_ok("udp-connected", mapped(udp_vip), 1)[0];
    assert_eq!(field(line, "reply"), "mu4");
    assert_eq!(field(line, "peer"), mapped(udp_vip).to_string(), "{line}");
    assert_eq!(field(line, "from"), mapped(udp_vip).to_string(), "{line}");

    // Unconnected: the kernel runs sendmsg4 for a mapped destination; recvmsg6
    // finds the IPv4 reverse entry.
    let line = &fx.client_ok("udp-unconnected", mapped(udp_vip), 1)[0];
    assert_eq!(field(line, "reply"), "mu4");
    assert_eq!(field(line, "peer"), mapped(udp_vip).to_string(), "{line}");

    assert_eq!(fx.service_stats(11).flows, 1);
    assert_eq!(fx.service_stats(12).flows, 2);
    assert_eq!(fx.all_drops(), 0);
}

#[test]
fn two_backends_share_the_connects() {
    const CONNECTS: u32 = 50;
    let mut fx = Fixture::new("sock-spread");
    let b1 = TestBackend::tcp("s1", LOOPBACK4);
    let b2 = TestBackend::tcp("s2", LOOPBACK4);
    let vip = v4(198, 18, 0, 17, 80);
    fx.service(13, vip, PROTO_TCP, 1, &[b1.addr, b2.addr]);

    let lines = fx.client_ok("tcp", vip, CONNECTS);
    let s1 = lines.iter().filter(|l| field(l, "reply") == "s1").count() as u64;
    let s2 = lines.iter().filter(|l| field(l, "reply") == "s2").count() as u64;
    assert_eq!(s1 + s2, u64::from(CONNECTS));
    assert!(lines.iter().all(|l| field(l, "peer") == vip.to_string()));
    // Slots 4:3 over 50 random picks: fewer than 5 on either side has a
    // probability far below 1e-6.
    assert!(s1 >= 5 && s2 >= 5, "s1 {s1}, s2 {s2}");
    assert_eq!(fx.service_stats(13).flows, u64::from(CONNECTS));
    assert_eq!(fx.backend_flows(1), s1);
    assert_eq!(fx.backend_flows(2), s2);
}

#[test]
fn client_ip_affinity_is_keyed_by_network_namespace() {
    const CONNECTS: u32 = 20;
    let mut fx = Fixture::new("sock-aff");
    let b1 = TestBackend::tcp("a1", LOOPBACK4);
    let b2 = TestBackend::tcp("a2", LOOPBACK4);
    let vip = v4(198, 18, 0, 18, 80);
    fx.service(14, vip, PROTO_TCP, 1, &[b1.addr, b2.addr]);
    // Turn affinity on (the service entry is replaced whole, as the agent does).
    fx.add_service(
        vip,
        PROTO_TCP,
        ServiceValue {
            id: 14,
            maglev_base: 14 * 8,
            maglev_size: 7,
            affinity_timeout: 60,
        },
    );

    // Two processes in the same network namespace: every connect sticks to one
    // backend.
    let mut lines = fx.client_ok("tcp", vip, CONNECTS);
    lines.extend(fx.client_ok("tcp", vip, CONNECTS));
    let first = field(&lines[0], "reply").to_owned();
    assert!(
        lines.iter().all(|l| field(l, "reply") == first),
        "affinity broken: {lines:?}"
    );
    assert_eq!(fx.service_stats(14).flows, 2 * u64::from(CONNECTS));

    // The one affinity entry's "client" is this network namespace's cookie.
    let map: HashMap<_, AffinityKey, AffinityValue> =
        HashMap::try_from(fx.bpf.map(lb::AFFINITY).unwrap()).unwrap();
    let keys: Vec<AffinityKey> = map.keys().map(Result::unwrap).collect();
    let cookie = netns_cookie();
    let expected = [
        cookie as u32,
        (cookie >> 32) as u32,
        0,
        u32::from_ne_bytes(*b"rune"),
    ];
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!(keys[0].service_id, 14);
    assert_eq!(keys[0].client, expected, "netns cookie {cookie}");
    let chosen = map.get(&keys[0], 0).unwrap().backend_id;
    assert_eq!(if first == "a1" { 1 } else { 2 }, chosen);
}

/// The cookie of this process's network namespace (`SO_NETNS_COOKIE`).
fn netns_cookie() -> u64 {
    let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: a valid socket and an out-buffer of the size given.
    let rc = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    assert_eq!(
        rc,
        0,
        "SO_NETNS_COOKIE: {}",
        std::io::Error::last_os_error()
    );
    cookie
}
