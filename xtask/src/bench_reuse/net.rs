//! The scenario's network and servers: the namespaces and their wiring, nginx in
//! the backend namespaces, the client's source address and readiness probes.

use super::{BACKENDS, GATEWAY, PROBE_SRC, src_addr};
use crate::bench_e2e::{Mode, client_name, enter, ip};
use crate::bench_sync::Netns;
use anyhow::{Context as _, Result, anyhow, ensure};
use std::{
    fs::File,
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    path::Path,
    process::{Child, Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

/// The bench's namespaces, wired: client and the backends, each linked to the node.
pub(super) struct Topology {
    /// Where wrk, nstat and the probes run.
    pub(super) client: Netns,
    /// Where the agent runs and forwards.
    pub(super) node: Netns,
    /// One per nginx backend, in the order of [`BACKENDS`].
    pub(super) backends: Vec<Netns>,
}

impl Topology {
    /// Creates and wires the namespaces (deleted again on drop, also when wiring
    /// fails): veths, addresses (the client's probe and per-run source addresses),
    /// routes, forwarding in the node.
    pub(super) fn create(pid: u32) -> Result<Self> {
        let net = Self {
            client: Netns::create(&format!("rune-bench-reuse-c-{pid}"))?,
            node: Netns::create(&format!("rune-bench-reuse-n-{pid}"))?,
            backends: (1..=BACKENDS.len())
                .map(|i| Netns::create(&format!("rune-bench-reuse-b{i}-{pid}")))
                .collect::<Result<_>>()?,
        };
        let (c, n) = (&client_name(&net.client), &client_name(&net.node));
        // The node's client-facing veth is `n-client`, where `Mode::flags` hooks eBPF.
        ip(&[
            "link", "add", "c-node", "netns", c, "type", "veth", "peer", "n-client", "netns", n,
        ])?;
        ip(&[
            "-n",
            c,
            "addr",
            "add",
            &format!("{PROBE_SRC}/24"),
            "dev",
            "c-node",
        ])?;
        for m in 0..Mode::ALL.len() {
            for via_vip in [false, true] {
                let addr = format!("{}/24", src_addr(m, via_vip));
                ip(&["-n", c, "addr", "add", &addr, "dev", "c-node"])?;
            }
        }
        ip(&[
            "-n",
            n,
            "addr",
            "add",
            &format!("{GATEWAY}/24"),
            "dev",
            "n-client",
        ])?;
        ip(&["-n", c, "link", "set", "c-node", "up"])?;
        ip(&["-n", n, "link", "set", "n-client", "up"])?;
        ip(&["-n", c, "route", "add", "default", "via", GATEWAY])?;
        for (i, (ns, addr)) in net.backends.iter().zip(BACKENDS).enumerate() {
            let b = &client_name(ns);
            let peer = format!("n-back{}", i + 1);
            let [x, y, z, _] = addr.octets();
            let gateway = Ipv4Addr::new(x, y, z, 1).to_string();
            ip(&[
                "link", "add", "b-node", "netns", b, "type", "veth", "peer", &peer, "netns", n,
            ])?;
            ip(&[
                "-n",
                b,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "b-node",
            ])?;
            ip(&[
                "-n",
                n,
                "addr",
                "add",
                &format!("{gateway}/24"),
                "dev",
                &peer,
            ])?;
            ip(&["-n", b, "link", "set", "b-node", "up"])?;
            ip(&["-n", n, "link", "set", &peer, "up"])?;
            ip(&["-n", b, "route", "add", "default", "via", &gateway])?;
        }
        sysctl(&net.node, "net.ipv4.ip_forward", "1")?;
        Ok(net)
    }
}

/// Sets a sysctl of namespace `ns` (`ip netns exec NS sysctl`), never the host's.
pub(super) fn sysctl(ns: &Netns, key: &str, value: &str) -> Result<()> {
    crate::util::run_status(
        "set a sysctl in a bench namespace",
        Command::new("ip").args([
            "netns",
            "exec",
            &client_name(ns),
            "sysctl",
            "-qw",
            &format!("{key}={value}"),
        ]),
    )
}

/// `program` as a command run inside namespace `ns` (and killed with the xtask).
pub(super) fn in_netns(ns: &Netns, program: &str) -> Result<Command> {
    let file = File::open(ns.path()).with_context(|| format!("opening {}", ns.path().display()))?;
    let mut cmd = Command::new(program);
    crate::util::enter_netns_on_exec(&mut cmd, file);
    Ok(cmd)
}

/// A child process of the bench (nginx, wrk), killed and reaped on drop.
pub(super) struct Reaped(pub(super) Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts nginx in backend namespace `ns`, in the foreground as one process, with its
/// config, temp paths, pid file and error log under `dir`: `200 ok` for every
/// request, no access log, no keep-alive (nginx closes each connection first).
pub(super) fn nginx(ns: &Netns, dir: &Path) -> Result<Reaped> {
    std::fs::create_dir_all(dir)?;
    let d = dir.display();
    let config = format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\nevents {{ worker_connections 4096; }}\nhttp {{\n  access_log off;\n  keepalive_timeout 0;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n  server {{\n    listen 80;\n    return 200 \"ok\";\n  }}\n}}\n"
    );
    let conf = dir.join("nginx.conf");
    std::fs::write(&conf, config)?;
    let stderr = File::create(dir.join("stderr.log"))?;
    let mut cmd = in_netns(ns, "nginx")?;
    // `-e`: the startup log before the config is read, not the packaged default.
    cmd.arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(&conf)
        .arg("-e")
        .arg(dir.join("error.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
    let child = cmd
        .spawn()
        .context("starting nginx (cargo xtask setup installs nginx-light)")?;
    Ok(Reaped(child))
}

/// Makes `src` the client's source address for new connections (its default route's
/// `src`), since wrk cannot bind one.
pub(super) fn route_src(client: &Netns, src: Ipv4Addr) -> Result<()> {
    let src = src.to_string();
    let c = client_name(client);
    ip(&[
        "-n", &c, "route", "replace", "default", "via", GATEWAY, "src", &src,
    ])
}

/// Waits (up to 20 s) until every target answers `200 ok` on port 80 from the
/// client's probe address: nginx listening, the agent's maps, rules or proxies in place.
pub(super) fn wait_answering(client: &Netns, targets: &[Ipv4Addr]) -> Result<()> {
    route_src(client, PROBE_SRC)?;
    let (path, targets) = (client.path(), targets.to_vec());
    std::thread::spawn(move || -> Result<()> {
        enter(&path)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        for target in targets {
            while let Err(e) = http_get(target) {
                if Instant::now() > deadline {
                    return Err(e.context(format!("{target}:80 does not answer")));
                }
                sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    })
    .join()
    .map_err(|_| anyhow!("the probe thread panicked"))?
}

/// One HTTP/1.0 request to `target`:80 from the calling thread's namespace; fails
/// unless the answer is `200 ok` within a second or two.
fn http_get(target: Ipv4Addr) -> Result<()> {
    let addr = SocketAddr::from((target, 80));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(1)))?;
    s.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    ensure!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("\r\n\r\nok"),
        "unexpected answer {answer:?}"
    );
    Ok(())
}
