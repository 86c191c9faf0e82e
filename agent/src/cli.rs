//! The `rune-agent` command line: `run`, `apply`, `get`, `delete`, `status`,
//! `cleanup`, `preflight`, `version`.
//!
//! Commands other than `run` reach a running agent through its socket
//! (`<state-dir>/agent.sock`); when no agent runs they open the store directly, so a
//! node can be prepared before its agent starts.

use crate::{
    config::{Config, ConfigError, FileConfig},
    localapi::{self, Client},
    model::{Kind, Object, ObjectKey, parse_documents},
    orderedlog::embedded::{EmbeddedLog, EmbeddedOptions},
    status::AgentStatus,
};
use anyhow::{Context, Result, bail};
use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};
use std::{io::Read, path::PathBuf};

/// The Rune node agent.
#[derive(Debug, Parser)]
#[command(name = "rune-agent", version, about, long_about = None)]
pub struct Cli {
    /// Where identity, store and socket live [default: /var/lib/rune as root,
    /// $XDG_STATE_HOME/rune otherwise].
    #[arg(long, global = true, env = "RUNE_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// A YAML config file; flags and RUNE_* variables override its settings.
    #[arg(long, global = true, env = "RUNE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent (in the foreground, until SIGINT/SIGTERM).
    Run(Box<RunArgs>),
    /// Create or update objects from a YAML/JSON file (several documents allowed).
    Apply {
        /// The file, or `-` for standard input.
        #[arg(short = 'f', long = "filename", value_name = "FILE|-")]
        file: String,
    },
    /// List objects.
    Get {
        /// Kind: service (svc) or endpoints (ep); every kind when omitted.
        kind: Option<String>,
        /// Name; every object of the kind when omitted.
        name: Option<String>,
        /// Namespace; with a NAME `default` when omitted, else every namespace.
        #[arg(short = 'n', long)]
        namespace: Option<String>,
        /// Output format; a table when omitted.
        #[arg(short = 'o', long, value_enum)]
        output: Option<Format>,
    },
    /// Delete one object.
    Delete {
        /// Kind: service (svc) or endpoints (ep).
        kind: String,
        /// Name.
        name: String,
        /// Namespace.
        #[arg(short = 'n', long, default_value = crate::model::DEFAULT_NAMESPACE)]
        namespace: String,
    },
    /// Show the agent's mode, identity, readiness, revision and services.
    Status {
        /// Output format; text when omitted.
        #[arg(short = 'o', long, value_enum)]
        output: Option<Format>,
    },
    /// Remove the kernel state a stopped agent left behind: detach the eBPF programs
    /// and unpin their maps (established flows through the VIPs end).
    Cleanup {
        /// bpffs directory of the pins [default: /sys/fs/bpf/rune, or the config file's].
        #[arg(long, env = "RUNE_BPF_PIN_DIR", value_name = "DIR")]
        bpf_pin_dir: Option<PathBuf>,
    },
    /// Check what this kernel and process can run (bpf syscall, BTF, program, map
    /// and helper types, attachments, cgroup v2, bpffs, capabilities, nft) and which
    /// data plane would be chosen, and why. Exits 0 when some data plane can run.
    Preflight {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// The data plane to decide for [default: auto, or the config file's].
        #[arg(long, env = "RUNE_DATAPLANE", value_enum)]
        dataplane: Option<crate::config::DataplaneChoice>,
        /// cgroup v2 directory of the socket-LB hooks, or `none` [default: the
        /// cgroup v2 root]; the attach probe uses an empty child it removes again.
        #[arg(long, env = "RUNE_CGROUP", value_name = "PATH")]
        cgroup: Option<String>,
    },
    /// Print the version.
    Version,
}

/// Output formats of `get` and `status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// YAML documents.
    Yaml,
    /// JSON.
    Json,
}

