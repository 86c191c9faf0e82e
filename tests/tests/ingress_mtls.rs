//! Client certificates through the ingress (`spec.expose.clientCert`) in dev mode:
//! every request to a route that requires one is checked against the route's CA,
//! whatever SNI its connection was opened with. Certificates from rcgen, curl as
//! the client. Needs no root.

use rune_agent_tests::{
    http::{TestCa, ca_secret, http_backend, tls_secret, write_file as file},
    ingress::{Ingress, PATIENCE, exposed, ip},
};
use rune_harness::agent::eventually;
use std::path::Path;

#[test]
fn every_request_to_an_mtls_route_needs_a_chain_from_its_ca() {
    let ingress = Ingress::start();
    let dir = tempfile::tempdir().unwrap();
    let (server_ca, good_ca, other_ca) = (
        TestCa::new("server ca"),
        TestCa::new("client ca"),
        TestCa::new("other client ca"),
    );
    let server_ca_file = file(dir.path(), "server-ca.pem", &server_ca.pem);
    let client_files = |ca: &TestCa, name: &str| {
        let (cert, key) = ca.leaf("client.test");
        (
            file(dir.path(), &format!("{name}.crt"), &cert),
            file(dir.path(), &format!("{name}.key"), &key),
        )
    };
    let (good_crt, good_key) = client_files(&good_ca, "good");
    let (other_crt, other_key) = client_files(&other_ca, "other");
    let backend = http_backend(ip("127.0.0.1"), 0, "web", false);
    let (mtls_cert, mtls_key) = server_ca.leaf("mtls.test");
    let (open_cert, open_key) = server_ca.leaf("open.test");
    let mut yaml = tls_secret("cert-mtls", &mtls_cert, &mtls_key) + "\n---\n";
    yaml += &(tls_secret("cert-open", &open_cert, &open_key) + "\n---\n");
    yaml += &(ca_secret("clients", &good_ca.pem) + "\n---\n");
    yaml += &exposed(
        "mtls",
        "host: mtls.test, tls: {secret: cert-mtls}, \
         clientCert: {caSecret: clients, mode: require}",
        &[&backend],
    );
    yaml += &exposed(
        "open",
        "host: open.test, tls: {secret: cert-open}",
        &[&backend],
    );
    ingress.apply(&yaml);

    let with = |crt: &Path, key: &Path, extra: &[&str]| {
        let mut args = vec![
            "--cert",
            crt.to_str().unwrap(),
            "--key",
            key.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        ingress.get_tls("mtls.test", "/", &server_ca_file, &args)
    };
    // A chain from the route's CA: served, over h2 and HTTP/1.1.
    let r = eventually(PATIENCE, "the mTLS route serves", || {
        let r = with(&good_crt, &good_key, &[]);
        (r.code == 200).then_some(r)
    });
    assert!(r.body.starts_with("web /"), "{r:?}");
    assert_eq!(r.version, "2", "{r:?}");
    let r = with(&good_crt, &good_key, &["--http1.1"]);
    assert_eq!(r.code, 200, "{r:?}");

    // Without a certificate, or with one from another CA: 403.
    let r = ingress.get_tls("mtls.test", "/", &server_ca_file, &[]);
    assert_eq!(r.code, 403, "{r:?}");
    let r = with(&other_crt, &other_key, &[]);
    assert_eq!(r.code, 403, "{r:?}");

    // A connection opened for open.test (no certificate requested there) cannot
    // carry a request for mtls.test: 421, over HTTP/1.1 and h2.
    for version in ["--http1.1", "--http2"] {
        let r = ingress.get_tls(
            "open.test",
            "/",
            &server_ca_file,
            &[version, "-H", "Host: mtls.test"],
        );
        assert_eq!(r.code, 421, "{version}: {r:?}");
    }
    // ... while open.test itself serves without a certificate.
    let r = ingress.get_tls("open.test", "/", &server_ca_file, &[]);
    assert_eq!(r.code, 200, "{r:?}");

    // Plain HTTP to the mTLS route: refused, not redirected.
    let r = ingress.get("mtls.test", "/", &[]);
    assert_eq!(r.code, 403, "{r:?}");

    // The CA rotates with its Secret: the next requests need the new CA's chains.
    ingress.apply(&ca_secret("clients", &other_ca.pem));
    eventually(PATIENCE, "the new client CA applies", || {
        (with(&other_crt, &other_key, &[]).code == 200).then_some(())
    });
    let r = with(&good_crt, &good_key, &[]);
    assert_eq!(r.code, 403, "{r:?}");
}
