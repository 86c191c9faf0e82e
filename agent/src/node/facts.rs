//! What the node is: facts read from the host (kernel, architecture, CPUs, memory,
//! addresses, free space of the state dir) and from the agent through a
//! [`FactsSource`] (data plane mode and why, failed preflight checks, map fill,
//! readiness), which `run` fills with closures over what it built.

use crate::{
    agent::Agent,
    config::{DataplaneMode, Mode},
    dataplane::{DataPlane, MapCount, MapUsage, PortState},
    preflight::Check,
    subsystem::Readiness,
};
use serde::{Deserialize, Serialize};
use std::{
    ffi::CStr,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{Arc, Weak},
};

/// Failing service ports named in `DataplaneDegraded`'s message; the rest are
/// counted.
const NAMED_FAILING_PORTS: usize = 5;

/// The facts of a node document.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Facts {
    /// `uname -r`.
    pub kernel_release: String,
    /// `uname -m` (`x86_64`, `aarch64`).
    pub architecture: String,
    /// Online CPUs.
    pub cpus: u64,
    /// `MemTotal` of /proc/meminfo, in bytes.
    pub memory_total_bytes: u64,
    /// The data plane carrying services, and why.
    pub dataplane: DataplaneFacts,
    /// The agent's version.
    pub agent_version: String,
    /// The data plane's fixed-size maps with their fill; absent where the mode
    /// keeps none (nftables, userspace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maps: Option<Vec<MapFill>>,
}

/// The data plane in use, why, and the preflight checks that failed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DataplaneFacts {
    /// `ebpf`, `nftables` or `userspace`.
    pub mode: String,
    /// Why this mode (preflight's decision, or dev mode).
    pub reason: String,
    /// The names of the preflight checks that failed at start.
    #[serde(default)]
    pub failed_checks: Vec<String>,
}

/// One map of the data plane: its capacity and, where known, how full it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MapFill {
    /// The map's name (`frontends`, `backends`, `conntrack_v4`, `conntrack_v6`).
    pub name: String,
    /// Entries it can hold.
    pub capacity: u64,
    /// Entries it holds; `None` when counting them failed.
    pub used: Option<u64>,
}

impl From<MapUsage> for MapFill {
    fn from(m: MapUsage) -> Self {
        Self {
            name: m.name.to_owned(),
            capacity: m.capacity,
            used: m.used,
        }
    }
}

impl MapFill {
    /// Whether the map is at least `percent` % full (never when its use is unknown).
    pub fn at_least(&self, percent: u64) -> bool {
        self.capacity > 0
            && self
                .used
                .is_some_and(|u| u * 100 >= self.capacity * percent)
    }
}

/// A closure giving one of the agent's facts.
pub type Fact<T> = Arc<dyn Fn() -> T + Send + Sync>;

/// A closure giving the data plane's maps, counted as far as asked (`None`: the
/// mode keeps no fixed-size maps).
pub type MapsFact = Arc<dyn Fn(MapCount) -> Option<Vec<MapFill>> + Send + Sync>;

/// What the agent tells the registrar about itself; `run` fills it with closures
/// over the data plane, preflight's results and the agent's readiness.
#[derive(Clone)]
pub struct FactsSource {
    /// The data plane's mode, why, and the failed preflight checks.
    pub dataplane: Fact<DataplaneFacts>,
    /// The data plane's maps: every one with the facts, the tables it keeps
    /// itself after every change of the applied revision.
    pub maps: MapsFact,
    /// `Ok` when the agent is ready, else why not (the `Ready` condition).
    pub ready: Fact<Result<(), String>>,
    /// A flag that changes when `ready` may have: the registrar writes the
    /// document again at once rather than at the next heartbeat.
    pub ready_changes: Option<Readiness>,
    /// Why the data plane is degraded (fell back from eBPF, ports failing), if it
    /// is (the `DataplaneDegraded` condition). Asked with the facts (every 60 s):
    /// it may walk every service port.
    pub degraded: Fact<Option<String>>,
    /// The state dir, whose filesystem's free space is the `DiskPressure`
    /// condition.
    pub state_dir: PathBuf,
}

impl std::fmt::Debug for FactsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FactsSource")
            .field("state_dir", &self.state_dir)
            .finish_non_exhaustive()
    }
}

