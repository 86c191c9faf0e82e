//! The CLI as a user meets it: working on the store with no agent running, the same
//! commands through a running agent's socket, clear errors for bad input, and an
//! identity and store that survive a restart. Then (issue 15) large files and
//! answers far over the transport's 4 MiB message limit through a running agent
//! (apply, get, status --all), a small summary, a duplicate VIP still refused with
//! the same error and an apply still all or nothing; a closed output pipe ending a
//! command quietly (exit status 141); and a start making the state dir private.
//! Needs no root.

use rune_harness::agent::{Agent, agent_bin, cli, eventually, free_port};
use std::{
    io::{BufRead as _, BufReader, Read as _},
    os::unix::fs::PermissionsExt,
    path::Path,
    process::{Command, Output, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

const PATIENCE: Duration = Duration::from_secs(20);

const WEB: &str = "apiVersion: rune/v1
kind: Service
metadata: {name: web}
spec:
  ports: [{name: http, port: 80, targetPort: 8080}]
  discovery: {vips: [198.18.100.10]}
---
apiVersion: rune/v1
kind: Endpoints
metadata: {name: web}
spec:
  endpoints: [{address: 127.0.0.2}, {address: 127.0.0.3, terminating: true}]
";

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn commands_work_on_the_store_without_an_agent() {
    let state = tempfile::tempdir().unwrap();
    let dir = state.path();

    let out = cli(dir, &["apply", "-f", "-"], Some(WEB));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        "service/default/web created\nendpoints/default/web created\n"
    );
    // Applying the same objects again changes nothing.
    let out = cli(dir, &["apply", "-f", "-"], Some(WEB));
    assert_eq!(
        stdout(&out),
        "service/default/web unchanged\nendpoints/default/web unchanged\n"
    );

    let out = cli(dir, &["get"], None);
    let table = stdout(&out);
    assert!(table.starts_with("KIND"), "{table}");
    assert!(
        table.contains("Service    default    web   198.18.100.10 80/TCP->8080"),
        "{table}"
    );
    assert!(table.contains("2 endpoints, 1 accepting"), "{table}");

    let out = cli(dir, &["get", "svc", "web", "-o", "json"], None);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["kind"], "Service");
    assert_eq!(doc["spec"]["ports"][0]["targetPort"], 8080);

    // What `get -o yaml` prints can be applied again unchanged.
    let out = cli(dir, &["get", "-o", "yaml"], None);
    let yaml = stdout(&out);
    let out = cli(dir, &["apply", "-f", "-"], Some(&yaml));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).lines().all(|l| l.ends_with(" unchanged")),
        "{}",
        stdout(&out)
    );

    let out = cli(dir, &["status"], None);
    let status = stdout(&out);
    assert!(status.contains("agent:      not running"), "{status}");
    assert!(status.contains("revision:   2"), "{status}");
    assert!(
        status.contains("backend 127.0.0.3:8080  terminating"),
        "{status}"
    );

    let out = cli(dir, &["delete", "endpoints", "web"], None);
    assert!(out.status.success());
    assert_eq!(stdout(&out), "endpoints/default/web deleted\n");
    let out = cli(dir, &["delete", "endpoints", "web"], None);
    assert!(
        !out.status.success(),
        "deleting a missing object is reported"
    );
    assert!(
        stderr(&out).contains("endpoints/default/web not found"),
        "{}",
        stderr(&out)
    );
    let out = cli(dir, &["get", "ep", "web"], None);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("not found"), "{}", stderr(&out));
}

