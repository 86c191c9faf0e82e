//! The agent's settings: defaults, then a YAML config file, then `RUNE_*` environment
//! variables and command-line flags (flags and env override the file), with the
//! kinds they are made of: the agent's [`Mode`] (production or dev), the
//! [`DataplaneRequest`] (what `--dataplane` asks for) and the [`DataplaneMode`] it
//! names (what runs).
//!
//! Everything is checked here, before anything is bound or started, so a bad setting
//! stops the agent with a usage error instead of half-starting it.

use serde::{Deserialize, Serialize};
use std::{
    fmt,
    net::SocketAddr,
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};
use thiserror::Error;

/// Default `--metrics-addr`.
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9464";

/// Longest accepted UDP idle timeout (one day).
pub const MAX_UDP_IDLE_SECONDS: u64 = 86_400;

/// Default `--dns-addr` in production (the Rune agent's address).
pub const DEFAULT_DNS_ADDR: &str = "127.0.0.123:53";

/// Default `--dns-addr` in dev mode (unprivileged, on loopback).
pub const DEFAULT_DEV_DNS_ADDR: &str = "127.0.0.1:15353";

/// Default `--dns-domain`.
pub const DEFAULT_DNS_DOMAIN: &str = "rune.";

/// Default `--dns-ttl-seconds`.
pub const DEFAULT_DNS_TTL_SECONDS: u32 = 5;

/// Longest accepted DNS TTL (one day).
pub const MAX_DNS_TTL_SECONDS: u32 = 86_400;

/// Default `--dns-resolv-conf`: where upstream resolvers are found when none are
/// configured.
pub const DEFAULT_DNS_RESOLV_CONF: &str = "/etc/resolv.conf";

/// Default `--dns-upstream-timeout-ms`.
pub const DEFAULT_DNS_UPSTREAM_TIMEOUT_MS: u64 = 2000;

/// Longest accepted `--dns-upstream-timeout-ms` (one minute).
pub const MAX_DNS_UPSTREAM_TIMEOUT_MS: u64 = 60_000;

/// Default `--dns-cache-size`.
pub const DEFAULT_DNS_CACHE_SIZE: usize = 10_000;

/// Largest accepted `--dns-cache-size`.
pub const MAX_DNS_CACHE_SIZE: usize = 10_000_000;

/// Default `--outbox-capacity`: entries the outbox holds before it drops new ones.
pub const DEFAULT_OUTBOX_CAPACITY: usize = 4096;

/// Default `--bpf-pin-dir`.
pub const DEFAULT_BPF_PIN_DIR: &str = "/sys/fs/bpf/rune";

/// Default `--lb-max-frontends`: frontends (VIP × port × protocol) the eBPF maps
/// hold. Each owns a Maglev table, so kernel memory is this × the table size × 4
/// bytes (32 MiB at the default table size).
pub const DEFAULT_LB_MAX_FRONTENDS: u32 = 512;

/// Default `--lb-max-backends`.
pub const DEFAULT_LB_MAX_BACKENDS: u32 = 65_536;

/// Default `--lb-max-flows`: conntrack entries per family (LRU).
pub const DEFAULT_LB_MAX_FLOWS: u32 = 262_144;

/// A data plane the agent can run in production: what preflight chooses (from a
/// [`DataplaneRequest`] and the checks), what carries services, what `status` and
/// `rune_dataplane_mode` show.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataplaneMode {
    /// eBPF programs (cgroup socket hooks, tc, XDP) and pinned maps.
    Ebpf,
    /// nftables DNAT in the agent's own table.
    Nftables,
    /// Userspace proxies listening on the VIPs.
    Userspace,
}

impl DataplaneMode {
    /// Every mode, best first (the order `auto` tries them in).
    pub const ALL: [DataplaneMode; 3] = [Self::Ebpf, Self::Nftables, Self::Userspace];

    /// The mode's name, as `--dataplane` spells it.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Nftables => "nftables",
            Self::Userspace => "userspace",
        }
    }
}

impl fmt::Display for DataplaneMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The data plane asked for (`--dataplane`, `RUNE_DATAPLANE`, `dataplane:`): let
/// preflight pick, or force one [`DataplaneMode`]. Only a production start turns it
/// into the mode that runs ([`crate::preflight::decide()`]); dev mode always uses the
/// userspace proxies on 127.0.0.1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DataplaneRequest {
    /// The best the kernel can run, as preflight decides: eBPF when every eBPF
    /// check passes, else nftables when `nft` works, else userspace proxies.
    #[default]
    Auto,
    /// This mode and no other: the start fails when a check it needs fails.
    Forced(DataplaneMode),
}

