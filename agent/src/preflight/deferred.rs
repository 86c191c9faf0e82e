//! The checks a production start leaves to the data plane's own load.
//!
//! `rune-agent preflight` puts a copy of the agent's programs through the verifier
//! and attaches them in a private namespace (`load:*`, `attach:*`). A production
//! start that goes on to load the real object would pay the verifier twice, so it
//! records those checks as [`placeholders`] (passed and needed by eBPF, so an
//! injected failure still decides as before) and fills them in from the real load:
//! [`record_loaded`] after it succeeded, [`failed_checks`] naming the step that
//! failed (auto then falls back, a forced mode stops naming the check),
//! [`record_not_probed`] when another data plane runs. A refused program reads the
//! same in both loads: `load_error`.

use super::{Check, DataplaneMode};
use crate::{
    dataplane::ebpf::{
        Attachment, EbpfError,
        attach::{Hooks, PROGRAMS},
    },
    error_chain::error_chain,
};
use agent_common::lb;
use aya::programs::ProgramError;

/// The detail of a check not probed yet; only checks with it are filled in.
pub const DEFERRED: &str = "deferred to the data plane's load (a production start verifies \
                            and attaches its programs once, there)";

const EBPF: &[DataplaneMode] = &[DataplaneMode::Ebpf];

/// The attach checks, by the hook names of [`Attachment::hook`] they cover.
const ATTACH_CHECKS: [(&str, &[&str]); 3] = [
    ("attach:xdp", &["xdp"]),
    ("attach:tc", &["tc-ingress", "tc-egress"]),
    ("attach:cgroup", &["cgroup"]),
];

/// The attach check covering program `name`.
fn attach_check(name: &str) -> &'static str {
    if name == lb::PROG_XDP_LB {
        "attach:xdp"
    } else if name == lb::PROG_TC_INGRESS || name == lb::PROG_TC_EGRESS {
        "attach:tc"
    } else {
        "attach:cgroup"
    }
}

/// The `load:*` and `attach:*` checks as deferred; `attach:cgroup` is informational
/// without a socket-LB cgroup, as the probe records it.
#[must_use]
pub fn placeholders(socket_lb: bool) -> Vec<Check> {
    let mut checks: Vec<Check> = PROGRAMS
        .iter()
        .map(|p| Check::new(format!("load:{p}"), true, DEFERRED, EBPF))
        .collect();
    for (name, _) in ATTACH_CHECKS {
        checks.push(if name == "attach:cgroup" && !socket_lb {
            Check::new(
                name,
                true,
                "not probed: socket LB off or no cgroup v2 (see cgroup2)",
                &[],
            )
        } else {
            Check::new(name, true, DEFERRED, EBPF)
        });
    }
    checks
}

/// Fills in the deferred checks from a load that succeeded with `attachments`:
/// programs it loaded passed the verifier; the others, and hooks not configured,
/// were not probed by this start (informational).
pub fn record_loaded(checks: &mut [Check], attachments: &[Attachment]) {
    for c in checks.iter_mut().filter(|c| c.detail == DEFERRED) {
        if let Some(program) = c.name.strip_prefix("load:") {
            *c = if let Some(a) = attachments.iter().find(|a| a.program == program) {
                verified(a.program)
            } else {
                not_probed(&c.name, "no hook of this start uses it")
            };
        } else if let Some((_, hooks)) = ATTACH_CHECKS.iter().find(|(n, _)| *n == c.name) {
            let mut targets: Vec<&str> = attachments
                .iter()
                .filter(|a| hooks.contains(&a.hook))
                .map(|a| a.target.as_str())
                .collect();
            targets.dedup();
            *c = if targets.is_empty() {
                not_probed(&c.name, "this start configures no such hook")
            } else {
                Check::new(
                    c.name.clone(),
                    true,
                    format!("attached at start to {}", targets.join(", ")),
                    EBPF,
                )
            };
        }
    }
}

/// The `load:*` check of `program`, which the data plane's load put through the
/// verifier.
fn verified(program: &str) -> Check {
    Check::new(
        format!("load:{program}"),
        true,
        "the verifier accepts it (loaded by the data plane at start)",
        EBPF,
    )
}

/// The detail of a `load:*` check whose program did not load: the syscall's error
/// and the verifier's last words (the probe's load and the data plane's read alike).
pub(crate) fn load_error(e: &ProgramError) -> String {
    match e {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = verifier_log.to_string();
            let tail: Vec<&str> = log
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            let tail = tail[tail.len().saturating_sub(2)..].join(" / ");
            format!("the verifier refused it ({io_error}): {tail}")
        }
        other => error_chain(other),
    }
}

/// Marks the deferred checks not probed: the data plane `mode` runs, not eBPF.
pub fn record_not_probed(checks: &mut [Check], mode: DataplaneMode) {
    for c in checks.iter_mut().filter(|c| c.detail == DEFERRED) {
        *c = not_probed(&c.name, &format!("the data plane is {mode}"));
    }
}

fn not_probed(name: &str, why: &str) -> Check {
    Check::new(
        name,
        true,
        format!("not probed at this start: {why} (`rune-agent preflight` probes it)"),
        &[],
    )
}

/// The checks a failed load of the eBPF data plane (configured with `hooks`)
/// decided, named as the probes name them: a rejected program fails its `load:*`,
/// an object whose maps cannot be created every `load:*`; a failed attachment
/// fails its hook's `attach:*`, and the `load:*` of every program of `hooks` passed
/// (they all went through the verifier first). Empty for errors no probe covers
/// (pins, map layouts): those stop the start.
#[must_use]
pub fn failed_checks(error: &EbpfError, hooks: &Hooks) -> Vec<Check> {
    let one = |name: String, detail: String| vec![Check::new(name, false, detail, EBPF)];
    match error {
        EbpfError::ProgramLoad { name, source } => one(format!("load:{name}"), load_error(source)),
        EbpfError::ProgramNotFound { name } | EbpfError::ProgramType { name, .. } => {
            one(format!("load:{name}"), error_chain(error))
        }
        EbpfError::Hook { name, .. } => {
            let mut checks = one(attach_check(name).to_owned(), error_chain(error));
            checks.extend(hooks.programs().into_iter().map(verified));
            checks
        }
        EbpfError::Object { .. } => PROGRAMS
            .iter()
            .map(|p| {
                Check::new(
                    format!("load:{p}"),
                    false,
                    format!("creating the object's maps: {}", error_chain(error)),
                    EBPF,
                )
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// Replaces the checks named in `decided` (from [`failed_checks`]) by them.
pub fn record_failed(checks: &mut [Check], decided: Vec<Check>) {
    for f in decided {
        if let Some(c) = checks.iter_mut().find(|c| c.name == f.name) {
            *c = f;
        }
    }
}

#[cfg(test)]
mod tests;
