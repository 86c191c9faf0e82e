//! Builds the eBPF programs (`agent-ebpf`) with aya-build, so a plain `cargo build`
//! produces an agent with its programs embedded (see `src/dataplane/ebpf/loader.rs`).
//!
//! The nested build makes both binaries of `agent-ebpf`: the agent's object, copied
//! to `$OUT_DIR` and embedded, and the test-only object (`agent-ebpf-test`: programs
//! only tests and benches load), which stays in `target/agent-ebpf-build/` where the
//! tests find it (`rune_harness::test_programs`). The agent never carries it.
//!
//! * `AYA_BUILD_SKIP=1` builds the agent without programs: an empty object is
//!   embedded and the loader says so at run time.
//! * A missing eBPF toolchain (nightly, its `rust-src`, `bpf-linker`) fails the build
//!   with one line that names the missing piece and the command that installs it.

use std::{
    env,
    ffi::OsStr,
    fs::{self, File},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, anyhow};

/// The package holding the programs; its binary is copied to `$OUT_DIR/agent-ebpf`.
const EBPF_PACKAGE: &str = "agent-ebpf";
/// Its second binary, the test-only programs (left in the shared build directory).
const TEST_OBJECT: &str = "agent-ebpf-test";
/// The toolchain aya-build compiles the programs with (`Toolchain::default()`).
const EBPF_TOOLCHAIN: &str = "nightly";

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let object = out_dir.join(EBPF_PACKAGE);

    if skip_requested() {
        // Replace any object from an earlier build: "skip" must mean "no programs".
        fs::write(&object, b"").with_context(|| format!("writing {}", object.display()))?;
        println!("cargo:warning=AYA_BUILD_SKIP is set: rune-agent is built without eBPF programs");
        return Ok(());
    }

    let bpf_linker = match check_toolchain() {
        Ok(bpf_linker) => bpf_linker,
        Err(missing) => {
            println!("cargo::error=eBPF toolchain missing ({missing}): run `cargo xtask setup`");
            return Ok(());
        }
    };
    // A new linker (e.g. after `cargo xtask setup`) must relink the programs.
    println!("cargo:rerun-if-changed={}", bpf_linker.display());

    let metadata = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let package_dir = |name: &str| -> anyhow::Result<PathBuf> {
        let package = metadata
            .packages
            .iter()
            .find(|p| p.name.as_str() == name)
            .ok_or_else(|| anyhow!("package {name} not found in the workspace"))?;
        let dir = package
            .manifest_path
            .parent()
            .ok_or_else(|| anyhow!("{} has no parent", package.manifest_path))?;
        Ok(dir.as_std_path().to_owned())
    };
    let ebpf_dir = package_dir(EBPF_PACKAGE)?;
    // The programs' map types live here; aya-build only watches the eBPF crate itself.
    println!(
        "cargo:rerun-if-changed={}",
        package_dir("agent-common")?.display()
    );

    // One nested build for every profile and tool (build, test, clippy, release):
    // each has its own OUT_DIR, and a cold build of the programs (core from source)
    // takes ~40 s on two cores. aya-build builds into and copies to `OUT_DIR`, so
    // point it at a directory shared through the target dir, under a lock so
    // concurrent cargo invocations never copy a half-written object.
    let shared = metadata
        .target_directory
        .as_std_path()
        .join("agent-ebpf-build");
    fs::create_dir_all(&shared).with_context(|| format!("creating {}", shared.display()))?;
    let lock_path = shared.join(".lock");
    let lock =
        File::create(&lock_path).with_context(|| format!("creating {}", lock_path.display()))?;
    lock.lock()
        .with_context(|| format!("locking {}", lock_path.display()))?;
    // SAFETY: this build script runs no other threads at this point (cargo metadata
    // was a child process that has exited), so nothing reads the environment while
    // it changes.
    unsafe { env::set_var("OUT_DIR", &shared) };

    let root_dir = ebpf_dir
        .to_str()
        .ok_or_else(|| anyhow!("non-UTF-8 path {}", ebpf_dir.display()))?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: EBPF_PACKAGE,
            root_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )?;
    let built = shared.join(EBPF_PACKAGE);
    fs::copy(&built, &object)
        .with_context(|| format!("copying {} to {}", built.display(), object.display()))?;
    let test_object = shared.join(TEST_OBJECT);
    if !test_object.is_file() {
        return Err(anyhow!("aya-build produced no {}", test_object.display()));
    }
    drop(lock);
    if !object.is_file() {
        return Err(anyhow!("aya-build produced no {}", object.display()));
    }
    Ok(())
}

/// Whether `AYA_BUILD_SKIP` asks for a build without programs (as aya-build reads it).
fn skip_requested() -> bool {
    env::var_os("AYA_BUILD_SKIP")
        .is_some_and(|v| v == OsStr::new("1") || v.eq_ignore_ascii_case("true"))
}

/// Checks the pieces aya-build needs; returns bpf-linker's path, or what is missing.
fn check_toolchain() -> Result<PathBuf, String> {
    let bpf_linker = find_on_path("bpf-linker").ok_or("bpf-linker not on PATH")?;
    if find_on_path("rustup").is_none() {
        return Err("rustup not on PATH".into());
    }
    let sysroot = Command::new("rustup")
        .args(["run", EBPF_TOOLCHAIN, "rustc", "--print", "sysroot"])
        .env_remove("RUSTUP_TOOLCHAIN")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| PathBuf::from(s.trim()))
        .ok_or_else(|| format!("no {EBPF_TOOLCHAIN} toolchain"))?;
    let core = sysroot.join("lib/rustlib/src/rust/library/core/Cargo.toml");
    if !core.is_file() {
        return Err(format!("no rust-src for {EBPF_TOOLCHAIN}"));
    }
    Ok(bpf_linker)
}

/// The first executable file called `name` in `$PATH`.
fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

/// Whether `path` is a regular file with an execute bit set.
fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
