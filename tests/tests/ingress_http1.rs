//! HTTP/1.1 connection management through the ingress as raw clients and backends
//! see it on the wire: keep-alive, pipelining, bodiless responses, interim
//! responses, closes on either side, HTTP/1.0 and a backend stalling mid-body.
//! Needs no root.

use rune_agent_tests::{
    ingress::Ingress,
    on_both_paths,
    wire::{Reply, Then, Wire, ok, scripted},
};
use std::{
    collections::BTreeSet,
    io::ErrorKind,
    sync::Arc,
    time::{Duration, Instant},
};

/// How long the proxy gets to close a connection it should close.
const CLOSE_WAIT: Duration = Duration::from_secs(3);

fn fifty_keep_alive_requests_ride_one_upstream_connection(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |_| Reply::keep(ok("hello")));
    let accepted = backend.accepted();
    let mut client = Wire::connect(ingress.http);
    for i in 0..50 {
        let r = client.get("web.test", &format!("/n{i}"));
        assert_eq!((r.status, r.text().as_str()), (200, "hello"), "request {i}");
    }
    let received = backend.received();
    assert_eq!(received.len(), 50, "{received:?}");
    let conns: BTreeSet<usize> = received.iter().map(|r| r.conn).collect();
    assert_eq!(conns.len(), 1, "upstream connections used: {conns:?}");
    // At most one new one (the readiness check's may have been reused).
    assert!(backend.accepted() - accepted <= 1, "{}", backend.accepted());
}

fn pipelined_requests_are_answered_in_order(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |r| Reply::keep(ok(r.target())));
    let mut client = Wire::connect(ingress.http);
    let paths = ["/one", "/two", "/three"];
    let requests: String = paths
        .iter()
        .map(|p| format!("GET {p} HTTP/1.1\r\nHost: web.test\r\n\r\n"))
        .collect();
    client.send(requests.as_bytes());
    for p in paths {
        let r = client.response(false).expect("a pipelined response");
        assert_eq!((r.status, r.text().as_str()), (200, p));
    }
    assert_eq!(backend.received().len(), 3);
}

/// Pipelined requests of which one the proxy answers itself (no route): the fast
/// path hands the connection, with the requests it has read, to hyper, which
/// answers them all in order.
fn a_pipeline_handed_over_midway_is_answered_whole_and_in_order(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |r| Reply::keep(ok(r.target())));
    let mut client = Wire::connect(ingress.http);
    let requests = "GET /one HTTP/1.1\r\nHost: web.test\r\n\r\n\
                    GET /lost HTTP/1.1\r\nHost: nowhere.test\r\n\r\n\
                    GET /two HTTP/1.1\r\nHost: web.test\r\n\r\n";
    client.send(requests.as_bytes());
    for (status, body) in [(200, "/one"), (404, "no route\n"), (200, "/two")] {
        let r = client.response(false).expect("a pipelined response");
        assert_eq!((r.status, r.text().as_str()), (status, body), "{r:?}");
    }
    let targets: Vec<String> = backend
        .received()
        .iter()
        .map(|r| r.target().to_owned())
        .collect();
    assert_eq!(targets, ["/one", "/two"]);
    // The connection goes on after the hand-over.
    let r = client.get("web.test", "/three");
    assert_eq!((r.status, r.text().as_str()), (200, "/three"), "{r:?}");
}

fn a_head_response_has_the_length_and_no_body(ingress: &Ingress) {
    let _backend = scripted(ingress, "web.test", |r| match r.method() {
        "HEAD" => Reply::keep("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"),
        _ => Reply::keep(ok("after")),
    });
    let mut client = Wire::connect(ingress.http);
    client.send(b"HEAD /x HTTP/1.1\r\nHost: web.test\r\n\r\n");
    let r = client.response(true).expect("the HEAD response");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.head.header("content-length"), Some("5"), "{r:?}");
    // A body sent after the head would be read as the next response's start.
    let r = client.get("web.test", "/next");
    assert_eq!((r.status, r.text().as_str()), (200, "after"));
}

