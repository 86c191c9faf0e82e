use super::*;
use crate::model::{Object, parse_documents};

/// Views of services `(name, host, path)`, each with one ready endpoint.
fn views(routes: &[(&str, &str, &str)]) -> Vec<ServiceView> {
    let exposes: Vec<(&str, String)> = routes
        .iter()
        .map(|(name, host, path)| (*name, format!("host: '{host}', path: '{path}'")))
        .collect();
    let exposes: Vec<(&str, &str)> = exposes.iter().map(|(n, e)| (*n, e.as_str())).collect();
    exposed_views(&exposes)
}

/// Views of services `(name, expose)` (the fields of `spec.expose` in YAML flow
/// form), the `i`th with one ready endpoint at 198.18.0.`i+1`:8080.
pub(crate) fn exposed_views(routes: &[(&str, &str)]) -> Vec<ServiceView> {
    let mut out = Vec::new();
    for (i, (name, expose)) in routes.iter().enumerate() {
        let text = format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
             spec: {{ports: [{{port: 80, targetPort: 8080}}], \
             expose: {{{expose}}}}}\n---\n\
             apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\n\
             spec: {{endpoints: [{{address: 198.18.0.{}, ready: true}}]}}\n",
            i + 1
        );
        let mut objects = parse_documents(&text).unwrap().into_iter();
        let (Some(Object::Service(s)), Some(Object::Endpoints(e))) =
            (objects.next(), objects.next())
        else {
            panic!("a service and its endpoints")
        };
        out.push(ServiceView {
            service: Arc::new(s),
            endpoints: Some(Arc::new(e)),
        });
    }
    out
}

fn service_for(table: &RouteTable, host: &str, path: &str) -> Option<String> {
    table.lookup(host, path).map(|r| r.service.clone())
}

#[test]
fn hosts_and_paths_pick_the_most_specific_route() {
    let table = RouteTable::build(
        &views(&[
            ("root", "a.example.com", "/"),
            ("api", "a.example.com", "/api"),
            ("v1", "a.example.com", "/api/v1"),
            ("wild", "*.example.com", "/"),
        ]),
        &BTreeMap::new(),
    );
    let cases = [
        ("a.example.com", "/", Some("default/root")),
        ("a.example.com", "/api", Some("default/api")),
        ("a.example.com", "/api/x", Some("default/api")),
        ("a.example.com", "/apiary", Some("default/root")),
        ("a.example.com", "/api/v1/users", Some("default/v1")),
        ("b.example.com", "/anything", Some("default/wild")),
        ("x.b.example.com", "/", None),
        ("example.com", "/", None),
        ("other.test", "/", None),
    ];
    for (host, path, want) in cases {
        assert_eq!(
            service_for(&table, host, path).as_deref(),
            want,
            "{host}{path}"
        );
    }
    let route = table.lookup("a.example.com", "/").unwrap();
    assert_eq!(route.backends[0].addr, "198.18.0.1:8080".parse().unwrap());
}

#[test]
fn segment_matching_does_not_match_inside_a_segment() {
    assert!(path_matches("/api", "/api"));
    assert!(path_matches("/api", "/api/"));
    assert!(path_matches("/api", "/api/x"));
    assert!(!path_matches("/api", "/apiary"));
    assert!(!path_matches("/api", "/"));
    assert!(path_matches("/", "/apiary"));
}

#[test]
fn hosts_are_normalized() {
    assert_eq!(normalize_host("A.Example:8080"), "a.example");
    assert_eq!(normalize_host("a.example."), "a.example");
    assert_eq!(normalize_host("[fd00::1]:80"), "fd00::1");
}

#[test]
fn the_least_loaded_backend_is_picked_and_a_failed_one_skipped() {
    let mut route = Route {
        service: "default/x".into(),
        host: "a".into(),
        path: "/".into(),
        tls: false,
        tls_from: None,
        allow: Some(Vec::new()),
        client_ca: None,
        h2c: false,
        backends: Vec::new(),
        requests: Default::default(),
    };
    for port in [1, 2] {
        route.backends.push(Arc::new(Backend::new(SocketAddr::from((
            [198, 18, 0, 1],
            port,
        )))));
    }
    route.backends[0].outstanding.store(3, Ordering::Relaxed);
    let first = route.pick(0, None).unwrap();
    assert_eq!(first.addr.port(), 2);
    let other = route.pick(0, Some(&first)).unwrap();
    assert_eq!(other.addr.port(), 1);
    // An empty allow-list (one that could not be used) refuses everyone.
    assert!(!route.allows("198.18.0.9".parse().unwrap()));
    route.allow = Some(vec!["198.18.0.0/24".parse().unwrap()]);
    assert!(route.allows("::ffff:198.18.0.9".parse().unwrap()));
    assert!(!route.allows("198.19.0.9".parse().unwrap()));
}

#[test]
fn a_request_names_one_host_and_paths_in_another_form_than_routes_are_refused() {
    assert_eq!(
        request_host(None, Some("Web.Example:80")),
        Some("web.example".into())
    );
    assert_eq!(
        request_host(Some("web.example"), None),
        Some("web.example".into())
    );
    assert_eq!(
        request_host(Some("web.example:443"), Some("web.example")),
        Some("web.example".into())
    );
    assert_eq!(
        request_host(Some("open.example"), Some("restricted.example")),
        None
    );
    assert_eq!(request_host(None, None), Some(String::new()));
    for ok in ["/", "/api", "/api/", "/api/x.y", "/a%20b", "/a%2Fb"] {
        assert!(path_is_normal(ok), "{ok}");
    }
    for bad in [
        "//admin",
        "/./admin",
        "/x/../admin",
        "/admin/.",
        "/%61dmin",
        "/a%7e",
        "admin",
    ] {
        assert!(!path_is_normal(bad), "{bad}");
    }
}

#[test]
fn port_names_say_which_upstreams_speak_h2c() {
    for name in ["grpc", "h2c", "http2", "grpc-api", "http2-web"] {
        assert!(speaks_h2c(name), "{name}");
    }
    for name in ["", "http", "web", "grpcweb", "api-grpc", "h2"] {
        assert!(!speaks_h2c(name), "{name}");
    }
}
