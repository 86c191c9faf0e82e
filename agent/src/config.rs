//! The agent's settings: defaults, then a YAML config file, then `RUNE_*` environment
//! variables and command-line flags (flags and env override the file). The kinds
//! of mode they name are in `config/modes.rs`.
//!
//! Each setting is declared once, below (`settings!`, in [`layers`]): its flag and
//! variable, its config-file key, and how it resolves into [`Config`]. The groups of
//! flags ([`GlobalSettings`], [`RunSettings`], …) are flattened into the commands
//! that take them; each command's flags and variables make one [`FileConfig`] layer,
//! laid over the file's.
//!
//! Everything is checked here, before anything is bound or started, so a bad setting
//! stops the agent with a usage error instead of half-starting it.

mod etcd;
mod layers;
mod modes;
pub mod recorded;
mod resolve;

pub use modes::{DataplaneMode, DataplaneRequest, Mode, ParseModeError};

use layers::settings;
use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
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

/// Default `--ingress-acme-directory`: Let's Encrypt's production server.
pub const DEFAULT_ACME_DIRECTORY: &str = "https://acme-v02.api.letsencrypt.org/directory";

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

/// Default `--policy-max-entries`: peer prefixes per family and port entries the
/// eBPF network policy maps hold.
pub const DEFAULT_POLICY_MAX_ENTRIES: u32 = 16_384;
/// NFLOG group of the nftables policy's log rules (groups are per network
/// namespace; an unusual number keeps clear of hand-written `log group` rules).
pub const DEFAULT_NFT_POLICY_LOG_GROUP: u16 = 6108;