fn responses_204_and_304_carry_no_body_and_the_connection_goes_on(ingress: &Ingress) {
    let _backend = scripted(ingress, "web.test", |r| match r.target() {
        "/204" => Reply::keep("HTTP/1.1 204 No Content\r\nX-App: 1\r\n\r\n"),
        "/304" => Reply::keep("HTTP/1.1 304 Not Modified\r\nETag: \"v1\"\r\n\r\n"),
        _ => Reply::keep(ok("after")),
    });
    let mut client = Wire::connect(ingress.http);
    for (path, code) in [("/204", 204), ("/304", 304), ("/204", 204)] {
        let r = client.get("web.test", path);
        assert_eq!(r.status, code, "{r:?}");
        assert_eq!(r.head.header("transfer-encoding"), None, "{r:?}");
        if code == 204 {
            assert_eq!(r.head.header("content-length"), None, "{r:?}");
        }
        let r = client.get("web.test", "/next");
        assert_eq!(
            (r.status, r.text().as_str()),
            (200, "after"),
            "after {path}"
        );
    }
}

fn a_backend_closing_with_connection_close_leaves_the_client_connection_usable(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |r| match r.target() {
        "/close" => Reply::then(
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nfirst",
            Then::Close,
        ),
        _ => Reply::keep(ok("second")),
    });
    let mut client = Wire::connect(ingress.http);
    for _ in 0..2 {
        let r = client.get("web.test", "/close");
        assert_eq!((r.status, r.text().as_str()), (200, "first"), "{r:?}");
        let r = client.get("web.test", "/next");
        assert_eq!((r.status, r.text().as_str()), (200, "second"), "{r:?}");
    }
    let received = backend.received();
    let conn = |i: usize| received[i].conn;
    assert_ne!(conn(0), conn(1), "reused a closed connection: {received:?}");
    assert_ne!(conn(2), conn(3), "reused a closed connection: {received:?}");
}

fn a_backend_closing_an_idle_connection_does_not_fail_the_next_request(ingress: &Ingress) {
    let backend = scripted(ingress, "web.test", |r| {
        Reply::then(ok(r.target()), Then::CloseAfter(Duration::from_millis(200)))
    });
    let mut client = Wire::connect(ingress.http);
    for path in ["/first", "/second", "/third"] {
        let r = client.get("web.test", path);
        assert_eq!((r.status, r.text().as_str()), (200, path), "{r:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
    let conns: BTreeSet<usize> = backend.received().iter().map(|r| r.conn).collect();
    assert_eq!(conns.len(), 3, "{:?}", backend.received());
}

fn interim_responses_before_the_final_one_keep_the_exchange_whole(ingress: &Ingress) {
    let _backend = scripted(ingress, "web.test", |r| match r.target() {
        "/hints" => Reply::keep(
            [
                &b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"[..],
                &ok("final"),
            ]
            .concat(),
        ),
        "/continue" => Reply::keep([&b"HTTP/1.1 100 Continue\r\n\r\n"[..], &ok("final")].concat()),
        _ => Reply::keep(ok("after")),
    });
    let mut client = Wire::connect(ingress.http);
    for path in ["/hints", "/continue"] {
        let r = client.get("web.test", path);
        assert_eq!((r.status, r.text().as_str()), (200, "final"), "{r:?}");
        let r = client.get("web.test", "/next");
        assert_eq!(
            (r.status, r.text().as_str()),
            (200, "after"),
            "after {path}"
        );
    }
}

fn a_client_connection_close_is_answered_then_closed(ingress: &Ingress) {
    let _backend = scripted(ingress, "web.test", |_| Reply::keep(ok("bye")));
    let mut client = Wire::connect(ingress.http);
    client.send(b"GET / HTTP/1.1\r\nHost: web.test\r\nConnection: close\r\n\r\n");
    let r = client.response(false).expect("the response");
    assert_eq!((r.status, r.text().as_str()), (200, "bye"), "{r:?}");
    assert!(client.closes_within(CLOSE_WAIT), "left open");
}

fn an_http10_request_is_answered_in_full_then_closed(ingress: &Ingress) {
    let _backend = scripted(ingress, "web.test", |r| Reply::keep(ok(r.target())));
    let mut client = Wire::connect(ingress.http);
    client.send(b"GET /old HTTP/1.0\r\nHost: web.test\r\n\r\n");
    let r = client.response(false).expect("the response");
    assert_eq!((r.status, r.text().as_str()), (200, "/old"), "{r:?}");
    assert_eq!(r.head.header("transfer-encoding"), None, "{r:?}");
    // Without Keep-Alive an HTTP/1.0 connection ends with its response.
    assert!(client.closes_within(CLOSE_WAIT), "left open");
}

fn a_backend_stalling_mid_body_gets_the_client_connection_cut(ingress: &Ingress) {
    // The harness's response timeout (tests/src/ingress.rs).
    let timeout = Duration::from_millis(1500);
    let _backend = scripted(ingress, "web.test", |_| {
        let half = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}",
            "x".repeat(50)
        );
        Reply::then(half, Then::Hang)
    });
    let mut client = Wire::connect(ingress.http);
    let sent = Instant::now();
    client.send(b"GET /stall HTTP/1.1\r\nHost: web.test\r\n\r\n");
    let err = client.response(false).expect_err("a whole response");
    let took = sent.elapsed();
    // The read ended by the proxy (end or reset), not by the client's timeout.
    assert!(
        !matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{err} after {took:?}"
    );
    assert!(
        took >= timeout / 2,
        "cut before the timeout: {took:?} ({err})"
    );
    assert!(took < timeout + CLOSE_WAIT, "cut late: {took:?}");
}

