//! Edge nodes: an agent whose node identity carries the label `role=edge` runs the
//! ingress proxy without `--ingress`; the same agent without the label does not.
//! Dev mode on 127.0.0.1, a backend the test runs on loopback. Needs no root.

use rune_agent_tests::http::{curl, http_backend};
use rune_harness::agent::{Agent, eventually, free_port};
use std::{net::TcpStream, time::Duration};

const PATIENCE: Duration = Duration::from_secs(20);

/// A dev-mode agent whose `node-identity.json` has `labels` (a JSON object), with
/// the ingress listener on a free port given but no `--ingress`; returns it, its
/// state dir and that port.
fn agent_labelled(labels: &str) -> (Agent, tempfile::TempDir, u16) {
    let state = tempfile::tempdir().unwrap();
    std::fs::write(
        state.path().join("node-identity.json"),
        format!(r#"{{"node_id":"0123456789abcdef0123456789abcdef","hostname":"edge","labels":{labels}}}"#),
    )
    .unwrap();
    let (http, https) = (free_port(), free_port());
    let (http_addr, https_addr) = (format!("127.0.0.1:{http}"), format!("127.0.0.1:{https}"));
    let mut agent = Agent::start(
        state.path(),
        &[
            "--dev",
            "--dev-port-offset",
            "10000",
            "--ingress-addr",
            &http_addr,
            "--ingress-tls-addr",
            &https_addr,
        ],
    );
    agent.wait_ready(PATIENCE);
    (agent, state, http)
}

fn exposed(backend_port: u16) -> String {
    let service_port = free_port() - 10000;
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: web}}\n\
         spec: {{ports: [{{port: {service_port}, targetPort: {backend_port}}}], expose: {{host: web.test}}}}\n\
         ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: web}}\n\
         spec: {{endpoints: [{{address: 127.0.0.2, ready: true}}]}}\n"
    )
}

#[test]
fn a_node_labelled_role_edge_serves_ingress_without_the_flag() {
    let backend = http_backend("127.0.0.2".parse().unwrap(), 0, "web", false);
    let (agent, _state, http) = agent_labelled(r#"{"role":"edge","zone":"a"}"#);
    let out = agent.cli(&["apply", "-f", "-"], Some(&exposed(backend.addr.port())));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resolve = format!("web.test:{http}:127.0.0.1");
    let url = format!("http://web.test:{http}/");
    let r = eventually(PATIENCE, "web.test answers 200 through the ingress", || {
        let r = curl(&["--resolve", &resolve, &url]);
        (r.code == 200).then_some(r)
    });
    assert!(r.body.starts_with("web"), "{r:?}");
}

#[test]
fn a_node_without_the_label_runs_no_ingress() {
    let (agent, _state, http) = agent_labelled(r#"{"role":"worker"}"#);
    let out = agent.cli(&["apply", "-f", "-"], Some(&exposed(free_port())));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The agent is ready (its listeners are bound by then): nothing listens on the
    // ingress port.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        TcpStream::connect(("127.0.0.1", http)).is_err(),
        "something answers on the ingress port of a node without role=edge"
    );
    agent.ensure_alive().unwrap();
}
