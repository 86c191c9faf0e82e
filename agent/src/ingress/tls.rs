//! TLS of the ingress proxy: the certificate for each exposed host, picked by SNI
//! from the routes' Secrets, swapped whole when a Secret or route changes (new
//! handshakes see the new certificates; open connections keep theirs).

use crate::{
    endpoints::ServiceView,
    model::{Secret, ServiceKey},
};
use arc_swap::ArcSwap;
use rustls::{
    CipherSuite, ServerConfig, SupportedCipherSuite,
    server::{ClientHello, ResolvesServerCert, danger::ClientCertVerifier},
    sign::CertifiedKey,
};
use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

/// Host → certificate, exact and wildcard, and the default for other names.
#[derive(Debug, Default)]
pub struct CertMap {
    exact: HashMap<String, Arc<CertifiedKey>>,
    /// Keyed by the part after `*.`.
    wildcard: HashMap<String, Arc<CertifiedKey>>,
    /// Served when SNI names no route with TLS (or is absent); none: refused.
    default: Option<Arc<CertifiedKey>>,
    /// Each exposed host's certificate expiry, Unix seconds (for the metric).
    pub expiries: Vec<(String, i64)>,
}

impl CertMap {
    /// The certificates of every exposed route with TLS whose Secret exists and
    /// holds a usable `tls.crt`/`tls.key`, or (`tls.mode: acme`) whose host has a
    /// certificate in `acme` (a route without one gets no handshake).
    pub fn build(
        views: &[ServiceView],
        secrets: &BTreeMap<ServiceKey, Arc<Secret>>,
        default: Option<&ServiceKey>,
        acme: &HashMap<String, Arc<CertifiedKey>>,
    ) -> CertMap {
        let mut map = CertMap {
            default: default.and_then(|key| match secrets.get(key).map(|s| s.certified_key()) {
                Some(Some(Ok(cert))) => Some(cert),
                _ => {
                    tracing::warn!(secret = %key, "ingress: default certificate Secret missing or unusable");
                    None
                }
            }),
            ..CertMap::default()
        };
        for view in views {
            let service = &view.service;
            let Some(expose) = &service.spec.expose else {
                continue;
            };
            if let Some(host) = expose.acme_host() {
                if let Some(key) = acme.get(host) {
                    map.insert(host, key.clone());
                }
                continue;
            }
            let Some((ns, name)) = expose.tls_secret(&service.metadata.namespace) else {
                continue;
            };
            let Some(secret) = secrets.get(&ServiceKey::new(ns, name)) else {
                tracing::warn!(service = %view.key(), secret = %format!("{ns}/{name}"), "ingress: TLS Secret not found");
                continue;
            };
            let key = match secret.certified_key() {
                Some(Ok(key)) => key,
                Some(Err(e)) => {
                    tracing::warn!(secret = %format!("{ns}/{name}"), error = %e, "ingress: TLS Secret unusable");
                    continue;
                }
                None => {
                    tracing::warn!(secret = %format!("{ns}/{name}"), "ingress: TLS Secret has no tls.crt");
                    continue;
                }
            };
            map.insert(&expose.host, key);
        }
        map
    }

    /// Serves `key` for `host` (exact or wildcard) and records its expiry.
    fn insert(&mut self, host: &str, key: Arc<CertifiedKey>) {
        if let Some(expiry) = not_after(&key) {
            self.expiries.push((host.to_owned(), expiry));
        }
        match host.strip_prefix("*.") {
            Some(suffix) => self.wildcard.insert(suffix.to_owned(), key),
            None => self.exact.insert(host.to_owned(), key),
        };
    }

    /// Whether a route of `host` (exact, or `*.` wildcard) is served a
    /// certificate for its name: an exact host's own, or a wildcard route's that
    /// covers it (the default certificate aside).
    pub fn has(&self, host: &str) -> bool {
        match host.strip_prefix("*.") {
            Some(suffix) => self.wildcard.contains_key(suffix),
            None => {
                self.exact.contains_key(host)
                    || host
                        .split_once('.')
                        .is_some_and(|(_, parent)| self.wildcard.contains_key(parent))
            }
        }
    }

    /// When the certificate served for a route of `host` (as exposed) expires,
    /// Unix seconds: its own, or for an exact host the wildcard route's covering it.
    pub fn expiry(&self, host: &str) -> Option<i64> {
        let of = |h: &str| self.expiries.iter().find(|(e, _)| e == h).map(|(_, t)| *t);
        of(host).or_else(|| {
            let (_, parent) = host.split_once('.').filter(|_| !host.starts_with("*."))?;
            of(&format!("*.{parent}"))
        })
    }

    /// Whether a default certificate answers names no route has a certificate for.
    pub fn has_default(&self) -> bool {
        self.default.is_some()
    }

    /// The certificate for `host` (lowercase): exact, else its parent's wildcard,
    /// else the default; without SNI the default.
    pub fn get(&self, host: Option<&str>) -> Option<Arc<CertifiedKey>> {
        let routed = host.and_then(|host| {
            self.exact.get(host).cloned().or_else(|| {
                let (_, parent) = host.split_once('.')?;
                self.wildcard.get(parent).cloned()
            })
        });
        routed.or_else(|| self.default.clone())
    }
}

/// When the leaf certificate of `key` expires, Unix seconds.
fn not_after(key: &CertifiedKey) -> Option<i64> {
    let leaf = key.end_entity_cert().ok()?;
    let (_, cert) = x509_parser::parse_x509_certificate(leaf).ok()?;
    Some(cert.validity().not_after.timestamp())
}

/// Picks the certificate by SNI from the current [`CertMap`]; no SNI or an unknown
/// one gets the default certificate if one is configured, else none, and the
/// handshake is refused.
#[derive(Debug, Default)]
pub struct SniResolver {
    /// Replaced whole by the route watcher.
    pub certs: ArcSwap<CertMap>,
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let name = hello.server_name().map(str::to_ascii_lowercase);
        self.certs.load().get(name.as_deref())
    }
}

/// The server configuration: TLS 1.2 and 1.3 (ring) with the cipher suites in
/// [`preference`] order, ALPN h2 then http/1.1,
/// certificates from `resolver`, client certificates as `client_auth` asks
/// (`NoClientAuth`: none).
pub fn server_config(
    resolver: Arc<SniResolver>,
    client_auth: Arc<dyn ClientCertVerifier>,
) -> Result<ServerConfig, rustls::Error> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.sort_by_key(preference);
    let provider = Arc::new(provider);
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_client_cert_verifier(client_auth)
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config.ignore_client_order = true;
    Ok(config)
}

/// The server's order of cipher suites: TLS 1.3 before 1.2, and within each
/// AES-128-GCM first (SHA-256 for the key schedule and ten AES rounds make
/// handshakes and bulk data cheaper than AES-256's SHA-384 and fourteen rounds);
/// a stable sort keeps ring's order after that (AES-256-GCM, then ChaCha20, which
/// a client listing it first, for want of AES hardware, does not get).
fn preference(suite: &SupportedCipherSuite) -> u8 {
    let aes_128 = matches!(
        suite.suite(),
        CipherSuite::TLS13_AES_128_GCM_SHA256
            | CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
            | CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
    );
    let tls12 = suite.version() != &rustls::version::TLS13;
    u8::from(!aes_128) + 2 * u8::from(tls12)
}
