//! The ingress proxy against Debian's nginx and haproxy as reverse proxies to the
//! same backend, on loopback: requests/s and p99 latency with kept-alive
//! connections, a new connection per request, and TLS with kept-alive connections
//! (`wrk --latency`), then the memory 1,000 routes add. Runs alternate (nginx,
//! haproxy, ingress, nginx, …) and medians are compared as ratios measured in the
//! same run (docs/performance.md).
//!
//! Every load loop is bounded in time (`wrk -d`, and a kill after a deadline); all
//! traffic stays on 127.0.0.0/8.

mod memory;
mod servers;
mod wrk;

use super::common::{apply, free_port, median, wait_ready};
use anyhow::{Result, bail};
use rune_harness::agent::Agent;
use servers::{
    ProxyPorts, haproxy, negotiated_suite, nginx, nginx_proxy, self_signed, wait_answering,
};
use std::{fmt::Write as _, path::Path};
use wrk::{Run, Scenario, wrk};

/// Interleaved rounds per scenario (one run of each proxy each).
const ROUNDS: usize = 5;
/// The host of the plain route (wrk sends it as `Host`).
const HOST: &str = "bench.test";
/// The host of the TLS route (a route with TLS redirects plain HTTP, and a route
/// without it answers TLS requests with 421, hence two).
const TLS_HOST: &str = "secure.test";
/// The TLS 1.3 cipher suite every proxy must negotiate with the clients.
const SUITE: &str = "TLS_AES_128_GCM_SHA256";
/// The memory 1,000 routes may add (issue 18).
const MEMORY_TARGET_MIB: f64 = 30.0;

/// Worker threads of every proxy: nginx's `worker_processes`, haproxy's
/// `nbthread` and the ingress's `--ingress-workers`. One: nginx runs as a single
/// process (no master, which a kill on drop would leave its workers behind).
const WORKERS: usize = 1;

/// The ingress's TLS handshake threads (`--ingress-handshake-threads`), beside its
/// worker: handshakes that nginx and haproxy do on their one thread.
const HANDSHAKE_THREADS: usize = 1;

/// The proxies compared, in the order of their columns.
const PROXIES: [&str; 3] = ["nginx", "haproxy", "ingress"];

pub fn run_alone() -> Result<()> {
    let bin = crate::util::bench_agent()?;
    println!("{}", section(&bin)?);
    Ok(())
}

/// The dev-mode agent with the ingress on 127.0.0.1:`http` and `https`, `extra`
/// flags after; killed on drop.
fn ingress_agent(bin: &Path, state: &Path, http: u16, https: u16, extra: &[&str]) -> Result<Agent> {
    // wrk's address SNI makes rustls warn per handshake: keep those lines out.
    Agent::command(bin, state)
        .args(["--dev"])
        .env("RUST_LOG", "warn,rustls=error")
        .args([
            "--ingress",
            "--ingress-addr",
            &format!("127.0.0.1:{http}"),
            "--ingress-tls-addr",
            &format!("127.0.0.1:{https}"),
            "--ingress-default-cert",
            "bench-cert",
            "--ingress-workers",
            &WORKERS.to_string(),
            "--ingress-handshake-threads",
            &HANDSHAKE_THREADS.to_string(),
        ])
        .args(extra)
        .spawn()
}

