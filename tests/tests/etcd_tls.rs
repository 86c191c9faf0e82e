//! The etcd backend over mutual TLS against a real etcd started with
//! `--client-cert-auth` (no root needed): the right CA and certificate work;
//! no certificate, a certificate from another CA, or a server this client's CA
//! did not sign are refused with an error naming the endpoint.

mod etcd_common;

use etcd_common::*;
use rune_agent::orderedlog::{
    LogError, OrderedLog,
    etcd::{EtcdLog, EtcdOptions},
};
use rune_harness::etcd::{Etcd, Pki};
use std::time::Duration;

/// Options for a TLS `etcd` with `ca` trusted and, if given, a client certificate.
fn tls_options(etcd: &Etcd, ca: &Pki, client: Option<&Pki>) -> EtcdOptions {
    let mut o = options(etcd.endpoint());
    o.ca_file = Some(ca.ca.clone());
    if let Some(c) = client {
        o.cert_file = Some(c.client_cert.clone());
        o.key_file = Some(c.client_key.clone());
    }
    o.connect_timeout = Duration::from_secs(3);
    o.request_timeout = Duration::from_secs(5);
    o
}

/// The error of a first request with `options`, which must fail.
async fn refused(options: EtcdOptions) -> LogError {
    let log = EtcdLog::connect(options).await.expect("options are valid");
    log.revision()
        .await
        .expect_err("etcd must refuse this client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_with_the_clusters_ca_and_a_client_certificate_works() {
    let pki = Pki::new("rune test CA");
    let etcd = Etcd::builder().tls(&pki).client_cert_auth().start();
    assert!(etcd.endpoint().starts_with("https://127.0.0.1:"));
    let log = EtcdLog::connect(tls_options(&etcd, &pki, Some(&pki)))
        .await
        .unwrap();
    let out = log.apply(vec![svc("web", "198.18.100.1")]).await.unwrap();
    let snap = log.snapshot().await.unwrap();
    assert_eq!(snap.revision, out.revision);
    assert_eq!(snap.objects, vec![svc("web", "198.18.100.1")]);
    let mut stream = log.watch(snap.revision).await.unwrap();
    let r = log.apply(vec![eps("web", &["198.18.11.2"])]).await.unwrap();
    assert_eq!(revisions(&take(&mut stream, 1).await), [r.revision]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_without_the_right_certificates_are_refused() {
    let pki = Pki::new("rune test CA");
    let other = Pki::new("another CA");
    let etcd = Etcd::builder().tls(&pki).client_cert_auth().start();
    let endpoint = etcd.endpoint().to_owned();

    for (what, options) in [
        ("no client certificate", tls_options(&etcd, &pki, None)),
        (
            "a client certificate from another CA",
            tls_options(&etcd, &pki, Some(&other)),
        ),
        (
            "a server this client's CA did not sign",
            tls_options(&etcd, &other, Some(&other)),
        ),
    ] {
        let err = refused(options).await;
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("etcd at {endpoint} ")),
            "{what}: {text}"
        );
        assert!(
            matches!(err, LogError::Unavailable { .. } | LogError::Refused { .. }),
            "{what}: {err:?}"
        );
        // The cause is said (or, when etcd only closed the connection, what that
        // means), not only "transport error".
        assert!(
            text.contains("this client's certificate") || text.contains("UnknownIssuer"),
            "{what}: {text}"
        );
        eprintln!("{what}: {text}");
    }
    // etcd refused the client certificates during the handshake.
    let log = etcd.log();
    assert!(log.contains("rejected connection"), "{log}");
    // Nothing was written by any of them.
    assert!(
        etcd.ctl_ok(&["get", "--prefix", "--keys-only", "/rune-test/"])
            .trim()
            .is_empty()
    );
}
