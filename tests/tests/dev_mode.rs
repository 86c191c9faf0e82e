//! The agent end to end in dev mode, as a user drives it: start `rune-agent run
//! --dev`, `apply` a service over the socket, connect through the proxies on
//! 127.0.0.1 to real backends on loopback, change and delete endpoints, read
//! `status` and `/metrics`. Needs no root.

use rune_harness::agent::{Agent, eventually, free_port, metric};
use std::{
    collections::HashMap,
    io::{BufRead, BufReader, Write},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

const OFFSET: u16 = 10000;
const PATIENCE: Duration = Duration::from_secs(20);

/// A backend: over TCP answers each line with its own address until the client
/// closes; over UDP (same port) echoes datagrams.
struct Backend {
    addr: IpAddr,
    accepted: Arc<AtomicUsize>,
}

fn start_backend(addr: IpAddr, port: u16) -> std::io::Result<Backend> {
    let listener = TcpListener::bind((addr, port))?;
    let udp = UdpSocket::bind((addr, port))?;
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while let Ok((n, from)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(&buf[..n], from);
        }
    });
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            counter.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut writer = stream;
                let mut line = String::new();
                while reader.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                    if writeln!(writer, "{addr}").is_err() {
                        break;
                    }
                    line.clear();
                }
            });
        }
    });
    Ok(Backend { addr, accepted })
}

/// Three backends on 127.0.0.2-4 sharing one port.
fn start_backends() -> (Vec<Backend>, u16) {
    for _ in 0..20 {
        let port = free_port();
        let addrs: Vec<IpAddr> = (2..=4)
            .map(|i| format!("127.0.0.{i}").parse().unwrap())
            .collect();
        let started: Result<Vec<_>, _> = addrs.iter().map(|a| start_backend(*a, port)).collect();
        if let Ok(b) = started {
            return (b, port);
        }
    }
    panic!("no common free port for three loopback backends");
}

/// One request over an open connection: the backend's address.
/// Requests sent with [`ask`]: each is `hello\n` (6 bytes) answered by
/// `127.0.0.N\n` (10 bytes).
static ASKED: AtomicUsize = AtomicUsize::new(0);

fn ask(conn: &mut (BufReader<TcpStream>, TcpStream)) -> String {
    ASKED.fetch_add(1, Ordering::SeqCst);
    writeln!(conn.1, "hello").unwrap();
    let mut line = String::new();
    conn.0.read_line(&mut line).unwrap();
    line.trim().to_owned()
}

