//! The scenario's network and servers: the namespaces and their wiring, nginx in
//! the backend namespaces, the client's source address and readiness probes.

use super::{BACKENDS, GATEWAY, PROBE_SRC, src_addr};
use crate::bench::modes::Mode;
use anyhow::{Context as _, Result, anyhow, ensure};
use rune_harness::{
    agent::die_with_parent,
    netns::{NetNs, enter},
    topology::{CLIENT_IF, Topology, TopologyConfig},
};
use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    path::Path,
    process::{Child, Command},
    thread::sleep,
    time::{Duration, Instant},
};

/// The scenario's network (`rune_harness::topology`): client, node and a backend
/// namespace per entry of [`BACKENDS`] (backend i at 198.18.(10+i).2), no test
/// servers (nginx serves), TX checksum offload left on (the XDP mode turns it off on
/// the client's veth for its runs); the client also gets the probe and per-run
/// source addresses. Deleted on drop, also when wiring fails.
pub(super) fn topology() -> Result<Topology> {
    let net = Topology::with_config(&TopologyConfig {
        backends: BACKENDS.len(),
        tcp_port: None,
        udp_port: None,
        client_tx_checksum_off: false,
        ..TopologyConfig::default()
    })?;
    ensure!(
        net.client_addr().v4 == PROBE_SRC
            && net.node_client_addr().v4.to_string() == GATEWAY
            && net.backends().iter().map(|b| b.addr().v4).eq(BACKENDS),
        "the bench's addresses differ from the topology's"
    );
    for m in 0..Mode::ALL.len() {
        for via_vip in [false, true] {
            let addr = format!("{}/24", src_addr(m, via_vip));
            net.client().ip(&["addr", "add", &addr, "dev", CLIENT_IF])?;
        }
    }
    Ok(net)
}

/// `program` as a command run inside namespace `ns` (and killed with the xtask).
pub(super) fn in_netns(ns: &NetNs, program: &str) -> Result<Command> {
    let mut cmd = ns.command(program)?;
    die_with_parent(&mut cmd);
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
pub(super) fn nginx(ns: &NetNs, dir: &Path) -> Result<Reaped> {
    let mut cmd = in_netns(ns, "nginx")?;
    rune_harness::nginx::configure(
        &mut cmd,
        dir,
        "keepalive_timeout 0;\nserver { listen 80; return 200 \"ok\"; }",
    )?;
    let child = cmd
        .spawn()
        .context("starting nginx (cargo xtask setup installs nginx-light)")?;
    Ok(Reaped(child))
}

/// Makes `src` the client's source address for new connections (its default route's
/// `src`), since wrk cannot bind one.
pub(super) fn route_src(client: &NetNs, src: Ipv4Addr) -> Result<()> {
    let src = src.to_string();
    client.ip(&["route", "replace", "default", "via", GATEWAY, "src", &src])?;
    Ok(())
}

/// Waits (up to 20 s) until every target answers `200 ok` on port 80 from the
/// client's probe address: nginx listening, the agent's maps, rules or proxies in place.
pub(super) fn wait_answering(client: &NetNs, targets: &[Ipv4Addr]) -> Result<()> {
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
