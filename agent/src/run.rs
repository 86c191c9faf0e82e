//! `rune-agent run`: builds the agent from its settings and runs it until a signal.
//!
//! Order of subsystems (started in this order, stopped in reverse): `metrics` first
//! so `/readyz` answers 503 while the rest comes up, then `localapi`, `watch` (the
//! ordered log into the cache), with etcd `drains` (the drained nodes into the
//! cache, before the data plane's first delta), `dataplane`, `dns` (which reads the
//! cache), with `--ingress` `ingress` (which reads it too), and with etcd `node`
//! last.
//!
//! The objects live in the embedded store in the state dir, or with
//! `--etcd-endpoints` in etcd (nothing is opened in the state dir then; the identity
//! stays there). With etcd, a probe keeps `status` and `rune_store_connected` told
//! whether etcd answers; the data plane serves the last state applied meanwhile.

use crate::{
    agent::{Agent, AgentConfig},
    applied::AppliedRevision,
    config::{Config, DataplaneMode, Mode},
    dataplane::{
        DataPlane, DataPlaneError,
        ebpf::{EbpfConfig, EbpfDataPlane, Hooks, MapSizes, attach},
        leftovers,
        nftables::{NftablesConfig, NftablesDataPlane},
        proxy::{ListenOn, ProxyConfig, UserspaceProxy},
        reconciler::Reconciler,
    },
    dns::{DnsConfig, DnsServer, ForwardConfig, ZoneConfig},
    endpoints::{CacheFeed, EndpointCache, read_first_snapshot},
    identity::Identity,
    ingress::{AcmeServer, AcmeSettings, IngressConfig, IngressServer, ProxyLimits},
    localapi::{self, LocalApiServer},
    metrics::{Metrics, server::MetricsServer},
    node::{
        drain_follower::DrainFollower,
        facts::FactsSource,
        registrar::{Registrar, RegistrarOptions},
    },
    orderedlog::{
        OrderedLog,
        embedded::{EmbeddedLog, EmbeddedOptions},
        etcd::EtcdLog,
        store::ObjectStore,
    },
    outbox::Outbox,
    preflight,
    status::{
        LiveStatus,
        store::{StoreLink, probe_etcd},
    },
};
use anyhow::{Context, Result};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The node label that runs the ingress proxy without `--ingress`: edge nodes are
/// chosen by their label in `node-identity.json` (docs/ingress.md).
const EDGE_LABEL: (&str, &str) = ("role", "edge");