#[test]
fn bad_input_is_refused_with_a_clear_error_and_nothing_is_stored() {
    let state = tempfile::tempdir().unwrap();
    let dir = state.path();
    // The second document is bad: the first must not be stored either.
    let bad = format!(
        "{WEB}---\napiVersion: rune/v1\nkind: Service\nmetadata: {{name: other}}\nspec: {{ports: [{{port: 70000}}]}}\n"
    );
    let out = cli(dir, &["apply", "-f", "-"], Some(&bad));
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("Service default/other: spec.ports[0].port"),
        "{err}"
    );
    assert!(err.contains("70000"), "{err}");
    // Not even an empty store was made.
    let out = cli(dir, &["get"], None);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("holds no embedded store"),
        "{}",
        stderr(&out)
    );
    assert!(std::fs::read_dir(dir).unwrap().next().is_none());

    let out = cli(dir, &["get", "pods"], None);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("unknown kind \"pods\""),
        "{}",
        stderr(&out)
    );

    // A bad setting is a usage error (exit 2) that names the setting.
    let out = cli(dir, &["run", "--dev", "--maglev-table-size", "100"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--maglev-table-size"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_running_agent_serves_the_cli_and_keeps_identity_and_store_across_restarts() {
    let state = tempfile::tempdir().unwrap();
    let dir = state.path();
    let mut agent = Agent::start(dir, &["--dev", "--dev-port-offset", "20000"]);
    agent.wait_ready(PATIENCE);
    let sock = dir.join("agent.sock");
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the socket is for the agent's own user only");

    let out = agent.cli(&["apply", "-f", "-"], Some(WEB));
    assert!(out.status.success(), "{}", stderr(&out));
    let status_at = |agent: &Agent, revision: u64| {
        eventually(PATIENCE, "status reaches the revision", || {
            let v: serde_json::Value =
                serde_json::from_slice(&agent.cli(&["status", "-o", "json"], None).stdout).ok()?;
            (v["revision"] == revision).then_some(v)
        })
    };
    let status = status_at(&agent, 2);
    assert_eq!(status["running"], true);
    assert_eq!(status["mode"], "dev");
    assert_eq!(status["dataplane"], "userspace");
    assert_eq!(status["ready"], true);
    let names: Vec<&str> = status["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["metrics", "localapi", "watch", "dataplane", "dns"]);
    let node_id = status["node"]["nodeId"].as_str().unwrap().to_owned();
    assert_eq!(agent.terminate(PATIENCE), Some(0));
    assert!(!sock.exists(), "the socket is removed on stop");

    // After a restart: same node id, same objects, revisions continue.
    let mut agent = Agent::start(dir, &["--dev", "--dev-port-offset", "20000"]);
    agent.wait_ready(PATIENCE);
    let status = status_at(&agent, 2);
    assert_eq!(status["node"]["nodeId"], node_id.as_str());
    assert_eq!(status["services"][0]["service"], "default/web");
    let out = agent.cli(&["delete", "svc", "web"], None);
    assert!(out.status.success(), "{}", stderr(&out));
    let status = status_at(&agent, 3);
    assert!(status["services"].as_array().unwrap().is_empty());

    // A second agent on the same state dir is refused, naming the reason.
    let second = cli(dir, &["run", "--dev"], None);
    assert!(!second.status.success());
    assert!(stderr(&second).contains("in use"), "{}", stderr(&second));
    assert_eq!(agent.terminate(PATIENCE), Some(0));
}

#[test]
fn settings_come_from_the_config_file_env_and_flags_in_that_order() {
    let state = tempfile::tempdir().unwrap();
    let dir = state.path();
    let config = dir.join("agent.yaml");
    // The file asks for dev mode and one offset; a flag overrides the offset; the
    // metrics address comes from the environment.
    std::fs::write(
        &config,
        "dev: true\ndevPortOffset: 30000\nreadyTimeoutSeconds: 10\n",
    )
    .unwrap();
    let metrics: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let config_arg = config.to_string_lossy().into_owned();
    let mut agent = Agent::start_with(
        dir,
        &["--config", &config_arg, "--dev-port-offset", "31000"],
        &[("RUNE_METRICS_ADDR", &metrics.to_string())],
        metrics,
    );
    agent.wait_ready(PATIENCE);
    let out = agent.cli(&["apply", "-f", "-"], Some(WEB));
    assert!(out.status.success(), "{}", stderr(&out));
    let listen = eventually(PATIENCE, "the port is listening", || {
        let v: serde_json::Value =
            serde_json::from_slice(&agent.cli(&["status", "-o", "json"], None).stdout).ok()?;
        assert_eq!(v["mode"], "dev", "dev mode from the file");
        v["services"][0]["ports"][0]["listen"]
            .as_str()
            .map(str::to_owned)
    });
    assert_eq!(
        listen, "127.0.0.1:31080",
        "the flag's offset wins over the file's"
    );
    assert_eq!(agent.terminate(PATIENCE), Some(0));
}

/// Services in the large file: with 10 endpoints each, ~5 MiB of YAML and ~6 MiB
/// of JSON on the wire.
const SERVICES: usize = 6_000;

/// The transport's default message limit, which large requests used to hit.
const GRPC_LIMIT: usize = 4 << 20;

/// Dev-mode port offset: service ports from 10000 up land beyond 65535, so the
/// agent's proxies bind nothing (the test is about the CLI, not 6,000 listeners).
const OFFSET: &str = "60000";

/// `n` services named `{prefix}-NNNNNN` from `first` on, each with its VIP
/// 10.<first+i> and 10 endpoints.
fn services_yaml(prefix: &str, first: usize, n: usize) -> String {
    let mut y = String::new();
    for i in first..first + n {
        let vip = std::net::Ipv4Addr::from(0x0a00_0000 + i as u32);
        y.push_str(&format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {prefix}-{i:06}}}\n\
             spec: {{ports: [{{name: http, port: {}, targetPort: 8080}}], discovery: {{vips: [{vip}]}}}}\n\
             ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {prefix}-{i:06}}}\nspec:\n  endpoints:\n",
            10_000 + i % 50_000
        ));
        for e in 0..10 {
            let addr = std::net::Ipv4Addr::from(0xac10_0000 + (i * 10 + e) as u32);
            y.push_str(&format!(
                "    - {{address: {addr}, node: node-{e}, ready: true}}\n"
            ));
        }
        y.push_str("---\n");
    }
    y
}

