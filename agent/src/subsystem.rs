//! The contract between the agent and each of its subsystems (data plane, DNS,
//! metrics listener, …): what a subsystem implements ([`Subsystem`]), what it is
//! given at start ([`StartContext`]), how it says it serves ([`Readiness`]) and how
//! it fails ([`SubsystemError`]).
//!
//! The rules: `start` returns promptly because long-running work goes into tasks the
//! subsystem owns; readiness is reported separately, through a [`Readiness`]; and
//! [`Subsystem::stop`] must be safe after a failed start or no start at all. The
//! lifecycle that drives the contract is [`crate::agent`].

use std::error::Error as StdError;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::Mode;

/// The observing side of a ready flag: cheap to clone, shared by whoever needs to
/// know (the agent, `/readyz`, tests).
///
/// Readiness can be lost again (a subsystem sets it back to not ready), so it is a
/// level, not a one-shot event.
#[derive(Clone, Debug)]
pub struct Readiness {
    rx: watch::Receiver<bool>,
}

/// The signalling side of a ready flag, kept by the component that becomes ready
/// (clones set the same flag, for a component whose tasks signal it).
#[derive(Clone, Debug)]
pub struct ReadySetter {
    tx: watch::Sender<bool>,
}

impl Readiness {
    /// A new flag, not ready yet: the setter goes to the component, the readiness to
    /// its observers (e.g. returned from [`Subsystem::ready`]).
    pub fn new() -> (ReadySetter, Readiness) {
        let (tx, rx) = watch::channel(false);
        (ReadySetter { tx }, Readiness { rx })
    }

    /// A readiness that is ready from the start, for subsystems with nothing to wait
    /// for.
    pub fn ready() -> Readiness {
        let (_tx, rx) = watch::channel(true);
        Readiness { rx }
    }

    /// Whether the flag is set right now.
    pub fn is_ready(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once the flag is set (at once if it already is). Never resolves if
    /// the setter was dropped without ever setting it: combine with a timeout or a
    /// cancellation token.
    pub async fn wait(&self) {
        let mut rx = self.rx.clone();
        if rx.wait_for(|ready| *ready).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Whether the flag is set right now, marking this value seen: [`Readiness::changed`]
    /// then waits for a newer one. For an observer that follows every change.
    pub fn current(&mut self) -> bool {
        *self.rx.borrow_and_update()
    }

    /// Waits until the flag changes after the value last seen through this handle;
    /// `false` when every setter is gone (it will never change again).
    pub async fn changed(&mut self) -> bool {
        self.rx.changed().await.is_ok()
    }
}

impl ReadySetter {
    /// Marks the component ready; observers waiting in [`Readiness::wait`] wake up.
    pub fn set_ready(&self) {
        self.set(true);
    }

    /// Marks the component not ready (again), e.g. when it lost what it needs to serve.
    pub fn set_not_ready(&self) {
        self.set(false);
    }

    /// Sets the flag; observers are woken only when the value changes.
    pub fn set(&self, ready: bool) {
        self.tx.send_if_modified(|current| {
            let changed = *current != ready;
            *current = ready;
            changed
        });
    }

    /// Another observer of this flag.
    pub fn readiness(&self) -> Readiness {
        Readiness {
            rx: self.tx.subscribe(),
        }
    }
}

/// What a subsystem gets when it is started.
#[derive(Clone, Debug)]
pub struct StartContext {
    /// Cancelled by the agent right before it calls [`Subsystem::stop`]: every task
    /// and loop the subsystem spawns should end on it.
    pub cancel: CancellationToken,
    /// The agent's mode.
    pub mode: Mode,
}

impl StartContext {
    /// A context with the given token and mode (the agent builds one per subsystem;
    /// subsystem tests build their own).
    pub fn new(cancel: CancellationToken, mode: Mode) -> Self {
        Self { cancel, mode }
    }
}

/// A type-erased error a subsystem keeps as the source of a [`SubsystemError`].
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Why a subsystem could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum SubsystemError {
    /// An I/O operation failed, e.g. binding a listener or opening a file.
    #[error("{context}")]
    Io {
        /// What was being done, with the offending value (`bind 127.0.0.123:53`).
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The subsystem's own typed error, kept as the source so it can be downcast.
    #[error("{context}")]
    Failed {
        /// What was being done, with the offending value.
        context: String,
        /// The underlying error.
        #[source]
        source: BoxError,
    },
    /// The subsystem cannot run here (missing kernel feature, not allowed in this
    /// mode, …).
    #[error("unavailable: {reason}")]
    Unavailable {
        /// Why, in words a user can act on.
        reason: String,
    },
}

impl SubsystemError {
    /// Wraps a subsystem's own error with what it was doing.
    pub fn failed(context: impl Into<String>, source: impl Into<BoxError>) -> Self {
        SubsystemError::Failed {
            context: context.into(),
            source: source.into(),
        }
    }

    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        SubsystemError::Io {
            context: context.into(),
            source,
        }
    }
}

/// A node-local component the agent owns: data plane, DNS, forwarder, ingress, …
///
/// Object safe, so the agent keeps `Arc<dyn Subsystem>`.
#[async_trait]
pub trait Subsystem: Send + Sync {
    /// A stable identifier for logs, metrics and `status`; unique within an agent.
    fn name(&self) -> &str;

    /// Takes ownership of the subsystem's work and returns promptly: long-running
    /// work goes into tasks the subsystem owns, ending on `ctx.cancel`. `Ok` means the
    /// subsystem accepted the work; readiness is reported through [`Subsystem::ready`].
    ///
    /// The agent may drop this future before it completes (start took longer than the
    /// ready timeout, or the agent is being stopped); it then calls
    /// [`Subsystem::stop`].
    async fn start(&self, ctx: &StartContext) -> Result<(), SubsystemError>;

    /// The subsystem's ready flag, set once it serves traffic. Called once, after a
    /// successful start.
    fn ready(&self) -> Readiness;

    /// Releases every resource and waits for every task to end. Must be safe after a
    /// failed start or no start at all. The start context's token is already
    /// cancelled when this is called.
    async fn stop(&self) -> Result<(), SubsystemError>;
}

#[cfg(test)]
mod tests;
