//! The ingress tests' agent: `rune-agent run --dev --ingress` on two free loopback
//! ports, with short timeouts, and the services they expose (tests/ingress*.rs).

use crate::http::{Curled, HttpBackend, curl};
use rune_harness::agent::{Agent, eventually, free_port, metric};
use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    time::Duration,
};
use tempfile::TempDir;

/// The dev port offset of the ingress tests' agents.
pub const OFFSET: u16 = 10000;

/// The requests the HTTP/1.1 fast path served.
pub const FAST_PATH_REQUESTS: &str = "rune_ingress_fast_path_requests_total";

/// How long the ingress tests wait for a change to take effect.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// An agent with the ingress on two free loopback ports.
pub struct Ingress {
    /// The agent.
    pub agent: Agent,
    /// The plain-HTTP port.
    pub http: u16,
    /// The TLS port.
    pub https: u16,
    state: TempDir,
}

impl Ingress {
    /// An agent with the default flags.
    pub fn start() -> Ingress {
        Ingress::start_with(&[])
    }

    /// An agent with `extra` flags (which may replace the short timeouts).
    pub fn start_with(extra: &[&str]) -> Ingress {
        let state = tempfile::tempdir().unwrap();
        let (http, https) = (free_port(), free_port());
        let agent = start_agent(state.path(), http, https, extra);
        Ingress {
            agent,
            http,
            https,
            state,
        }
    }

    /// The agent's state dir.
    pub fn state_dir(&self) -> &Path {
        self.state.path()
    }

    /// Stops the agent (SIGTERM) and starts it again on the same state dir and
    /// ports with `extra` flags.
    pub fn restart(&mut self, extra: &[&str]) {
        self.agent.terminate(PATIENCE);
        self.agent = start_agent(self.state.path(), self.http, self.https, extra);
    }

    /// `rune-agent apply -f -` of `yaml`; panics when refused.
    pub fn apply(&self, yaml: &str) {
        let out = self.agent.cli(&["apply", "-f", "-"], Some(yaml));
        assert!(
            out.status.success(),
            "apply: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `curl http://HOST:PORT/PATH` (HOST resolved to 127.0.0.1) with `extra` flags.
    pub fn get(&self, host: &str, path: &str, extra: &[&str]) -> Curled {
        let resolve = format!("{host}:{}:127.0.0.1", self.http);
        let url = format!("http://{host}:{}{path}", self.http);
        let mut args = vec!["--resolve", &resolve, &url];
        args.extend_from_slice(extra);
        curl(&args)
    }

    /// `curl https://HOST:PORT/PATH` trusting `ca` (a PEM file).
    pub fn get_tls(&self, host: &str, path: &str, ca: &Path, extra: &[&str]) -> Curled {
        let resolve = format!("{host}:{}:127.0.0.1", self.https);
        let url = format!("https://{host}:{}{path}", self.https);
        let ca = ca.to_str().unwrap();
        let mut args = vec!["--resolve", &resolve, "--cacert", ca, &url];
        args.extend_from_slice(extra);
        curl(&args)
    }

    /// Waits until `host``path` answers `code` over plain HTTP (routes follow the
    /// cache a moment after an apply).
    pub fn until(&self, host: &str, path: &str, code: u16) -> Curled {
        eventually(PATIENCE, &format!("{host}{path} answers {code}"), || {
            let r = self.get(host, path, &[]);
            (r.code == code).then_some(r)
        })
    }

    /// One sample of the agent's metrics (0 when absent).
    pub fn metric(&self, series: &str) -> f64 {
        metric(&self.agent.metrics_text(), series).unwrap_or(0.0)
    }
}

/// `run --dev --ingress` on `state` with the ingress on `http`/`https`, ready.
fn start_agent(state: &Path, http: u16, https: u16, extra: &[&str]) -> Agent {
    let (offset, http_addr) = (OFFSET.to_string(), format!("127.0.0.1:{http}"));
    let https_addr = format!("127.0.0.1:{https}");
    let mut args = vec![
        "--dev",
        "--dev-port-offset",
        &offset,
        "--ingress",
        "--ingress-addr",
        &http_addr,
        "--ingress-tls-addr",
        &https_addr,
    ];
    // Short timeouts and a small head limit, unless `extra` sets them.
    let defaults = [
        ("--ingress-header-timeout-ms", "1000"),
        ("--ingress-response-timeout-ms", "1500"),
        ("--ingress-connect-timeout-ms", "500"),
        ("--ingress-max-header-bytes", "8192"),
    ];
    for (flag, value) in defaults {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    args.extend_from_slice(extra);
    let mut agent = Agent::start(state, &args);
    agent.wait_ready(PATIENCE);
    agent
}

/// A service `name` exposed with `expose` (a YAML flow mapping's inside) and
/// endpoints at `backends` (one port, shared by all).
pub fn exposed(name: &str, expose: &str, backends: &[&HttpBackend]) -> String {
    let addrs: Vec<SocketAddr> = backends.iter().map(|b| b.addr).collect();
    exposed_at(name, expose, &addrs)
}

/// [`exposed`] with endpoints at `addrs` (one port, the first's, shared by all).
pub fn exposed_at(name: &str, expose: &str, addrs: &[SocketAddr]) -> String {
    let port = addrs.first().map_or(80, SocketAddr::port);
    let service_port = free_port() - OFFSET;
    let endpoints: Vec<String> = addrs
        .iter()
        .map(|a| format!("{{address: {}, ready: true}}", a.ip()))
        .collect();
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
         spec: {{ports: [{{port: {service_port}, targetPort: {port}}}], expose: {{{expose}}}}}\n\
         ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\n\
         spec: {{endpoints: [{}]}}\n---\n",
        endpoints.join(", ")
    )
}

/// An address from its text.
pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// Turns each named `fn case(ingress: &Ingress)` into two tests, `case::fast_path`
/// and `case::hyper_only` (`--ingress-no-fast-path`), so both ways of serving
/// HTTP/1.1 are held to the same behaviour.
#[macro_export]
macro_rules! on_both_paths {
    ($($case:ident),* $(,)?) => {
        $(
            mod $case {
                #[test]
                fn fast_path() {
                    let ingress = $crate::ingress::Ingress::start();
                    super::$case(&ingress);
                    assert!(ingress.metric($crate::ingress::FAST_PATH_REQUESTS) > 0.0);
                }

                #[test]
                fn hyper_only() {
                    let ingress = $crate::ingress::Ingress::start_with(&["--ingress-no-fast-path"]);
                    super::$case(&ingress);
                    assert_eq!(ingress.metric($crate::ingress::FAST_PATH_REQUESTS), 0.0);
                }
            }
        )*
    };
}
