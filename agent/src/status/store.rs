//! The agent's link to its store, as `status` and `/metrics` show it: which backend
//! holds the objects, whether it answers (etcd: since when it does not, and why),
//! and the keys the etcd readers skipped.
//!
//! The etcd watch rides out outages by itself (it reconnects and resumes), so the
//! feed never sees them: [`probe_etcd`] asks etcd for its revision every
//! [`PROBE_INTERVAL`] ([`PROBE_RETRY`] while it does not answer) and records the answer, keeping `rune_store_connected` and
//! `rune_store_skipped_keys_total` current. Nothing here touches the cache: while
//! etcd is away the data planes keep serving the last state applied.

use crate::{lock::lock, metrics::Metrics, orderedlog::etcd::EtcdLog};
use std::{
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};
use tokio_util::sync::CancellationToken;

/// How often [`probe_etcd`] asks etcd whether it answers, while it does (an idle
/// node's traffic: one small request per interval besides its lease keep-alives).
pub const PROBE_INTERVAL: Duration = Duration::from_secs(5);

/// How often it asks while etcd does not answer (`status` and the metric turn back
/// within a second of etcd's return).
pub const PROBE_RETRY: Duration = Duration::from_secs(1);

/// How long one probe may take before etcd counts as unreachable (a cut network
/// answers nothing at all).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// The store's state as `status` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreState {
    /// `embedded <path>` or `etcd <endpoints> (prefix <prefix>)`.
    pub backend: String,
    /// While the store does not answer: `since <time>, <why>`.
    pub disconnected: Option<String>,
    /// Keys skipped so far and the last one with why, when any were.
    pub skipped: Option<String>,
}

/// The link's mutable part.
#[derive(Debug, Default)]
struct Link {
    /// Since when and why the store does not answer; `None` while it does.
    down: Option<(SystemTime, String)>,
    /// How many keys were skipped, and the last one with why.
    skipped: Option<(u64, String)>,
}

/// The agent's link to its store, shared by the probe (writer) and `status`.
#[derive(Debug)]
pub struct StoreLink {
    backend: String,
    link: Mutex<Link>,
}

impl StoreLink {
    /// The embedded store in `path`: always reachable.
    pub fn embedded(path: &std::path::Path) -> Self {
        Self {
            backend: format!("embedded {}", path.display()),
            link: Mutex::default(),
        }
    }

    /// etcd at `endpoints`: not reached yet until the first probe answers.
    pub fn etcd(etcd: &EtcdLog) -> Self {
        Self {
            backend: format!("etcd {} (prefix {})", etcd.endpoints(), etcd.prefix()),
            link: Mutex::new(Link {
                down: Some((SystemTime::now(), "not reached yet".to_owned())),
                skipped: None,
            }),
        }
    }

    /// Whether the store answers.
    pub fn connected(&self) -> bool {
        lock(&self.link).down.is_none()
    }

    /// What `status` shows.
    pub fn state(&self) -> StoreState {
        let link = lock(&self.link);
        StoreState {
            backend: self.backend.clone(),
            disconnected: link
                .down
                .as_ref()
                .map(|(since, why)| format!("since {}, {why}", utc(*since))),
            skipped: link
                .skipped
                .as_ref()
                .map(|(count, last)| format!("{count} keys skipped; last: {last}")),
        }
    }

    /// Records a probe's answer; returns whether the link changed (up or down).
    fn record(&self, answer: Result<(), String>) -> bool {
        let mut link = lock(&self.link);
        match (answer, &mut link.down) {
            (Ok(()), down) => down.take().is_some(),
            (Err(why), Some((_, old))) => {
                *old = why;
                false
            }
            (Err(why), down @ None) => {
                *down = Some((SystemTime::now(), why));
                true
            }
        }
    }
}

/// Probes `etcd` until `cancel`: records in `link` whether it answers (logging each
/// change once), and keeps `rune_store_connected` and
/// `rune_store_skipped_keys_total` current.
pub async fn probe_etcd(
    link: Arc<StoreLink>,
    etcd: EtcdLog,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let mut counted = 0;
    let mut first = true;
    loop {
        let answer = match tokio::time::timeout(PROBE_TIMEOUT, etcd.revision()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "etcd at {} did not answer within {PROBE_TIMEOUT:?}",
                etcd.endpoints()
            )),
        };
        let changed = link.record(answer.clone());
        metrics.store_connected.set(i64::from(link.connected()));
        match answer {
            Ok(()) if changed => tracing::info!(
                endpoints = etcd.endpoints(),
                "etcd answers: the store is connected"
            ),
            Err(why) if changed || first => tracing::warn!(
                error = %why,
                "etcd does not answer: the data plane keeps serving the last state applied; \
                 retrying"
            ),
            _ => {}
        }
        first = false;
        let skipped = etcd.skipped();
        if skipped.count > counted {
            metrics.store_skipped_keys.inc_by(skipped.count - counted);
            counted = skipped.count;
            if let Some(last) = skipped.last {
                lock(&link.link).skipped = Some((skipped.count, last.to_string()));
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(if link.connected() { PROBE_INTERVAL } else { PROBE_RETRY }) => {}
        }
    }
}

/// `t` as `2026-12-02T04:40:01Z` (UTC, whole seconds), as the node documents
/// write times.
pub fn utc(t: SystemTime) -> String {
    crate::node::time::Timestamp::from(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn utc_times_are_calendar_dates() {
        assert_eq!(utc(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_796_186_401);
        assert_eq!(utc(t), "2026-12-02T04:40:01Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(utc(leap), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn a_link_goes_down_once_and_keeps_since_when() {
        let link = StoreLink::embedded(std::path::Path::new("/state"));
        assert!(link.connected());
        assert_eq!(link.state().backend, "embedded /state");
        assert!(link.record(Err("refused".into())));
        let since = link.state().disconnected.unwrap();
        assert!(since.ends_with(", refused"), "{since}");
        assert!(!link.record(Err("timed out".into())));
        let again = link.state().disconnected.unwrap();
        assert_eq!(again.split(',').next(), since.split(',').next());
        assert!(again.ends_with(", timed out"), "{again}");
        assert!(link.record(Ok(())));
        assert!(link.connected() && link.state().disconnected.is_none());
        assert!(!link.record(Ok(())));
    }
}
