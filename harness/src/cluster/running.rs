//! A running cluster: one etcd on the host's loopback (TLS and client-certificate
//! authentication, certificates made by `rune-agent certs`, etcd's roles set by
//! `rune-agent certs etcd-rbac`), the [`Cluster`] topology, and one `rune-agent
//! run` per node inside its namespace, each with its own state dir, pin directory
//! and cgroup, its node certificate and its identity (`node-<i>`). What the
//! multi-node tests, `cargo xtask run --cluster N` and `cargo xtask bench cluster`
//! start.
//!
//! Dropping it kills the agents, then removes pins, cgroups, namespaces, etcd and
//! the work directory (also on panic).

use std::{
    fs,
    os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
    process::{Command, Output},
    time::Duration,
};

use anyhow::{Context as _, bail};

use super::{Cluster, NODE_POD_IF};
use crate::{
    agent::{Agent, run_cli},
    bpffs::PinDir,
    cgroup::TestCgroup,
    etcd::{Etcd, Pki},
};

/// How to start a [`RunningCluster`].
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Nodes (1 to [`super::MAX_NODES`]).
    pub nodes: usize,
    /// The `rune-agent` binary.
    pub bin: PathBuf,
    /// `--dataplane` of every agent (`ebpf`, `nftables`, `userspace`, `auto`).
    pub dataplane: String,
    /// More `run` flags for every agent.
    pub extra_args: Vec<String>,
    /// Agents' logs go to `<work>/node-<i>.log` instead of being kept in memory.
    pub log_files: bool,
    /// Seconds of the node leases (the agents' `--node-lease-seconds`; `None`:
    /// their default).
    pub lease_seconds: Option<u64>,
    /// Start every agent in [`RunningCluster::start`] (default); `false` leaves
    /// them to [`RunningCluster::start_agent`].
    pub start_agents: bool,
}

impl ClusterConfig {
    /// `nodes` agents of `bin` on the eBPF data plane.
    pub fn new(nodes: usize, bin: impl Into<PathBuf>) -> ClusterConfig {
        ClusterConfig {
            nodes,
            bin: bin.into(),
            dataplane: "ebpf".to_owned(),
            extra_args: Vec::new(),
            log_files: false,
            lease_seconds: None,
            start_agents: true,
        }
    }
}

/// One node's agent and what it owns on the host.
struct NodeAgent {
    agent: Option<Agent>,
    state_dir: PathBuf,
    pins: PinDir,
    cgroup: TestCgroup,
    node_id: String,
}

/// etcd, the topology and an agent per node (see the module's doc).
pub struct RunningCluster {
    // Field order is drop order: agents stop before their pins, cgroups and
    // namespaces go, and etcd after them.
    agents: Vec<NodeAgent>,
    cluster: Cluster,
    etcd: Etcd,
    pki: Pki,
    config: ClusterConfig,
    work: WorkDir,
}

/// The cluster's work directory (certificates, state dirs, logs); removed on drop.
struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

