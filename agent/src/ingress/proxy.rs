//! One request through the ingress proxy: route, allow-list, redirect, upstream
//! choice and the forwarded request.

use super::{
    access_log::{self, AccessLog},
    acme::Challenges,
    answers::{acme_answer, answer, empty, redirect},
    body_limit,
    client_cert::{self, TlsSession},
    headers::{forwarded_headers, keep_te_trailers, strip_hop_by_hop},
    metrics::{IngressMetrics, ReasonLabels, RequestLabels},
    routes::{Backend, Route, RouteTable, path_is_normal, request_host},
    upgrade,
    upstream::{
        Failure, Http1Pool, Origins, h2c_client, is_idempotent, path_and_query, upstream_uri,
    },
};
use arc_swap::ArcSwap;
use futures::future::Either;
use http_body_util::BodyExt;
use hyper::{
    Request, Response, StatusCode, Uri,
    body::{Body, Incoming},
    header,
};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use ipnet::IpNet;
use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use super::body::ProxyBody;

/// The limits and timeouts a request is held to.
#[derive(Clone, Debug)]
pub struct ProxyLimits {
    /// Time to connect to an endpoint.
    pub connect_timeout: Duration,
    /// Time for an endpoint's response headers, else 504; and then for each
    /// piece of an HTTP/1.1 response body, else the response is cut.
    pub response_timeout: Duration,
    /// Largest request body, else 413: by Content-Length before anything is sent,
    /// else counted as it streams.
    pub max_body_bytes: u64,
    /// Peers whose X-Forwarded-For is appended to instead of replaced.
    pub trusted_proxies: Vec<IpNet>,
    /// The TLS listener's port, for redirects (omitted from the URL when 443).
    pub tls_port: u16,
    /// The share of requests written to the access log, 0 to 1.
    pub access_log_sample: f64,
}

/// The endpoint that answered a request (a response extension, for the access log).
#[derive(Clone, Copy, Debug)]
struct Upstream(SocketAddr);

/// What every connection's requests share: one per worker thread, with its own
/// upstream clients (so upstream connections stay on the worker that uses them)
/// and the routes, access-log sampling and ACME tokens of all workers.
pub struct Proxy {
    /// The current routes (swapped by the route watcher).
    pub routes: Arc<ArcSwap<RouteTable>>,
    /// HTTP/1.1 to endpoints, pooled (this worker's connections).
    http1: Arc<Http1Pool>,
    /// The fast path's raw HTTP/1.1 connections to endpoints (this worker's).
    pub(super) origins: Origins,
    /// HTTP/2 with prior knowledge (h2c) to endpoints of routes whose port says so,
    /// one multiplexed connection per endpoint.
    h2c_client: Client<HttpConnector, ProxyBody>,
    pub(super) limits: ProxyLimits,
    pub(super) metrics: IngressMetrics,
    pub(super) access_log: Arc<AccessLog>,
    /// Rotates the starting point of the least-outstanding choice.
    pub(super) turn: AtomicUsize,
    /// Pending ACME HTTP-01 tokens, answered on the plain listener before routing.
    pub challenges: Arc<Challenges>,
}

impl Proxy {
    /// A proxy with no routes yet.
    pub fn new(limits: ProxyLimits, metrics: IngressMetrics) -> Proxy {
        Proxy {
            routes: Arc::default(),
            http1: Arc::new(Http1Pool::new(
                limits.connect_timeout,
                limits.response_timeout,
            )),
            origins: Origins::new(limits.connect_timeout),
            h2c_client: h2c_client(limits.connect_timeout),
            access_log: Arc::new(AccessLog::new(limits.access_log_sample)),
            limits,
            metrics,
            turn: AtomicUsize::new(0),
            challenges: Arc::default(),
        }
    }

    /// A proxy for another worker thread: the same routes, access-log sampling
    /// and ACME tokens, its own upstream clients.
    pub fn for_worker(&self) -> Proxy {
        Proxy {
            routes: self.routes.clone(),
            http1: Arc::new(Http1Pool::new(
                self.limits.connect_timeout,
                self.limits.response_timeout,
            )),
            origins: Origins::new(self.limits.connect_timeout),
            h2c_client: h2c_client(self.limits.connect_timeout),
            access_log: self.access_log.clone(),
            limits: self.limits.clone(),
            metrics: self.metrics.clone(),
            turn: AtomicUsize::new(0),
            challenges: self.challenges.clone(),
        }
    }

    /// Closes this worker's upstream connections idle too long (or closed by their
    /// endpoint).
    pub fn sweep_idle(&self) {
        self.http1.sweep();
        self.origins.sweep();
    }

