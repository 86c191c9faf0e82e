//! A client's HTTP/1.1 request head, parsed in place, checked against the route it
//! is for, and written out as the endpoint's request head: the same forwarded
//! headers as the hyper path ([`forwarded_headers`](super::super::headers)), built
//! straight into one buffer. Anything the fast path does not serve (another
//! version, an upgrade, a chunked or unbuffered body, a request the proxy answers
//! itself) is handed to hyper untouched.

use super::super::{
    access_log::AccessLog,
    acme::CHALLENGE_PATH,
    client_cert::TlsSession,
    routes::{Backend, Route, RouteTable, normalize_host, path_is_normal},
    upstream::is_idempotent,
};
use ipnet::IpNet;
use std::{
    io::Write as _,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

/// Most headers a request may have on the fast path (hyper's own limit).
pub const MAX_HEADERS: usize = 100;

/// Most headers the `Connection` header may name on the fast path.
const MAX_NAMED: usize = 8;

/// Hop-by-hop headers: never forwarded either way.
pub const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Request headers the proxy writes itself in place of the client's.
const REPLACED: [&str; 6] = [
    "host",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "forwarded",
    // From the length it checked, whatever the client's `Connection` names: the
    // endpoint must frame the body as the proxy did.
    "content-length",
];

/// The comma-separated tokens of a `Connection` header value.
pub fn tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value.split(|&b| b == b',').map(<[u8]>::trim_ascii)
}

/// What the fast path does with the bytes at the front of a connection's buffer.
pub enum Parsed {
    /// Not a whole request head yet.
    Partial,
    /// A request to forward; its endpoint head is in the output buffer.
    Forward(Plan),
    /// Anything else: hyper serves the connection from this request on.
    HandOver,
}

/// A request the fast path forwards.
pub struct Plan {
    /// Bytes of the request head and of its body, both in the buffer.
    pub len: usize,
    /// The route it matched.
    pub route: Arc<Route>,
    /// The endpoint chosen first, and the turn it was chosen on (for a retry).
    pub backend: Arc<Backend>,
    pub turn: usize,
    /// The client asked to close after this response.
    pub close: bool,
    /// Resending it is safe (an idempotent method without a body).
    pub retryable: bool,
    /// A `HEAD` request: its response has no body whatever it announces.
    pub head: bool,
    /// The method, path and host, when the access log wants this request.
    pub logged: Option<(String, String, String)>,
}

/// What a request is checked against.
pub struct Context<'a> {
    pub routes: &'a RouteTable,
    pub peer: SocketAddr,
    pub tls: Option<&'a TlsSession>,
    /// Largest request head (hyper answers 431 beyond).
    pub max_head_bytes: usize,
    pub max_body_bytes: u64,
    pub trusted_proxies: &'a [IpNet],
    /// Asked, for a request the fast path forwards, whether it gets a line.
    pub access_log: &'a AccessLog,
    /// Rotates the start of the least-outstanding choice of endpoint.
    pub turn: &'a AtomicUsize,
}

/// The request head's headers the plan needs, found in one pass.
#[derive(Default)]
struct Seen<'b> {
    host: Option<&'b [u8]>,
    hosts: usize,
    content_length: Option<u64>,
    /// `Transfer-Encoding`, `Upgrade`, `Expect`, an unusable `Content-Length`, or
    /// more named headers than the fast path tracks.
    unusual: bool,
    close: bool,
    named: smallvec::SmallVec<[&'b [u8]; MAX_NAMED]>,
    prior_for: Option<&'b [u8]>,
    prior_forwarded: Option<&'b [u8]>,
}

impl<'b> Seen<'b> {
    fn note(&mut self, name: &str, value: &'b [u8]) {
        let is = |n: &str| name.eq_ignore_ascii_case(n);
        if is("host") {
            self.hosts += 1;
            self.host = Some(value);
        } else if is("content-length") {
            match (
                std::str::from_utf8(value).ok().and_then(parse_length),
                self.content_length,
            ) {
                (Some(n), None) => self.content_length = Some(n),
                (Some(n), Some(m)) if n == m => {}
                _ => self.unusual = true,
            }
        } else if is("transfer-encoding") || is("upgrade") || is("expect") {
            self.unusual = true;
        } else if is("connection") {
            for token in tokens(value) {
                if token.eq_ignore_ascii_case(b"close") {
                    self.close = true;
                } else if !token.is_empty() && !token.eq_ignore_ascii_case(b"keep-alive") {
                    if self.named.len() == MAX_NAMED {
                        self.unusual = true;
                    }
                    self.named.push(token);
                }
            }
        } else if is("x-forwarded-for") {
            self.prior_for.get_or_insert(value);
        } else if is("forwarded") {
            self.prior_forwarded.get_or_insert(value);
        }
    }

    /// Whether a header of `name` goes to the endpoint as the client sent it.
    fn forwards(&self, name: &str) -> bool {
        !HOP_BY_HOP
            .iter()
            .chain(&REPLACED)
            .any(|d| name.eq_ignore_ascii_case(d))
            && !self
                .named
                .iter()
                .any(|n| n.eq_ignore_ascii_case(name.as_bytes()))
    }
}

