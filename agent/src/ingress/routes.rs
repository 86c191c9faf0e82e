//! The ingress routing table, rebuilt from the endpoint cache on every change: host
//! (exact beats wildcard) then the longest path prefix on segment boundaries.

use super::{client_cert::ClientCa, metrics::CodeCounters};
use crate::{
    endpoints::ServiceView,
    model::{Expose, Secret, ServiceKey},
};
use hyper::http::uri::Authority;
use ipnet::IpNet;
use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

/// One upstream endpoint of a route, with its requests in flight.
#[derive(Debug)]
pub struct Backend {
    /// Where requests go: the endpoint's address and its port for the exposed port.
    pub addr: SocketAddr,
    /// Requests sent and not yet answered (least-outstanding balancing).
    pub outstanding: AtomicUsize,
    /// `addr` as a URI authority, formatted once rather than per request.
    pub authority: Authority,
}

impl Backend {
    /// The endpoint at `addr`, with nothing in flight.
    pub fn new(addr: SocketAddr) -> Backend {
        Backend {
            addr,
            outstanding: AtomicUsize::new(0),
            // A socket address always formats as a valid authority.
            authority: Authority::try_from(addr.to_string())
                .unwrap_or_else(|_| Authority::from_static("invalid")),
        }
    }
}

/// A request in flight to a [`Backend`], counted until dropped (also when the
/// request's future is dropped midway).
pub struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Backend {
    /// Counts a request in flight to it until the guard drops.
    pub fn in_flight(&self) -> InFlight<'_> {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        InFlight(&self.outstanding)
    }
}

/// One exposed service.
#[derive(Debug)]
pub struct Route {
    /// `namespace/name` of the service (metrics, logs).
    pub service: String,
    /// The host as exposed (`*.example.com` for a wildcard).
    pub host: String,
    /// The path prefix.
    pub path: String,
    /// The route has TLS: plain HTTP is redirected to HTTPS.
    pub tls: bool,
    /// Where its certificate comes from (`secret NS/NAME` or `acme`), for status.
    pub tls_from: Option<String>,
    /// Networks served; `None`: every client. An empty list refuses everyone (a list
    /// that could not be used: fail closed).
    pub allow: Option<Vec<IpNet>>,
    /// The CA that must verify the client's certificate chain on every request;
    /// `None`: no client certificate needed.
    pub client_ca: Option<ClientCa>,
    /// The endpoints speak HTTP/2 without TLS (h2c with prior knowledge, as gRPC
    /// servers do): the exposed port is named so ([`speaks_h2c`]).
    pub h2c: bool,
    /// Ready, non-terminating endpoints.
    pub backends: Vec<Arc<Backend>>,
    /// `rune_ingress_requests_total` of this route, by status code.
    pub requests: CodeCounters,
}

impl Route {
    /// Whether `client` may use this route.
    pub fn allows(&self, client: IpAddr) -> bool {
        let client = match client {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(client, IpAddr::V4),
            v4 => v4,
        };
        self.allow
            .as_ref()
            .is_none_or(|nets| nets.iter().any(|n| n.contains(&client)))
    }

    /// The backend with the fewest requests in flight, other than `except`; ties go
    /// to the one after `turn` (a rotating counter) so equal backends share load.
    pub fn pick(&self, turn: usize, except: Option<&Arc<Backend>>) -> Option<Arc<Backend>> {
        let n = self.backends.len();
        (0..n)
            .map(|i| &self.backends[(turn + i) % n])
            .filter(|b| except.is_none_or(|e| !Arc::ptr_eq(e, b)))
            .min_by_key(|b| b.outstanding.load(Ordering::Relaxed))
            .cloned()
    }
}

/// Every route, by host.
#[derive(Debug, Default)]
pub struct RouteTable {
    /// Exact hosts → routes, longest path first.
    exact: HashMap<String, Vec<Arc<Route>>>,
    /// Wildcard hosts by the part after `*.` → routes, longest path first.
    wildcard: HashMap<String, Vec<Arc<Route>>>,
}

impl RouteTable {
    /// The table of every service with `spec.expose`; client-certificate CAs come
    /// from `secrets`.
    pub fn build(views: &[ServiceView], secrets: &BTreeMap<ServiceKey, Arc<Secret>>) -> RouteTable {
        let mut table = RouteTable::default();
        for view in views {
            let Some(expose) = &view.service.spec.expose else {
                continue;
            };
            let port = expose.service_port(&view.service.spec.ports);
            let backends = port
                .map(|port| {
                    view.port_backends(port)
                        .into_iter()
                        .filter(|b| b.endpoint.accepts_new())
                        .map(|b| Arc::new(Backend::new(b.addr)))
                        .collect()
                })
                .unwrap_or_default();
            // Checked at apply; should a list still not parse, nobody is served.
            let allow = (!expose.allow_cidrs.is_empty())
                .then(|| expose.allowed_networks().unwrap_or_default());
            let route = Arc::new(Route {
                service: view.key().to_string(),
                host: expose.host.clone(),
                path: expose.path().to_owned(),
                tls: expose.tls.is_some(),
                tls_from: tls_from(expose, &view.service.metadata.namespace),
                allow,
                client_ca: ClientCa::for_route(view, secrets),
                h2c: port.is_some_and(|p| speaks_h2c(&p.name)),
                backends,
                requests: CodeCounters::default(),
            });
            let (map, host) = match expose.host.strip_prefix("*.") {
                Some(suffix) => (&mut table.wildcard, suffix),
                None => (&mut table.exact, expose.host.as_str()),
            };
            map.entry(host.to_owned()).or_default().push(route);
        }
        for routes in table.exact.values_mut().chain(table.wildcard.values_mut()) {
            routes.sort_by_key(|r| std::cmp::Reverse(r.path.len()));
        }
        table
    }

