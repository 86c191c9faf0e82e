//! Unit tests of the certificates: files and modes, refusals, and what the
//! certificates say (parsed back with x509-parser, signatures checked).

use super::*;
use std::{fs, os::unix::fs::PermissionsExt};
use x509_parser::{
    certificate::X509Certificate, extensions::GeneralName, pem::parse_x509_pem,
    prelude::FromDer as _,
};

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

fn options(sans: &[&str]) -> InitOptions {
    InitOptions {
        sans: sans.iter().map(|s| (*s).to_owned()).collect(),
        validity: Validity::days(2).unwrap(),
        ca_validity: Validity::days(3).unwrap(),
        force: false,
    }
}

/// The DER of the PEM certificate at `path`.
fn der(path: &Path) -> Vec<u8> {
    let pem = fs::read(path).unwrap();
    parse_x509_pem(&pem).unwrap().1.contents
}

fn cn(cert: &X509Certificate<'_>) -> String {
    cert.subject()
        .iter_common_name()
        .next()
        .unwrap()
        .as_str()
        .unwrap()
        .to_owned()
}

#[test]
fn init_makes_a_private_directory_of_a_ca_a_server_and_an_admin() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pki");
    let written = init(&dir, &options(&["etcd-1.example", "10.0.0.5"])).unwrap();
    assert_eq!(written.len(), 6);
    assert_eq!(mode(&dir), 0o700);
    for w in &written {
        assert_eq!(
            mode(&w.path) & 0o077 == 0,
            w.private,
            "{}",
            w.path.display()
        );
        assert_eq!(w.private, w.path.to_string_lossy().ends_with("-key.pem"));
    }

    let ca_der = der(&dir.join(CA_CERT));
    let (_, ca) = X509Certificate::from_der(&ca_der).unwrap();
    assert!(ca.is_ca());
    let server_der = der(&dir.join(SERVER_CERT));
    let (_, server) = X509Certificate::from_der(&server_der).unwrap();
    server.verify_signature(Some(ca.public_key())).unwrap();
    assert!(!server.is_ca());
    let eku = server.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.server_auth && eku.client_auth);
    let names: Vec<String> = server
        .subject_alternative_name()
        .unwrap()
        .unwrap()
        .value
        .general_names
        .iter()
        .map(|n| match n {
            GeneralName::DNSName(d) => (*d).to_owned(),
            GeneralName::IPAddress(ip) => format!("{ip:?}"),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(
        names,
        [
            "etcd-1.example",
            "[10, 0, 0, 5]",
            "localhost",
            "[127, 0, 0, 1]"
        ]
    );

    let admin_der = der(&dir.join(ADMIN_CERT));
    let (_, admin) = X509Certificate::from_der(&admin_der).unwrap();
    admin.verify_signature(Some(ca.public_key())).unwrap();
    assert_eq!(cn(&admin), ADMIN_CN);
    let eku = admin.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.client_auth && !eku.server_auth);
}

#[test]
fn existing_files_are_kept_unless_forced() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    init(dir, &options(&[])).unwrap();
    let ca = fs::read(dir.join(CA_CERT)).unwrap();
    let err = init(dir, &options(&[])).unwrap_err();
    assert!(matches!(err, CertsError::Exists { .. }), "{err}");
    assert!(err.to_string().contains("--force"), "{err}");
    assert_eq!(fs::read(dir.join(CA_CERT)).unwrap(), ca);

    let mut forced = options(&[]);
    forced.force = true;
    init(dir, &forced).unwrap();
    assert_ne!(fs::read(dir.join(CA_CERT)).unwrap(), ca);
    assert_eq!(mode(&dir.join(CA_KEY)), 0o600);

    let validity = Validity::days(1).unwrap();
    issue_node(dir, "n1", &validity, false).unwrap();
    let err = issue_node(dir, "n1", &validity, false).unwrap_err();
    assert!(matches!(err, CertsError::Exists { .. }), "{err}");
    issue_node(dir, "n1", &validity, true).unwrap();
}

