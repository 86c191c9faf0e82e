//! The memory row of `bench ingress`: what 1,000 exposed routes add to the agent.
//!
//! Two dev-mode agents with the ingress on get the same 1,000 services (a port
//! each, one endpoint); only the second's services carry `expose` routes. The
//! difference of their resident sets is what the routes cost (route table,
//! certificate map, per-host metrics), not the services' own cost in the other
//! subsystems.

use super::servers::wait_answering;
use crate::bench::common::{apply, free_port, free_port_block, wait_connect, wait_ready};
use anyhow::Result;
use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    time::Duration,
};

/// Services (and, in the second agent, routes).
pub(super) const ROUTES: usize = 1000;

/// Resident sets of the two agents, KiB.
pub(super) struct Memory {
    pub(super) without_routes_kib: u64,
    pub(super) with_routes_kib: u64,
}

/// Starts both agents in turn and reads their resident sets once every service
/// (and route) answers.
pub(super) fn measure(rt: &tokio::runtime::Runtime, bin: &Path, backend: u16) -> Result<Memory> {
    Ok(Memory {
        without_routes_kib: resident(rt, bin, backend, false)?,
        with_routes_kib: resident(rt, bin, backend, true)?,
    })
}

fn resident(rt: &tokio::runtime::Runtime, bin: &Path, backend: u16, routes: bool) -> Result<u64> {
    let state = tempfile::Builder::new()
        .prefix("rune-bench-ingress-mem-")
        .tempdir()?;
    let (http, https) = (rt.block_on(free_port())?, rt.block_on(free_port())?);
    let agent = super::ingress_agent(bin, state.path(), http, https, &["--dev-port-offset", "0"])?;
    rt.block_on(wait_ready(&agent))?;
    let base = rt.block_on(free_port_block(ROUTES))?;
    let mut yaml = String::new();
    for i in 0..ROUTES {
        let expose = if routes {
            format!(", expose: {{host: {}}}", host(i))
        } else {
            String::new()
        };
        writeln!(
            yaml,
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: r{i}}}\n\
             spec: {{ports: [{{port: {}, targetPort: {backend}}}]{expose}}}\n---\n\
             apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: r{i}}}\n\
             spec: {{endpoints: [{{address: 127.0.0.2}}]}}\n---",
            base + i as u16
        )?;
    }
    apply(bin, &agent, &yaml)?;
    let last = SocketAddr::from((Ipv4Addr::LOCALHOST, base + ROUTES as u16 - 1));
    rt.block_on(wait_connect(last))?;
    if routes {
        wait_answering(&format!("http://127.0.0.1:{http}/"), &host(ROUTES - 1))?;
    }
    std::thread::sleep(Duration::from_secs(1));
    agent.status_kib("VmRSS")
}

fn host(i: usize) -> String {
    format!("r{i}.mem.test")
}
