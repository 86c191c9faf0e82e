//! Agents on etcd end to end (no root): dev agents (`rune-agent run --dev
//! --etcd-endpoints …`, each with its own state dir, ports and metrics) sharing one
//! harness etcd, driven by `rune-agent apply/get/delete --etcd-endpoints` with no
//! agent in between; traffic through their dev proxies on 127.0.0.1 to TCP backends
//! the test runs on loopback. Then what etcd going away does: the data plane keeps
//! serving the last state (no request lost), `/readyz` stays ready, `status` and
//! `rune_store_connected` say it; compaction meanwhile is a resync; an agent started
//! while etcd is down waits for it; values other clients wrote that are not objects
//! are skipped; plain http:// off loopback is refused.

use rune_harness::{
    agent::{Agent, agent_bin, cli, eventually, free_port, metric},
    etcd::{Etcd, Gate, Pki},
};
use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::Path,
    process::Output,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

/// How long anything may take to happen (a watch reconnect waits up to 5 s).
const PATIENCE: Duration = Duration::from_secs(30);
/// The service port every manifest uses; each agent's offset puts its proxy on a
/// free port.
const SERVICE_PORT: u16 = 5000;

/// A TCP backend on 127.0.0.1 answering each line with `<name>\n`.
fn backend(name: &'static str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut writer = stream;
                let mut line = String::new();
                while reader.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                    if writeln!(writer, "{name}").is_err() {
                        break;
                    }
                    line.clear();
                }
            });
        }
    });
    port
}

/// Service `name` on [`SERVICE_PORT`] with one endpoint, 127.0.0.1:`backend_port`.
fn manifest(name: &str, backend_port: u16) -> String {
    manifest_on(name, SERVICE_PORT, backend_port)
}

/// Service `name` on `port` with one endpoint, 127.0.0.1:`backend_port`.
fn manifest_on(name: &str, port: u16, backend_port: u16) -> String {
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
         spec: {{ports: [{{name: http, port: {port}, protocol: TCP, targetPort: {backend_port}}}]}}\n\
         ---\n\
         apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\n\
         spec: {{endpoints: [{{address: 127.0.0.1, node: dev, ready: true}}]}}\n"
    )
}

