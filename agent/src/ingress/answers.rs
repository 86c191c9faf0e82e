//! The ingress proxy's own answers: short plain-text errors, redirects to HTTPS,
//! ACME challenge answers.

use super::body::ProxyBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::{
    Response, StatusCode, Uri,
    body::Bytes,
    header::{self, HeaderValue},
};

/// The content type of the proxy's own answers.
pub const TEXT_PLAIN: &str = "text/plain; charset=utf-8";

/// The proxy's own answer: a status and a short plain-text body.
pub fn answer(status: StatusCode, text: &'static str) -> Response<ProxyBody> {
    let mut resp = full(Bytes::from_static(text.as_bytes()), TEXT_PLAIN);
    *resp.status_mut() = status;
    resp
}

/// The key authorization of a pending ACME HTTP-01 challenge (RFC 8555 §8.3).
pub fn acme_answer(key_authorization: String) -> Response<ProxyBody> {
    full(Bytes::from(key_authorization), "application/octet-stream")
}

/// A 200 with `body` of `content_type`.
fn full(body: Bytes, content_type: &'static str) -> Response<ProxyBody> {
    let mut resp = Response::new(
        Full::new(body)
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// 308 to the same URL over HTTPS, whose listener is on `tls_port`.
pub fn redirect(uri: &Uri, host: &str, tls_port: u16) -> Response<ProxyBody> {
    let port = match tls_port {
        443 => String::new(),
        p => format!(":{p}"),
    };
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let location = format!("https://{host}{port}{path}");
    let mut resp = answer(StatusCode::PERMANENT_REDIRECT, "moved to https\n");
    if let Ok(v) = HeaderValue::from_str(&location) {
        resp.headers_mut().insert(header::LOCATION, v);
    }
    resp
}

/// An empty body.
pub fn empty() -> ProxyBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}
