//! The `dns` subsystem: an authoritative DNS server for service names,
//! `<service>.<namespace>.rune`, on UDP and TCP, kept current from the endpoint cache.
//!
//! Answers come from our own [`Zone`], an immutable table of record sets kept ready
//! in wire form, updated per cache delta (only the changed services' names) and
//! swapped in atomically, so a lookup takes no lock and answers change within
//! milliseconds of a change in the cache. Over UDP, zone answers take a fast path
//! ([`fast`]: batched receive and send, the answer copied from the zone);
//! hickory-server carries everything else: TCP, forwarded names, malformed or
//! unusual queries.
//!
//! Names outside the zone are forwarded to upstream resolvers ([`Forwarder`]:
//! configured ones, or those of a resolv.conf minus the agent's own addresses), with
//! a cache; with no upstream at all they are refused.

mod cache;
pub mod fast;
mod forward;
mod udp;
mod zone;

pub use cache::{CacheKey, Cached, DnsCache, MAX_NEGATIVE_TTL, MAX_POSITIVE_TTL};
pub use forward::{
    DEFAULT_CACHE_SIZE, DEFAULT_UPSTREAM_TIMEOUT, ForwardConfig, ForwardError, Forwarder,
    ResolvConfError, parse_resolv_conf, upstreams_from_resolv_conf,
};
pub use zone::{
    Answer, Authority, InvalidDomain, WireAnswer, WireRecords, Zone, ZoneConfig, ZoneWriter,
};

use crate::{
    applied::Acker,
    config::Mode,
    endpoints::EndpointCache,
    lock::lock,
    metrics::{DnsQueryLabels, DnsZoneLabels, Metrics},
    subsystem::{Readiness, ReadySetter, StartContext, Subsystem, SubsystemError},
};
use arc_swap::ArcSwap;
use hickory_proto::{
    op::{Edns, Header, HeaderCounts, MessageType, Metadata, OpCode, ResponseCode},
    rr::{DNSClass, RecordType},
};
use hickory_server::{
    Server,
    net::runtime::Time,
    server::{Request, RequestHandler, ResponseHandler, ResponseInfo},
    zone_handler::MessageResponseBuilder,
};
use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::net::{TcpListener, UdpSocket};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// How long a TCP client may stay idle between queries before it is disconnected.
const TCP_TIMEOUT: Duration = Duration::from_secs(10);

/// How many ports are tried for a listen address with port 0.
const PORT_ZERO_TRIES: u32 = 8;

/// Responses buffered per TCP connection.
const TCP_RESPONSE_BUFFER: usize = 16;

/// The DNS server's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsConfig {
    /// Where to listen, UDP and TCP on each address.
    pub addrs: Vec<SocketAddr>,
    /// What the zone holds.
    pub zone: ZoneConfig,
    /// Where names outside the zone go.
    pub forward: ForwardConfig,
}

/// Whether the server answers, as `status` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DnsState {
    /// Not started yet.
    Off,
    /// Listening on these addresses.
    Serving {
        /// Every bound address (UDP and TCP on each).
        addrs: Vec<SocketAddr>,
        /// Where names outside the zone are forwarded; empty: they are refused.
        upstreams: Vec<SocketAddr>,
    },
    /// Dev mode only: nothing could be bound, the agent runs without DNS.
    Disabled {
        /// Why, with the addresses and the OS's reasons.
        reason: String,
    },
}

impl std::fmt::Display for DnsState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DnsState::Off => f.write_str("off"),
            DnsState::Serving { addrs, upstreams } => {
                let addrs: Vec<String> = addrs.iter().map(ToString::to_string).collect();
                write!(f, "serving on {}", addrs.join(", "))?;
                if upstreams.is_empty() {
                    f.write_str("; no upstream, other names refused")
                } else {
                    let upstreams: Vec<String> =
                        upstreams.iter().map(ToString::to_string).collect();
                    write!(f, "; forwarding to {}", upstreams.join(", "))
                }
            }
            DnsState::Disabled { reason } => write!(f, "off: {reason}"),
        }
    }
}

