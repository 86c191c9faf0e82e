//! `cargo xtask setup`: installs what building and testing the project needs on a
//! Debian 12 machine. Every item is checked first, so a second run is fast and needs
//! no network; one line per item says `ok` or what was done.

use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, anyhow};

use crate::util;

/// Debian packages the agent, its build, its tests and the benchmarks run: `nft`,
/// `ip`, `dnsmasq` (the DNS benchmark's reference server), `ethtool` (the test
/// topology turns off TX checksum offload on veths, which XDP needs), `wrk` and
/// `nginx` (the client and backends of the short-connection bench, `bench reuse`),
/// `protoc` with the well-known `.proto` files (the etcd client's build compiles
/// etcd's API with it), `etcd` with `etcdctl` and `openssl` (the etcd tests
/// start their own etcd, with certificates they make), `pebble` (the ACME test
/// server the ingress tests issue certificates from) and `haproxy` (the second
/// reference proxy of `bench ingress`).
const APT_PACKAGES: &[&str] = &[
    "nftables",
    "iproute2",
    "dnsmasq-base",
    "ethtool",
    "wrk",
    "nginx-light",
    "protobuf-compiler",
    "libprotobuf-dev",
    "etcd-server",
    "etcd-client",
    "openssl",
    "pebble",
    "haproxy",
];
/// Packages whose install starts and enables a machine-wide service when systemd
/// runs (etcd on 127.0.0.1:2379, haproxy); nothing here uses them (tests and benches
/// start their own), so setup stops and disables the ones its own install started.
const PACKAGED_SERVICES: &[(&str, &str)] = &[
    ("etcd-server", "etcd.service"),
    ("haproxy", "haproxy.service"),
];
/// The toolchain the eBPF programs are built with (aya-build's default).
const NIGHTLY: &str = "nightly";
/// bpf-linker's semver range; `bpf-linker --version` must start with this.
const BPF_LINKER_VERSION: &str = "0.13";
/// Where bpffs is mounted (aya pins maps there).
const BPFFS: &str = rune_harness::bpffs::BPFFS;

/// Checks and, where missing, installs every item.
pub fn run() -> anyhow::Result<()> {
    apt_packages()?;
    stable_components()?;
    nightly()?;
    rust_src()?;
    bpf_linker()?;
    bpffs()?;
    Ok(())
}

fn report(item: &str, state: &str) {
    println!("setup: {item:<24} {state}");
}

fn apt_packages() -> anyhow::Result<()> {
    let installed = |pkg: &str| {
        util::output(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
            .is_some_and(|s| s.trim() == "install ok installed")
    };
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| !installed(p))
        .collect();
    for pkg in APT_PACKAGES.iter().filter(|p| !missing.contains(p)) {
        report(&format!("apt {pkg}"), "ok");
    }
    if missing.is_empty() {
        return Ok(());
    }
    if !util::is_root() {
        // Dev mode needs none of them; the privileged tests (run as root) do.
        for pkg in &missing {
            report(
                &format!("apt {pkg}"),
                &format!("missing (not root: `sudo apt-get install {pkg}`)"),
            );
        }
        return Ok(());
    }
    let apt = |args: &[&str]| {
        let mut cmd = Command::new("apt-get");
        cmd.args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null());
        cmd
    };
    util::run_status("apt-get update", &mut apt(&["update", "-q"]))?;
    let mut install = apt(&["install", "-y", "-q", "--no-install-recommends"]);
    install.args(&missing);
    util::run_status("apt-get install", &mut install)?;
    for pkg in &missing {
        report(&format!("apt {pkg}"), "installed");
    }
    for (package, unit) in PACKAGED_SERVICES {
        if missing.contains(package) {
            stop_packaged_service(unit);
        }
    }
    Ok(())
}

/// Stops and disables the machine-wide service that installing a Debian package
/// just started (only where systemd runs; elsewhere the package starts nothing).
fn stop_packaged_service(unit: &str) {
    if !Path::new("/run/systemd/system").is_dir() {
        return;
    }
    let stopped = Command::new("systemctl")
        .args(["disable", "--now", unit])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let state = if stopped {
        "stopped and disabled (tests start their own)".to_string()
    } else {
        format!("could not be disabled: `systemctl disable --now {unit}`")
    };
    report(unit, &state);
}

/// `rustup run nightly ...`, with the caller's toolchain choice removed.
fn nightly_cmd(program: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", NIGHTLY, program])
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("CARGO");
    cmd
}

fn nightly_sysroot() -> Option<PathBuf> {
    util::output(nightly_cmd("rustc").args(["--print", "sysroot"])).map(|s| PathBuf::from(s.trim()))
}