    /// Every route.
    pub fn routes(&self) -> impl Iterator<Item = &Arc<Route>> {
        self.exact.values().chain(self.wildcard.values()).flatten()
    }

    /// The route for `host` (lowercase, without a port) and `path`: exact host
    /// first, then the wildcard of its parent domain; in each the longest prefix.
    pub fn lookup(&self, host: &str, path: &str) -> Option<&Arc<Route>> {
        fn find<'t>(routes: Option<&'t Vec<Arc<Route>>>, path: &str) -> Option<&'t Arc<Route>> {
            routes.and_then(|r| r.iter().find(|r| path_matches(&r.path, path)))
        }
        find(self.exact.get(host), path).or_else(|| {
            let (_, parent) = host.split_once('.')?;
            find(self.wildcard.get(parent), path)
        })
    }
}

impl RouteTable {
    /// Whether a route of `host` (lowercase) requires client certificates: its
    /// handshakes then request one. Exact host and wildcard both count, as a
    /// request's path may fall through from one to the other.
    pub fn requests_client_cert(&self, host: &str) -> bool {
        let wants = |routes: Option<&Vec<Arc<Route>>>| {
            routes.is_some_and(|r| r.iter().any(|r| r.client_ca.is_some()))
        };
        wants(self.exact.get(host))
            || host
                .split_once('.')
                .is_some_and(|(_, parent)| wants(self.wildcard.get(parent)))
    }
}

/// Where the certificate of a route with `expose` comes from, for status.
fn tls_from(expose: &Expose, namespace: &str) -> Option<String> {
    if expose.acme_host().is_some() {
        return Some("acme".to_owned());
    }
    expose
        .tls_secret(namespace)
        .map(|(ns, name)| format!("secret {ns}/{name}"))
}

/// Whether a service port named `name` speaks h2c: `grpc`, `h2c` or `http2`, alone
/// or before a `-` (`grpc-api`): the port-naming convention meshes use, so a
/// service needs no field of its own.
pub fn speaks_h2c(name: &str) -> bool {
    let protocol = name.split_once('-').map_or(name, |(p, _)| p);
    matches!(protocol, "grpc" | "h2c" | "http2")
}

/// Whether `prefix` matches `path` on segment boundaries: `/api` matches `/api`
/// and `/api/x`, not `/apiary`.
pub fn path_matches(prefix: &str, path: &str) -> bool {
    prefix == "/"
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// The host of a `Host` header or URI authority: lowercase, without a port or a
/// trailing dot.
pub fn normalize_host(host: &str) -> String {
    let host = if host.starts_with('[') {
        host.split_once(']')
            .map_or(host, |(h, _)| h)
            .trim_start_matches('[')
    } else {
        host.rsplit_once(':').map_or(host, |(h, _)| h)
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// The host a request is routed by: the request target's authority (absolute form,
/// h2's `:authority`) or else its `Host` header, normalized; `None` when both are
/// given and name different hosts (the upstream would see another host than the
/// one whose route, and allow-list, was chosen).
pub fn request_host(authority: Option<&str>, host_header: Option<&str>) -> Option<String> {
    match (
        authority.map(normalize_host),
        host_header.map(normalize_host),
    ) {
        (Some(a), Some(h)) if a != h => None,
        (Some(a), _) => Some(a),
        (None, h) => Some(h.unwrap_or_default()),
    }
}

/// Whether `path` is in the one form routes match on: no empty segment (`//`), no
/// dot segment (`/./`, `/../`) and no percent-encoded unreserved character
/// (`%61` for `a`). A backend may read those forms as another path than the
/// one matched (`//admin` as `/admin`), passing around that route's allow-list.
pub fn path_is_normal(path: &str) -> bool {
    // With no `//`, only the last segment can be empty (a trailing slash).
    let no_dot_segment = path.split('/').all(|seg| seg != "." && seg != "..");
    let bytes = path.as_bytes();
    let encoded_unreserved = bytes.windows(3).any(|w| {
        w[0] == b'%'
            && std::str::from_utf8(&w[1..])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .is_some_and(|c| c.is_ascii_alphanumeric() || b"-._~".contains(&c))
    });
    path.starts_with('/') && !path.contains("//") && no_dot_segment && !encoded_unreserved
}

#[cfg(test)]
pub(super) mod tests;