/// The `dns` subsystem.
pub struct DnsServer {
    config: DnsConfig,
    cache: Arc<EndpointCache>,
    metrics: Arc<Metrics>,
    zone: Arc<ArcSwap<Zone>>,
    state: Arc<Mutex<DnsState>>,
    serving: ReadySetter,
    readiness: Readiness,
    tasks: TaskTracker,
    /// Acknowledges each zone swapped in ([`DnsServer::with_applied`]).
    acker: Mutex<Option<Acker>>,
}

impl DnsServer {
    /// A server answering from `cache`, counting queries in `metrics`. Fails when the
    /// configured domain is not a valid name.
    pub fn new(
        config: DnsConfig,
        cache: Arc<EndpointCache>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, InvalidDomain> {
        let empty = Zone::build(&config.zone, 0, std::iter::empty())?;
        let (serving, readiness) = Readiness::new();
        Ok(Self {
            config,
            cache,
            metrics,
            zone: Arc::new(ArcSwap::from_pointee(empty)),
            state: Arc::new(Mutex::new(DnsState::Off)),
            serving,
            readiness,
            tasks: TaskTracker::new(),
            acker: Mutex::new(None),
        })
    }

    /// Acknowledges to `acker` (the node's applied revision) the revision of every
    /// zone swapped in. DNS turned off (dev mode) drops it and holds nothing back.
    #[must_use]
    pub fn with_applied(self, acker: Acker) -> Self {
        *lock(&self.acker) = Some(acker);
        self
    }

    /// Whether and where the server answers (for `status`).
    pub fn state(&self) -> DnsState {
        lock(&self.state).clone()
    }

    /// A closure reading [`DnsServer::state`], for a status document that outlives
    /// borrowing the server.
    pub fn state_handle(&self) -> impl Fn() -> DnsState + Send + Sync + 'static {
        let state = self.state.clone();
        move || lock(&state).clone()
    }
}

impl DnsServer {
    /// The configured upstreams, or those of the resolv.conf without the agent's own
    /// addresses (configured and bound); a resolv.conf that cannot be read means
    /// none, with a warning.
    fn upstreams(&self, bound: &[SocketAddr]) -> Vec<SocketAddr> {
        let forward = &self.config.forward;
        let own: Vec<SocketAddr> = self.config.addrs.iter().chain(bound).copied().collect();
        if !forward.upstreams.is_empty() {
            let (mine, others): (Vec<SocketAddr>, Vec<SocketAddr>) = forward
                .upstreams
                .iter()
                .partition(|u| forward::is_own(**u, &own));
            if !mine.is_empty() {
                tracing::warn!(
                    upstreams = ?mine,
                    "DNS upstreams that are the agent itself are left out"
                );
            }
            return others;
        }
        let Some(path) = &forward.resolv_conf else {
            return Vec::new();
        };
        match upstreams_from_resolv_conf(path, &own) {
            Ok(found) => found,
            Err(error) => {
                tracing::warn!(%error, "no DNS upstreams: names outside the zone are refused");
                Vec::new()
            }
        }
    }
}

/// A listen address the server could not bind.
#[derive(Debug, thiserror::Error)]
#[error("bind {protocol} {addr}")]
pub struct BindError {
    /// The address.
    pub addr: SocketAddr,
    /// `udp` or `tcp`.
    pub protocol: &'static str,
    /// The OS's reason.
    #[source]
    pub source: std::io::Error,
}

/// Binds UDP and TCP on each address; returns the sockets and the failures.
async fn bind_all(
    addrs: &[SocketAddr],
) -> (Vec<(UdpSocket, TcpListener, SocketAddr)>, Vec<BindError>) {
    let mut bound = Vec::new();
    let mut failed = Vec::new();
    for &addr in addrs {
        // Port 0: the UDP socket's port is taken for TCP too, and may be in use for
        // TCP already; a few fresh ports are tried before giving up.
        let tries = if addr.port() == 0 { PORT_ZERO_TRIES } else { 1 };
        for attempt in 1..=tries {
            let udp = match UdpSocket::bind(addr).await {
                Ok(s) => s,
                Err(source) => {
                    failed.push(BindError {
                        addr,
                        protocol: "udp",
                        source,
                    });
                    break;
                }
            };
            let local = udp.local_addr().unwrap_or(addr);
            match TcpListener::bind(local).await {
                Ok(tcp) => {
                    bound.push((udp, tcp, local));
                    break;
                }
                Err(source)
                    if attempt < tries && source.kind() == std::io::ErrorKind::AddrInUse => {}
                Err(source) => {
                    failed.push(BindError {
                        addr: local,
                        protocol: "tcp",
                        source,
                    });
                    break;
                }
            }
        }
    }
    (bound, failed)
}

