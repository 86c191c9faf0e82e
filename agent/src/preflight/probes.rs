//! The probes: each asks the kernel or the host directly and records a [`Check`].
//!
//! Nothing here changes the host for longer than the probe: maps and programs are
//! closed again, the agent's programs are loaded from a copy of the object whose
//! maps are not pinned ([`super::object`]), tc and XDP are attached to `lo` of a
//! private network namespace that vanishes with the probe thread, and the cgroup
//! hook to an empty child cgroup that is removed again. Every command is bounded in
//! time.

use super::{Check, DataplaneMode, Options, deferred};
use crate::{
    dataplane::ebpf::{attach, pins},
    error_chain::error_chain,
};
use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
};
use std::{
    io,
    os::fd::{FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

mod own_programs;

use DataplaneMode::{Ebpf, Nftables, Userspace};
use own_programs::agent_programs;

const EBPF: &[DataplaneMode] = &[Ebpf];

/// How long one `nft` command may take.
const COMMAND_PATIENCE: Duration = Duration::from_secs(5);

/// The program types our programs are, by the names checks use.
const PROGRAM_TYPES: [(&str, ProgramType); 3] = [
    ("xdp", ProgramType::Xdp),
    ("sched_cls", ProgramType::SchedClassifier),
    ("cgroup_sock_addr", ProgramType::CgroupSockAddr),
];

/// The helpers our programs call, per program type (the unit test below keeps this
/// equal to the calls in the embedded object).
const HELPERS: [(&str, ProgramType, &[BpfHelper]); 3] = {
    [
        (
            "xdp",
            ProgramType::Xdp,
            &[
                BpfHelper::BPF_FUNC_map_lookup_elem,
                BpfHelper::BPF_FUNC_map_update_elem,
                BpfHelper::BPF_FUNC_ktime_get_ns,
                BpfHelper::BPF_FUNC_get_smp_processor_id,
                // A new flow's port when its own is held at its backend.
                BpfHelper::BPF_FUNC_get_prandom_u32,
                // The refusal of a service without backends (RST / ICMP error,
                // resized in place and sent back with XDP_TX).
                BpfHelper::BPF_FUNC_xdp_adjust_head,
                BpfHelper::BPF_FUNC_xdp_adjust_tail,
                BpfHelper::BPF_FUNC_xdp_get_buff_len,
            ],
        ),
        (
            "sched_cls",
            ProgramType::SchedClassifier,
            &[
                BpfHelper::BPF_FUNC_map_lookup_elem,
                BpfHelper::BPF_FUNC_map_update_elem,
                // tc egress deletes the conntrack entries of a VIP flow that is over.
                BpfHelper::BPF_FUNC_map_delete_elem,
                BpfHelper::BPF_FUNC_ktime_get_ns,
                // A new flow whose client port another flow holds at its backend
                // tries random ports of its class.
                BpfHelper::BPF_FUNC_get_prandom_u32,
                BpfHelper::BPF_FUNC_get_smp_processor_id,
                BpfHelper::BPF_FUNC_l3_csum_replace,
                BpfHelper::BPF_FUNC_l4_csum_replace,
                BpfHelper::BPF_FUNC_skb_pull_data,
                // The refusal of a service without backends: the RST / ICMP error is
                // resized, its checksum state reset, and sent back out.
                BpfHelper::BPF_FUNC_redirect,
                BpfHelper::BPF_FUNC_skb_change_tail,
                BpfHelper::BPF_FUNC_skb_adjust_room,
                BpfHelper::BPF_FUNC_csum_level,
                // Network policy verdict events for `observe`.
                BpfHelper::BPF_FUNC_ringbuf_output,
            ],
        ),
        (
            "cgroup_sock_addr",
            ProgramType::CgroupSockAddr,
            &[
                BpfHelper::BPF_FUNC_map_lookup_elem,
                BpfHelper::BPF_FUNC_map_update_elem,
                BpfHelper::BPF_FUNC_ktime_get_ns,
                BpfHelper::BPF_FUNC_get_smp_processor_id,
                BpfHelper::BPF_FUNC_get_prandom_u32,
                BpfHelper::BPF_FUNC_get_socket_cookie,
                BpfHelper::BPF_FUNC_get_netns_cookie,
            ],
        ),
    ]
};

/// The map types our maps are.
const MAP_TYPES: [(&str, MapType); 4] = [
    ("hash", MapType::Hash),
    ("array", MapType::Array),
    ("lru_hash", MapType::LruHash),
    ("percpu_array", MapType::PerCpuArray),
];

// bpf(2) constants (uapi/linux/bpf.h).
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
const BPF_F_MMAPABLE: u32 = 1 << 10;

// Capability bits of CapEff.
const CAP_NET_BIND_SERVICE: u32 = 10;
const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// The kernel release (`uname -r`), or why it is unknown.
#[must_use]
pub fn kernel_release() -> String {
    // SAFETY: uname fills the zeroed struct; the fields are NUL-terminated.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&raw mut u) } != 0 {
        return format!("unknown ({})", io::Error::last_os_error());
    }
    // SAFETY: NUL-terminated by uname.
    unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Every probe, in the order the table shows them.
pub fn probe_all(options: &Options) -> Vec<Check> {
    // `nft` runs as two child processes: beside the kernel probes, not after them.
    let nft = std::thread::spawn(nft);
    let mut checks = vec![Check::new("kernel", true, kernel_release(), &[])];
    checks.extend(capabilities());
    checks.push(bpf_syscall());
    checks.push(btf());
    checks.push(bpffs());
    let cgroup = socket_lb_cgroup(options);
    checks.push(cgroup2(&cgroup));
    for (name, kind) in PROGRAM_TYPES {
        checks.push(program_type(name, kind));
    }
    for (name, kind) in MAP_TYPES {
        checks.push(map_type(name, kind));
    }
    checks.push(map_flag(
        "map-flag:mmapable",
        BPF_MAP_TYPE_ARRAY,
        BPF_F_MMAPABLE,
        "arrays mapped into the agent's memory (BPF_F_MMAPABLE, Maglev tables)",
    ));
    for (type_name, kind, helpers) in HELPERS {
        for helper in helpers {
            checks.push(helper_check(type_name, kind, *helper));
        }
    }
    if options.defer_programs {
        checks.extend(deferred::placeholders(cgroup.ok().flatten().is_some()));
    } else {
        checks.extend(agent_programs(cgroup));
    }
    checks.extend(nft.join().unwrap_or_else(|_| {
        ["nft", "nft-netlink"]
            .map(|name| Check::new(name, false, "the nft probe thread panicked", &[Nftables]))
            .into()
    }));
    checks
}

/// The effective capabilities (CapEff of /proc/self/status).
fn cap_eff() -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("reading /proc/self/status: {e}"))?;
    parse_cap_eff(&status)
}

