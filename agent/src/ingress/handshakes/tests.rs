use super::*;
use crate::{
    ingress::tls::{CertMap, SniResolver},
    model::{Secret, ServiceKey},
};
use rustls::pki_types::{CertificateDer, ServerName};
use std::collections::{BTreeMap, HashMap};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const HOST: &str = "handshake.test";

/// TLS configurations serving a fresh self-signed certificate for [`HOST`] as the
/// default, and the certificate for clients to trust.
fn configs() -> (Arc<TlsConfigs>, CertificateDer<'static>) {
    let cert = rcgen::generate_simple_self_signed(vec![HOST.to_owned()]).unwrap();
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "cert"},
        "data": {"tls.crt": cert.cert.pem(), "tls.key": cert.signing_key.serialize_pem()},
    }))
    .unwrap();
    let key = ServiceKey::new("default", "cert");
    let secrets = BTreeMap::from([(key.clone(), Arc::new(secret))]);
    let resolver = Arc::new(SniResolver::default());
    resolver.certs.store(Arc::new(CertMap::build(
        &[],
        &secrets,
        Some(&key),
        &HashMap::new(),
    )));
    let configs = TlsConfigs::new(resolver).unwrap();
    (Arc::new(configs), cert.cert.der().clone())
}

/// Handshakes on `threads` threads (0: inline) with `timeout`, tracked by `tasks`.
fn handshakes(
    threads: usize,
    timeout: Duration,
    tasks: &TaskTracker,
) -> (Handshakes, CertificateDer<'static>) {
    let (configs, cert) = configs();
    let routes = Arc::new(ArcSwap::from_pointee(RouteTable::default()));
    let h = Handshakes::start(threads, configs, routes, timeout, tasks).unwrap();
    (h, cert)
}

/// A TLS client trusting `cert` that sends `ping` and returns what it reads back.
async fn client(addr: std::net::SocketAddr, cert: CertificateDer<'static>) -> Vec<u8> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from(HOST).unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    tls.write_all(b"ping").await.unwrap();
    let mut back = Vec::new();
    tls.read_to_end(&mut back).await.unwrap();
    back
}

/// A current-thread runtime, as each worker runs.
fn worker() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_connection_comes_back_established_and_usable_on_the_worker() {
    for threads in [0, 1, 2] {
        worker().block_on(async {
            let tasks = TaskTracker::new();
            let (h, cert) = handshakes(threads, Duration::from_secs(5), &tasks);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let client = tokio::spawn(client(addr, cert));
            let (stream, _) = listener.accept().await.unwrap();
            let Ok((mut tls, session)) = h.handshake(stream).await else {
                panic!("no handshake with {threads} threads");
            };
            assert_eq!(session.sni.as_deref(), Some(HOST));
            // The client lists AES-256 first (rustls's order); the server's wins.
            assert_eq!(
                tls.get_ref().1.negotiated_cipher_suite().map(|s| s.suite()),
                Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256)
            );
            let mut ping = [0; 4];
            tls.read_exact(&mut ping).await.unwrap();
            assert_eq!(&ping, b"ping");
            tls.write_all(b"pong").await.unwrap();
            tls.shutdown().await.unwrap();
            assert_eq!(client.await.unwrap(), b"pong");
            // The threads end once the workers' side is gone.
            drop(h);
            tasks.close();
            tokio::time::timeout(Duration::from_secs(5), tasks.wait())
                .await
                .expect("handshake threads did not end");
        });
    }
}

#[test]
fn a_client_that_sends_nothing_times_out_wherever_the_handshake_runs() {
    for threads in [0, 1] {
        worker().block_on(async {
            let tasks = TaskTracker::new();
            let (h, _) = handshakes(threads, Duration::from_millis(200), &tasks);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let _silent = TcpStream::connect(addr).await.unwrap();
            let (stream, _) = listener.accept().await.unwrap();
            assert!(matches!(
                h.handshake(stream).await,
                Err(HandshakeError::Timeout)
            ));
        });
    }
}

#[test]
fn a_client_that_is_not_tls_fails_the_handshake() {
    worker().block_on(async {
        let tasks = TaskTracker::new();
        let (h, _) = handshakes(1, Duration::from_secs(5), &tasks);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut plain = TcpStream::connect(addr).await.unwrap();
        plain
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        assert!(matches!(
            h.handshake(stream).await,
            Err(HandshakeError::Failed(_))
        ));
    });
}
