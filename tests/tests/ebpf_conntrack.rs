//! How the eBPF data plane tells the flows of different frontends apart when they
//! share a backend (issue 14), in tc mode and in XDP mode.
//!
//! The tc egress program translates a backend's reply back to the VIP and service
//! port its flow came through. Which frontend that was must come from the flow, not
//! from a guess over the frontends leading to the backend:
//!
//! * [`reused_source_ports_across_frontends`]: one client, a small range of source
//!   ports, two VIPs in front of the same backend (IPv4 and IPv6). Each port comes
//!   back within about a second through the other VIP, while the backend still
//!   holds the previous connection's TIME_WAIT (its server closes first). The two
//!   flows must not meet at the backend on one 4-tuple (its TIME_WAIT would refuse
//!   the second SYN, another client view) and each flow's packets, a challenge ACK
//!   included, must go back through the VIP its SYN came through; otherwise the
//!   client never sees them and its connect stalls for a second (a SYN
//!   retransmitted on timeout).
//! * [`one_backend_behind_many_frontends`] (20 and 200 TCP frontends, and 3 UDP
//!   ones): replies through every frontend of one backend get their VIP and port
//!   back, with no bound on the frontends per backend, and the agent does not warn
//!   of one.
//!
//! Needs root. Each test builds its own namespaces (and pin directory) and removes
//! them on drop; traffic goes only to 198.18.0.0/15 and fd00::/8 inside them. Tests
//! run one at a time (they share the CPU with the agent they start).

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use rune_agent_tests::{
    modes::{Mode, ModeAgent},
    vip::{BACKEND_PORT, PATIENCE},
};
use rune_harness::{
    agent::eventually,
    netns::require_root,
    topology::{Topology, TopologyConfig},
};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// One test at a time: each starts a privileged agent and its own topology.
static SERIAL: Mutex<()> = Mutex::new(());

/// Instantiates `scenario(mode)` as one test per mode, in a module named after it.
macro_rules! per_mode {
    ($scenario:ident: $($test:ident => $mode:expr),+ $(,)?) => {
        mod $scenario {
            $(
                #[test]
                fn $test() {
                    super::$scenario($mode);
                }
            )+
        }
    };
}

per_mode!(reused_source_ports_across_frontends:
    ebpf_tc => super::Mode::Ebpf,
    ebpf_xdp => super::Mode::EbpfXdp,
);
per_mode!(one_backend_behind_20_frontends:
    ebpf_tc => super::Mode::Ebpf,
    ebpf_xdp => super::Mode::EbpfXdp,
);
per_mode!(one_backend_behind_200_frontends:
    ebpf_tc => super::Mode::Ebpf,
    ebpf_xdp => super::Mode::EbpfXdp,
);

/// The first VIPs of the tests' services; the others follow (198.18.100.11,
/// fd00:100::11, ...).
const FIRST_VIP4: Ipv4Addr = Ipv4Addr::new(198, 18, 100, 10);
const FIRST_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, 0x10);
/// A TCP connect slower than this is a stall: an unanswered SYN is sent again only
/// after a second.
const STALL: Duration = Duration::from_millis(500);
/// How long a probe waits to connect and then for its reply.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The `i`th VIP (0-based) of the tests' services, of `family`'s family (in
/// 198.18.100.0/24 or fd00:100::/64).
fn vip(i: usize, family: IpAddr) -> IpAddr {
    assert!(i < 200, "VIP {i} is outside the VIP ranges");
    match family {
        IpAddr::V4(_) => IpAddr::V4((u32::from(FIRST_VIP4) + i as u32).into()),
        IpAddr::V6(_) => IpAddr::V6((u128::from(FIRST_VIP6) + i as u128).into()),
    }
}

