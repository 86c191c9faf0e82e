//! Preflight end to end: `rune-agent preflight --json` on this machine, the data
//! plane decision with injected probe failures (`RUNE_PREFLIGHT_FAIL`, testing
//! only), a forced mode that cannot run failing the start, and the choice showing
//! in `status` and `/metrics`.
//!
//! Needs root. Every agent process runs in a network namespace the test creates,
//! with its own state dir, cgroup and bpffs pin directory; preflight's own probes
//! attach only inside a private namespace and an empty child of the test's cgroup.

use std::{
    path::Path,
    process::{Command, Output, Stdio},
    sync::{Mutex, mpsc},
    time::Duration,
};

use rune_harness::{
    agent::{Agent, agent_bin, free_port, metric},
    bpffs::PinDir,
    cgroup::TestCgroup,
    netns::{NetNs, require_root},
};
use serde_json::Value;

/// One test at a time: each loads the agent's programs through the verifier.
static SERIAL: Mutex<()> = Mutex::new(());

/// How long one command or agent start may take.
const PATIENCE: Duration = Duration::from_secs(30);

/// Runs `cmd` to its end with output captured; killed (and the test failed) after
/// [`PATIENCE`].
fn finish(mut cmd: Command) -> Output {
    let child = cmd
        .env("RUNE_DNS_RESOLV_CONF", "/dev/null")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rune-agent");
    let pid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(PATIENCE) {
        Ok(out) => out.expect("waiting for rune-agent"),
        Err(_) => {
            // SAFETY: kill(2) on our own child, not reaped yet (its waiter still runs).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("rune-agent did not finish within {PATIENCE:?}");
        }
    }
}

/// `rune-agent preflight --json --cgroup CG ARGS` inside `ns`, with `env`.
fn preflight_json(
    ns: &NetNs,
    cgroup: &TestCgroup,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Output, Value) {
    let state = tempfile::tempdir().unwrap();
    let mut cmd = ns.command(agent_bin()).unwrap();
    cmd.arg("preflight")
        .arg("--json")
        .arg("--cgroup")
        .arg(cgroup.path())
        .arg("--state-dir")
        .arg(state.path())
        .args(args)
        .envs(env.iter().copied());
    let out = finish(cmd);
    let json: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "preflight --json printed no JSON ({e}): stdout {} stderr {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, json)
}

/// The check named `name` in a preflight document.
fn check<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {doc:#}"))
}

/// A production agent in `ns` (data plane `auto`) with its pins under `pins`, the
/// socket LB on `cgroup`, tc on `interfaces` and small maps; ready when returned.
fn start_production(
    ns: &NetNs,
    state: &Path,
    pins: &PinDir,
    cgroup: &str,
    interfaces: &str,
) -> Agent {
    let pin_dir = pins.path().display().to_string();
    let mut agent = Agent::start_in(
        ns,
        state,
        &[
            "--bpf-pin-dir",
            &pin_dir,
            "--cgroup",
            cgroup,
            "--interfaces",
            interfaces,
            "--lb-max-frontends",
            "64",
            "--maglev-table-size",
            "1021",
        ],
    );
    agent.wait_ready(PATIENCE);
    agent
}

