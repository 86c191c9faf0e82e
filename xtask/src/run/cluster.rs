//! `cargo xtask run --cluster N`: a dev cluster on this machine
//! (`rune_harness::cluster::running`): etcd with TLS on loopback, N node
//! namespaces joined by a bridge, each with its agent (the best data plane
//! preflight allows, attached to the node's pod interface) and a pod; an example
//! service whose endpoints are every pod; then it waits for Ctrl-C and removes all
//! of it.

use std::{net::Ipv4Addr, time::Duration};

use anyhow::{Context as _, bail};
use rune_harness::{
    cluster::{
        POD_TCP_PORT,
        running::{ClusterConfig, RunningCluster},
    },
    netns::require_root,
};

/// The example service's VIP.
const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 200, 10);

/// Builds the release agent, starts the cluster, applies the example, prints how
/// to reach it, and waits for Ctrl-C.
pub fn run(nodes: usize, extra_args: Vec<String>) -> anyhow::Result<()> {
    require_root().context("`cargo xtask run --cluster` builds network namespaces")?;
    if nodes == 0 {
        bail!("--cluster needs at least one node");
    }
    let bin = crate::util::bench_agent()?;
    let mut config = ClusterConfig::new(nodes, &bin);
    config.dataplane = "auto".to_owned();
    config.extra_args = extra_args;
    config.log_files = true;
    println!("starting etcd and {nodes} agents ...");
    let cluster = RunningCluster::start(config, Duration::from_secs(120))?;
    let example = example_yaml(&cluster);
    let out = cluster.cli(&["apply", "-f", "-", "--wait=30s"], Some(&example));
    if !out.status.success() {
        bail!(
            "applying the example failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = cluster.cli(&["get", "nodes"], None);
    println!("{}", String::from_utf8_lossy(&out.stdout));
    print_usage(&cluster, &bin.display().to_string());
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(tokio::signal::ctrl_c())
        .context("waiting for Ctrl-C")?;
    println!("stopping the agents and removing the cluster ...");
    drop(cluster);
    Ok(())
}

/// The example: service `hello` on the VIP, port 80 → every pod's line server.
fn example_yaml(cluster: &RunningCluster) -> String {
    let eps: Vec<String> = cluster
        .topology()
        .nodes()
        .iter()
        .map(|n| format!("{{address: {}, node: {}}}", n.pod_addr(), n.name()))
        .collect();
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: hello}}\n\
         spec: {{ports: [{{port: 80, targetPort: {POD_TCP_PORT}}}], discovery: {{vips: [{VIP}]}}}}\n\
         ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: hello}}\n\
         spec: {{endpoints: [{}]}}\n",
        eps.join(", ")
    )
}

fn print_usage(cluster: &RunningCluster, bin: &str) {
    let admin = cluster.admin_etcd_args().join(" ");
    let first = &cluster.topology().nodes()[0];
    println!("The cluster runs. As the admin (on the host):");
    println!("  {bin} get nodes {admin}");
    println!("  {bin} get svc {admin}");
    println!("  {bin} apply -f FILE --wait {admin}");
    println!();
    println!("From node-1's pod, through the VIP (each line is answered by a pod):");
    println!(
        "  ip netns exec {} bash -c 'exec 3<>/dev/tcp/{VIP}/80; echo hi >&3; head -1 <&3'",
        first.pod().name()
    );
    println!(
        "Agents' logs and certificates: {}",
        cluster
            .certs_dir()
            .parent()
            .map_or(String::new(), |p| p.display().to_string())
    );
    println!();
    println!("Ctrl-C stops the agents and removes etcd, the namespaces and every file.");
}
