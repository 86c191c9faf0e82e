//! Unit tests without an etcd: options, endpoints, the key layout. The tests
//! against a real etcd are in `tests/tests/etcd_*.rs`.

use super::{
    keys::{Layout, Parsed, parse_relative, range_end, relative},
    options::parse_endpoint,
    *,
};
use std::{io::Write as _, net::IpAddr};

fn options(endpoints: &[&str]) -> EtcdOptions {
    EtcdOptions::new(endpoints.iter().copied())
}

#[test]
fn endpoints_need_a_scheme_a_host_and_a_port() {
    for (endpoint, says) in [
        ("127.0.0.1:2379", "no scheme"),
        ("https://", "no port"),
        ("https://etcd-a", "no port"),
        ("https://:2379", "no host"),
        ("https://etcd-a:0", "is not 1-65535"),
        ("https://etcd-a:http", "is not 1-65535"),
        ("https://etcd-a:2379/v3", "only a host and a port"),
        ("https://[fd00::1]", "no port after the IPv6 address"),
        ("https://[etcd]:2379", "is not an IPv6 address"),
    ] {
        let err = parse_endpoint(endpoint).unwrap_err();
        assert!(
            err.to_string().contains(says) && err.to_string().contains(endpoint),
            "{endpoint}: {err}"
        );
    }
    let ok = parse_endpoint("https://[fd00::1]:2379/").unwrap();
    assert!(ok.tls && !ok.loopback);
    let ok = parse_endpoint("http://[::1]:2379").unwrap();
    assert!(!ok.tls && ok.loopback);
    assert!(parse_endpoint("http://127.0.0.9:2379").unwrap().loopback);
    assert!(parse_endpoint("http://LOCALHOST:2379").unwrap().loopback);
    assert!(!parse_endpoint("http://10.0.0.1:2379").unwrap().loopback);
}

#[test]
fn plain_http_is_refused_off_loopback_unless_insecure() {
    let err = options(&["http://198.18.0.1:2379"])
        .connect_options()
        .err()
        .unwrap();
    assert_eq!(
        err,
        ConnectError::PlainHttp {
            endpoint: "http://198.18.0.1:2379".into()
        }
    );
    assert!(err.to_string().contains("not loopback"), "{err}");
    // One loopback endpoint does not make another one acceptable.
    let err = options(&["http://127.0.0.1:2379", "http://etcd-b:2379"])
        .connect_options()
        .err()
        .unwrap();
    assert!(
        matches!(err, ConnectError::PlainHttp { endpoint } if endpoint == "http://etcd-b:2379")
    );
    options(&["http://127.0.0.1:2379", "http://localhost:2379"])
        .connect_options()
        .unwrap();
    let mut insecure = options(&["http://198.18.0.1:2379"]);
    insecure.insecure = true;
    insecure.connect_options().unwrap();
}

#[test]
fn https_needs_a_ca_and_one_scheme_for_all_endpoints() {
    let err = options(&["https://etcd-a:2379"])
        .connect_options()
        .err()
        .unwrap();
    assert!(matches!(err, ConnectError::NoCa { .. }), "{err}");
    let err = options(&["http://127.0.0.1:2379", "https://etcd-a:2379"])
        .connect_options()
        .err()
        .unwrap();
    assert!(matches!(err, ConnectError::MixedSchemes { .. }), "{err}");
    let mut tls_on_http = options(&["http://127.0.0.1:2379"]);
    tls_on_http.ca_file = Some("/nonexistent/ca.pem".into());
    assert_eq!(
        tls_on_http.connect_options().err().unwrap(),
        ConnectError::TlsWithoutHttps { what: "CA file" }
    );
}

