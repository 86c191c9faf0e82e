//! HTTP/1.1 messages through the ingress as raw clients and backends see them on
//! the wire: body framings both ways, large bodies, the forwarded headers, the
//! request target, and malformed responses. Needs no root.

use rune_agent_tests::{
    ingress::Ingress,
    on_both_paths,
    wire::{Reply, Then, Wire, ok, scripted},
};
use std::{sync::Arc, time::Duration};

/// `n` bytes of a pattern that does not repeat on chunk or buffer boundaries.
fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

/// `body` chunked in pieces of `piece` bytes, with the last chunk.
fn chunked(body: &[u8], piece: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for c in body.chunks(piece) {
        out.extend(format!("{:x}\r\n", c.len()).as_bytes());
        out.extend(c);
        out.extend(b"\r\n");
    }
    out.extend(b"0\r\n\r\n");
    out
}

fn a_chunked_response_with_an_extension_and_a_trailer_arrives_decoded(ingress: &Ingress) {
    let _backend = scripted(ingress, "web.test", |r| match r.target() {
        "/chunked" => Reply::keep(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\n\r\n\
             5;x=y\r\nhello\r\n6\r\n world\r\n0\r\nX-Sum: 42\r\n\r\n",
        ),
        _ => Reply::keep(ok("after")),
    });
    let mut client = Wire::connect(ingress.http);
    for _ in 0..2 {
        let r = client.get("web.test", "/chunked");
        assert_eq!((r.status, r.text().as_str()), (200, "hello world"), "{r:?}");
        let r = client.get("web.test", "/next");
        assert_eq!((r.status, r.text().as_str()), (200, "after"), "{r:?}");
    }
}

fn a_close_delimited_response_arrives_whole(ingress: &Ingress) {
    let body = Arc::new(pattern(100_000));
    let sent = body.clone();
    let _backend = scripted(ingress, "web.test", move |_| {
        let head = &b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n"[..];
        Reply::then([head, &sent].concat(), Then::Close)
    });
    let mut client = Wire::connect(ingress.http);
    let r = client.get("web.test", "/");
    assert_eq!(r.status, 200, "{:?}", r.head);
    assert!(r.body == *body, "{} bytes of {}", r.body.len(), body.len());
}

fn a_post_body_reaches_the_backend_exactly_whether_sent_with_the_head_or_after(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |r| {
        Reply::keep(ok(r.body.len().to_string()))
    });
    let mut client = Wire::connect(ingress.http);
    let head = b"POST /p HTTP/1.1\r\nHost: web.test\r\nContent-Length: 11\r\n\r\n";
    client.send(&[&head[..], b"hello world"].concat());
    let r = client.response(false).expect("the response");
    assert_eq!((r.status, r.text().as_str()), (200, "11"), "{r:?}");
    client.send(head);
    std::thread::sleep(Duration::from_millis(300));
    client.send(b"later body!");
    let r = client.response(false).expect("the response");
    assert_eq!((r.status, r.text().as_str()), (200, "11"), "{r:?}");
    let received = backend.received();
    let bodies: Vec<&[u8]> = received.iter().map(|r| &r.body[..]).collect();
    assert_eq!(bodies, [&b"hello world"[..], b"later body!"]);
    for r in &received {
        assert_eq!(r.head.header("content-length"), Some("11"), "{r:?}");
    }
}

fn forwarded_headers_are_set_and_hop_by_hop_ones_dropped_both_ways(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |_| {
        Reply::keep(
            "HTTP/1.1 200 OK\r\nConnection: X-Internal\r\nX-Internal: 1\r\n\
             Keep-Alive: timeout=9\r\nX-App: 1\r\nContent-Length: 2\r\n\r\nok",
        )
    });
    let mut client = Wire::connect(ingress.http);
    client.send(
        b"GET /h HTTP/1.1\r\nHost: web.test\r\nX-Forwarded-For: 6.6.6.6\r\n\
          Forwarded: for=6.6.6.6\r\nConnection: keep-alive, X-Secret\r\nX-Secret: s\r\n\
          Keep-Alive: timeout=5\r\nProxy-Connection: x\r\n\r\n",
    );
    let r = client.response(false).expect("the response");
    assert_eq!((r.status, r.text().as_str()), (200, "ok"), "{r:?}");
    assert_eq!(r.head.header("x-app"), Some("1"), "{r:?}");
    for h in ["x-internal", "keep-alive"] {
        assert_eq!(r.head.header(h), None, "{h} reached the client: {r:?}");
    }
    let connection = r.head.all("connection").join(",").to_ascii_lowercase();
    assert!(!connection.contains("x-internal"), "{r:?}");
    let got = backend.received().pop().expect("the forwarded request");
    let h = |name: &str| got.head.all(name);
    assert_eq!(h("x-forwarded-for"), ["127.0.0.1"], "{got:?}");
    assert_eq!(h("x-forwarded-proto"), ["http"], "{got:?}");
    assert_eq!(h("x-forwarded-host"), ["web.test"], "{got:?}");
    assert_eq!(h("host"), ["web.test"], "{got:?}");
    let forwarded = h("forwarded");
    assert_eq!(forwarded.len(), 1, "{got:?}");
    assert!(forwarded[0].starts_with("for=127.0.0.1"), "{got:?}");
    assert!(!forwarded[0].contains("6.6.6.6"), "{got:?}");
    for name in ["x-secret", "keep-alive", "proxy-connection"] {
        assert!(h(name).is_empty(), "{name} reached the backend: {got:?}");
    }
    // The connection goes on.
    let r = client.get("web.test", "/again");
    assert_eq!(r.status, 200, "{r:?}");
}

