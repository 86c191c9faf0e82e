//! ACME for the ingress proxy (`tls.mode: acme`, docs/ingress.md): certificates
//! for exposed hosts from an ACME server (Let's Encrypt, or pebble in tests) over
//! HTTP-01, whose tokens the plain listener answers ([`Challenges`]).
//!
//! One task ([`Acme::run`]) keeps a certificate for every host the routes want:
//! it loads the stored ones at start (a restart does not re-issue), orders missing
//! ones, renews each ahead of its expiry, and after a failure retries with an
//! exponential backoff while the current certificate stays served. Certificates
//! reach the SNI map ([`super::tls::CertMap`]) through [`Acme::certs`]; each change
//! is announced on [`Acme::changes`] so the route watcher rebuilds the map.

mod challenges;
mod issue;
mod schedule;
mod store;

pub use challenges::{CHALLENGE_PATH, Challenges};
pub use issue::AcmeServer;

use crate::{lock::lock, model::load_certified_key, node::time::Timestamp};
use arc_swap::ArcSwap;
use instant_acme::Account;
use issue::OrderError;
use rustls::sign::CertifiedKey;
use serde::{Deserialize, Serialize};
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};
use store::AcmeStore;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The longest one issuance may take (account, order, validation, certificate).
const ISSUE_TIMEOUT: Duration = Duration::from_secs(180);

/// The longest the task sleeps before looking at the clock again.
const MAX_SLEEP: Duration = Duration::from_secs(3600);

/// How the ingress gets ACME certificates.
#[derive(Clone, Debug)]
pub struct AcmeSettings {
    /// The ACME server.
    pub server: AcmeServer,
    /// How long before expiry a certificate is renewed (at most half its lifetime).
    pub renew_before: Duration,
    /// The wait before retrying a failed order; it doubles with each further
    /// failure, up to an hour.
    pub first_retry: Duration,
    /// Where the account and certificates are kept (`<state-dir>/acme`).
    pub dir: PathBuf,
}

/// One ACME certificate as `status` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AcmeCertStatus {
    /// The exposed host.
    pub host: String,
    /// The issuer's distinguished name; none before the first certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issuer: Option<String>,
    /// The serial number (hex).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// When it expires (RFC 3339 UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<String>,
    /// When it is due for renewal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_at: Option<String>,
    /// The last failure (`<time>: <why>`), until an attempt succeeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

impl fmt::Display for AcmeCertStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.issuer, &self.expires) {
            (Some(issuer), Some(expires)) => write!(
                f,
                "{} acme, issuer {issuer}, serial {}, expires {expires}, renew {}",
                self.host,
                self.serial.as_deref().unwrap_or("?"),
                self.renew_at.as_deref().unwrap_or("?"),
            )?,
            _ => write!(f, "{} acme, no certificate yet", self.host)?,
        }
        if let Some(e) = &self.last_error {
            write!(f, "; last error {e}")?;
        }
        Ok(())
    }
}

/// A certificate in hand, with what scheduling and `status` need.
struct Issued {
    key: Arc<CertifiedKey>,
    issuer: String,
    serial: String,
    not_before: i64,
    not_after: i64,
}

impl Issued {
    /// From a PEM text holding the private key and the chain (leaf first).
    fn parse(pem: &str) -> Result<Issued, String> {
        let key = load_certified_key(pem, pem)?;
        let leaf = key.end_entity_cert().map_err(|e| e.to_string())?;
        let (_, cert) = x509_parser::parse_x509_certificate(leaf).map_err(|e| e.to_string())?;
        Ok(Issued {
            issuer: cert.issuer().to_string(),
            serial: cert.raw_serial_as_string(),
            not_before: cert.validity().not_before.timestamp(),
            not_after: cert.validity().not_after.timestamp(),
            key: Arc::new(key),
        })
    }
}

/// One wanted host's certificate and attempts.
#[derive(Default)]
struct HostState {
    cert: Option<Issued>,
    /// Failures in a row.
    failures: u32,
    /// No attempt before this (after a failure).
    retry_at: Option<Instant>,
    last_error: Option<String>,
}

