//! Client certificates (`spec.expose.clientCert`, mutual TLS), checked per request.
//!
//! A handshake whose SNI names a host with a route that requires client
//! certificates gets a configuration that *requests* one (optional at the
//! handshake: routes are host **and** path, so other routes of the host may not
//! need one); the client proves it holds the leaf's key there, and the chain is kept
//! with the connection ([`TlsSession`]). Every request to such a route, after route
//! selection, verifies that chain against the route's own CA ([`ClientCa`], from its
//! Secret's `ca.crt`), whatever SNI the connection was opened with: a client cannot
//! pass around the check by opening the connection for another host. Handshakes
//! for other hosts are not asked for a certificate, so browsers see no prompt.

use super::tls::{SniResolver, server_config};
use crate::{
    endpoints::ServiceView,
    model::{Secret, ServiceKey},
};
use hyper::StatusCode;
use rustls::{
    DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig, SignatureScheme,
    client::danger::HandshakeSignatureValid,
    crypto::{WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature},
    server::{
        Acceptor, NoClientAuth, WebPkiClientVerifier,
        danger::{ClientCertVerified, ClientCertVerifier},
    },
};
use rustls_pki_types::{CertificateDer, UnixTime};
use std::{collections::BTreeMap, io, sync::Arc};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::{LazyConfigAcceptor, server::TlsStream};

/// Most intermediate certificates a client may send: real client chains have
/// one or two; each request re-verifies the chain, so its length is bounded.
const MAX_INTERMEDIATES: usize = 4;

/// What a connection's TLS handshake leaves for its requests.
#[derive(Debug, Default)]
pub struct TlsSession {
    /// The SNI the client sent, lowercase.
    pub sni: Option<String>,
    /// The chain the client presented, leaf first (empty: none, or none was
    /// requested). The handshake proved the client holds the leaf's key; the chain
    /// itself is verified per request, against the CA of the request's route.
    pub chain: Vec<CertificateDer<'static>>,
    /// The client chose HTTP/2 (ALPN `h2`).
    pub h2: bool,
}

/// A route's client-certificate CA: verifies a presented chain. A route whose CA
/// Secret is missing or unusable has none and refuses every request (fail closed).
#[derive(Clone, Debug)]
pub struct ClientCa(Option<Arc<dyn ClientCertVerifier>>);

impl ClientCa {
    /// Whether its CA could be loaded (else every request is refused).
    pub fn usable(&self) -> bool {
        self.0.is_some()
    }

    /// The CA of `expose.clientCert` for the service of `view`, from `secrets`;
    /// `None` when the route requires no client certificate.
    pub fn for_route(
        view: &ServiceView,
        secrets: &BTreeMap<ServiceKey, Arc<Secret>>,
    ) -> Option<ClientCa> {
        let service = &view.service;
        let expose = service.spec.expose.as_ref()?;
        let (ns, name) = expose.client_ca_secret(&service.metadata.namespace)?;
        let verifier = match secrets.get(&ServiceKey::new(ns, name)) {
            None => Err("the Secret was not found".to_owned()),
            Some(secret) => verifier(secret),
        };
        Some(ClientCa(match verifier {
            Ok(v) => Some(v),
            Err(error) => {
                tracing::warn!(service = %view.key(), secret = %format!("{ns}/{name}"), %error,
                    "ingress: client CA unusable; the route refuses every request");
                None
            }
        }))
    }

    /// Whether `chain` (leaf first) is a valid client chain up to this CA now.
    fn verifies(&self, chain: &[CertificateDer<'static>]) -> bool {
        let (Some(verifier), Some((leaf, intermediates))) = (&self.0, chain.split_first()) else {
            return false;
        };
        verifier
            .verify_client_cert(leaf, intermediates, UnixTime::now())
            .is_ok()
    }
}

/// A verifier of client chains against the `ca.crt` of `secret`.
fn verifier(secret: &Secret) -> Result<Arc<dyn ClientCertVerifier>, String> {
    let certs = secret
        .ca_certificates()
        .unwrap_or_else(|| Err("the Secret has no ca.crt".to_owned()))?;
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots.add(cert).map_err(|e| format!("ca.crt: {e}"))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| format!("ca.crt: {e}"))
}

