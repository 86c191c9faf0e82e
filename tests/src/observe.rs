//! `rune-agent observe -o json` as the policy tests use it: the first verdict an
//! agent streams while the test makes traffic.

use rune_harness::agent::agent_bin;
use std::{
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Command, Stdio},
    sync::mpsc,
    thread,
    time::Duration,
};

/// Runs `rune-agent observe -o json ARGS` against the agent of `state_dir` and
/// calls `attempt` (at most `attempts` times, waiting up to a second after each)
/// until `observe` prints a line: that line as JSON. Panics when none came.
pub fn first_event(
    state_dir: &Path,
    args: &[&str],
    attempts: usize,
    mut attempt: impl FnMut(),
) -> serde_json::Value {
    let mut observe = Command::new(agent_bin())
        .args(["observe", "-o", "json"])
        .args(args)
        .arg("--state-dir")
        .arg(state_dir)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = observe.stdout.take().unwrap();
    let (lines_tx, lines) = mpsc::channel();
    let reader = thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = None;
    for _ in 0..attempts {
        attempt();
        if let Ok(line) = lines.recv_timeout(Duration::from_secs(1)) {
            seen = Some(line);
            break;
        }
    }
    let _ = observe.kill();
    let _ = observe.wait();
    let _ = reader.join();
    let line = seen.expect("observe showed no verdict");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line}: {e}"))
}