/// Runs the agent until SIGINT or SIGTERM, then stops every subsystem.
pub async fn run(config: Config) -> Result<()> {
    let mode = config.mode;
    // Checked before anything is created: a refused etcd setting changes nothing.
    let etcd_options = config.etcd_options()?;
    raise_fd_limit();
    // Creates the state dir when missing.
    let identity = Identity::load_or_create(&config.state_dir)?;
    // The CLI on this node then reaches the same etcd (or none) without flags.
    if let Err(e) = crate::config::recorded::record(&config) {
        tracing::warn!(error = %e, file = crate::config::recorded::FILE, "recording the etcd settings in the state dir failed: the CLI on this node needs them given");
    }
    // etcd takes the client certificate's CN as this node's user.
    if let Some(cert) = etcd_options.as_ref().and_then(|o| o.cert_file.as_deref()) {
        crate::certs::client::check_node_certificate(cert, &identity.node_id)?;
    }
    let metrics = Arc::new(Metrics::new());
    // What the data plane and DNS have in the kernel, acknowledged per revision.
    let applied = AppliedRevision::with_metrics(&metrics);
    let (store, link) = open_store(&config, etcd_options).await?;
    // With etcd, the probe runs until `run` returns (the guard cancels it).
    let probe = CancellationToken::new();
    let _probe_guard = probe.clone().drop_guard();
    match &link {
        Link::Embedded(_) => {
            metrics.store_connected.set(1);
        }
        Link::Etcd(link, etcd) => {
            tokio::spawn(probe_etcd(
                link.clone(),
                etcd.clone(),
                metrics.clone(),
                probe.clone(),
            ));
        }
    }
    let cache = Arc::new(EndpointCache::new());
    // The first snapshot is read into the cache (on the blocking pool) while
    // preflight and the data plane's load run: on a large cluster both take a
    // while, and even a small node's two cores do them side by side.
    let log: Arc<dyn OrderedLog> = store.clone();
    let first_snapshot = read_first_snapshot(log.clone(), cache.clone());
    // Production runs preflight first; dev mode always uses the loopback proxies.
    let (plane, selected): (Arc<dyn DataPlane>, _) = match mode {
        Mode::Dev => (
            userspace_proxy(
                &config,
                &identity,
                &metrics,
                ListenOn::Loopback,
                config.dev_port_offset,
            )?,
            None,
        ),
        Mode::Production => {
            let (plane, selected) = production_dataplane(&config, &identity, &metrics).await?;
            (plane, Some(selected))
        }
    };
    let outbox = Arc::new(Outbox::from_metrics(config.outbox_capacity, &metrics));
    let agent = Arc::new(Agent::new(AgentConfig {
        identity: identity.clone(),
        mode,
        outbox,
        ready_timeout: config.ready_timeout,
        metrics: metrics.clone(),
    })?);

    let dns = Arc::new(
        DnsServer::new(
            DnsConfig {
                addrs: config.dns_addrs.clone(),
                zone: ZoneConfig {
                    domain: config.dns_domain.clone(),
                    ttl: config.dns_ttl_seconds,
                    mode,
                    dev_port_offset: config.dev_port_offset,
                },
                forward: ForwardConfig {
                    upstreams: config.dns_upstreams.clone(),
                    resolv_conf: Some(config.dns_resolv_conf.clone()),
                    timeout: config.dns_upstream_timeout,
                    cache_size: config.dns_cache_size,
                },
            },
            cache.clone(),
            metrics.clone(),
        )?
        .with_applied(applied.consumer("dns")),
    );

    if mode == Mode::Dev {
        metrics.set_dataplane(plane.mode(), &[]);
    }
    // The node's facts, for its key in etcd.
    let facts = matches!(link, Link::Etcd(..)).then(|| {
        FactsSource::for_agent(
            Arc::downgrade(&agent),
            mode,
            plane.clone(),
            selected
                .as_ref()
                .map_or_else(|| "dev mode".to_owned(), |s| s.reason.clone()),
            selected
                .as_ref()
                .map(|s| s.checks.clone())
                .unwrap_or_default(),
            config.state_dir.clone(),
        )
    });
    let ingress = (config.ingress || identity.has_label(EDGE_LABEL.0, EDGE_LABEL.1)).then(|| {
        Arc::new(IngressServer::new(
            IngressConfig {
                addr: config.ingress_addr,
                tls_addr: config.ingress_tls_addr,
                header_timeout: config.ingress_header_timeout,
                idle_timeout: config.ingress_idle_timeout,
                max_header_bytes: config.ingress_max_header_bytes,
                max_connections: config.ingress_max_connections,
                workers: config.ingress_workers,
                handshake_threads: config.ingress_handshake_threads,
                fast_path: !config.ingress_no_fast_path,
                default_cert: config.ingress_default_cert.clone(),
                limits: ProxyLimits {
                    connect_timeout: config.ingress_connect_timeout,
                    response_timeout: config.ingress_response_timeout,
                    max_body_bytes: config.ingress_max_body_bytes,
                    trusted_proxies: config.ingress_trusted_proxies.clone(),
                    tls_port: config.ingress_tls_addr.port(),
                    access_log_sample: config.ingress_access_log_sample,
                },
                acme: AcmeSettings {
                    server: AcmeServer {
                        directory: config.ingress_acme_directory.clone(),
                        email: config.ingress_acme_email.clone(),
                        ca_bundle: config.ingress_acme_ca_bundle.clone(),
                    },
                    renew_before: config.ingress_acme_renew_before,
                    first_retry: config.ingress_acme_retry,
                    dir: config.state_dir.join("acme"),
                },
            },
            cache.clone(),
            metrics.ingress.clone(),
        ))
    });
    let status = LiveStatus {
        acme: ingress.as_ref().map(|i| i.acme_status()),
        routes: ingress.as_ref().map(|i| i.route_status()),
        agent: Arc::downgrade(&agent),
        cache: cache.clone(),
        plane: plane.clone(),
        dns: Arc::new(dns.state_handle()),
        state_dir: config.state_dir.clone(),
        dataplane_reason: selected.as_ref().map(|s| s.reason.clone()),
        preflight: selected.map(|s| s.checks).unwrap_or_default(),
        store: link.store_link(),
    };
    agent.register(Arc::new(MetricsServer::new(
        config.metrics_addr,
        metrics.clone(),
        agent.readiness(),
    )))?;
    agent.register(Arc::new(LocalApiServer::new(
        localapi::socket_path(&config.state_dir),
        store.clone(),
        status,
    )))?;
    agent.register(Arc::new(
        CacheFeed::new(log, cache.clone(), metrics)
            .with_first_snapshot(first_snapshot)
            .with_applied(applied.clone()),
    ))?;
    // Drained nodes' endpoints are terminating in the cache: known before the data
    // plane and DNS take their first delta (its start waits a moment for that).
    if let Link::Etcd(_, etcd) = &link {
        agent.register(Arc::new(DrainFollower::new(etcd.clone(), cache.clone())))?;
    }
    agent.register(Arc::new(
        Reconciler::new(plane, cache).with_applied(applied.consumer("dataplane")),
    ))?;
    agent.register(dns)?;
    if let Some(ingress) = ingress {
        agent.register(ingress)?;
    }
    // Registered last, so stopped first: the node's key is revoked while the
    // rest still serves.
    if let (Link::Etcd(_, etcd), Some(facts)) = (&link, facts) {
        let ttl = config.node_lease;
        agent.register(Arc::new(Registrar::new(
            etcd.clone(),
            identity.clone(),
            facts,
            applied,
            RegistrarOptions {
                ttl,
                heartbeat: ttl / 3,
                ..RegistrarOptions::default()
            },
        )))?;
    }

    tracing::info!(
        mode = %mode,
        node_id = %identity.node_id,
        state_dir = %config.state_dir.display(),
        store = %link.store_link().state().backend,
        "starting rune-agent"
    );
    if mode == Mode::Dev {
        tracing::warn!(
            "dev mode: network policy is checked for connections through the proxies only \
             (ingress, not direct traffic to endpoints, not egress)"
        );
    }
    // One signal future for the whole run, installed before start: a SIGTERM that
    // arrives between start and the wait below is not lost.
    let signal = shutdown_signal()?;
    tokio::pin!(signal);
    let start = agent.start();
    tokio::pin!(start);
    let started = tokio::select! {
        r = &mut start => Some(r),
        () = &mut signal => None,
    };
    match started {
        Some(Ok(())) => {
            match agent.ready_err() {
                None => tracing::info!("agent ready"),
                Some(e) => tracing::warn!(error = %e, "agent running but not ready"),
            }
            signal.await;
        }
        Some(Err(e)) => {
            let _ = agent.stop().await;
            return Err(e).context("starting the agent");
        }
        None => {
            // Never drop a start in progress (it may be rolling back): stop aborts
            // it, and both run to their end.
            tracing::info!("signal received during start; stopping");
            let (_, stopped) = tokio::join!(start, agent.stop());
            return stopped.context("stopping the agent");
        }
    }
    tracing::info!("stopping");
    agent.stop().await.context("stopping the agent")?;
    tracing::info!("stopped");
    Ok(())
}