impl FactsSource {
    /// What `run` has: the agent (held weakly: the agent owns the registrar),
    /// its data plane, preflight's reason and checks (none in dev mode), and the
    /// state dir; the maps are the data plane's own ([`DataPlane::maps`]). The
    /// data plane is degraded when, in production, it is not eBPF while checks
    /// eBPF needs failed, or when service ports fail.
    pub fn for_agent(
        agent: Weak<Agent>,
        mode: Mode,
        plane: Arc<dyn DataPlane>,
        reason: String,
        checks: Vec<Check>,
        state_dir: PathBuf,
    ) -> Self {
        let failed: Vec<String> = checks
            .iter()
            .filter(|c| !c.passed)
            .map(|c| c.name.clone())
            .collect();
        let ebpf_blocked: Vec<String> = checks
            .iter()
            .filter(|c| !c.passed && c.needed_by.contains(&DataplaneMode::Ebpf))
            .map(|c| c.name.clone())
            .collect();
        let dataplane = DataplaneFacts {
            mode: plane.mode().to_owned(),
            reason,
            failed_checks: failed,
        };
        let facts_plane = dataplane.clone();
        let status_plane = plane.clone();
        let maps_plane = plane.clone();
        let ready_changes = agent.upgrade().map(|a| a.readiness());
        Self {
            ready_changes,
            dataplane: Arc::new(move || facts_plane.clone()),
            maps: Arc::new(move |count| {
                maps_plane
                    .maps(count)
                    .map(|maps| maps.into_iter().map(MapFill::from).collect())
            }),
            ready: Arc::new(move || match agent.upgrade() {
                None => Err("the agent is gone".to_owned()),
                Some(a) => a.ready_err().map_or(Ok(()), |e| Err(e.to_string())),
            }),
            degraded: Arc::new(move || {
                let mut why = Vec::new();
                if mode == Mode::Production
                    && status_plane.mode() != "ebpf"
                    && !ebpf_blocked.is_empty()
                {
                    why.push(format!(
                        "{} instead of ebpf: {} failed",
                        status_plane.mode(),
                        ebpf_blocked.join(", ")
                    ));
                }
                // The first few, then a count: the node document must stay small
                // (it is rewritten on changes and read by every `get nodes`).
                let mut failing = 0usize;
                let mut named: Vec<String> = Vec::new();
                for p in status_plane.status() {
                    if let PortState::Failed { reason } = p.state {
                        failing += 1;
                        if named.len() < NAMED_FAILING_PORTS {
                            named
                                .push(format!("{}:{}/{}: {reason}", p.service, p.port, p.protocol));
                        }
                    }
                }
                if failing > 0 {
                    let more = failing - named.len();
                    let more = if more > 0 {
                        format!("; and {more} more")
                    } else {
                        String::new()
                    };
                    why.push(format!(
                        "{failing} service port(s) failing: {}{more}",
                        named.join("; ")
                    ));
                }
                (!why.is_empty()).then(|| why.join("; "))
            }),
            state_dir,
        }
    }

    /// A source that reports `mode` ready and not degraded, with no maps: what a
    /// test or a minimal agent has.
    pub fn fixed(mode: &str, reason: &str, state_dir: PathBuf) -> Self {
        let dataplane = DataplaneFacts {
            mode: mode.to_owned(),
            reason: reason.to_owned(),
            failed_checks: Vec::new(),
        };
        Self {
            dataplane: Arc::new(move || dataplane.clone()),
            maps: Arc::new(|_| None),
            ready: Arc::new(|| Ok(())),
            ready_changes: None,
            degraded: Arc::new(|| None),
            state_dir,
        }
    }
}

/// Readings of the host that change (for the pressure conditions).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostSample {
    /// `MemTotal` and `MemAvailable`, in bytes, when /proc/meminfo could be read.
    pub memory: Option<(u64, u64)>,
    /// Bytes available to the agent and the size of the state dir's filesystem.
    pub disk: Option<(u64, u64)>,
}

/// The node's facts and host readings now (the data plane's degradation is
/// asked separately: see [`FactsSource::degraded`]).
pub fn gather(source: &FactsSource) -> (Facts, HostSample) {
    let (kernel_release, architecture) = uname();
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| meminfo(&t));
    let sample = HostSample {
        memory,
        disk: disk_space(&source.state_dir),
    };
    let facts = Facts {
        kernel_release,
        architecture,
        cpus: cpus(),
        memory_total_bytes: memory.map_or(0, |(total, _)| total),
        dataplane: (source.dataplane)(),
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        maps: (source.maps)(MapCount::WithFlows),
    };
    (facts, sample)
}

/// The kernel release and machine, from uname(2).
fn uname() -> (String, String) {
    // SAFETY: utsname is plain data; uname fills it with NUL-terminated strings.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return (String::new(), String::new());
    }
    // SAFETY: the fields are NUL-terminated after a successful uname.
    let text = |f: &[libc::c_char]| {
        unsafe { CStr::from_ptr(f.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    };
    (text(&u.release), text(&u.machine))
}

/// Online CPUs.
fn cpus() -> u64 {
    // SAFETY: sysconf has no memory effects.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    u64::try_from(n).unwrap_or(0)
}

/// `MemTotal` and `MemAvailable` of a /proc/meminfo text, in bytes.
pub fn meminfo(text: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some((field("MemTotal")?, field("MemAvailable")?))
}

/// Bytes available to unprivileged users and the total size of the filesystem
/// holding `dir`.
fn disk_space(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain data, filled by the call for a NUL-terminated path.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut s) } != 0 {
        return None;
    }
    let unit = s.f_frsize as u64;
    Some((s.f_bavail as u64 * unit, s.f_blocks as u64 * unit))
}

