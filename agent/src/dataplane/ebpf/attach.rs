//! Loads the load balancer's programs and attaches them through pinned links.
//!
//! Every attachment is a BPF link pinned at `<pin dir>/links/<program>@<target>`,
//! so the programs keep running when the agent exits or is killed: a restarted or
//! upgraded agent finds the pins and swaps its freshly loaded programs in. XDP and
//! tc links are updated in place (`BPF_LINK_UPDATE`, atomic: no packet misses a
//! program); cgroup hooks get the new link first and the old one is unpinned after,
//! so for a moment both run, which is harmless because they share the maps. Pins of
//! targets no longer configured are removed, which detaches them.

use super::{
    error::EbpfError,
    pins::{fs_type, links_dir},
};
use agent_common::{lb, policy};
use aya::{
    Ebpf,
    programs::{
        CgroupAttachMode, CgroupSockAddr, ProgramError, SchedClassifier, TcAttachType, Xdp,
        XdpMode,
        links::{FdLink, LinkError, PinnedLink},
        tc::SchedClassifierLink,
        xdp::XdpLink,
    },
};
use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

/// Where the programs go.
#[derive(Clone, Debug, Default)]
pub struct Hooks {
    /// cgroup v2 directory for the socket-LB programs (`None`: socket LB off).
    pub cgroup: Option<PathBuf>,
    /// Interfaces that get tc ingress (DNAT) and egress (reverse NAT).
    pub tc: Vec<String>,
    /// Interfaces that get the XDP load balancer.
    pub xdp: Vec<String>,
    /// Interfaces toward local endpoints that get the network policy programs
    /// (tc egress: ingress rules of the destination; tc ingress: egress rules of
    /// the source).
    pub policy: Vec<String>,
    /// How XDP is attached.
    pub xdp_mode: XdpMode,
}

impl Hooks {
    /// The programs these hooks run, in [`PROGRAMS`] order. [`attach_all`] puts
    /// every one of them through the verifier before it attaches anything, so a
    /// failed attachment means all of them were accepted.
    #[must_use]
    pub fn programs(&self) -> Vec<&'static str> {
        let mut programs = Vec::new();
        if self.cgroup.is_some() {
            programs.extend_from_slice(CGROUP_PROGRAMS);
        }
        if !self.tc.is_empty() {
            programs.extend([lb::PROG_TC_INGRESS, lb::PROG_TC_EGRESS]);
        }
        if !self.xdp.is_empty() {
            programs.push(lb::PROG_XDP_LB);
        }
        if !self.policy.is_empty() {
            programs.extend([policy::PROG_POLICY_FROM, policy::PROG_POLICY_TO]);
        }
        programs
    }
}

/// One program attached somewhere, for `status`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Attachment {
    /// The program's name.
    pub program: &'static str,
    /// The hook: `cgroup`, `tc-ingress`, `tc-egress` or `xdp`.
    pub hook: &'static str,
    /// The cgroup path or interface name.
    pub target: String,
}

/// Every program the agent attaches: the socket-LB ones first (in the order they
/// are attached), then tc ingress and egress, then XDP, then the policy programs.
/// Preflight loads each.
pub const PROGRAMS: [&str; 13] = [
    lb::PROG_CONNECT4,
    lb::PROG_CONNECT6,
    lb::PROG_SENDMSG4,
    lb::PROG_SENDMSG6,
    lb::PROG_RECVMSG4,
    lb::PROG_RECVMSG6,
    lb::PROG_GETPEERNAME4,
    lb::PROG_GETPEERNAME6,
    lb::PROG_TC_INGRESS,
    lb::PROG_TC_EGRESS,
    lb::PROG_XDP_LB,
    policy::PROG_POLICY_FROM,
    policy::PROG_POLICY_TO,
];

/// The socket-LB programs: the first eight of [`PROGRAMS`].
const CGROUP_PROGRAMS: &[&str] = PROGRAMS.split_at(8).0;

/// A pin file name for `program` on `target` (slashes of cgroup paths escaped).
fn pin_path(pin_dir: &Path, program: &str, target: &str) -> PathBuf {
    let target: String = target
        .chars()
        .map(|c| if c == '/' { '%' } else { c })
        .collect();
    links_dir(pin_dir).join(format!("{program}@{target}"))
}