    /// Counts a request answered with `code` (on `route`, if it had one) whose
    /// response head took `duration`.
    pub(super) fn count(&self, route: Option<&Route>, code: u16, duration: Duration) {
        if let Some(r) = route {
            r.requests
                .inc(&self.metrics.requests, &r.host, &r.service, code);
        } else {
            let labels = RequestLabels {
                host: String::new(),
                service: String::new(),
                code,
            };
            self.metrics.requests.get_or_create(&labels).inc();
        }
        self.metrics.duration.observe(duration.as_secs_f64());
    }

    /// Counts an upstream failure of the endpoint at `addr`.
    pub(super) fn upstream_failed(&self, addr: SocketAddr, failure: &Failure) {
        upstream_failed(&self.metrics, addr, failure);
    }

    /// Answers one request from `peer`, received over TLS when `tls` (the
    /// connection's handshake) is given.
    pub async fn handle(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
        tls: Option<&TlsSession>,
    ) -> Response<ProxyBody> {
        if tls.is_none()
            && let Some(key_authorization) = self.challenges.answer(req.uri().path())
        {
            return acme_answer(key_authorization);
        }
        let start = Instant::now();
        let logged = self.access_log.wanted().then(|| {
            (
                req.method().clone(),
                req.uri().path().to_owned(),
                req.version(),
            )
        });
        let routes = self.routes.load();
        let authority = req.uri().authority().map(|a| a.as_str());
        let mut hosts = req.headers().get_all(header::HOST).iter();
        let host = match (hosts.next(), hosts.next()) {
            // RFC 9112 §3.2: one Host, and an HTTP/1.1 request without one is refused.
            (_, Some(_)) => None,
            (None, None) if authority.is_none() && req.version() == hyper::Version::HTTP_11 => None,
            (first, None) => request_host(authority, first.map(|h| h.to_str().unwrap_or("\u{0}"))),
        };
        let (route, response) = match &host {
            None => (
                None,
                answer(
                    StatusCode::BAD_REQUEST,
                    "the Host header is missing, repeated, or names another host than the request target\n",
                ),
            ),
            Some(_) if !path_is_normal(req.uri().path()) => (
                None,
                answer(
                    StatusCode::BAD_REQUEST,
                    "the path has an empty or dot segment or an encoded unreserved character\n",
                ),
            ),
            Some(host) => {
                let route = routes.lookup(host, req.uri().path()).cloned();
                let response = match &route {
                    None => answer(StatusCode::NOT_FOUND, "no route\n"),
                    Some(route) => self.for_route(req, route, host, peer, tls).await,
                };
                (route, response)
            }
        };
        let duration = start.elapsed();
        self.count(route.as_deref(), response.status().as_u16(), duration);
        if let Some((method, path, version)) = logged {
            AccessLog::record(&access_log::Entry {
                client: peer,
                method: method.as_str(),
                host: host.as_deref().unwrap_or_default(),
                path: &path,
                version: access_log::version_name(version),
                tls: tls.is_some(),
                status: response.status().as_u16(),
                service: route.as_ref().map_or("", |r| r.service.as_str()),
                upstream: response.extensions().get::<Upstream>().map(|u| u.0),
                duration,
            });
        }
        response
    }

