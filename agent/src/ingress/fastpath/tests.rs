//! What the fast path forwards, and what it leaves to hyper, request by request;
//! and how it frames and rewrites endpoints' responses.

use super::{
    request::{self, Context, Parsed},
    response::{self, Framing},
};
use crate::ingress::{
    access_log::AccessLog,
    routes::{RouteTable, tests::exposed_views},
};
use std::collections::BTreeMap;

/// One plain route (`web.test`), one TLS-only route, one allowing only 10.0.0.0/8.
fn table() -> RouteTable {
    let views = exposed_views(&[
        ("web", "host: web.test"),
        ("secure", "host: secure.test, tls: {secret: cert}"),
        ("closed", "host: closed.test, allowCidrs: ['10.0.0.0/8']"),
    ]);
    RouteTable::build(&views, &BTreeMap::new())
}

/// Logs nothing.
static NO_LOG: std::sync::LazyLock<AccessLog> = std::sync::LazyLock::new(|| AccessLog::new(0.0));

/// The least-outstanding choice's rotation.
static TURN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn cx<'a>(routes: &'a RouteTable, trusted: &'a [ipnet::IpNet]) -> Context<'a> {
    Context {
        routes,
        peer: "127.0.0.1:40000".parse().unwrap(),
        tls: None,
        max_head_bytes: 8192,
        max_body_bytes: 100,
        trusted_proxies: trusted,
        access_log: &NO_LOG,
        turn: &TURN,
    }
}

/// The endpoint's request for `raw`, or `None` when the fast path leaves it.
fn forwarded(raw: &str, trusted: &[ipnet::IpNet]) -> Option<String> {
    let routes = table();
    let mut out = Vec::new();
    match request::parse(raw.as_bytes(), &cx(&routes, trusted), &mut out) {
        Parsed::Forward(plan) => {
            assert!(plan.len <= raw.len());
            Some(String::from_utf8(out).unwrap())
        }
        Parsed::HandOver => None,
        Parsed::Partial => panic!("partial: {raw:?}"),
    }
}

#[test]
fn a_plain_request_is_forwarded_with_the_proxys_headers_and_without_hop_by_hop_ones() {
    let raw = "GET /a?b=1 HTTP/1.1\r\nHost: Web.Test:80\r\nX-Forwarded-For: 6.6.6.6\r\n\
               Forwarded: for=6.6.6.6\r\nConnection: keep-alive, X-Secret\r\nX-Secret: s\r\n\
               Keep-Alive: 5\r\nTE: trailers\r\nProxy-Connection: x\r\nAccept: */*\r\n\r\n";
    let out = forwarded(raw, &[]).expect("forwarded");
    assert_eq!(
        out,
        "GET /a?b=1 HTTP/1.1\r\nAccept: */*\r\nhost: Web.Test:80\r\n\
         x-forwarded-host: Web.Test:80\r\nx-forwarded-for: 127.0.0.1\r\n\
         x-forwarded-proto: http\r\nforwarded: for=127.0.0.1;proto=http;host=\"Web.Test:80\"\r\n\r\n"
    );
}

#[test]
fn a_trusted_peer_s_forwarding_headers_are_appended_to() {
    let raw = "GET / HTTP/1.1\r\nHost: web.test\r\nX-Forwarded-For: 6.6.6.6\r\n\
               Forwarded: for=6.6.6.6\r\n\r\n";
    let out = forwarded(raw, &["127.0.0.0/8".parse().unwrap()]).unwrap();
    assert!(
        out.contains("x-forwarded-for: 6.6.6.6, 127.0.0.1\r\n"),
        "{out}"
    );
    assert!(
        out.contains("forwarded: for=6.6.6.6, for=127.0.0.1;"),
        "{out}"
    );
}

#[test]
fn a_body_in_the_buffer_goes_with_the_head_and_a_pipelined_request_stays() {
    let routes = table();
    let raw =
        "POST / HTTP/1.1\r\nHost: web.test\r\nContent-Length: 5\r\n\r\nhelloGET / HTTP/1.1\r\n";
    let mut out = Vec::new();
    let Parsed::Forward(plan) = request::parse(raw.as_bytes(), &cx(&routes, &[]), &mut out) else {
        panic!("not forwarded")
    };
    assert_eq!(&raw[plan.len..], "GET / HTTP/1.1\r\n");
    assert!(out.ends_with(b"\r\n\r\nhello"));
    assert!(!plan.retryable, "a POST with a body is not resent");
}

#[test]
fn an_incomplete_head_waits_for_more() {
    let routes = table();
    let parsed = request::parse(
        b"GET / HTTP/1.1\r\nHost: web",
        &cx(&routes, &[]),
        &mut Vec::new(),
    );
    assert!(matches!(parsed, Parsed::Partial));
}

