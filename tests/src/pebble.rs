//! pebble (Let's Encrypt's test ACME server, Debian's package) and
//! pebble-challtestsrv (its DNS, answering every name with 127.0.0.1) as real
//! processes on loopback, for the ACME tests (tests/ingress_acme.rs).

use crate::{http::TestCa, ingress::PATIENCE};
use rune_harness::agent::{die_with_parent, eventually, free_port};
use std::{
    net::TcpStream,
    path::PathBuf,
    process::{Child, Command, Stdio},
};
use tempfile::TempDir;

/// pebble and its DNS server, killed on drop.
pub struct Pebble {
    dir: TempDir,
    listen: u16,
    management: u16,
    dns: u16,
    dns_management: u16,
    /// The lifetime of the certificates it issues.
    pub validity_seconds: u64,
    children: Vec<Child>,
}

impl Pebble {
    /// A pebble issuing certificates valid `validity_seconds`: its ports and its
    /// API's certificate (by a CA of the test's) chosen, not started yet.
    pub fn new(validity_seconds: u64) -> Pebble {
        let dir = tempfile::tempdir().unwrap();
        let api_ca = TestCa::new("pebble API test CA");
        let (cert, key) = api_ca.leaf("127.0.0.1");
        std::fs::write(dir.path().join("api-ca.pem"), &api_ca.pem).unwrap();
        std::fs::write(dir.path().join("api-cert.pem"), cert).unwrap();
        std::fs::write(dir.path().join("api-key.pem"), key).unwrap();
        Pebble {
            dir,
            listen: free_port(),
            management: free_port(),
            dns: free_port(),
            dns_management: free_port(),
            validity_seconds,
            children: Vec::new(),
        }
    }

    /// Its ACME directory URL.
    pub fn directory(&self) -> String {
        format!("https://127.0.0.1:{}/dir", self.listen)
    }

    /// The CA of pebble's API certificate (what the agent trusts for ACME).
    pub fn api_ca(&self) -> PathBuf {
        self.dir.path().join("api-ca.pem")
    }

    /// The agent's ACME flags for this pebble.
    pub fn flags(&self) -> Vec<String> {
        vec![
            "--ingress-acme-directory".into(),
            self.directory(),
            "--ingress-acme-ca-bundle".into(),
            self.api_ca().display().to_string(),
            "--ingress-acme-email".into(),
            "ops@acme.test".into(),
            // A failed order (the test stops pebble) is tried again soon.
            "--ingress-acme-retry-seconds".into(),
            "2".into(),
        ]
    }

    /// Starts the DNS server and pebble, validating HTTP-01 on `http_port`; returns
    /// the PEM file of pebble's issuing root once both answer.
    pub fn start(&mut self, http_port: u16) -> PathBuf {
        let config = serde_json::json!({"pebble": {
            "listenAddress": format!("127.0.0.1:{}", self.listen),
            "managementListenAddress": format!("127.0.0.1:{}", self.management),
            "certificate": self.dir.path().join("api-cert.pem"),
            "privateKey": self.dir.path().join("api-key.pem"),
            "httpPort": http_port,
            "tlsPort": free_port(),
            "ocspResponderURL": "",
            "externalAccountBindingRequired": false,
            "certificateValidityPeriod": self.validity_seconds,
        }});
        let config_path = self.dir.path().join("pebble.json");
        std::fs::write(&config_path, config.to_string()).unwrap();
        let dns = format!("127.0.0.1:{}", self.dns);
        let dns_management = format!("127.0.0.1:{}", self.dns_management);
        let mut challtestsrv = Command::new("pebble-challtestsrv");
        challtestsrv
            .args(["-dns01", &dns, "-management", &dns_management])
            .args(["-http01", "", "-https01", "", "-tlsalpn01", ""])
            .args(["-defaultIPv4", "127.0.0.1", "-defaultIPv6", ""]);
        self.spawn(challtestsrv);
        let mut pebble = Command::new("pebble");
        pebble
            .arg("-config")
            .arg(&config_path)
            .args(["-dnsserver", &dns])
            .env("PEBBLE_VA_NOSLEEP", "1")
            .env("PEBBLE_VA_ALWAYS_VALID", "0")
            .env("PEBBLE_WFE_NONCEREJECT", "0")
            .env("PEBBLE_AUTHZREUSE", "0");
        self.spawn(pebble);
        for port in [self.dns_management, self.listen, self.management] {
            eventually(PATIENCE, &format!("pebble listens on {port}"), || {
                TcpStream::connect(("127.0.0.1", port)).ok()
            });
        }
        let root = self.dir.path().join("root.pem");
        let url = format!("https://127.0.0.1:{}/roots/0", self.management);
        let out = Command::new("curl")
            .args(["-sSf", "--max-time", "10", "--cacert"])
            .arg(self.api_ca())
            .arg("-o")
            .arg(&root)
            .arg(&url)
            .output()
            .unwrap();
        assert!(out.status.success(), "{url}: {out:?}");
        root
    }

    /// Stops pebble and its DNS server.
    pub fn stop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn spawn(&mut self, mut cmd: Command) {
        cmd.stdin(Stdio::null()).stdout(Stdio::null());
        die_with_parent(&mut cmd);
        self.children.push(
            cmd.spawn()
                .expect("pebble is installed (cargo xtask setup)"),
        );
    }
}

impl Drop for Pebble {
    fn drop(&mut self) {
        self.stop();
    }
}
