//! `cargo xtask test`: everything CI checks, in order, stopping at the first failure.

use anyhow::Context as _;

use crate::{setup, util};

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
    for (name, args) in steps {
        println!("==> {name}: cargo {}", args.join(" "));
        util::run_status(&format!("step {name}"), util::cargo().args(*args))?;
    }
    println!("==> all steps passed");
    Ok(())
}
