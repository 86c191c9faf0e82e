//! An endpoint's HTTP/1.1 response head, parsed in place, and the client's response
//! head written from it: hop-by-hop headers removed, the body's framing
//! (RFC 9112 §6.3) decided so it can be relayed as it comes.

use super::request::{HOP_BY_HOP, MAX_HEADERS, parse_length, tokens};
use std::io::Write as _;

/// How the response body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// No body (a `HEAD` request, 204, 304).
    Empty,
    /// `Content-Length` bytes.
    Length(u64),
    /// Chunked: relayed chunked, as it came.
    Chunked,
    /// Until the endpoint closes: the client's connection closes after it.
    UntilClose,
}

/// A final response head.
#[derive(Debug)]
pub struct Head {
    /// Bytes of the head in the endpoint's buffer.
    pub len: usize,
    pub status: u16,
    pub framing: Framing,
    /// The endpoint keeps its connection open after this response.
    pub keeps: bool,
    /// The client's connection closes after this response.
    pub closes: bool,
}

/// What the front of an endpoint's buffer holds.
#[derive(Debug)]
pub enum Parsed {
    /// Not a whole head yet.
    Partial,
    /// An interim (1xx) response of this many bytes, not passed on.
    Interim(usize),
    /// The final response head; the client's head is in the output buffer.
    Final(Head),
    /// Not a response the proxy can carry: the client gets 502.
    Bad,
}

/// Parses the response head at the front of `buf`, to a `HEAD` request when
/// `head`, writing the client's head into `out` (cleared first) with
/// `Connection: close` when `close` (the client asked) or the body runs until
/// the endpoint closes.
pub fn parse(buf: &[u8], head: bool, close: bool, out: &mut Vec<u8>) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::Bad,
    };
    let (Some(version), Some(status)) = (resp.version, resp.code) else {
        return Parsed::Bad;
    };
    match status {
        // A protocol switch nobody asked for cannot be carried.
        101 => return Parsed::Bad,
        100..=199 => return Parsed::Interim(len),
        200..=999 => {}
        _ => return Parsed::Bad,
    }
    let mut length = None;
    let mut chunked = None;
    let mut endpoint_closes = version == 0;
    let mut named = smallvec::SmallVec::<[&[u8]; 4]>::new();
    for h in resp.headers.iter() {
        let is = |n: &str| h.name.eq_ignore_ascii_case(n);
        if is("content-length") {
            match (
                std::str::from_utf8(h.value).ok().and_then(parse_length),
                length,
            ) {
                (Some(n), None) => length = Some(n),
                (Some(n), Some(m)) if n == m => {}
                _ => return Parsed::Bad,
            }
        } else if is("transfer-encoding") {
            // Only `chunked`, once: another coding would reach the client undeclared.
            if chunked.is_some() || !h.value.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Parsed::Bad;
            }
            chunked = Some(());
        } else if is("connection") {
            for token in tokens(h.value) {
                if token.eq_ignore_ascii_case(b"close") {
                    endpoint_closes = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") && version == 0 {
                    endpoint_closes = false;
                } else if !token.is_empty() && !token.eq_ignore_ascii_case(b"content-length") {
                    // The body's length stays declared whatever `Connection` names.
                    named.push(token);
                }
            }
        }
    }
    let framing = if head || status == 204 || status == 304 {
        Framing::Empty
    } else if chunked.is_some() {
        Framing::Chunked
    } else if let Some(n) = length {
        Framing::Length(n)
    } else {
        Framing::UntilClose
    };
    let closes = close || framing == Framing::UntilClose;
    out.clear();
    // Writing to a Vec cannot fail.
    let _ = write!(out, "HTTP/1.1 {status} ");
    out.extend_from_slice(resp.reason.unwrap_or_default().as_bytes());
    out.extend_from_slice(b"\r\n");
    for h in resp.headers.iter() {
        let hop = HOP_BY_HOP.iter().any(|n| h.name.eq_ignore_ascii_case(n))
            || named.iter().any(|n| n.eq_ignore_ascii_case(h.name.as_bytes()))
            // A chunked body's length is its chunks' (RFC 9112 §6.3).
            || (chunked.is_some() && h.name.eq_ignore_ascii_case("content-length"));
        if !hop {
            out.extend_from_slice(h.name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(h.value);
            out.extend_from_slice(b"\r\n");
        }
    }
    if framing == Framing::Chunked {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    if closes {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    Parsed::Final(Head {
        len,
        status,
        framing,
        // Both a length and chunked: a sign of smuggling (RFC 9112 §6.1), not kept.
        keeps: !endpoint_closes
            && framing != Framing::UntilClose
            && !(chunked.is_some() && length.is_some()),
        closes,
    })
}