impl DataplaneRequest {
    /// Every request, in the order `--help` lists them: `auto`, then each mode forced.
    pub const ALL: [DataplaneRequest; 4] = [
        Self::Auto,
        Self::Forced(DataplaneMode::Ebpf),
        Self::Forced(DataplaneMode::Nftables),
        Self::Forced(DataplaneMode::Userspace),
    ];

    /// The name as written on the command line and in the config file.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Forced(mode) => mode.as_str(),
        }
    }

    /// The request named `name`, as [`DataplaneRequest::as_str`] spells it.
    fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }

    /// What the request does, for `--help`.
    fn help(self) -> &'static str {
        match self {
            Self::Auto => {
                "The best the kernel can run, as preflight decides: eBPF when every eBPF \
                 check passes, else nftables when `nft` works, else userspace proxies"
            }
            Self::Forced(DataplaneMode::Ebpf) => {
                "The eBPF data plane; the start fails when a check it needs fails"
            }
            Self::Forced(DataplaneMode::Nftables) => {
                "nftables DNAT in the agent's own table; the start fails without a working `nft`"
            }
            Self::Forced(DataplaneMode::Userspace) => {
                "Userspace proxies listening on the VIPs themselves (the last resort)"
            }
        }
    }
}

impl clap::ValueEnum for DataplaneRequest {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.as_str()).help(self.help()))
    }
}

/// The names of [`DataplaneRequest::ALL`], for the error about any other.
const DATAPLANE_REQUEST_NAMES: &[&str] = &["auto", "ebpf", "nftables", "userspace"];

/// A YAML scalar naming a request, read the way serde reads a unit-variant enum (the
/// same errors for a wrong name or a wrong shape).
impl<'de> Deserialize<'de> for DataplaneRequest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;

        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = DataplaneRequest;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("enum DataplaneRequest")
            }

            fn visit_enum<A: serde::de::EnumAccess<'de>>(
                self,
                data: A,
            ) -> Result<Self::Value, A::Error> {
                use serde::de::{Error as _, VariantAccess as _};
                let (name, variant) = data.variant::<String>()?;
                let request = DataplaneRequest::named(&name)
                    .ok_or_else(|| A::Error::unknown_variant(&name, DATAPLANE_REQUEST_NAMES))?;
                variant.unit_variant()?;
                Ok(request)
            }
        }

        deserializer.deserialize_enum("DataplaneRequest", DATAPLANE_REQUEST_NAMES, Visitor)
    }
}

/// How the agent runs: on a real node, or on a laptop (`--dev`). Subsystems branch on
/// it (dev mode: userspace proxies on 127.0.0.1, no nftables, no eBPF, no root
/// needed); which data plane a production node runs is [`DataplaneRequest`]'s and
/// preflight's business, not this.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A real node: eBPF, nftables or VIP proxies, as preflight decides.
    #[default]
    Production,
    /// A laptop: everything on loopback, nothing that needs privileges.
    Dev,
}

impl Mode {
    /// The lower-case name used in flags, config files, logs and `status`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Production => "production",
            Mode::Dev => "dev",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A mode name that is neither `production` nor `dev`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown mode {value:?}: expected \"production\" or \"dev\"")]
pub struct ParseModeError {
    /// The rejected input.
    pub value: String,
}

impl FromStr for Mode {
    type Err = ParseModeError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value {
            "production" => Ok(Mode::Production),
            "dev" => Ok(Mode::Dev),
            _ => Err(ParseModeError {
                value: value.to_owned(),
            }),
        }
    }
}

