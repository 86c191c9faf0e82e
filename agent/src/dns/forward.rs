//! Forwarding of names outside the zone to upstream resolvers, with a cache.
//!
//! A small stub forwarder over tokio sockets: one query over UDP (TCP when the
//! answer comes back truncated), a total deadline per question split between the
//! first upstream and one retry on the next, and answers cached per their TTLs
//! ([`DnsCache`]). Upstreams are always explicit: either configured, or read from a
//! resolv.conf file the caller names ([`upstreams_from_resolv_conf`]).

use super::cache::{CacheKey, Cached, DnsCache};
use crate::{
    lock::lock,
    metrics::{DnsUpstreamErrorLabels, Metrics},
};
use futures::{
    FutureExt,
    future::{BoxFuture, Shared},
};
use hickory_proto::{
    op::{Edns, Message, MessageType, OpCode, Query},
    rr::LowerName,
};
use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpStream, UdpSocket},
    sync::Semaphore,
};

/// Default `--dns-upstream-timeout-ms`: the whole budget of one forwarded question.
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);

/// Default `--dns-cache-size`.
pub const DEFAULT_CACHE_SIZE: usize = 10_000;

/// Default bound on questions in flight upstream at once (each holds a socket for
/// up to the timeout); beyond it new questions fail at once instead of piling up.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1024;

/// EDNS payload size advertised upstream (the DNS flag day 2020 value).
const UPSTREAM_PAYLOAD: u16 = 1232;

/// The forwarder's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForwardConfig {
    /// Upstream resolvers, in order of preference. Empty: read `resolv_conf`.
    pub upstreams: Vec<SocketAddr>,
    /// Where to find upstreams when none are configured; `None`: no forwarding.
    pub resolv_conf: Option<PathBuf>,
    /// How long one forwarded question may take, retry included.
    pub timeout: Duration,
    /// How many answers the cache holds (0: none).
    pub cache_size: usize,
}

impl Default for ForwardConfig {
    /// No upstreams and no resolv.conf: names outside the zone are refused.
    fn default() -> Self {
        Self {
            upstreams: Vec::new(),
            resolv_conf: None,
            timeout: DEFAULT_UPSTREAM_TIMEOUT,
            cache_size: DEFAULT_CACHE_SIZE,
        }
    }
}

/// A resolv.conf that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("read {path}")]
pub struct ResolvConfError {
    /// The file.
    pub path: PathBuf,
    /// The OS's reason.
    #[source]
    pub source: std::io::Error,
}

/// The `nameserver` lines of resolv.conf text (port 53), in order, without
/// duplicates and without any address in `own` (the agent's own DNS listeners, so it
/// never forwards to itself). Lines it cannot parse are skipped.
pub fn parse_resolv_conf(text: &str, own: &[SocketAddr]) -> Vec<SocketAddr> {
    let mut out: Vec<SocketAddr> = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            continue;
        }
        let Some(Ok(ip)) = words.next().map(str::parse::<IpAddr>) else {
            continue;
        };
        let addr = SocketAddr::new(ip, 53);
        if !is_own(addr, own) && !out.contains(&addr) {
            out.push(addr);
        }
    }
    out
}

/// Whether `addr` is one of the agent's listeners, so forwarding there would loop.
/// A wildcard listener covers every local address of its family (`[::]` is
/// dual-stack on Linux and covers IPv4 too).
pub(crate) fn is_own(addr: SocketAddr, own: &[SocketAddr]) -> bool {
    own.iter().any(|o| {
        o.port() == addr.port()
            && (o.ip() == addr.ip()
                || (o.ip().is_unspecified()
                    && (o.is_ipv6() || addr.is_ipv4())
                    && is_local(addr.ip())))
    })
}