/// Service `name` on `vips` with TCP ports `tcp_ports` and, when given, UDP port
/// `udp_port`, all to the backends' [`BACKEND_PORT`], and its endpoints `backends`
/// (ready).
fn service_yaml(
    name: &str,
    vips: &[IpAddr],
    tcp_ports: &[u16],
    udp_port: Option<u16>,
    backends: &[IpAddr],
) -> String {
    let mut ports = String::new();
    for p in tcp_ports {
        ports.push_str(&format!(
            "    - {{name: tcp-{p}, port: {p}, protocol: TCP, targetPort: {BACKEND_PORT}}}\n"
        ));
    }
    if let Some(p) = udp_port {
        ports.push_str(&format!(
            "    - {{name: udp-{p}, port: {p}, protocol: UDP, targetPort: {BACKEND_PORT}}}\n"
        ));
    }
    let vips: Vec<String> = vips.iter().map(|v| format!("\"{v}\"")).collect();
    let vips = vips.join(", ");
    let mut eps = String::new();
    for b in backends {
        eps.push_str(&format!(
            "    - {{address: \"{b}\", node: node-b, ready: true, terminating: false}}\n"
        ));
    }
    format!(
        "apiVersion: rune/v1
kind: Service
metadata: {{name: {name}}}
spec:
  ports:
{ports}  discovery: {{vips: [{vips}]}}
---
apiVersion: rune/v1
kind: Endpoints
metadata: {{name: {name}}}
spec:
  endpoints:
{eps}"
    )
}

/// The frontends the agent has written to the maps (it lists each one in
/// `rune_dataplane_flows_total`).
fn frontends_in_maps(m: &ModeAgent<'_>) -> usize {
    m.agent()
        .metrics_text()
        .lines()
        .filter(|l| l.starts_with("rune_dataplane_flows_total{"))
        .count()
}

/// Counter `name` of the `TcpExt` lines of /proc/net/netstat, in the network
/// namespace of the calling thread (`thread-self`: `/proc/net` is the process's).
fn tcp_ext_counter(name: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/thread-self/net/netstat").unwrap();
    let mut lines = text.lines();
    while let (Some(names), Some(values)) = (lines.next(), lines.next()) {
        if !names.starts_with("TcpExt:") {
            continue;
        }
        let found = names
            .split_whitespace()
            .zip(values.split_whitespace())
            .find(|(n, _)| *n == name);
        if let Some((_, v)) = found {
            return v.parse().unwrap();
        }
    }
    panic!("no TcpExt counter {name} in /proc/net/netstat");
}

/// What one [`tcp_probe`] saw.
struct Probe {
    /// How long the connect took, if it connected.
    connect: Option<Duration>,
    /// SYNs the client sent again before it connected.
    syn_retransmits: u32,
    /// `Ok`, or the step that failed.
    result: Result<(), String>,
}

/// One TCP request from `src` (bound with SO_REUSEADDR) to `to`: connects within
/// [`PROBE_TIMEOUT`], checks the peer is `to`, sends `line` and reads the reply to
/// EOF (the server closes after its reply), which must be `"<backend> <line>\n"`.
/// Run it in the client's namespace.
fn tcp_probe(src: SocketAddr, to: SocketAddr, line: &str) -> Probe {
    let failed = |connect, syn_retransmits, e: String| Probe {
        connect,
        syn_retransmits,
        result: Err(e),
    };
    let socket = match Socket::new(Domain::for_address(to), Type::STREAM, Some(Protocol::TCP))
        .and_then(|s| s.set_reuse_address(true).map(|()| s))
        .and_then(|s| s.bind(&SockAddr::from(src)).map(|()| s))
    {
        Ok(s) => s,
        Err(e) => return failed(None, 0, format!("socket bound to {src}: {e}")),
    };
    let started = Instant::now();
    if let Err(e) = socket.connect_timeout(&SockAddr::from(to), PROBE_TIMEOUT) {
        return failed(None, 0, format!("connect: {e}"));
    }
    let connect = Some(started.elapsed());
    let stream: TcpStream = socket.into();
    // Read before any data: every retransmission so far was of the SYN.
    let syn_retransmits = match total_retransmits(&stream) {
        Ok(n) => n,
        Err(e) => return failed(connect, 0, format!("TCP_INFO: {e}")),
    };
    let exchange = || -> std::io::Result<(SocketAddr, String)> {
        stream.set_read_timeout(Some(PROBE_TIMEOUT))?;
        stream.set_write_timeout(Some(PROBE_TIMEOUT))?;
        let peer = stream.peer_addr()?;
        (&stream).write_all(format!("{line}\n").as_bytes())?;
        let mut reply = String::new();
        (&stream).read_to_string(&mut reply)?;
        Ok((peer, reply))
    };
    let result = match exchange() {
        Err(e) => Err(format!("exchange: {e}")),
        Ok((peer, _)) if peer != to => Err(format!("peer {peer}, not {to}")),
        Ok((_, reply))
            if !reply.starts_with("backend-") || !reply.ends_with(&format!(" {line}\n")) =>
        {
            Err(format!("reply {reply:?}"))
        }
        Ok(_) => Ok(()),
    };
    Probe {
        connect,
        syn_retransmits,
        result,
    }
}