fn connect(proxy: SocketAddr) -> (BufReader<TcpStream>, TcpStream) {
    let s = TcpStream::connect_timeout(&proxy, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    (BufReader::new(s.try_clone().unwrap()), s)
}

/// Opens `n` connections, one request each; returns answers per backend address.
fn spread(proxy: SocketAddr, n: usize) -> HashMap<String, usize> {
    let mut by = HashMap::new();
    for _ in 0..n {
        let mut c = connect(proxy);
        *by.entry(ask(&mut c)).or_insert(0) += 1;
    }
    by
}

fn manifest(service_port: u16, udp_port: u16, backend_port: u16, eps: &str) -> String {
    format!(
        r#"apiVersion: rune/v1
kind: Service
metadata: {{name: web}}
spec:
  ports:
    - {{name: http, port: {service_port}, protocol: TCP, targetPort: {backend_port}}}
    - {{name: echo, port: {udp_port}, protocol: UDP, targetPort: {backend_port}}}
  discovery: {{vips: [198.18.100.10]}}
---
apiVersion: rune/v1
kind: Endpoints
metadata: {{name: web}}
spec:
  endpoints:
{eps}
---
apiVersion: rune/v1
kind: Service
metadata: {{name: echo}}
spec:
  ports: [{{port: {udp_port}, protocol: UDP, targetPort: {backend_port}}}]
---
apiVersion: rune/v1
kind: Endpoints
metadata: {{name: echo}}
spec:
  endpoints: [{{address: 127.0.0.4}}]
"#
    )
}

fn endpoint_lines(entries: &[(&str, bool)]) -> String {
    entries
        .iter()
        .map(|(a, term)| {
            format!("    - {{address: {a}, node: dev, ready: true, terminating: {term}}}\n")
        })
        .collect()
}

#[test]
fn dev_mode_end_to_end() {
    let state = tempfile::tempdir().unwrap();
    let (backends, backend_port) = start_backends();
    // Service ports whose offset ports are free on 127.0.0.1.
    let http_port = free_port() - OFFSET;
    let udp_free = UdpSocket::bind("127.0.0.1:0").unwrap();
    let udp_port = udp_free.local_addr().unwrap().port() - OFFSET;
    drop(udp_free);
    // The echo service's UDP port equals web's second port: same 127.0.0.1 port, so
    // exactly one of the two binds fails and must be reported, the rest keeps working.
    let mut agent = Agent::start(
        state.path(),
        &["--dev", "--dev-port-offset", &OFFSET.to_string()],
    );
    agent.wait_ready(PATIENCE);

    let all = endpoint_lines(&[
        ("127.0.0.2", false),
        ("127.0.0.3", false),
        ("127.0.0.4", false),
    ]);
    let out = agent.cli(
        &["apply", "-f", "-"],
        Some(&manifest(http_port, udp_port, backend_port, &all)),
    );
    assert!(
        out.status.success(),
        "apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let applied = String::from_utf8_lossy(&out.stdout);
    assert!(applied.contains("service/default/web created"), "{applied}");

    let proxy: SocketAddr = format!("127.0.0.1:{}", http_port + OFFSET).parse().unwrap();
    eventually(PATIENCE, "proxy listening", || {
        TcpStream::connect(proxy).ok()
    });
    let mut made = 1; // the probe above

    // 300 connections, spread over the three backends.
    let by = spread(proxy, 300);
    made += 300;
    assert_eq!(by.values().sum::<usize>(), 300, "{by:?}");
    for b in &backends {
        let n = by.get(&b.addr.to_string()).copied().unwrap_or(0);
        assert!(
            (60..=141).contains(&n),
            "backend {} got {n} of 300: {by:?}",
            b.addr
        );
    }

    // Hold a connection to 127.0.0.2, then mark it terminating.
    let mut held = loop {
        let mut c = connect(proxy);
        made += 1;
        if ask(&mut c) == "127.0.0.2" {
            break c;
        }
    };
    let before = backends[0].accepted.load(Ordering::SeqCst);
    let draining = endpoint_lines(&[
        ("127.0.0.2", true),
        ("127.0.0.3", false),
        ("127.0.0.4", false),
    ]);
    let out = agent.cli(
        &["apply", "-f", "-"],
        Some(&manifest(http_port, udp_port, backend_port, &draining)),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eventually(PATIENCE, "status shows 127.0.0.2 terminating", || {
        let s = String::from_utf8_lossy(&agent.cli(&["status"], None).stdout).into_owned();
        s.contains(&format!("backend 127.0.0.2:{backend_port}  terminating"))
            .then_some(())
    });
    // Status is read from the cache; give the proxy its own proof: no new connection
    // reaches the terminating backend.
    let by = spread(proxy, 100);
    made += 100;
    assert_eq!(
        by.get("127.0.0.2"),
        None,
        "terminating backend got new connections: {by:?}"
    );
    assert_eq!(backends[0].accepted.load(Ordering::SeqCst), before);
    assert_eq!(
        ask(&mut held),
        "127.0.0.2",
        "the open connection keeps working"
    );

    // Delete it: traffic continues on the others, the held connection still finishes.
    let rest = endpoint_lines(&[("127.0.0.3", false), ("127.0.0.4", false)]);
    let out = agent.cli(
        &["apply", "-f", "-"],
        Some(&manifest(http_port, udp_port, backend_port, &rest)),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eventually(PATIENCE, "status drops 127.0.0.2", || {
        let s = String::from_utf8_lossy(&agent.cli(&["status"], None).stdout).into_owned();
        (!s.contains("127.0.0.2")).then_some(())
    });
    let by = spread(proxy, 100);
    made += 100;
    assert_eq!(by.values().sum::<usize>(), 100);
    assert_eq!(by.get("127.0.0.2"), None, "{by:?}");
    assert_eq!(ask(&mut held), "127.0.0.2");
    drop(held);

    // UDP echo through web's UDP port.
    let client = UdpSocket::bind("127.0.0.1:0").unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let udp_proxy: SocketAddr = format!("127.0.0.1:{}", udp_port + OFFSET).parse().unwrap();
    let mut echoed = 0;
    for i in 0..20 {
        let msg = format!("ping {i}");
        client.send_to(msg.as_bytes(), udp_proxy).unwrap();
        let mut buf = [0u8; 64];
        if let Ok((n, from)) = client.recv_from(&mut buf) {
            assert_eq!(from, udp_proxy, "replies come from the service address");
            assert_eq!(&buf[..n], msg.as_bytes());
            echoed += 1;
        }
    }
    assert!(echoed >= 19, "UDP echo: {echoed} of 20 round trips");

    // Status: the service, its backends, its ports; the clashing port is reported.
    let out = agent.cli(&["status"], None);
    let status = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(status.contains("mode:       dev"), "{status}");
    assert!(status.contains("default/web"), "{status}");
    assert!(
        status.contains(&format!("backend 127.0.0.3:{backend_port}  accepting")),
        "{status}"
    );
    assert!(
        status.contains(&format!("backend 127.0.0.4:{backend_port}  accepting")),
        "{status}"
    );
    assert!(status.contains("listening"), "{status}");
    assert!(
        status.contains("failed"),
        "the clashing UDP port is reported: {status}"
    );

    // Metrics count exactly what we sent.
    let text = agent.metrics_text();
    let tcp_ok = metric(
        &text,
        r#"rune_proxy_connections_total{service="default/web",protocol="TCP",result="ok"}"#,
    );
    assert_eq!(tcp_ok, Some(made as f64), "{text}");
    let asked = ASKED.load(Ordering::SeqCst) as f64;
    let bytes = |dir: &str| {
        metric(
            &text,
            &format!(
                r#"rune_proxy_bytes_total{{service="default/web",protocol="TCP",direction="{dir}"}}"#
            ),
        )
    };
    assert_eq!(bytes("to_backend"), Some(asked * 6.0), "{text}");
    assert_eq!(bytes("to_client"), Some(asked * 10.0), "{text}");
    // Whichever of web and echo won the shared UDP port carried the one flow.
    let udp_flows: f64 = ["default/web", "default/echo"]
        .iter()
        .filter_map(|svc| {
            metric(
                &text,
                &format!(
                    r#"rune_proxy_connections_total{{service="{svc}",protocol="UDP",result="ok"}}"#
                ),
            )
        })
        .sum();
    assert_eq!(udp_flows, 1.0, "one UDP flow: {text}");
    let up = text
        .lines()
        .filter(|l| l.starts_with("rune_proxy_listener_up{") && l.ends_with(" 0"))
        .count();
    assert_eq!(up, 1, "exactly one listener failed to bind: {text}");
    assert_eq!(
        metric(&text, r#"rune_objects{kind="Service"}"#),
        Some(2.0),
        "{text}"
    );

    assert_eq!(agent.terminate(PATIENCE), Some(0), "clean exit on SIGTERM");
}

/// A backend process of [`dev_mode_three_backends_on_one_address`]
/// (`rune-test-server`), killed on drop.
struct ServerProcess(std::process::Child);

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `rune-test-server` on 127.0.0.1:`port`; `None` when it cannot bind.
fn start_server_process(port: u16) -> Option<ServerProcess> {
    use std::process::{Command, Stdio};
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rune-test-server"));
    cmd.arg(format!("127.0.0.1:{port}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    rune_harness::agent::die_with_parent(&mut cmd);
    let mut child = ServerProcess(cmd.spawn().unwrap());
    let stdout = child.0.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    line.starts_with("listening ").then_some(child)
}

/// The first use on a laptop: three processes of one backend on 127.0.0.1, ports
/// P1–P3, balanced through the dev proxy. One endpoint takes the target port, two
/// override it; a true duplicate is refused naming the address and port; one of
/// the three terminating stops getting new connections while its neighbours on the
/// same address go on.
#[test]
fn dev_mode_three_backends_on_one_address() {
    let state = tempfile::tempdir().unwrap();
    let mut servers = Vec::new();
    let mut ports = Vec::new();
    while ports.len() < 3 {
        let port = free_port();
        if let Some(server) = start_server_process(port) {
            servers.push(server);
            ports.push(port);
        }
    }
    let http_port = free_port() - OFFSET;
    let mut agent = Agent::start(
        state.path(),
        &["--dev", "--dev-port-offset", &OFFSET.to_string()],
    );
    agent.wait_ready(PATIENCE);
    let manifest = |endpoints: &str| {
        format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: web}}\n\
             spec: {{ports: [{{name: http, port: {http_port}, targetPort: {}}}]}}\n---\n\
             apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: web}}\n\
             spec:\n  endpoints:\n{endpoints}",
            ports[0]
        )
    };
    let endpoint = |port: u16, terminating: bool| {
        if port == ports[0] {
            format!("    - {{address: 127.0.0.1, terminating: {terminating}}}\n")
        } else {
            format!(
                "    - {{address: 127.0.0.1, ports: {{http: {port}}}, terminating: {terminating}}}\n"
            )
        }
    };
    let apply = |endpoints: &str| agent.cli(&["apply", "-f", "-"], Some(&manifest(endpoints)));

    // The same address and port twice: refused, naming where and what.
    let twice = format!("{}{}", endpoint(ports[1], false), endpoint(ports[1], false));
    let out = apply(&twice);
    assert!(!out.status.success(), "a true duplicate must be refused");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "Endpoints default/web: spec.endpoints[1]: duplicate endpoint 127.0.0.1:{} (http)",
            ports[1]
        )),
        "{err}"
    );

    let all: String = ports.iter().map(|p| endpoint(*p, false)).collect();
    let out = apply(&all);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let proxy: SocketAddr = format!("127.0.0.1:{}", http_port + OFFSET).parse().unwrap();
    eventually(PATIENCE, "proxy listening", || {
        TcpStream::connect(proxy).ok()
    });
    let by = spread(proxy, 300);
    assert_eq!(by.values().sum::<usize>(), 300, "{by:?}");
    for port in &ports {
        let n = by.get(&format!("127.0.0.1:{port}")).copied().unwrap_or(0);
        assert!(
            (60..=141).contains(&n),
            "127.0.0.1:{port} got {n} of 300: {by:?}"
        );
    }
    // `status` lists the three backends.
    let out = agent.cli(&["status", "-o", "json"], None);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let web = status["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["service"] == "default/web")
        .unwrap();
    assert_eq!(web["backends"].as_array().map(Vec::len), Some(3), "{web}");

    // The second process terminates: no new connections; the other two on the
    // same address keep getting them, and its open connection keeps working.
    let leaving = format!("127.0.0.1:{}", ports[1]);
    let mut held = loop {
        let mut c = connect(proxy);
        if ask(&mut c) == leaving {
            break c;
        }
    };
    let draining: String = ports.iter().map(|p| endpoint(*p, *p == ports[1])).collect();
    let out = apply(&draining);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eventually(
        PATIENCE,
        "the terminating backend gets no new connections",
        || (!spread(proxy, 30).contains_key(&leaving)).then_some(()),
    );
    let by = spread(proxy, 100);
    assert_eq!(
        by.len(),
        2,
        "the other two keep getting connections: {by:?}"
    );
    assert!(!by.contains_key(&leaving), "{by:?}");
    assert_eq!(ask(&mut held), leaving, "the open connection keeps working");

    assert_eq!(agent.terminate(PATIENCE), Some(0), "clean exit on SIGTERM");
    drop(servers);
}
