//! etcd's mutual TLS and authorization as `rune-agent certs` sets them up, against
//! a real etcd started with `--client-cert-auth` (no root needed): the PKI is made
//! by the `rune-agent certs init`/`issue` binary, the roles by `certs etcd-rbac`.
//! A node may read the prefix and write only its own `nodes/<id>` key (under a
//! lease); it may not write objects or another node's key, and is told so; the
//! admin may write objects; clients without a valid certificate of the cluster's
//! CA (none, another CA's, an expired one) are refused.
//!
//! Needs the agent binary: `cargo build -p rune-agent` first.

mod etcd_common;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, PutOptions, TlsOptions};
use etcd_common::*;
use rune_agent::{
    certs::{self, Validity},
    orderedlog::{
        LogError, OrderedLog,
        embedded::ApplyError,
        etcd::{EtcdLog, EtcdOptions},
    },
};
use rune_harness::{
    agent::agent_bin,
    etcd::{Etcd, Pki},
};
use std::{
    fs,
    future::Future,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::Duration,
};
use tempfile::TempDir;

/// The prefix of [`options`] (etcd_common), which the roles are granted on.
const PREFIX: &str = "/rune-test/v1/";

/// How long one whole test may take.
const TEST_LIMIT: Duration = Duration::from_secs(180);

/// `test` within [`TEST_LIMIT`].
async fn bounded(test: impl Future<Output = ()>) {
    tokio::time::timeout(TEST_LIMIT, test)
        .await
        .expect("the test took too long");
}

/// Runs `rune-agent <args>` (with a private state dir).
fn agent(state: &Path, args: &[&str]) -> Output {
    Command::new(agent_bin())
        .arg("--state-dir")
        .arg(state)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running rune-agent")
}

