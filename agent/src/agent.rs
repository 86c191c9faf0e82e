//! The agent's lifecycle: a set of [`Subsystem`]s (data plane, DNS, forwarder, …) that
//! the [`Agent`] starts in registration order, waits on until they report ready, and
//! stops in reverse order.
//!
//! Subsystems are registered before [`Agent::start`] and follow the contract of
//! [`crate::subsystem`]. When one subsystem fails to start, everything already
//! started is stopped again, so a failed start leaves no task behind.

use std::{
    fmt,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{
    config::Mode,
    error_chain::error_chain,
    identity::Identity,
    metrics::{Metrics, SubsystemLabels},
    outbox::Outbox,
    subsystem::{Readiness, ReadySetter, StartContext, Subsystem, SubsystemError},
};

/// How long [`Agent::start`] waits for every subsystem to report ready, unless
/// configured.
pub const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Where a subsystem is in its lifecycle, as shown by `status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum SubsystemState {
    /// Registered, the agent has not started yet.
    Registered,
    /// Started (or starting), not ready yet.
    Starting,
    /// Reported ready.
    Ready,
    /// Did not report ready within the ready timeout, or lost its readiness.
    NotReady,
    /// Start failed; the subsystem was stopped again.
    Failed {
        /// The error, with its causes.
        reason: String,
    },
    /// Stopped.
    Stopped,
}

impl fmt::Display for SubsystemState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubsystemState::Registered => f.write_str("registered"),
            SubsystemState::Starting => f.write_str("starting"),
            SubsystemState::Ready => f.write_str("ready"),
            SubsystemState::NotReady => f.write_str("not ready"),
            SubsystemState::Failed { reason } => write!(f, "failed: {reason}"),
            SubsystemState::Stopped => f.write_str("stopped"),
        }
    }
}

/// One line of `status`: a subsystem and its state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubsystemStatus {
    /// The subsystem's name.
    pub name: String,
    /// Its lifecycle state.
    #[serde(flatten)]
    pub state: SubsystemState,
}

/// A subsystem whose stop returned an error.
#[derive(Debug)]
pub struct StopFailure {
    /// The subsystem's name.
    pub subsystem: String,
    /// What its stop returned.
    pub error: SubsystemError,
}

/// Errors of the agent's lifecycle.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The outbox handed in cannot hold anything.
    #[error("invalid outbox capacity {capacity}: must be at least 1")]
    InvalidOutboxCapacity {
        /// The rejected capacity.
        capacity: usize,
    },
    /// A subsystem name is empty; names label metrics and `status` lines.
    #[error("subsystem name must not be empty")]
    EmptySubsystemName,
    /// [`Agent::register`] was called after [`Agent::start`] (or [`Agent::stop`]).
    #[error("cannot register subsystem {name:?}: the agent has already been started")]
    RegisterAfterStart {
        /// The rejected subsystem's name.
        name: String,
    },
    /// Two subsystems with the same name.
    #[error("subsystem {name:?} is already registered")]
    DuplicateSubsystem {
        /// The duplicated name.
        name: String,
    },
    /// [`Agent::start`] was called twice.
    #[error("the agent has already been started")]
    AlreadyStarted,
    /// [`Agent::ready_err`] before [`Agent::start`].
    #[error("the agent has not been started")]
    NotStarted,
    /// The agent was stopped (before or while starting).
    #[error("the agent has been stopped")]
    Stopped,
    /// A subsystem's start returned an error; the agent stopped what it had started.
    #[error("subsystem {subsystem:?} failed to start")]
    StartFailed {
        /// The failing subsystem.
        subsystem: String,
        /// What its start returned.
        #[source]
        source: SubsystemError,
    },
    /// A subsystem's start did not return within the ready timeout; the agent
    /// stopped what it had started.
    #[error("subsystem {subsystem:?} did not return from start within {timeout:?}")]
    StartTimedOut {
        /// The hanging subsystem.
        subsystem: String,
        /// The ready timeout.
        timeout: Duration,
    },
    /// Some subsystems have not reported ready (within the ready timeout, or lost
    /// their readiness since).
    #[error("subsystems not ready (ready timeout {timeout:?}): {}", .subsystems.join(", "))]
    NotReady {
        /// Names of the subsystems that are not ready, in registration order.
        subsystems: Vec<String>,
        /// The configured ready timeout.
        timeout: Duration,
    },
    /// Some subsystems' stop returned an error; every subsystem was still stopped.
    #[error("failed to stop {}", describe_stop_failures(.failures))]
    StopFailed {
        /// Each failing subsystem with its error.
        failures: Vec<StopFailure>,
    },
}

fn describe_stop_failures(failures: &[StopFailure]) -> String {
    failures
        .iter()
        .map(|failure| format!("{:?}: {}", failure.subsystem, error_chain(&failure.error)))
        .collect::<Vec<_>>()
        .join("; ")
}

/// What an [`Agent`] needs: its identity, mode, outbox, tunables and the shared
/// metrics.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// The persisted node identity.
    pub identity: Identity,
    /// Production or dev.
    pub mode: Mode,
    /// The outbox subsystems queue into, built by the caller (it holds at least 1).
    pub outbox: Arc<Outbox>,
    /// How long start may take in all: every subsystem's start, then all readiness.
    pub ready_timeout: Duration,
    /// The metrics every subsystem updates.
    pub metrics: Arc<Metrics>,
}

impl AgentConfig {
    /// A config with the default ready timeout.
    pub fn new(identity: Identity, mode: Mode, outbox: Arc<Outbox>, metrics: Arc<Metrics>) -> Self {
        Self {
            identity,
            mode,
            outbox,
            ready_timeout: DEFAULT_READY_TIMEOUT,
            metrics,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    Starting,
    Started,
    Stopping,
    Stopped,
}

struct Entry {
    subsystem: Arc<dyn Subsystem>,
    name: String,
    state: SubsystemState,
    /// Set when start was called; taken when stop is called, so nothing stops twice.
    token: Option<CancellationToken>,
}

struct State {
    phase: Phase,
    entries: Vec<Entry>,
}

/// What the agent shares with its readiness watchers.
struct Shared {
    state: Mutex<State>,
    /// The whole agent's ready flag.
    ready: ReadySetter,
    metrics: Arc<Metrics>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        crate::lock::lock(&self.state)
    }

    fn set_metric(&self, name: &str, ready: bool) {
        self.metrics
            .subsystem_ready
            .get_or_create(&SubsystemLabels {
                subsystem: name.to_owned(),
            })
            .set(i64::from(ready));
    }

    fn set_entry_state(&self, state: &mut State, index: usize, new: SubsystemState) {
        if let Some(entry) = state.entries.get_mut(index) {
            self.set_metric(&entry.name, new == SubsystemState::Ready);
            entry.state = new;
        }
        self.publish(state);
    }

    /// The whole agent is ready when it has started everything and every subsystem
    /// reports ready.
    fn publish(&self, state: &State) {
        let ready = state.phase == Phase::Started
            && state
                .entries
                .iter()
                .all(|entry| entry.state == SubsystemState::Ready);
        self.ready.set(ready);
    }

    /// A subsystem's ready flag changed (or was first read).
    fn on_readiness(&self, index: usize, ready: bool) {
        let mut state = self.lock();
        if !matches!(state.phase, Phase::Starting | Phase::Started) {
            return;
        }
        let Some(entry) = state.entries.get(index) else {
            return;
        };
        let new = match (&entry.state, ready) {
            (SubsystemState::Starting | SubsystemState::NotReady, true) => SubsystemState::Ready,
            (SubsystemState::Ready, false) => SubsystemState::NotReady,
            _ => return,
        };
        self.set_entry_state(&mut state, index, new);
    }
}

/// The per-node daemon's core: owns the subsystems' lifecycle, the outbox, the
/// identity and the mode. Share it behind an `Arc`; every method takes `&self`.
pub struct Agent {
    identity: Identity,
    mode: Mode,
    ready_timeout: Duration,
    outbox: Arc<Outbox>,
    shared: Arc<Shared>,
    /// Serialises start and stop.
    lifecycle: tokio::sync::Mutex<()>,
    /// Cancelled by stop, so that a start in progress gives up at once.
    abort: CancellationToken,
    /// Parent of every subsystem's token and of the readiness watchers.
    root: CancellationToken,
    /// The agent's own tasks (readiness watchers).
    tasks: TaskTracker,
    /// Set once start has finished waiting for readiness (or failed, or stop ran).
    settled: watch::Sender<bool>,
}

impl Agent {
    /// An agent with no subsystems yet.
    pub fn new(config: AgentConfig) -> Result<Self, AgentError> {
        let capacity = config.outbox.capacity();
        if capacity == 0 {
            return Err(AgentError::InvalidOutboxCapacity { capacity });
        }
        let (ready, _) = Readiness::new();
        let (settled, _) = watch::channel(false);
        Ok(Self {
            identity: config.identity,
            mode: config.mode,
            ready_timeout: config.ready_timeout,
            outbox: config.outbox,
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    phase: Phase::Idle,
                    entries: Vec::new(),
                }),
                ready,
                metrics: config.metrics,
            }),
            lifecycle: tokio::sync::Mutex::new(()),
            abort: CancellationToken::new(),
            root: CancellationToken::new(),
            tasks: TaskTracker::new(),
            settled,
        })
    }

    /// This node's identity.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Production or dev.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The outbox subsystems queue logs and events into, for the forwarder to drain.
    pub fn outbox(&self) -> &Arc<Outbox> {
        &self.outbox
    }

    /// Adds a subsystem; it starts after those registered before it and stops before
    /// them. Only before [`Agent::start`].
    pub fn register(&self, subsystem: Arc<dyn Subsystem>) -> Result<(), AgentError> {
        let name = subsystem.name().to_owned();
        let mut state = self.shared.lock();
        if state.phase != Phase::Idle {
            return Err(AgentError::RegisterAfterStart { name });
        }
        if name.is_empty() {
            return Err(AgentError::EmptySubsystemName);
        }
        if state.entries.iter().any(|entry| entry.name == name) {
            return Err(AgentError::DuplicateSubsystem { name });
        }
        self.shared.set_metric(&name, false);
        state.entries.push(Entry {
            subsystem,
            name,
            state: SubsystemState::Registered,
            token: None,
        });
        Ok(())
    }

    /// Starts every subsystem in registration order, then waits for all of them to
    /// report ready, all within one ready timeout.
    ///
    /// Returns `Ok` once everything started, even when some subsystem did not become
    /// ready in time ([`Agent::ready_err`] says which). When a subsystem fails to
    /// start (or its start does not return within the ready timeout), every subsystem
    /// whose start was called, the failing one included, is stopped in reverse order
    /// and the error is returned; the agent is then stopped for good.
    pub async fn start(&self) -> Result<(), AgentError> {
        let guard = self.lifecycle.lock().await;
        let count = {
            let mut state = self.shared.lock();
            match state.phase {
                Phase::Idle => state.phase = Phase::Starting,
                Phase::Starting | Phase::Started => return Err(AgentError::AlreadyStarted),
                Phase::Stopping | Phase::Stopped => return Err(AgentError::Stopped),
            }
            state.entries.len()
        };
        // One deadline for the whole start: every subsystem's start and the wait for
        // readiness share `ready_timeout`, so start never blocks longer than that.
        let deadline = tokio::time::Instant::now() + self.ready_timeout;
        for index in 0..count {
            let Some((subsystem, name, token)) = self.begin_start(index) else {
                continue;
            };
            let ctx = StartContext::new(token.clone(), self.mode);
            tracing::debug!(subsystem = %name, "starting subsystem");
            let outcome = tokio::select! {
                biased;
                () = self.abort.cancelled() => return Err(AgentError::Stopped),
                outcome = tokio::time::timeout_at(deadline, subsystem.start(&ctx)) => outcome,
            };
            let (reason, error) = match outcome {
                Ok(Ok(())) => {
                    self.watch_readiness(index, subsystem.ready(), token);
                    continue;
                }
                Ok(Err(source)) => (
                    error_chain(&source),
                    AgentError::StartFailed {
                        subsystem: name,
                        source,
                    },
                ),
                Err(_elapsed) => (
                    format!(
                        "start did not return within the ready timeout ({:?})",
                        self.ready_timeout
                    ),
                    AgentError::StartTimedOut {
                        subsystem: name,
                        timeout: self.ready_timeout,
                    },
                ),
            };
            tracing::error!(error = %error_chain(&error), "start failed; stopping what was started");
            {
                let mut state = self.shared.lock();
                self.shared
                    .set_entry_state(&mut state, index, SubsystemState::Failed { reason });
            }
            for failure in self.shutdown().await {
                tracing::warn!(
                    subsystem = %failure.subsystem,
                    error = %error_chain(&failure.error),
                    "stop after failed start returned an error"
                );
            }
            return Err(error);
        }
        {
            let mut state = self.shared.lock();
            state.phase = Phase::Started;
            self.shared.publish(&state);
        }
        // Stop may run while we wait for readiness.
        drop(guard);

        let ready = self.readiness();
        let in_time = tokio::select! {
            biased;
            () = self.abort.cancelled() => return Err(AgentError::Stopped),
            waited = tokio::time::timeout_at(deadline, ready.wait()) => waited.is_ok(),
        };
        if !in_time {
            let mut state = self.shared.lock();
            for index in 0..state.entries.len() {
                let starting = state
                    .entries
                    .get(index)
                    .is_some_and(|entry| entry.state == SubsystemState::Starting);
                if starting {
                    self.shared
                        .set_entry_state(&mut state, index, SubsystemState::NotReady);
                }
            }
            drop(state);
            if let Some(error) = self.ready_err() {
                tracing::warn!(error = %error, "agent not ready in time");
            }
        }
        self.settled.send_replace(true);
        Ok(())
    }

    /// Marks entry `index` as starting and hands out what its start needs.
    fn begin_start(&self, index: usize) -> Option<(Arc<dyn Subsystem>, String, CancellationToken)> {
        let mut state = self.shared.lock();
        let token = self.root.child_token();
        let entry = state.entries.get_mut(index)?;
        entry.token = Some(token.clone());
        entry.state = SubsystemState::Starting;
        Some((entry.subsystem.clone(), entry.name.clone(), token))
    }

    /// Follows one subsystem's ready flag until the subsystem is stopped.
    fn watch_readiness(&self, index: usize, mut readiness: Readiness, token: CancellationToken) {
        let shared = Arc::clone(&self.shared);
        self.tasks.spawn(async move {
            loop {
                shared.on_readiness(index, readiness.current());
                tokio::select! {
                    () = token.cancelled() => break,
                    alive = readiness.changed() => if !alive { break },
                }
            }
        });
    }

    /// Resolves once start has finished waiting for readiness: every subsystem is
    /// ready or the ready timeout passed (check [`Agent::ready_err`]); at once after
    /// start when there are no subsystems; also after a failed start or a stop.
    pub async fn ready(&self) {
        let mut settled = self.settled.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = settled.wait_for(|settled| *settled).await;
    }

    /// Why the agent is not fully ready, naming the subsystems that are not;
    /// `None` when every subsystem reports ready.
    pub fn ready_err(&self) -> Option<AgentError> {
        let state = self.shared.lock();
        match state.phase {
            Phase::Idle => Some(AgentError::NotStarted),
            Phase::Stopping | Phase::Stopped => Some(AgentError::Stopped),
            Phase::Starting | Phase::Started => {
                let subsystems: Vec<String> = state
                    .entries
                    .iter()
                    .filter(|entry| entry.state != SubsystemState::Ready)
                    .map(|entry| entry.name.clone())
                    .collect();
                if subsystems.is_empty() && state.phase == Phase::Started {
                    None
                } else {
                    Some(AgentError::NotReady {
                        subsystems,
                        timeout: self.ready_timeout,
                    })
                }
            }
        }
    }

    /// The whole agent's ready flag (what `/readyz` serves): set while every
    /// subsystem reports ready, cleared again when one loses readiness or on stop.
    pub fn readiness(&self) -> Readiness {
        self.shared.ready.readiness()
    }

    /// Every registered subsystem with its state, in registration order.
    pub fn subsystems(&self) -> Vec<SubsystemStatus> {
        self.shared
            .lock()
            .entries
            .iter()
            .map(|entry| SubsystemStatus {
                name: entry.name.clone(),
                state: entry.state.clone(),
            })
            .collect()
    }

    /// Stops every started subsystem in reverse registration order, waiting for each
    /// to return. Safe before start, after a failed start, during start (which then
    /// returns [`AgentError::Stopped`]) and more than once. Every subsystem is stopped
    /// even when some return errors; those are reported together.
    pub async fn stop(&self) -> Result<(), AgentError> {
        self.abort.cancel();
        let _guard = self.lifecycle.lock().await;
        if self.shared.lock().phase == Phase::Stopped {
            return Ok(());
        }
        let failures = self.shutdown().await;
        if failures.is_empty() {
            Ok(())
        } else {
            Err(AgentError::StopFailed { failures })
        }
    }

    /// Stops every subsystem whose start was called, newest first, then the agent's
    /// own tasks. Called with the lifecycle lock held.
    async fn shutdown(&self) -> Vec<StopFailure> {
        let to_stop: Vec<(usize, String, Arc<dyn Subsystem>, CancellationToken)> = {
            let mut state = self.shared.lock();
            state.phase = Phase::Stopping;
            self.shared.publish(&state);
            state
                .entries
                .iter_mut()
                .enumerate()
                .rev()
                .filter_map(|(index, entry)| {
                    // Cloned, not taken: a token is cleared only once its subsystem's
                    // stop returned, so a shutdown cut short (its future dropped) is
                    // completed by the next one instead of skipping subsystems.
                    let token = entry.token.clone()?;
                    Some((index, entry.name.clone(), entry.subsystem.clone(), token))
                })
                .collect()
        };
        let mut failures = Vec::new();
        for (index, name, subsystem, token) in to_stop {
            tracing::debug!(subsystem = %name, "stopping subsystem");
            token.cancel();
            if let Err(error) = subsystem.stop().await {
                failures.push(StopFailure {
                    subsystem: name,
                    error,
                });
            }
            let mut state = self.shared.lock();
            if let Some(entry) = state.entries.get_mut(index) {
                entry.token = None;
            }
            let failed = state
                .entries
                .get(index)
                .is_some_and(|entry| matches!(entry.state, SubsystemState::Failed { .. }));
            if !failed {
                self.shared
                    .set_entry_state(&mut state, index, SubsystemState::Stopped);
            }
        }
        self.root.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        {
            let mut state = self.shared.lock();
            state.phase = Phase::Stopped;
            self.shared.publish(&state);
        }
        self.settled.send_replace(true);
        failures
    }
}

#[cfg(test)]
mod tests;
