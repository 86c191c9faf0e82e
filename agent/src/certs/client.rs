//! Checks of the client certificate an agent gives etcd, made at start: etcd takes
//! the certificate's CN as the agent's user, and the roles of `certs etcd-rbac`
//! let a node write only the key of the node its CN names. A certificate of
//! another node (or the admin's) would register nothing (refused) or too much
//! (the admin may write everything), and an expired one is refused by etcd with
//! little more than a closed connection, so both stop the start with a clear error.

use std::path::Path;

use time::OffsetDateTime;

/// Why a client certificate cannot be this node's.
#[derive(Debug, thiserror::Error)]
pub enum ClientCertError {
    /// The file cannot be read or is not a PEM certificate.
    #[error("--etcd-cert {path}: {message}")]
    Unreadable {
        /// The certificate file.
        path: String,
        /// Why.
        message: String,
    },
    /// The CN is not the node id.
    #[error(
        "--etcd-cert {path} is for {cn:?}, but this node's id is {node_id} (from its state \
         dir): etcd lets a node write only the node key its certificate names. Issue this \
         node's certificate with `rune-agent certs issue {node_id} DIR`"
    )]
    OtherNode {
        /// The certificate file.
        path: String,
        /// Its CN.
        cn: String,
        /// This node's id.
        node_id: String,
    },
    /// The certificate is outside its validity.
    #[error(
        "--etcd-cert {path} is not valid now (valid {not_before} to {not_after}): issue a new one"
    )]
    NotValidNow {
        /// The certificate file.
        path: String,
        /// Its start.
        not_before: String,
        /// Its end.
        not_after: String,
    },
}

/// Refuses a client certificate whose CN is not `node_id`, or that is not valid
/// now.
pub fn check_node_certificate(path: &Path, node_id: &str) -> Result<(), ClientCertError> {
    let shown = path.display().to_string();
    let unreadable = |message: String| ClientCertError::Unreadable {
        path: shown.clone(),
        message,
    };
    let pem = std::fs::read(path).map_err(|e| unreadable(e.to_string()))?;
    let (_, block) = x509_parser::pem::parse_x509_pem(&pem)
        .map_err(|e| unreadable(format!("no PEM certificate: {e}")))?;
    let cert = block
        .parse_x509()
        .map_err(|e| unreadable(format!("not an X.509 certificate: {e}")))?;
    let cn = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|c| c.as_str().ok())
        .unwrap_or_default()
        .to_owned();
    if cn != node_id {
        return Err(ClientCertError::OtherNode {
            path: shown,
            cn,
            node_id: node_id.to_owned(),
        });
    }
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let validity = cert.validity();
    if now < validity.not_before.timestamp() || now > validity.not_after.timestamp() {
        return Err(ClientCertError::NotValidNow {
            path: shown,
            not_before: validity.not_before.to_string(),
            not_after: validity.not_after.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