fn a_garbage_or_missing_backend_response_gets_502(ingress: &Ingress) {
    let _backend = scripted(ingress, "web.test", |r| match r.target() {
        "/garbage" => Reply::then("HELLO\r\n\r\n", Then::Close),
        "/silent" => Reply::then(Vec::new(), Then::Close),
        _ => Reply::keep(ok("after")),
    });
    for path in ["/garbage", "/silent"] {
        let mut client = Wire::connect(ingress.http);
        let r = client.get("web.test", path);
        assert_eq!(r.status, 502, "{path}: {r:?}");
    }
    // To a HEAD: the 502 has no body, and the connection's next response is whole.
    let mut client = Wire::connect(ingress.http);
    client.send(b"HEAD /garbage HTTP/1.1\r\nHost: web.test\r\n\r\n");
    let r = client.response(true).expect("the HEAD's answer");
    assert_eq!(r.status, 502, "{r:?}");
    let next = client.get("web.test", "/after");
    assert_eq!(
        (next.status, next.text().as_str()),
        (200, "after"),
        "{next:?}"
    );
}

fn large_bodies_both_ways_arrive_intact(ingress: &Ingress) {
    let big = Arc::new(pattern(4 << 20));
    let sent = big.clone();
    let backend = scripted(ingress, "web.test", move |r| match r.target() {
        "/big" => Reply::keep(ok(&sent[..])),
        "/big-chunked" => {
            let head = &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"[..];
            Reply::keep([head, &chunked(&sent, 65_536)].concat())
        }
        _ => Reply::keep(ok(r.body.len().to_string())),
    });
    let mut client = Wire::connect(ingress.http);
    let upload = pattern(1 << 20);
    let head = format!(
        "POST /up HTTP/1.1\r\nHost: web.test\r\nContent-Length: {}\r\n\r\n",
        upload.len()
    );
    client.send(&[head.as_bytes(), &upload].concat());
    let r = client.response(false).expect("the upload's response");
    assert_eq!(
        (r.status, r.text()),
        (200, upload.len().to_string()),
        "{r:?}"
    );
    let got = backend.received().pop().expect("the upload");
    assert!(
        got.body == upload,
        "{} bytes of {}",
        got.body.len(),
        upload.len()
    );
    for path in ["/big", "/big-chunked"] {
        let r = client.get("web.test", path);
        assert_eq!(r.status, 200, "{path}: {:?}", r.head);
        assert!(
            r.body == *big,
            "{path}: {} bytes of {}",
            r.body.len(),
            big.len()
        );
    }
}

fn the_request_target_with_a_query_is_forwarded_verbatim(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |r| Reply::keep(ok(r.target())));
    let mut client = Wire::connect(ingress.http);
    let target = "/a/b?x=1&y=%20";
    let r = client.get("web.test", target);
    assert_eq!((r.status, r.text().as_str()), (200, target), "{r:?}");
    let got = backend.received().pop().expect("the request");
    assert_eq!(got.target(), target, "{got:?}");
}

on_both_paths!(
    a_chunked_response_with_an_extension_and_a_trailer_arrives_decoded,
    a_close_delimited_response_arrives_whole,
    a_post_body_reaches_the_backend_exactly_whether_sent_with_the_head_or_after,
    forwarded_headers_are_set_and_hop_by_hop_ones_dropped_both_ways,
    a_garbage_or_missing_backend_response_gets_502,
    large_bodies_both_ways_arrive_intact,
    the_request_target_with_a_query_is_forwarded_verbatim,
);