/// `tcpi_total_retrans` of `stream` (`TCP_INFO`): its retransmitted segments.
fn total_retransmits(stream: &TcpStream) -> std::io::Result<u32> {
    // SAFETY: tcp_info is plain integers; all zeros is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` and `len` are valid for writes of `len` bytes, and the
    // descriptor stays open during the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(info.tcpi_total_retrans)
}

/// 600 short TCP connections from one client address and 150 source ports,
/// alternating between two VIPs whose only endpoint is the same backend (IPv4, then
/// as many over IPv6); each port is used through one VIP, then (a cycle later,
/// about a second) through the other. The backend's server closes first, so the
/// backend holds the previous connection's TIME_WAIT when the port comes back
/// through the other VIP; the client holds none, so its port is free at once.
///
/// The backend sees the same address pair both times. Its TIME_WAIT takes the new
/// SYN as a new connection, or (about half the time: the client's TCP timestamps
/// start at a random offset per connection, and an older one fails PAWS) rejects it
/// with a challenge ACK. That ACK is the reply that must be translated back through
/// the VIP the SYN went to: the client then resets the TIME_WAIT and sends its SYN
/// again 10 ms later (the kernel's quick retransmission in SYN-SENT). Translated
/// through the other VIP, it reaches no socket, and the SYN is retransmitted only
/// after a second.
///
/// Every connection must succeed (the VIP as its peer, a backend's reply),
/// connected within [`STALL`] (500 ms), and every SYN the client retransmitted
/// (`TcpExtTCPSynRetrans`) must be one of those quick ones.
fn reused_source_ports_across_frontends(mode: Mode) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = Topology::with_config(&TopologyConfig {
        backends: 1,
        tcp_port: Some(BACKEND_PORT),
        udp_port: None,
        tcp_close_after_reply: true,
        ..TopologyConfig::default()
    })
    .unwrap();
    let m = ModeAgent::start(mode, &topo);
    let backend = topo.backends()[0].addr();
    // Two services, each on an IPv4 and an IPv6 VIP, port 80, the same backend.
    let vips = |family: IpAddr| [0, 1].map(|i| SocketAddr::new(vip(i, family), 80));
    let (v4, v6) = (
        vips(Ipv4Addr::UNSPECIFIED.into()),
        vips(Ipv6Addr::UNSPECIFIED.into()),
    );
    let yaml: Vec<String> = (0..2)
        .map(|i| {
            let vips = [v4[i].ip(), v6[i].ip()];
            service_yaml(&format!("front-{i}"), &vips, &[80], None, &backend.both())
        })
        .collect();
    m.apply(&yaml.join("---\n"));
    // From the client's second address: the bursts' addresses see no other flow.
    for v in v4.into_iter().chain(v6) {
        let alt = topo.client_alt_addr().like(v.ip());
        eventually(PATIENCE, &format!("{v} answers"), || {
            topo.tcp_request_from(Some(alt), v, "ping").ok().map(drop)
        });
    }

    let mut summaries = Vec::new();
    let mut ok = true;
    for vips in [v4, v6] {
        let client = topo.client_addr().like(vips[0].ip());
        let (good, summary) = topo.client().run(|| reuse_burst(client, vips)).unwrap();
        eprintln!("{mode:?}: {summary}");
        ok &= good;
        summaries.push(summary);
    }
    assert!(ok, "{mode:?}: {summaries:#?}");
}