/// `status -o json` of `agent`.
fn status_json(agent: &Agent) -> Value {
    let out = agent.cli(&["status", "-o", "json"], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Asserts that metric `name` in the `/metrics` text `text` reads `value`.
fn assert_metric(text: &str, name: &str, value: f64) {
    assert_eq!(metric(text, name), Some(value), "{name}: {text}");
}

/// Whether `dir` (a cgroup) has child cgroups.
fn has_children(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .any(|e| e.file_type().is_ok_and(|t| t.is_dir()))
}

#[test]
fn preflight_json_reports_this_machine_ebpf_capable() {
    require_root().unwrap();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ns = NetNs::new("pf-json").unwrap();
    let cgroup = TestCgroup::new("pf-json").unwrap();
    let (out, doc) = preflight_json(&ns, &cgroup, &[], &[]);
    assert!(out.status.success(), "{doc:#}");
    assert_eq!(doc["mode"], "ebpf", "{doc:#}");
    assert_eq!(doc["requested"], "auto");
    assert_eq!(
        doc["available"],
        serde_json::json!(["ebpf", "nftables", "userspace"]),
        "{doc:#}"
    );
    for name in [
        "bpf-syscall",
        "btf",
        "cap-bpf",
        "prog:cgroup_sock_addr",
        "map:lru_hash",
        "helper:sched_cls:bpf_l4_csum_replace",
        "load:rune_tc_ingress",
        "load:rune_connect6",
        "load:rune_xdp_lb",
        "attach:tc",
        "attach:xdp",
        "attach:cgroup",
        "nft",
        "nft-netlink",
    ] {
        assert_eq!(check(&doc, name)["passed"], true, "{name}: {doc:#}");
    }
    let kernel = check(&doc, "kernel");
    assert_eq!(kernel["detail"], doc["kernel"]);
    // The cgroup attach probe removed its child again.
    assert!(
        !has_children(cgroup.path()),
        "preflight left a cgroup behind"
    );
}

#[test]
fn auto_with_an_injected_ebpf_failure_would_choose_nftables() {
    require_root().unwrap();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ns = NetNs::new("pf-auto").unwrap();
    let cgroup = TestCgroup::new("pf-auto").unwrap();
    let (out, doc) = preflight_json(
        &ns,
        &cgroup,
        &[],
        &[("RUNE_PREFLIGHT_FAIL", "load:rune_tc_ingress")],
    );
    assert!(out.status.success(), "{doc:#}");
    assert_eq!(doc["mode"], "nftables", "{doc:#}");
    assert_eq!(
        doc["available"],
        serde_json::json!(["nftables", "userspace"])
    );
    let reason = doc["reason"].as_str().unwrap();
    assert!(
        reason.contains("ebpf unavailable: load:rune_tc_ingress"),
        "{reason}"
    );
    let failed = check(&doc, "load:rune_tc_ingress");
    assert_eq!(failed["passed"], false);
    assert!(
        failed["detail"]
            .as_str()
            .unwrap()
            .contains("RUNE_PREFLIGHT_FAIL")
    );

    // A forced mode is decided the same way; one that cannot run exits non-zero.
    let (out, doc) = preflight_json(
        &ns,
        &cgroup,
        &["--dataplane", "ebpf"],
        &[("RUNE_PREFLIGHT_FAIL", "btf")],
    );
    assert!(!out.status.success(), "{doc:#}");
    assert_eq!(doc["mode"], Value::Null);
    assert!(doc["reason"].as_str().unwrap().contains("btf ("), "{doc:#}");

    // A misspelt check name is refused rather than silently ignored.
    let mut cmd = ns.command(agent_bin()).unwrap();
    let state = tempfile::tempdir().unwrap();
    cmd.args(["preflight", "--state-dir"])
        .arg(state.path())
        .env("RUNE_PREFLIGHT_FAIL", "no-such-check");
    let out = finish(cmd);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unknown check \"no-such-check\""),
        "{stderr}"
    );
}

#[test]
fn forced_ebpf_with_an_injected_probe_failure_fails_the_start_naming_the_check() {
    require_root().unwrap();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ns = NetNs::new("pf-forced").unwrap();
    let cgroup = TestCgroup::new("pf-forced").unwrap();
    let pins = PinDir::new("pf-forced");
    let state = tempfile::tempdir().unwrap();
    let metrics_port = ns.run(free_port).unwrap().to_string();
    let mut cmd = ns.command(agent_bin()).unwrap();
    cmd.arg("run")
        .arg("--state-dir")
        .arg(state.path())
        .args(["--dataplane", "ebpf", "--interfaces", ""])
        .arg("--bpf-pin-dir")
        .arg(pins.path())
        .arg("--cgroup")
        .arg(cgroup.path())
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
        .env("RUNE_PREFLIGHT_FAIL", "btf,attach:tc");
    let out = finish(cmd);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the start succeeded: {stderr}");
    assert!(
        stderr.contains("--dataplane ebpf cannot run here: preflight checks failed: btf ("),
        "{stderr}"
    );
    assert!(stderr.contains("attach:tc ("), "{stderr}");
    // It failed before loading anything.
    assert!(!pins.path().exists(), "pins were created");
    assert!(!has_children(cgroup.path()));
}

