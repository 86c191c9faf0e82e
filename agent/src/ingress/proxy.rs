//! One request through the ingress proxy: route, allow-list, redirect, upstream
//! choice, the forwarded request, and the proxy's own short answers.

use super::{
    metrics::{IngressMetrics, ReasonLabels, RequestLabels},
    routes::{Backend, Route, RouteTable, path_is_normal, request_host},
    upgrade,
};
use arc_swap::ArcSwap;

use http_body_util::{BodyExt, Empty, Full, combinators::UnsyncBoxBody};
use hyper::{
    HeaderMap, Method, Request, Response, StatusCode, Uri,
    body::{Body, Bytes, Incoming},
    header::{self, HeaderName, HeaderValue},
};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use ipnet::IpNet;
use std::{
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

/// The body type both ways: a client's or upstream's stream, or the proxy's own text.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// Any body error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The limits and timeouts a request is held to.
#[derive(Clone, Debug)]
pub struct ProxyLimits {
    /// Time to connect to an endpoint.
    pub connect_timeout: Duration,
    /// Time for an endpoint's response headers, else 504.
    pub response_timeout: Duration,
    /// Largest request body by Content-Length, else 413.
    pub max_body_bytes: u64,
    /// Peers whose X-Forwarded-For is appended to instead of replaced.
    pub trusted_proxies: Vec<IpNet>,
    /// The TLS listener's port, for redirects (omitted from the URL when 443).
    pub tls_port: u16,
}

/// What every connection's requests share.
pub struct Proxy {
    /// The current routes (swapped by the route watcher).
    pub routes: ArcSwap<RouteTable>,
    client: Client<HttpConnector, ProxyBody>,
    limits: ProxyLimits,
    metrics: IngressMetrics,
    /// Rotates the starting point of the least-outstanding choice.
    turn: AtomicUsize,
}

/// Hop-by-hop headers: never forwarded either way.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

impl Proxy {
    /// A proxy with no routes yet.
    pub fn new(limits: ProxyLimits, metrics: IngressMetrics) -> Proxy {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(limits.connect_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        Proxy {
            routes: ArcSwap::default(),
            client,
            limits,
            metrics,
            turn: AtomicUsize::new(0),
        }
    }

    /// Answers one request from `peer`, received over TLS when `tls`.
    pub async fn handle(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
        tls: bool,
    ) -> Response<ProxyBody> {
        let start = Instant::now();
        let routes = self.routes.load();
        let host = request_host(
            req.uri().authority().map(|a| a.as_str()),
            req.headers()
                .get(header::HOST)
                .map(|h| h.to_str().unwrap_or("\u{0}")),
        );
        let (route, response) = match host {
            None => (
                None,
                answer(
                    StatusCode::BAD_REQUEST,
                    "the Host header names another host than the request target\n",
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
                let route = routes.lookup(&host, req.uri().path()).cloned();
                let response = match &route {
                    None => answer(StatusCode::NOT_FOUND, "no route\n"),
                    Some(route) => self.for_route(req, route, &host, peer, tls).await,
                };
                (route, response)
            }
        };
        let (route_host, service) = route
            .as_ref()
            .map(|r| (r.host.clone(), r.service.clone()))
            .unwrap_or_default();
        self.metrics
            .requests
            .get_or_create(&RequestLabels {
                host: route_host,
                service,
                code: response.status().as_u16(),
            })
            .inc();
        self.metrics.duration.observe(start.elapsed().as_secs_f64());
        response
    }

    async fn for_route(
        &self,
        mut req: Request<Incoming>,
        route: &Route,
        host: &str,
        peer: SocketAddr,
        tls: bool,
    ) -> Response<ProxyBody> {
        if !route.allows(peer.ip()) {
            return answer(StatusCode::FORBIDDEN, "forbidden\n");
        }
        if route.tls && !tls {
            return self.redirect(req.uri(), host);
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
        let retryable = is_idempotent(&parts.method) && body.is_end_stream();
        let mut headers = forwarded_headers(&parts.headers, host, peer, tls, &self.limits);
        if let Some(value) = upgrade {
            upgrade::keep_headers(&mut headers, value);
        }
        let build = |backend: &Backend, body: ProxyBody| {
            let mut up = Request::new(body);
            *up.method_mut() = parts.method.clone();
            *up.uri_mut() = upstream_uri(backend.addr, &parts.uri);
            *up.headers_mut() = headers.clone();
            up
        };
        let mut result = self.send(
            &first,
            build(&first, body.map_err(Into::into).boxed_unsync()),
        );
        let mut response = result.await;
        if let Err(Failure::Connect) = response
            && retryable
            && let Some(second) = route.pick(turn, Some(&first))
        {
            result = self.send(&second, build(&second, empty()));
            response = result.await;
        }
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
                Response::from_parts(parts, body.map_err(Into::into).boxed_unsync())
            }
            Err(Failure::Timeout) => answer(StatusCode::GATEWAY_TIMEOUT, "upstream timeout\n"),
            Err(Failure::Connect | Failure::Protocol) => {
                answer(StatusCode::BAD_GATEWAY, "upstream error\n")
            }
        }
    }

    /// Sends one request to `backend`, counting it in flight until its response
    /// headers come (or it fails).
    fn send(
        &self,
        backend: &Arc<Backend>,
        req: Request<ProxyBody>,
    ) -> impl Future<Output = Result<Response<Incoming>, Failure>> + Send + 'static {
        let backend = backend.clone();
        let fut = self.client.request(req);
        let timeout = self.limits.response_timeout;
        let errors = self.metrics.upstream_errors.clone();
        async move {
            backend.outstanding.fetch_add(1, Ordering::Relaxed);
            let r = tokio::time::timeout(timeout, fut).await;
            backend.outstanding.fetch_sub(1, Ordering::Relaxed);
            let failure = match r {
                Ok(Ok(resp)) => return Ok(resp),
                Ok(Err(e)) if e.is_connect() => Failure::Connect,
                Ok(Err(_)) => Failure::Protocol,
                Err(_) => Failure::Timeout,
            };
            let reason = match failure {
                Failure::Connect => "connect",
                Failure::Timeout => "timeout",
                Failure::Protocol => "protocol",
            };
            errors.get_or_create(&ReasonLabels { reason }).inc();
            tracing::debug!(backend = %backend.addr, reason, "ingress: upstream failed");
            Err(failure)
        }
    }

    /// 308 to the same URL over HTTPS.
    fn redirect(&self, uri: &Uri, host: &str) -> Response<ProxyBody> {
        let port = match self.limits.tls_port {
            443 => String::new(),
            p => format!(":{p}"),
        };
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        let location = format!("https://{host}{port}{path}");
        let mut resp = answer(StatusCode::PERMANENT_REDIRECT, "moved to https\n");
        if let Ok(v) = HeaderValue::from_str(&location) {
            resp.headers_mut().insert(header::LOCATION, v);
        }
        resp
    }
}

/// Why an upstream exchange failed.
enum Failure {
    /// No connection could be made (nothing was sent).
    Connect,
    /// No response headers within the response timeout.
    Timeout,
    /// The connection broke or the response was not HTTP.
    Protocol,
}

fn is_idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

/// `http://ADDR/path?query`.
fn upstream_uri(addr: SocketAddr, uri: &Uri) -> Uri {
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    format!("http://{addr}{path}").parse().unwrap_or_default()
}

/// The client's headers without hop-by-hop ones, with `Host` kept (set from an h2
/// authority) and `X-Forwarded-For/-Proto/-Host` and `Forwarded` set.
fn forwarded_headers(
    from: &HeaderMap,
    host: &str,
    peer: SocketAddr,
    tls: bool,
    limits: &ProxyLimits,
) -> HeaderMap {
    let mut headers = from.clone();
    strip_hop_by_hop(&mut headers);
    let client = match peer.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer.ip(), IpAddr::V4),
        ip => ip,
    };
    let trusted = limits.trusted_proxies.iter().any(|n| n.contains(&client));
    let xff = match from.get("x-forwarded-for").and_then(|v| v.to_str().ok()) {
        Some(prior) if trusted => format!("{prior}, {client}"),
        _ => client.to_string(),
    };
    let original_host = from
        .get(header::HOST)
        .cloned()
        .or_else(|| HeaderValue::from_str(host).ok());
    if let Some(h) = &original_host {
        headers.insert(header::HOST, h.clone());
        headers.insert("x-forwarded-host", h.clone());
    }
    if let Ok(v) = HeaderValue::from_str(&xff) {
        headers.insert("x-forwarded-for", v);
    }
    let proto = if tls { "https" } else { "http" };
    headers.insert("x-forwarded-proto", HeaderValue::from_static(proto));
    // RFC 7239: the same facts in one header, replaced or (trusted peer) appended.
    let node = match client {
        IpAddr::V6(v6) => format!("\"[{v6}]\""),
        v4 => v4.to_string(),
    };
    let shown_host = original_host
        .as_ref()
        .and_then(|h| h.to_str().ok())
        .unwrap_or(host)
        .replace(['"', '\\'], "");
    let mut forwarded = format!("for={node};proto={proto};host=\"{shown_host}\"");
    if let Some(prior) = from.get(header::FORWARDED).and_then(|v| v.to_str().ok())
        && trusted
    {
        forwarded = format!("{prior}, {forwarded}");
    }
    if let Ok(v) = HeaderValue::from_str(&forwarded) {
        headers.insert(header::FORWARDED, v);
    }
    headers
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Headers the Connection header names are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for h in HOP_BY_HOP.iter().chain(&named) {
        headers.remove(h);
    }
}

fn empty() -> ProxyBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// The proxy's own answer: a status and a short plain-text body.
pub fn answer(status: StatusCode, text: &'static str) -> Response<ProxyBody> {
    let mut resp = Response::new(
        Full::new(Bytes::from_static(text.as_bytes()))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}
