//! Which data plane runs, decided from recorded check results (a pure function, so
//! every kernel we cannot boot here is a unit test).

use super::{Check, failed_for};
use crate::config::{DataplaneMode, DataplaneRequest};

/// The data plane chosen, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// The mode.
    pub mode: DataplaneMode,
    /// Why, in words a user reads in the log and in `status`.
    pub reason: String,
}

/// No data plane can run as asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecideError {
    /// The forced mode needs checks that failed.
    #[error(
        "--dataplane {mode} cannot run here: preflight checks failed: {failed} \
         (run `rune-agent preflight` for every check, or choose --dataplane auto)"
    )]
    Unavailable {
        /// The mode asked for.
        mode: DataplaneMode,
        /// The failed checks with their reasons.
        failed: String,
    },
    /// `auto` found no mode whose checks all pass.
    #[error("no data plane can run here: {why} (run `rune-agent preflight` for every check)")]
    NoneAvailable {
        /// Each mode's failed checks.
        why: String,
    },
}

/// Failed checks named with their details; more are named only, the rest counted.
const DETAILED: usize = 3;
const NAMED: usize = 10;

/// The checks `mode` needs that failed, `name (detail)` for the first few, then
/// names, then a count (an unprivileged run fails dozens); empty when none failed.
fn failures(checks: &[Check], mode: DataplaneMode) -> String {
    let failed: Vec<&Check> = failed_for(checks, mode).collect();
    let mut parts: Vec<String> = failed
        .iter()
        .take(NAMED)
        .enumerate()
        .map(|(i, c)| {
            if i < DETAILED {
                format!("{} ({})", c.name, c.detail)
            } else {
                c.name.clone()
            }
        })
        .collect();
    if failed.len() > NAMED {
        parts.push(format!("and {} more", failed.len() - NAMED));
    }
    parts.join(", ")
}

/// How many checks `mode` needs (for the reason of a mode that passed them all).
fn needed(checks: &[Check], mode: DataplaneMode) -> usize {
    checks
        .iter()
        .filter(|c| c.needed_by.contains(&mode))
        .count()
}

/// Picks the data plane for `requested` from the checks: a forced mode runs only
/// when every check it needs passed; `auto` takes the first of eBPF, nftables and
/// userspace whose checks all passed, and says why the better ones were skipped.
pub fn decide(requested: DataplaneRequest, checks: &[Check]) -> Result<Selection, DecideError> {
    if let DataplaneRequest::Forced(mode) = requested {
        let failed = failures(checks, mode);
        if !failed.is_empty() {
            return Err(DecideError::Unavailable { mode, failed });
        }
        return Ok(Selection {
            mode,
            reason: format!(
                "forced by --dataplane {mode}; its {} checks passed",
                needed(checks, mode)
            ),
        });
    }
    let mut skipped: Vec<String> = Vec::new();
    for mode in DataplaneMode::ALL {
        let failed = failures(checks, mode);
        if failed.is_empty() {
            let passed = format!("all {} {mode} checks passed", needed(checks, mode));
            let reason = if skipped.is_empty() {
                format!("auto: {passed}")
            } else {
                format!("auto: {}; {passed}", skipped.join("; "))
            };
            return Ok(Selection { mode, reason });
        }
        skipped.push(format!("{mode} unavailable: {failed}"));
    }
    Err(DecideError::NoneAvailable {
        why: skipped.join("; "),
    })
}

#[cfg(test)]
mod tests;