/// Everything `rune-agent run` needs, resolved and checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Where identity, store and socket live.
    pub state_dir: PathBuf,
    /// Production, or dev (`--dev`, `dev: true`): userspace proxies on 127.0.0.1, no
    /// root, no kernel changes.
    pub mode: Mode,
    /// Dev mode: added to every service port (e.g. to avoid privileged ports).
    pub dev_port_offset: u16,
    /// Address of the `/metrics`, `/healthz`, `/readyz` listener.
    pub metrics_addr: SocketAddr,
    /// How long `start` waits for every subsystem to report ready.
    pub ready_timeout: Duration,
    /// Capacity of the outbox.
    pub outbox_capacity: usize,
    /// Maglev table size per service (a prime).
    pub maglev_table_size: u32,
    /// UDP flows keep their backend until idle this long.
    pub udp_idle_timeout: Duration,
    /// Ordered-log events kept for watchers before compaction.
    pub log_history: u64,
    /// Where the embedded DNS server listens (UDP and TCP on each).
    pub dns_addrs: Vec<SocketAddr>,
    /// The zone the DNS server is authoritative for: lower case, with a trailing dot.
    pub dns_domain: String,
    /// TTL of every DNS answer (and of negative answers), in seconds.
    pub dns_ttl_seconds: u32,
    /// Upstream resolvers for names outside the zone; empty: those of
    /// [`Config::dns_resolv_conf`].
    pub dns_upstreams: Vec<SocketAddr>,
    /// The resolv.conf read for upstreams when none are configured.
    pub dns_resolv_conf: PathBuf,
    /// How long one forwarded question may take, retry included.
    pub dns_upstream_timeout: Duration,
    /// How many forwarded answers are cached (0: none).
    pub dns_cache_size: usize,
    /// The production data plane asked for.
    pub dataplane: DataplaneRequest,
    /// bpffs directory for the eBPF maps' and links' pins.
    pub bpf_pin_dir: PathBuf,
    /// cgroup v2 directory for the socket-LB hooks: `None` the cgroup v2 root,
    /// `Some(None)` socket LB off (`--cgroup none`).
    pub cgroup: Option<Option<PathBuf>>,
    /// Interfaces for the tc programs: `None` those of the default routes.
    pub interfaces: Option<Vec<String>>,
    /// Interfaces for the XDP program (none by default).
    pub xdp_interfaces: Vec<String>,
    /// Capacity of the eBPF frontend maps (and Maglev tables).
    pub lb_max_frontends: u32,
    /// Capacity of the eBPF backend map.
    pub lb_max_backends: u32,
    /// Capacity of the eBPF conntrack maps, per family.
    pub lb_max_flows: u32,
    /// nftables mode: leave table `inet rune` in the kernel on stop.
    pub keep_rules_on_stop: bool,
}

/// The config file's shape; every field optional. Unknown keys are errors.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FileConfig {
    /// See [`Config::state_dir`].
    pub state_dir: Option<PathBuf>,
    /// See [`Config::mode`]: `true` for dev mode.
    pub dev: Option<bool>,
    /// See [`Config::dev_port_offset`].
    pub dev_port_offset: Option<u16>,
    /// See [`Config::metrics_addr`].
    pub metrics_addr: Option<String>,
    /// See [`Config::ready_timeout`], in seconds.
    pub ready_timeout_seconds: Option<u64>,
    /// See [`Config::outbox_capacity`].
    pub outbox_capacity: Option<usize>,
    /// See [`Config::maglev_table_size`].
    pub maglev_table_size: Option<u32>,
    /// See [`Config::udp_idle_timeout`], in seconds.
    pub udp_idle_timeout_seconds: Option<u64>,
    /// See [`Config::log_history`].
    pub log_history: Option<u64>,
    /// See [`Config::dns_addrs`]; empty or absent means the mode's default.
    pub dns_addrs: Option<Vec<String>>,
    /// See [`Config::dns_domain`].
    pub dns_domain: Option<String>,
    /// See [`Config::dns_ttl_seconds`].
    pub dns_ttl_seconds: Option<u32>,
    /// See [`Config::dns_upstreams`]: `ADDR` or `ADDR:PORT` each.
    pub dns_upstreams: Option<Vec<String>>,
    /// See [`Config::dns_resolv_conf`].
    pub dns_resolv_conf: Option<PathBuf>,
    /// See [`Config::dns_upstream_timeout`], in milliseconds.
    pub dns_upstream_timeout_ms: Option<u64>,
    /// See [`Config::dns_cache_size`].
    pub dns_cache_size: Option<usize>,
    /// See [`Config::dataplane`].
    pub dataplane: Option<DataplaneRequest>,
    /// See [`Config::bpf_pin_dir`].
    pub bpf_pin_dir: Option<PathBuf>,
    /// See [`Config::cgroup`]; `none` turns socket LB off.
    pub cgroup: Option<String>,
    /// See [`Config::interfaces`]; an empty list means none.
    pub interfaces: Option<Vec<String>>,
    /// See [`Config::xdp_interfaces`].
    pub xdp_interfaces: Option<Vec<String>>,
    /// See [`Config::keep_rules_on_stop`].
    pub keep_rules_on_stop: Option<bool>,
    /// See [`Config::lb_max_frontends`].
    pub lb_max_frontends: Option<u32>,
    /// See [`Config::lb_max_backends`].
    pub lb_max_backends: Option<u32>,
    /// See [`Config::lb_max_flows`].
    pub lb_max_flows: Option<u32>,
}