#[test]
fn a_node_certificate_names_the_node_and_is_signed_by_the_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    init(dir, &options(&[])).unwrap();
    let written = issue_node(dir, "0a1b2c", &Validity::days(1).unwrap(), false).unwrap();
    assert_eq!(
        written,
        [
            Written {
                path: node_key_file(dir, "0a1b2c"),
                private: true
            },
            Written {
                path: node_cert_file(dir, "0a1b2c"),
                private: false
            },
        ]
    );
    assert_eq!(mode(&node_key_file(dir, "0a1b2c")), 0o600);
    let ca_der = der(&dir.join(CA_CERT));
    let (_, ca) = X509Certificate::from_der(&ca_der).unwrap();
    let node_der = der(&node_cert_file(dir, "0a1b2c"));
    let (_, node) = X509Certificate::from_der(&node_der).unwrap();
    node.verify_signature(Some(ca.public_key())).unwrap();
    assert_eq!(cn(&node), "0a1b2c");
    let eku = node.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.client_auth && !eku.server_auth);
}

#[test]
fn issuing_without_a_usable_ca_is_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let validity = Validity::days(1).unwrap();
    let err = issue_node(dir, "n1", &validity, false).unwrap_err();
    assert!(
        err.to_string().contains("holds no CA") && err.to_string().contains("certs init"),
        "{err}"
    );

    // A CA key that is not the CA certificate's: certificates would not verify.
    let other = tempfile::tempdir().unwrap();
    init(dir, &options(&[])).unwrap();
    init(other.path(), &options(&[])).unwrap();
    fs::copy(other.path().join(CA_KEY), dir.join(CA_KEY)).unwrap();
    let err = issue_node(dir, "n1", &validity, false).unwrap_err();
    assert!(
        matches!(err, CertsError::BadCa { .. }) && err.to_string().contains("does not belong"),
        "{err}"
    );

    // A leaf in place of the CA certificate.
    fs::copy(dir.join(ADMIN_CERT), dir.join(CA_CERT)).unwrap();
    fs::copy(dir.join(ADMIN_KEY), dir.join(CA_KEY)).unwrap();
    let err = issue_node(dir, "n1", &validity, false).unwrap_err();
    assert!(err.to_string().contains("not a CA"), "{err}");

    fs::write(dir.join(CA_KEY), "garbage").unwrap();
    let err = issue_node(dir, "n1", &validity, false).unwrap_err();
    assert!(err.to_string().contains("not a private key"), "{err}");
    assert!(!node_cert_file(dir, "n1").exists());
}

#[test]
fn node_ids_that_are_not_plain_names_or_are_admins_are_refused() {
    for id in [
        "",
        "a/b",
        "..",
        "root",
        "rune-admin",
        "a b",
        "é",
        &"x".repeat(129),
    ] {
        assert!(
            matches!(check_node_id(id), Err(CertsError::BadName { .. })),
            "{id:?}"
        );
    }
    for id in ["0a1b2c3d4e5f60718293a4b5c6d7e8f9", "node-1.example", "n_1"] {
        check_node_id(id).unwrap();
    }
}

#[test]
fn bad_sans_and_validities_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for san in ["", "a..b", "bad name", "x/y"] {
        let err = init(tmp.path(), &options(&[san])).unwrap_err();
        assert!(matches!(err, CertsError::BadName { .. }), "{san:?}: {err}");
    }
    assert!(fs::read_dir(tmp.path()).unwrap().next().is_none());
    assert!(Validity::days(0).is_err());
    let now = OffsetDateTime::now_utc();
    assert!(Validity::between(now, now - Duration::days(1)).is_err());
}

#[test]
fn certificates_end_no_later_than_their_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut short_ca = options(&[]);
    short_ca.validity = Validity::days(30).unwrap();
    short_ca.ca_validity = Validity::days(2).unwrap();
    init(dir, &short_ca).unwrap();
    issue_node(dir, "n1", &Validity::days(30).unwrap(), false).unwrap();
    let ca_der = der(&dir.join(CA_CERT));
    let ca_end = X509Certificate::from_der(&ca_der)
        .unwrap()
        .1
        .validity()
        .not_after
        .timestamp();
    for path in [dir.join(SERVER_CERT), node_cert_file(dir, "n1")] {
        let cert_der = der(&path);
        let (_, cert) = X509Certificate::from_der(&cert_der).unwrap();
        assert_eq!(
            cert.validity().not_after.timestamp(),
            ca_end,
            "{}",
            path.display()
        );
    }
}
