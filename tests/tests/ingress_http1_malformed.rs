//! Malformed and ambiguous HTTP/1.1 requests at the ingress, as raw clients send
//! them: what must be refused before any backend sees it, and how a request
//! framed two ways is forwarded. Needs no root.

use rune_agent_tests::{
    ingress::Ingress,
    on_both_paths,
    wire::{Reply, Wire, ok, scripted},
};
use std::{io::ErrorKind, time::Duration};

/// How long the proxy gets to close a connection it should close.
const CLOSE_WAIT: Duration = Duration::from_secs(3);

/// Reads the answer to something malformed: a 400, or the connection closed
/// (end or reset) without a response.
fn refused(client: &mut Wire, what: &str) {
    match client.response(false) {
        Ok(r) => assert_eq!(r.status, 400, "{what}: {r:?}"),
        Err(e) => assert!(
            !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{what}: no answer: {e}"
        ),
    }
}

fn malformed_requests_are_refused_before_the_backend(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |_| Reply::keep(ok("served")));
    let h = "Host: web.test\r\n";
    let cases = [
        ("a garbage request line", format!("HELLO THERE\r\n{h}\r\n")),
        ("four parts", format!("GET / HTTP/1.1 extra\r\n{h}\r\n")),
        (
            "a space before a colon",
            "GET / HTTP/1.1\r\nHost : web.test\r\n\r\n".into(),
        ),
        (
            "two different lengths",
            format!("POST / HTTP/1.1\r\n{h}Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd"),
        ),
        (
            "a signed length",
            format!("POST / HTTP/1.1\r\n{h}Content-Length: +3\r\n\r\nabc"),
        ),
        (
            "chunked not the last coding",
            format!(
                "POST / HTTP/1.1\r\n{h}Transfer-Encoding: chunked, gzip\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
            ),
        ),
        (
            "an absolute target naming another host",
            "GET http://web.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n".into(),
        ),
    ];
    for (what, request) in cases {
        let mut client = Wire::connect(ingress.http);
        client.send(request.as_bytes());
        refused(&mut client, what);
    }
    assert!(backend.received().is_empty(), "{:?}", backend.received());
}

fn a_request_with_both_length_and_chunked_is_refused_or_forwarded_chunked_then_closed(
    ingress: &Ingress,
) {
    let backend = scripted(ingress, "web.test", |r| Reply::keep(ok(&r.body)));
    let mut client = Wire::connect(ingress.http);
    client.send(
        b"POST / HTTP/1.1\r\nHost: web.test\r\nContent-Length: 3\r\n\
          Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    );
    let r = client.response(false).expect("an answer");
    if r.status != 400 {
        // Forwarded: framed by the chunked coding alone, the length removed.
        assert_eq!((r.status, r.text().as_str()), (200, "abc"), "{r:?}");
        let received = backend.received();
        assert_eq!(received.len(), 1, "{received:?}");
        assert_eq!(
            received[0].head.header("content-length"),
            None,
            "{received:?}"
        );
    }
    // RFC 9112 6.1: the connection is closed after responding either way.
    assert!(client.closes_within(CLOSE_WAIT), "left open");
}

fn an_obs_folded_header_is_refused_or_unfolded(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |_| Reply::keep(ok("served")));
    let mut client = Wire::connect(ingress.http);
    client.send(b"GET / HTTP/1.1\r\nHost: web.test\r\nX-Fold: a\r\n b\r\n\r\n");
    let r = client.response(false).expect("an answer");
    if r.status != 400 {
        assert_eq!(r.status, 200, "{r:?}");
        let got = backend.received().pop().expect("the request");
        assert_eq!(got.head.all("x-fold"), ["a b"], "{got:?}");
    }
}

/// A body whose `Content-Length` the client's `Connection` names as hop-by-hop:
/// the endpoint must still get the body framed, never as a second request.
fn a_length_named_by_connection_cannot_smuggle_a_request(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |r| Reply::keep(ok(&r.body)));
    let smuggled = "GET /admin HTTP/1.1\r\nHost: web.test\r\nX-Forwarded-For: 10.0.0.1\r\n\r\n";
    let mut client = Wire::connect(ingress.http);
    client.send(
        format!(
            "POST / HTTP/1.1\r\nHost: web.test\r\nConnection: content-length\r\n\
             Content-Length: {}\r\n\r\n{smuggled}",
            smuggled.len()
        )
        .as_bytes(),
    );
    let r = client.response(false).expect("an answer");
    assert_eq!((r.status, r.text()), (200, smuggled.to_owned()), "{r:?}");
    // The next client request gets its own answer, not the smuggled one's.
    let next = client.get("web.test", "/next");
    assert_eq!(next.status, 200, "{next:?}");
    std::thread::sleep(Duration::from_millis(200));
    let received = backend.received();
    let targets: Vec<&str> = received.iter().map(|r| r.target()).collect();
    assert_eq!(targets, ["/", "/next"], "{received:?}");
}

/// A response whose `Content-Length` the endpoint's `Connection` names: the
/// client still gets it framed, and its connection goes on.
fn a_response_length_named_by_connection_still_frames_the_body(ingress: &Ingress) {
    let _backend = scripted(ingress, "web.test", |_| {
        Reply::keep(
            "HTTP/1.1 200 OK\r\nConnection: content-length\r\nContent-Length: 5\r\n\r\nhello",
        )
    });
    let mut client = Wire::connect(ingress.http);
    for _ in 0..2 {
        let r = client.get("web.test", "/");
        assert_eq!((r.status, r.text().as_str()), (200, "hello"), "{r:?}");
    }
}

/// `request` to a route of `web.test` gets 400, and its backend sees nothing.
fn answered_400_before_the_backend(ingress: &Ingress, request: &[u8]) {
    let backend = scripted(ingress, "web.test", |_| Reply::keep(ok("served")));
    let mut client = Wire::connect(ingress.http);
    client.send(request);
    let r = client.response(false).expect("an answer");
    assert_eq!(r.status, 400, "{r:?}");
    assert!(backend.received().is_empty(), "{:?}", backend.received());
}

fn two_different_host_headers_get_400_before_the_backend(ingress: &Ingress) {
    answered_400_before_the_backend(
        ingress,
        b"GET / HTTP/1.1\r\nHost: web.test\r\nHost: other.test\r\n\r\n",
    );
}

fn an_http11_request_without_host_gets_400(ingress: &Ingress) {
    answered_400_before_the_backend(ingress, b"GET / HTTP/1.1\r\n\r\n");
}

on_both_paths!(
    malformed_requests_are_refused_before_the_backend,
    a_request_with_both_length_and_chunked_is_refused_or_forwarded_chunked_then_closed,
    an_obs_folded_header_is_refused_or_unfolded,
    a_length_named_by_connection_cannot_smuggle_a_request,
    a_response_length_named_by_connection_still_frames_the_body,
    two_different_host_headers_get_400_before_the_backend,
    an_http11_request_without_host_gets_400,
);
