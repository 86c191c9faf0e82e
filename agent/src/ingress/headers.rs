//! The headers a request and a response carry across the ingress proxy: hop-by-hop
//! ones removed, `Host` kept, the client's address and scheme added
//! (`X-Forwarded-*`, `Forwarded`).

use super::upgrade;
use hyper::body::Bytes;
use hyper::{
    HeaderMap,
    header::{self, HeaderName, HeaderValue},
};
use ipnet::IpNet;
use std::{
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

/// Hop-by-hop headers: never forwarded either way.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The client's headers without hop-by-hop ones, with `Host` kept (set from an h2
/// authority) and `X-Forwarded-For/-Proto/-Host` and `Forwarded` set.
pub fn forwarded_headers(
    from: &HeaderMap,
    host: &str,
    peer: SocketAddr,
    tls: bool,
    trusted_proxies: &[IpNet],
) -> HeaderMap {
    let mut headers = from.clone();
    strip_hop_by_hop(&mut headers);
    let client = match peer.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer.ip(), IpAddr::V4),
        ip => ip,
    };
    let trusted = trusted_proxies.iter().any(|n| n.contains(&client));
    let xff = match from.get("x-forwarded-for").and_then(|v| v.to_str().ok()) {
        Some(prior) if trusted => format!("{prior}, {client}"),
        _ => client.to_string(),
    };
    let original_host = from
        .get(header::HOST)
        .cloned()
        .or_else(|| HeaderValue::from_str(host).ok());
    if let Some(h) = &original_host {
        headers.insert(header::HOST, h.clone());
        headers.insert("x-forwarded-host", h.clone());
    }
    if let Ok(v) = owned_value(xff) {
        headers.insert("x-forwarded-for", v);
    }
    let proto = if tls { "https" } else { "http" };
    headers.insert("x-forwarded-proto", HeaderValue::from_static(proto));
    // RFC 7239: the same facts in one header, replaced or (trusted peer) appended.
    let shown_host = original_host
        .as_ref()
        .and_then(|h| h.to_str().ok())
        .unwrap_or(host);
    let mut forwarded = match from.get(header::FORWARDED).and_then(|v| v.to_str().ok()) {
        Some(prior) if trusted => format!("{prior}, "),
        _ => String::with_capacity(48),
    };
    // Writing to a String cannot fail.
    let _ = match client {
        IpAddr::V6(v6) => write!(forwarded, "for=\"[{v6}]\""),
        v4 => write!(forwarded, "for={v4}"),
    };
    let _ = write!(forwarded, ";proto={proto};host=\"");
    forwarded.extend(shown_host.chars().filter(|c| !matches!(c, '"' | '\\')));
    forwarded.push('"');
    if let Ok(v) = owned_value(forwarded) {
        headers.insert(header::FORWARDED, v);
    }
    headers
}

/// A header value that takes `text`'s buffer rather than copying it.
fn owned_value(text: String) -> Result<HeaderValue, header::InvalidHeaderValue> {
    HeaderValue::from_maybe_shared(Bytes::from(text))
}

/// Puts `TE: trailers` back when the client sent it (the one `TE` HTTP/2 allows;
/// gRPC servers expect it).
pub fn keep_te_trailers(from: &HeaderMap, headers: &mut HeaderMap) {
    if upgrade::lists(from, header::TE, "trailers") {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
}

/// Removes hop-by-hop headers, and those the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Headers the Connection header names are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for h in HOP_BY_HOP.iter().chain(&named) {
        headers.remove(h);
    }
}
