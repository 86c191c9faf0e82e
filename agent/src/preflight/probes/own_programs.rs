//! The probe that loads the agent's own programs (from a copy of its object whose
//! maps are not pinned) and attaches them where the eBPF mode would: XDP and tc on
//! `lo` of a private namespace, the socket hooks on an empty child cgroup.

use super::{Check, EBPF};
use crate::{
    dataplane::ebpf::{EMBEDDED_OBJECT, EbpfError, attach, programs_embedded},
    error_chain::error_chain,
    preflight::{deferred::load_error, object},
};
use agent_common::lb;
use aya::{
    EbpfLoader,
    programs::{
        CgroupAttachMode, CgroupSockAddr, Program, ProgramError, SchedClassifier, TcAttachType,
        Xdp, XdpMode,
    },
};
use std::{
    io,
    path::{Path, PathBuf},
};

/// Loads the agent's own programs (maps unpinned and tiny) and attaches them in
/// a private network namespace and an empty child cgroup, on a thread of its own
/// (the namespace belongs to that thread and ends with it).
pub(super) fn agent_programs(cgroup: Result<Option<PathBuf>, String>) -> Vec<Check> {
    let probe = std::thread::Builder::new()
        .name("preflight".into())
        .spawn(move || agent_programs_here(cgroup.ok().flatten()));
    let failed = |why: String| {
        attach::PROGRAMS
            .iter()
            .map(|p| format!("load:{p}"))
            .chain(["attach:xdp", "attach:tc", "attach:cgroup"].map(str::to_owned))
            .map(|name| Check::new(name, false, why.clone(), EBPF))
            .collect()
    };
    match probe {
        Ok(handle) => handle
            .join()
            .unwrap_or_else(|_| failed("the probe thread panicked".into())),
        Err(e) => failed(format!("starting the probe thread: {e}")),
    }
}

/// Map capacity in the probe: tiny, nothing is stored.
const PROBE_MAP_ENTRIES: u32 = 64;

fn agent_programs_here(cgroup: Option<PathBuf>) -> Vec<Check> {
    let mut checks = Vec::new();
    let loaded = if programs_embedded() {
        object::without_pins(EMBEDDED_OBJECT)
            .map_err(|e| e.to_string())
            .and_then(|copy| {
                let mut loader = EbpfLoader::new();
                for map in [
                    lb::SERVICES_V4,
                    lb::SERVICES_V6,
                    lb::BACKENDS,
                    lb::SERVICE_STATS,
                    lb::BACKEND_STATS,
                    lb::CONNTRACK_V4,
                    lb::CONNTRACK_V6,
                    lb::SOCK_REVERSE,
                    lb::AFFINITY,
                ] {
                    loader.map_max_entries(map, PROBE_MAP_ENTRIES);
                }
                loader
                    .load(copy.bytes())
                    .map_err(|e| format!("creating the object's maps: {}", error_chain(&e)))
            })
    } else {
        Err(EbpfError::NotEmbedded.to_string())
    };
    let mut ebpf = match loaded {
        Ok(ebpf) => ebpf,
        Err(why) => {
            for p in attach::PROGRAMS {
                checks.push(Check::new(format!("load:{p}"), false, why.clone(), EBPF));
            }
            for name in ["attach:xdp", "attach:tc", "attach:cgroup"] {
                checks.push(Check::new(
                    name,
                    false,
                    "not probed: no program loaded",
                    EBPF,
                ));
            }
            return checks;
        }
    };
    for name in attach::PROGRAMS {
        let result = match ebpf.program_mut(name) {
            Some(Program::Xdp(p)) => p.load().map_err(|e| load_error(&e)),
            Some(Program::SchedClassifier(p)) => p.load().map_err(|e| load_error(&e)),
            Some(Program::CgroupSockAddr(p)) => p.load().map_err(|e| load_error(&e)),
            Some(_) => Err("of an unexpected program type".to_owned()),
            None => Err("not in the embedded object".to_owned()),
        };
        checks.push(match result {
            Ok(()) => Check::new(
                format!("load:{name}"),
                true,
                "the verifier accepts it",
                EBPF,
            ),
            Err(why) => Check::new(format!("load:{name}"), false, why, EBPF),
        });
    }
    // SAFETY: unshare(2) on this thread only; it ends with the probe.
    let private_netns = if unsafe { libc::unshare(libc::CLONE_NEWNET) } == 0 {
        Ok(())
    } else {
        Err(format!(
            "creating a private network namespace for the probe: {}",
            io::Error::last_os_error()
        ))
    };
    checks.push(attach_xdp(&mut ebpf, &private_netns));
    checks.push(attach_tc(&mut ebpf, &private_netns));
    checks.push(attach_cgroup(&mut ebpf, cgroup.as_deref()));
    checks
}