/// Flags of `run`; each overrides the config file's setting of the same name.
#[derive(Debug, Default, Args)]
pub struct RunArgs {
    /// Dev mode: userspace proxies on 127.0.0.1, no root needed, no kernel changes.
    #[arg(long, env = "RUNE_DEV", action = ArgAction::SetTrue)]
    pub dev: bool,
    /// Dev mode: add N to every service port (e.g. 10000 to avoid privileged ports).
    #[arg(long, env = "RUNE_DEV_PORT_OFFSET", value_name = "N")]
    pub dev_port_offset: Option<u16>,
    /// Address of the /metrics, /healthz and /readyz listener [default: 127.0.0.1:9464].
    #[arg(long, env = "RUNE_METRICS_ADDR", value_name = "ADDR:PORT")]
    pub metrics_addr: Option<String>,
    /// Seconds `run` waits for every subsystem to be ready [default: 30].
    #[arg(long, env = "RUNE_READY_TIMEOUT_SECONDS", value_name = "S")]
    pub ready_timeout_seconds: Option<u64>,
    /// Outbox capacity [default: 4096].
    #[arg(long, env = "RUNE_OUTBOX_CAPACITY", value_name = "N")]
    pub outbox_capacity: Option<usize>,
    /// Maglev table size per service, a prime [default: 16381].
    #[arg(long, env = "RUNE_MAGLEV_TABLE_SIZE", value_name = "PRIME")]
    pub maglev_table_size: Option<u32>,
    /// Seconds an idle UDP flow keeps its backend [default: 60].
    #[arg(long, env = "RUNE_UDP_IDLE_TIMEOUT_SECONDS", value_name = "S")]
    pub udp_idle_timeout_seconds: Option<u64>,
    /// Ordered-log events kept for watchers before compaction [default: 10000].
    #[arg(long, env = "RUNE_LOG_HISTORY", value_name = "N")]
    pub log_history: Option<u64>,
    /// Where the embedded DNS server listens, UDP and TCP; repeatable
    /// [default: 127.0.0.123:53; with --dev 127.0.0.1:15353].
    #[arg(
        long = "dns-addr",
        env = "RUNE_DNS_ADDR",
        value_name = "ADDR:PORT",
        value_delimiter = ','
    )]
    pub dns_addrs: Vec<String>,
    /// The DNS zone answered for services, `<service>.<namespace>.<domain>` [default: rune].
    #[arg(long, env = "RUNE_DNS_DOMAIN", value_name = "DOMAIN")]
    pub dns_domain: Option<String>,
    /// TTL of DNS answers, in seconds [default: 5].
    #[arg(long, env = "RUNE_DNS_TTL_SECONDS", value_name = "S")]
    pub dns_ttl_seconds: Option<u32>,
    /// Upstream resolver for names outside the DNS zone, ADDR or ADDR:PORT; repeatable
    /// [default: the nameservers of --dns-resolv-conf, minus the agent's own].
    #[arg(
        long = "dns-upstream",
        env = "RUNE_DNS_UPSTREAM",
        value_name = "ADDR[:PORT]",
        value_delimiter = ','
    )]
    pub dns_upstreams: Vec<String>,
    /// Where upstream resolvers are read when none are given [default: /etc/resolv.conf].
    #[arg(long, env = "RUNE_DNS_RESOLV_CONF", value_name = "PATH")]
    pub dns_resolv_conf: Option<PathBuf>,
    /// How long one forwarded DNS question may take, retry included [default: 2000].
    #[arg(long, env = "RUNE_DNS_UPSTREAM_TIMEOUT_MS", value_name = "MS")]
    pub dns_upstream_timeout_ms: Option<u64>,
    /// Forwarded DNS answers kept in the cache, 0 for none [default: 10000].
    #[arg(long, env = "RUNE_DNS_CACHE_SIZE", value_name = "N")]
    pub dns_cache_size: Option<usize>,
    /// Production data plane: auto (preflight picks ebpf, else nftables, else
    /// userspace), or one of them forced (the start fails when its checks fail) [default: auto].
    #[arg(long, env = "RUNE_DATAPLANE", value_enum)]
    pub dataplane: Option<crate::config::DataplaneChoice>,
    /// bpffs directory for the eBPF pins [default: /sys/fs/bpf/rune].
    #[arg(long, env = "RUNE_BPF_PIN_DIR", value_name = "DIR")]
    pub bpf_pin_dir: Option<PathBuf>,
    /// cgroup v2 directory for the socket-LB hooks, or `none` [default: the cgroup v2 root].
    #[arg(long, env = "RUNE_CGROUP", value_name = "PATH")]
    pub cgroup: Option<String>,
    /// Interfaces for the tc programs, comma-separated; empty for none [default: those of the default routes].
    #[arg(long, env = "RUNE_INTERFACES", value_name = "A,B")]
    pub interfaces: Option<String>,
    /// Interfaces for the XDP program, comma-separated [default: none].
    #[arg(long, env = "RUNE_XDP_INTERFACES", value_name = "A,B")]
    pub xdp_interfaces: Option<String>,
    /// Frontends (VIP × port × protocol) the eBPF maps hold [default: 512].
    #[arg(long, env = "RUNE_LB_MAX_FRONTENDS", value_name = "N")]
    pub lb_max_frontends: Option<u32>,
    /// Backends the eBPF maps hold [default: 65536].
    #[arg(long, env = "RUNE_LB_MAX_BACKENDS", value_name = "N")]
    pub lb_max_backends: Option<u32>,
    /// Conntrack entries per family [default: 262144].
    #[arg(long, env = "RUNE_LB_MAX_FLOWS", value_name = "N")]
    pub lb_max_flows: Option<u32>,
    /// nftables mode: leave the table `inet rune` in the kernel on stop.
    #[arg(long, env = "RUNE_KEEP_RULES_ON_STOP")]
    pub keep_rules_on_stop: bool,
}

