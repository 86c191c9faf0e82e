use super::*;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};

/// A CA: its certificate (PEM) and an issuer for leaves.
fn ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(params, key))
}

/// A client chain (its leaf only) issued by `issuer` for `usage`.
fn client(issuer: &Issuer<'static, KeyPair>, usage: ExtendedKeyUsagePurpose) -> TlsSession {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["client.test".to_owned()]).unwrap();
    params.extended_key_usages = vec![usage];
    let cert = params.signed_by(&key, issuer).unwrap();
    TlsSession {
        sni: Some("mtls.test".to_owned()),
        chain: vec![cert.der().clone()],
        h2: false,
    }
}

fn client_ca(pem: &str) -> ClientCa {
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "ca"}, "data": {"ca.crt": pem},
    }))
    .unwrap();
    ClientCa(Some(verifier(&secret).unwrap()))
}

fn status(r: Result<(), Refusal>) -> u16 {
    r.err().map_or(200, |(code, _)| code.as_u16())
}

#[test]
fn each_request_needs_a_chain_the_routes_ca_verifies() {
    let (ours_pem, ours) = ca("ours");
    let (_, theirs) = ca("theirs");
    let route_ca = client_ca(&ours_pem);
    let good = client(&ours, ExtendedKeyUsagePurpose::ClientAuth);
    assert_eq!(status(check(&route_ca, Some(&good), "mtls.test")), 200);
    // Whatever SNI the connection was opened with, the chain is what counts.
    let other_sni = TlsSession {
        sni: Some("other.test".to_owned()),
        chain: good.chain.clone(),
        h2: false,
    };
    assert_eq!(status(check(&route_ca, Some(&other_sni), "mtls.test")), 200);

    let foreign = client(&theirs, ExtendedKeyUsagePurpose::ClientAuth);
    assert_eq!(status(check(&route_ca, Some(&foreign), "mtls.test")), 403);
    let server_only = client(&ours, ExtendedKeyUsagePurpose::ServerAuth);
    assert_eq!(
        status(check(&route_ca, Some(&server_only), "mtls.test")),
        403
    );
    let none = TlsSession {
        sni: Some("mtls.test".to_owned()),
        chain: Vec::new(),
        h2: false,
    };
    assert_eq!(status(check(&route_ca, Some(&none), "mtls.test")), 403);
    // No certificate on a connection opened for another host: 421.
    let elsewhere = TlsSession {
        sni: Some("other.test".to_owned()),
        chain: Vec::new(),
        h2: false,
    };
    assert_eq!(status(check(&route_ca, Some(&elsewhere), "mtls.test")), 421);
    // Plain HTTP: refused, not redirected.
    assert_eq!(status(check(&route_ca, None, "mtls.test")), 403);
    // A route whose CA could not be loaded refuses even a good chain.
    assert_eq!(
        status(check(&ClientCa(None), Some(&good), "mtls.test")),
        403
    );
}

#[test]
fn a_secret_without_a_usable_ca_gives_no_verifier() {
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "ca"}, "data": {"other": "x"},
    }))
    .unwrap();
    assert!(verifier(&secret).unwrap_err().contains("no ca.crt"));
}
