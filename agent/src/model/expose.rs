//! `Service.spec.expose`: how the ingress proxy publishes a service over HTTP(S) —
//! host, path prefix, TLS from a Secret, and a client-address allow-list.

use super::{ModelError, ServicePort, check_dns_label};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::fmt;

/// An HTTP(S) route to a service through the ingress proxy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Expose {
    /// The service port that receives the traffic (its name or number); the only
    /// port when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PortRef>,
    /// The host name: exact (`shop.example.com`) or one leading wildcard label
    /// (`*.example.com`, which matches exactly one more label).
    pub host: String,
    /// The path prefix, matched on segment boundaries; `/` when omitted.
    #[serde(default = "root_path")]
    pub path: String,
    /// TLS for this host: the certificate's Secret, or ACME.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ExposeTls>,
    /// Client addresses or networks served; every client when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_cidrs: Vec<String>,
    /// Client certificates required for this route: every request must come over a
    /// TLS connection whose client presented a chain verified by this CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<ClientCert>,
}

fn root_path() -> String {
    "/".to_owned()
}

/// A service port named by its name or its number.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PortRef {
    /// The port's number (`spec.ports[].port`).
    Number(u16),
    /// The port's name (`spec.ports[].name`).
    Name(String),
}

impl fmt::Display for PortRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortRef::Number(n) => write!(f, "{n}"),
            PortRef::Name(n) => write!(f, "{n:?}"),
        }
    }
}

/// TLS of an exposed route.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ExposeTls {
    /// The Secret holding `tls.crt` and `tls.key`: `NAME` (the service's namespace)
    /// or `NAMESPACE/NAME`; required with `manual`, absent with `acme`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secret: String,
    /// Where the certificate comes from; `manual` (the Secret) when omitted.
    #[serde(default)]
    pub mode: TlsMode,
}

/// Where a route's certificate comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// The Secret named by `tls.secret`, written by the user.
    #[default]
    Manual,
    /// Issued by an ACME server over HTTP-01 and kept in the agent's state dir
    /// (docs/ingress.md).
    Acme,
}

/// Client-certificate requirement of a route.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClientCert {
    /// The Secret whose `ca.crt` verifies client certificates: `NAME` (the
    /// service's namespace) or `NAMESPACE/NAME`.
    pub ca_secret: String,
    /// `require` (the only mode): requests without a verified chain are refused.
    pub mode: String,
}

/// The one `clientCert.mode`.
pub const CLIENT_CERT_REQUIRE: &str = "require";

impl Expose {
    /// The route's path in its one stored form (checked at apply: no trailing `/`
    /// except the root).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The namespace and name of the TLS Secret (`manual` mode), resolved against
    /// `namespace`.
    pub fn tls_secret<'a>(&'a self, namespace: &'a str) -> Option<(&'a str, &'a str)> {
        self.tls
            .as_ref()
            .filter(|t| t.mode == TlsMode::Manual)
            .map(|t| secret_ref(namespace, &t.secret))
    }

    /// The host whose certificate ACME issues (`tls.mode: acme`).
    pub fn acme_host(&self) -> Option<&str> {
        self.tls
            .as_ref()
            .filter(|t| t.mode == TlsMode::Acme)
            .map(|_| self.host.as_str())
    }

    /// The namespace and name of the client-certificate CA's Secret, resolved
    /// against `namespace`.
    pub fn client_ca_secret<'a>(&'a self, namespace: &'a str) -> Option<(&'a str, &'a str)> {
        self.client_cert
            .as_ref()
            .map(|c| secret_ref(namespace, &c.ca_secret))
    }

    /// The service port this route sends to, if it names one of `ports`.
    pub fn service_port<'p>(&self, ports: &'p [ServicePort]) -> Option<&'p ServicePort> {
        match &self.port {
            None if ports.len() == 1 => ports.first(),
            None => None,
            Some(PortRef::Number(n)) => ports.iter().find(|p| p.port == *n),
            Some(PortRef::Name(n)) => ports.iter().find(|p| p.name == *n),
        }
    }

    /// The allow-list as networks; an error names the first entry that is neither a
    /// network nor an address, and why.
    pub fn allowed_networks(&self) -> Result<Vec<IpNet>, (usize, String)> {
        self.allow_cidrs
            .iter()
            .enumerate()
            .map(|(i, s)| super::parse_cidr(s).map_err(|e| (i, e)))
            .collect()
    }

    /// Checks the route against its service's ports; errors name `spec.expose.*`.
    pub(super) fn validate(&self, object: &str, ports: &[ServicePort]) -> Result<(), ModelError> {
        let field = |f: &str| format!("spec.expose.{f}");
        if self.service_port(ports).is_none() {
            let message = match &self.port {
                None => "must name a port: the service has several".to_owned(),
                Some(p) => format!("{p} is not a port of this service"),
            };
            return Err(ModelError::invalid(object, field("port"), message));
        }
        if let Some(p) = self.service_port(ports)
            && p.protocol != super::Protocol::Tcp
        {
            return Err(ModelError::invalid(
                object,
                field("port"),
                format!("port {} is UDP: HTTP needs a TCP port", p.port),
            ));
        }
        check_host(object, &field("host"), &self.host)?;
        check_path(object, &field("path"), &self.path)?;
        if let Some(tls) = &self.tls {
            tls.validate(object, &self.host)?;
        }
        if let Err((i, why)) = self.allowed_networks() {
            return Err(ModelError::invalid(
                object,
                field(&format!("allowCidrs[{i}]")),
                why,
            ));
        }
        if let Some(client_cert) = &self.client_cert {
            self.validate_client_cert(object, client_cert)?;
        }
        Ok(())
    }

    /// `clientCert`: a valid Secret reference, mode `require`, and TLS on the route
    /// (a client certificate only exists on a TLS connection).
    fn validate_client_cert(&self, object: &str, c: &ClientCert) -> Result<(), ModelError> {
        let field = |f: &str| format!("spec.expose.clientCert.{f}");
        let (ns, name) = secret_ref("default", &c.ca_secret);
        check_dns_label(object, &field("caSecret"), ns)?;
        check_dns_label(object, &field("caSecret"), name)?;
        if c.mode != CLIENT_CERT_REQUIRE {
            return Err(ModelError::invalid(
                object,
                field("mode"),
                format!("{:?} is not a mode: the one mode is \"require\"", c.mode),
            ));
        }
        if self.tls.is_none() {
            return Err(ModelError::invalid(
                object,
                field("caSecret"),
                "client certificates need TLS: set spec.expose.tls",
            ));
        }
        Ok(())
    }
}