/// Whether `ip` is an address of this host: loopback, or one a socket can bind to
/// (binding sends nothing).
fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// [`parse_resolv_conf`] of the file at `path`; a missing file means no upstreams.
pub fn upstreams_from_resolv_conf(
    path: &Path,
    own: &[SocketAddr],
) -> Result<Vec<SocketAddr>, ResolvConfError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(parse_resolv_conf(&text, own)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(source) => Err(ResolvConfError {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Why a forwarded question got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// No upstream answered in time.
    #[error("upstream {upstream} did not answer within {timeout:?}")]
    Timeout {
        /// The last upstream asked.
        upstream: SocketAddr,
        /// The time it had.
        timeout: Duration,
    },
    /// A socket operation failed.
    #[error("upstream {upstream}: {operation}")]
    Io {
        /// The upstream.
        upstream: SocketAddr,
        /// What was tried, e.g. `udp send`.
        operation: &'static str,
        /// The OS's reason.
        #[source]
        source: std::io::Error,
    },
    /// Too many questions were in flight upstream already.
    #[error("more than {max} questions in flight upstream")]
    Overloaded {
        /// The bound.
        max: usize,
    },
    /// No upstream is configured.
    #[error("no upstream resolver")]
    NoUpstream,
    /// The task asking upstream ended without an answer (it panicked).
    #[error("forwarding ended early: {message}")]
    Aborted {
        /// The task's error.
        message: String,
    },
    /// The upstream's answer could not be parsed or did not match the question.
    #[error("upstream {upstream}: malformed answer: {message}")]
    Malformed {
        /// The upstream.
        upstream: SocketAddr,
        /// What was wrong.
        message: String,
    },
}

impl ForwardError {
    /// The `reason` label of `rune_dns_upstream_errors_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            ForwardError::Timeout { .. } => "timeout",
            ForwardError::Io { .. } => "io",
            ForwardError::Malformed { .. } => "malformed",
            ForwardError::Overloaded { .. } => "overloaded",
            ForwardError::NoUpstream => "no_upstream",
            ForwardError::Aborted { .. } => "aborted",
        }
    }
}

/// A question in flight upstream, awaited by every client that asked it meanwhile.
type Flight = Shared<BoxFuture<'static, Result<Cached, Arc<ForwardError>>>>;

/// Forwards questions to upstreams and caches their answers; concurrent identical
/// misses share one upstream exchange.
pub struct Forwarder {
    inner: Arc<Inner>,
}

struct Inner {
    upstreams: Vec<SocketAddr>,
    timeout: Duration,
    cache: DnsCache,
    metrics: Arc<Metrics>,
    inflight: Mutex<HashMap<CacheKey, Flight>>,
    permits: Arc<Semaphore>,
    max_in_flight: usize,
}

impl Forwarder {
    /// A forwarder to `upstreams` (at least one, or every question fails).
    pub fn new(
        upstreams: Vec<SocketAddr>,
        timeout: Duration,
        cache_size: usize,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                upstreams,
                timeout,
                cache: DnsCache::new(cache_size),
                metrics,
                inflight: Mutex::new(HashMap::new()),
                permits: Arc::new(Semaphore::new(DEFAULT_MAX_IN_FLIGHT)),
                max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            }),
        }
    }

    /// The same forwarder with at most `max` distinct questions in flight upstream
    /// at once (at least 1); more fail at once with [`ForwardError::Overloaded`].
    pub fn with_max_in_flight(self, max: usize) -> Self {
        let max_in_flight = max.max(1);
        let permits = Arc::new(Semaphore::new(max_in_flight));
        match Arc::try_unwrap(self.inner) {
            Ok(inner) => Self {
                inner: Arc::new(Inner {
                    permits,
                    max_in_flight,
                    ..inner
                }),
            },
            // Shared already: questions may be in flight; keep the bound it has.
            Err(inner) => Self { inner },
        }
    }

    /// The upstreams, in order of preference.
    pub fn upstreams(&self) -> &[SocketAddr] {
        &self.inner.upstreams
    }

    /// The answer to `query`: from the cache, from an identical question already in
    /// flight, or from the first upstream, or on failure from the next one, all
    /// within the configured timeout.
    pub async fn resolve(&self, query: &Query) -> Result<Cached, Arc<ForwardError>> {
        let key = CacheKey {
            name: LowerName::from(query.name()),
            rtype: query.query_type(),
            class: query.query_class(),
        };
        let inner = &self.inner;
        if let Some(hit) = inner.cache.get(&key, Instant::now()) {
            inner.metrics.dns_cache_hits.inc();
            return Ok(hit);
        }
        inner.metrics.dns_cache_misses.inc();
        let flight = {
            let mut inflight = lock(&inner.inflight);
            match inflight.get(&key) {
                Some(flight) => flight.clone(),
                None => {
                    let flight = Inner::fly(inner.clone(), key.clone(), query.clone());
                    inflight.insert(key, flight.clone());
                    flight
                }
            }
        };
        flight.await
    }
}