// The settings, each declared once (see `settings!` in layers.rs):
//
//     /// The --help text [default: …].
//     #[arg(long = "flag", env = "RUNE_FLAG", …)]
//     file_key: FlagAndFileType => config_field: ConfigType = resolver,
//
// The file key is the field's name in camelCase; the resolver turns the value, if
// any, into the `Config` field (its default, its checks) and may read the fields
// resolved above it. Adding a setting: docs/configuration.md.
settings! {
    /// The settings every command takes (global flags).
    pub struct GlobalSettings {
        /// Where identity, store and socket live [default: /var/lib/rune as root,
        /// $XDG_STATE_HOME/rune otherwise].
        #[arg(long = "state-dir", env = "RUNE_STATE_DIR", global = true, value_name = "DIR")]
        state_dir: PathBuf => state_dir: PathBuf = |dir: Option<PathBuf>| {
            Ok(dir.unwrap_or_else(default_state_dir))
        },
    }

    /// The settings only `run` takes: mode, listeners, capacities, DNS.
    pub struct RunSettings {
        /// Dev mode: userspace proxies on 127.0.0.1, no root needed, no kernel changes.
        // A switch: `--dev` sets true, `RUNE_DEV` true or false, absent sets nothing.
        #[arg(long = "dev", env = "RUNE_DEV", num_args = 0, default_missing_value = "true")]
        dev: bool => mode: Mode = |dev| {
            Ok(if dev == Some(true) { Mode::Dev } else { Mode::Production })
        },
        /// Dev mode: add N to every service port (e.g. 10000 to avoid privileged ports).
        #[arg(long = "dev-port-offset", env = "RUNE_DEV_PORT_OFFSET", value_name = "N")]
        dev_port_offset: u16 => dev_port_offset: u16 = |n| resolve::or(n, 0),
        /// Address of the /metrics, /healthz and /readyz listener [default: 127.0.0.1:9464].
        #[arg(long = "metrics-addr", env = "RUNE_METRICS_ADDR", value_name = "ADDR:PORT")]
        metrics_addr: String => metrics_addr: SocketAddr = |addr| {
            resolve::socket_addr(addr, DEFAULT_METRICS_ADDR)
        },
        /// Seconds `run` waits for every subsystem to be ready [default: 30].
        #[arg(
            long = "ready-timeout-seconds", env = "RUNE_READY_TIMEOUT_SECONDS", value_name = "S"
        )]
        ready_timeout_seconds: u64 => ready_timeout: Duration = |s| {
            resolve::at_least_1(s, 30).map(Duration::from_secs)
        },
        /// Seconds of this node's lease in etcd: its node key outlives a dead agent by
        /// at most this long; keep-alives go every third of it [default: 30].
        #[arg(long = "node-lease-seconds", env = "RUNE_NODE_LEASE_SECONDS", value_name = "S")]
        node_lease_seconds: u64 => node_lease: Duration = |s: Option<u64>| {
            match s {
                Some(s) if s < 3 => Err(format!("{s} is below 3 seconds")),
                s => Ok(Duration::from_secs(s.unwrap_or(30))),
            }
        },
        /// Outbox capacity [default: 4096].
        #[arg(long = "outbox-capacity", env = "RUNE_OUTBOX_CAPACITY", value_name = "N")]
        outbox_capacity: usize => outbox_capacity: usize = |n| {
            resolve::at_least_1(n, DEFAULT_OUTBOX_CAPACITY)
        },
        /// Maglev table size per service, a prime [default: 16381].
        #[arg(long = "maglev-table-size", env = "RUNE_MAGLEV_TABLE_SIZE", value_name = "PRIME")]
        maglev_table_size: u32 => maglev_table_size: u32 = |n| {
            resolve::maglev_table_size(n, 16381)
        },
        /// Seconds an idle UDP flow keeps its backend [default: 60].
        #[arg(
            long = "udp-idle-timeout-seconds", env = "RUNE_UDP_IDLE_TIMEOUT_SECONDS",
            value_name = "S"
        )]
        udp_idle_timeout_seconds: u64 => udp_idle_timeout: Duration = |s| {
            resolve::in_range(s, 60, 1..=MAX_UDP_IDLE_SECONDS).map(Duration::from_secs)
        },
        /// Ordered-log events kept for watchers before compaction [default: 10000].
        #[arg(long = "log-history", env = "RUNE_LOG_HISTORY", value_name = "N")]
        log_history: u64 => log_history: u64 = |n| resolve::at_least_1(n, 10_000),
        /// Where the embedded DNS server listens, UDP and TCP; repeatable
        /// [default: 127.0.0.123:53; with --dev 127.0.0.1:15353].
        #[arg(
            long = "dns-addr", env = "RUNE_DNS_ADDR", value_name = "ADDR:PORT",
            value_delimiter = ','
        )]
        dns_addrs: Vec<String> => dns_addrs: Vec<SocketAddr> = |addrs| {
            resolve::dns_addrs(addrs, mode)
        },
        /// The DNS zone answered for services, `<service>.<namespace>.<domain>` [default: rune].
        #[arg(long = "dns-domain", env = "RUNE_DNS_DOMAIN", value_name = "DOMAIN")]
        dns_domain: String => dns_domain: String = resolve::dns_domain,
        /// TTL of DNS answers, in seconds [default: 5].
        #[arg(long = "dns-ttl-seconds", env = "RUNE_DNS_TTL_SECONDS", value_name = "S")]
        dns_ttl_seconds: u32 => dns_ttl_seconds: u32 = |s| {
            resolve::in_range(s, DEFAULT_DNS_TTL_SECONDS, 0..=MAX_DNS_TTL_SECONDS)
        },
        /// Upstream resolver for names outside the DNS zone, ADDR or ADDR:PORT; repeatable
        /// [default: the nameservers of --dns-resolv-conf, minus the agent's own].
        #[arg(
            long = "dns-upstream", env = "RUNE_DNS_UPSTREAM", value_name = "ADDR[:PORT]",
            value_delimiter = ','
        )]
        dns_upstreams: Vec<String> => dns_upstreams: Vec<SocketAddr> = resolve::dns_upstreams,
        /// Where upstream resolvers are read when none are given [default: /etc/resolv.conf].
        #[arg(long = "dns-resolv-conf", env = "RUNE_DNS_RESOLV_CONF", value_name = "PATH")]
        dns_resolv_conf: PathBuf => dns_resolv_conf: PathBuf = |path| {
            resolve::or(path, PathBuf::from(DEFAULT_DNS_RESOLV_CONF))
        },
        /// How long one forwarded DNS question may take, retry included [default: 2000].
        #[arg(
            long = "dns-upstream-timeout-ms", env = "RUNE_DNS_UPSTREAM_TIMEOUT_MS",
            value_name = "MS"
        )]
        dns_upstream_timeout_ms: u64 => dns_upstream_timeout: Duration = |ms| {
            let range = 1..=MAX_DNS_UPSTREAM_TIMEOUT_MS;
            resolve::in_range(ms, DEFAULT_DNS_UPSTREAM_TIMEOUT_MS, range).map(Duration::from_millis)
        },
        /// Forwarded DNS answers kept in the cache, 0 for none [default: 10000].
        #[arg(long = "dns-cache-size", env = "RUNE_DNS_CACHE_SIZE", value_name = "N")]
        dns_cache_size: usize => dns_cache_size: usize = |n| {
            resolve::in_range(n, DEFAULT_DNS_CACHE_SIZE, 0..=MAX_DNS_CACHE_SIZE)
        },
        /// Run the ingress HTTP(S) proxy for services with `spec.expose` (docs/ingress.md).
        #[arg(long = "ingress", env = "RUNE_INGRESS", num_args = 0, default_missing_value = "true")]
        ingress: bool => ingress: bool = |on| resolve::or(on, false),
        /// The ingress proxy's plain-HTTP listener [default: 0.0.0.0:80; with --dev
        /// 127.0.0.1:8080 plus --dev-port-offset].
        #[arg(long = "ingress-addr", env = "RUNE_INGRESS_ADDR", value_name = "ADDR:PORT")]
        ingress_addr: String => ingress_addr: SocketAddr = |addr| {
            resolve::listen_addr(addr, mode, dev_port_offset, ingress, ("0.0.0.0:80", 8080))
        },
        /// The ingress proxy's TLS listener [default: 0.0.0.0:443; with --dev
        /// 127.0.0.1:8443 plus --dev-port-offset].
        #[arg(long = "ingress-tls-addr", env = "RUNE_INGRESS_TLS_ADDR", value_name = "ADDR:PORT")]
        ingress_tls_addr: String => ingress_tls_addr: SocketAddr = |addr| {
            resolve::listen_addr(addr, mode, dev_port_offset, ingress, ("0.0.0.0:443", 8443))
        },
        /// The Secret (NAME in `default`, or NAMESPACE/NAME) whose certificate the
        /// ingress proxy serves for names no route has [default: none: refused].
        #[arg(long = "ingress-default-cert", env = "RUNE_INGRESS_DEFAULT_CERT", value_name = "SECRET")]
        ingress_default_cert: String => ingress_default_cert: Option<crate::model::ServiceKey> = |r| {
            resolve::secret_ref(r)
        },
        /// Peers whose X-Forwarded-For the ingress proxy appends to instead of replacing,
        /// CIDRs, comma-separated [default: none].
        #[arg(
            long = "ingress-trusted-proxies", env = "RUNE_INGRESS_TRUSTED_PROXIES",
            value_name = "CIDR,CIDR", value_delimiter = ','
        )]
        ingress_trusted_proxies: Vec<String> => ingress_trusted_proxies: Vec<ipnet::IpNet> = |l: Option<Vec<String>>| {
            resolve::cidrs(l.unwrap_or_default())
        },
        /// Milliseconds a client has to send a request's headers (and a TLS handshake)
        /// [default: 10000].
        #[arg(
            long = "ingress-header-timeout-ms", env = "RUNE_INGRESS_HEADER_TIMEOUT_MS",
            value_name = "MS"
        )]
        ingress_header_timeout_ms: u64 => ingress_header_timeout: Duration = |ms| {
            resolve::in_range(ms, 10_000, 100..=600_000).map(Duration::from_millis)
        },
        /// Seconds an idle keep-alive client connection is kept open [default: 60].
        #[arg(
            long = "ingress-idle-timeout-seconds", env = "RUNE_INGRESS_IDLE_TIMEOUT_SECONDS",
            value_name = "S"
        )]
        ingress_idle_timeout_seconds: u64 => ingress_idle_timeout: Duration = |s| {
            resolve::in_range(s, 60, 1..=3600).map(Duration::from_secs)
        },
        /// Milliseconds to connect to an upstream endpoint [default: 3000].
        #[arg(
            long = "ingress-connect-timeout-ms", env = "RUNE_INGRESS_CONNECT_TIMEOUT_MS",
            value_name = "MS"
        )]
        ingress_connect_timeout_ms: u64 => ingress_connect_timeout: Duration = |ms| {
            resolve::in_range(ms, 3000, 10..=60_000).map(Duration::from_millis)
        },
        /// Milliseconds an upstream has to send its response headers, else 504, and
        /// then each piece of an HTTP/1.1 response body, else the response is cut
        /// [default: 60000].
        #[arg(
            long = "ingress-response-timeout-ms", env = "RUNE_INGRESS_RESPONSE_TIMEOUT_MS",
            value_name = "MS"
        )]
        ingress_response_timeout_ms: u64 => ingress_response_timeout: Duration = |ms| {
            resolve::in_range(ms, 60_000, 10..=3_600_000).map(Duration::from_millis)
        },
        /// Largest request head (line and headers) in bytes, else 431 [default: 65536].
        #[arg(
            long = "ingress-max-header-bytes", env = "RUNE_INGRESS_MAX_HEADER_BYTES",
            value_name = "BYTES"
        )]
        ingress_max_header_bytes: usize => ingress_max_header_bytes: usize = |n| {
            resolve::in_range(n, 65_536, 8192..=1 << 20)
        },
        /// Largest request body in bytes (announced or streamed), else 413
        /// [default: 67108864].
        #[arg(
            long = "ingress-max-body-bytes", env = "RUNE_INGRESS_MAX_BODY_BYTES",
            value_name = "BYTES"
        )]
        ingress_max_body_bytes: u64 => ingress_max_body_bytes: u64 = |n| {
            resolve::at_least_1(n, 64 << 20)
        },
        /// Most client connections the ingress proxy keeps open, both listeners
        /// together; at the cap, idle keep-alive connections are closed to make room
        /// [default: 16384].
        #[arg(
            long = "ingress-max-connections", env = "RUNE_INGRESS_MAX_CONNECTIONS",
            value_name = "N"
        )]
        ingress_max_connections: usize => ingress_max_connections: usize = |n| {
            resolve::in_range(n, 16_384, 1..=1 << 20)
        },
        /// Threads serving ingress clients, each with its own listeners (sharing the
        /// port) and upstream connections [default: the available CPUs].
        #[arg(long = "ingress-workers", env = "RUNE_INGRESS_WORKERS", value_name = "N")]
        ingress_workers: usize => ingress_workers: usize = |n| {
            resolve::in_range(n, resolve::cpus(), 1..=1024)
        },
        /// Threads doing the ingress proxy's TLS handshakes, apart from the workers so
        /// a flood of new TLS clients does not slow the clients already served;
        /// 0 does each handshake on the worker that accepted the connection
        /// [default: the available CPUs].
        #[arg(
            long = "ingress-handshake-threads", env = "RUNE_INGRESS_HANDSHAKE_THREADS",
            value_name = "N"
        )]
        ingress_handshake_threads: usize => ingress_handshake_threads: usize = |n| {
            resolve::in_range(n, resolve::cpus(), 0..=1024)
        },
        /// Serve every ingress request with hyper, without the HTTP/1.1 fast path
        /// (docs/ingress.md): a fallback should the fast path misbehave.
        #[arg(
            long = "ingress-no-fast-path", env = "RUNE_INGRESS_NO_FAST_PATH", num_args = 0,
            default_missing_value = "true"
        )]
        ingress_no_fast_path: bool => ingress_no_fast_path: bool = |off| resolve::or(off, false),
        /// The share of requests the ingress proxy writes an access-log line for
        /// (target `rune::ingress::access`), 0 (none) to 1 (every request) [default: 1].
        #[arg(
            long = "ingress-access-log-sample", env = "RUNE_INGRESS_ACCESS_LOG_SAMPLE",
            value_name = "RATE"
        )]
        ingress_access_log_sample: f64 => ingress_access_log_sample: f64 = |r| {
            resolve::in_range(r, 1.0, 0.0..=1.0)
        },
        /// The ACME server's directory URL for routes with `tls.mode: acme`
        /// [default: https://acme-v02.api.letsencrypt.org/directory].
        #[arg(long = "ingress-acme-directory", env = "RUNE_INGRESS_ACME_DIRECTORY", value_name = "URL")]
        ingress_acme_directory: String => ingress_acme_directory: String = |url: Option<String>| {
            let url = url.unwrap_or_else(|| DEFAULT_ACME_DIRECTORY.to_owned());
            if url.starts_with("https://") {
                Ok(url)
            } else {
                Err(format!("{url:?} is not an https:// URL"))
            }
        },
        /// The contact e-mail of the ACME account [default: none].
        #[arg(long = "ingress-acme-email", env = "RUNE_INGRESS_ACME_EMAIL", value_name = "EMAIL")]
        ingress_acme_email: String => ingress_acme_email: Option<String> = Ok,
        /// PEM certificates trusted for the ACME server's HTTPS, instead of the system's
        /// roots [default: the system's roots].
        #[arg(long = "ingress-acme-ca-bundle", env = "RUNE_INGRESS_ACME_CA_BUNDLE", value_name = "PATH")]
        ingress_acme_ca_bundle: PathBuf => ingress_acme_ca_bundle: Option<PathBuf> = Ok,
        /// Seconds before expiry an ACME certificate is renewed (at most half its
        /// lifetime) [default: 2592000, 30 days].
        #[arg(
            long = "ingress-acme-renew-before-seconds", env = "RUNE_INGRESS_ACME_RENEW_BEFORE_SECONDS",
            value_name = "S"
        )]
        ingress_acme_renew_before_seconds: u64 => ingress_acme_renew_before: Duration = |s| {
            resolve::in_range(s, 30 * 86_400, 1..=365 * 86_400).map(Duration::from_secs)
        },
        /// Seconds before a failed ACME order is tried again; each further failure
        /// doubles the wait, up to an hour [default: 60].
        #[arg(
            long = "ingress-acme-retry-seconds", env = "RUNE_INGRESS_ACME_RETRY_SECONDS",
            value_name = "S"
        )]
        ingress_acme_retry_seconds: u64 => ingress_acme_retry: Duration = |s| {
            resolve::in_range(s, 60, 1..=3600).map(Duration::from_secs)
        },
    }

    /// The data plane asked for and the cgroup of its socket-LB hooks: `run` and
    /// `preflight` take them.
    pub struct DataplaneSettings {
        /// Production data plane: auto (preflight picks ebpf, else nftables, else
        /// userspace), or one of them forced (the start fails when its checks fail)
        /// [default: auto].
        #[arg(long = "dataplane", env = "RUNE_DATAPLANE", value_enum)]
        dataplane: DataplaneRequest => dataplane: DataplaneRequest = |request| {
            resolve::or(request, DataplaneRequest::Auto)
        },
        /// cgroup v2 directory for the socket-LB hooks, or `none` [default: the cgroup v2 root].
        #[arg(long = "cgroup", env = "RUNE_CGROUP", value_name = "PATH")]
        cgroup: String => cgroup: Option<Option<PathBuf>> = resolve::cgroup,
    }

    /// Where the eBPF pins are: `run` and `cleanup` take it.
    pub struct PinSettings {
        /// bpffs directory for the eBPF pins [default: /sys/fs/bpf/rune].
        #[arg(long = "bpf-pin-dir", env = "RUNE_BPF_PIN_DIR", value_name = "DIR")]
        bpf_pin_dir: PathBuf => bpf_pin_dir: PathBuf = |dir| {
            resolve::or(dir, PathBuf::from(DEFAULT_BPF_PIN_DIR))
        },
    }

    /// How the production data plane uses the kernel: interfaces, eBPF map sizes,
    /// nftables rules on stop (`run`).
    pub struct KernelSettings {
        /// Interfaces for the tc programs, comma-separated; empty for none [default: those
        /// of the default routes].
        // One list per occurrence (`Set`): `--interfaces a,b`, not repeated.
        #[arg(
            long = "interfaces", env = "RUNE_INTERFACES", value_name = "A,B",
            value_delimiter = ',', action = clap::ArgAction::Set
        )]
        interfaces: Vec<String> => interfaces: Option<Vec<String>> = |list: Option<Vec<_>>| {
            Ok(list.map(resolve::names))
        },
        /// Interfaces for the XDP program, comma-separated [default: none].
        #[arg(
            long = "xdp-interfaces", env = "RUNE_XDP_INTERFACES", value_name = "A,B",
            value_delimiter = ',', action = clap::ArgAction::Set
        )]
        xdp_interfaces: Vec<String> => xdp_interfaces: Vec<String> = |list: Option<Vec<_>>| {
            Ok(list.map(resolve::names).unwrap_or_default())
        },
        /// Interfaces toward this node's endpoints for the eBPF network policy
        /// programs, comma-separated [default: none].
        #[arg(
            long = "policy-interfaces", env = "RUNE_POLICY_INTERFACES", value_name = "A,B",
            value_delimiter = ',', action = clap::ArgAction::Set
        )]
        policy_interfaces: Vec<String> => policy_interfaces: Vec<String> = |list: Option<Vec<_>>| {
            Ok(list.map(resolve::names).unwrap_or_default())
        },
        /// Peer prefixes (per family) and port entries the eBPF policy maps hold
        /// [default: 16384].
        #[arg(long = "policy-max-entries", env = "RUNE_POLICY_MAX_ENTRIES", value_name = "N")]
        policy_max_entries: u32 => policy_max_entries: u32 = |n| {
            resolve::in_range(n, DEFAULT_POLICY_MAX_ENTRIES, 1..=1 << 24)
        },
        /// Frontends (VIP × port × protocol) the eBPF maps hold [default: 512].
        #[arg(long = "lb-max-frontends", env = "RUNE_LB_MAX_FRONTENDS", value_name = "N")]
        lb_max_frontends: u32 => lb_max_frontends: u32 = |n| {
            resolve::in_range(n, DEFAULT_LB_MAX_FRONTENDS, 2..=1 << 20)
        },
        /// Backends the eBPF maps hold [default: 65536].
        #[arg(long = "lb-max-backends", env = "RUNE_LB_MAX_BACKENDS", value_name = "N")]
        lb_max_backends: u32 => lb_max_backends: u32 = |n| {
            resolve::in_range(n, DEFAULT_LB_MAX_BACKENDS, 2..=1 << 24)
        },
        /// Conntrack entries per family [default: 262144].
        #[arg(long = "lb-max-flows", env = "RUNE_LB_MAX_FLOWS", value_name = "N")]
        lb_max_flows: u32 => lb_max_flows: u32 = |n| {
            resolve::in_range(n, DEFAULT_LB_MAX_FLOWS, 2..=1 << 26)
        },
        /// nftables mode: most elements each network-policy set holds; more fail the
        /// policy closed [default: unbounded].
        #[arg(
            long = "nft-policy-set-size", env = "RUNE_NFT_POLICY_SET_SIZE", value_name = "N"
        )]
        nft_policy_set_size: u32 => nft_policy_set_size: Option<u32> = |n: Option<u32>| {
            n.map(|n| resolve::in_range(Some(n), n, 1..=1 << 24)).transpose()
        },
        /// nftables mode: NFLOG group the policy's refused (and audit would-drop)
        /// packets are logged to, read by the agent for `observe`; 0: not logged
        /// [default: 6108].
        #[arg(
            long = "nft-policy-log-group", env = "RUNE_NFT_POLICY_LOG_GROUP", value_name = "N"
        )]
        nft_policy_log_group: u16 => nft_policy_log_group: Option<u16> = |n| {
            resolve::or(n, DEFAULT_NFT_POLICY_LOG_GROUP).map(|n| (n != 0).then_some(n))
        },
        /// nftables mode: leave the table `inet rune` in the kernel on stop.
        #[arg(
            long = "keep-rules-on-stop", env = "RUNE_KEEP_RULES_ON_STOP", num_args = 0,
            default_missing_value = "true"
        )]
        keep_rules_on_stop: bool => keep_rules_on_stop: bool = |keep| resolve::or(keep, false),
    }

    /// Where the objects live when many nodes share them: an etcd cluster instead of
    /// the embedded store (`run`, `apply`, `get`, `delete`, `status` take them; see
    /// docs/etcd.md). Checked together by [`Config::etcd_options`].
    pub struct EtcdSettings {
        /// etcd client URLs, comma-separated (https://HOST:PORT; http:// only on
        /// loopback or with --etcd-insecure) [default: none: the embedded store].
        // One list per occurrence (`Set`), as --interfaces.
        #[arg(
            long = "etcd-endpoints", env = "RUNE_ETCD_ENDPOINTS", value_name = "URL,URL",
            value_delimiter = ',', action = clap::ArgAction::Set
        )]
        etcd_endpoints: Vec<String> => etcd_endpoints: Vec<String> = |list: Option<Vec<_>>| {
            Ok(list.map(resolve::names).unwrap_or_default())
        },
        /// PEM file of the CA that signed the etcd members' certificates (https://).
        #[arg(long = "etcd-ca", env = "RUNE_ETCD_CA", value_name = "FILE")]
        etcd_ca: PathBuf => etcd_ca: Option<PathBuf> = Ok,
        /// PEM file of this client's certificate for etcd (mutual TLS), with --etcd-key.
        #[arg(long = "etcd-cert", env = "RUNE_ETCD_CERT", value_name = "FILE")]
        etcd_cert: PathBuf => etcd_cert: Option<PathBuf> = Ok,
        /// PEM file of this client's private key for etcd, with --etcd-cert.
        #[arg(long = "etcd-key", env = "RUNE_ETCD_KEY", value_name = "FILE")]
        etcd_key: PathBuf => etcd_key: Option<PathBuf> = Ok,
        /// Allow plain http:// to etcd endpoints that are not loopback (objects cross
        /// the network unencrypted and unauthenticated).
        #[arg(
            long = "etcd-insecure", env = "RUNE_ETCD_INSECURE", num_args = 0,
            default_missing_value = "true"
        )]
        etcd_insecure: bool => etcd_insecure: bool = |insecure| resolve::or(insecure, false),
        /// The etcd key prefix the objects live under [default: /rune/v1/].
        #[arg(long = "etcd-prefix", env = "RUNE_ETCD_PREFIX", value_name = "PREFIX")]
        etcd_prefix: String => etcd_prefix: String = |prefix| {
            resolve::or(prefix, crate::orderedlog::etcd::DEFAULT_PREFIX.to_owned())
        },
        /// etcd's --max-txn-ops: a larger apply is refused before anything is written
        /// [default: 128].
        #[arg(long = "etcd-max-txn-ops", env = "RUNE_ETCD_MAX_TXN_OPS", value_name = "N")]
        etcd_max_txn_ops: usize => etcd_max_txn_ops: usize = |n| {
            resolve::at_least_1(n, crate::orderedlog::etcd::DEFAULT_MAX_TXN_OPS)
        },
        /// etcd's --max-request-bytes: a larger apply is refused before anything is
        /// written [default: 1572864].
        #[arg(
            long = "etcd-max-request-bytes", env = "RUNE_ETCD_MAX_REQUEST_BYTES",
            value_name = "BYTES"
        )]
        etcd_max_request_bytes: usize => etcd_max_request_bytes: usize = |n| {
            resolve::at_least_1(n, crate::orderedlog::etcd::DEFAULT_MAX_REQUEST_BYTES)
        },
    }
}