fn parse_cap_eff(status: &str) -> Result<u64, String> {
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .ok_or("no CapEff line in /proc/self/status")?;
    u64::from_str_radix(hex.trim(), 16).map_err(|e| format!("CapEff {:?}: {e}", hex.trim()))
}

fn capabilities() -> Vec<Check> {
    let caps = cap_eff();
    [
        (
            "cap-bpf",
            "CAP_BPF",
            CAP_BPF,
            EBPF,
            "for loading programs and creating maps",
        ),
        (
            "cap-net-admin",
            "CAP_NET_ADMIN",
            CAP_NET_ADMIN,
            &[Ebpf, Nftables, Userspace][..],
            "for tc/XDP attachment, nftables, VIP addresses",
        ),
        (
            "cap-sys-admin",
            "CAP_SYS_ADMIN",
            CAP_SYS_ADMIN,
            EBPF,
            "for cgroup hooks, mounting bpffs",
        ),
        (
            "cap-perfmon",
            "CAP_PERFMON",
            CAP_PERFMON,
            &[][..],
            "advisory: wider verifier allowances our programs do not need",
        ),
        (
            "cap-net-bind-service",
            "CAP_NET_BIND_SERVICE",
            CAP_NET_BIND_SERVICE,
            &[Userspace][..],
            "for proxies on VIP ports below 1024",
        ),
    ]
    .into_iter()
    .map(|(name, cap, bit, needed_by, why)| match &caps {
        Ok(bits) if bits & (1 << bit) != 0 => {
            Check::new(name, true, format!("{cap} effective ({why})"), needed_by)
        }
        Ok(_) => Check::new(
            name,
            false,
            format!("{cap} not in the effective set ({why}); run as root"),
            needed_by,
        ),
        Err(e) => Check::new(name, false, e.clone(), needed_by),
    })
    .collect()
}