/// Removes a flight from the in-flight map when dropped.
struct Landing {
    inner: Arc<Inner>,
    key: CacheKey,
}

impl Drop for Landing {
    fn drop(&mut self) {
        lock(&self.inner.inflight).remove(&self.key);
    }
}

/// Most records an answer may hold to be cached: the cache is bounded in entries,
/// so entries must be bounded in size too (a client could otherwise fill it with
/// 64 KiB answers from a domain it controls).
const MAX_CACHED_RECORDS: usize = 64;

fn cacheable(answer: &Cached) -> bool {
    answer.answers.len() + answer.authorities.len() + answer.additionals.len() <= MAX_CACHED_RECORDS
}

impl Inner {
    /// Starts asking upstream in a task of its own, so that the answer is cached
    /// and the flight ends even when every client that asked has gone.
    fn fly(inner: Arc<Inner>, key: CacheKey, query: Query) -> Flight {
        let permit = inner.permits.clone().try_acquire_owned();
        let task = tokio::spawn(async move {
            // Ends the flight even if this task panics: a later query for the same
            // name then asks again instead of waiting on a flight that never lands.
            let landing = Landing {
                inner: inner.clone(),
                key: key.clone(),
            };
            let result = match permit {
                Ok(_permit) => inner.ask_upstreams(&query).await,
                Err(_) => {
                    let error = ForwardError::Overloaded {
                        max: inner.max_in_flight,
                    };
                    inner.count_error(&error);
                    Err(error)
                }
            };
            if let Ok(answer) = &result
                && cacheable(answer)
            {
                inner
                    .cache
                    .insert(key.clone(), Arc::new(answer.clone()), Instant::now());
            }
            drop(landing);
            result.map_err(Arc::new)
        });
        async move {
            match task.await {
                Ok(result) => result,
                Err(error) => Err(Arc::new(ForwardError::Aborted {
                    message: error.to_string(),
                })),
            }
        }
        .boxed()
        .shared()
    }

    /// Counts a failure in `rune_dns_upstream_errors_total{reason}`.
    fn count_error(&self, error: &ForwardError) {
        self.metrics
            .dns_upstream_errors
            .get_or_create(&DnsUpstreamErrorLabels {
                reason: error.reason(),
            })
            .inc();
    }

    /// One try on the first upstream with half the budget, then one on the next
    /// with what is left.
    async fn ask_upstreams(&self, query: &Query) -> Result<Cached, ForwardError> {
        let start = tokio::time::Instant::now();
        let deadline = start + self.timeout;
        let n = self.upstreams.len();
        let mut last = None;
        for attempt in 0..2 {
            let Some(&upstream) = self.upstreams.get(attempt % n.max(1)) else {
                break;
            };
            let until = if attempt == 0 {
                start + self.timeout / 2
            } else {
                deadline
            };
            let budget = until.saturating_duration_since(tokio::time::Instant::now());
            let result = match tokio::time::timeout_at(until, exchange(upstream, query)).await {
                Ok(result) => result,
                Err(_) => Err(ForwardError::Timeout {
                    upstream,
                    timeout: budget,
                }),
            };
            match result {
                Ok(answer) => return Ok(answer),
                Err(error) => {
                    self.count_error(&error);
                    tracing::debug!(%error, attempt, "DNS upstream failed");
                    last = Some(error);
                }
            }
        }
        Err(last.unwrap_or(ForwardError::NoUpstream))
    }
}