/// The ACME subsystem of the ingress proxy.
pub struct Acme {
    settings: AcmeSettings,
    store: AcmeStore,
    /// Pending HTTP-01 tokens, answered by the plain listener.
    challenges: Arc<Challenges>,
    /// Host → certificate, as served.
    certs: ArcSwap<HashMap<String, Arc<CertifiedKey>>>,
    hosts: Mutex<BTreeMap<String, HostState>>,
    wanted: watch::Sender<BTreeSet<String>>,
    changed: watch::Sender<u64>,
}

impl Acme {
    /// ACME with `settings`, publishing challenge tokens in `challenges`.
    pub fn new(settings: AcmeSettings, challenges: Arc<Challenges>) -> Acme {
        Acme {
            store: AcmeStore::new(settings.dir.clone()),
            settings,
            challenges,
            certs: ArcSwap::default(),
            hosts: Mutex::default(),
            wanted: watch::Sender::new(BTreeSet::new()),
            changed: watch::Sender::new(0),
        }
    }

    /// Host → certificate for every host with one.
    pub fn certs(&self) -> Arc<HashMap<String, Arc<CertifiedKey>>> {
        self.certs.load_full()
    }

    /// Announces each change of [`Acme::certs`].
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The hosts the routes want certificates for (exact names).
    pub fn want(&self, hosts: BTreeSet<String>) {
        self.wanted.send_if_modified(|current| {
            let changed = *current != hosts;
            *current = hosts;
            changed
        });
    }

    /// Each wanted host's certificate and last error, by host.
    pub fn status(&self) -> Vec<AcmeCertStatus> {
        let wanted = self.wanted.borrow().clone();
        let hosts = lock(&self.hosts);
        wanted
            .iter()
            .map(|host| {
                let state = hosts.get(host);
                let cert = state.and_then(|s| s.cert.as_ref());
                AcmeCertStatus {
                    host: host.clone(),
                    issuer: cert.map(|c| c.issuer.clone()),
                    serial: cert.map(|c| c.serial.clone()),
                    expires: cert.map(|c| utc(c.not_after)),
                    renew_at: cert.map(|c| {
                        utc(schedule::renew_at(
                            c.not_before,
                            c.not_after,
                            self.settings.renew_before,
                        ))
                    }),
                    last_error: state.and_then(|s| s.last_error.clone()),
                }
            })
            .collect()
    }