#[async_trait::async_trait]
impl Subsystem for DnsServer {
    fn name(&self) -> &str {
        "dns"
    }

    async fn start(&self, ctx: &StartContext) -> Result<(), SubsystemError> {
        let (bound, failed) = bind_all(&self.config.addrs).await;
        if !failed.is_empty() {
            if ctx.mode == Mode::Production {
                // Nothing half-serves in production: the agent's start fails with the
                // first address that could not be bound and the OS's reason.
                if let Some(error) = failed.into_iter().next() {
                    return Err(SubsystemError::io(error.to_string(), error.source));
                }
                return Ok(());
            }
            let reason = failed
                .iter()
                .map(|e| format!("{e}: {}", e.source))
                .collect::<Vec<_>>()
                .join("; ");
            if bound.is_empty() {
                tracing::warn!(%reason, "dev mode: DNS is off; continuing without it");
                lock(&self.acker).take();
                *lock(&self.state) = DnsState::Disabled { reason };
                self.serving.set_ready();
                return Ok(());
            }
            tracing::warn!(%reason, "dev mode: DNS serves on the other addresses only");
        }
        let addrs: Vec<SocketAddr> = bound.iter().map(|(_, _, a)| *a).collect();
        let upstreams = self.upstreams(&addrs);
        let forwarder = (!upstreams.is_empty()).then(|| {
            Forwarder::new(
                upstreams.clone(),
                self.config.forward.timeout,
                self.config.forward.cache_size,
                self.metrics.clone(),
            )
        });

        let handler = Arc::new(Handler {
            zone: self.zone.clone(),
            metrics: self.metrics.clone(),
            forwarder,
        });
        let mut server = Server::new(SharedHandler(handler.clone()));
        for (udp, tcp, addr) in bound {
            let udp = match udp.into_std() {
                Ok(udp) => udp,
                Err(error) => {
                    return Err(SubsystemError::io(format!("DNS UDP socket {addr}"), error));
                }
            };
            let (handler, cancel) = (handler.clone(), ctx.cancel.clone());
            let runtime = tokio::runtime::Handle::current();
            self.tasks
                .spawn_blocking(move || udp::serve(udp, handler, cancel, runtime));
            server.register_listener(tcp, TCP_TIMEOUT, TCP_RESPONSE_BUFFER);
        }
        let cancel = ctx.cancel.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                () = cancel.cancelled() => {
                    if let Err(error) = server.shutdown_gracefully().await {
                        tracing::warn!(%error, "DNS server shut down with an error");
                    }
                }
                result = server.block_until_done() => {
                    if let Err(error) = result {
                        tracing::error!(%error, "DNS server stopped");
                    }
                }
            }
        });
        self.tasks.spawn(follow(
            self.cache.clone(),
            self.config.zone.clone(),
            self.zone.clone(),
            self.serving.clone(),
            lock(&self.acker).take(),
            ctx.cancel.clone(),
        ));
        tracing::info!(
            addrs = ?addrs,
            upstreams = ?upstreams,
            domain = %self.config.zone.domain,
            "DNS serving"
        );
        *lock(&self.state) = DnsState::Serving { addrs, upstreams };
        Ok(())
    }

    fn ready(&self) -> Readiness {
        self.readiness.clone()
    }

    async fn stop(&self) -> Result<(), SubsystemError> {
        self.tasks.close();
        self.tasks.wait().await;
        let mut state = lock(&self.state);
        if matches!(*state, DnsState::Serving { .. }) {
            *state = DnsState::Off;
        }
        Ok(())
    }
}

