//! Each ingress route as `status` shows it: where it sends requests, how it is
//! secured, and what keeps it from serving as declared.

use super::{
    acme::{unix, utc},
    routes::RouteTable,
    tls::CertMap,
};
use serde::{Deserialize, Serialize};
use std::{fmt, time::SystemTime};

/// One route.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteStatus {
    /// The host as exposed (`*.example.com` for a wildcard).
    pub host: String,
    /// The path prefix.
    pub path: String,
    /// `namespace/name` of the service.
    pub service: String,
    /// Ready endpoints requests go to.
    pub endpoints: usize,
    /// The endpoints speak h2c (gRPC) rather than HTTP/1.1.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub h2c: bool,
    /// Where its certificate comes from: `secret NS/NAME` or `acme`; none: no TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<String>,
    /// When the certificate served for it expires (RFC 3339 UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<String>,
    /// Every request needs a client certificate.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub client_cert: bool,
    /// How many networks `allowCidrs` serves; none: every client.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_networks: Option<usize>,
    /// What keeps the route from serving as declared, and what clients get.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
}

impl fmt::Display for RouteStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{} -> {}, {} endpoint{}",
            self.host,
            self.path,
            self.service,
            self.endpoints,
            if self.endpoints == 1 { "" } else { "s" }
        )?;
        if self.h2c {
            f.write_str(" (h2c)")?;
        }
        if let Some(tls) = &self.tls {
            write!(f, ", tls {tls}")?;
            if let Some(expires) = &self.expires {
                write!(f, " (expires {expires})")?;
            }
        }
        if self.client_cert {
            f.write_str(", client certificates")?;
        }
        if let Some(n) = self.allow_networks {
            write!(f, ", allow {n} network{}", if n == 1 { "" } else { "s" })?;
        }
        for p in &self.problems {
            write!(f, "; {p}")?;
        }
        Ok(())
    }
}

/// Every route of `table`, by host and path, with what `certs` serves.
pub fn routes(table: &RouteTable, certs: &CertMap) -> Vec<RouteStatus> {
    routes_at(table, certs, unix(SystemTime::now()))
}

