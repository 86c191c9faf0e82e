//! The start's check of a node's client certificate.

use super::*;
use crate::certs::{InitOptions, Validity, init, issue_node, node_cert_file};
use time::Duration;

fn pki(dir: &Path) {
    init(
        dir,
        &InitOptions {
            sans: Vec::new(),
            validity: Validity::days(2).unwrap(),
            ca_validity: Validity::days(3).unwrap(),
            force: false,
        },
    )
    .unwrap();
}

#[test]
fn a_node_certificate_is_accepted_for_its_own_node_only() {
    let tmp = tempfile::tempdir().unwrap();
    pki(tmp.path());
    issue_node(tmp.path(), "n1", &Validity::days(1).unwrap(), false).unwrap();
    let cert = node_cert_file(tmp.path(), "n1");
    check_node_certificate(&cert, "n1").unwrap();
    let err = check_node_certificate(&cert, "n2").unwrap_err();
    assert!(matches!(err, ClientCertError::OtherNode { .. }), "{err}");
    assert!(err.to_string().contains("certs issue n2"), "{err}");
    // The admin's certificate is nobody's node certificate.
    let admin = tmp.path().join("admin.pem");
    let err = check_node_certificate(&admin, "n1").unwrap_err();
    assert!(err.to_string().contains("\"rune-admin\""), "{err}");
}

#[test]
fn an_expired_or_unreadable_certificate_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    pki(tmp.path());
    let now = OffsetDateTime::now_utc();
    let past = Validity::between(now - Duration::days(3), now - Duration::days(1)).unwrap();
    issue_node(tmp.path(), "old", &past, false).unwrap();
    let err = check_node_certificate(&node_cert_file(tmp.path(), "old"), "old").unwrap_err();
    assert!(matches!(err, ClientCertError::NotValidNow { .. }), "{err}");
    let err = check_node_certificate(&tmp.path().join("missing.pem"), "old").unwrap_err();
    assert!(matches!(err, ClientCertError::Unreadable { .. }), "{err}");
}