/// The store's link as `run` keeps it: the embedded store's, or etcd's with the
/// client its probe asks.
enum Link {
    Embedded(Arc<StoreLink>),
    Etcd(Arc<StoreLink>, EtcdLog),
}

impl Link {
    fn store_link(&self) -> Arc<StoreLink> {
        match self {
            Link::Embedded(link) | Link::Etcd(link, _) => link.clone(),
        }
    }
}

/// The store the agent reads and writes: etcd with `options` (connecting sends
/// nothing, so etcd may be down: the feed and the probe retry), else the embedded
/// store in the state dir.
async fn open_store(
    config: &Config,
    options: Option<crate::orderedlog::etcd::EtcdOptions>,
) -> Result<(Arc<dyn ObjectStore>, Link)> {
    match options {
        Some(options) => {
            let etcd = EtcdLog::connect(options)
                .await
                .context("the etcd store (--etcd-endpoints)")?;
            let link = Arc::new(StoreLink::etcd(&etcd));
            Ok((Arc::new(etcd.clone()), Link::Etcd(link, etcd)))
        }
        None => {
            let store = EmbeddedLog::open(
                &config.state_dir,
                EmbeddedOptions {
                    history: config.log_history,
                },
            )?;
            let link = Arc::new(StoreLink::embedded(store.path()));
            Ok((Arc::new(store), Link::Embedded(link)))
        }
    }
}

