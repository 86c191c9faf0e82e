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

fn two_different_host_headers_get_400_before_the_backend(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |_| Reply::keep(ok("served")));
    let mut client = Wire::connect(ingress.http);
    client.send(b"GET / HTTP/1.1\r\nHost: web.test\r\nHost: other.test\r\n\r\n");
    let r = client.response(false).expect("an answer");
    assert_eq!(r.status, 400, "{r:?}");
    assert!(backend.received().is_empty(), "{:?}", backend.received());
}

fn an_http11_request_without_host_gets_400(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |_| Reply::keep(ok("served")));
    let mut client = Wire::connect(ingress.http);
    client.send(b"GET / HTTP/1.1\r\n\r\n");
    let r = client.response(false).expect("an answer");
    assert_eq!(r.status, 400, "{r:?}");
    assert!(backend.received().is_empty(), "{:?}", backend.received());
}

on_both_paths!(
    malformed_requests_are_refused_before_the_backend,
    a_request_with_both_length_and_chunked_is_refused_or_forwarded_chunked_then_closed,
    an_obs_folded_header_is_refused_or_unfolded,
    two_different_host_headers_get_400_before_the_backend,
    an_http11_request_without_host_gets_400,
);
