//! `Upgrade` requests (WebSocket and other protocols) through the ingress proxy:
//! the request goes upstream with its `Connection: upgrade` and `Upgrade` headers,
//! and once the endpoint answers 101 the two connections are spliced byte for byte.

use hyper::{
    HeaderMap,
    header::{self, HeaderValue},
    upgrade::OnUpgrade,
};
use hyper_util::rt::TokioIo;

/// Whether a comma-separated list header `name` (`Connection`, `TE`) lists `token`
/// (case-insensitive), in any of its lines.
pub fn lists(headers: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// The `Upgrade` value of an HTTP/1.1 request that asks for one (its `Connection`
/// header lists `upgrade`).
pub fn requested(headers: &HeaderMap) -> Option<HeaderValue> {
    lists(headers, header::CONNECTION, "upgrade")
        .then(|| headers.get(header::UPGRADE).cloned())
        .flatten()
}

/// Puts `Connection: upgrade` and `Upgrade: value` back (hop-by-hop headers are
/// removed before forwarding; these two carry the upgrade across).
pub fn keep_headers(headers: &mut HeaderMap, value: HeaderValue) {
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, value);
}

/// Copies bytes both ways between the client's and the endpoint's upgraded
/// connections until either side closes.
pub async fn splice(client: OnUpgrade, upstream: OnUpgrade) {
    let (client, upstream) = match tokio::try_join!(client, upstream) {
        Ok(both) => both,
        Err(error) => {
            tracing::debug!(%error, "ingress: upgrade failed");
            return;
        }
    };
    let (mut client, mut upstream) = (TokioIo::new(client), TokioIo::new(upstream));
    if let Err(error) = tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        tracing::debug!(%error, "ingress: upgraded connection ended");
    }
}