/// Applies every cache delta to the zone and swaps the new version in; ready after
/// the first.
async fn follow(
    cache: Arc<EndpointCache>,
    config: ZoneConfig,
    zone: Arc<ArcSwap<Zone>>,
    ready: ReadySetter,
    acker: Option<Acker>,
    cancel: CancellationToken,
) {
    let mut writer = match ZoneWriter::new(&config) {
        Ok(w) => w,
        // The domain was checked when the server was made; this cannot happen.
        Err(error) => {
            tracing::error!(%error, "DNS zone not kept");
            return;
        }
    };
    let mut sub = cache.subscribe();
    // Services changed since the heap was last trimmed.
    let mut changed_since_trim = 0usize;
    loop {
        let delta = tokio::select! {
            () = cancel.cancelled() => return,
            d = sub.next() => d,
            // A large change (a snapshot, a bulk apply) frees the previous shards,
            // and the rest of the agent frees its own garbage of the same change:
            // once deltas pause, give those pages back rather than keep them.
            () = tokio::time::sleep(TRIM_WHEN_QUIET), if changed_since_trim > TRIM_AFTER_CHANGES => {
                changed_since_trim = 0;
                crate::heap::trim();
                continue;
            }
        };
        let revision = delta.revision;
        if delta.only_revision() {
            // The zone is right at this revision already.
            if let Some(a) = &acker {
                a.ack(revision);
            }
            continue;
        }
        // A bulk change may come as several deltas: they add up.
        changed_since_trim += delta.upserted.len() + delta.removed.len() + usize::from(delta.full);
        writer.apply(delta);
        // The SOA serial is 32 bits; the revision wraps into it.
        zone.store(Arc::new(writer.publish(revision as u32)));
        ready.set_ready();
        if let Some(a) = &acker {
            a.ack(revision);
        }
        tracing::debug!(revision, services = writer.services(), "DNS zone updated");
    }
}

/// How long deltas must pause before freed memory is returned after a large one.
const TRIM_WHEN_QUIET: Duration = Duration::from_millis(200);

/// Changes to more services than this (in one delta or several close together)
/// return freed memory to the system once deltas pause.
const TRIM_AFTER_CHANGES: usize = 1000;

/// The handler hickory-server's TCP listeners call (the UDP loop shares it).
struct SharedHandler(Arc<Handler>);

#[async_trait::async_trait]
impl RequestHandler for SharedHandler {
    async fn handle_request<R: ResponseHandler, T: Time>(
        &self,
        request: &Request,
        response_handle: R,
    ) -> ResponseInfo {
        self.0
            .handle_request::<R, T>(request, response_handle)
            .await
    }
}

/// Answers queries from the current zone, and forwards the rest.
struct Handler {
    zone: Arc<ArcSwap<Zone>>,
    metrics: Arc<Metrics>,
    forwarder: Option<Forwarder>,
}

/// The `rcode` label of a response code.
fn rcode_label(rcode: ResponseCode) -> &'static str {
    match rcode {
        ResponseCode::NoError => "NOERROR",
        ResponseCode::FormErr => "FORMERR",
        ResponseCode::ServFail => "SERVFAIL",
        ResponseCode::NXDomain => "NXDOMAIN",
        ResponseCode::NotImp => "NOTIMP",
        ResponseCode::Refused => "REFUSED",
        _ => "OTHER",
    }
}

/// The `zone` label of an answer.
fn zone_label(authority: Authority) -> &'static str {
    match authority {
        Authority::Zone => "rune",
        Authority::Other => "other",
    }
}

impl Handler {
    fn count(&self, qtype: Option<RecordType>, rcode: ResponseCode, authority: Authority) {
        self.metrics
            .dns_queries
            .get_or_create(&DnsQueryLabels {
                r#type: qtype.map_or("NONE", <&'static str>::from),
                rcode: rcode_label(rcode),
                zone: zone_label(authority),
            })
            .inc();
    }
}