/// One request through `proxy` on a new connection: the backend's name.
fn ask(proxy: SocketAddr) -> std::io::Result<String> {
    let s = TcpStream::connect_timeout(&proxy, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut reader = BufReader::new(s.try_clone()?);
    let mut writer = s;
    writeln!(writer, "hello")?;
    let mut line = String::new();
    reader.read_line(&mut line)?;
    Ok(line.trim().to_owned())
}

/// A dev agent on `endpoint` with its proxy on a free port (returned) and its own
/// DNS port.
fn dev_agent(state: &Path, endpoint: &str, extra: &[&str]) -> (Agent, SocketAddr) {
    let proxy_port = free_port();
    let dns = format!("127.0.0.1:{}", free_port());
    let offset = (proxy_port - SERVICE_PORT).to_string();
    let mut args = vec![
        "--dev",
        "--dev-port-offset",
        &offset,
        "--dns-addr",
        &dns,
        "--etcd-endpoints",
        endpoint,
    ];
    args.extend_from_slice(extra);
    let agent = Agent::command(agent_bin(), state)
        .args(&args)
        .keep_log()
        .spawn()
        .unwrap_or_else(|e| panic!("{e:#}"));
    (agent, SocketAddr::from(([127, 0, 0, 1], proxy_port)))
}

/// `rune-agent ARGS --etcd-endpoints ENDPOINT` with no agent (a state dir of its
/// own, empty), feeding `stdin`.
fn etcd_cli(endpoint: &str, args: &[&str], stdin: Option<&str>) -> Output {
    let state = tempfile::tempdir().unwrap();
    let mut all = args.to_vec();
    all.extend_from_slice(&["--etcd-endpoints", endpoint]);
    let out = cli(state.path(), &all, stdin);
    assert!(
        std::fs::read_dir(state.path()).unwrap().next().is_none(),
        "the CLI on etcd must not create a store in the state dir"
    );
    out
}

/// [`etcd_cli`], which must succeed: its standard output.
fn etcd_cli_ok(endpoint: &str, args: &[&str], stdin: Option<&str>) -> String {
    let out = etcd_cli(endpoint, args, stdin);
    assert!(
        out.status.success(),
        "rune-agent {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `rune-agent status` of `agent` (through its socket), which must succeed.
fn status(agent: &Agent) -> String {
    let out = agent.cli(&["status"], None);
    assert!(
        out.status.success(),
        "status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until `proxy` answers with `name`.
fn wait_answer(proxy: SocketAddr, name: &str) {
    eventually(PATIENCE, &format!("{proxy} answering {name}"), || {
        (ask(proxy).ok().as_deref() == Some(name)).then_some(())
    });
}

/// Requests through `proxy`, one new connection every 20 ms, until stopped; counts
/// them and the failures (with the first few errors).
struct RequestLoop {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicUsize>,
    thread: Option<thread::JoinHandle<Vec<String>>>,
}

impl RequestLoop {
    fn start(proxy: SocketAddr) -> RequestLoop {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicUsize::new(0));
        let (s, d) = (stop.clone(), done.clone());
        let thread = thread::spawn(move || {
            let mut failures = Vec::new();
            while !s.load(Ordering::SeqCst) {
                if let Err(e) = ask(proxy).and_then(|a| {
                    if a.is_empty() {
                        Err(std::io::Error::other("connection closed without an answer"))
                    } else {
                        Ok(a)
                    }
                }) {
                    failures.push(e.to_string());
                }
                d.fetch_add(1, Ordering::SeqCst);
                thread::sleep(Duration::from_millis(20));
            }
            failures
        });
        RequestLoop {
            stop,
            done,
            thread: Some(thread),
        }
    }

    /// Stops the loop: (requests made, failures).
    fn finish(mut self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        let failures = self.thread.take().unwrap().join().unwrap();
        (self.done.load(Ordering::SeqCst), failures)
    }
}

fn store_connected(agent: &Agent) -> Option<f64> {
    metric(&agent.metrics_text(), "rune_store_connected")
}

#[test]
fn two_dev_agents_share_one_etcd_written_by_the_cli_without_an_agent() {
    let etcd = Etcd::start();
    let port = backend("one");
    let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (mut a, a_proxy) = dev_agent(a_dir.path(), etcd.endpoint(), &[]);
    let (mut b, b_proxy) = dev_agent(b_dir.path(), etcd.endpoint(), &[]);
    a.wait_ready(PATIENCE);
    b.wait_ready(PATIENCE);
    // No embedded store in an etcd agent's state dir (the identity is there).
    assert!(!a_dir.path().join("store.redb").exists());

    let applied = etcd_cli_ok(
        etcd.endpoint(),
        &["apply", "-f", "-"],
        Some(&manifest("web", port)),
    );
    assert!(applied.contains("service/default/web created"), "{applied}");
    assert!(
        applied.contains("endpoints/default/web created"),
        "{applied}"
    );
    wait_answer(a_proxy, "one");
    wait_answer(b_proxy, "one");

    // get via etcd directly, and via an agent's local API (which reads etcd too).
    let listed = etcd_cli_ok(etcd.endpoint(), &["get", "svc"], None);
    assert!(listed.contains("web"), "{listed}");
    let one = etcd_cli_ok(etcd.endpoint(), &["get", "svc", "web", "-o", "json"], None);
    assert!(
        one.contains(&format!("\"targetPort\":{port}"))
            || one.contains(&format!("\"targetPort\": {port}")),
        "{one}"
    );
    let out = a.cli(&["get", "ep", "web"], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("web"));

    let st = status(&a);
    assert!(
        st.contains(&format!("store:      etcd {}", etcd.endpoint())),
        "{st}"
    );
    assert!(!st.contains("StoreDisconnected"), "{st}");
    assert_eq!(store_connected(&a), Some(1.0));
    // The local API of an agent on etcd writes to etcd.
    let out = a.cli(
        &["apply", "-f", "-"],
        Some(&manifest_on("via-a", SERVICE_PORT + 1, port)),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = etcd_cli_ok(etcd.endpoint(), &["get", "svc", "via-a"], None);
    assert!(listed.contains("via-a"), "{listed}");
    etcd_cli_ok(etcd.endpoint(), &["delete", "svc", "via-a"], None);
    // `status` is an agent's: with no agent on the state dir, etcd is not read.
    let alone = etcd_cli(etcd.endpoint(), &["status"], None);
    let err = String::from_utf8_lossy(&alone.stderr);
    assert!(
        !alone.status.success() && err.contains("no agent answers"),
        "{err}"
    );

    // delete via etcd: both agents stop serving the service.
    let deleted = etcd_cli_ok(etcd.endpoint(), &["delete", "svc", "web"], None);
    assert!(deleted.contains("service/default/web deleted"), "{deleted}");
    for proxy in [a_proxy, b_proxy] {
        eventually(PATIENCE, "the proxy closed", || {
            TcpStream::connect(proxy).is_err().then_some(())
        });
    }
    let gone = etcd_cli(etcd.endpoint(), &["get", "svc", "web"], None);
    assert!(!gone.status.success());
    assert!(
        String::from_utf8_lossy(&gone.stderr).contains("not found"),
        "{}",
        String::from_utf8_lossy(&gone.stderr)
    );
    let again = etcd_cli(etcd.endpoint(), &["delete", "svc", "web"], None);
    assert!(!again.status.success());
}

#[test]
fn an_etcd_outage_loses_no_request_and_the_agent_catches_up_after() {
    let mut etcd = Etcd::start();
    let (one, two) = (backend("one"), backend("two"));
    let dir = tempfile::tempdir().unwrap();
    let (mut agent, proxy) = dev_agent(dir.path(), etcd.endpoint(), &[]);
    agent.wait_ready(PATIENCE);
    etcd_cli_ok(
        etcd.endpoint(),
        &["apply", "-f", "-"],
        Some(&manifest("web", one)),
    );
    wait_answer(proxy, "one");

    let requests = RequestLoop::start(proxy);
    etcd.stop();
    let stopped = Instant::now();
    eventually(PATIENCE, "rune_store_connected 0", || {
        (store_connected(&agent) == Some(0.0)).then_some(())
    });
    let st = status(&agent);
    assert!(st.contains("StoreDisconnected since "), "{st}");
    assert!(st.contains("ready:      yes"), "{st}");
    // Down for at least 6 s, ready all along.
    while stopped.elapsed() < Duration::from_secs(6) {
        assert_eq!(agent.http_get("/readyz").unwrap().0, 200);
        thread::sleep(Duration::from_millis(200));
    }
    etcd.start_again();
    eventually(PATIENCE, "rune_store_connected 1", || {
        (store_connected(&agent) == Some(1.0)).then_some(())
    });
    // A change after the outage is live.
    let changed = Instant::now();
    etcd_cli_ok(
        etcd.endpoint(),
        &["apply", "-f", "-"],
        Some(&manifest("web", two)),
    );
    wait_answer(proxy, "two");
    eprintln!("change live {:?} after the apply", changed.elapsed());
    assert!(
        changed.elapsed() < Duration::from_secs(10),
        "{:?}",
        changed.elapsed()
    );
    let (made, failures) = requests.finish();
    assert!(made > 100, "only {made} requests");
    assert!(
        failures.is_empty(),
        "{} of {made} failed: {failures:?}",
        failures.len()
    );
    assert!(!status(&agent).contains("StoreDisconnected"));
}

#[test]
fn compaction_while_the_watch_is_cut_is_a_resync_that_loses_nothing() {
    let etcd = Etcd::start();
    let gate = Gate::new(etcd.addr());
    let (one, two) = (backend("one"), backend("two"));
    let dir = tempfile::tempdir().unwrap();
    let (mut agent, proxy) = dev_agent(dir.path(), &gate.endpoint(), &[]);
    agent.wait_ready(PATIENCE);
    etcd_cli_ok(
        etcd.endpoint(),
        &["apply", "-f", "-"],
        Some(&manifest("web", one)),
    );
    // Another service (on a port of its own) that changes while the watch is cut.
    etcd_cli_ok(
        etcd.endpoint(),
        &["apply", "-f", "-"],
        Some(&manifest_on("other", SERVICE_PORT + 1, one)),
    );
    wait_answer(proxy, "one");

    let requests = RequestLoop::start(proxy);
    gate.cut();
    etcd_cli_ok(
        etcd.endpoint(),
        &["apply", "-f", "-"],
        Some(&manifest("web", two)),
    );
    etcd_cli_ok(etcd.endpoint(), &["delete", "ep", "other"], None);
    etcd.compact(etcd.revision());
    thread::sleep(Duration::from_secs(2));
    // Still the old state while cut.
    assert_eq!(ask(proxy).unwrap(), "one");
    gate.restore();
    wait_answer(proxy, "two");
    let (made, failures) = requests.finish();
    assert!(
        failures.is_empty(),
        "{} of {made} failed: {failures:?}",
        failures.len()
    );
    let log = agent.log();
    assert!(
        log.contains("compacted") && log.contains("resync"),
        "no resync after compaction in the log:\n{log}"
    );
    let st = status(&agent);
    assert!(st.contains("Endpoints 1, Secret 0, Service 2"), "{st}");
}

#[test]
fn an_agent_started_while_etcd_is_down_waits_for_it_and_says_why() {
    let mut etcd = Etcd::start();
    etcd.stop();
    let port = backend("one");
    let dir = tempfile::tempdir().unwrap();
    let (agent, proxy) = dev_agent(
        dir.path(),
        etcd.endpoint(),
        &["--ready-timeout-seconds", "2"],
    );
    // The agent's own status (before its socket is up, `status` reads the state
    // dir's embedded store).
    let st = eventually(PATIENCE, "the agent answering status", || {
        let out = agent.cli(&["status"], None);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.success() && text.contains("agent:      running")).then_some(text)
    });
    assert!(st.contains("StoreDisconnected since "), "{st}");
    assert!(st.contains("ready:      no"), "{st}");
    // Past the ready timeout: still running, not ready.
    thread::sleep(Duration::from_secs(4));
    agent.ensure_alive().unwrap();
    assert_eq!(agent.http_get("/readyz").unwrap().0, 503);
    assert!(status(&agent).contains("StoreDisconnected since "));
    assert!(
        agent.log().contains("etcd does not answer"),
        "{}",
        agent.log()
    );

    etcd.start_again();
    agent.try_wait_ready(PATIENCE).unwrap();
    etcd_cli_ok(
        etcd.endpoint(),
        &["apply", "-f", "-"],
        Some(&manifest("web", port)),
    );
    wait_answer(proxy, "one");
    let st = status(&agent);
    assert!(
        st.contains("ready:      yes") && !st.contains("StoreDisconnected"),
        "{st}"
    );
}

#[test]
fn values_other_clients_wrote_that_are_not_objects_are_skipped() {
    let etcd = Etcd::start();
    let (one, two) = (backend("one"), backend("two"));
    let dir = tempfile::tempdir().unwrap();
    let (mut agent, proxy) = dev_agent(dir.path(), etcd.endpoint(), &[]);
    agent.wait_ready(PATIENCE);
    etcd_cli_ok(
        etcd.endpoint(),
        &["apply", "-f", "-"],
        Some(&manifest("web", one)),
    );
    wait_answer(proxy, "one");

    etcd.ctl_ok(&["put", "/rune/v1/service/default/broken", "{not json"]);
    etcd.ctl_ok(&["put", "/rune/v1/gadget/default/x", "{}"]);
    etcd_cli_ok(
        etcd.endpoint(),
        &["apply", "-f", "-"],
        Some(&manifest("web", two)),
    );
    wait_answer(proxy, "two");
    eventually(PATIENCE, "two keys counted as skipped", || {
        let n = metric(&agent.metrics_text(), "rune_store_skipped_keys_total")?;
        (n >= 2.0).then_some(())
    });
    let log = agent.log();
    assert!(log.contains("/rune/v1/service/default/broken"), "{log}");
    assert!(log.contains("/rune/v1/gadget/default/x"), "{log}");
    let st = status(&agent);
    assert!(st.contains("keys skipped; last: "), "{st}");
}

#[test]
fn a_skipped_value_is_acknowledged_as_applied_and_apply_wait_goes_on() {
    let etcd = Etcd::start();
    let one = backend("one");
    let dir = tempfile::tempdir().unwrap();
    let (mut agent, proxy) = dev_agent(dir.path(), etcd.endpoint(), &[]);
    agent.wait_ready(PATIENCE);
    etcd_cli_ok(
        etcd.endpoint(),
        &["apply", "-f", "-", "--wait=20s"],
        Some(&manifest("web", one)),
    );
    wait_answer(proxy, "one");

    // Garbage as the last write: its revision is applied all the same.
    let put = etcd.ctl_ok(&[
        "put",
        "/rune/v1/endpoints/default/web",
        "{not json",
        "-w",
        "json",
    ]);
    let at = put.find("\"revision\":").expect("a revision") + 11;
    let garbage: f64 = put[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap();
    eventually(PATIENCE, "the garbage's revision applied", || {
        let applied = metric(&agent.metrics_text(), "rune_applied_revision")?;
        (applied >= garbage).then_some(())
    });
    // The last valid endpoints stay in service.
    assert_eq!(ask(proxy).unwrap(), "one");
    let log = agent.log();
    assert!(log.contains("/rune/v1/endpoints/default/web"), "{log}");

    // And a good apply after it is waited for and returns.
    let two = backend("two");
    let out = etcd_cli_ok(
        etcd.endpoint(),
        &["apply", "-f", "-", "--wait=20s"],
        Some(&manifest("web", two)),
    );
    assert!(out.contains("endpoints/default/web"), "{out}");
    assert_eq!(ask(proxy).unwrap(), "two");
}

#[test]
fn the_cli_on_a_node_uses_the_etcd_its_agent_ran_on_and_never_makes_an_empty_store() {
    let etcd = Etcd::start();
    let dir = tempfile::tempdir().unwrap();
    let (mut agent, _) = dev_agent(dir.path(), etcd.endpoint(), &[]);
    agent.wait_ready(PATIENCE);
    // Stopped: the CLI cannot ask it, and is given no etcd setting.
    agent.terminate(PATIENCE);
    let out = cli(dir.path(), &["apply", "-f", "-"], Some(&manifest("web", 9)));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = etcd_cli_ok(etcd.endpoint(), &["get", "svc"], None);
    assert!(listed.contains("web"), "the apply went to etcd: {listed}");
    let out = cli(dir.path(), &["get", "svc", "web"], None);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("web"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !dir.path().join("store.redb").exists(),
        "no embedded store beside the etcd record"
    );

    // A state dir with neither a store nor a record: said so, nothing created.
    let empty = tempfile::tempdir().unwrap();
    for args in [&["get"][..], &["delete", "svc", "web"]] {
        let out = cli(empty.path(), args, None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(err.contains("holds no embedded store"), "{args:?}: {err}");
        assert!(err.contains("--etcd-endpoints"), "{args:?}: {err}");
    }
    assert!(
        std::fs::read_dir(empty.path()).unwrap().next().is_none(),
        "nothing created in the empty state dir"
    );
}

#[test]
fn mutual_tls_settings_reach_etcd_from_flags_and_from_a_config_file() {
    let pki = Pki::new("rune agent test CA");
    let etcd = Etcd::builder().tls(&pki).client_cert_auth().start();
    let port = backend("one");
    let (ca, cert, key) = (
        pki.ca.to_str().unwrap(),
        pki.client_cert.to_str().unwrap(),
        pki.client_key.to_str().unwrap(),
    );
    // A node whose id is not its certificate's CN is refused at start, naming the
    // command that issues its own.
    let other = tempfile::tempdir().unwrap();
    let out = cli(
        other.path(),
        &[
            "run",
            "--dev",
            "--etcd-endpoints",
            etcd.endpoint(),
            "--etcd-ca",
            ca,
            "--etcd-cert",
            cert,
            "--etcd-key",
            key,
        ],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("\"rune-client\"") && err.contains("certs issue"),
        "{err}"
    );

    // The node whose id is the certificate's CN (`rune-client`, the harness's).
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("node-identity.json"),
        "{\"node_id\": \"rune-client\", \"hostname\": \"test\"}",
    )
    .unwrap();
    let (mut agent, proxy) = dev_agent(
        dir.path(),
        etcd.endpoint(),
        &["--etcd-ca", ca, "--etcd-cert", cert, "--etcd-key", key],
    );
    agent.wait_ready(PATIENCE);

    // The CLI from a config file: the same keys as the agent's.
    let files = tempfile::tempdir().unwrap();
    let config = files.path().join("cli.yaml");
    std::fs::write(
        &config,
        format!(
            "etcdEndpoints: [\"{}\"]\netcdCa: {ca}\netcdCert: {cert}\netcdKey: {key}\n",
            etcd.endpoint()
        ),
    )
    .unwrap();
    let state = tempfile::tempdir().unwrap();
    let config = config.to_str().unwrap();
    let out = cli(
        state.path(),
        &["apply", "-f", "-", "--config", config],
        Some(&manifest("web", port)),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_answer(proxy, "one");
    assert!(!state.path().join("store.redb").exists());

    // Without a client certificate etcd refuses the CLI, and the error says so.
    let out = cli(
        state.path(),
        &[
            "get",
            "svc",
            "--etcd-endpoints",
            etcd.endpoint(),
            "--etcd-ca",
            ca,
        ],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(etcd.endpoint()) && err.contains("certificate"),
        "{err}"
    );
}

#[test]
fn plain_http_to_an_address_off_loopback_is_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = "http://198.51.100.7:2379";
    for args in [
        &["run", "--dev", "--etcd-endpoints", endpoint][..],
        &["get", "svc", "--etcd-endpoints", endpoint],
    ] {
        let out = cli(dir.path(), args, None);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("--etcd-endpoints"), "{args:?}: {err}");
        assert!(err.contains("--etcd-insecure"), "{args:?}: {err}");
    }
    // Nothing was created in the state dir: the check comes first.
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
}