/// The production data plane preflight chose, with the checks behind the choice.
#[derive(Debug)]
struct SelectedDataplane {
    reason: String,
    checks: Vec<preflight::Check>,
}

/// Runs preflight, decides the data plane for `--dataplane` (a forced mode whose
/// checks fail is an error naming them), removes what other modes left, and starts
/// the chosen data plane; logs and records the choice.
///
/// The agent's programs go through the verifier once, in the eBPF data plane's own
/// load (preflight defers `load:*` and `attach:*` to it). When that load fails,
/// its failed step becomes the failed check: `auto` decides again (nftables, else
/// userspace) and a forced `ebpf` stops naming the check, as if preflight had found
/// it.
async fn production_dataplane(
    config: &Config,
    identity: &Identity,
    metrics: &Arc<Metrics>,
) -> Result<(Arc<dyn DataPlane>, SelectedDataplane)> {
    let options = preflight::Options {
        defer_programs: true,
        ..preflight::Options::with_cgroup(config.cgroup.clone())
    };
    let report = preflight::run(&options)?;
    for c in report.checks.iter().filter(|c| !c.passed) {
        tracing::warn!(check = %c.name, detail = %c.detail, "preflight check failed");
    }
    let mut checks = report.checks;
    let mut selection =
        preflight::decide(config.dataplane, &checks).context("choosing the data plane")?;
    // eBPF is tried at most once: every later mode either starts or stops the start.
    let plane = loop {
        // eBPF removes the other modes' leftovers only once it runs: a load that
        // fails (auto then falls back, maybe to nftables) must not have taken down
        // a working nftables table first. nftables and userspace start clean.
        if selection.mode != DataplaneMode::Ebpf {
            remove_other_modes(selection.mode, config).await?;
        }
        match start_dataplane(selection.mode, config, identity, metrics)? {
            Started::Plane(plane, attachments) => {
                if selection.mode == DataplaneMode::Ebpf {
                    remove_other_modes(selection.mode, config).await?;
                }
                match &attachments {
                    Some(attached) => preflight::deferred::record_loaded(&mut checks, attached),
                    None => preflight::deferred::record_not_probed(&mut checks, selection.mode),
                }
                break plane;
            }
            Started::EbpfFailed(error, failed) => {
                for c in &failed {
                    tracing::warn!(check = %c.name, detail = %c.detail, "eBPF data plane failed to load; recorded as a failed preflight check");
                }
                preflight::deferred::record_failed(&mut checks, failed);
                selection = preflight::decide(config.dataplane, &checks)
                    .with_context(|| format!("starting the eBPF data plane: {error:#}"))?;
                if selection.mode == DataplaneMode::Ebpf {
                    return Err(error.context("starting the eBPF data plane"));
                }
            }
        }
    };
    tracing::info!(
        mode = %selection.mode,
        reason = %selection.reason,
        kernel = %report.kernel,
        "data plane chosen"
    );
    let results: Vec<(String, bool)> = checks.iter().map(|c| (c.name.clone(), c.passed)).collect();
    metrics.set_dataplane(selection.mode.as_str(), &results);
    Ok((
        plane,
        SelectedDataplane {
            reason: selection.reason,
            checks,
        },
    ))
}

/// Removes what data plane modes other than `mode` left on the node.
async fn remove_other_modes(mode: DataplaneMode, config: &Config) -> Result<()> {
    let removed = leftovers::remove(&leftovers::others(mode), &config.bpf_pin_dir)
        .await
        .context("removing what another data plane mode left")?;
    if !removed.is_empty() {
        tracing::info!(%removed, "removed what other data plane modes left");
    }
    Ok(())
}

/// What starting a production data plane gave.
enum Started {
    /// The plane, and for eBPF what it attached.
    Plane(Arc<dyn DataPlane>, Option<Vec<attach::Attachment>>),
    /// The eBPF load failed at a step preflight probes: the error and the failed
    /// checks (it left nothing it created behind).
    EbpfFailed(anyhow::Error, Vec<preflight::Check>),
}