/// Why the settings were refused.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The config file is not valid.
    #[error("config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A setting has a value the agent cannot use.
    #[error("setting {setting}: {message}")]
    Invalid {
        /// The setting's flag name, e.g. `--metrics-addr`.
        setting: &'static str,
        /// What is wrong, with the value.
        message: String,
    },
}

impl FileConfig {
    /// Reads a YAML config file.
    pub fn load(path: &Path) -> Result<FileConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        if text.trim().is_empty() {
            return Ok(FileConfig::default());
        }
        serde_yaml_ng::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// Fills every unset field from `over` (flags and env win over the file).
    pub fn overridden_by(self, over: FileConfig) -> FileConfig {
        FileConfig {
            state_dir: over.state_dir.or(self.state_dir),
            dev: over.dev.or(self.dev),
            dev_port_offset: over.dev_port_offset.or(self.dev_port_offset),
            metrics_addr: over.metrics_addr.or(self.metrics_addr),
            ready_timeout_seconds: over.ready_timeout_seconds.or(self.ready_timeout_seconds),
            outbox_capacity: over.outbox_capacity.or(self.outbox_capacity),
            maglev_table_size: over.maglev_table_size.or(self.maglev_table_size),
            udp_idle_timeout_seconds: over
                .udp_idle_timeout_seconds
                .or(self.udp_idle_timeout_seconds),
            log_history: over.log_history.or(self.log_history),
            dns_addrs: over.dns_addrs.or(self.dns_addrs),
            dns_domain: over.dns_domain.or(self.dns_domain),
            dns_ttl_seconds: over.dns_ttl_seconds.or(self.dns_ttl_seconds),
            dns_upstreams: over.dns_upstreams.or(self.dns_upstreams),
            dns_resolv_conf: over.dns_resolv_conf.or(self.dns_resolv_conf),
            dns_upstream_timeout_ms: over
                .dns_upstream_timeout_ms
                .or(self.dns_upstream_timeout_ms),
            dns_cache_size: over.dns_cache_size.or(self.dns_cache_size),
            dataplane: over.dataplane.or(self.dataplane),
            bpf_pin_dir: over.bpf_pin_dir.or(self.bpf_pin_dir),
            cgroup: over.cgroup.or(self.cgroup),
            interfaces: over.interfaces.or(self.interfaces),
            xdp_interfaces: over.xdp_interfaces.or(self.xdp_interfaces),
            lb_max_frontends: over.lb_max_frontends.or(self.lb_max_frontends),
            lb_max_backends: over.lb_max_backends.or(self.lb_max_backends),
            lb_max_flows: over.lb_max_flows.or(self.lb_max_flows),
            keep_rules_on_stop: over.keep_rules_on_stop.or(self.keep_rules_on_stop),
        }
    }