/// `rune-agent --state-dir DIR ARGS` with `-f FILE` data passed as a file.
fn apply_file(dir: &Path, file: &Path) -> Output {
    cli(dir, &["apply", "-f", &file.to_string_lossy()], None)
}

fn service_count(dir: &Path) -> usize {
    let out = cli(dir, &["get", "svc"], None);
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out).lines().count() - 1
}

#[test]
fn large_files_and_answers_go_through_the_running_agent() {
    let state = tempfile::tempdir().unwrap();
    let dir = state.path();
    let file = dir.join("large.yaml");
    std::fs::write(&file, services_yaml("svc", 0, SERVICES)).unwrap();
    let size = std::fs::metadata(&file).unwrap().len() as usize;
    assert!(size > GRPC_LIMIT, "the file is {size} bytes");

    let mut agent = Agent::start(dir, &["--dev", "--dev-port-offset", OFFSET]);
    agent.wait_ready(PATIENCE);

    // apply: one all-or-nothing apply of 12,000 objects, one line each.
    let out = apply_file(dir, &file);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines = stdout(&out);
    assert_eq!(lines.lines().count(), 2 * SERVICES);
    assert!(
        lines.lines().all(|l| l.ends_with(" created")),
        "{lines:.300}"
    );
    assert!(lines.contains("endpoints/default/svc-005999 created"));

    // get: JSON and YAML answers over 4 MiB, complete and valid.
    let out = agent.cli(&["get", "-o", "json"], None);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(out.stdout.len() > GRPC_LIMIT, "{} bytes", out.stdout.len());
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let items = list["items"].as_array().unwrap();
    assert_eq!(items.len(), 2 * SERVICES);
    assert_eq!(list["kind"], "List");
    assert_eq!(items[0]["metadata"]["name"], "svc-000000");
    assert_eq!(items[SERVICES]["kind"], "Endpoints");
    let out = agent.cli(&["get", "-o", "yaml"], None);
    assert!(out.status.success(), "{}", stderr(&out));
    let yaml = dir.join("back.yaml");
    std::fs::write(&yaml, &out.stdout).unwrap();
    // What `get -o yaml` printed applies again, unchanged, through the agent.
    let out = apply_file(dir, &yaml);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).lines().count(), 2 * SERVICES);
    assert!(stdout(&out).lines().all(|l| l.ends_with(" unchanged")));
    assert_eq!(service_count(dir), SERVICES);

    // status: a fast summary without the services, then one, then all of them.
    let started = Instant::now();
    let out = agent.cli(&["status", "-o", "json"], None);
    assert!(out.status.success(), "{}", stderr(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // The summary costs the same whatever the node carries (the whole document
    // took 5.5 s here, and timed out at 100,000 services): the agent must answer
    // status from status::LiveStatus.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the summary took {:?}: does run.rs hand the local API a status::LiveStatus?",
        started.elapsed()
    );
    assert_eq!(summary["objects"]["Service"], SERVICES);
    assert_eq!(summary["servicesOmitted"], SERVICES);
    assert_eq!(summary["services"].as_array().unwrap().len(), 0);
    assert_eq!(summary["mode"], "dev");
    let text = stdout(&agent.cli(&["status"], None));
    assert!(
        text.contains("6000 services, not listed (more than 20)"),
        "{text}"
    );
    let out = agent.cli(&["status", "svc-000042"], None);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("  default/svc-000042  [10.0.0.42]  endpoints: 10\n"),
        "{}",
        stdout(&out)
    );
    let out = agent.cli(&["status", "default/nope"], None);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("service default/nope not found"),
        "{}",
        stderr(&out)
    );
    let out = agent.cli(&["status", "--all", "-o", "json"], None);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(out.stdout.len() > GRPC_LIMIT, "{} bytes", out.stdout.len());
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let services = all["services"].as_array().unwrap();
    assert_eq!(services.len(), SERVICES);
    assert_eq!(services[SERVICES - 1]["service"], "default/svc-005999");
    assert_eq!(services[7]["backends"].as_array().unwrap().len(), 10);
    assert_eq!(all["running"], true);
    let out = agent.cli(&["status", "--all"], None);
    let text = stdout(&out);
    assert!(text.contains("agent:      running"), "{text:.300}");
    assert!(
        text.contains("  default/svc-005999  [10.0.23.111]"),
        "the last service is listed"
    );

    // A duplicate VIP is refused with the same error as ever, through the agent.
    let dup = "apiVersion: rune/v1\nkind: Service\nmetadata: {name: other}\n\
               spec: {ports: [{port: 80}], discovery: {vips: [10.0.0.5]}}\n";
    let out = agent.cli(&["apply", "-f", "-"], Some(dup));
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(
            "Service default/other: spec.discovery.vips[0]: VIP 10.0.0.5 is already used by Service default/svc-000005"
        ),
        "{}",
        stderr(&out)
    );

    // All or nothing: a large apply whose last service takes a used VIP stores
    // none of its 6,001 objects.
    let revision = summary["revision"].as_u64().unwrap();
    let mut bad = services_yaml("new", SERVICES, SERVICES / 2);
    bad.push_str(dup);
    let bad_file = dir.join("bad.yaml");
    std::fs::write(&bad_file, bad).unwrap();
    let out = apply_file(dir, &bad_file);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("VIP 10.0.0.5 is already used by Service default/svc-000005"),
        "{}",
        stderr(&out)
    );
    assert_eq!(service_count(dir), SERVICES);
    let v: serde_json::Value =
        serde_json::from_slice(&agent.cli(&["status", "-o", "json"], None).stdout).unwrap();
    assert_eq!(v["revision"].as_u64(), Some(revision));
    assert_eq!(agent.terminate(PATIENCE), Some(0));

    // Without an agent the store answers the same way.
    let out = cli(dir, &["status", "--all", "-o", "json"], None);
    assert!(out.status.success(), "{}", stderr(&out));
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(all["services"].as_array().unwrap().len(), SERVICES);
    assert_eq!(all["running"], false);
    let out = cli(dir, &["status", "-o", "json"], None);
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["servicesOmitted"], SERVICES);
}

