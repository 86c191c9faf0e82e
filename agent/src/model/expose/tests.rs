use crate::model::{Object, parse_documents};

/// The error of applying a service with `expose` (a YAML flow mapping) and `ports`.
fn expose_error(ports: &str, expose: &str) -> Option<String> {
    let text = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: web}}\n\
         spec: {{ports: {ports}, expose: {expose}}}\n"
    );
    parse_documents(&text).err().map(|e| e.to_string())
}

const ONE: &str = "[{port: 80}]";
const TWO: &str = "[{name: http, port: 80, targetPort: 8080}, {name: admin, port: 9000}]";

#[test]
fn good_routes_are_accepted() {
    for expose in [
        "{host: shop.example.com}",
        "{host: '*.example.com', path: /api/v1}",
        "{host: a.example, tls: {secret: certs/a}, allowCidrs: [198.18.0.0/15, '10.0.0.1']}",
        "{host: a.example, tls: {mode: acme}}",
    ] {
        assert_eq!(expose_error(ONE, expose), None, "{expose}");
    }
    assert_eq!(expose_error(TWO, "{host: a.example, port: http}"), None);
    assert_eq!(expose_error(TWO, "{host: a.example, port: 9000}"), None);
}

#[test]
fn bad_routes_are_refused_naming_the_field_and_value() {
    let cases = [
        (
            ONE,
            "{host: 'Shop.example'}",
            "spec.expose.host: \"Shop.example\" is not a host name",
        ),
        (
            ONE,
            "{host: 'a.*.example'}",
            "spec.expose.host: \"a.*.example\"",
        ),
        (ONE, "{host: '*.com'}", "spec.expose.host: \"*.com\""),
        (
            ONE,
            "{host: a.example, path: api}",
            "spec.expose.path: \"api\" must start with \"/\"",
        ),
        (
            ONE,
            "{host: a.example, path: /api/}",
            "spec.expose.path: \"/api/\" must not end",
        ),
        (
            ONE,
            "{host: a.example, path: /a/../b}",
            "spec.expose.path: \"/a/../b\" has an empty",
        ),
        (
            ONE,
            "{host: a.example, path: '/a b'}",
            "spec.expose.path: \"/a b\" has a character",
        ),
        (
            TWO,
            "{host: a.example}",
            "spec.expose.port: must name a port",
        ),
        (
            TWO,
            "{host: a.example, port: web}",
            "spec.expose.port: \"web\" is not a port",
        ),
        (
            ONE,
            "{host: a.example, port: 81}",
            "spec.expose.port: 81 is not a port",
        ),
        (
            ONE,
            "{host: a.example, allowCidrs: [10.0.0.0/8, 10.0.0.0/33]}",
            "spec.expose.allowCidrs[1]: \"10.0.0.0/33\" is not a CIDR",
        ),
        (
            ONE,
            "{host: a.example, tls: {secret: 'A'}}",
            "spec.expose.tls.secret: \"A\"",
        ),
        (
            ONE,
            "{host: a.example, tls: {secret: a, mode: acme}}",
            "spec.expose.tls.secret: not used with mode acme",
        ),
        (
            ONE,
            "{host: '*.example.com', tls: {mode: acme}}",
            "spec.expose.tls.mode: acme (HTTP-01) cannot issue a wildcard",
        ),
        (
            ONE,
            "{host: a.example, tls: {mode: manual}}",
            "spec.expose.tls.secret: must not be empty",
        ),
        (
            ONE,
            "{host: a.example, clientCert: {caSecret: ca, mode: require}}",
            "spec.expose.clientCert.caSecret: client certificates need TLS",
        ),
        (
            ONE,
            "{host: a.example, tls: {secret: a}, clientCert: {caSecret: ca, mode: optional}}",
            "spec.expose.clientCert.mode: \"optional\" is not a mode",
        ),
        (
            ONE,
            "{host: a.example, tls: {secret: a}, clientCert: {caSecret: 'x/Y', mode: require}}",
            "spec.expose.clientCert.caSecret: \"Y\"",
        ),
    ];
    for (ports, expose, want) in cases {
        let err = expose_error(ports, expose).unwrap_or_else(|| panic!("{expose} was accepted"));
        assert!(
            err.starts_with(&format!("Service default/web: {want}")),
            "{expose}: {err}"
        );
    }
}

/// A Secret document with `data`.
fn secret(data: &[(&str, &str)]) -> Result<Object, String> {
    let data: serde_json::Map<String, serde_json::Value> = data
        .iter()
        .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v)))
        .collect();
    let doc = serde_json::json!({
        "apiVersion": "rune/v1", "kind": "Secret", "metadata": {"name": "cert"}, "data": data,
    });
    parse_documents(&doc.to_string())
        .map(|mut v| v.remove(0))
        .map_err(|e| e.to_string())
}

fn self_signed(host: &str) -> (String, String) {
    let c = rcgen::generate_simple_self_signed(vec![host.to_owned()]).expect("rcgen");
    (c.cert.pem(), c.signing_key.serialize_pem())
}

#[test]
fn a_tls_secret_is_checked_at_apply() {
    let (cert, key) = self_signed("a.example");
    let (_, other_key) = self_signed("b.example");
    let ok = secret(&[("tls.crt", &cert), ("tls.key", &key), ("ca.crt", &cert)]).unwrap();
    let Object::Secret(s) = &ok else {
        panic!("a Secret")
    };
    assert!(matches!(s.certified_key(), Some(Ok(_))));
    // Its Debug output (logs) names the keys, never the values.
    assert!(!format!("{ok:?}").contains("PRIVATE KEY"));
    let bad = [
        (
            vec![("tls.crt", cert.as_str()), ("tls.key", other_key.as_str())],
            "does not belong",
        ),
        (
            vec![("tls.crt", "junk"), ("tls.key", key.as_str())],
            "holds no PEM certificate",
        ),
        (vec![("tls.crt", cert.as_str())], "tls.key is missing"),
        (
            vec![("tls.key", key.as_str())],
            "data.tls.crt: missing beside tls.key",
        ),
        (
            vec![("tls.crt", cert.as_str()), ("tls.key", "junk")],
            "not a PEM private key",
        ),
        (vec![("a/b", "x")], "\"a/b\" is not a key"),
    ];
    for (data, want) in bad {
        let err = secret(&data).expect_err(want);
        assert!(err.starts_with("Secret default/cert: "), "{err}");
        assert!(err.contains(want), "{want}: {err}");
    }
}

#[test]
fn a_secret_survives_the_store_round_trip() {
    let (cert, key) = self_signed("a.example");
    let s = secret(&[("tls.crt", &cert), ("tls.key", &key)]).unwrap();
    let back = crate::model::parse_stored(&s.to_json().to_string()).unwrap();
    assert_eq!(back, s);
}