/// [`agent`], which must succeed; returns its standard output.
fn agent_ok(state: &Path, args: &[&str]) -> String {
    let out = agent(state, args);
    assert!(
        out.status.success(),
        "rune-agent {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().expect("temporary paths are UTF-8")
}

/// An etcd serving the certificates of a `rune-agent certs init` directory, with
/// `--client-cert-auth`; etcdctl ([`Etcd::ctl`]) is the admin.
struct Cluster {
    tmp: TempDir,
    dir: PathBuf,
    etcd: Etcd,
    _pki: Pki,
}

impl Cluster {
    /// `certs init` in a new directory, and etcd started on its server certificate.
    fn start() -> Cluster {
        Cluster::start_with(true)
    }

    /// [`Cluster::start`], with `--client-cert-auth` or not.
    fn start_with(client_cert_auth: bool) -> Cluster {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("pki");
        let out = agent_ok(&tmp.path().join("state"), &["certs", "init", s(&dir)]);
        assert!(out.contains("ca-key.pem (key, 0600)"), "{out}");
        // The harness starts etcd on a Pki's files: replace them with ours.
        let pki = Pki::new("replaced by rune-agent certs init");
        for (ours, theirs) in [
            (certs::CA_CERT, &pki.ca),
            (certs::SERVER_CERT, &pki.server_cert),
            (certs::SERVER_KEY, &pki.server_key),
            (certs::ADMIN_CERT, &pki.client_cert),
            (certs::ADMIN_KEY, &pki.client_key),
        ] {
            fs::copy(dir.join(ours), theirs).unwrap();
        }
        let builder = Etcd::builder().tls(&pki);
        let etcd = if client_cert_auth {
            builder.client_cert_auth().start()
        } else {
            builder.start()
        };
        Cluster {
            tmp,
            dir,
            etcd,
            _pki: pki,
        }
    }

    fn state(&self) -> PathBuf {
        self.tmp.path().join("state")
    }

    /// `certs issue <id>` with the binary.
    fn issue(&self, id: &str) {
        agent_ok(&self.state(), &["certs", "issue", id, s(&self.dir)]);
    }

    /// `certs etcd-rbac` as the certificate `cert`/`key`, for `nodes`.
    fn rbac_as(&self, cert: &Path, key: &Path, nodes: &[&str]) -> Output {
        let endpoint = self.etcd.endpoint().to_owned();
        let ca = self.dir.join(certs::CA_CERT);
        let mut args = vec![
            "certs",
            "etcd-rbac",
            "--etcd-endpoints",
            &endpoint,
            "--etcd-ca",
            s(&ca),
            "--etcd-cert",
            s(cert),
            "--etcd-key",
            s(key),
            "--etcd-prefix",
            PREFIX,
        ];
        for n in nodes {
            args.extend(["--node", n]);
        }
        agent(&self.state(), &args)
    }

    /// `certs etcd-rbac` as the admin, which must succeed.
    fn rbac(&self, nodes: &[&str]) -> String {
        let out = self.rbac_as(
            &self.dir.join(certs::ADMIN_CERT),
            &self.dir.join(certs::ADMIN_KEY),
            nodes,
        );
        assert!(
            out.status.success(),
            "etcd-rbac: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Options for this etcd with the CA, and the client certificate `cert`/`key`
    /// if given.
    fn options(&self, client: Option<(PathBuf, PathBuf)>) -> EtcdOptions {
        let mut o = options(self.etcd.endpoint());
        o.ca_file = Some(self.dir.join(certs::CA_CERT));
        if let Some((cert, key)) = client {
            o.cert_file = Some(cert);
            o.key_file = Some(key);
        }
        o.connect_timeout = Duration::from_secs(3);
        o.request_timeout = Duration::from_secs(5);
        o
    }

    fn node(&self, id: &str) -> (PathBuf, PathBuf) {
        (
            certs::node_cert_file(&self.dir, id),
            certs::node_key_file(&self.dir, id),
        )
    }

    fn admin(&self) -> (PathBuf, PathBuf) {
        (
            self.dir.join(certs::ADMIN_CERT),
            self.dir.join(certs::ADMIN_KEY),
        )
    }

    async fn log(&self, client: (PathBuf, PathBuf)) -> EtcdLog {
        EtcdLog::connect(self.options(Some(client))).await.unwrap()
    }

    /// A raw etcd client with `client`'s certificate.
    async fn raw(&self, (cert, key): (PathBuf, PathBuf)) -> Client {
        let tls = TlsOptions::new()
            .ca_certificate(Certificate::from_pem(
                fs::read(self.dir.join(certs::CA_CERT)).unwrap(),
            ))
            .identity(Identity::from_pem(
                fs::read(cert).unwrap(),
                fs::read(key).unwrap(),
            ));
        let options = ConnectOptions::new()
            .with_tls(tls)
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(Duration::from_secs(5));
        Client::connect([self.etcd.endpoint()], Some(options))
            .await
            .unwrap()
    }
}

/// The log's error of an apply, which must not be a refusal of the objects.
fn log_error(e: ApplyError) -> LogError {
    match e {
        ApplyError::Log(e) => e,
        other => panic!("the objects were refused, not the client: {other}"),
    }
}

/// Whether `e` is etcd's refusal for lack of permission.
fn denied(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("permission denied"))
}

/// Writes `<prefix>nodes/<id>` under a new lease as `client`, keeps the lease
/// alive once, and returns the value read back.
async fn register(client: &mut Client, id: &str) -> Result<String, etcd_client::Error> {
    let lease = client.lease_grant(30, None).await?.id();
    client
        .put(
            format!("{PREFIX}nodes/{id}"),
            format!("{{\"node\":\"{id}\"}}"),
            Some(PutOptions::new().with_lease(lease)),
        )
        .await?;
    let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
    keeper.keep_alive().await?;
    let answer = stream.message().await?.expect("a keepalive answer");
    assert!(answer.ttl() > 0, "the lease expired: {answer:?}");
    let got = client.get(format!("{PREFIX}nodes/{id}"), None).await?;
    let kv = got.kvs().first().expect("the node's key");
    assert_eq!(kv.lease(), lease);
    Ok(kv.value_str()?.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_read_the_prefix_and_write_only_their_own_key_and_the_admin_writes_objects() {
    bounded(async {
        let cluster = Cluster::start();
        cluster.issue("n1");
        cluster.issue("n2");
        // Issuing again is refused without --force, and names the file.
        let out = agent(&cluster.state(), &["certs", "issue", "n1", s(&cluster.dir)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("node-n1.pem exists"),
            "{err}"
        );

        let out = cluster.rbac(&["n1", "n2"]);
        assert!(
            out.contains("added user n1") && out.contains("added role rune-node-n1"),
            "{out}"
        );
        assert!(out.contains("authentication is enabled"), "{out}");

        // (f) The admin applies services.
        let admin = cluster.log(cluster.admin()).await;
        let applied = admin.apply(vec![svc("web", "198.18.100.1")]).await.unwrap();

        // (a) A node reads the prefix: a snapshot, and a watch of it.
        let node = cluster.log(cluster.node("n1")).await;
        let snap = node.snapshot().await.unwrap();
        assert_eq!(snap.objects, vec![svc("web", "198.18.100.1")]);
        assert_eq!(snap.revision, applied.revision);
        let mut stream = node.watch(snap.revision).await.unwrap();
        let r = admin
            .apply(vec![eps("web", &["198.18.11.2"])])
            .await
            .unwrap();
        assert_eq!(revisions(&take(&mut stream, 1).await), [r.revision]);

        // (a) ... and writes its own key under a lease.
        let mut raw = cluster.raw(cluster.node("n1")).await;
        assert_eq!(register(&mut raw, "n1").await.unwrap(), "{\"node\":\"n1\"}");

        // (b) It may not write a Service, nor delete one, and is told why.
        for err in [
            log_error(
                node.apply(vec![svc("evil", "198.18.100.9")])
                    .await
                    .unwrap_err(),
            ),
            node.delete(&key(rune_agent::model::Kind::Service, "web"))
                .await
                .unwrap_err(),
        ] {
            let text = err.to_string();
            assert!(matches!(err, LogError::Refused { .. }), "{err:?}");
            assert!(
                text.contains("permission denied")
                    && text.contains("the CN of its certificate")
                    && text.contains("certs etcd-rbac"),
                "{text}"
            );
        }
        // (b) ... nor another node's key, nor a key outside the prefix.
        for key in [format!("{PREFIX}nodes/n2"), "/elsewhere".to_owned()] {
            let err = raw.put(key.as_str(), "x", None).await.unwrap_err();
            assert!(denied(&err), "{key}: {err:?}");
        }
        let err = register(&mut raw, "n2").await.unwrap_err();
        assert!(denied(&err), "{err:?}");
        // Nothing of it was written.
        let snap = admin.snapshot().await.unwrap();
        assert_eq!(snap.objects.len(), 2, "{:?}", snap.objects);
        let keys =
            cluster
                .etcd
                .ctl_ok(&["get", "--prefix", "--keys-only", &format!("{PREFIX}nodes/")]);
        assert_eq!(
            keys.lines().filter(|l| !l.is_empty()).collect::<Vec<_>>(),
            [format!("{PREFIX}nodes/n1")]
        );

        // A node cannot change the roles: told to use the admin certificate.
        let (cert, key) = cluster.node("n1");
        let out = cluster.rbac_as(&cert, &key, &["n1"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains("permission denied")
                && err.contains("CN rune-admin"),
            "{err}"
        );

        // Running it again changes nothing; a node added later gets its share.
        let out = cluster.rbac(&["n1", "n2"]);
        assert!(!out.contains("added"), "{out}");
        cluster.issue("n3");
        let out = cluster.rbac(&["n3"]);
        assert!(
            out.contains("added user n3") && !out.contains("added user n1"),
            "{out}"
        );
        let mut n3 = cluster.raw(cluster.node("n3")).await;
        register(&mut n3, "n3").await.unwrap();
        assert!(denied(&register(&mut n3, "n1").await.unwrap_err()));
        // n1 kept its rights.
        register(&mut raw, "n1").await.unwrap();

        // Deleting a node's user takes its access away, certificate or not.
        let n2 = cluster.log(cluster.node("n2")).await;
        n2.snapshot().await.unwrap();
        cluster.etcd.ctl_ok(&["user", "delete", "n2"]);
        let err = n2.snapshot().await.unwrap_err();
        assert!(
            matches!(err, LogError::Refused { .. })
                && err.to_string().contains("permission denied"),
            "{err:?}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_rbac_takes_its_connection_from_the_config_file_like_every_command() {
    bounded(async {
        let cluster = Cluster::start();
        cluster.issue("n1");
        let file = cluster.tmp.path().join("admin.yaml");
        let ca = cluster.dir.join(certs::CA_CERT);
        let (cert, key) = (
            cluster.dir.join(certs::ADMIN_CERT),
            cluster.dir.join(certs::ADMIN_KEY),
        );
        fs::write(
            &file,
            format!(
                "etcdEndpoints: [{}]\netcdCa: {}\netcdCert: {}\netcdKey: {}\netcdPrefix: {PREFIX}\n",
                cluster.etcd.endpoint(),
                s(&ca),
                s(&cert),
                s(&key)
            ),
        )
        .unwrap();
        let out = agent_ok(
            &cluster.state(),
            &["certs", "etcd-rbac", "--config", s(&file), "--node", "n1"],
        );
        assert!(out.contains("n1"), "{out}");
        // The node's role is on the configured prefix: it may write its own key.
        let mut raw = cluster.raw(cluster.node("n1")).await;
        register(&mut raw, "n1").await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_granted_more_than_its_share_is_brought_back_to_it() {
    bounded(async {
        let cluster = Cluster::start();
        cluster.issue("n1");
        cluster.rbac(&["n1"]);
        // Someone widened the node's role and gave it the admin's.
        cluster.etcd.ctl_ok(&[
            "role",
            "grant-permission",
            "rune-node-n1",
            "readwrite",
            "--prefix=true",
            PREFIX,
        ]);
        cluster
            .etcd
            .ctl_ok(&["user", "grant-role", "n1", "rune-admin"]);
        let node = cluster.log(cluster.node("n1")).await;
        node.apply(vec![svc("web", "198.18.100.1")]).await.unwrap();

        let out = cluster.rbac(&["n1"]);
        assert!(out.contains("revoked permission rune-node-n1"), "{out}");
        assert!(out.contains("revoked role n1: rune-admin"), "{out}");
        let err = node
            .apply(vec![svc("web", "198.18.100.2")])
            .await
            .unwrap_err();
        assert!(err.to_string().contains("permission denied"), "{err}");
        let mut raw = cluster.raw(cluster.node("n1")).await;
        register(&mut raw, "n1").await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_without_a_valid_certificate_of_the_clusters_ca_are_refused() {
    bounded(async {
        let cluster = Cluster::start();
        cluster.issue("n1");
        // An expired certificate of the right CA, through the library.
        let now = time::OffsetDateTime::now_utc();
        let expired =
            Validity::between(now - time::Duration::days(3), now - time::Duration::days(1))
                .unwrap();
        certs::issue_node(&cluster.dir, "old", &expired, false).unwrap();
        // A certificate of another CA, for a node of the same name.
        let other = tempfile::tempdir().unwrap();
        agent_ok(&cluster.state(), &["certs", "init", s(other.path())]);
        agent_ok(&cluster.state(), &["certs", "issue", "n1", s(other.path())]);
        cluster.rbac(&["n1", "old"]);
        let endpoint = cluster.etcd.endpoint().to_owned();

        for (what, client, cause) in [
            ("(c) no client certificate", None, None),
            (
                "(d) a certificate of another CA",
                Some((
                    certs::node_cert_file(other.path(), "n1"),
                    certs::node_key_file(other.path(), "n1"),
                )),
                Some("unknown authority"),
            ),
            (
                "(e) an expired certificate",
                Some(cluster.node("old")),
                Some("expired"),
            ),
        ] {
            let before = cluster.etcd.log().len();
            let log = EtcdLog::connect(cluster.options(client)).await.unwrap();
            let err = log
                .revision()
                .await
                .expect_err("etcd must refuse this client");
            let text = err.to_string();
            assert!(
                text.starts_with(&format!("etcd at {endpoint} ")),
                "{what}: {text}"
            );
            assert!(text.contains("this client's certificate"), "{what}: {text}");
            let err = log_error(
                log.apply(vec![svc("evil", "198.18.100.9")])
                    .await
                    .expect_err("etcd must refuse this client"),
            );
            assert!(
                matches!(err, LogError::Unavailable { .. } | LogError::Refused { .. }),
                "{what}: {err:?}"
            );
            // etcd refused it during the handshake, for that reason (etcd may write
            // its log line a moment after the client gave up).
            let mut etcd_log = String::new();
            for _ in 0..50 {
                etcd_log = cluster.etcd.log()[before..].to_owned();
                if etcd_log.contains("rejected connection") {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert!(
                etcd_log.contains("rejected connection"),
                "{what}: {etcd_log}"
            );
            if let Some(cause) = cause {
                assert!(etcd_log.contains(cause), "{what}: {etcd_log}");
            }
            eprintln!("{what}: {text}");
        }
        // The valid node certificate of the same name works, and nothing was written.
        let node = cluster.log(cluster.node("n1")).await;
        assert!(node.snapshot().await.unwrap().objects.is_empty());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_that_does_not_take_certificate_cns_as_users_is_not_locked() {
    bounded(async {
        // A --trusted-ca-file without --client-cert-auth: etcd asks for client
        // certificates but does not take their CN as the user.
        let cluster = Cluster::start_with(false);
        cluster.issue("n1");
        let out = cluster.rbac_as(
            &cluster.dir.join(certs::ADMIN_CERT),
            &cluster.dir.join(certs::ADMIN_KEY),
            &["n1"],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains("does not take a client certificate's CN as its user")
                && err.contains("--client-cert-auth")
                && err.contains("switched off again"),
            "{err}"
        );
        // Authentication is off again: clients work as before.
        let admin = cluster.log(cluster.admin()).await;
        admin.apply(vec![svc("web", "198.18.100.1")]).await.unwrap();
        let node = cluster.log(cluster.node("n1")).await;
        node.apply(vec![svc("db", "198.18.100.2")]).await.unwrap();
    })
    .await;
}