/// `bpf(BPF_MAP_CREATE)` of a tiny map, closed again.
fn create_map(map_type: u32, key_size: u32, value_size: u32, flags: u32) -> io::Result<OwnedFd> {
    /// The leading fields of `union bpf_attr` for BPF_MAP_CREATE; the rest zero.
    #[repr(C)]
    struct MapCreate {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
        rest: [u32; 27],
    }
    let attr = MapCreate {
        map_type,
        key_size,
        value_size,
        max_entries: 1,
        map_flags: flags,
        rest: [0; 27],
    };
    // SAFETY: bpf(2) reads `size` bytes of the attribute, all initialised.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_CREATE,
            &raw const attr,
            size_of::<MapCreate>() as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn bpf_syscall() -> Check {
    match create_map(BPF_MAP_TYPE_ARRAY, 4, 4, 0) {
        Ok(_) => Check::new("bpf-syscall", true, "bpf(BPF_MAP_CREATE) works", EBPF),
        Err(e) => {
            let why = match e.raw_os_error() {
                Some(libc::ENOSYS) => "kernel built without the bpf syscall".to_owned(),
                Some(libc::EPERM) => format!("{e}: needs CAP_BPF (root)"),
                _ => e.to_string(),
            };
            Check::new(
                "bpf-syscall",
                false,
                format!("bpf(BPF_MAP_CREATE): {why}"),
                EBPF,
            )
        }
    }
}

fn btf() -> Check {
    match aya::Btf::from_sys_fs() {
        Ok(_) => Check::new("btf", true, "/sys/kernel/btf/vmlinux parsed", EBPF),
        Err(e) => Check::new(
            "btf",
            false,
            format!("/sys/kernel/btf/vmlinux: {e} (kernel without CONFIG_DEBUG_INFO_BTF)"),
            EBPF,
        ),
    }
}

/// bpffs's `f_type`.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

fn bpffs() -> Check {
    let root = Path::new("/sys/fs/bpf");
    if pins::fs_type(root) == Some(BPF_FS_MAGIC) {
        return Check::new("bpffs", true, "mounted on /sys/fs/bpf", EBPF);
    }
    let known = std::fs::read_to_string("/proc/filesystems")
        .map(|t| {
            t.lines()
                .any(|l| l.split_whitespace().last() == Some("bpf"))
        })
        .unwrap_or(false);
    let may_mount = cap_eff().is_ok_and(|c| c & (1 << CAP_SYS_ADMIN) != 0);
    match (known, may_mount) {
        (true, true) => Check::new(
            "bpffs",
            true,
            "not mounted on /sys/fs/bpf; the agent mounts it at start",
            EBPF,
        ),
        (true, false) => Check::new(
            "bpffs",
            false,
            "not mounted on /sys/fs/bpf, and mounting it needs CAP_SYS_ADMIN",
            EBPF,
        ),
        (false, _) => Check::new(
            "bpffs",
            false,
            "the kernel has no bpf filesystem (not in /proc/filesystems)",
            EBPF,
        ),
    }
}

/// Where socket LB would attach: `Ok(Some(dir))`, `Ok(None)` when turned off, or
/// why there is no cgroup v2 directory.
fn socket_lb_cgroup(options: &Options) -> Result<Option<PathBuf>, String> {
    match &options.cgroup {
        Some(None) => Ok(None),
        Some(Some(dir)) => Ok(Some(dir.clone())),
        None => attach::default_cgroup().map(Some).ok_or_else(|| {
            "no cgroup v2 mount at /sys/fs/cgroup/unified or /sys/fs/cgroup".to_owned()
        }),
    }
}

fn cgroup2(cgroup: &Result<Option<PathBuf>, String>) -> Check {
    match cgroup {
        Ok(None) => Check::new("cgroup2", true, "socket LB off (--cgroup none)", EBPF),
        Ok(Some(dir)) if dir.is_dir() => Check::new(
            "cgroup2",
            true,
            format!("socket LB hooks go on {}", dir.display()),
            EBPF,
        ),
        Ok(Some(dir)) => Check::new(
            "cgroup2",
            false,
            format!("{} is not a directory", dir.display()),
            EBPF,
        ),
        Err(e) => Check::new("cgroup2", false, e.clone(), EBPF),
    }
}

fn program_type(name: &str, kind: ProgramType) -> Check {
    let check = format!("prog:{name}");
    match is_program_supported(kind) {
        Ok(true) => Check::new(check, true, "a trivial program loads", EBPF),
        Ok(false) => Check::new(check, false, "the kernel refuses this program type", EBPF),
        Err(e) => Check::new(check, false, error_chain(&e), EBPF),
    }
}

fn map_type(name: &str, kind: MapType) -> Check {
    let check = format!("map:{name}");
    match is_map_supported(kind) {
        Ok(true) => Check::new(check, true, "a one-entry map is created", EBPF),
        Ok(false) => Check::new(check, false, "the kernel refuses this map type", EBPF),
        Err(e) => Check::new(check, false, error_chain(&e), EBPF),
    }
}

fn map_flag(name: &str, map_type: u32, flag: u32, what: &str) -> Check {
    let (key, value) = if map_type == BPF_MAP_TYPE_ARRAY {
        (4, 8)
    } else {
        (8, 8)
    };
    match create_map(map_type, key, value, flag) {
        Ok(_) => Check::new(name, true, what, EBPF),
        Err(e) => Check::new(name, false, format!("{what}: {e}"), EBPF),
    }
}

/// `bpf_map_lookup_elem` from `BPF_FUNC_map_lookup_elem`.
fn helper_name(helper: BpfHelper) -> String {
    let debug = format!("{helper:?}");
    format!(
        "bpf_{}",
        debug.strip_prefix("BPF_FUNC_").unwrap_or(debug.as_str())
    )
}

fn helper_check(type_name: &str, kind: ProgramType, id: BpfHelper) -> Check {
    let helper = helper_name(id);
    let check = format!("helper:{type_name}:{helper}");
    match is_helper_supported(kind, id) {
        Ok(true) => Check::new(check, true, "a program calling it loads", EBPF),
        Ok(false) => Check::new(
            check,
            false,
            format!("the verifier does not offer {helper} to {type_name} programs"),
            EBPF,
        ),
        Err(e) => Check::new(check, false, error_chain(&e), EBPF),
    }
}

/// Runs `program args` with its output captured, killed after [`COMMAND_PATIENCE`].
fn run_bounded(program: &str, args: &[&str]) -> io::Result<Output> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + COMMAND_PATIENCE;
    loop {
        if child.try_wait()?.is_some() {
            return child.wait_with_output();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{program} did not finish within {COMMAND_PATIENCE:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn first_line(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("")
        .to_owned()
}

/// The `nft` binary and its version, and whether it reaches nftables over netlink
/// (a read-only `nft list chains`: nft 1.0.6 reads every set element of every table
/// before `list tables`, slow on a node with big sets, while `list chains` reads
/// no element).
fn nft() -> Vec<Check> {
    const NFT: &[DataplaneMode] = &[Nftables];
    let version = match run_bounded("nft", &["--version"]) {
        Ok(out) if out.status.success() => Ok(first_line(&out.stdout)),
        Ok(out) => Err(format!(
            "nft --version: {} {}",
            out.status,
            first_line(&out.stderr)
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err("nft is not in PATH".to_owned()),
        Err(e) => Err(format!("nft --version: {e}")),
    };
    let (version_check, netlink) = match version {
        Ok(v) => (
            Check::new("nft", true, v, NFT),
            match run_bounded("nft", &["list", "chains"]) {
                Ok(out) if out.status.success() => Check::new(
                    "nft-netlink",
                    true,
                    "nft list chains answered over netlink",
                    NFT,
                ),
                Ok(out) => Check::new(
                    "nft-netlink",
                    false,
                    format!("nft list chains: {}", first_line(&out.stderr)),
                    NFT,
                ),
                Err(e) => Check::new("nft-netlink", false, format!("nft list chains: {e}"), NFT),
            },
        ),
        Err(why) => (
            Check::new("nft", false, why, NFT),
            Check::new("nft-netlink", false, "not probed: no nft binary", NFT),
        ),
    };
    vec![version_check, netlink]
}

#[cfg(test)]
mod tests;