#[test]
fn tls_files_must_be_readable_pem_and_come_as_a_pair() {
    let dir = tempfile::tempdir().unwrap();
    let pem = dir.path().join("ca.pem");
    std::fs::File::create(&pem)
        .unwrap()
        .write_all(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
        .unwrap();
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let missing = dir.path().join("missing.pem");

    let mut o = options(&["https://etcd-a:2379"]);
    o.ca_file = Some(missing.clone());
    let err = o.connect_options().err().unwrap();
    assert!(
        matches!(&err, ConnectError::ReadFile { what: "CA file", path, .. } if *path == missing),
        "{err}"
    );
    o.ca_file = Some(junk.clone());
    assert_eq!(
        o.connect_options().err().unwrap(),
        ConnectError::NotPem {
            what: "CA file",
            path: junk
        }
    );
    o.ca_file = Some(pem.clone());
    o.connect_options().unwrap();
    o.cert_file = Some(pem.clone());
    assert_eq!(
        o.connect_options().err().unwrap(),
        ConnectError::HalfIdentity {
            cert: Some(pem.clone()),
            key: None
        }
    );
    o.key_file = Some(pem);
    o.connect_options().unwrap();
}

#[test]
fn prefixes_start_with_a_slash_and_end_with_exactly_one() {
    let with = |p: &str| {
        let mut o = options(&["http://127.0.0.1:2379"]);
        o.prefix = p.to_owned();
        o.normalized_prefix()
    };
    assert_eq!(with("/rune/v1").unwrap(), "/rune/v1/");
    assert_eq!(with("/rune/v1//").unwrap(), "/rune/v1/");
    assert!(matches!(with("/"), Err(ConnectError::BadPrefix { .. })));
    assert!(matches!(
        with("rune/v1"),
        Err(ConnectError::BadPrefix { .. })
    ));
    assert!(matches!(
        with("/rune//v1"),
        Err(ConnectError::BadPrefix { .. })
    ));
    let mut zero = options(&["http://127.0.0.1:2379"]);
    zero.max_txn_ops = 0;
    assert!(matches!(
        zero.connect_options(),
        Err(ConnectError::BadOption {
            name: "max_txn_ops",
            ..
        })
    ));
}

#[test]
fn keys_round_trip_and_everything_else_is_named() {
    let layout = Layout::new("/rune/v1/".to_owned());
    let key = ObjectKey::new(Kind::Endpoints, "shop", "web");
    assert_eq!(layout.object(&key), "/rune/v1/endpoints/shop/web");
    assert_eq!(
        layout.parse(layout.object(&key).as_bytes()),
        Parsed::Object(key.clone())
    );
    assert_eq!(parse_relative(&relative(&key)), Ok(key));
    let vip: IpAddr = "fd00::1".parse().unwrap();
    assert_eq!(layout.vip(&vip), "/rune/v1/_index/vip/fd00::1");
    assert_eq!(layout.parse(layout.vip(&vip).as_bytes()), Parsed::Internal);
    assert_eq!(
        layout.objects_of(Kind::Service, Some("default")),
        "/rune/v1/service/default/"
    );
    for (key, says) in [
        ("/rune/v1/secret/default/x", "unknown kind \"secret\""),
        ("/rune/v1/Service/default/x", "unknown kind \"Service\""),
        ("/rune/v1/service/default", "not <kind>/<namespace>/<name>"),
        (
            "/rune/v1/service/default/x/y",
            "not <kind>/<namespace>/<name>",
        ),
        ("/rune/v1/service//x", "empty namespace or name"),
        ("/other/service/default/x", "not under the prefix"),
    ] {
        match layout.parse(key.as_bytes()) {
            Parsed::Unknown(reason) => assert!(reason.contains(says), "{key}: {reason}"),
            other => panic!("{key}: {other:?}"),
        }
    }
    assert!(matches!(layout.parse(b"/rune/v1/\xff"), Parsed::Unknown(_)));
}

#[test]
fn a_range_end_covers_exactly_the_prefix() {
    assert_eq!(range_end(b"/rune/v1/"), b"/rune/v10".to_vec());
    assert_eq!(range_end(b"a\xff"), b"b".to_vec());
    assert_eq!(range_end(b"\xff\xff"), vec![0]);
}

#[tokio::test]
async fn connecting_sends_nothing_and_a_request_to_nobody_is_unavailable() {
    // A port nothing listens on (bound, then closed).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut o = options(&[endpoint.as_str()]);
    o.connect_timeout = std::time::Duration::from_millis(500);
    o.request_timeout = std::time::Duration::from_secs(2);
    let log = EtcdLog::connect(o).await.unwrap();
    let err = log.revision().await.unwrap_err();
    match &err {
        LogError::Unavailable { endpoints, message } => {
            assert_eq!(*endpoints, endpoint);
            assert!(!message.contains("grpc request error"), "{message}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        err.to_string()
            .starts_with(&format!("etcd at {endpoint} is unavailable: ")),
        "{err}"
    );
}

#[test]
fn errors_say_the_cause_without_the_transports_wrappers() {
    let status = tonic::Status::unavailable("transport error: connection refused");
    let e = etcd_client::Error::GRpcStatus(status);
    assert_eq!(error::describe(&e), "connection refused");
    assert!(error::is_transient(&e));
    let denied = etcd_client::Error::GRpcStatus(tonic::Status::permission_denied(
        "etcdserver: permission denied",
    ));
    assert!(matches!(
        error::log_error("https://etcd-a:2379", &denied),
        LogError::Refused { endpoints, message }
            if endpoints == "https://etcd-a:2379"
                && message == format!("etcdserver: permission denied{}", error::PERMISSION_HINT)
    ));
    let compacted = etcd_client::Error::GRpcStatus(tonic::Status::out_of_range(
        "etcdserver: mvcc: required revision has been compacted",
    ));
    assert!(error::is_compacted(&compacted) && !error::is_transient(&compacted));
}

#[test]
fn a_refused_client_certificate_is_named_as_such() {
    let alert = error::tls_hint("connection error: received fatal alert: BadCertificate");
    assert!(
        alert
            .unwrap()
            .contains("etcd refused this client's certificate")
    );
    let closed = error::tls_hint("connection closed").unwrap();
    assert!(
        closed.contains("if this goes on while etcd is up"),
        "{closed}"
    );
    assert_eq!(
        error::tls_hint("tcp connect error: Connection refused"),
        None
    );
}