fn nightly() -> anyhow::Result<()> {
    if nightly_sysroot().is_some() {
        report("rust nightly", "ok");
        return Ok(());
    }
    // bpf-linker must link the same LLVM major as this nightly; bpf_linker() derives
    // the feature from whatever nightly is installed here.
    util::run_status(
        "rustup toolchain install",
        Command::new("rustup").args(["toolchain", "install", NIGHTLY, "--profile", "minimal"]),
    )?;
    report("rust nightly", "installed");
    Ok(())
}

/// rustfmt and clippy for the default toolchain (`cargo xtask test` runs both).
fn stable_components() -> anyhow::Result<()> {
    for (component, probe) in [("rustfmt", "fmt"), ("clippy", "clippy")] {
        if util::output(util::cargo().args([probe, "--version"])).is_some() {
            report(component, "ok");
            continue;
        }
        util::run_status(
            &format!("rustup component add {component}"),
            Command::new("rustup").args(["component", "add", component]),
        )?;
        report(component, "installed");
    }
    Ok(())
}

fn rust_src() -> anyhow::Result<()> {
    let sysroot = nightly_sysroot().ok_or_else(|| anyhow!("no {NIGHTLY} toolchain"))?;
    if sysroot
        .join("lib/rustlib/src/rust/library/core/Cargo.toml")
        .is_file()
    {
        report("rust-src (nightly)", "ok");
        return Ok(());
    }
    util::run_status(
        "rustup component add rust-src",
        Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", NIGHTLY]),
    )?;
    report("rust-src (nightly)", "installed");
    Ok(())
}

fn bpf_linker() -> anyhow::Result<()> {
    let wanted = format!("bpf-linker {BPF_LINKER_VERSION}.");
    if util::output(Command::new("bpf-linker").arg("--version"))
        .is_some_and(|v| v.trim().starts_with(&wanted))
    {
        report("bpf-linker", "ok");
        return Ok(());
    }
    // Build bpf-linker against the nightly's own libLLVM, so both use one LLVM. The
    // prefix must outlive the install: bpf-linker's rpath points into it.
    let sysroot = nightly_sysroot().ok_or_else(|| anyhow!("no {NIGHTLY} toolchain"))?;
    let llvm = find_libllvm(&sysroot.join("lib"))?;
    let major = llvm_major()?;
    let prefix = llvm_prefix()?;
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    let llvm_name = llvm
        .file_name()
        .ok_or_else(|| anyhow!("{} has no file name", llvm.display()))?;
    for link in [lib.join("libLLVM.so"), lib.join(llvm_name)] {
        if link.symlink_metadata().is_ok() {
            fs::remove_file(&link).with_context(|| format!("removing {}", link.display()))?;
        }
        symlink(&llvm, &link).with_context(|| format!("linking {}", link.display()))?;
    }
    let mut install = util::cargo();
    install
        .args(["install", "bpf-linker", "--version"])
        .arg(format!("^{BPF_LINKER_VERSION}"))
        .args(["--no-default-features", "--features"])
        .arg(format!("llvm-{major}"))
        // An installed but broken bpf-linker (its libLLVM gone after a nightly
        // update) must be rebuilt, not reported as "already installed".
        .arg("--force")
        .env("LLVM_PREFIX", &prefix);
    util::run_status("cargo install bpf-linker", &mut install)?;
    report("bpf-linker", "installed");
    Ok(())
}

/// The nightly's shared libLLVM (`libLLVM.so.<version>-rust-<version>`).
fn find_libllvm(lib_dir: &Path) -> anyhow::Result<PathBuf> {
    let entries =
        fs::read_dir(lib_dir).with_context(|| format!("reading {}", lib_dir.display()))?;
    entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM.so."))
        })
        .ok_or_else(|| anyhow!("no libLLVM.so.* in {}", lib_dir.display()))
}

/// The LLVM major version of the nightly (`LLVM version: 22.1.4` → 22).
fn llvm_major() -> anyhow::Result<u32> {
    let version = util::output(nightly_cmd("rustc").arg("-vV"))
        .ok_or_else(|| anyhow!("`rustc -vV` failed for {NIGHTLY}"))?;
    version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .and_then(|major| major.trim().parse().ok())
        .ok_or_else(|| anyhow!("no LLVM version in `rustc -vV`:\n{version}"))
}

/// A stable home for the libLLVM symlinks bpf-linker is built and run against.
fn llvm_prefix() -> anyhow::Result<PathBuf> {
    let home = std::env::var_os("HOME").ok_or_else(|| anyhow!("HOME not set"))?;
    Ok(PathBuf::from(home).join(".cache/rune-llvm"))
}

fn bpffs() -> anyhow::Result<()> {
    if rune_harness::bpffs::is_bpffs(Path::new(BPFFS)) {
        report("bpffs", "ok");
    } else if !util::is_root() {
        report(
            "bpffs",
            &format!("not mounted at {BPFFS} (needs root), skipped"),
        );
    } else {
        rune_harness::bpffs::ensure_mounted()?;
        report("bpffs", "mounted");
    }
    Ok(())
}