/// The burst of [`reused_source_ports_across_frontends`] from `client` to `vips`
/// (one family), in the client's namespace: whether it went well, and what it saw.
fn reuse_burst(client: IpAddr, vips: [SocketAddr; 2]) -> (bool, String) {
    /// Connections in the burst.
    const CONNECTIONS: usize = 600;
    /// Source ports the burst cycles through (below the ephemeral range, so no
    /// other client socket takes them).
    const PORTS: usize = 150;
    const FIRST_PORT: u16 = 20_000;
    /// The burst stops after this long, or after this many failed or stalled
    /// connections.
    const DEADLINE: Duration = Duration::from_secs(60);
    const MAX_BAD: usize = 20;

    let before = tcp_ext_counter("TCPSynRetrans");
    let started = Instant::now();
    let mut probes = Vec::with_capacity(CONNECTIONS);
    let mut bad = 0;
    for i in 0..CONNECTIONS {
        if started.elapsed() > DEADLINE || bad >= MAX_BAD {
            break;
        }
        let src = SocketAddr::new(client, FIRST_PORT + (i % PORTS) as u16);
        // Each cycle through the ports moves every port to the other VIP.
        let to = vips[(i + i / PORTS) % 2];
        let probe = tcp_probe(src, to, &format!("c{i}"));
        bad += usize::from(probe.result.is_err() || probe.connect.is_none_or(|c| c > STALL));
        probes.push((src, to, probe));
    }
    let syn_retransmits = tcp_ext_counter("TCPSynRetrans") - before;
    let took = started.elapsed();

    let failed: Vec<String> = probes
        .iter()
        .enumerate()
        .filter_map(|(i, (src, to, p))| {
            let e = p.result.as_ref().err()?;
            Some(format!("#{i} from port {} to {to}: {e}", src.port()))
        })
        .collect();
    // Per VIP: connections that worked, and that took over STALL to connect.
    let mut per_vip: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for (_, to, p) in &probes {
        let e = per_vip.entry(to.to_string()).or_default();
        e.0 += usize::from(p.result.is_ok());
        e.1 += usize::from(p.connect.is_some_and(|c| c > STALL));
    }
    let stalls: usize = per_vip.values().map(|v| v.1).sum();
    let max = probes
        .iter()
        .filter_map(|p| p.2.connect)
        .max()
        .unwrap_or_default();
    let quick: u64 = probes
        .iter()
        .filter(|p| p.2.connect.is_some_and(|c| c <= STALL))
        .map(|p| u64::from(p.2.syn_retransmits))
        .sum();
    let slow = syn_retransmits.saturating_sub(quick);
    let good = probes.len() == CONNECTIONS && failed.is_empty() && stalls == 0 && slow == 0;
    let stalled: Vec<String> = probes
        .iter()
        .enumerate()
        .filter_map(|(i, (src, to, p))| {
            let c = p.connect.filter(|c| *c > STALL)?;
            Some(format!("#{i} from port {} to {to} in {c:?}", src.port()))
        })
        .collect();
    let mut summary = format!(
        "{} of {CONNECTIONS} connections from {client} on {PORTS} source ports, each port \
         alternating between {} and {} (one backend, which closes first) in {took:?} (the burst \
         stops after {DEADLINE:?} or {MAX_BAD} bad connections): {} failed, {stalls} took over \
         {STALL:?} to connect (max {max:?}); client SYN retransmits +{syn_retransmits} ({quick} \
         quick ones in connections made within {STALL:?}, {slow} others); per VIP (worked, \
         stalled): {per_vip:?}",
        probes.len(),
        vips[0],
        vips[1],
        failed.len(),
    );
    if !stalled.is_empty() {
        summary.push_str(&format!(
            "; first stalls: {:?}",
            &stalled[..stalled.len().min(5)]
        ));
    }
    if !failed.is_empty() {
        summary.push_str(&format!(
            "; first failures: {:?}",
            &failed[..failed.len().min(5)]
        ));
    }
    (good, summary)
}

