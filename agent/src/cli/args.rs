//! The command line's shape: the commands, their flags (clap), and the settings
//! layer they make over the config file's.

use super::{certs, nodes, observe};
use crate::config::{
    Config, ConfigError, DataplaneSettings, EtcdSettings, FileConfig, GlobalSettings,
    KernelSettings, PinSettings, RunSettings,
};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// The Rune node agent.
#[derive(Debug, Parser)]
#[command(name = "rune-agent", version, about, long_about = None)]
pub struct Cli {
    /// The settings every command takes (`--state-dir`).
    #[command(flatten)]
    pub global: GlobalSettings,
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
        /// With etcd: return once every Ready node has the change in its kernel
        /// (its applied revision reached the write's), or fail after TIMEOUT naming
        /// the nodes behind [default TIMEOUT: 60s].
        #[arg(
            long,
            value_name = "TIMEOUT",
            num_args = 0..=1,
            require_equals = true,
            default_missing_value = "60s",
            value_parser = nodes::parse_timeout
        )]
        wait: Option<std::time::Duration>,
        /// `--etcd-endpoints` and the rest: write to etcd directly.
        #[command(flatten)]
        etcd: EtcdSettings,
    },
    /// List objects, or with etcd the nodes (`get nodes`, `get node NAME -o yaml`).
    Get {
        /// Kind: service (svc), endpoints (ep) or node(s) (etcd only); every object
        /// kind when omitted.
        kind: Option<String>,
        /// Name; every object of the kind when omitted.
        name: Option<String>,
        /// Namespace; with a NAME `default` when omitted, else every namespace.
        #[arg(short = 'n', long)]
        namespace: Option<String>,
        /// Output format; a table when omitted.
        #[arg(short = 'o', long, value_enum)]
        output: Option<Format>,
        /// Print the values of Secrets (with `-o yaml` only); hidden otherwise.
        #[arg(long)]
        show_secrets: bool,
        /// `--etcd-endpoints` and the rest: read etcd directly.
        #[command(flatten)]
        etcd: EtcdSettings,
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
        /// `--etcd-endpoints` and the rest: delete in etcd directly.
        #[command(flatten)]
        etcd: EtcdSettings,
    },
    /// Drain a node (etcd only): every agent treats the endpoints on it as
    /// terminating (no new connections; established ones end within their
    /// services' drainSeconds) until `undrain`.
    Drain {
        /// The node: its id, or a host name only one node has.
        node: String,
        /// `--etcd-endpoints` and the rest (the admin's certificate).
        #[command(flatten)]
        etcd: EtcdSettings,
    },
    /// Undo `drain`: the node's endpoints take new connections again.
    Undrain {
        /// The node: its id, or a host name only one node has.
        node: String,
        /// `--etcd-endpoints` and the rest (the admin's certificate).
        #[command(flatten)]
        etcd: EtcdSettings,
    },
    /// Show the agent's mode, identity, readiness, revision and object counts, and
    /// the services with their ports and backends when there are at most 20 (more
    /// are counted only: `--all` lists them, SERVICE shows one).
    Status(StatusArgs),
    /// Stream the running agent's network policy verdicts: flows refused, or in
    /// audit mode that would have been (eBPF data plane).
    Observe(observe::ObserveArgs),
    /// Remove the kernel state a stopped agent left behind: detach the eBPF programs
    /// and unpin their maps (established flows through the VIPs end).
    Cleanup {
        /// `--bpf-pin-dir`.
        #[command(flatten)]
        pins: PinSettings,
    },
    /// Check what this kernel and process can run (bpf syscall, BTF, program, map
    /// and helper types, attachments, cgroup v2, bpffs, capabilities, nft) and which
    /// data plane would be chosen, and why. Exits 0 when some data plane can run.
    ///
    /// The cgroup attach probe uses an empty child of `--cgroup` it removes again.
    Preflight {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// `--dataplane` (the one to decide for) and `--cgroup`.
        #[command(flatten)]
        dataplane: DataplaneSettings,
    },
    /// Make the certificates of etcd's mutual TLS and set up etcd's roles for them.
    Certs {
        /// `init`, `issue` or `etcd-rbac`.
        #[command(subcommand)]
        command: certs::CertsCommand,
    },
    /// Print the version.
    Version,
}

