//! The body type of every request and response the proxy handles.

use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Bytes;

/// The body type both ways: a client's or upstream's stream, or the proxy's own text.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// Any body error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