/// Starts data plane `mode`; an eBPF load failing at a step preflight probes is
/// [`Started::EbpfFailed`], every other error stops the start.
fn start_dataplane(
    mode: DataplaneMode,
    config: &Config,
    identity: &Identity,
    metrics: &Arc<Metrics>,
) -> Result<Started> {
    let plane: Arc<dyn DataPlane> = match mode {
        DataplaneMode::Ebpf => {
            let ebpf_config = ebpf_config(config, identity);
            let ebpf = match EbpfDataPlane::new(&ebpf_config) {
                Ok(ebpf) => ebpf,
                Err(DataPlaneError::Ebpf(e)) => {
                    let failed = preflight::deferred::failed_checks(&e, &ebpf_config.hooks);
                    let error = anyhow::Error::new(e);
                    if failed.is_empty() {
                        return Err(error.context(
                            "starting the eBPF data plane (its preflight checks passed: this is \
                             a pin or map error; --dataplane nftables runs without eBPF)",
                        ));
                    }
                    return Ok(Started::EbpfFailed(error, failed));
                }
                Err(e) => return Err(e).context("starting the eBPF data plane"),
            };
            metrics.set_dataplane_collector(ebpf.collector());
            let attached = ebpf.attachments().to_vec();
            return Ok(Started::Plane(Arc::new(ebpf), Some(attached)));
        }
        DataplaneMode::Nftables => {
            let nft = NftablesDataPlane::new(NftablesConfig {
                node_name: identity.hostname.clone(),
                keep_rules_on_stop: config.keep_rules_on_stop,
                policy_set_size: config.nft_policy_set_size,
                policy_log_group: config.nft_policy_log_group,
            })
            .context(
                "starting the nftables data plane (its preflight checks passed: this is an \
                 error of nft itself)",
            )?;
            metrics.set_dataplane_collector(nft.collector());
            nft.start_policy_events();
            Arc::new(nft)
        }
        DataplaneMode::Userspace => userspace_proxy(config, identity, metrics, ListenOn::Vips, 0)?,
    };
    Ok(Started::Plane(plane, None))
}

/// The userspace proxies listening on `listen`, ports shifted by `port_offset`.
fn userspace_proxy(
    config: &Config,
    identity: &Identity,
    metrics: &Arc<Metrics>,
    listen: ListenOn,
    port_offset: u16,
) -> Result<Arc<dyn DataPlane>> {
    let proxy = UserspaceProxy::new(
        ProxyConfig {
            listen,
            port_offset,
            node_name: identity.hostname.clone(),
            maglev_table_size: config.maglev_table_size,
            udp_idle_timeout: config.udp_idle_timeout,
            ..ProxyConfig::default()
        },
        metrics.clone(),
    )?;
    metrics.set_dataplane_collector(proxy.collector());
    Ok(Arc::new(proxy))
}

/// The eBPF data plane's settings: hooks from the config, else the cgroup v2 root
/// and the interfaces of the default routes.
fn ebpf_config(config: &Config, identity: &Identity) -> EbpfConfig {
    let cgroup = match &config.cgroup {
        Some(choice) => choice.clone(),
        None => attach::default_cgroup(),
    };
    let tc = config
        .interfaces
        .clone()
        .unwrap_or_else(attach::default_route_interfaces);
    EbpfConfig {
        pin_dir: config.bpf_pin_dir.clone(),
        hooks: Hooks {
            cgroup,
            tc,
            xdp: config.xdp_interfaces.clone(),
            policy: config.policy_interfaces.clone(),
            ..Hooks::default()
        },
        sizes: MapSizes {
            frontends: config.lb_max_frontends,
            backends: config.lb_max_backends,
            table_size: config.maglev_table_size,
            flows: config.lb_max_flows,
            affinity: config.lb_max_flows,
            policy_entries: config.policy_max_entries,
        },
        node_name: identity.hostname.clone(),
    }
}

/// Raises the soft limit on open files to the hard limit: every proxied connection
/// takes two descriptors and every UDP flow one, and the usual soft limit of 1024
/// would otherwise starve every listener at once.
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to an initialised rlimit.
    let raised = unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && {
            if lim.rlim_cur < lim.rlim_max {
                lim.rlim_cur = lim.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0
            } else {
                true
            }
        }
    };
    if raised {
        tracing::debug!(limit = lim.rlim_cur, "open file limit");
    } else {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "cannot raise the open file limit; many connections may fail"
        );
    }
}

/// Resolves on the first SIGTERM or SIGINT; the handlers are installed at once.
fn shutdown_signal() -> Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}