#[test]
fn production_start_shows_the_choice_in_status_and_metrics() {
    require_root().unwrap();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ns = NetNs::new("pf-start").unwrap();
    let cgroup = TestCgroup::new("pf-start").unwrap();
    let pins = PinDir::new("pf-start");
    let state = tempfile::tempdir().unwrap();
    let cgroup_dir = cgroup.path().display().to_string();
    let mut agent = start_production(&ns, state.path(), &pins, &cgroup_dir, "");
    let text = agent.metrics_text();
    assert_metric(&text, "rune_dataplane_mode{mode=\"ebpf\"}", 1.0);
    assert_metric(&text, "rune_preflight_check{check=\"btf\"}", 1.0);
    assert_metric(
        &text,
        "rune_preflight_check{check=\"load:rune_xdp_lb\"}",
        1.0,
    );
    let status = status_json(&agent);
    assert_eq!(status["dataplane"], "ebpf");
    assert!(
        status["dataplaneReason"]
            .as_str()
            .unwrap()
            .starts_with("auto: all "),
        "{status:#}"
    );
    let checks = status["preflight"].as_array().unwrap();
    assert!(
        checks
            .iter()
            .any(|c| c["name"] == "nft-netlink" && c["passed"] == true),
        "{status:#}"
    );
    let out = agent.cli(&["status"], None);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("data plane: ebpf (auto: all "), "{text}");
    assert!(text.contains("preflight:  "), "{text}");
    assert_eq!(agent.terminate(PATIENCE), Some(0));
}

/// A production start defers the programs' verifier checks to the real load: when
/// that load fails (here the cgroup attachment: `--cgroup` names a directory that
/// is not a cgroup, which no preflight probe sees), `auto` records the failed check,
/// removes what the load created and runs nftables; a forced `ebpf` stops naming
/// the check and leaves no pins. A hook target that does not exist is a
/// configuration error: it stops the start in `auto` too, naming it.
#[test]
fn a_failed_real_load_falls_back_in_auto_and_stops_a_forced_ebpf() {
    require_root().unwrap();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ns = NetNs::new("pf-fallback").unwrap();
    let pins = PinDir::new("pf-fallback");
    let not_a_cgroup = tempfile::tempdir().unwrap();
    let not_a_cgroup = not_a_cgroup.path().display().to_string();
    let state = tempfile::tempdir().unwrap();
    let mut agent = start_production(&ns, state.path(), &pins, &not_a_cgroup, "lo");
    let status = status_json(&agent);
    assert_eq!(status["dataplane"], "nftables", "{status:#}");
    let reason = status["dataplaneReason"].as_str().unwrap();
    assert!(
        reason.starts_with("auto: ebpf unavailable: attach:cgroup (")
            && reason.contains(&not_a_cgroup),
        "{status:#}"
    );
    let checks = status["preflight"].as_array().unwrap();
    let attach_cgroup = checks
        .iter()
        .find(|c| c["name"] == "attach:cgroup")
        .unwrap();
    assert_eq!(attach_cgroup["passed"], false, "{status:#}");
    // The programs of the configured hooks went through the verifier before the
    // attachment failed: passed. What eBPF did not get to (no XDP interface) is
    // reported as not probed, not as passed by a probe.
    let detail = |name: &str| {
        let c = checks.iter().find(|c| c["name"] == name).unwrap();
        (
            c["passed"] == true,
            c["detail"].as_str().unwrap().to_owned(),
        )
    };
    for name in ["load:rune_tc_ingress", "load:rune_connect4"] {
        let (passed, detail) = detail(name);
        assert!(
            passed && detail.contains("verifier accepts it"),
            "{status:#}"
        );
    }
    let (_, xdp) = detail("load:rune_xdp_lb");
    assert!(xdp.starts_with("not probed at this start"), "{status:#}");
    let text = agent.metrics_text();
    assert_metric(&text, "rune_preflight_check{check=\"attach:cgroup\"}", 0.0);
    assert_metric(&text, "rune_dataplane_mode{mode=\"nftables\"}", 1.0);
    assert!(!pins.path().exists(), "the failed load left its pins");
    assert_eq!(agent.terminate(PATIENCE), Some(0));

    let run = |extra: &[&str]| {
        let state = tempfile::tempdir().unwrap();
        let mut cmd = ns.command(agent_bin()).unwrap();
        cmd.arg("run")
            .arg("--state-dir")
            .arg(state.path())
            .args(extra)
            .arg("--bpf-pin-dir")
            .arg(pins.path());
        let out = finish(cmd);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "the start succeeded: {stderr}");
        assert!(!pins.path().exists(), "the failed start left its pins");
        stderr
    };
    let stderr = run(&["--dataplane", "ebpf", "--cgroup", &not_a_cgroup]);
    assert!(
        stderr
            .contains("--dataplane ebpf cannot run here: preflight checks failed: attach:cgroup ("),
        "{stderr}"
    );
    // A mistyped interface stops the start in auto too.
    let stderr = run(&["--cgroup", "none", "--interfaces", "rune-no-such0"]);
    assert!(
        stderr.contains("interfaces: no interface \"rune-no-such0\" in this network namespace"),
        "{stderr}"
    );
}