fn hook_error(
    name: &'static str,
    target: &str,
    source: impl std::error::Error + Send + Sync + 'static,
) -> EbpfError {
    EbpfError::Hook {
        name,
        target: target.to_owned(),
        source: Box::new(source),
    }
}

/// Loads program `name` of type `P` (once).
fn load<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P, EbpfError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
    P: Loadable + 'a,
{
    let program: &mut P = ebpf
        .program_mut(name)
        .ok_or(EbpfError::ProgramNotFound { name })?
        .try_into()
        .map_err(|source| EbpfError::ProgramType {
            name,
            source: Box::new(source),
        })?;
    match program.load_program() {
        Ok(()) | Err(ProgramError::AlreadyLoaded) => Ok(program),
        Err(source) => Err(EbpfError::ProgramLoad {
            name,
            source: Box::new(source),
        }),
    }
}

/// The program types loaded here.
trait Loadable {
    fn load_program(&mut self) -> Result<(), ProgramError>;
}
impl Loadable for CgroupSockAddr {
    fn load_program(&mut self) -> Result<(), ProgramError> {
        self.load()
    }
}
impl Loadable for SchedClassifier {
    fn load_program(&mut self) -> Result<(), ProgramError> {
        self.load()
    }
}
impl Loadable for Xdp {
    fn load_program(&mut self) -> Result<(), ProgramError> {
        self.load()
    }
}

