//! One certificate from the ACME server (RFC 8555, through instant-acme): the
//! account (loaded from the store, else registered), an order for one host, its
//! HTTP-01 challenge published for the plain listener to answer, then the CSR (a
//! fresh P-256 key by rcgen) and the chain.

use super::{
    Challenges,
    store::{AcmeStore, StoredAccount},
};
use crate::error_chain::error_chain;
use hyper::body::Bytes;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use instant_acme::{
    Account, AuthorizationStatus, BodyWrapper, ChallengeType, HttpClient, Identifier, NewAccount,
    NewOrder, OrderStatus, RetryPolicy,
};
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::{CertificateDer, pem::PemObject};
use std::{path::Path, sync::Arc, time::Duration};

/// How long the server may take to validate a challenge or issue the certificate.
const ORDER_PATIENCE: Duration = Duration::from_secs(90);

/// Where the ACME server is and how to reach it.
#[derive(Clone, Debug)]
pub struct AcmeServer {
    /// The directory URL.
    pub directory: String,
    /// The account's contact e-mail, if any.
    pub email: Option<String>,
    /// PEM certificates to trust for the server instead of the system's roots.
    pub ca_bundle: Option<std::path::PathBuf>,
}

/// Why an order failed.
#[derive(Debug, thiserror::Error)]
pub enum OrderError {
    /// The server does not know the account (a test server that restarted, an
    /// account deactivated): registering anew fixes it.
    #[error("the ACME server does not know the account: {0}")]
    AccountGone(String),
    /// Anything else, as one line.
    #[error("{0}")]
    Failed(String),
}

impl From<String> for OrderError {
    fn from(message: String) -> Self {
        OrderError::Failed(message)
    }
}

impl From<&str> for OrderError {
    fn from(message: &str) -> Self {
        OrderError::Failed(message.to_owned())
    }
}

/// The RFC 8555 problem type of an unknown account.
const ACCOUNT_DOES_NOT_EXIST: &str = "urn:ietf:params:acme:error:accountDoesNotExist";

/// The account at `server`: the stored one when it was made there, else a new one
/// (stored before use).
pub async fn account(server: &AcmeServer, store: &AcmeStore) -> Result<Account, String> {
    let http = || http_client(server.ca_bundle.as_deref());
    let stored = store
        .account()
        .map_err(|e| format!("reading the ACME account: {e}"))?;
    if let Some(stored) = stored.filter(|s| s.directory == server.directory) {
        return Account::builder_with_http(http()?)
            .from_credentials(stored.credentials)
            .await
            .map_err(|e| format!("loading the ACME account: {}", error_chain(&e)));
    }
    let contact = server.email.as_ref().map(|e| format!("mailto:{e}"));
    let contact: Vec<&str> = contact.iter().map(String::as_str).collect();
    let (account, credentials) = Account::builder_with_http(http()?)
        .create(
            &NewAccount {
                contact: &contact,
                terms_of_service_agreed: true,
                only_return_existing: false,
            },
            server.directory.clone(),
            None,
        )
        .await
        .map_err(|e| {
            format!(
                "registering an ACME account at {}: {}",
                server.directory,
                error_chain(&e)
            )
        })?;
    store
        .save_account(&StoredAccount {
            directory: server.directory.clone(),
            credentials,
        })
        .map_err(|e| format!("storing the ACME account: {e}"))?;
    tracing::info!(directory = %server.directory, id = account.id(), "acme: account registered");
    Ok(account)
}

/// The HTTPS client to the ACME server: rustls with ring, trusting `ca_bundle`
/// when given, else the system's roots.
fn http_client(ca_bundle: Option<&Path>) -> Result<Box<dyn HttpClient>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = hyper_rustls::HttpsConnectorBuilder::new();
    let builder = match ca_bundle {
        Some(path) => {
            let unreadable =
                |e: &dyn std::fmt::Display| format!("ACME CA bundle {}: {e}", path.display());
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| unreadable(&e))? {
                roots
                    .add(cert.map_err(|e| unreadable(&e))?)
                    .map_err(|e| unreadable(&e))?;
            }
            let config = ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_root_certificates(roots)
                .with_no_client_auth();
            builder.with_tls_config(config)
        }
        None => builder
            .with_provider_and_native_roots(provider)
            .map_err(|e| format!("the system's root certificates: {e}"))?,
    };
    let connector = builder.https_only().enable_http1().enable_http2().build();
    let client: Client<_, BodyWrapper<Bytes>> =
        Client::builder(TokioExecutor::new()).build(connector);
    Ok(Box::new(client))
}

/// Orders a certificate for `host`, answering its HTTP-01 challenge through
/// `challenges`: returns the private key and the chain, both PEM.
pub async fn issue(
    account: &Account,
    challenges: &Challenges,
    host: &str,
) -> Result<(String, String), OrderError> {
    let fail = |what: &str, e: instant_acme::Error| format!("{what}: {}", error_chain(&e));
    let identifiers = [Identifier::Dns(host.to_owned())];
    let mut order = match account.new_order(&NewOrder::new(&identifiers)).await {
        Ok(order) => order,
        Err(instant_acme::Error::Api(p)) if p.r#type.as_deref() == Some(ACCOUNT_DOES_NOT_EXIST) => {
            return Err(OrderError::AccountGone(p.to_string()));
        }
        Err(e) => return Err(fail("new order", e).into()),
    };
    // Tokens published for this order, withdrawn whatever the outcome.
    let mut published = challenges.publication();
    let mut authorizations = order.authorizations();
    while let Some(authorization) = authorizations.next().await {
        let mut authorization = authorization.map_err(|e| fail("authorization", e))?;
        match authorization.status {
            AuthorizationStatus::Pending => {}
            AuthorizationStatus::Valid => continue,
            status => return Err(format!("authorization is {status:?}").into()),
        }
        let mut challenge = authorization
            .challenge(ChallengeType::Http01)
            .ok_or("the server offers no http-01 challenge")?;
        published.add(&challenge.token, challenge.key_authorization().as_str());
        challenge
            .set_ready()
            .await
            .map_err(|e| fail("challenge", e))?;
    }
    let patience = RetryPolicy::new()
        .initial_delay(Duration::from_millis(200))
        .timeout(ORDER_PATIENCE);
    let status = order
        .poll_ready(&patience)
        .await
        .map_err(|e| fail("waiting for validation", e))?;
    if status != OrderStatus::Ready {
        let why = order.state().error.as_ref().map_or_else(
            || format!("order is {status:?}"),
            |p| format!("order is {status:?}: {p}"),
        );
        return Err(why.into());
    }
    drop(published);
    let key_pem = order.finalize().await.map_err(|e| fail("finalize", e))?;
    let chain_pem = order
        .poll_certificate(&patience)
        .await
        .map_err(|e| fail("certificate", e))?;
    Ok((key_pem, chain_pem))
}
