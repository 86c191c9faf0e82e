//! The ingress's limits in dev mode: request bodies (announced and streamed) and
//! the connection cap, whose idle keep-alive connections make room. Needs no root.

use rune_agent_tests::{
    http::{http_backend, write_file},
    ingress::{Ingress, exposed, ip},
};
use std::{
    io::{Read, Write},
    net::TcpStream,
    time::Duration,
};

#[test]
fn a_body_past_the_limit_gets_413_announced_or_chunked() {
    let ingress = Ingress::start_with(&["--ingress-max-body-bytes", "1024"]);
    let hang = http_backend(ip("127.0.0.1"), 0, "hang", true);
    let web = http_backend(ip("127.0.0.1"), 0, "web", false);
    let yaml = exposed("hang", "host: hang.test", &[&hang]);
    ingress.apply(&(yaml + &exposed("web", "host: web.test", &[&web])));
    ingress.until("web.test", "/", 200);
    let dir = tempfile::tempdir().unwrap();
    let big = write_file(dir.path(), "big", &"x".repeat(4096));
    let small = write_file(dir.path(), "small", &"x".repeat(512));
    let (big, small) = (
        format!("@{}", big.display()),
        format!("@{}", small.display()),
    );
    let chunked = ["-H", "Transfer-Encoding: chunked", "--data-binary"];
    // Chunked past the limit, to an endpoint that never answers: only the limit
    // can end the exchange, with 413.
    let r = ingress.get("hang.test", "/", &[&chunked[..], &[big.as_str()]].concat());
    assert_eq!(r.code, 413, "{r:?}");
    // An announced length past the limit: 413 before anything is sent.
    let r = ingress.get("web.test", "/", &["--data-binary", &big]);
    assert_eq!(r.code, 413, "{r:?}");
    // Chunked within the limit: served.
    let r = ingress.get("web.test", "/", &[&chunked[..], &[small.as_str()]].concat());
    assert_eq!(r.code, 200, "{r:?}");
}

/// A connection to `port` that sent one request for `host` and read its whole
/// answer (its `Content-Length`), left open (keep-alive).
fn answered_keep_alive(port: u16, host: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    write!(s, "GET / HTTP/1.1\r\nHost: {host}\r\n\r\n").unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    // Bounded: a few reads carry one small answer.
    for _ in 0..100 {
        let n = s.read(&mut chunk).expect("the answer");
        assert_ne!(n, 0, "closed before the answer: {got:?}");
        got.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            assert!(head.starts_with("http/1.1 200"), "{head}");
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("a content-length");
            if body.len() >= length {
                return s;
            }
        }
    }
    panic!("no whole answer: {got:?}");
}

/// Whether the proxy closed `s` (end of stream or reset) within its read timeout.
fn closed(s: &mut TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match s.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

#[test]
fn at_the_connection_cap_idle_keep_alive_connections_make_room() {
    // A long header timeout: idle keep-alive connections stay until asked.
    let ingress = Ingress::start_with(&[
        "--ingress-max-connections",
        "2",
        "--ingress-header-timeout-ms",
        "30000",
    ]);
    let web = http_backend(ip("127.0.0.1"), 0, "web", false);
    ingress.apply(&exposed("web", "host: web.test", &[&web]));
    ingress.until("web.test", "/", 200);
    let mut idle = [
        answered_keep_alive(ingress.http, "web.test"),
        answered_keep_alive(ingress.http, "web.test"),
    ];
    // The cap is reached; a third client is still served ...
    let r = ingress.get("web.test", "/", &[]);
    assert_eq!(r.code, 200, "{r:?}");
    // ... because the idle connections were closed to make room.
    let count = idle.iter_mut().map(closed).filter(|c| *c).count();
    assert!(count >= 1, "no idle connection was closed");
}