/// Replaces whatever is pinned at `path` by `link` (program `name` on `target`).
fn repin<L>(link: L, path: &Path, name: &'static str, target: &str) -> Result<(), EbpfError>
where
    L: TryInto<FdLink, Error = LinkError>,
{
    let link: FdLink = link.try_into().map_err(|e| hook_error(name, target, e))?;
    if path.exists() {
        fs::remove_file(path).map_err(|e| EbpfError::pin(path, e))?;
    }
    link.pin(path).map_err(|e| EbpfError::pin(path, e))?;
    Ok(())
}

/// The link pinned at `path`, as a link of type `L`, if there is one of that type.
fn pinned<L: TryFrom<FdLink>>(path: &Path) -> Option<L> {
    let link: FdLink = PinnedLink::from_pin(path).ok()?.into();
    L::try_from(link).ok()
}

/// Loads the programs `hooks` needs and attaches them, reusing pinned links.
/// Returns what is attached. Pins of attachments not in `hooks` are removed.
pub fn attach_all(
    ebpf: &mut Ebpf,
    pin_dir: &Path,
    hooks: &Hooks,
) -> Result<Vec<Attachment>, EbpfError> {
    // Every program through the verifier before anything is attached: a rejected
    // one fails the start without swapping in half of the new programs.
    for name in hooks.programs() {
        if CGROUP_PROGRAMS.contains(&name) {
            load::<CgroupSockAddr>(ebpf, name)?;
        } else if name == lb::PROG_XDP_LB {
            load::<Xdp>(ebpf, name)?;
        } else {
            load::<SchedClassifier>(ebpf, name)?;
        }
    }
    let dir = links_dir(pin_dir);
    fs::create_dir_all(&dir).map_err(|e| EbpfError::pin(&dir, e))?;
    let mut attached = Vec::new();

    if let Some(cgroup) = &hooks.cgroup {
        let target = cgroup.display().to_string();
        let file = fs::File::open(cgroup).map_err(|e| {
            hook_error(
                lb::PROG_CONNECT4,
                &target,
                ProgramError::IOError(std::io::Error::new(
                    e.kind(),
                    format!("opening cgroup {target}: {e}"),
                )),
            )
        })?;
        for name in CGROUP_PROGRAMS {
            let program: &mut CgroupSockAddr = load(ebpf, name)?;
            let id = program
                .attach(&file, CgroupAttachMode::Single)
                .map_err(|e| hook_error(name, &target, e))?;
            let link = program
                .take_link(id)
                .map_err(|e| hook_error(name, &target, e))?;
            // The new link runs before the old one is unpinned (and so detached).
            repin(link, &pin_path(pin_dir, name, &target), name, &target)?;
            attached.push(Attachment {
                program: name,
                hook: "cgroup",
                target: target.clone(),
            });
        }
    }

    let lb_tc = hooks.tc.iter().map(|interface| {
        (
            interface,
            [
                (lb::PROG_TC_INGRESS, TcAttachType::Ingress, "tc-ingress"),
                (lb::PROG_TC_EGRESS, TcAttachType::Egress, "tc-egress"),
            ],
        )
    });
    let policy_tc = hooks.policy.iter().map(|interface| {
        (
            interface,
            [
                (
                    policy::PROG_POLICY_FROM,
                    TcAttachType::Ingress,
                    "tc-ingress",
                ),
                (policy::PROG_POLICY_TO, TcAttachType::Egress, "tc-egress"),
            ],
        )
    });
    for (interface, programs) in lb_tc.chain(policy_tc) {
        for (name, attach_type, hook) in programs {
            let path = pin_path(pin_dir, name, interface);
            let program: &mut SchedClassifier = load(ebpf, name)?;
            // An update in place keeps the pin; a new link is pinned.
            let updated = pinned::<SchedClassifierLink>(&path)
                .and_then(|link| program.attach_to_link(link).ok());
            if updated.is_none() {
                let id = program
                    .attach(interface, attach_type)
                    .map_err(|e| hook_error(name, interface, e))?;
                let link = program
                    .take_link(id)
                    .map_err(|e| hook_error(name, interface, e))?;
                repin(link, &path, name, interface)?;
            }
            attached.push(Attachment {
                program: name,
                hook,
                target: interface.clone(),
            });
        }
    }

    for interface in &hooks.xdp {
        let name = lb::PROG_XDP_LB;
        let path = pin_path(pin_dir, name, interface);
        let program: &mut Xdp = load(ebpf, name)?;
        let updated = pinned::<XdpLink>(&path).and_then(|link| program.attach_to_link(link).ok());
        if updated.is_none() {
            // A stale pin (its interface was recreated) holds nothing: drop it
            // (XDP takes one link per interface).
            let _ = fs::remove_file(&path);
            let id = program
                .attach(interface, hooks.xdp_mode)
                .map_err(|e| hook_error(name, interface, e))?;
            let link = program
                .take_link(id)
                .map_err(|e| hook_error(name, interface, e))?;
            repin(link, &path, name, interface)?;
        }
        attached.push(Attachment {
            program: name,
            hook: "xdp",
            target: interface.clone(),
        });
    }

    // Whatever else is pinned belongs to hooks no longer configured.
    let keep: BTreeSet<PathBuf> = attached
        .iter()
        .map(|a| pin_path(pin_dir, a.program, &a.target))
        .collect();
    if let Ok(entries) = fs::read_dir(&dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if !keep.contains(&path) {
                tracing::info!(pin = %path.display(), "detaching a program no longer configured");
                fs::remove_file(&path).map_err(|e| EbpfError::pin(&path, e))?;
            }
        }
    }
    Ok(attached)
}

/// cgroup2's `f_type`.
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// The cgroup v2 root: `/sys/fs/cgroup/unified` on hybrid hosts, else
/// `/sys/fs/cgroup` when that is cgroup v2.
#[must_use]
pub fn default_cgroup() -> Option<PathBuf> {
    ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| fs_type(p) == Some(CGROUP2_SUPER_MAGIC))
}

/// The interfaces of this network namespace's default routes (IPv4 and IPv6),
/// from `/proc/net/route` and `/proc/net/ipv6_route`, sorted, without duplicates.
#[must_use]
pub fn default_route_interfaces() -> Vec<String> {
    let mut out = BTreeSet::new();
    if let Ok(text) = fs::read_to_string("/proc/net/route") {
        // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 7 && f[1] == "00000000" && f[7] == "00000000" {
                out.insert(f[0].to_owned());
            }
        }
    }
    if let Ok(text) = fs::read_to_string("/proc/net/ipv6_route") {
        // dest dest_len src src_len next_hop metric refcnt use flags iface
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() >= 10 && f[0].bytes().all(|b| b == b'0') && f[1] == "00" && f[9] != "lo" {
                out.insert(f[9].to_owned());
            }
        }
    }
    out.into_iter().collect()
}