fn attach_xdp(ebpf: &mut aya::Ebpf, netns: &Result<(), String>) -> Check {
    let result = netns.clone().and_then(|()| {
        let program: &mut Xdp = ebpf
            .program_mut(lb::PROG_XDP_LB)
            .ok_or("rune_xdp_lb missing")?
            .try_into()
            .map_err(|e: ProgramError| e.to_string())?;
        let link = program
            .attach("lo", XdpMode::Skb)
            .map_err(|e| error_chain(&e))?;
        program.detach(link).map_err(|e| error_chain(&e))
    });
    match result {
        Ok(()) => Check::new(
            "attach:xdp",
            true,
            "rune_xdp_lb attached to lo of a private namespace",
            EBPF,
        ),
        Err(why) => Check::new("attach:xdp", false, why, EBPF),
    }
}

fn attach_tc(ebpf: &mut aya::Ebpf, netns: &Result<(), String>) -> Check {
    let result = netns.clone().and_then(|()| {
        for (name, side) in [
            (lb::PROG_TC_INGRESS, TcAttachType::Ingress),
            (lb::PROG_TC_EGRESS, TcAttachType::Egress),
        ] {
            let program: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or(format!("{name} missing"))?
                .try_into()
                .map_err(|e: ProgramError| e.to_string())?;
            let link = match program.attach("lo", side) {
                Ok(link) => link,
                // Kernels before TCX (6.6) need a clsact qdisc; this namespace is ours.
                Err(_) => {
                    let _ = aya::programs::tc::qdisc_add_clsact("lo");
                    program.attach("lo", side).map_err(|e| error_chain(&e))?
                }
            };
            program.detach(link).map_err(|e| error_chain(&e))?;
        }
        Ok(())
    });
    match result {
        Ok(()) => Check::new(
            "attach:tc",
            true,
            "tc ingress and egress attached to lo of a private namespace",
            EBPF,
        ),
        Err(why) => Check::new("attach:tc", false, why, EBPF),
    }
}

/// An empty child cgroup, removed on drop.
struct ProbeCgroup(PathBuf);

impl Drop for ProbeCgroup {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir(&self.0) {
            tracing::warn!(cgroup = %self.0.display(), error = %e, "removing the preflight cgroup failed");
        }
    }
}

fn attach_cgroup(ebpf: &mut aya::Ebpf, parent: Option<&Path>) -> Check {
    let Some(parent) = parent else {
        return Check::new(
            "attach:cgroup",
            true,
            "not probed: socket LB off or no cgroup v2 (see cgroup2)",
            &[],
        );
    };
    let result = (|| -> Result<(), String> {
        let dir = parent.join(format!("rune-preflight-{}", std::process::id()));
        std::fs::create_dir(&dir)
            .map_err(|e| format!("creating the probe cgroup {}: {e}", dir.display()))?;
        let cgroup = ProbeCgroup(dir);
        let file = std::fs::File::open(&cgroup.0)
            .map_err(|e| format!("opening {}: {e}", cgroup.0.display()))?;
        let program: &mut CgroupSockAddr = ebpf
            .program_mut(lb::PROG_CONNECT4)
            .ok_or("rune_connect4 missing")?
            .try_into()
            .map_err(|e: ProgramError| e.to_string())?;
        let link = program
            .attach(&file, CgroupAttachMode::Single)
            .map_err(|e| error_chain(&e))?;
        program.detach(link).map_err(|e| error_chain(&e))
    })();
    match result {
        Ok(()) => Check::new(
            "attach:cgroup",
            true,
            format!(
                "rune_connect4 attached to an empty child of {}",
                parent.display()
            ),
            EBPF,
        ),
        Err(why) => Check::new("attach:cgroup", false, why, EBPF),
    }
}