/// One setting as [`SETTINGS`] lists it: the names it goes by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The flag, e.g. `--metrics-addr`: what a refusal names.
    pub flag: &'static str,
    /// The environment variable, e.g. `RUNE_METRICS_ADDR`.
    pub env: &'static str,
    /// The field of [`FileConfig`], e.g. `metrics_addr`.
    pub field: &'static str,
}

impl Setting {
    /// The config-file key: the field's name in camelCase (`metricsAddr`).
    #[must_use]
    pub fn file_key(&self) -> String {
        let mut key = String::with_capacity(self.field.len());
        let mut upper = false;
        for c in self.field.chars() {
            match c {
                '_' => upper = true,
                c if upper => {
                    key.push(c.to_ascii_uppercase());
                    upper = false;
                }
                c => key.push(c),
            }
        }
        key
    }
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

    /// Applies defaults and checks every value: each setting's own checks (its
    /// declaration), then those across settings.
    pub fn resolve(self) -> Result<Config, ConfigError> {
        let config = self.resolve_each()?;
        let (frontends, table_size) = (config.lb_max_frontends, config.maglev_table_size);
        if u64::from(frontends) * u64::from(table_size) > u64::from(u32::MAX / 4) {
            return Err(ConfigError::Invalid {
                setting: "--lb-max-frontends",
                message: format!(
                    "{frontends} frontends × {table_size} Maglev slots do not fit one map"
                ),
            });
        }
        Ok(config)
    }
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
