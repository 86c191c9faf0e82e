//! The ingress proxy end to end in dev mode: `rune-agent run --dev --ingress` on
//! 127.0.0.1, HTTP backends the test runs on loopback, curl as the client (HTTP/1.1
//! and h2), certificates from Secrets the test makes (rcgen). Needs no root.

use rune_agent_tests::{
    http::{HttpBackend, TestCa, http_backend, tls_secret, write_file},
    ingress::{Ingress, PATIENCE, exposed, ip},
};
use rune_harness::agent::{eventually, metric};
use std::{
    io::{Read, Write},
    net::TcpStream,
    time::Duration,
};

#[test]
fn routes_by_host_and_path_over_http1_and_h2() {
    let ingress = Ingress::start();
    let backends: Vec<HttpBackend> = ["root", "api", "v1", "wild", "hang"]
        .iter()
        .map(|n| http_backend(ip("127.0.0.1"), 0, n, *n == "hang"))
        .collect();
    let [root, api, v1, wild, hang] = &backends[..] else {
        unreachable!()
    };
    let mut yaml = String::new();
    yaml += &exposed("root", "host: a.example.com", &[root]);
    yaml += &exposed("api", "host: a.example.com, path: /api", &[api]);
    yaml += &exposed("v1", "host: a.example.com, path: /api/v1", &[v1]);
    yaml += &exposed("wild", "host: '*.example.com'", &[wild]);
    yaml += &exposed("hang", "host: hang.test", &[hang]);
    yaml += &exposed(
        "only-lo",
        "host: allow.test, allowCidrs: [127.0.0.1/32]",
        &[root],
    );
    yaml += &exposed("empty", "host: empty.test", &[]);
    yaml += &exposed("nocert", "host: nocert.test, tls: {secret: nope}", &[root]);
    ingress.apply(&yaml);
    ingress.until("empty.test", "/", 503);

    // `status` lists each route with what keeps it from serving.
    let out = ingress.agent.cli(&["status"], None);
    let status = String::from_utf8_lossy(&out.stdout);
    for line in [
        "a.example.com/api -> default/api, 1 endpoint",
        "*.example.com/ -> default/wild, 1 endpoint",
        "allow.test/ -> default/only-lo, 1 endpoint, allow 1 network",
        "empty.test/ -> default/empty, 0 endpoints; no ready endpoint: 503",
        "nocert.test/ -> default/nocert, 1 endpoint, tls secret default/nope; \
         secret default/nope missing or unusable: handshakes refused",
    ] {
        assert!(
            status
                .lines()
                .any(|l| l.trim_start_matches("routes:").trim() == line),
            "no route line {line:?} in status:\n{status}"
        );
    }

    for (host, path, want) in [
        ("a.example.com", "/", "root /"),
        ("a.example.com", "/api", "api /api"),
        ("a.example.com", "/api/x?q=1", "api /api/x?q=1"),
        ("a.example.com", "/apiary", "root /apiary"),
        ("a.example.com", "/api/v1/users", "v1 /api/v1/users"),
        ("b.example.com", "/api", "wild /api"),
    ] {
        let r = ingress.get(host, path, &[]);
        assert_eq!(r.code, 200, "{host}{path}: {r:?}");
        assert!(r.body.starts_with(want), "{host}{path}: {r:?}");
        assert_eq!(r.version, "1.1");
    }
    // Only one label under a wildcard; unknown hosts: 404 from the proxy.
    assert_eq!(ingress.get("x.b.example.com", "/", &[]).code, 404);
    assert_eq!(ingress.get("other.test", "/", &[]).code, 404);

    // h2 with prior knowledge on the plain port.
    let r = ingress.get("a.example.com", "/api", &["--http2-prior-knowledge"]);
    assert_eq!((r.code, r.version.as_str()), (200, "2"), "{r:?}");
    assert!(r.body.starts_with("api /api"), "{r:?}");

    // X-Forwarded-For and Forwarded are replaced (the client is not trusted), the
    // rest set.
    let r = ingress.get(
        "a.example.com",
        "/",
        &[
            "-H",
            "X-Forwarded-For: 203.0.113.9",
            "-H",
            "Forwarded: for=203.0.113.9",
        ],
    );
    assert!(
        r.body.contains(&format!(
            "forwarded=for=127.0.0.1;proto=http;host=\"a.example.com:{}\"",
            ingress.http
        )),
        "{r:?}"
    );
    assert!(
        r.body
            .contains("xff=127.0.0.1 proto=http host=a.example.com:"),
        "{r:?}"
    );

    // allowCidrs: 127.0.0.1 is listed, 127.0.0.2 is not.
    assert_eq!(ingress.get("allow.test", "/", &[]).code, 200);
    let other = ingress.get("allow.test", "/", &["--interface", "127.0.0.2"]);
    assert_eq!(other.code, 403, "{other:?}");

    // A backend that never answers: 504 after the response timeout.
    let r = ingress.get("hang.test", "/", &[]);
    assert_eq!(r.code, 504, "{r:?}");
    assert!(ingress.metric("rune_ingress_upstream_errors_total{reason=\"timeout\"}") >= 1.0);

    // A head above --ingress-max-header-bytes: 431.
    let big = format!("X-Big: {}", "x".repeat(10_000));
    let r = ingress.get("a.example.com", "/", &["-H", &big]);
    assert_eq!(r.code, 431, "{r:?}");

    // A second service claiming a.example.com/api is refused, naming both.
    let out = ingress.agent.cli(
        &["apply", "-f", "-"],
        Some(&exposed(
            "api-two",
            "host: a.example.com, path: /api",
            &[api],
        )),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let both = "Service default/api-two: spec.expose: host a.example.com path /api \
                is already used by Service default/api";
    assert!(err.contains(both), "{err}");

    let ok =
        "rune_ingress_requests_total{host=\"a.example.com\",service=\"default/api\",code=\"200\"}";
    assert!(ingress.metric(ok) >= 2.0);
}

#[test]
fn an_upgrade_is_spliced_through() {
    let ingress = Ingress::start();
    let backend = http_backend(ip("127.0.0.1"), 0, "web", false);
    ingress.apply(&exposed("web", "host: web.test", &[&backend]));
    ingress.until("web.test", "/", 200);
    let mut s = TcpStream::connect(("127.0.0.1", ingress.http)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(
        b"GET /ws HTTP/1.1\r\nHost: web.test\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n",
    )
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(
            s.read(&mut byte).unwrap(),
            1,
            "closed in the head: {head:?}"
        );
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: echo"), "{head}");
    for i in 0..3 {
        let msg = format!("ping {i}\n");
        s.write_all(msg.as_bytes()).unwrap();
        let mut back = vec![0u8; msg.len()];
        s.read_exact(&mut back).unwrap();
        assert_eq!(String::from_utf8_lossy(&back), msg);
    }
}

#[test]
fn a_dead_endpoint_is_retried_on_the_other() {
    let ingress = Ingress::start();
    let alive = http_backend(ip("127.0.0.2"), 0, "alive", false);
    let doomed = http_backend(ip("127.0.0.3"), alive.addr.port(), "doomed", false);
    ingress.apply(&exposed("web", "host: web.test", &[&alive, &doomed]));
    ingress.until("web.test", "/", 200);
    // Both serve while both live.
    eventually(PATIENCE, "both endpoints answer", || {
        let names: Vec<String> = (0..10)
            .map(|_| ingress.get("web.test", "/", &[]).body)
            .collect();
        (names.iter().any(|b| b.starts_with("alive"))
            && names.iter().any(|b| b.starts_with("doomed")))
        .then_some(())
    });
    doomed.stop();
    // Every request still succeeds: a refused connect is retried on the other.
    for i in 0..30 {
        let r = ingress.get("web.test", "/", &[]);
        assert_eq!(r.code, 200, "request {i}: {r:?}");
        assert!(r.body.starts_with("alive"), "request {i}: {r:?}");
    }
    assert!(ingress.metric("rune_ingress_upstream_errors_total{reason=\"connect\"}") >= 1.0);
    alive.stop();
    let r = ingress.get("web.test", "/", &[]);
    assert_eq!(r.code, 502, "{r:?}");
}

#[test]
fn tls_from_secrets_by_sni_with_redirect_and_rotation() {
    let ingress = Ingress::start();
    let dir = tempfile::tempdir().unwrap();
    let (ca_a, ca_b, ca_new) = (
        TestCa::new("ca a"),
        TestCa::new("ca b"),
        TestCa::new("ca new"),
    );
    let file = |name: &str, text: &str| write_file(dir.path(), name, text);
    let (ca_a_file, ca_b_file) = (file("a.pem", &ca_a.pem), file("b.pem", &ca_b.pem));
    let new_file = file("new.pem", &ca_new.pem);
    let both = file("both.pem", &format!("{}{}", ca_a.pem, ca_new.pem));
    let backend = http_backend(ip("127.0.0.1"), 0, "web", false);
    let (cert_a, key_a) = ca_a.leaf("a.test");
    let (cert_b, key_b) = ca_b.leaf("b.test");
    let mut yaml = tls_secret("cert-a", &cert_a, &key_a) + "\n---\n";
    yaml += &(tls_secret("cert-b", &cert_b, &key_b) + "\n---\n");
    yaml += &exposed("a", "host: a.test, tls: {secret: cert-a}", &[&backend]);
    yaml += &exposed(
        "b",
        "host: b.test, tls: {secret: default/cert-b}",
        &[&backend],
    );
    ingress.apply(&yaml);

    // `get` hides a Secret's values unless asked.
    let shown = |args: &[&str]| {
        let out = ingress.agent.cli(args, None);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for args in [
        &["get", "secret", "cert-b"][..],
        &["get", "secret", "cert-b", "-o", "yaml"],
        &["get", "-o", "json"],
    ] {
        let text = shown(args);
        assert!(
            text.contains("cert-b") && !text.contains("PRIVATE KEY"),
            "{args:?}: {text}"
        );
    }
    let text = shown(&["get", "secret", "cert-b", "-o", "yaml", "--show-secrets"]);
    assert!(text.contains("BEGIN PRIVATE KEY"), "{text}");

    // Plain HTTP to a TLS route: 308 to the same URL over HTTPS.
    let r = ingress.until("a.test", "/x?y=1", 308);
    let location = format!("https://a.test:{}/x?y=1", ingress.https);
    let r2 = ingress.get("a.test", "/x?y=1", &["-D", "-"]);
    assert!(r2.body.contains(&location), "{r:?} {r2:?}");

    // SNI picks each host's certificate: each verifies against its own CA only.
    let a = ingress.get_tls("a.test", "/", &ca_a_file, &[]);
    assert_eq!((a.code, a.version.as_str()), (200, "2"), "ALPN h2: {a:?}");
    assert!(a.body.contains("proto=https host=a.test"), "{a:?}");
    let b = ingress.get_tls("b.test", "/", &ca_b_file, &["--http1.1"]);
    assert_eq!((b.code, b.version.as_str()), (200, "1.1"), "{b:?}");
    assert_ne!(ingress.get_tls("b.test", "/", &ca_a_file, &[]).exit, 0);
    // An unknown name gets no certificate: the handshake is refused.
    let unknown = ingress.get_tls("c.test", "/", &ca_a_file, &[]);
    assert_eq!(unknown.code, 0, "{unknown:?}");
    assert!(
        ingress.metric("rune_ingress_tls_handshake_errors_total{reason=\"unknown_sni\"}") >= 1.0
    );

    // Rotation: a new certificate for a.test (another CA) while a client loops over
    // new connections trusting both CAs; no request fails, and new handshakes get
    // the new certificate.
    let (cert_new, key_new) = ca_new.leaf("a.test");
    let rotate = tls_secret("cert-a", &cert_new, &key_new);
    let mut failed = Vec::new();
    for i in 0..60 {
        if i == 20 {
            ingress.apply(&rotate);
        }
        let r = ingress.get_tls("a.test", "/", &both, &[]);
        if r.code != 200 {
            failed.push((i, r));
        }
    }
    assert!(failed.is_empty(), "failed during rotation: {failed:?}");
    eventually(PATIENCE, "the new certificate served", || {
        (ingress.get_tls("a.test", "/", &new_file, &[]).code == 200).then_some(())
    });
    assert_ne!(ingress.get_tls("a.test", "/", &ca_a_file, &[]).exit, 0);
}

#[test]
fn names_without_a_route_get_the_default_certificate_when_one_is_set() {
    let ingress = Ingress::start_with(&["--ingress-default-cert", "ops/fallback"]);
    let dir = tempfile::tempdir().unwrap();
    let (ca, ca_other) = (TestCa::new("ca default"), TestCa::new("ca other"));
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca.pem).unwrap();
    let (cert, key) = ca.leaf("unknown.test");
    let secret = tls_secret("ops/fallback", &cert, &key);
    let backend = http_backend(ip("127.0.0.1"), 0, "web", false);
    let (cert_a, key_a) = ca_other.leaf("a.test");
    let yaml = secret + "\n---\n" + &tls_secret("cert-a", &cert_a, &key_a) + "\n---\n";
    ingress.apply(&(yaml + &exposed("a", "host: a.test, tls: {secret: cert-a}", &[&backend])));
    // A name no route has: the handshake completes with the default certificate,
    // and the proxy answers 404 for the missing route.
    let r = eventually(PATIENCE, "the default certificate served", || {
        let r = ingress.get_tls("unknown.test", "/", &ca_file, &[]);
        (r.code != 0).then_some(r)
    });
    assert_eq!(r.code, 404, "{r:?}");
    // Its expiry, and the routed host's, are exported.
    let text = ingress.agent.metrics_text();
    assert!(
        metric(
            &text,
            "rune_ingress_certificate_expiry_seconds{host=\"a.test\"}"
        )
        .is_some_and(|t| t > 1.7e9),
        "{text}"
    );
}

#[test]
fn a_slow_header_client_is_cut_while_a_good_client_is_served() {
    let ingress = Ingress::start();
    let backend = http_backend(ip("127.0.0.1"), 0, "web", false);
    ingress.apply(&exposed("web", "host: web.test", &[&backend]));
    ingress.until("web.test", "/", 200);
    // Slowloris: one header byte every 100 ms, for at most 80 bytes (8 s); the
    // header timeout is 1 s, so the proxy must close the connection first.
    let mut slow = TcpStream::connect(("127.0.0.1", ingress.http)).unwrap();
    slow.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let head = format!(
        "GET / HTTP/1.1\r\nHost: web.test\r\nX-Slow: {}",
        "y".repeat(80)
    );
    let mut cut = false;
    let mut served = 0;
    for (i, byte) in head.bytes().enumerate() {
        if slow.write_all(&[byte]).is_err() {
            cut = true;
            break;
        }
        let mut buf = [0u8; 512];
        match slow.read(&mut buf) {
            Ok(_) => {
                // 0 bytes: closed; anything else is the proxy's 408/close.
                cut = true;
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => {
                cut = true;
                break;
            }
        }
        // Meanwhile a good client is served.
        if i % 5 == 0 {
            let r = ingress.get("web.test", "/", &[]);
            assert_eq!(r.code, 200, "good client beside the slow one: {r:?}");
            served += 1;
        }
    }
    assert!(cut, "the slow client was never cut");
    assert!(served >= 1);
}