/// Every address of the node's interfaces but loopback and IPv6 link-local ones
/// (which mean nothing off their link), sorted.
pub fn addresses() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs allocates a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return out;
    }
    let mut at = list;
    while !at.is_null() {
        // SAFETY: `at` is an element of the list getifaddrs returned.
        let ifa = unsafe { &*at };
        at = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0 {
            continue;
        }
        // SAFETY: ifa_addr points to a sockaddr of the family it names.
        let ip = match i32::from(unsafe { (*ifa.ifa_addr).sa_family }) {
            libc::AF_INET => {
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes())
            }
            libc::AF_INET6 => {
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                IpAddr::from(sin6.sin6_addr.s6_addr)
            }
            _ => continue,
        };
        let link_local = matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80);
        if !ip.is_loopback() && !link_local {
            out.push(ip);
        }
    }
    // SAFETY: the list came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_facts_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let (facts, sample) = gather(&FactsSource::fixed(
            "userspace",
            "dev mode",
            dir.path().into(),
        ));
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        assert_eq!(facts.kernel_release, release.trim());
        assert_eq!(facts.architecture, std::env::consts::ARCH);
        assert!(facts.cpus >= 1);
        assert!(facts.memory_total_bytes > 0);
        assert_eq!(facts.dataplane.mode, "userspace");
        assert_eq!(facts.agent_version, env!("CARGO_PKG_VERSION"));
        assert_eq!(
            facts.maps, None,
            "a data plane without maps has no map facts"
        );
        let (total, available) = sample.memory.unwrap();
        assert!(available <= total && total == facts.memory_total_bytes);
        let (free, size) = sample.disk.unwrap();
        assert!(free <= size && size > 0);
        assert!(addresses().iter().all(|a| !a.is_loopback()));
    }

    /// A data plane whose ports (this many) failed to bind.
    struct Failing(u16);

    #[async_trait::async_trait]
    impl DataPlane for Failing {
        fn mode(&self) -> &'static str {
            "nftables"
        }
        async fn apply(
            &self,
            _: &crate::endpoints::Delta,
        ) -> Result<(), crate::dataplane::DataPlaneError> {
            Ok(())
        }
        fn status(&self) -> Vec<crate::dataplane::ServicePortStatus> {
            (0..self.0)
                .map(|i| crate::dataplane::ServicePortStatus {
                    service: "default/web".into(),
                    port: 80 + i,
                    protocol: crate::model::Protocol::Tcp,
                    listen: None,
                    state: PortState::Failed {
                        reason: "address in use".into(),
                    },
                    endpoints_known: true,
                    backends: Vec::new(),
                    counters: None,
                })
                .collect()
        }
        async fn shutdown(&self) {}
    }

    #[test]
    fn the_agents_source_says_why_the_data_plane_is_degraded() {
        let checks = vec![
            Check {
                name: "btf".into(),
                passed: false,
                detail: "no BTF".into(),
                needed_by: vec![DataplaneMode::Ebpf],
            },
            Check {
                name: "nft".into(),
                passed: true,
                detail: String::new(),
                needed_by: vec![DataplaneMode::Nftables],
            },
        ];
        let source = FactsSource::for_agent(
            Weak::new(),
            Mode::Production,
            Arc::new(Failing(1)),
            "auto: eBPF unavailable".into(),
            checks,
            PathBuf::from("/"),
        );
        let facts = (source.dataplane)();
        assert_eq!(facts.mode, "nftables");
        assert_eq!(facts.failed_checks, vec!["btf".to_owned()]);
        let why = (source.degraded)().expect("degraded");
        assert!(
            why.contains("nftables instead of ebpf: btf failed"),
            "{why}"
        );
        assert!(why.contains("default/web:80/TCP: address in use"), "{why}");
        assert_eq!((source.ready)(), Err("the agent is gone".to_owned()));
    }

    #[test]
    fn many_failing_ports_are_counted_not_all_named() {
        let source = FactsSource::for_agent(
            Weak::new(),
            Mode::Production,
            Arc::new(Failing(10_000)),
            "forced".into(),
            Vec::new(),
            PathBuf::from("/"),
        );
        let why = (source.degraded)().expect("degraded");
        assert!(why.starts_with("10000 service port(s) failing: "), "{why}");
        assert!(why.ends_with("; and 9995 more"), "{why}");
        assert!(why.len() < 1024, "{} bytes", why.len());
    }

    #[test]
    fn meminfo_is_parsed_in_bytes() {
        let text = "MemTotal:        2000 kB\nMemFree:   10 kB\nMemAvailable:     150 kB\n";
        assert_eq!(meminfo(text), Some((2000 * 1024, 150 * 1024)));
        assert_eq!(meminfo("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn map_fill_thresholds() {
        let map = |used| MapFill {
            name: "flows".into(),
            capacity: 1000,
            used,
        };
        assert!(map(Some(900)).at_least(90));
        assert!(!map(Some(899)).at_least(90));
        assert!(!map(None).at_least(90));
    }
}