    /// Applies defaults and checks every value.
    pub fn resolve(self) -> Result<Config, ConfigError> {
        let metrics_addr = self.metrics_addr.as_deref().unwrap_or(DEFAULT_METRICS_ADDR);
        let metrics_addr = metrics_addr.parse().map_err(|_| ConfigError::Invalid {
            setting: "--metrics-addr",
            message: format!("{metrics_addr:?} is not an address:port"),
        })?;
        let ready_timeout = self.ready_timeout_seconds.unwrap_or(30);
        if ready_timeout == 0 {
            return Err(ConfigError::Invalid {
                setting: "--ready-timeout-seconds",
                message: "must be at least 1".into(),
            });
        }
        let outbox_capacity = self.outbox_capacity.unwrap_or(DEFAULT_OUTBOX_CAPACITY);
        if outbox_capacity == 0 {
            return Err(ConfigError::Invalid {
                setting: "--outbox-capacity",
                message: "must be at least 1".into(),
            });
        }
        let maglev_table_size = self.maglev_table_size.unwrap_or(16381);
        if !(101..=crate::maglev::MAX_TABLE_SIZE).contains(&maglev_table_size)
            || !crate::maglev::is_prime(maglev_table_size)
        {
            return Err(ConfigError::Invalid {
                setting: "--maglev-table-size",
                message: format!(
                    "{maglev_table_size} is not a prime from 101 to {}",
                    crate::maglev::MAX_TABLE_SIZE
                ),
            });
        }
        let udp_idle = self.udp_idle_timeout_seconds.unwrap_or(60);
        if !(1..=MAX_UDP_IDLE_SECONDS).contains(&udp_idle) {
            return Err(ConfigError::Invalid {
                setting: "--udp-idle-timeout-seconds",
                message: format!("{udp_idle} is out of range 1-{MAX_UDP_IDLE_SECONDS}"),
            });
        }
        let log_history = self.log_history.unwrap_or(10_000);
        if log_history == 0 {
            return Err(ConfigError::Invalid {
                setting: "--log-history",
                message: "must be at least 1".into(),
            });
        }
        let mode = if self.dev.unwrap_or(false) {
            Mode::Dev
        } else {
            Mode::Production
        };
        let dns_addrs = resolve_dns_addrs(self.dns_addrs, mode)?;
        let dns_domain = resolve_dns_domain(self.dns_domain.as_deref())?;
        let dns_ttl_seconds = self.dns_ttl_seconds.unwrap_or(DEFAULT_DNS_TTL_SECONDS);
        if dns_ttl_seconds > MAX_DNS_TTL_SECONDS {
            return Err(ConfigError::Invalid {
                setting: "--dns-ttl-seconds",
                message: format!("{dns_ttl_seconds} is out of range 0-{MAX_DNS_TTL_SECONDS}"),
            });
        }
        let dns_upstreams = resolve_dns_upstreams(self.dns_upstreams.unwrap_or_default())?;
        let upstream_timeout = self
            .dns_upstream_timeout_ms
            .unwrap_or(DEFAULT_DNS_UPSTREAM_TIMEOUT_MS);
        if !(1..=MAX_DNS_UPSTREAM_TIMEOUT_MS).contains(&upstream_timeout) {
            return Err(ConfigError::Invalid {
                setting: "--dns-upstream-timeout-ms",
                message: format!(
                    "{upstream_timeout} is out of range 1-{MAX_DNS_UPSTREAM_TIMEOUT_MS}"
                ),
            });
        }
        let dns_cache_size = self.dns_cache_size.unwrap_or(DEFAULT_DNS_CACHE_SIZE);
        if dns_cache_size > MAX_DNS_CACHE_SIZE {
            return Err(ConfigError::Invalid {
                setting: "--dns-cache-size",
                message: format!("{dns_cache_size} is out of range 0-{MAX_DNS_CACHE_SIZE}"),
            });
        }
        let lb_max_frontends = self.lb_max_frontends.unwrap_or(DEFAULT_LB_MAX_FRONTENDS);
        let lb_max_backends = self.lb_max_backends.unwrap_or(DEFAULT_LB_MAX_BACKENDS);
        let lb_max_flows = self.lb_max_flows.unwrap_or(DEFAULT_LB_MAX_FLOWS);
        for (setting, value, max) in [
            ("--lb-max-frontends", lb_max_frontends, 1 << 20),
            ("--lb-max-backends", lb_max_backends, 1 << 24),
            ("--lb-max-flows", lb_max_flows, 1 << 26),
        ] {
            if !(2..=max).contains(&value) {
                return Err(ConfigError::Invalid {
                    setting,
                    message: format!("{value} is out of range 2-{max}"),
                });
            }
        }
        if u64::from(lb_max_frontends) * u64::from(maglev_table_size) > u64::from(u32::MAX / 4) {
            return Err(ConfigError::Invalid {
                setting: "--lb-max-frontends",
                message: format!(
                    "{lb_max_frontends} frontends × {maglev_table_size} Maglev slots do not fit one map"
                ),
            });
        }
        let names = |list: Vec<String>| -> Vec<String> {
            list.iter()
                .flat_map(|s| s.split(','))
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()
        };
        let cgroup = self.cgroup.map(|c| match c.trim() {
            "none" | "" => None,
            path => Some(PathBuf::from(path)),
        });
        Ok(Config {
            dataplane: self.dataplane.unwrap_or_default(),
            bpf_pin_dir: self
                .bpf_pin_dir
                .unwrap_or_else(|| PathBuf::from(DEFAULT_BPF_PIN_DIR)),
            cgroup,
            interfaces: self.interfaces.map(names),
            xdp_interfaces: self.xdp_interfaces.map(names).unwrap_or_default(),
            lb_max_frontends,
            lb_max_backends,
            lb_max_flows,
            keep_rules_on_stop: self.keep_rules_on_stop.unwrap_or(false),
            state_dir: self.state_dir.unwrap_or_else(default_state_dir),
            mode,
            dev_port_offset: self.dev_port_offset.unwrap_or(0),
            metrics_addr,
            ready_timeout: Duration::from_secs(ready_timeout),
            outbox_capacity,
            maglev_table_size,
            udp_idle_timeout: Duration::from_secs(udp_idle),
            log_history,
            dns_addrs,
            dns_domain,
            dns_ttl_seconds,
            dns_upstreams,
            dns_resolv_conf: self
                .dns_resolv_conf
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DNS_RESOLV_CONF)),
            dns_upstream_timeout: Duration::from_millis(upstream_timeout),
            dns_cache_size,
        })
    }
}