on_both_paths!(
    fifty_keep_alive_requests_ride_one_upstream_connection,
    pipelined_requests_are_answered_in_order,
    a_pipeline_handed_over_midway_is_answered_whole_and_in_order,
    a_head_response_has_the_length_and_no_body,
    responses_204_and_304_carry_no_body_and_the_connection_goes_on,
    a_backend_closing_with_connection_close_leaves_the_client_connection_usable,
    a_backend_closing_an_idle_connection_does_not_fail_the_next_request,
    interim_responses_before_the_final_one_keep_the_exchange_whole,
    a_client_connection_close_is_answered_then_closed,
    an_http10_request_is_answered_in_full_then_closed,
    a_backend_stalling_mid_body_gets_the_client_connection_cut,
);

/// A client that asks for a large response and stops reading it: the proxy
/// gives the connection up (fast path: no byte taken for the stall timeout;
/// hyper: once idle, no byte moved for the idle timeout) rather than holding it,
/// its cap place and its endpoint connection for as long as the client lives.
fn a_client_that_stops_reading_is_given_up(flags: &[&str]) {
    const SIZE: usize = 64 << 20;
    let mut all = vec!["--ingress-idle-timeout-seconds", "1"];
    all.extend_from_slice(flags);
    let ingress = Ingress::start_with(&all);
    let response = Arc::new(ok(vec![b'x'; SIZE]));
    let _backend = scripted(&ingress, "web.test", move |_| {
        Reply::then(response.as_slice(), Then::Close)
    });
    let mut client = Wire::connect(ingress.http);
    client.send(b"GET /big HTTP/1.1\r\nHost: web.test\r\n\r\n");
    let head = client.head().unwrap().expect("the response head");
    assert!(head.start.starts_with("HTTP/1.1 200"), "{head:?}");
    std::thread::sleep(Duration::from_secs(5));
    // What the kernel buffers held, then the end: far less than the body.
    let got = client.bytes_within(Duration::from_secs(10));
    assert!(
        got < SIZE / 2,
        "{got} of {SIZE} bytes: the connection was kept"
    );
}

#[test]
fn a_client_that_stops_reading_is_given_up_on_the_fast_path() {
    a_client_that_stops_reading_is_given_up(&[]);
}

#[test]
fn a_client_that_stops_reading_is_given_up_by_hyper() {
    a_client_that_stops_reading_is_given_up(&["--ingress-no-fast-path"]);
}