/// Why a request was refused: the status and a short text for the client.
pub type Refusal = (StatusCode, &'static str);

/// The per-request check of a route with `ca` for a request to `host` over `tls`
/// (`None`: plain HTTP): `Err` holds the refusal.
///
/// * plain HTTP: 403 (not redirected: the redirect would only invite a second
///   request that needs the certificate anyway);
/// * no certificate this CA verifies on a connection opened for another host
///   (SNI ≠ host): 421, so a client that reused a connection (HTTP/2 coalescing)
///   retries on one opened for this host, where this host's certificate is
///   requested;
/// * no certificate, or one this CA does not verify: 403.
pub fn check(ca: &ClientCa, tls: Option<&TlsSession>, host: &str) -> Result<(), Refusal> {
    let Some(tls) = tls else {
        return Err((
            StatusCode::FORBIDDEN,
            "a client certificate is required: use https\n",
        ));
    };
    let verified = !tls.chain.is_empty() && ca.verifies(&tls.chain);
    if verified {
        return Ok(());
    }
    if tls.sni.as_deref() != Some(host) {
        return Err((
            StatusCode::MISDIRECTED_REQUEST,
            "misdirected request: connect for this host\n",
        ));
    }
    if tls.chain.is_empty() {
        return Err((StatusCode::FORBIDDEN, "a client certificate is required\n"));
    }
    Err((StatusCode::FORBIDDEN, "client certificate not accepted\n"))
}

/// The handshake side of client certificates: asks for one, lets a client without
/// one through, accepts any chain whose leaf key signs the handshake (proof of
/// possession), and leaves the chain's verification to each request.
#[derive(Debug)]
struct RequestClientCert {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ClientCertVerifier for RequestClientCert {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    /// No hints: each route has its own CA, and the client sends what it has.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        // Verified per request against the route's CA (`check`); a long chain
        // would make every request pay for path building, so it ends here.
        if intermediates.len() > MAX_INTERMEDIATES {
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::BadEncoding,
            ));
        }
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The TLS listener's two configurations: one that requests a client certificate
/// (for hosts with a route that requires one) and one that does not.
pub struct TlsConfigs {
    plain: Arc<ServerConfig>,
    requesting: Arc<ServerConfig>,
}

impl TlsConfigs {
    /// Both configurations, with certificates from `resolver`.
    pub fn new(resolver: Arc<SniResolver>) -> Result<TlsConfigs, rustls::Error> {
        let algorithms = rustls::crypto::ring::default_provider().signature_verification_algorithms;
        Ok(TlsConfigs {
            plain: Arc::new(server_config(resolver.clone(), Arc::new(NoClientAuth))?),
            requesting: Arc::new(server_config(
                resolver,
                Arc::new(RequestClientCert { algorithms }),
            )?),
        })
    }

    /// Completes a handshake on `stream`, requesting a client certificate when
    /// `wanted` says a route of the SNI's host requires one.
    pub async fn accept<S>(
        &self,
        stream: S,
        wanted: impl FnOnce(&str) -> bool,
    ) -> io::Result<(TlsStream<S>, TlsSession)>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let start = LazyConfigAcceptor::new(Acceptor::default(), stream).await?;
        let sni = start
            .client_hello()
            .server_name()
            .map(str::to_ascii_lowercase);
        let wants = sni.as_deref().is_some_and(wanted);
        let config = if wants {
            self.requesting.clone()
        } else {
            self.plain.clone()
        };
        let stream = start.into_stream(config).await?;
        let chain = stream
            .get_ref()
            .1
            .peer_certificates()
            .map(|c| c.iter().map(|c| c.clone().into_owned()).collect())
            .unwrap_or_default();
        let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
        Ok((stream, TlsSession { sni, chain, h2 }))
    }
}

#[cfg(test)]
mod tests;