impl Cli {
    /// The settings: config file, overridden by flags and environment.
    pub fn config(&self, run: Option<&RunArgs>) -> Result<Config, ConfigError> {
        let file = match &self.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        let mut flags = FileConfig {
            state_dir: self.state_dir.clone(),
            ..FileConfig::default()
        };
        if let Some(r) = run {
            flags.dev = r.dev.then_some(true);
            flags.dev_port_offset = r.dev_port_offset;
            flags.metrics_addr = r.metrics_addr.clone();
            flags.ready_timeout_seconds = r.ready_timeout_seconds;
            flags.outbox_capacity = r.outbox_capacity;
            flags.maglev_table_size = r.maglev_table_size;
            flags.udp_idle_timeout_seconds = r.udp_idle_timeout_seconds;
            flags.log_history = r.log_history;
            flags.dns_addrs = (!r.dns_addrs.is_empty()).then(|| r.dns_addrs.clone());
            flags.dns_domain = r.dns_domain.clone();
            flags.dns_ttl_seconds = r.dns_ttl_seconds;
            flags.dns_upstreams = (!r.dns_upstreams.is_empty()).then(|| r.dns_upstreams.clone());
            flags.dns_resolv_conf = r.dns_resolv_conf.clone();
            flags.dns_upstream_timeout_ms = r.dns_upstream_timeout_ms;
            flags.dns_cache_size = r.dns_cache_size;
            flags.dataplane = r.dataplane;
            flags.bpf_pin_dir = r.bpf_pin_dir.clone();
            flags.cgroup = r.cgroup.clone();
            flags.interfaces = r.interfaces.clone().map(|s| vec![s]);
            flags.xdp_interfaces = r.xdp_interfaces.clone().map(|s| vec![s]);
            flags.lb_max_frontends = r.lb_max_frontends;
            flags.lb_max_backends = r.lb_max_backends;
            flags.lb_max_flows = r.lb_max_flows;
            flags.keep_rules_on_stop = r.keep_rules_on_stop.then_some(true);
        }
        file.overridden_by(flags).resolve()
    }
}

/// Where a command's requests go: the running agent, or the store itself.
enum Target {
    Agent(Client),
    Store(EmbeddedLog),
}

