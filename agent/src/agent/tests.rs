//! The lifecycle's tests: fake subsystems that record what the agent does to them.

use std::{
    collections::BTreeMap,
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
};

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