impl RunningCluster {
    /// Starts etcd, makes the certificates and roles, builds the topology and
    /// starts every agent; waits (up to `patience` per agent) until each is ready.
    pub fn start(config: ClusterConfig, patience: Duration) -> anyhow::Result<RunningCluster> {
        let work = WorkDir(crate::etcd::unique_dir("cluster"));
        let certs = work.0.join("certs");
        let node_ids: Vec<String> = (1..=config.nodes).map(node_id).collect();
        certs_cmd(
            &config.bin,
            &["certs", "init", path_str(&certs)?, "--san", "127.0.0.1"],
        )?;
        for id in &node_ids {
            certs_cmd(&config.bin, &["certs", "issue", id, path_str(&certs)?])?;
        }
        let pki = Pki::from_files(
            certs.join("ca.pem"),
            certs.join("server.pem"),
            certs.join("server-key.pem"),
            certs.join("admin.pem"),
            certs.join("admin-key.pem"),
        );
        let etcd = Etcd::builder().tls(&pki).client_cert_auth().start();
        let cluster = Cluster::new(config.nodes, Some(etcd.addr()))?;
        let mut running = RunningCluster {
            agents: Vec::new(),
            cluster,
            etcd,
            pki,
            config,
            work,
        };
        let mut rbac = vec!["certs".to_owned(), "etcd-rbac".to_owned()];
        rbac.extend(running.admin_etcd_args());
        for id in &node_ids {
            rbac.extend(["--node".to_owned(), id.clone()]);
        }
        let rbac: Vec<&str> = rbac.iter().map(String::as_str).collect();
        certs_cmd(&running.config.bin, &rbac)?;
        for (i, id) in node_ids.into_iter().enumerate() {
            let state_dir = running.work.0.join(format!("node-{}", i + 1));
            write_identity(&state_dir, &id, &format!("node-{}", i + 1))?;
            running.agents.push(NodeAgent {
                agent: None,
                state_dir,
                pins: PinDir::new(&format!("cl{}", i + 1)),
                cgroup: TestCgroup::new(&format!("cl{}", i + 1))?,
                node_id: id,
            });
        }
        if running.config.start_agents {
            for i in 0..running.agents.len() {
                running.start_agent(i)?;
            }
            for i in 0..running.agents.len() {
                running.agent(i).try_wait_ready(patience)?;
            }
            running.wait_nodes_ready(running.agents.len(), patience)?;
        }
        Ok(running)
    }