#[async_trait::async_trait]
impl RequestHandler for Handler {
    async fn handle_request<R: ResponseHandler, T: Time>(
        &self,
        request: &Request,
        mut response_handle: R,
    ) -> ResponseInfo {
        let started = std::time::Instant::now();
        let request_edns = request.edns.as_ref();
        let response_edns = request_edns.map(|e| {
            let mut edns = Edns::new();
            edns.set_max_payload(e.max_payload().max(512));
            edns
        });
        let builder = MessageResponseBuilder::new(&request.queries, response_edns.as_ref());
        let mut metadata = Metadata::response_from_request(&request.metadata);
        // Every answer says whether this server recurses for other names.
        metadata.recursion_available = self.forwarder.is_some();

        let query = match request.request_info() {
            Ok(info) if request.metadata.op_code == OpCode::Query => Some(info.query),
            _ => None,
        };
        let zone = self.zone.load_full();
        let sent = match query {
            Some(q) => {
                let qtype = q.query_type();
                let mut answer = zone.lookup(q.name(), qtype);
                let zone_kind = answer.authority_kind;
                // The zone holds IN records only: other classes (CH, HS) in it are
                // refused rather than answered with IN data.
                if answer.authority_kind != Authority::Other && q.query_class() != DNSClass::IN {
                    answer = Answer {
                        rcode: ResponseCode::Refused,
                        authoritative: false,
                        answers: Vec::new(),
                        authority: Vec::new(),
                        authority_kind: Authority::Zone,
                    };
                }
                if answer.authority_kind == Authority::Other
                    && let Some(forwarder) = &self.forwarder
                {
                    let forwarded = forwarder.resolve(q.original()).await;
                    metadata.recursion_available = true;
                    metadata.authoritative = false;
                    let sent = match forwarded {
                        Ok(reply) => {
                            metadata.response_code = reply.rcode;
                            self.count(Some(qtype), reply.rcode, Authority::Other);
                            let response = builder.build(
                                metadata,
                                reply.answers.iter(),
                                reply.authorities.iter(),
                                std::iter::empty(),
                                reply.additionals.iter(),
                            );
                            self.observe(started, Authority::Other);
                            response_handle.send_response(response).await
                        }
                        Err(error) => {
                            tracing::debug!(%error, name = %q.name(), "DNS forward failed");
                            metadata.response_code = ResponseCode::ServFail;
                            self.count(Some(qtype), ResponseCode::ServFail, Authority::Other);
                            let response = builder.build_no_records(metadata);
                            self.observe(started, Authority::Other);
                            response_handle.send_response(response).await
                        }
                    };
                    return self.finish(sent, request);
                }
                metadata.response_code = answer.rcode;
                metadata.authoritative = answer.authoritative;
                self.count(Some(qtype), answer.rcode, answer.authority_kind);
                let response = builder.build(
                    metadata,
                    answer.answers.iter(),
                    answer.authority.iter(),
                    std::iter::empty(),
                    std::iter::empty(),
                );
                self.observe(started, zone_kind);
                response_handle.send_response(response).await
            }
            None => {
                metadata.response_code = if request.metadata.op_code == OpCode::Query {
                    ResponseCode::FormErr
                } else {
                    ResponseCode::NotImp
                };
                self.count(None, metadata.response_code, Authority::Other);
                let response = builder.build_no_records(metadata);
                self.observe(started, Authority::Other);
                response_handle.send_response(response).await
            }
        };
        self.finish(sent, request)
    }
}

impl Handler {
    /// Records the time since `started` in the latency histogram: before the
    /// response is sent, so that a client that has its answer sees it counted.
    fn observe(&self, started: std::time::Instant, authority: Authority) {
        self.metrics
            .dns_query_duration
            .get_or_create(&DnsZoneLabels {
                zone: zone_label(authority),
            })
            .observe(started.elapsed().as_secs_f64());
    }

    /// What hickory-server is told about a response: sent, or SERVFAIL when sending
    /// failed.
    fn finish(
        &self,
        sent: Result<ResponseInfo, hickory_server::net::NetError>,
        request: &Request,
    ) -> ResponseInfo {
        match sent {
            Ok(info) => info,
            Err(error) => {
                tracing::debug!(%error, "DNS response not sent");
                let mut failed = Metadata::new(
                    request.metadata.id,
                    MessageType::Response,
                    request.metadata.op_code,
                );
                failed.response_code = ResponseCode::ServFail;
                ResponseInfo::from(Header {
                    metadata: failed,
                    counts: HeaderCounts::default(),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests;