/// Arguments of `status`.
#[derive(Debug, Default, Args)]
pub struct StatusArgs {
    /// One service, `NAME` (namespace from -n, else `default`) or `NAMESPACE/NAME`.
    #[arg(conflicts_with = "all")]
    pub service: Option<String>,
    /// Namespace of SERVICE.
    #[arg(short = 'n', long, requires = "service")]
    pub namespace: Option<String>,
    /// Every service and orphan endpoints object, streamed.
    #[arg(long)]
    pub all: bool,
    /// Output format; text when omitted.
    #[arg(short = 'o', long, value_enum)]
    pub output: Option<Format>,
    /// `--etcd-endpoints` and the rest: the agent is asked all the same; without
    /// one running, status is not read from etcd.
    #[command(flatten)]
    pub etcd: EtcdSettings,
}

/// Output formats of `get` and `status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// YAML documents.
    Yaml,
    /// JSON.
    Json,
}

/// Flags of `run`: every group of settings; each overrides the config file's
/// setting of the same name.
#[derive(Clone, Debug, Default, Args)]
pub struct RunArgs {
    /// Mode, listeners, capacities, DNS.
    #[command(flatten)]
    pub settings: RunSettings,
    /// `--dataplane`, `--cgroup`.
    #[command(flatten)]
    pub dataplane: DataplaneSettings,
    /// `--bpf-pin-dir`.
    #[command(flatten)]
    pub pins: PinSettings,
    /// Interfaces, eBPF map sizes, nftables rules on stop.
    #[command(flatten)]
    pub kernel: KernelSettings,
    /// `--etcd-endpoints` and the rest: the objects in etcd.
    #[command(flatten)]
    pub etcd: EtcdSettings,
}

impl Command {
    /// The settings this command's flags and their variables set: a layer over the
    /// config file's.
    pub fn settings(&self) -> FileConfig {
        match self {
            Command::Run(args) => {
                let RunArgs {
                    settings,
                    dataplane,
                    pins,
                    kernel,
                    etcd,
                } = args.as_ref().clone();
                [
                    settings.into(),
                    dataplane.into(),
                    pins.into(),
                    kernel.into(),
                    etcd.into(),
                ]
                .into_iter()
                .fold(FileConfig::default(), FileConfig::overridden_by)
            }
            Command::Cleanup { pins } => pins.clone().into(),
            Command::Preflight { dataplane, .. } => dataplane.clone().into(),
            Command::Apply { etcd, .. }
            | Command::Get { etcd, .. }
            | Command::Delete { etcd, .. }
            | Command::Drain { etcd, .. }
            | Command::Undrain { etcd, .. }
            | Command::Status(StatusArgs { etcd, .. }) => etcd.clone().into(),
            Command::Certs {
                command: certs::CertsCommand::EtcdRbac(args),
            } => args.etcd.clone().into(),
            Command::Certs { .. } | Command::Version | Command::Observe(_) => FileConfig::default(),
        }
    }
}

impl Cli {
    /// The settings: defaults, then the config file, then the command's flags and
    /// variables.
    pub fn config(&self) -> Result<Config, ConfigError> {
        let file = match &self.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        file.overridden_by(self.flags()).resolve()
    }

    /// The layer the command line and the `RUNE_*` variables set: the global flags
    /// and the command's (a flag wins over its variable: clap reads both).
    pub fn flags(&self) -> FileConfig {
        FileConfig::from(self.global.clone()).overridden_by(self.command.settings())
    }
}