#[test]
fn everything_the_fast_path_does_not_serve_is_left_to_hyper() {
    let cases = [
        ("HTTP/1.0", "GET / HTTP/1.0\r\nHost: web.test\r\n\r\n"),
        (
            "absolute form",
            "GET http://web.test/ HTTP/1.1\r\nHost: web.test\r\n\r\n",
        ),
        ("no Host", "GET / HTTP/1.1\r\n\r\n"),
        (
            "two Hosts",
            "GET / HTTP/1.1\r\nHost: web.test\r\nHost: web.test\r\n\r\n",
        ),
        (
            "chunked body",
            "POST / HTTP/1.1\r\nHost: web.test\r\nTransfer-Encoding: chunked\r\n\r\n",
        ),
        (
            "two lengths",
            "POST / HTTP/1.1\r\nHost: web.test\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        ),
        (
            "signed length",
            "POST / HTTP/1.1\r\nHost: web.test\r\nContent-Length: +1\r\n\r\na",
        ),
        (
            "body not here yet",
            "POST / HTTP/1.1\r\nHost: web.test\r\nContent-Length: 9\r\n\r\nabc",
        ),
        (
            "body over the limit",
            "POST / HTTP/1.1\r\nHost: web.test\r\nContent-Length: 101\r\n\r\n",
        ),
        (
            "upgrade",
            "GET / HTTP/1.1\r\nHost: web.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        ),
        (
            "expect",
            "PUT / HTTP/1.1\r\nHost: web.test\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n",
        ),
        (
            "connect",
            "CONNECT web.test:443 HTTP/1.1\r\nHost: web.test\r\n\r\n",
        ),
        ("no route", "GET / HTTP/1.1\r\nHost: nowhere.test\r\n\r\n"),
        (
            "dot segment",
            "GET /a/../b HTTP/1.1\r\nHost: web.test\r\n\r\n",
        ),
        (
            "TLS-only route",
            "GET / HTTP/1.1\r\nHost: secure.test\r\n\r\n",
        ),
        ("allow-list", "GET / HTTP/1.1\r\nHost: closed.test\r\n\r\n"),
        (
            "ACME challenge",
            "GET /.well-known/acme-challenge/t HTTP/1.1\r\nHost: web.test\r\n\r\n",
        ),
        (
            "non-ASCII Host",
            "GET / HTTP/1.1\r\nHost: w\u{e9}b.test\r\n\r\n",
        ),
        ("h2 preface", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        ("garbage", "HELLO\r\n\r\n"),
    ];
    for (what, raw) in cases {
        assert_eq!(forwarded(raw, &[]), None, "{what}");
    }
    let long = format!(
        "GET / HTTP/1.1\r\nHost: web.test\r\nX: {}\r\n\r\n",
        "x".repeat(9000)
    );
    assert_eq!(forwarded(&long, &[]), None, "a head over the limit");
}

/// The client's head and the framing of an endpoint's `raw` response.
fn relayed(raw: &str, head: bool, close: bool) -> Result<(String, Framing, bool, bool), String> {
    let mut out = Vec::new();
    match response::parse(raw.as_bytes(), head, close, &mut out) {
        response::Parsed::Final(h) => {
            assert_eq!(h.len, raw.find("\r\n\r\n").unwrap() + 4);
            Ok((
                String::from_utf8(out).unwrap(),
                h.framing,
                h.keeps,
                h.closes,
            ))
        }
        other => Err(format!("{other:?}")),
    }
}

#[test]
fn response_framing_follows_rfc_9112() {
    let (out, framing, keeps, closes) = relayed(
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: X-In\r\nX-In: 1\r\nKeep-Alive: 9\r\nX-App: 1\r\n\r\n",
        false,
        false,
    )
    .unwrap();
    assert_eq!(
        out,
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-App: 1\r\n\r\n"
    );
    assert_eq!((framing, keeps, closes), (Framing::Length(2), true, false));

    let (out, framing, ..) = relayed(
        "HTTP/1.1 200 OK\r\nContent-Length: 9\r\nTransfer-Encoding: chunked\r\n\r\n",
        false,
        false,
    )
    .unwrap();
    assert_eq!(out, "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n");
    assert_eq!(framing, Framing::Chunked);

    let (out, framing, keeps, closes) = relayed("HTTP/1.1 200 OK\r\n\r\n", false, false).unwrap();
    assert_eq!(out, "HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n");
    assert_eq!((framing, keeps, closes), (Framing::UntilClose, false, true));

    for (raw, head) in [
        ("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", true),
        ("HTTP/1.1 204 No Content\r\n\r\n", false),
        (
            "HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n",
            false,
        ),
    ] {
        let (_, framing, keeps, _) = relayed(raw, head, false).unwrap();
        assert_eq!((framing, keeps), (Framing::Empty, true), "{raw:?}");
    }
    let (_, _, keeps, _) = relayed(
        "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
        false,
        false,
    )
    .unwrap();
    assert!(!keeps, "the endpoint closes");
    let (_, _, keeps, _) =
        relayed("HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", false, false).unwrap();
    assert!(!keeps, "HTTP/1.0 closes unless it says keep-alive");
    let (out, _, _, closes) =
        relayed("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", false, true).unwrap();
    assert!(
        closes && out.ends_with("connection: close\r\n\r\n"),
        "the client asked to close"
    );
}

#[test]
fn responses_the_proxy_cannot_carry_are_refused_and_interim_ones_skipped() {
    let mut out = Vec::new();
    for raw in [
        "HTTP/1.1 101 Switching Protocols\r\n\r\n",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        "HELLO\r\n\r\n",
    ] {
        let parsed = response::parse(raw.as_bytes(), false, false, &mut out);
        assert!(
            matches!(parsed, response::Parsed::Bad),
            "{raw:?}: {parsed:?}"
        );
    }
    let parsed = response::parse(
        b"HTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\nHTTP/1.1 200",
        false,
        false,
        &mut out,
    );
    assert!(
        matches!(parsed, response::Parsed::Interim(37)),
        "{parsed:?}"
    );
}
