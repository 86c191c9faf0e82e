//! etcd-client's errors turned into [`LogError`]s that name the endpoints and say
//! what failed, never a raw transport error; and [`SkippedKey`], a value the readers
//! could not use.

use crate::orderedlog::{LogError, Revision};
use etcd_client::Error;
use thiserror::Error as ThisError;
use tonic::Code;

/// A key under the prefix that readers skipped: a value another client wrote that
/// is not a valid object, or a key of a kind this agent does not know. The rest of
/// the snapshot or stream goes on without it.
#[derive(Clone, Debug, ThisError, PartialEq, Eq)]
#[error("etcd key {key} (revision {revision}) skipped: {reason}")]
pub struct SkippedKey {
    /// The key, as stored (lossy UTF-8).
    pub key: String,
    /// The revision at which it was written or deleted.
    pub revision: Revision,
    /// Why it was skipped.
    pub reason: String,
}

/// Whether etcd refused a read or a watch because the revision asked for was
/// compacted away.
pub(super) fn is_compacted(e: &Error) -> bool {
    matches!(e, Error::GRpcStatus(s) if s.code() == Code::OutOfRange && s.message().contains("compacted"))
}

/// Whether a request may succeed when tried again later (etcd or the network is
/// down or slow), as opposed to a refusal.
pub(super) fn is_transient(e: &Error) -> bool {
    match e {
        Error::GRpcStatus(s) => matches!(
            s.code(),
            Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Unknown
                | Code::Cancelled
                | Code::Aborted
                | Code::Internal
        ),
        Error::TransportError(_)
        | Error::IoError(_)
        | Error::WatchError(_)
        | Error::EndpointError(_)
        | Error::Internal(_) => true,
        _ => false,
    }
}

/// What a refusal for lack of permission means, with etcd authentication on.
pub(super) const PERMISSION_HINT: &str = " (etcd's authentication is on and does not \
    allow this request to this client's user, the CN of its certificate: a node may \
    read the prefix and write only its own nodes/<node id> key; writing objects takes \
    the admin certificate. See `rune-agent certs etcd-rbac`)";

/// `e` as a [`LogError`]: [`LogError::Unavailable`] when it may pass,
/// [`LogError::Refused`] when etcd said no (for lack of permission: saying so).
pub(super) fn log_error(endpoints: &str, e: &Error) -> LogError {
    let mut message = describe(e);
    if matches!(e, Error::GRpcStatus(s) if s.code() == Code::PermissionDenied) {
        message.push_str(PERMISSION_HINT);
    }
    if is_transient(e) {
        LogError::Unavailable {
            endpoints: endpoints.to_owned(),
            message,
        }
    } else {
        LogError::Refused {
            endpoints: endpoints.to_owned(),
            message,
        }
    }
}

/// What a failure over TLS means for the client's certificate, when it reads as
/// etcd refusing it: a TLS alert about it, or (the alert lost under HTTP/2) a
/// connection closed at once.
pub(super) fn tls_hint(message: &str) -> Option<String> {
    const CHECK: &str = "check that a client certificate and key are given and that a CA \
                         the cluster trusts signed them";
    let alert = [
        "BadCertificate",
        "CertificateRequired",
        "UnknownCA",
        "CertificateUnknown",
    ]
    .iter()
    .any(|a| message.contains(&format!("fatal alert: {a}")));
    let closed = ["connection closed", "broken pipe", "connection reset"]
        .iter()
        .any(|m| message.contains(m));
    if alert {
        Some(format!(
            " (etcd refused this client's certificate: {CHECK})"
        ))
    } else if closed {
        Some(format!(
            " (if this goes on while etcd is up, etcd is refusing this client's certificate: {CHECK})"
        ))
    } else {
        None
    }
}

/// Wrappers that say nothing about the cause: dropped from messages.
const GENERIC: &[&str] = &[
    "grpc request error",
    "operation was canceled",
    "transport error",
    "connection error",
];

/// What went wrong, from the outermost message to the root cause, each said once
/// (`tcp connect error: Connection refused (os error 111)`), without etcd-client's
/// and tonic's wrappers (`grpc request error: status: Unavailable, ...`).
pub(super) fn describe(e: &Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut push = |s: String| {
        let mut s = s.trim();
        while let Some(rest) = GENERIC.iter().find_map(|g| s.strip_prefix(g)) {
            s = rest.trim_start_matches(':').trim();
        }
        if !s.is_empty() && !parts.iter().any(|p| p.contains(s)) {
            parts.push(s.to_owned());
        }
    };
    let mut source: Option<&(dyn std::error::Error + 'static)> = match e {
        Error::GRpcStatus(s) => {
            push(s.message().to_owned());
            std::error::Error::source(s)
        }
        Error::TransportError(t) => {
            push(t.to_string());
            std::error::Error::source(t)
        }
        other => {
            push(other.to_string());
            std::error::Error::source(other)
        }
    };
    while let Some(s) = source {
        push(s.to_string());
        source = s.source();
    }
    if parts.is_empty() {
        return e.to_string();
    }
    parts.join(": ")
}
