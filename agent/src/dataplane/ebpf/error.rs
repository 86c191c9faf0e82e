//! The eBPF data plane's errors: [`EbpfError`] for loading, attaching and pinning,
//! [`MapsError`] for one map operation; a leaf module, so every other one can
//! return them without importing another.

use aya::{
    maps::MapError,
    programs::{ProgramError, XdpMode},
};
use std::path::{Path, PathBuf};

/// What can go wrong while loading, attaching or reading the agent's eBPF programs.
#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    /// The binary carries no eBPF object: it was built with `AYA_BUILD_SKIP=1`.
    #[error(
        "this rune-agent was built without eBPF programs (AYA_BUILD_SKIP=1); \
         rebuild it with the eBPF toolchain (`cargo xtask setup`)"
    )]
    NotEmbedded,

    /// The object could not be parsed, relocated, or its maps created.
    #[error("loading the embedded eBPF object ({size} bytes) failed")]
    Object {
        /// Size of the embedded object in bytes.
        size: usize,
        /// aya's error (boxed: it is large, and errors travel by value).
        #[source]
        source: Box<aya::EbpfError>,
    },

    /// The object has no program of this name (the programs and the loader disagree).
    #[error("eBPF program {name} not found in the embedded object")]
    ProgramNotFound {
        /// The program's name.
        name: &'static str,
    },

    /// The program exists but is of another type than expected.
    #[error("eBPF program {name} is not of the expected type")]
    ProgramType {
        /// The program's name.
        name: &'static str,
        /// aya's error (boxed, as are all large sources here).
        #[source]
        source: Box<ProgramError>,
    },

    /// The kernel refused the program; the source holds the verifier log.
    #[error("loading eBPF program {name} into the kernel failed")]
    ProgramLoad {
        /// The program's name.
        name: &'static str,
        /// aya's error; `ProgramError::LoadError` carries the verifier log.
        #[source]
        source: Box<ProgramError>,
    },

    /// Attaching the program to a network interface failed.
    #[error("attaching eBPF program {name} to interface {interface} ({mode:?}) failed")]
    Attach {
        /// The program's name.
        name: &'static str,
        /// The interface name.
        interface: String,
        /// The requested XDP mode.
        mode: XdpMode,
        /// aya's error (boxed, as are all large sources here).
        #[source]
        source: Box<ProgramError>,
    },

    /// Attaching a program to a hook (cgroup, tc, XDP) failed.
    #[error("attaching eBPF program {name} to {target} failed")]
    Hook {
        /// The program's name.
        name: &'static str,
        /// The cgroup path or interface name.
        target: String,
        /// aya's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// Pinning or unpinning under bpffs failed.
    #[error("eBPF pin {path}: {reason}")]
    Pin {
        /// The pin's path.
        path: PathBuf,
        /// The OS's reason.
        reason: String,
    },

    /// A load-balancer map could not be opened, read or written.
    #[error(transparent)]
    Maps(MapsError),

    /// A map pinned by an earlier agent has another key or value size than this
    /// agent's programs use (an upgrade changed its layout); loading would fail.
    #[error(
        "eBPF map {name} pinned in {dir} has (key, value) sizes {found:?}, this agent \
         needs {want:?}: stop the agent and run `rune-agent cleanup --bpf-pin-dir {dir}` \
         (established flows through the node are reset once)"
    )]
    PinnedLayout {
        /// The map's name.
        name: &'static str,
        /// The pin directory.
        dir: String,
        /// Key and value sizes of the pinned map.
        found: (u32, u32),
        /// Key and value sizes this agent needs.
        want: (u32, u32),
    },

    /// Conntrack of the previous layout could not be copied into the new maps.
    #[error("carrying eBPF map {name} over from the previous layout failed: {reason}")]
    CarryOver {
        /// The map's name.
        name: &'static str,
        /// aya's reason.
        reason: String,
    },

    /// The object has no map of this name.
    #[error("eBPF map {name} not found in the embedded object")]
    MapNotFound {
        /// The map's name.
        name: &'static str,
    },

    /// Opening or reading a map failed.
    #[error("reading eBPF map {name} failed")]
    Map {
        /// The map's name.
        name: &'static str,
        /// aya's error.
        #[source]
        source: MapError,
    },
}

impl EbpfError {
    /// A [`Self::Pin`] error at `path`.
    pub(super) fn pin(path: &Path, reason: impl ToString) -> Self {
        Self::Pin {
            path: path.to_owned(),
            reason: reason.to_string(),
        }
    }

    /// The kernel verifier's log when this error is a rejected program load.
    #[must_use]
    pub fn verifier_log(&self) -> Option<String> {
        match self {
            Self::ProgramLoad { source, .. } => match source.as_ref() {
                ProgramError::LoadError { verifier_log, .. } => Some(verifier_log.to_string()),
                _ => None,
            },
            _ => None,
        }
    }
}

/// A map operation that failed.
#[derive(Debug, thiserror::Error)]
#[error("eBPF map {map}: {op} failed: {reason}")]
pub struct MapsError {
    /// The map's name.
    pub map: &'static str,
    /// What was being done.
    pub op: &'static str,
    /// The OS's or aya's reason.
    pub reason: String,
}

impl MapsError {
    pub(super) fn new(map: &'static str, op: &'static str, reason: impl ToString) -> Self {
        Self {
            map,
            op,
            reason: reason.to_string(),
        }
    }
}

impl From<MapsError> for EbpfError {
    fn from(e: MapsError) -> Self {
        EbpfError::Maps(e)
    }
}

#[cfg(test)]
mod tests;
