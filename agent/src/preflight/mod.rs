//! Preflight: what this kernel and process can run, and which data plane follows.
//!
//! [`probes`] asks the kernel directly (tiny maps and programs, the agent's own
//! programs through the verifier, real attachments in a private network namespace,
//! `nft` over netlink) instead of trusting version numbers; [`decide()`] turns the
//! recorded results into a [`Selection`] (or an error naming the failed checks).
//! `rune-agent preflight` prints both, and every production start runs them.
//!
//! For tests only, `RUNE_PREFLIGHT_FAIL=check,...` makes the named checks fail
//! (see [`INJECT_ENV`]).

pub mod decide;
pub mod deferred;
pub mod object;
pub mod probes;

pub use decide::{DecideError, Selection, decide};

use crate::config::{DataplaneMode, DataplaneRequest};
use serde::{Deserialize, Serialize};
use std::{fmt::Write as _, path::PathBuf};

/// Environment variable naming checks to fail, comma-separated: for tests only.
pub const INJECT_ENV: &str = "RUNE_PREFLIGHT_FAIL";

/// One check's result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Check {
    /// Stable name, e.g. `btf` or `load:rune_tc_ingress`.
    pub name: String,
    /// Whether it passed.
    pub passed: bool,
    /// What was found, or why it failed.
    pub detail: String,
    /// The modes that cannot run when it fails (empty: informational).
    pub needed_by: Vec<DataplaneMode>,
}

impl Check {
    /// A check result.
    pub fn new(
        name: impl Into<String>,
        passed: bool,
        detail: impl Into<String>,
        needed_by: &[DataplaneMode],
    ) -> Self {
        Self {
            name: name.into(),
            passed,
            detail: detail.into(),
            needed_by: needed_by.to_vec(),
        }
    }
}

/// Where the probes look; from the agent's settings.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// The cgroup v2 directory of the socket-LB hooks: `None` the cgroup v2 root,
    /// `Some(None)` socket LB off. The attach probe uses an empty child it creates
    /// there and removes.
    pub cgroup: Option<Option<PathBuf>>,
    /// Checks to report as failed whatever the probe found (testing only).
    pub inject_failures: Vec<String>,
    /// Leave the agent's own programs to the data plane's load (a production
    /// start): `load:*` and `attach:*` are recorded as [`deferred`] instead of
    /// loading and attaching a copy, so a start puts its programs through the
    /// verifier once. `rune-agent preflight` probes them.
    pub defer_programs: bool,
}

impl Options {
    /// Options with the injected failures of [`INJECT_ENV`].
    #[must_use]
    pub fn with_cgroup(cgroup: Option<Option<PathBuf>>) -> Self {
        let inject_failures = std::env::var(INJECT_ENV)
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        Self {
            cgroup,
            inject_failures,
            defer_programs: false,
        }
    }
}

/// Why preflight could not produce a report.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    /// An injected failure names no check (a typo in a test would otherwise pass).
    #[error("{INJECT_ENV} names unknown check {name:?} (known: {known})")]
    UnknownInjectedCheck {
        /// The unknown name.
        name: String,
        /// Every check name.
        known: String,
    },
}

/// Every check of one preflight run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// The kernel release (uname -r).
    pub kernel: String,
    /// The checks, in probe order.
    pub checks: Vec<Check>,
}

impl Report {
    /// The checks that failed and that `mode` needs.
    pub fn failed_for(&self, mode: DataplaneMode) -> impl Iterator<Item = &Check> {
        failed_for(&self.checks, mode)
    }

    /// Marks the named checks failed (testing only); every name must exist.
    pub fn inject_failures(&mut self, names: &[String]) -> Result<(), PreflightError> {
        for name in names {
            let Some(check) = self.checks.iter_mut().find(|c| &c.name == name) else {
                return Err(PreflightError::UnknownInjectedCheck {
                    name: name.clone(),
                    known: self
                        .checks
                        .iter()
                        .map(|c| c.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            };
            check.passed = false;
            check.detail = format!(
                "failure injected by {INJECT_ENV} (testing only); the probe said: {}",
                check.detail
            );
        }
        Ok(())
    }
}

/// The checks in `checks` that failed and that `mode` needs.
pub fn failed_for(checks: &[Check], mode: DataplaneMode) -> impl Iterator<Item = &Check> {
    checks
        .iter()
        .filter(move |c| !c.passed && c.needed_by.contains(&mode))
}

/// Runs every probe (the verifier checking the agent's programs takes longest), then
/// applies the injected failures.
pub fn run(options: &Options) -> Result<Report, PreflightError> {
    let mut report = Report {
        kernel: probes::kernel_release(),
        checks: probes::probe_all(options),
    };
    report.inject_failures(&options.inject_failures)?;
    Ok(report)
}

/// `rune-agent preflight --json`'s document: the checks and the decision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Outcome {
    /// The kernel release.
    pub kernel: String,
    /// `auto`, `ebpf`, `nftables` or `userspace`.
    pub requested: String,
    /// The modes whose checks all passed, best first.
    pub available: Vec<DataplaneMode>,
    /// The mode that would run; absent when none can.
    pub mode: Option<DataplaneMode>,
    /// Why that mode (or why none).
    pub reason: String,
    /// Every check.
    pub checks: Vec<Check>,
}

impl Outcome {
    /// The report and the decision for `requested`.
    #[must_use]
    pub fn new(report: &Report, requested: DataplaneRequest) -> Self {
        let (mode, reason) = match decide(requested, &report.checks) {
            Ok(s) => (Some(s.mode), s.reason),
            Err(e) => (None, e.to_string()),
        };
        Self {
            kernel: report.kernel.clone(),
            requested: requested.as_str().to_owned(),
            available: DataplaneMode::ALL
                .into_iter()
                .filter(|m| report.failed_for(*m).next().is_none())
                .collect(),
            mode,
            reason,
            checks: report.checks.clone(),
        }
    }

    /// The table `rune-agent preflight` prints.
    #[must_use]
    pub fn render(&self) -> String {
        let mut o = String::new();
        let w = self.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        let _ = writeln!(o, "kernel {}", self.kernel);
        let _ = writeln!(o, "{:w$}  {:4}  {:24}  DETAIL", "CHECK", "", "NEEDED BY");
        for c in &self.checks {
            let needed: Vec<&str> = c.needed_by.iter().map(|m| m.as_str()).collect();
            let needed = if needed.is_empty() {
                "-".to_owned()
            } else {
                needed.join(",")
            };
            let _ = writeln!(
                o,
                "{:w$}  {:4}  {needed:24}  {}",
                c.name,
                if c.passed { "ok" } else { "FAIL" },
                c.detail
            );
        }
        let available: Vec<&str> = self.available.iter().map(|m| m.as_str()).collect();
        let _ = writeln!(
            o,
            "available: {}",
            if available.is_empty() {
                "none".to_owned()
            } else {
                available.join(", ")
            }
        );
        match self.mode {
            Some(m) => {
                let _ = writeln!(
                    o,
                    "data plane: {m} (requested {}): {}",
                    self.requested, self.reason
                );
            }
            None => {
                let _ = writeln!(
                    o,
                    "data plane: none (requested {}): {}",
                    self.requested, self.reason
                );
            }
        }
        o
    }
}

#[cfg(test)]
mod tests;
