//! The CLI as a user meets it: working on the store with no agent running, the same
//! commands through a running agent's socket, clear errors for bad input, and an
//! identity and store that survive a restart. Needs no root.

use rune_harness::agent::{Agent, cli, eventually, free_port};
use std::{os::unix::fs::PermissionsExt, process::Output, time::Duration};

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
        status.contains("backend 127.0.0.3  terminating"),
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
    let out = cli(dir, &["get"], None);
    assert_eq!(
        stdout(&out).lines().count(),
        1,
        "only the header: {}",
        stdout(&out)
    );

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
