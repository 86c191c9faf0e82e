//! `cargo xtask build-ebpf`: builds only the eBPF programs, as agent/build.rs does
//! through aya-build, into `target/ebpf`, and prints the objects' paths: the agent's
//! (`agent-ebpf`), then the test-only programs' (`agent-ebpf-test`).

use std::{env, ffi::OsString, path::PathBuf};

use anyhow::Context as _;

use crate::util;

/// The bpf target the programs are built for (little-endian hosts only, as today).
const TARGET: &str = "bpfel-unknown-none";

/// Builds `agent-ebpf` with the nightly toolchain and prints the objects' paths.
pub fn run() -> anyhow::Result<()> {
    let objects = build()?;
    println!("{}", objects.agent.display());
    println!("{}", objects.test.display());
    Ok(())
}

/// The two objects of `agent-ebpf`.
pub struct Objects {
    /// What the agent embeds and loads.
    pub agent: PathBuf,
    /// The programs only tests and benches load (`rune_harness::test_programs`).
    pub test: PathBuf,
}

/// Builds `agent-ebpf` with the nightly toolchain; returns the objects' paths.
pub fn build() -> anyhow::Result<Objects> {
    let target_dir = util::target_dir().join("ebpf");
    // The same flags aya-build passes (bpf_target_arch cfg, BTF, full debug info).
    let mut rustflags = OsString::new();
    rustflags.push(format!("--cfg=bpf_target_arch=\"{}\"", env::consts::ARCH));
    rustflags.push("\x1f-Cdebuginfo=2\x1f-Clink-arg=--btf");

    let mut cmd = std::process::Command::new("rustup");
    cmd.current_dir(util::workspace_root())
        .args([
            "run",
            "nightly",
            "cargo",
            "build",
            "--package",
            "agent-ebpf",
        ])
        .args([
            "--bins",
            "--release",
            "--target",
            TARGET,
            "-Z",
            "build-std=core",
        ])
        .arg("--target-dir")
        .arg(&target_dir)
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags)
        // Let rustup pick the nightly's own cargo and rustc, not ours.
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO");
    util::run_status("build-ebpf", &mut cmd)
        .context("is the eBPF toolchain installed? run `cargo xtask setup`")?;

    let dir = target_dir.join(TARGET).join("release");
    Ok(Objects {
        agent: dir.join("agent-ebpf"),
        test: dir.join(rune_harness::test_programs::OBJECT),
    })
}