    /// Keeps the wanted hosts' certificates until cancelled.
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        self.load();
        let mut wanted = self.wanted.subscribe();
        let mut account = None;
        loop {
            let hosts = wanted.borrow_and_update().clone();
            let next = self.next_due(&hosts);
            if let Some((host, wait)) = &next
                && wait.is_zero()
            {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = self.attempt(host, &mut account) => continue,
                }
            }
            let wait = next.map_or(MAX_SLEEP, |(_, wait)| wait.min(MAX_SLEEP));
            tokio::select! {
                () = cancel.cancelled() => return,
                changed = wanted.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Loads the stored certificates (any host: the routes may want it later).
    fn load(&self) {
        let stored = match self.store.certs() {
            Ok(s) => s,
            Err(error) => {
                tracing::warn!(dir = %self.store.dir().display(), %error, "acme: stored certificates unreadable");
                return;
            }
        };
        let mut hosts = lock(&self.hosts);
        for (host, pem) in stored {
            match Issued::parse(&pem) {
                Ok(issued) => {
                    tracing::info!(%host, serial = %issued.serial, expires = %utc(issued.not_after), "acme: stored certificate loaded");
                    hosts.entry(host).or_default().cert = Some(issued);
                }
                Err(error) => {
                    tracing::warn!(%host, %error, "acme: stored certificate unusable: issuing anew");
                }
            }
        }
        drop(hosts);
        self.publish();
    }

    /// The wanted host due soonest and how long until it is due.
    fn next_due(&self, wanted: &BTreeSet<String>) -> Option<(String, Duration)> {
        let hosts = lock(&self.hosts);
        let now = Instant::now();
        let unix_now = unix(SystemTime::now());
        wanted
            .iter()
            .map(|host| {
                let state = hosts.get(host);
                let renew = state.and_then(|s| s.cert.as_ref()).map_or(0, |c| {
                    schedule::renew_at(c.not_before, c.not_after, self.settings.renew_before)
                });
                let until_renew =
                    Duration::from_secs(u64::try_from(renew.saturating_sub(unix_now)).unwrap_or(0));
                let until_retry = state
                    .and_then(|s| s.retry_at)
                    .map_or(Duration::ZERO, |at| at.saturating_duration_since(now));
                (host.clone(), until_renew.max(until_retry))
            })
            .min_by_key(|(_, wait)| *wait)
    }

    /// Issues (or renews) `host`'s certificate once; records the outcome.
    async fn attempt(&self, host: &str, account: &mut Option<Account>) {
        tracing::info!(%host, directory = %self.settings.server.directory, "acme: ordering a certificate");
        let outcome = tokio::time::timeout(ISSUE_TIMEOUT, self.obtain(host, account))
            .await
            .unwrap_or_else(|_| Err(format!("timed out after {ISSUE_TIMEOUT:?}")));
        let mut hosts = lock(&self.hosts);
        let state = hosts.entry(host.to_owned()).or_default();
        match outcome {
            Ok(issued) => {
                tracing::info!(%host, serial = %issued.serial, expires = %utc(issued.not_after), "acme: certificate issued");
                *state = HostState {
                    cert: Some(issued),
                    ..HostState::default()
                };
                drop(hosts);
                self.publish();
            }
            Err(error) => {
                // The next attempt starts from the stored account again.
                *account = None;
                state.failures = state.failures.saturating_add(1);
                let wait = schedule::backoff(self.settings.first_retry, state.failures);
                state.retry_at = Some(Instant::now() + wait);
                state.last_error = Some(format!("{}: {error}", utc(unix(SystemTime::now()))));
                tracing::warn!(%host, %error, retry_in = ?wait, "acme: ordering a certificate failed");
            }
        }
    }

    /// The account (once), an order for `host`, the stored result. An account the
    /// server does not know is forgotten and registered anew, once.
    async fn obtain(&self, host: &str, account: &mut Option<Account>) -> Result<Issued, String> {
        let mut registered_anew = false;
        let (key_pem, chain_pem) = loop {
            let current = match account {
                Some(a) => a,
                None => account.insert(issue::account(&self.settings.server, &self.store).await?),
            };
            match issue::issue(current, &self.challenges, host).await {
                Ok(issued) => break issued,
                Err(OrderError::AccountGone(why)) if !registered_anew => {
                    tracing::warn!(%why, "acme: the server does not know the account: registering anew");
                    self.store
                        .remove_account()
                        .map_err(|e| format!("forgetting the ACME account: {e}"))?;
                    *account = None;
                    registered_anew = true;
                }
                Err(e) => return Err(e.to_string()),
            }
        };
        let issued = Issued::parse(&format!("{key_pem}\n{chain_pem}"))?;
        self.store
            .save_cert(host, &key_pem, &chain_pem)
            .map_err(|e| format!("storing the certificate: {e}"))?;
        Ok(issued)
    }

    /// Swaps in the certificates in hand and announces the change.
    fn publish(&self) {
        let certs = lock(&self.hosts)
            .iter()
            .filter_map(|(host, s)| Some((host.clone(), s.cert.as_ref()?.key.clone())))
            .collect();
        self.certs.store(Arc::new(certs));
        self.changed.send_modify(|n| *n += 1);
    }
}

/// `t` in whole seconds since the Unix epoch (0 before it).
pub(in crate::ingress) fn unix(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// A Unix time as `status` shows times (RFC 3339 UTC).
pub(in crate::ingress) fn utc(unix_seconds: i64) -> String {
    Timestamp(u64::try_from(unix_seconds).unwrap_or(0)).to_string()
}

#[cfg(test)]
mod tests;