    /// Waits until `get nodes` lists `count` nodes whose state is Ready (their
    /// documents say so: `apply --wait` counts them), at most `patience`.
    pub fn wait_nodes_ready(&self, count: usize, patience: Duration) -> anyhow::Result<()> {
        let deadline = std::time::Instant::now() + patience;
        loop {
            let out = self.cli(&["get", "nodes"], None);
            let table = String::from_utf8_lossy(&out.stdout).into_owned();
            let ready = table
                .lines()
                .skip(1)
                .filter(|l| {
                    l.split_whitespace()
                        .nth(1)
                        .is_some_and(|s| s.starts_with("Ready"))
                })
                .count();
            if out.status.success() && ready >= count {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                bail!("{ready} of {count} nodes Ready within {patience:?}:\n{table}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The topology.
    pub fn topology(&self) -> &Cluster {
        &self.cluster
    }

    /// etcd (to stop, start or compact it).
    pub fn etcd(&mut self) -> &mut Etcd {
        &mut self.etcd
    }

    /// The node id of node `i` (0-based), also its certificate's CN.
    pub fn node_id(&self, i: usize) -> &str {
        &self.agents[i].node_id
    }

    /// Node `i`'s running agent (0-based). Panics when it was killed.
    pub fn agent(&self, i: usize) -> &Agent {
        self.agents[i].agent.as_ref().expect("the agent runs")
    }

    /// Node `i`'s state dir.
    pub fn state_dir(&self, i: usize) -> &Path {
        &self.agents[i].state_dir
    }

    /// The certificates' directory (CA, server, admin and node certificates).
    pub fn certs_dir(&self) -> PathBuf {
        self.work.0.join("certs")
    }

    /// The `--etcd-*` flags of the admin (host side: etcd's own loopback port).
    pub fn admin_etcd_args(&self) -> Vec<String> {
        vec![
            "--etcd-endpoints".to_owned(),
            format!("https://{}", self.etcd.addr()),
            "--etcd-ca".to_owned(),
            self.pki.ca.display().to_string(),
            "--etcd-cert".to_owned(),
            self.pki.client_cert.display().to_string(),
            "--etcd-key".to_owned(),
            self.pki.client_key.display().to_string(),
        ]
    }

    /// Runs `rune-agent ARGS` as the admin on the host, the admin's `--etcd-*`
    /// flags appended.
    pub fn cli(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let mut all: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        all.extend(self.admin_etcd_args());
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        run_cli(
            &self.config.bin,
            None,
            &self.work.0.join("admin-state"),
            &all,
            stdin,
        )
    }

    /// The `run` flags of node `i`'s agent.
    pub fn agent_args(&self, i: usize) -> anyhow::Result<Vec<String>> {
        let node = &self.agents[i];
        let topo = &self.cluster.nodes()[i];
        let relay = topo
            .etcd_addr()
            .context("the cluster was built without relays to etcd")?;
        let certs = self.certs_dir();
        let mut args = vec![
            "--dataplane".to_owned(),
            self.config.dataplane.clone(),
            "--interfaces".to_owned(),
            NODE_POD_IF.to_owned(),
            "--cgroup".to_owned(),
            node.cgroup.path().display().to_string(),
            "--bpf-pin-dir".to_owned(),
            node.pins.path().display().to_string(),
            "--etcd-endpoints".to_owned(),
            format!("https://{relay}"),
            "--etcd-ca".to_owned(),
            certs.join("ca.pem").display().to_string(),
            "--etcd-cert".to_owned(),
            certs
                .join(format!("node-{}.pem", node.node_id))
                .display()
                .to_string(),
            "--etcd-key".to_owned(),
            certs
                .join(format!("node-{}-key.pem", node.node_id))
                .display()
                .to_string(),
        ];
        if let Some(s) = self.config.lease_seconds {
            args.extend(["--node-lease-seconds".to_owned(), s.to_string()]);
        }
        args.extend(self.config.extra_args.iter().cloned());
        Ok(args)
    }

    /// Starts node `i`'s agent (again); does not wait until it is ready.
    pub fn start_agent(&mut self, i: usize) -> anyhow::Result<()> {
        if self.agents[i].agent.is_some() {
            bail!("node-{}'s agent already runs", i + 1);
        }
        let args = self.agent_args(i)?;
        let mut cmd = Agent::command(&self.config.bin, &self.agents[i].state_dir)
            .netns(self.cluster.nodes()[i].ns())
            .args(args)
            .metrics("127.0.0.1:9464".parse()?)
            .stop_gracefully()
            .die_with_parent();
        cmd = if self.config.log_files {
            cmd.log_file(self.work.0.join(format!("node-{}.log", i + 1)))
        } else {
            cmd.keep_log()
        };
        self.agents[i].agent = Some(cmd.spawn()?);
        Ok(())
    }

    /// Kills node `i`'s agent with SIGKILL: its kernel state (pinned data plane)
    /// stays, its node lease runs out.
    pub fn kill_agent(&mut self, i: usize) {
        if let Some(mut a) = self.agents[i].agent.take() {
            a.kill();
        }
    }

    /// Stops node `i`'s agent with SIGTERM (a clean stop: it deregisters).
    pub fn stop_agent(&mut self, i: usize, patience: Duration) -> Option<i32> {
        self.agents[i]
            .agent
            .take()
            .and_then(|mut a| a.terminate(patience))
    }
}

/// The node id of node `i`: 32 hex digits, as the agent makes them, readable.
fn node_id(i: usize) -> String {
    format!("{i:032x}")
}

/// Writes the identity an agent would make on its first start, with a known id and
/// host name: the certificates name the node before its agent ever ran.
fn write_identity(state_dir: &Path, node_id: &str, hostname: &str) -> anyhow::Result<()> {
    fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(state_dir)
        .with_context(|| format!("creating {}", state_dir.display()))?;
    let json = format!("{{\"node_id\":\"{node_id}\",\"hostname\":\"{hostname}\"}}\n");
    let path = state_dir.join("node-identity.json");
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    std::io::Write::write_all(&mut f, json.as_bytes())?;
    Ok(())
}

/// Runs `rune-agent ARGS` and fails with its output when it fails.
fn certs_cmd(bin: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(bin)
        .args(args)
        .output()
        .with_context(|| format!("running {} {}", bin.display(), args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "`rune-agent {}` failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn path_str(p: &Path) -> anyhow::Result<&str> {
    p.to_str()
        .with_context(|| format!("{} is not UTF-8", p.display()))
}