impl ExposeTls {
    /// `manual` needs a valid Secret reference; `acme` needs none and an exact host
    /// (HTTP-01 cannot prove a wildcard).
    fn validate(&self, object: &str, host: &str) -> Result<(), ModelError> {
        let field = |f: &str| format!("spec.expose.tls.{f}");
        match self.mode {
            TlsMode::Manual => {
                let (ns, name) = secret_ref("default", &self.secret);
                check_dns_label(object, &field("secret"), ns)?;
                check_dns_label(object, &field("secret"), name)
            }
            TlsMode::Acme if !self.secret.is_empty() => Err(ModelError::invalid(
                object,
                field("secret"),
                "not used with mode acme: the certificate is kept in the state dir",
            )),
            TlsMode::Acme if host.starts_with("*.") => Err(ModelError::invalid(
                object,
                field("mode"),
                "acme (HTTP-01) cannot issue a wildcard host",
            )),
            TlsMode::Acme => Ok(()),
        }
    }
}

/// `NAME` or `NAMESPACE/NAME`, resolved against `namespace`.
fn secret_ref<'a>(namespace: &'a str, reference: &'a str) -> (&'a str, &'a str) {
    reference.split_once('/').unwrap_or((namespace, reference))
}

/// A lowercase DNS name of labels, optionally with one leading `*.` label.
fn check_host(object: &str, field: &str, host: &str) -> Result<(), ModelError> {
    let name = host.strip_prefix("*.").unwrap_or(host);
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if host.len() > 253 || !name.contains('.') && host != name || !name.split('.').all(label_ok) {
        return Err(ModelError::invalid(
            object,
            field,
            format!(
                "{host:?} is not a host name (lowercase DNS labels, optionally one leading \
                 \"*.\" wildcard label)"
            ),
        ));
    }
    Ok(())
}

/// A path prefix: starts with `/`, no trailing `/` (except the root), no empty, `.`
/// or `..` segments, and only characters of a URL path.
fn check_path(object: &str, field: &str, path: &str) -> Result<(), ModelError> {
    let bad = |why: &str| {
        Err(ModelError::invalid(
            object,
            field,
            format!("{path:?} {why}"),
        ))
    };
    if !path.starts_with('/') {
        return bad("must start with \"/\"");
    }
    if path == "/" {
        return Ok(());
    }
    if path.ends_with('/') {
        return bad("must not end with \"/\" (prefixes match whole segments already)");
    }
    if path[1..]
        .split('/')
        .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return bad("has an empty, \".\" or \"..\" segment");
    }
    let allowed = |b: u8| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@%/".contains(&b);
    if !path.bytes().all(allowed) {
        return bad("has a character that is not allowed in a URL path");
    }
    Ok(())
}

#[cfg(test)]
mod tests;