/// Runs the CLI, reads one line of its output, closes the pipe and waits: what
/// `rune-agent ARGS | head -1` does. Returns that line, the exit code and stderr.
fn first_line_then_close(dir: &Path, args: &[&str]) -> (String, Option<i32>, String) {
    let mut child = Command::new(agent_bin())
        .arg("--state-dir")
        .arg(dir)
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    {
        let mut out = BufReader::new(child.stdout.take().unwrap());
        out.read_line(&mut first).unwrap();
    }
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    (first, status.code(), err)
}

#[test]
fn a_closed_output_pipe_ends_commands_quietly_with_status_141() {
    let state = tempfile::tempdir().unwrap();
    let dir = state.path();
    // Enough output to fill the pipe: 2,000 services.
    let out = cli(
        dir,
        &["apply", "-f", "-"],
        Some(&services_yaml("svc", 0, 2_000)),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let commands: [&[&str]; 4] = [
        &["get"],
        &["get", "-o", "yaml"],
        &["status", "--all"],
        &["status", "--all", "-o", "json"],
    ];
    // From the store, then through an agent.
    for args in commands {
        let (first, code, err) = first_line_then_close(dir, args);
        assert!(!first.is_empty(), "{args:?}");
        assert_eq!(code, Some(141), "{args:?}: {err}");
        assert_eq!(err, "", "{args:?}: nothing on stderr, no panic");
    }
    let mut agent = Agent::start(dir, &["--dev", "--dev-port-offset", OFFSET]);
    agent.wait_ready(PATIENCE);
    for args in commands {
        let (first, code, err) = first_line_then_close(dir, args);
        assert!(!first.is_empty(), "{args:?}");
        assert_eq!(code, Some(141), "{args:?}: {err}");
        assert_eq!(err, "", "{args:?}: nothing on stderr, no panic");
    }
    // The agent is unharmed.
    let out = agent.cli(&["status"], None);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(agent.terminate(PATIENCE), Some(0));
}

#[test]
fn a_start_makes_the_state_dir_private_and_says_what_it_changed() {
    let state = tempfile::tempdir().unwrap();
    let dir = state.path().join("rune");
    // A state dir as an earlier agent left it: 0755, with a 0644 store.
    let out = cli(
        &dir,
        &["apply", "-f", "-"],
        Some(&services_yaml("svc", 0, 1)),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let store = dir.join("store.redb");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;

    let metrics = format!("127.0.0.1:{}", free_port());
    let dns = format!("127.0.0.1:{}", free_port());
    let mut child = Command::new(agent_bin())
        .args(["run", "--dev", "--dev-port-offset", OFFSET])
        .args(["--metrics-addr", &metrics, "--dns-addr", &dns])
        .arg("--state-dir")
        .arg(&dir)
        .env("RUNE_DNS_RESOLV_CONF", "/dev/null")
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stderr_pipe = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr_pipe).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut log = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    while !log.iter().any(|l: &String| l.contains("agent ready")) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => log.push(rune_harness::agent::without_ansi_escapes(&line)),
            Err(_) => panic!("no \"agent ready\" in: {log:#?}"),
        }
    }
    let _ = child.kill();
    let _ = child.wait();

    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&store), 0o600);
    assert_eq!(mode(&dir.join("node-identity.json")), 0o600);
    let changed: Vec<&String> = log
        .iter()
        .filter(|l| l.contains("tightened permissions in the state dir"))
        .collect();
    assert_eq!(changed.len(), 2, "{log:#?}");
    assert!(
        changed
            .iter()
            .any(|l| l.contains("from=0755") && l.contains("to=0700")),
        "{changed:#?}"
    );
    assert!(
        changed
            .iter()
            .any(|l| l.contains("store.redb") && l.contains("from=0644") && l.contains("to=0600")),
        "{changed:#?}"
    );
}