async fn target(config: &Config) -> Result<Target> {
    let socket = localapi::socket_path(&config.state_dir);
    if let Some(client) = Client::connect(&socket).await? {
        return Ok(Target::Agent(client));
    }
    let options = EmbeddedOptions {
        history: config.log_history,
    };
    let store = EmbeddedLog::open(&config.state_dir, options).with_context(|| {
        format!(
            "no agent answers on {} and the store cannot be opened",
            socket.display()
        )
    })?;
    Ok(Target::Store(store))
}

fn parse_kind(kind: &str) -> Result<Kind> {
    Kind::parse(kind)
        .with_context(|| format!("unknown kind {kind:?} (known: service/svc, endpoints/ep)"))
}

/// `rune-agent apply -f FILE|-`.
pub async fn apply(config: &Config, file: &str) -> Result<()> {
    let text = if file == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading standard input")?;
        s
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {file}"))?
    };
    let objects = parse_documents(&text).with_context(|| format!("in {file}"))?;
    if objects.is_empty() {
        bail!("{file}: no objects found");
    }
    let lines = match target(config).await? {
        Target::Agent(mut c) => c.apply(&objects).await?.0,
        Target::Store(store) => {
            let outcome = tokio::task::spawn_blocking(move || store.apply(objects)).await??;
            outcome
                .results
                .iter()
                .map(|(k, c)| localapi::format_change(k, *c))
                .collect()
        }
    };
    for line in lines {
        println!("{line}");
    }
    Ok(())
}

/// `rune-agent get [KIND] [NAME]`.
pub async fn get(
    config: &Config,
    kind: Option<&str>,
    name: Option<&str>,
    namespace: Option<&str>,
    output: Option<Format>,
) -> Result<()> {
    let kind = kind.map(parse_kind).transpose()?;
    if name.is_some() && kind.is_none() {
        bail!("a name needs a kind: rune-agent get KIND NAME");
    }
    // A name is looked up in one namespace (`default` unless -n says otherwise), as
    // `delete` does; without a name, every namespace is listed.
    let namespace = match (name, namespace) {
        (Some(_), None) => Some(crate::model::DEFAULT_NAMESPACE),
        _ => namespace,
    };
    let (_, objects) = match target(config).await? {
        Target::Agent(mut c) => c.get(kind, namespace, name).await?,
        Target::Store(store) => store.get(kind, namespace, name)?,
    };
    if objects.is_empty() && name.is_some() {
        bail!(
            "{} {}/{} not found",
            kind.map(Kind::as_str).unwrap_or_default(),
            namespace.unwrap_or_default(),
            name.unwrap_or_default()
        );
    }
    print!("{}", render_objects(&objects, output, name.is_some())?);
    Ok(())
}

/// Renders objects as a table, YAML documents or JSON.
pub fn render_objects(objects: &[Object], output: Option<Format>, single: bool) -> Result<String> {
    let docs: Vec<serde_json::Value> = objects.iter().map(Object::to_json).collect();
    Ok(match output {
        Some(Format::Json) if single && docs.len() == 1 => {
            serde_json::to_string_pretty(&docs[0])? + "\n"
        }
        Some(Format::Json) => {
            let list = serde_json::json!({"apiVersion": crate::model::API_VERSION, "kind": "List", "items": docs});
            serde_json::to_string_pretty(&list)? + "\n"
        }
        Some(Format::Yaml) => {
            let mut out = String::new();
            for (i, d) in docs.iter().enumerate() {
                if i > 0 {
                    out.push_str("---\n");
                }
                out.push_str(&serde_yaml_ng::to_string(d)?);
            }
            out
        }
        None => table(objects),
    })
}