    async fn for_route(
        &self,
        mut req: Request<Incoming>,
        route: &Route,
        host: &str,
        peer: SocketAddr,
        session: Option<&TlsSession>,
    ) -> Response<ProxyBody> {
        if !route.allows(peer.ip()) {
            return answer(StatusCode::FORBIDDEN, "forbidden\n");
        }
        if let Some(ca) = &route.client_ca
            && let Err((status, text)) = client_cert::check(ca, session, host)
        {
            return answer(status, text);
        }
        let tls = session.is_some();
        if route.tls && !tls {
            return redirect(req.uri(), host, self.limits.tls_port);
        }
        if !route.tls && tls {
            // The certificate was chosen for another host than this request's.
            return answer(StatusCode::MISDIRECTED_REQUEST, "misdirected request\n");
        }
        let too_long = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .is_some_and(|n| n > self.limits.max_body_bytes);
        if too_long {
            return answer(StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n");
        }
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let Some(first) = route.pick(turn, None) else {
            return answer(StatusCode::SERVICE_UNAVAILABLE, "no ready endpoint\n");
        };
        let upgrade = upgrade::requested(req.headers());
        let client_upgrade = upgrade.is_some().then(|| hyper::upgrade::on(&mut req));
        let (parts, body) = req.into_parts();
        // A connect failure is retried once on another endpoint when resending is
        // safe: an idempotent method and no body to replay.
        let retryable = is_idempotent(parts.method.as_str()) && body.is_end_stream();
        // Built again for a retry rather than copied for every request.
        let forwarded = || {
            let mut headers = forwarded_headers(
                &parts.headers,
                host,
                peer,
                tls,
                &self.limits.trusted_proxies,
            );
            if route.h2c {
                // HTTP/2 has no Upgrade; gRPC needs `TE: trailers` to reach the server.
                keep_te_trailers(&parts.headers, &mut headers);
            } else if let Some(value) = &upgrade {
                upgrade::keep_headers(&mut headers, value.clone());
            }
            headers
        };
        let build = |backend: &Backend, body: ProxyBody| {
            let mut up = Request::new(body);
            *up.method_mut() = parts.method.clone();
            // HTTP/1.1 in origin form (the Host header names the host); the h2c
            // client wants the endpoint's address in the URI.
            *up.uri_mut() = if route.h2c {
                upstream_uri(backend, &parts.uri)
            } else {
                Uri::from(path_and_query(&parts.uri))
            };
            *up.headers_mut() = forwarded();
            if route.h2c {
                *up.version_mut() = hyper::Version::HTTP_2;
            }
            up
        };
        let (body, tripped) = body_limit::limited(body, self.limits.max_body_bytes);
        let mut result = self.send(&first, route.h2c, build(&first, body.boxed_unsync()));
        let mut response = result.await;
        let mut upstream = first.addr;
        if let Err(Failure::Connect) = response
            && retryable
            && let Some(second) = route.pick(turn, Some(&first))
        {
            result = self.send(&second, route.h2c, build(&second, empty()));
            response = result.await;
            upstream = second.addr;
        }
        let mut response = match response {
            // The body went past the limit while it streamed: the client's doing.
            Err(Failure::Protocol) if tripped.is_set() => {
                answer(StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n")
            }
            response => self.relay(response, client_upgrade),
        };
        response.extensions_mut().insert(Upstream(upstream));
        response
    }

    /// The client's response from the endpoint's (or the failure's answer),
    /// splicing the connections when the endpoint switched protocols.
    fn relay(
        &self,
        response: Result<Response<ProxyBody>, Failure>,
        client_upgrade: Option<hyper::upgrade::OnUpgrade>,
    ) -> Response<ProxyBody> {
        match response {
            Ok(mut resp) => {
                let switched = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
                let protocol = resp.headers().get(header::UPGRADE).cloned();
                let upstream_upgrade = switched.then(|| hyper::upgrade::on(&mut resp));
                let (mut parts, body) = resp.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                if switched {
                    // A switch the client did not ask for cannot be carried.
                    let (Some(client), Some(upstream), Some(protocol)) =
                        (client_upgrade, upstream_upgrade, protocol)
                    else {
                        return answer(StatusCode::BAD_GATEWAY, "upstream error\n");
                    };
                    upgrade::keep_headers(&mut parts.headers, protocol);
                    tokio::spawn(upgrade::splice(client, upstream));
                }
                Response::from_parts(parts, body)
            }
            Err(failure) => {
                let (status, text) = failure.answer();
                answer(status, text)
            }
        }
    }

    /// Sends one request to `backend` (over h2c when `h2c`), counting it in flight
    /// until its response headers come (or it fails).
    fn send(
        &self,
        backend: &Arc<Backend>,
        h2c: bool,
        req: Request<ProxyBody>,
    ) -> impl Future<Output = Result<Response<ProxyBody>, Failure>> + Send + 'static {
        let backend = backend.clone();
        let fut = if h2c {
            let fut = self.h2c_client.request(req);
            Either::Left(async move {
                match fut.await {
                    Ok(resp) => Ok(resp.map(|b| b.map_err(Into::into).boxed_unsync())),
                    Err(e) if e.is_connect() => Err(Failure::Connect),
                    Err(_) => Err(Failure::Protocol),
                }
            })
        } else {
            let (pool, addr) = (self.http1.clone(), backend.addr);
            Either::Right(async move { pool.send(addr, req).await })
        };
        let timeout = self.limits.response_timeout;
        let metrics = self.metrics.clone();
        async move {
            let in_flight = backend.in_flight();
            let r = tokio::time::timeout(timeout, fut).await;
            drop(in_flight);
            let failure = match r {
                Ok(Ok(resp)) => return Ok(resp),
                Ok(Err(failure)) => failure,
                Err(_) => Failure::Timeout,
            };
            upstream_failed(&metrics, backend.addr, &failure);
            Err(failure)
        }
    }
}

/// Counts an upstream failure of the endpoint at `addr` in `metrics`.
fn upstream_failed(metrics: &IngressMetrics, addr: SocketAddr, failure: &Failure) {
    let reason = failure.reason();
    metrics
        .upstream_errors
        .get_or_create(&ReasonLabels { reason })
        .inc();
    tracing::debug!(backend = %addr, reason, "ingress: upstream failed");
}