/// Asks `upstream` over UDP, and again over TCP when the answer is truncated.
async fn exchange(upstream: SocketAddr, query: &Query) -> Result<Cached, ForwardError> {
    let id: u16 = rand::random();
    let mut message = Message::new(id, MessageType::Query, OpCode::Query);
    message.metadata.recursion_desired = true;
    message.add_query(query.clone());
    let mut edns = Edns::new();
    edns.set_max_payload(UPSTREAM_PAYLOAD);
    message.set_edns(edns);
    let bytes = message.to_vec().map_err(|e| ForwardError::Malformed {
        upstream,
        message: format!("query not encodable: {e}"),
    })?;
    let reply = exchange_udp(upstream, &bytes, id, query).await?;
    let reply = if reply.metadata.truncation {
        exchange_tcp(upstream, &bytes, id, query).await?
    } else {
        reply
    };
    Ok(Cached {
        rcode: reply.metadata.response_code,
        answers: reply.answers,
        authorities: reply.authorities,
        additionals: reply.additionals,
    })
}

/// Whether `reply` answers our query `id` for `query`.
fn matches(reply: &Message, id: u16, query: &Query) -> bool {
    reply.metadata.id == id
        && reply.metadata.message_type == MessageType::Response
        && reply.queries.len() == 1
        && reply.queries[0].query_type() == query.query_type()
        && reply.queries[0].query_class() == query.query_class()
        && LowerName::from(reply.queries[0].name()) == LowerName::from(query.name())
}

fn io(
    upstream: SocketAddr,
    operation: &'static str,
) -> impl FnOnce(std::io::Error) -> ForwardError {
    move |source| ForwardError::Io {
        upstream,
        operation,
        source,
    }
}

/// One UDP exchange; answers that do not match the query (id, question) are
/// ignored, as a spoofed or late answer would be.
async fn exchange_udp(
    upstream: SocketAddr,
    bytes: &[u8],
    id: u16,
    query: &Query,
) -> Result<Message, ForwardError> {
    let local: SocketAddr = if upstream.is_ipv4() {
        SocketAddr::from(([0, 0, 0, 0], 0))
    } else {
        SocketAddr::from(([0u16; 8], 0))
    };
    let socket = UdpSocket::bind(local)
        .await
        .map_err(io(upstream, "udp bind"))?;
    socket
        .connect(upstream)
        .await
        .map_err(io(upstream, "udp connect"))?;
    socket.send(bytes).await.map_err(io(upstream, "udp send"))?;
    // We advertise a 1232-byte EDNS payload: a larger answer comes back truncated
    // and is fetched over TCP, so a small buffer per query suffices.
    let mut buf = vec![0u8; 4096];
    loop {
        let n = socket
            .recv(&mut buf)
            .await
            .map_err(io(upstream, "udp receive"))?;
        if let Ok(reply) = Message::from_vec(&buf[..n])
            && matches(&reply, id, query)
        {
            return Ok(reply);
        }
    }
}

/// One TCP exchange (two-byte length prefix).
async fn exchange_tcp(
    upstream: SocketAddr,
    bytes: &[u8],
    id: u16,
    query: &Query,
) -> Result<Message, ForwardError> {
    let len = u16::try_from(bytes.len()).map_err(|_| ForwardError::Malformed {
        upstream,
        message: "query too long for TCP".into(),
    })?;
    let mut stream = TcpStream::connect(upstream)
        .await
        .map_err(io(upstream, "tcp connect"))?;
    let mut framed = Vec::with_capacity(bytes.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(bytes);
    stream
        .write_all(&framed)
        .await
        .map_err(io(upstream, "tcp send"))?;
    let mut len = [0u8; 2];
    stream
        .read_exact(&mut len)
        .await
        .map_err(io(upstream, "tcp receive"))?;
    let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
    stream
        .read_exact(&mut buf)
        .await
        .map_err(io(upstream, "tcp receive"))?;
    let reply = Message::from_vec(&buf).map_err(|e| ForwardError::Malformed {
        upstream,
        message: e.to_string(),
    })?;
    if !matches(&reply, id, query) {
        return Err(ForwardError::Malformed {
            upstream,
            message: "answer does not match the question".into(),
        });
    }
    Ok(reply)
}

#[cfg(test)]
mod tests;