fn table(objects: &[Object]) -> String {
    let mut rows = vec![[
        "KIND".to_owned(),
        "NAMESPACE".to_owned(),
        "NAME".to_owned(),
        "DETAILS".to_owned(),
    ]];
    for o in objects {
        let m = o.metadata();
        let details = match o {
            Object::Service(s) => {
                let ports: Vec<String> = s
                    .spec
                    .ports
                    .iter()
                    .map(|p| format!("{}/{}->{}", p.port, p.protocol, p.target()))
                    .collect();
                let vips: Vec<String> = s
                    .spec
                    .discovery
                    .vips
                    .iter()
                    .map(|v| v.to_string())
                    .collect();
                let vips = if s.spec.discovery.headless {
                    "headless".to_owned()
                } else if vips.is_empty() {
                    "no VIP".to_owned()
                } else {
                    vips.join(",")
                };
                format!("{vips} {}", ports.join(","))
            }
            Object::Endpoints(e) => {
                let total = e.spec.endpoints.len();
                let ready = e.spec.endpoints.iter().filter(|x| x.accepts_new()).count();
                format!("{total} endpoints, {ready} accepting")
            }
        };
        rows.push([
            o.kind().to_string(),
            m.namespace.clone(),
            m.name.clone(),
            details,
        ]);
    }
    let widths: Vec<usize> = (0..4)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let line = format!(
            "{:w0$}  {:w1$}  {:w2$}  {}",
            r[0],
            r[1],
            r[2],
            r[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2]
        );
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `rune-agent delete KIND NAME`.
pub async fn delete(config: &Config, kind: &str, name: &str, namespace: &str) -> Result<()> {
    let key = ObjectKey::new(parse_kind(kind)?, namespace, name);
    let deleted = match target(config).await? {
        Target::Agent(mut c) => c.delete(&key).await?,
        Target::Store(store) => store.delete(&key)?,
    };
    let shown = localapi::object_path(&key);
    match deleted {
        Some(_) => {
            println!("{shown} deleted");
            Ok(())
        }
        None => bail!("{shown} not found"),
    }
}

/// `rune-agent status`.
pub async fn status(config: &Config, output: Option<Format>) -> Result<()> {
    let status = match target(config).await? {
        Target::Agent(mut c) => {
            let v = c.status().await?;
            serde_json::from_value::<AgentStatus>(v).context("reading the agent's status")?
        }
        Target::Store(store) => AgentStatus::from_store(&config.state_dir, &store)?,
    };
    match output {
        Some(Format::Json) => println!("{}", serde_json::to_string_pretty(&status)?),
        Some(Format::Yaml) => print!("{}", serde_yaml_ng::to_string(&status)?),
        None => print!("{}", status.render()),
    }
    Ok(())
}

/// `rune-agent cleanup`: refuses while an agent runs on this state dir (it would
/// re-create what is removed), then removes every pin.
pub async fn cleanup(config: &Config, pin_dir: Option<&std::path::Path>) -> Result<()> {
    let socket = localapi::socket_path(&config.state_dir);
    if Client::connect(&socket).await?.is_some() {
        bail!(
            "an agent is running on {} (stop it first: cleanup removes what it uses)",
            socket.display()
        );
    }
    let dir = pin_dir.unwrap_or(&config.bpf_pin_dir);
    let removed =
        crate::dataplane::leftovers::remove(&crate::preflight::DataplaneMode::ALL, dir).await?;
    println!("removed {} eBPF pins under {}", removed.pins, dir.display());
    for ip in &removed.vips {
        println!("removed VIP address {ip} from lo");
    }
    if removed.nft_table {
        println!("removed the nftables table inet rune");
    }
    Ok(())
}

/// `rune-agent preflight [--json]`: every check, then the data plane `requested`
/// would get. Fails (after printing) when no data plane can run.
pub fn preflight(
    config: &Config,
    json: bool,
    requested: Option<crate::config::DataplaneChoice>,
    cgroup: Option<&str>,
) -> Result<()> {
    use crate::preflight::{self, Options, Outcome};
    let cgroup = match cgroup.map(str::trim) {
        Some("none" | "") => Some(None),
        Some(path) => Some(Some(PathBuf::from(path))),
        None => config.cgroup.clone(),
    };
    let report = preflight::run(&Options::with_cgroup(cgroup))?;
    let outcome = Outcome::new(&report, requested.unwrap_or(config.dataplane));
    if json {
        println!("{}", serde_json::to_string_pretty(&outcome)?);
    } else {
        print!("{}", outcome.render());
    }
    if outcome.mode.is_none() {
        bail!("{}", outcome.reason);
    }
    Ok(())
}