/// Upstream resolvers as socket addresses: `ADDR` means port 53; IPv6 with a port
/// is written `[ADDR]:PORT`.
fn resolve_dns_upstreams(upstreams: Vec<String>) -> Result<Vec<SocketAddr>, ConfigError> {
    let mut out: Vec<SocketAddr> = Vec::with_capacity(upstreams.len());
    for raw in &upstreams {
        let text = raw.trim();
        let addr = text
            .parse::<SocketAddr>()
            .ok()
            .or_else(|| {
                text.parse::<std::net::IpAddr>()
                    .ok()
                    .map(|ip| SocketAddr::new(ip, 53))
            })
            .filter(|a| a.port() != 0 && !a.ip().is_unspecified())
            .ok_or_else(|| ConfigError::Invalid {
                setting: "--dns-upstream",
                message: format!("{raw:?} is not an ADDR or ADDR:PORT"),
            })?;
        if !out.contains(&addr) {
            out.push(addr);
        }
    }
    Ok(out)
}

/// The DNS listen addresses, or the mode's default when none are given.
fn resolve_dns_addrs(
    addrs: Option<Vec<String>>,
    mode: Mode,
) -> Result<Vec<SocketAddr>, ConfigError> {
    let addrs = addrs.filter(|a| !a.is_empty()).unwrap_or_else(|| {
        vec![
            match mode {
                Mode::Dev => DEFAULT_DEV_DNS_ADDR,
                Mode::Production => DEFAULT_DNS_ADDR,
            }
            .to_owned(),
        ]
    });
    let mut out: Vec<SocketAddr> = Vec::with_capacity(addrs.len());
    for a in &addrs {
        let addr: SocketAddr = a.parse().map_err(|_| ConfigError::Invalid {
            setting: "--dns-addr",
            message: format!("{a:?} is not an address:port"),
        })?;
        if !out.contains(&addr) {
            out.push(addr);
        }
    }
    Ok(out)
}

/// The DNS zone as a lower-case absolute name (`rune.`), checked to be a valid,
/// non-root domain name.
fn resolve_dns_domain(domain: Option<&str>) -> Result<String, ConfigError> {
    let raw = domain.unwrap_or(DEFAULT_DNS_DOMAIN);
    let mut domain = raw.trim().to_ascii_lowercase();
    if !domain.ends_with('.') {
        domain.push('.');
    }
    let valid = domain.len() > 1
        && domain.len() <= 200
        && domain[..domain.len() - 1].split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if !valid {
        return Err(ConfigError::Invalid {
            setting: "--dns-domain",
            message: format!(
                "{raw:?} is not a domain name (e.g. \"rune\" or \"cluster.example.\")"
            ),
        });
    }
    Ok(domain)
}

/// `/var/lib/rune` as root; `$XDG_STATE_HOME/rune` (or `~/.local/state/rune`)
/// otherwise, so a laptop user needs no root.
pub fn default_state_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if root {
        return PathBuf::from("/var/lib/rune");
    }
    if let Some(x) = std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("rune");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".local/state/rune")
}

#[cfg(test)]
mod tests;