/// A `Content-Length` value: digits only.
pub fn parse_length(text: &str) -> Option<u64> {
    let text = text.trim_matches([' ', '\t']);
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// A header value `HeaderValue::to_str` accepts: visible ASCII, spaces and tabs.
fn visible(value: &[u8]) -> Option<&str> {
    value
        .iter()
        .all(|&b| b == b'\t' || (b' '..0x7f).contains(&b))
        .then(|| std::str::from_utf8(value).ok())
        .flatten()
}

/// Parses the request head at the front of `buf` and plans it, writing the
/// endpoint's request head and body into `out` (cleared first).
pub fn parse(buf: &[u8], cx: &Context<'_>, out: &mut Vec<u8>) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::HandOver,
    };
    let (Some(method), Some(target), Some(1)) = (req.method, req.path, req.version) else {
        return Parsed::HandOver;
    };
    if method == "CONNECT" || !origin_form(target) {
        return Parsed::HandOver;
    }
    let mut seen = Seen::default();
    for h in req.headers.iter() {
        seen.note(h.name, h.value);
    }
    let path = target.split_once('?').map_or(target, |(p, _)| p);
    let body_len = seen.content_length.unwrap_or(0);
    let Some(host_value) = seen.host.and_then(visible) else {
        return Parsed::HandOver;
    };
    let whole = u64::try_from(buf.len() - head_len).is_ok_and(|have| have >= body_len);
    if seen.unusual
        || head_len > cx.max_head_bytes
        || seen.hosts != 1
        || body_len > cx.max_body_bytes
        || !whole
        || (cx.tls.is_none() && path.starts_with(CHALLENGE_PATH))
        || !path_is_normal(path)
    {
        return Parsed::HandOver;
    }
    let host = normalize_host(host_value);
    let Some(route) = cx.routes.lookup(&host, path) else {
        return Parsed::HandOver;
    };
    let tls = cx.tls.is_some();
    if !route.allows(cx.peer.ip()) || route.client_ca.is_some() || route.tls != tls || route.h2c {
        return Parsed::HandOver;
    }
    let turn = cx.turn.fetch_add(1, Ordering::Relaxed);
    let Some(backend) = route.pick(turn, None) else {
        return Parsed::HandOver;
    };
    // Fits: the whole body was checked to be in the buffer.
    let body_len = usize::try_from(body_len).unwrap_or(usize::MAX);
    out.clear();
    write_head(out, method, target, &req, &seen, host_value, cx);
    out.extend_from_slice(&buf[head_len..head_len + body_len]);
    Parsed::Forward(Plan {
        len: head_len + body_len,
        route: route.clone(),
        backend,
        turn,
        close: seen.close,
        retryable: body_len == 0 && is_idempotent(method),
        head: method == "HEAD",
        logged: cx
            .access_log
            .wanted()
            .then(|| (method.to_owned(), path.to_owned(), host.clone())),
    })
}

/// The endpoint's request head: the client's request line and headers (less the
/// hop-by-hop ones), `Host` kept, and the proxy's `X-Forwarded-*` and `Forwarded`.
fn write_head(
    out: &mut Vec<u8>,
    method: &str,
    target: &str,
    req: &httparse::Request<'_, '_>,
    seen: &Seen<'_>,
    host: &str,
    cx: &Context<'_>,
) {
    let line = |out: &mut Vec<u8>, name: &[u8], value: &[u8]| {
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    };
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for h in req.headers.iter().filter(|h| seen.forwards(h.name)) {
        line(out, h.name.as_bytes(), h.value);
    }
    if let Some(n) = seen.content_length {
        // Writing to a Vec cannot fail.
        let _ = write!(out, "content-length: {n}\r\n");
    }
    line(out, b"host", host.as_bytes());
    line(out, b"x-forwarded-host", host.as_bytes());
    let client = match cx.peer.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(cx.peer.ip(), IpAddr::V4),
        ip => ip,
    };
    let trusted = cx.trusted_proxies.iter().any(|n| n.contains(&client));
    fn prior(value: Option<&[u8]>, trusted: bool) -> Option<&str> {
        value.and_then(visible).filter(|_| trusted)
    }
    // Writing to a Vec cannot fail.
    out.extend_from_slice(b"x-forwarded-for: ");
    if let Some(p) = prior(seen.prior_for, trusted) {
        let _ = write!(out, "{p}, ");
    }
    let _ = write!(out, "{client}\r\n");
    let proto = if cx.tls.is_some() { "https" } else { "http" };
    let _ = write!(out, "x-forwarded-proto: {proto}\r\nforwarded: ");
    if let Some(p) = prior(seen.prior_forwarded, trusted) {
        let _ = write!(out, "{p}, ");
    }
    let _ = match client {
        IpAddr::V6(v6) => write!(out, "for=\"[{v6}]\""),
        v4 => write!(out, "for={v4}"),
    };
    let _ = write!(out, ";proto={proto};host=\"");
    out.extend(host.bytes().filter(|c| !matches!(c, b'"' | b'\\')));
    out.extend_from_slice(b"\"\r\n\r\n");
}

/// Whether `target` is an origin-form request target hyper's URI parser takes
/// (the `http` crate's rules), so the fast path serves no target hyper would
/// refuse: a path and an optional query, no fragment, under 65535 bytes.
fn origin_form(target: &str) -> bool {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let in_path = |b: u8| matches!(b, 0x21 | 0x24..=0x3B | 0x3D | 0x40..=0x5F | 0x61..=0x7A | 0x7C | 0x7E | b'"' | b'{' | b'}');
    let in_query = |b: u8| matches!(b, 0x21 | 0x24..=0x3B | 0x3D | 0x3F..=0x7E);
    target.len() < usize::from(u16::MAX)
        && path.starts_with('/')
        && path.bytes().all(in_path)
        && query.bytes().all(in_query)
}