/// The section: each proxy, each scenario, as a Markdown table, and the memory row.
pub fn section(bin: &Path) -> Result<String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let work = tempfile::Builder::new()
        .prefix("rune-bench-ingress-")
        .tempdir()?;
    let dir = work.path();
    let port = || rt.block_on(free_port());
    let backend = port()?;
    let proxy_ports = || -> Result<ProxyPorts> {
        Ok(ProxyPorts {
            http: port()?,
            https: port()?,
            backend,
        })
    };
    let (nginx_ports, haproxy_ports, ingress_ports) =
        (proxy_ports()?, proxy_ports()?, proxy_ports()?);
    let service_ports = (port()?, port()?);
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    self_signed(&cert, &key, HOST)?;
    let _backend = nginx(
        &dir.join("backend"),
        &format!(
            "server {{ listen 127.0.0.2:{backend}; keepalive_requests 100000; return 200 \"ok\"; }}"
        ),
    )?;
    let _nginx = nginx_proxy(&dir.join("proxy"), &nginx_ports, &cert, &key)?;
    let _haproxy = haproxy(&dir.join("haproxy"), &haproxy_ports, &cert, &key)?;
    let state = tempfile::Builder::new().prefix("rune-bench-").tempdir()?;
    let agent = ingress_agent(
        bin,
        state.path(),
        ingress_ports.http,
        ingress_ports.https,
        &[],
    )?;
    rt.block_on(wait_ready(&agent))?;
    apply(bin, &agent, &objects(service_ports, backend, &cert, &key)?)?;
    let urls = |p: &ProxyPorts| {
        (
            format!("http://127.0.0.1:{}/", p.http),
            format!("https://127.0.0.1:{}/", p.https),
        )
    };
    let urls = [
        urls(&nginx_ports),
        urls(&haproxy_ports),
        urls(&ingress_ports),
    ];
    for (plain, tls) in &urls {
        wait_answering(plain, HOST)?;
        wait_answering(tls, TLS_HOST)?;
    }
    for ports in [&nginx_ports, &haproxy_ports, &ingress_ports] {
        let suite = negotiated_suite(ports.https)?;
        if suite != SUITE {
            bail!("127.0.0.1:{} negotiated {suite}, not {SUITE}", ports.https);
        }
    }

    let mut rows = Vec::new();
    for scenario in Scenario::ALL {
        let (url, host): (Vec<&String>, &str) = if scenario.tls() {
            (urls.iter().map(|u| &u.1).collect(), TLS_HOST)
        } else {
            (urls.iter().map(|u| &u.0).collect(), HOST)
        };
        // Warm-up, not counted.
        for u in &url {
            wrk(scenario, u, host)?;
        }
        let mut runs: [Vec<Run>; 3] = Default::default();
        for _ in 0..ROUNDS {
            for (i, u) in url.iter().enumerate() {
                runs[i].push(wrk(scenario, u, host)?);
            }
        }
        let med = |runs: &[Run], f: fn(&Run) -> f64| {
            let mut v: Vec<f64> = runs.iter().map(f).collect();
            median(&mut v)
        };
        rows.push((
            scenario,
            runs.each_ref().map(|r| med(r, |r| r.rate)),
            runs.each_ref().map(|r| med(r, |r| r.p99_ms)),
        ));
    }
    drop(agent);
    let memory = memory::measure(&rt, bin, backend)?;

    let mut t = String::new();
    writeln!(
        t,
        "## Ingress proxy vs nginx and haproxy (reverse proxies, loopback)"
    )?;
    writeln!(t)?;
    writeln!(
        t,
        "One nginx backend (`return 200 \"ok\"`); nginx ({WORKERS} worker, upstream keepalive pool) and haproxy ({WORKERS} thread, `http-reuse always`) vs the agent's ingress (dev mode, `--ingress-workers {WORKERS} --ingress-handshake-threads {HANDSHAKE_THREADS}`: TLS handshakes on a thread of their own); {} with a `Host` of the route (new connection: plus `Connection: close`; TLS: SNI is the address, answered by each proxy's default certificate, every proxy checked to negotiate TLS 1.3 with {SUITE} by its own order; flood: a second wrk with {} connections making a new TLS connection per request to the same proxy during the run, its answers not counted). {ROUNDS} interleaved rounds, medians.",
        wrk::describe(),
        wrk::FLOOD_CONNECTIONS
    )?;
    writeln!(t)?;
    writeln!(
        t,
        "| scenario | {} req/s | {} req/s | {} req/s | vs nginx | vs haproxy | p99 {} / {} / {} | target |",
        PROXIES[0], PROXIES[1], PROXIES[2], PROXIES[0], PROXIES[1], PROXIES[2]
    )?;
    writeln!(t, "|---|---:|---:|---:|---:|---:|---:|---|")?;
    for (s, rate, p99) in rows {
        writeln!(
            t,
            "| {} | {:.0} | {:.0} | {:.0} | {:.2}x | {:.2}x | {:.2} / {:.2} / {:.2} ms | >= 1.0x, p99 <= theirs |",
            s.label(),
            rate[0],
            rate[1],
            rate[2],
            rate[2] / rate[0],
            rate[2] / rate[1],
            p99[0],
            p99[1],
            p99[2]
        )?;
    }
    let added = (memory.with_routes_kib as f64 - memory.without_routes_kib as f64) / 1024.0;
    writeln!(t)?;
    writeln!(
        t,
        "Memory: {} services with `expose` routes {:.1} MiB resident, the same services without routes {:.1} MiB: **{added:.1} MiB added by the routes** (target < {MEMORY_TARGET_MIB} MiB: {}).",
        memory::ROUTES,
        memory.with_routes_kib as f64 / 1024.0,
        memory.without_routes_kib as f64 / 1024.0,
        super::common::verdict(added < MEMORY_TARGET_MIB)
    )?;
    Ok(t)
}

/// The two Services (their port's target the backend), their Endpoints and the TLS
/// Secret.
fn objects(service_ports: (u16, u16), backend: u16, cert: &Path, key: &Path) -> Result<String> {
    let secret = serde_json::json!({
        "apiVersion": "rune/v1",
        "kind": "Secret",
        "metadata": {"name": "bench-cert"},
        "data": {
            "tls.crt": std::fs::read_to_string(cert)?,
            "tls.key": std::fs::read_to_string(key)?,
        },
    });
    // wrk sends the URL's address as SNI, which names no host: the default
    // certificate (the same Secret) answers it.
    let service = |name: &str, port: u16, expose: &str| {
        format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
             spec: {{ports: [{{port: {port}, targetPort: {backend}}}], expose: {{{expose}}}}}\n\
             ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\n\
             spec: {{endpoints: [{{address: 127.0.0.2}}]}}\n"
        )
    };
    Ok(format!(
        "{secret}\n---\n{}---\n{}",
        service("bench", service_ports.0, &format!("host: {HOST}")),
        service(
            "secure",
            service_ports.1,
            &format!("host: {TLS_HOST}, tls: {{secret: bench-cert}}")
        ),
    ))
}
