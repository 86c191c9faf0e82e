//! `cargo xtask test`: everything CI checks, in order, stopping at the first failure.

use std::{
    io::{BufRead as _, BufReader},
    process::Stdio,
};

use anyhow::{Context as _, bail};

use crate::{setup, util};

/// Passed and failed tests summed over every `cargo test` step.
#[derive(Default)]
struct Tally {
    passed: u64,
    failed: u64,
}

impl Tally {
    /// Adds a libtest summary line (`test result: ok. 3 passed; 0 failed; ...`).
    fn add_line(&mut self, line: &str) {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(what), Some(n)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                _ => {}
            }
        }
    }
}

/// Runs a `cargo test` step, echoing its output and counting its results.
fn run_counted(name: &str, args: &[&str], tally: &mut Tally) -> anyhow::Result<()> {
    let mut cmd = util::cargo();
    cmd.args(args).stdout(Stdio::piped());
    let mut child = cmd
        .spawn()
        .with_context(|| format!("step {name}: could not start cargo"))?;
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line?;
            println!("{line}");
            tally.add_line(&line);
        }
    }
    let status = child.wait()?;
    if !status.success() {
        println!("{} passed, {} failed", tally.passed, tally.failed.max(1));
        bail!("step {name} failed ({status}): {}", util::describe(&cmd));
    }
    Ok(())
}

/// Runs setup, fmt, clippy, build, unit tests, then the end-to-end tests serially.
pub fn run() -> anyhow::Result<()> {
    setup::run().context("step setup failed")?;
    let steps: &[(&str, &[&str])] = &[
        ("fmt", &["fmt", "--all", "--", "--check"]),
        (
            "clippy",
            &[
                "clippy",
                "--workspace",
                "--exclude",
                "agent-ebpf",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ],
        ),
        // The end-to-end tests run target/debug/rune-agent: build the binaries first.
        (
            "build",
            &["build", "--workspace", "--exclude", "agent-ebpf", "--bins"],
        ),
        (
            "unit tests",
            &[
                "test",
                "--workspace",
                "--exclude",
                "agent-ebpf",
                "--exclude",
                "rune-agent-tests",
            ],
        ),
        // End-to-end tests share namespaces, ports and the agent binary: one at a time.
        (
            "end-to-end tests",
            &["test", "-p", "rune-agent-tests", "--", "--test-threads=1"],
        ),
    ];
    let mut tally = Tally::default();
    for (name, args) in steps {
        println!("==> {name}: cargo {}", args.join(" "));
        if args[0] == "test" {
            run_counted(name, args, &mut tally)?;
        } else {
            util::run_status(&format!("step {name}"), util::cargo().args(*args))?;
        }
    }
    println!("==> all steps passed");
    // The one summary line for every test run above (CI reads the closing line).
    println!("{} passed, {} failed", tally.passed, tally.failed);
    Ok(())
}

#[cfg(test)]
mod tests;
