//! `kind: Secret`: named strings (certificates and keys as PEM) that other objects
//! refer to, e.g. the certificate of an exposed route (`spec.expose.tls.secret`).
//!
//! The TLS keys are checked at apply with rustls, the same code the ingress proxy
//! loads them with: a certificate chain and key that do not parse, or a key that
//! does not belong to the certificate, are refused with the reason, so whatever the
//! store holds the proxy can serve.

use super::{Metadata, ModelError};
use rustls::{crypto::ring::default_provider, sign::CertifiedKey};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use serde::{Deserialize, Serialize};
use std::{collections::BTreeMap, fmt, sync::Arc};

/// The key of a certificate chain (PEM, leaf first).
pub const TLS_CERT_KEY: &str = "tls.crt";
/// The key of the chain's private key (PEM).
pub const TLS_KEY_KEY: &str = "tls.key";
/// The key of a CA bundle (PEM).
pub const CA_CERT_KEY: &str = "ca.crt";

/// Named strings; `get` hides the values unless asked (`-o yaml --show-secrets`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Secret {
    /// Name, namespace and labels.
    pub metadata: Metadata,
    /// Key → value.
    #[serde(default)]
    pub data: BTreeMap<String, String>,
}

/// Debug output names the keys only: secrets must not reach logs.
impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Secret")
            .field("metadata", &self.metadata)
            .field("data", &self.data.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Secret {
    /// The certificate and key of `tls.crt`/`tls.key`, ready to serve; `None` when
    /// the Secret has no `tls.crt`.
    pub fn certified_key(&self) -> Option<Result<Arc<CertifiedKey>, String>> {
        let cert = self.data.get(TLS_CERT_KEY)?;
        let Some(key) = self.data.get(TLS_KEY_KEY) else {
            return Some(Err(format!(
                "{TLS_KEY_KEY} is missing beside {TLS_CERT_KEY}"
            )));
        };
        Some(load_certified_key(cert, key).map(Arc::new))
    }

    /// The certificates of `ca.crt` (e.g. the CA that verifies client certificates);
    /// `None` when the Secret has no `ca.crt`.
    pub fn ca_certificates(&self) -> Option<Result<Vec<CertificateDer<'static>>, String>> {
        self.data
            .get(CA_CERT_KEY)
            .map(|pem| parse_certificates(pem))
    }

    pub(super) fn validate(&self, object: &str) -> Result<(), ModelError> {
        for key in self.data.keys() {
            let ok = !key.is_empty()
                && key.len() <= 253
                && key
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b));
            if !ok {
                return Err(ModelError::invalid(
                    object,
                    "data",
                    format!("{key:?} is not a key (letters, digits, '-', '_' and '.')"),
                ));
            }
        }
        if self.data.contains_key(TLS_KEY_KEY) && !self.data.contains_key(TLS_CERT_KEY) {
            return Err(ModelError::invalid(
                object,
                format!("data.{TLS_CERT_KEY}"),
                format!("missing beside {TLS_KEY_KEY}"),
            ));
        }
        if let Some(Err(message)) = self.certified_key() {
            return Err(ModelError::invalid(
                object,
                format!("data.{TLS_CERT_KEY}"),
                message,
            ));
        }
        if let Some(Err(message)) = self.ca_certificates() {
            return Err(ModelError::invalid(
                object,
                format!("data.{CA_CERT_KEY}"),
                message,
            ));
        }
        Ok(())
    }
}

/// Every certificate of a PEM text; at least one.
fn parse_certificates(pem: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err("holds no PEM certificate".to_owned());
    }
    Ok(certs)
}

/// A certificate chain (PEM, leaf first) and its private key (PEM) checked to
/// belong together, ready to serve: for Secrets and for ACME certificates alike.
pub fn load_certified_key(cert_pem: &str, key_pem: &str) -> Result<CertifiedKey, String> {
    let chain = parse_certificates(cert_pem)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| format!("{TLS_KEY_KEY} is not a PEM private key: {e}"))?;
    let certified =
        CertifiedKey::from_der(chain, key, &default_provider()).map_err(|e| match e {
            rustls::Error::InconsistentKeys(_) => {
                format!("{TLS_KEY_KEY} does not belong to the certificate")
            }
            e => format!("certificate and {TLS_KEY_KEY} cannot be used: {e}"),
        })?;
    // `from_der` lets a key whose public half is unknown pass; refuse it here.
    certified
        .keys_match()
        .map_err(|e| format!("{TLS_KEY_KEY} does not belong to the certificate: {e}"))?;
    Ok(certified)
}