/// [`routes`] at `now` (Unix seconds), when expired certificates are a problem.
fn routes_at(table: &RouteTable, certs: &CertMap, now: i64) -> Vec<RouteStatus> {
    let mut out: Vec<RouteStatus> = table
        .routes()
        .map(|r| {
            let mut problems = Vec::new();
            if r.backends.is_empty() {
                problems.push("no ready endpoint: 503".to_owned());
            }
            if let Some(tls) = &r.tls_from
                && !certs.has(&r.host)
            {
                let meanwhile = if certs.has_default() {
                    "the default certificate is served"
                } else {
                    "handshakes refused"
                };
                problems.push(if tls == "acme" {
                    format!("no certificate yet: {meanwhile}")
                } else {
                    format!("{tls} missing or unusable: {meanwhile}")
                });
            }
            let expiry = r.tls_from.as_ref().and_then(|_| certs.expiry(&r.host));
            if let Some(at) = expiry.filter(|at| *at <= now) {
                problems.push(format!(
                    "certificate expired {}: clients refuse it",
                    utc(at)
                ));
            }
            if r.allow.as_ref().is_some_and(Vec::is_empty) {
                problems.push("allowCidrs unusable: every client gets 403".to_owned());
            }
            if r.client_ca.as_ref().is_some_and(|ca| !ca.usable()) {
                problems.push("client CA unusable: every request refused".to_owned());
            }
            RouteStatus {
                host: r.host.clone(),
                path: r.path.clone(),
                service: r.service.clone(),
                endpoints: r.backends.len(),
                h2c: r.h2c,
                tls: r.tls_from.clone(),
                expires: expiry.map(utc),
                client_cert: r.client_ca.is_some(),
                allow_networks: r.allow.as_ref().map(Vec::len),
                problems,
            }
        })
        .collect();
    out.sort_by(|a, b| (&a.host, &a.path).cmp(&(&b.host, &b.path)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        endpoints::ServiceView,
        model::{Object, ServiceKey, parse_documents},
    };
    use std::{
        collections::{BTreeMap, HashMap},
        sync::Arc,
    };

    #[test]
    fn a_route_without_endpoints_certificate_or_ca_names_each_problem() {
        let text = "apiVersion: rune/v1\nkind: Service\nmetadata: {name: web}\n\
                    spec: {ports: [{port: 80}], expose: {host: a.test, path: /api, \
                    tls: {secret: cert}, clientCert: {caSecret: ca, mode: require}, \
                    allowCidrs: [198.18.0.0/15]}}\n";
        let Some(Object::Service(s)) = parse_documents(text).unwrap().pop() else {
            panic!("a service")
        };
        let views = [ServiceView {
            service: Arc::new(s),
            endpoints: None,
        }];
        let table = RouteTable::build(&views, &BTreeMap::new());
        let status = routes(&table, &CertMap::default());
        assert_eq!(status.len(), 1);
        assert_eq!(
            status[0].to_string(),
            "a.test/api -> default/web, 0 endpoints, tls secret default/cert, \
             client certificates, allow 1 network; no ready endpoint: 503; \
             secret default/cert missing or unusable: handshakes refused; \
             client CA unusable: every request refused"
        );
    }

    #[test]
    fn a_route_shows_when_its_certificate_expires_and_once_expired_a_problem() {
        let cert = rcgen::generate_simple_self_signed(vec!["a.test".to_owned()]).unwrap();
        let text = format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: web}}\n\
             spec: {{ports: [{{port: 80}}], expose: {{host: a.test, tls: {{secret: cert}}}}}}\n\
             ---\napiVersion: rune/v1\nkind: Secret\nmetadata: {{name: cert}}\n\
             data: {{tls.crt: {:?}, tls.key: {:?}}}\n",
            cert.cert.pem(),
            cert.signing_key.serialize_pem()
        );
        let mut objects = parse_documents(&text).unwrap().into_iter();
        let (Some(Object::Service(s)), Some(Object::Secret(secret))) =
            (objects.next(), objects.next())
        else {
            panic!("a service and its secret")
        };
        let views = [ServiceView {
            service: Arc::new(s),
            endpoints: None,
        }];
        let secrets = BTreeMap::from([(ServiceKey::new("default", "cert"), Arc::new(secret))]);
        let table = RouteTable::build(&views, &secrets);
        let certs = CertMap::build(&views, &secrets, None, &HashMap::new());
        let expiry = certs.expiry("a.test").expect("the certificate's expiry");

        let now = routes_at(&table, &certs, expiry - 1);
        assert_eq!(now[0].expires, Some(utc(expiry)));
        assert!(!now[0].to_string().contains("expired"), "{}", now[0]);
        let later = routes_at(&table, &certs, expiry + 1);
        let line = later[0].to_string();
        assert!(
            line.contains(&format!(
                "; certificate expired {}: clients refuse it",
                utc(expiry)
            )),
            "{line}"
        );
    }

    #[test]
    fn a_route_reads_as_one_line_with_its_problems_last() {
        let r = RouteStatus {
            host: "a.test".to_owned(),
            path: "/api".to_owned(),
            service: "default/web".to_owned(),
            endpoints: 0,
            tls: Some("secret default/cert".to_owned()),
            expires: Some("2027-01-01T00:00:00Z".to_owned()),
            client_cert: true,
            allow_networks: Some(1),
            problems: vec!["no ready endpoint: 503".to_owned()],
            ..RouteStatus::default()
        };
        assert_eq!(
            r.to_string(),
            "a.test/api -> default/web, 0 endpoints, tls secret default/cert (expires 2027-01-01T00:00:00Z), client certificates, allow 1 network; no ready endpoint: 503"
        );
    }
}
