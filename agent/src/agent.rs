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
};

/// The subsystem contract under the path it had before it moved to
/// [`crate::subsystem`], for the modules that still name it so (the local API and
/// the data plane's reconciler).
pub use crate::subsystem::{Readiness, ReadySetter, StartContext, Subsystem, SubsystemError};

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
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use async_trait::async_trait;
    use tokio::{sync::Notify, task::JoinHandle};

    use super::*;

    const PATIENCE: Duration = Duration::from_secs(2);

    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Behaviour {
        /// Ready as soon as it started.
        ReadyAtStart,
        /// Ready when the test calls `set_ready`.
        Manual,
        /// Start returns an error.
        FailStart,
        /// Start never returns.
        HangStart,
        /// Ready at start; stop returns an error.
        FailStop,
        /// Ready at start; stop waits until the test releases it.
        SlowStop,
    }

    type Log = Arc<Mutex<Vec<String>>>;

    /// A subsystem that records what happens to it and owns one task that ends on its
    /// token.
    struct Fake {
        name: String,
        behaviour: Behaviour,
        log: Log,
        setter: ReadySetter,
        readiness: Readiness,
        start_called: Notify,
        task: Mutex<Option<JoinHandle<()>>>,
        task_ended: Arc<AtomicBool>,
        token: Mutex<Option<CancellationToken>>,
        cancelled_before_stop: AtomicBool,
        stops: AtomicUsize,
        release_stop: Notify,
    }

    impl Fake {
        fn new(name: &str, behaviour: Behaviour, log: &Log) -> Arc<Self> {
            let (setter, readiness) = Readiness::new();
            Arc::new(Self {
                name: name.to_owned(),
                behaviour,
                log: log.clone(),
                setter,
                readiness,
                start_called: Notify::new(),
                task: Mutex::new(None),
                task_ended: Arc::new(AtomicBool::new(false)),
                token: Mutex::new(None),
                cancelled_before_stop: AtomicBool::new(false),
                stops: AtomicUsize::new(0),
                release_stop: Notify::new(),
            })
        }

        fn record(&self, what: &str) {
            self.log
                .lock()
                .unwrap()
                .push(format!("{what}:{}", self.name));
        }
    }

    #[async_trait]
    impl Subsystem for Fake {
        fn name(&self) -> &str {
            &self.name
        }

        async fn start(&self, ctx: &StartContext) -> Result<(), SubsystemError> {
            self.record("start");
            *self.token.lock().unwrap() = Some(ctx.cancel.clone());
            self.start_called.notify_one();
            match self.behaviour {
                Behaviour::FailStart => {
                    return Err(SubsystemError::io(
                        "bind 127.0.0.1:53",
                        std::io::Error::new(std::io::ErrorKind::AddrInUse, "boom"),
                    ));
                }
                Behaviour::HangStart => std::future::pending::<()>().await,
                _ => {}
            }
            let cancel = ctx.cancel.clone();
            let ended = self.task_ended.clone();
            *self.task.lock().unwrap() = Some(tokio::spawn(async move {
                cancel.cancelled().await;
                ended.store(true, Ordering::SeqCst);
            }));
            if matches!(
                self.behaviour,
                Behaviour::ReadyAtStart | Behaviour::FailStop | Behaviour::SlowStop
            ) {
                self.setter.set_ready();
            }
            Ok(())
        }

        fn ready(&self) -> Readiness {
            self.readiness.clone()
        }

        async fn stop(&self) -> Result<(), SubsystemError> {
            self.record("stop");
            self.stops.fetch_add(1, Ordering::SeqCst);
            let cancelled = self
                .token
                .lock()
                .unwrap()
                .as_ref()
                .is_none_or(CancellationToken::is_cancelled);
            self.cancelled_before_stop
                .store(cancelled, Ordering::SeqCst);
            if self.behaviour == Behaviour::SlowStop {
                self.release_stop.notified().await;
            }
            // Waits for the task, which ends only once the agent cancelled the token.
            let task = self.task.lock().unwrap().take();
            if let Some(task) = task {
                task.await.unwrap();
            }
            if self.behaviour == Behaviour::FailStop {
                return Err(SubsystemError::Unavailable {
                    reason: "flush failed".into(),
                });
            }
            Ok(())
        }
    }

    fn identity() -> Identity {
        Identity {
            node_id: "0123456789abcdef0123456789abcdef".into(),
            hostname: "node-a".into(),
            labels: BTreeMap::new(),
        }
    }

    fn agent_with(ready_timeout: Duration) -> (Arc<Agent>, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let outbox = Arc::new(Outbox::from_metrics(
            crate::config::DEFAULT_OUTBOX_CAPACITY,
            &metrics,
        ));
        let mut config = AgentConfig::new(identity(), Mode::Dev, outbox, metrics.clone());
        config.ready_timeout = ready_timeout;
        (Arc::new(Agent::new(config).unwrap()), metrics)
    }

    fn log() -> Log {
        Arc::new(Mutex::new(Vec::new()))
    }

    fn entries(log: &Log) -> Vec<String> {
        log.lock().unwrap().clone()
    }

    fn states(agent: &Agent) -> Vec<(String, SubsystemState)> {
        agent
            .subsystems()
            .into_iter()
            .map(|s| (s.name, s.state))
            .collect()
    }

    fn ready_metric(metrics: &Metrics, name: &str) -> i64 {
        metrics
            .subsystem_ready
            .get_or_create(&SubsystemLabels {
                subsystem: name.into(),
            })
            .get()
    }

    async fn stop_in_time(agent: &Agent) -> Result<(), AgentError> {
        tokio::time::timeout(PATIENCE, agent.stop())
            .await
            .expect("stop did not return")
    }

    use std::collections::BTreeMap;

    #[tokio::test]
    async fn a_stop_cut_short_is_completed_by_the_next_one() {
        let (agent, _) = agent_with(PATIENCE);
        let log = log();
        let a = Fake::new("a", Behaviour::ReadyAtStart, &log);
        let b = Fake::new("b", Behaviour::SlowStop, &log);
        agent.register(a.clone()).unwrap();
        agent.register(b.clone()).unwrap();
        agent.start().await.unwrap();
        // The first stop is abandoned while b is still stopping (e.g. a timeout).
        let cut = tokio::time::timeout(Duration::from_millis(100), agent.stop()).await;
        assert!(cut.is_err(), "b's stop should still be running");
        assert_eq!(a.stops.load(Ordering::SeqCst), 0);
        // The next stop finishes b and still stops a.
        b.release_stop.notify_one();
        stop_in_time(&agent).await.unwrap();
        assert_eq!(a.stops.load(Ordering::SeqCst), 1, "a was skipped");
        assert!(a.task_ended.load(Ordering::SeqCst) && b.task_ended.load(Ordering::SeqCst));
        assert_eq!(
            entries(&log),
            ["start:a", "start:b", "stop:b", "stop:b", "stop:a"]
        );
    }

    #[test]
    fn new_rejects_zero_outbox_capacity_and_exposes_config() {
        let metrics = Arc::new(Metrics::new());
        let outbox = |capacity| Arc::new(Outbox::from_metrics(capacity, &metrics));
        let mut config = AgentConfig::new(identity(), Mode::Dev, outbox(0), metrics.clone());
        assert_eq!(config.ready_timeout, DEFAULT_READY_TIMEOUT);
        let error = Agent::new(config.clone()).err().unwrap();
        assert!(matches!(
            error,
            AgentError::InvalidOutboxCapacity { capacity: 0 }
        ));
        config.outbox = outbox(2);
        let agent = Agent::new(config).unwrap();
        assert_eq!(agent.identity(), &identity());
        assert_eq!(agent.mode(), Mode::Dev);
        assert_eq!(agent.outbox().capacity(), 2);
    }

    #[tokio::test]
    async fn register_is_rejected_after_start_with_the_name() {
        let log = log();
        let (agent, _) = agent_with(PATIENCE);
        agent
            .register(Fake::new("a", Behaviour::ReadyAtStart, &log))
            .unwrap();
        let duplicate = agent.register(Fake::new("a", Behaviour::ReadyAtStart, &log));
        assert!(matches!(duplicate, Err(AgentError::DuplicateSubsystem { name }) if name == "a"));
        let empty = agent.register(Fake::new("", Behaviour::ReadyAtStart, &log));
        assert!(matches!(empty, Err(AgentError::EmptySubsystemName)));

        agent.start().await.unwrap();
        let late = agent.register(Fake::new("late", Behaviour::ReadyAtStart, &log));
        match late {
            Err(error @ AgentError::RegisterAfterStart { .. }) => {
                assert!(error.to_string().contains("\"late\""), "{error}");
            }
            other => panic!("expected RegisterAfterStart, got {other:?}"),
        }
        assert!(matches!(
            agent.start().await,
            Err(AgentError::AlreadyStarted)
        ));
        assert_eq!(agent.subsystems().len(), 1);
        stop_in_time(&agent).await.unwrap();
    }

    #[tokio::test]
    async fn starts_in_registration_order_and_stops_in_reverse() {
        let log = log();
        let (agent, metrics) = agent_with(PATIENCE);
        let fakes: Vec<_> = ["a", "b", "c"]
            .into_iter()
            .map(|n| Fake::new(n, Behaviour::ReadyAtStart, &log))
            .collect();
        for fake in &fakes {
            agent.register(fake.clone()).unwrap();
            assert_eq!(ready_metric(&metrics, &fake.name), 0);
        }
        assert!(
            states(&agent)
                .iter()
                .all(|(_, s)| *s == SubsystemState::Registered)
        );

        agent.start().await.unwrap();
        agent.ready().await;
        assert!(agent.ready_err().is_none(), "{:?}", agent.ready_err());
        assert!(agent.readiness().is_ready());
        assert!(
            states(&agent)
                .iter()
                .all(|(_, s)| *s == SubsystemState::Ready)
        );
        assert_eq!(ready_metric(&metrics, "b"), 1);
        assert!(
            metrics
                .encode()
                .contains("rune_subsystem_ready{subsystem=\"c\"} 1")
        );

        stop_in_time(&agent).await.unwrap();
        assert_eq!(
            entries(&log),
            [
                "start:a", "start:b", "start:c", "stop:c", "stop:b", "stop:a"
            ]
        );
        for fake in &fakes {
            assert!(
                fake.task_ended.load(Ordering::SeqCst),
                "{} task left",
                fake.name
            );
            assert!(
                fake.cancelled_before_stop.load(Ordering::SeqCst),
                "{} token not cancelled before stop",
                fake.name
            );
            assert_eq!(ready_metric(&metrics, &fake.name), 0);
        }
        assert!(!agent.readiness().is_ready());
        assert!(agent.tasks.is_empty(), "readiness watchers left behind");
        assert!(
            states(&agent)
                .iter()
                .all(|(_, s)| *s == SubsystemState::Stopped)
        );

        // Idempotent: nothing is stopped twice.
        stop_in_time(&agent).await.unwrap();
        assert!(fakes.iter().all(|f| f.stops.load(Ordering::SeqCst) == 1));
    }

    #[tokio::test]
    async fn failed_start_stops_what_started_in_reverse_and_leaves_no_task() {
        let log = log();
        let (agent, metrics) = agent_with(PATIENCE);
        let a = Fake::new("a", Behaviour::ReadyAtStart, &log);
        let b = Fake::new("b", Behaviour::Manual, &log);
        let c = Fake::new("c", Behaviour::FailStart, &log);
        let d = Fake::new("d", Behaviour::ReadyAtStart, &log);
        for fake in [&a, &b, &c, &d] {
            agent.register(fake.clone()).unwrap();
        }

        let error = tokio::time::timeout(PATIENCE, agent.start())
            .await
            .expect("start hung")
            .unwrap_err();
        match &error {
            AgentError::StartFailed { subsystem, source } => {
                assert_eq!(subsystem, "c");
                assert!(matches!(source, SubsystemError::Io { .. }));
            }
            other => panic!("expected StartFailed, got {other:?}"),
        }
        assert_eq!(
            entries(&log),
            [
                "start:a", "start:b", "start:c", "stop:c", "stop:b", "stop:a"
            ]
        );
        assert!(a.task_ended.load(Ordering::SeqCst));
        assert!(b.task_ended.load(Ordering::SeqCst));
        assert!(agent.tasks.is_empty(), "readiness watchers left behind");
        assert_eq!(d.stops.load(Ordering::SeqCst), 0, "d was never started");

        let states = states(&agent);
        assert_eq!(states[0].1, SubsystemState::Stopped);
        assert_eq!(states[1].1, SubsystemState::Stopped);
        match &states[2].1 {
            SubsystemState::Failed { reason } => {
                assert!(
                    reason.contains("bind 127.0.0.1:53") && reason.contains("boom"),
                    "{reason}"
                );
            }
            other => panic!("expected Failed, got {other:?}"),
        }
        assert_eq!(states[3].1, SubsystemState::Registered);
        assert_eq!(ready_metric(&metrics, "a"), 0);

        // Ready resolves, and the agent is finished.
        tokio::time::timeout(PATIENCE, agent.ready())
            .await
            .expect("ready did not resolve after a failed start");
        assert!(matches!(agent.ready_err(), Some(AgentError::Stopped)));
        assert!(matches!(agent.start().await, Err(AgentError::Stopped)));

        // Stop after a failed start is safe and stops nothing twice.
        stop_in_time(&agent).await.unwrap();
        for fake in [&a, &b, &c] {
            assert_eq!(fake.stops.load(Ordering::SeqCst), 1, "{}", fake.name);
        }
    }

    #[tokio::test]
    async fn start_that_never_returns_times_out_and_is_stopped() {
        let log = log();
        let (agent, _) = agent_with(Duration::from_millis(100));
        agent
            .register(Fake::new("a", Behaviour::ReadyAtStart, &log))
            .unwrap();
        agent
            .register(Fake::new("hang", Behaviour::HangStart, &log))
            .unwrap();

        let error = tokio::time::timeout(PATIENCE, agent.start())
            .await
            .expect("start hung")
            .unwrap_err();
        assert!(
            matches!(&error, AgentError::StartTimedOut { subsystem, timeout }
                if subsystem == "hang" && *timeout == Duration::from_millis(100)),
            "{error:?}"
        );
        assert!(error.to_string().contains("\"hang\""), "{error}");
        assert_eq!(
            entries(&log),
            ["start:a", "start:hang", "stop:hang", "stop:a"]
        );
    }

    #[tokio::test]
    async fn slow_subsystem_ready_within_timeout_makes_start_wait() {
        let log = log();
        let (agent, metrics) = agent_with(Duration::from_secs(5));
        let slow = Fake::new("slow", Behaviour::Manual, &log);
        agent.register(slow.clone()).unwrap();

        let start = tokio::spawn({
            let agent = agent.clone();
            async move { agent.start().await }
        });
        slow.start_called.notified().await;
        assert!(!agent.readiness().is_ready());
        assert!(
            !start.is_finished(),
            "start returned before the subsystem was ready"
        );
        assert!(agent.ready_err().is_some());

        slow.setter.set_ready();
        tokio::time::timeout(PATIENCE, start)
            .await
            .expect("start did not see readiness")
            .unwrap()
            .unwrap();
        agent.ready().await;
        assert!(agent.ready_err().is_none());
        assert!(agent.readiness().is_ready());
        assert_eq!(ready_metric(&metrics, "slow"), 1);
        stop_in_time(&agent).await.unwrap();
    }

    #[tokio::test]
    async fn subsystem_never_ready_is_named_after_the_timeout_and_may_become_ready_later() {
        let log = log();
        let timeout = Duration::from_millis(100);
        let (agent, metrics) = agent_with(timeout);
        agent
            .register(Fake::new("a", Behaviour::ReadyAtStart, &log))
            .unwrap();
        let late = Fake::new("late", Behaviour::Manual, &log);
        agent.register(late.clone()).unwrap();

        tokio::time::timeout(PATIENCE, agent.start())
            .await
            .expect("start did not give up waiting")
            .unwrap();
        tokio::time::timeout(PATIENCE, agent.ready())
            .await
            .expect("ready did not resolve after the timeout");
        match agent.ready_err() {
            Some(AgentError::NotReady {
                subsystems,
                timeout: t,
            }) => {
                assert_eq!(subsystems, ["late"]);
                assert_eq!(t, timeout);
            }
            other => panic!("expected NotReady, got {other:?}"),
        }
        assert_eq!(
            states(&agent),
            [
                ("a".to_owned(), SubsystemState::Ready),
                ("late".to_owned(), SubsystemState::NotReady)
            ]
        );
        assert_eq!(ready_metric(&metrics, "a"), 1);
        assert_eq!(ready_metric(&metrics, "late"), 0);
        assert!(!agent.readiness().is_ready());

        // Readiness that arrives late still makes the agent ready (/readyz flips).
        late.setter.set_ready();
        tokio::time::timeout(PATIENCE, agent.readiness().wait())
            .await
            .expect("agent readiness did not follow a late subsystem");
        assert!(agent.ready_err().is_none());
        assert_eq!(ready_metric(&metrics, "late"), 1);
        stop_in_time(&agent).await.unwrap();
    }

    #[tokio::test]
    async fn lost_readiness_clears_the_agents_readiness() {
        let log = log();
        let (agent, _) = agent_with(PATIENCE);
        let flaky = Fake::new("flaky", Behaviour::ReadyAtStart, &log);
        agent.register(flaky.clone()).unwrap();
        agent.start().await.unwrap();
        assert!(agent.readiness().is_ready());

        flaky.setter.set_not_ready();
        let mut readiness = agent.readiness();
        tokio::time::timeout(PATIENCE, async {
            while readiness.current() {
                readiness.changed().await;
            }
        })
        .await
        .expect("agent readiness did not drop");
        assert_eq!(states(&agent)[0].1, SubsystemState::NotReady);
        assert!(
            matches!(agent.ready_err(), Some(AgentError::NotReady { subsystems, .. }) if subsystems == ["flaky"])
        );
        stop_in_time(&agent).await.unwrap();
    }

    #[tokio::test]
    async fn no_subsystems_is_ready_at_once_after_start() {
        let (agent, _) = agent_with(DEFAULT_READY_TIMEOUT);
        let before = tokio::time::timeout(Duration::from_millis(20), agent.ready()).await;
        assert!(before.is_err(), "ready resolved before start");
        assert!(matches!(agent.ready_err(), Some(AgentError::NotStarted)));

        tokio::time::timeout(PATIENCE, agent.start())
            .await
            .expect("start waited with nothing to wait for")
            .unwrap();
        tokio::time::timeout(PATIENCE, agent.ready())
            .await
            .expect("ready did not resolve");
        assert!(agent.ready_err().is_none());
        assert!(agent.readiness().is_ready());
        stop_in_time(&agent).await.unwrap();
    }

    #[tokio::test]
    async fn stop_before_start_is_safe_and_final() {
        let log = log();
        let (agent, _) = agent_with(PATIENCE);
        let a = Fake::new("a", Behaviour::ReadyAtStart, &log);
        agent.register(a.clone()).unwrap();
        stop_in_time(&agent).await.unwrap();
        stop_in_time(&agent).await.unwrap();
        assert!(matches!(agent.start().await, Err(AgentError::Stopped)));
        assert!(matches!(
            agent.register(Fake::new("b", Behaviour::ReadyAtStart, &log)),
            Err(AgentError::RegisterAfterStart { .. })
        ));
        assert!(entries(&log).is_empty(), "{:?}", entries(&log));
    }

    #[tokio::test]
    async fn stop_during_a_hanging_start_returns_promptly() {
        let log = log();
        let (agent, _) = agent_with(Duration::from_secs(30));
        agent
            .register(Fake::new("a", Behaviour::ReadyAtStart, &log))
            .unwrap();
        let hang = Fake::new("hang", Behaviour::HangStart, &log);
        agent.register(hang.clone()).unwrap();

        let start = tokio::spawn({
            let agent = agent.clone();
            async move { agent.start().await }
        });
        hang.start_called.notified().await;
        stop_in_time(&agent).await.unwrap();
        let result = tokio::time::timeout(PATIENCE, start)
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(result, Err(AgentError::Stopped)), "{result:?}");
        assert_eq!(
            entries(&log),
            ["start:a", "start:hang", "stop:hang", "stop:a"]
        );
        assert!(agent.tasks.is_empty());
    }

    #[tokio::test]
    async fn stop_while_waiting_for_readiness_returns_promptly() {
        let log = log();
        let (agent, _) = agent_with(Duration::from_secs(30));
        let never = Fake::new("never", Behaviour::Manual, &log);
        agent.register(never.clone()).unwrap();

        let start = tokio::spawn({
            let agent = agent.clone();
            async move { agent.start().await }
        });
        never.start_called.notified().await;
        stop_in_time(&agent).await.unwrap();
        let result = tokio::time::timeout(PATIENCE, start)
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(result, Err(AgentError::Stopped)), "{result:?}");
        assert!(never.task_ended.load(Ordering::SeqCst));
        assert!(agent.tasks.is_empty());
        tokio::time::timeout(PATIENCE, agent.ready())
            .await
            .expect("ready did not resolve after stop");
    }

    #[tokio::test]
    async fn stop_errors_are_reported_after_stopping_everything() {
        let log = log();
        let (agent, _) = agent_with(PATIENCE);
        agent
            .register(Fake::new("a", Behaviour::ReadyAtStart, &log))
            .unwrap();
        agent
            .register(Fake::new("b", Behaviour::FailStop, &log))
            .unwrap();
        agent
            .register(Fake::new("c", Behaviour::ReadyAtStart, &log))
            .unwrap();
        agent.start().await.unwrap();

        let error = stop_in_time(&agent).await.unwrap_err();
        match &error {
            AgentError::StopFailed { failures } => {
                assert_eq!(failures.len(), 1);
                assert_eq!(failures[0].subsystem, "b");
            }
            other => panic!("expected StopFailed, got {other:?}"),
        }
        assert!(error.to_string().contains("flush failed"), "{error}");
        assert_eq!(
            entries(&log),
            [
                "start:a", "start:b", "start:c", "stop:c", "stop:b", "stop:a"
            ]
        );
        assert!(
            states(&agent)
                .iter()
                .all(|(_, s)| *s == SubsystemState::Stopped)
        );
    }

    #[test]
    fn status_serialises_for_the_status_command() {
        let status = SubsystemStatus {
            name: "dns".into(),
            state: SubsystemState::Failed {
                reason: "bind 127.0.0.123:53: address in use".into(),
            },
        };
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"name": "dns", "state": "failed", "reason": "bind 127.0.0.123:53: address in use"})
        );
        let ready = serde_json::to_value(SubsystemStatus {
            name: "dns".into(),
            state: SubsystemState::NotReady,
        })
        .unwrap();
        assert_eq!(
            ready,
            serde_json::json!({"name": "dns", "state": "not_ready"})
        );
        assert_eq!(SubsystemState::NotReady.to_string(), "not ready");
    }
}