/// [`one_backend_behind_many_frontends`] with 20 TCP frontends (10 VIPs × 2 ports)
/// and 3 UDP ones.
fn one_backend_behind_20_frontends(mode: Mode) {
    one_backend_behind_many_frontends(mode, 10);
}

/// [`one_backend_behind_many_frontends`] with 200 TCP frontends (100 VIPs × 2
/// ports) and 3 UDP ones.
fn one_backend_behind_200_frontends(mode: Mode) {
    one_backend_behind_many_frontends(mode, 100);
}

/// One backend behind `services` services, each on its own VIP with TCP ports 80
/// and 81 (2 × `services` TCP frontends: 20 or 200), the last three also with UDP
/// port 53. A TCP connection through every frontend (16 at a time, each from its
/// own source port) must be answered by the backend with the frontend's VIP and
/// port as its peer, and a UDP request through each UDP frontend must be answered
/// from its VIP and port. The agent must not log that the backend is reached
/// through "too many frontends" (a bound on the frontends per backend leaves the
/// replies through the others untranslated).
fn one_backend_behind_many_frontends(mode: Mode, services: usize) {
    /// Services (the last ones) with a UDP port too.
    const UDP_SERVICES: usize = 3;
    const TCP_PORTS: [u16; 2] = [80, 81];
    const UDP_PORT: u16 = 53;
    /// TCP probes at once.
    const WORKERS: usize = 16;
    /// Source ports: TCP probe `i` uses `FIRST_TCP_PORT + i`, UDP probe `k`
    /// `FIRST_UDP_PORT + k` (below the ephemeral range, each once, so no two flows
    /// share an address pair at the backend).
    const FIRST_TCP_PORT: u16 = 21_000;
    const FIRST_UDP_PORT: u16 = 22_000;

    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = Topology::with_config(&TopologyConfig {
        backends: 1,
        tcp_port: Some(BACKEND_PORT),
        udp_port: Some(BACKEND_PORT),
        tcp_close_after_reply: true,
        ..TopologyConfig::default()
    })
    .unwrap();
    let m = ModeAgent::start_with(mode, &topo, &["--lb-max-frontends", "512"]);
    let backend = topo.backends()[0].addr().v4.into();
    let udp_from = services - UDP_SERVICES.min(services);
    let yaml: Vec<String> = (0..services)
        .map(|i| {
            let udp = (i >= udp_from).then_some(UDP_PORT);
            service_yaml(
                &format!("front-{i}"),
                &[vip(i, backend)],
                &TCP_PORTS,
                udp,
                &[backend],
            )
        })
        .collect();
    m.apply(&yaml.join("---\n"));
    let frontends = services * TCP_PORTS.len() + (services - udp_from);
    eventually(PATIENCE, "every frontend is in the maps", || {
        (frontends_in_maps(&m) == frontends).then_some(())
    });

    // In the order the agent sorts a backend's frontends: by VIP, then port.
    let tcp: Vec<SocketAddr> = (0..services)
        .flat_map(|i| TCP_PORTS.map(|p| SocketAddr::new(vip(i, backend), p)))
        .collect();
    let client = IpAddr::V4(topo.client_addr().v4);
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let mut results: Vec<(usize, Result<(), String>)> = topo
        .client()
        .run(|| {
            thread::scope(|scope| {
                let workers: Vec<_> = (0..WORKERS)
                    .map(|_| {
                        scope.spawn(|| {
                            let mut mine = Vec::new();
                            loop {
                                let i = next.fetch_add(1, Ordering::SeqCst);
                                let Some(to) = tcp.get(i) else { break };
                                let src = SocketAddr::new(client, FIRST_TCP_PORT + i as u16);
                                mine.push((i, tcp_probe(src, *to, &format!("f{i}")).result));
                            }
                            mine
                        })
                    })
                    .collect();
                workers
                    .into_iter()
                    .flat_map(|w| w.join().unwrap())
                    .collect()
            })
        })
        .unwrap();
    let took = started.elapsed();
    results.sort_by_key(|r| r.0);
    let tcp_failed: Vec<usize> = results
        .iter()
        .filter(|r| r.1.is_err())
        .map(|r| r.0)
        .collect();
    let tcp_details: Vec<String> = results
        .iter()
        .filter_map(|(i, r)| {
            let e = r.as_ref().err()?;
            Some(format!("frontend {} {}: {e}", i + 1, tcp[*i]))
        })
        .take(6)
        .collect();

    let udp_failed: Vec<String> = (udp_from..services)
        .enumerate()
        .filter_map(|(k, i)| {
            let to = SocketAddr::new(vip(i, backend), UDP_PORT);
            let src = SocketAddr::new(client, FIRST_UDP_PORT + k as u16);
            let payload = format!("u{k}");
            let reply = topo
                .client()
                .run(|| -> std::io::Result<(String, SocketAddr)> {
                    let socket = UdpSocket::bind(src)?;
                    socket.set_read_timeout(Some(PROBE_TIMEOUT))?;
                    socket.send_to(payload.as_bytes(), to)?;
                    let mut buf = [0u8; 512];
                    let (n, from) = socket.recv_from(&mut buf)?;
                    Ok((String::from_utf8_lossy(&buf[..n]).into_owned(), from))
                })
                .unwrap();
            match reply {
                Ok((text, from))
                    if from == to && text.starts_with("backend-") && text.ends_with(&payload) =>
                {
                    None
                }
                Ok((text, from)) => Some(format!("{to}: {text:?} from {from}")),
                Err(e) => Some(format!("{to}: {e}")),
            }
        })
        .collect();
    let too_many = m
        .log()
        .lines()
        .filter(|l| l.contains("too many frontends"))
        .map(str::to_owned)
        .collect::<Vec<_>>();

    eprintln!(
        "{mode:?}: {} TCP frontends in {took:?}: {} failed ({}); UDP failures {udp_failed:?}; \
         \"too many frontends\" logged {} times",
        tcp.len(),
        tcp_failed.len(),
        ranges(&tcp_failed),
        too_many.len()
    );
    assert!(
        tcp_failed.is_empty() && udp_failed.is_empty() && too_many.is_empty(),
        "{mode:?}: one backend behind {} TCP and {} UDP frontends: TCP through {} of {} \
         frontends failed (frontends {}, numbered by VIP then port from 1), e.g. {tcp_details:#?}; \
         UDP failed through {udp_failed:#?}; the agent logged \"too many frontends\" {} times: \
         {:?}",
        tcp.len(),
        services - udp_from,
        tcp_failed.len(),
        tcp.len(),
        ranges(&tcp_failed),
        too_many.len(),
        too_many.last(),
    );
    // Every answer came from the one backend through its VIP (checked per probe);
    // the backend served them all.
    let served = topo.backend_counts()[0].tcp_connections;
    assert!(served >= tcp.len() as u64, "backend-1 served {served}");
}

/// 1-based frontend numbers of the 0-based `indexes` (sorted), as ranges: "9-20, 23".
fn ranges(indexes: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < indexes.len() {
        let start = indexes[i];
        let mut end = start;
        while i + 1 < indexes.len() && indexes[i + 1] == end + 1 {
            i += 1;
            end = indexes[i];
        }
        out.push(if start == end {
            format!("{}", start + 1)
        } else {
            format!("{}-{}", start + 1, end + 1)
        });
        i += 1;
    }
    if out.is_empty() {
        "none".to_owned()
    } else {
        out.join(", ")
    }
}
