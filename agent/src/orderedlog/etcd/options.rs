//! How to reach etcd: [`EtcdOptions`] (endpoints, TLS files, key prefix, timeouts,
//! etcd's transaction limits), checked and turned into a client by
//! [`EtcdOptions::connect_options`]. Every refusal is a [`ConnectError`] naming the
//! endpoint, file or setting.

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};
use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};
use thiserror::Error;

/// The key prefix objects live under unless told otherwise.
pub const DEFAULT_PREFIX: &str = "/rune/v1/";

/// etcd's default `--max-txn-ops`: operations (and, separately, comparisons) in one
/// transaction.
pub const DEFAULT_MAX_TXN_OPS: usize = 128;

/// etcd's default `--max-request-bytes` (1.5 MiB): the largest request it accepts.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1536 * 1024;

/// Keys read per request by a snapshot or a listing (every page at one revision).
pub const DEFAULT_PAGE_SIZE: usize = 1000;

/// How many times a write is tried when other writers change what it read.
pub const DEFAULT_WRITE_ATTEMPTS: u32 = 16;

/// Where etcd is and how to talk to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdOptions {
    /// Client URLs of the etcd members, `https://host:port` (or `http://host:port` on
    /// loopback, or anywhere with [`EtcdOptions::insecure`]).
    pub endpoints: Vec<String>,
    /// The root every key lives under (default [`DEFAULT_PREFIX`]); tests use their
    /// own so that several stores can share one etcd.
    pub prefix: String,
    /// PEM file of the CA that signed the etcd members' certificates (required for
    /// `https://`).
    pub ca_file: Option<PathBuf>,
    /// PEM file of this client's certificate (mutual TLS), with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// PEM file of this client's private key, with `cert_file`.
    pub key_file: Option<PathBuf>,
    /// The name to check the members' certificates against, when it is not the
    /// endpoints' host.
    pub server_name: Option<String>,
    /// Allows plain `http://` to an address that is not loopback: objects then cross
    /// the network unencrypted and unauthenticated.
    pub insecure: bool,
    /// How long connecting to one member may take.
    pub connect_timeout: Duration,
    /// How long one request may take (a watch: until etcd answers its creation).
    pub request_timeout: Duration,
    /// HTTP/2 keepalive ping interval, so a silent network cut ends a watch. Not
    /// below etcd's `--grpc-keepalive-min-time` (5 s by default): etcd closes the
    /// connections of clients that ping more often.
    pub keepalive_interval: Duration,
    /// How long a keepalive ping may go unanswered before the connection counts as
    /// broken.
    pub keepalive_timeout: Duration,
    /// etcd's `--max-txn-ops`: an apply that needs more operations is refused
    /// before anything is sent.
    pub max_txn_ops: usize,
    /// etcd's `--max-request-bytes`: an apply whose request would be larger is
    /// refused before anything is sent.
    pub max_request_bytes: usize,
    /// Keys per page of a snapshot or listing.
    pub page_size: usize,
    /// How many times a write is tried when other writers keep changing what it
    /// read (compare-and-swap conflicts).
    pub write_attempts: u32,
}

impl EtcdOptions {
    /// Options for `endpoints` with every other setting at its default.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            prefix: DEFAULT_PREFIX.to_owned(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            server_name: None,
            insecure: false,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(5),
            max_txn_ops: DEFAULT_MAX_TXN_OPS,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            page_size: DEFAULT_PAGE_SIZE,
            write_attempts: DEFAULT_WRITE_ATTEMPTS,
        }
    }

    /// The endpoints as one string for messages (`https://a:2379,https://b:2379`).
    pub fn endpoints_text(&self) -> String {
        self.endpoints.join(",")
    }

    /// The prefix with exactly one trailing `/`; refused when it does not start with
    /// `/`, is only `/`, or holds an empty segment.
    pub fn normalized_prefix(&self) -> Result<String, ConnectError> {
        let p = self.prefix.trim_end_matches('/');
        let bad = |message: &str| ConnectError::BadPrefix {
            prefix: self.prefix.clone(),
            message: message.to_owned(),
        };
        if !self.prefix.starts_with('/') {
            return Err(bad("must start with '/'"));
        }
        if p.is_empty() {
            // Every key of the cluster, other programs' too.
            return Err(bad("must name at least one segment (e.g. /rune/v1/)"));
        }
        if p[1..].split('/').any(str::is_empty) {
            return Err(bad("has an empty segment ('//')"));
        }
        Ok(format!("{p}/"))
    }

    /// Checks every setting and builds etcd-client's options, reading the TLS files.
    /// Nothing is sent: etcd-client connects on the first request.
    pub fn connect_options(&self) -> Result<ConnectOptions, ConnectError> {
        self.normalized_prefix()?;
        for (name, value) in [
            ("max_txn_ops", self.max_txn_ops),
            ("max_request_bytes", self.max_request_bytes),
            ("page_size", self.page_size),
            ("write_attempts", self.write_attempts as usize),
        ] {
            if value == 0 {
                return Err(ConnectError::BadOption {
                    name,
                    message: "must be at least 1".to_owned(),
                });
            }
        }
        let tls = self.check_endpoints()?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            .with_timeout(self.request_timeout)
            .with_keep_alive(self.keepalive_interval, self.keepalive_timeout)
            .with_keep_alive_while_idle(true);
        if tls {
            options = options.with_tls(self.tls()?);
        } else if let Some((what, _)) = self.tls_files().next() {
            return Err(ConnectError::TlsWithoutHttps { what });
        }
        Ok(options)
    }

    /// Checks the endpoints; returns whether they use TLS.
    fn check_endpoints(&self) -> Result<bool, ConnectError> {
        if self.endpoints.is_empty() {
            return Err(ConnectError::NoEndpoints);
        }
        let (mut http, mut https) = (None, None);
        for endpoint in &self.endpoints {
            let parsed = parse_endpoint(endpoint)?;
            if parsed.tls {
                https.get_or_insert_with(|| endpoint.clone());
            } else {
                if !parsed.loopback && !self.insecure {
                    return Err(ConnectError::PlainHttp {
                        endpoint: endpoint.clone(),
                    });
                }
                http.get_or_insert_with(|| endpoint.clone());
            }
        }
        match (http, https) {
            (Some(http), Some(https)) => Err(ConnectError::MixedSchemes { http, https }),
            (None, Some(https)) if self.ca_file.is_none() => {
                Err(ConnectError::NoCa { endpoint: https })
            }
            (_, https) => Ok(https.is_some()),
        }
    }

    /// The TLS files given, named.
    fn tls_files(&self) -> impl Iterator<Item = (&'static str, &PathBuf)> {
        [
            ("CA file", self.ca_file.as_ref()),
            ("client certificate", self.cert_file.as_ref()),
            ("client key", self.key_file.as_ref()),
        ]
        .into_iter()
        .filter_map(|(what, path)| path.map(|p| (what, p)))
    }

    fn tls(&self) -> Result<TlsOptions, ConnectError> {
        let mut tls = TlsOptions::new();
        if let Some(ca) = &self.ca_file {
            tls = tls.ca_certificate(Certificate::from_pem(read_pem("CA file", ca)?));
        }
        match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => {
                tls = tls.identity(Identity::from_pem(
                    read_pem("client certificate", cert)?,
                    read_pem("client key", key)?,
                ));
            }
            (None, None) => {}
            (cert, key) => {
                return Err(ConnectError::HalfIdentity {
                    cert: cert.clone(),
                    key: key.clone(),
                });
            }
        }
        if let Some(name) = &self.server_name {
            tls = tls.domain_name(name.clone());
        }
        Ok(tls)
    }
}

/// Why [`EtcdOptions`] cannot be used.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConnectError {
    /// No endpoint at all.
    #[error("no etcd endpoint given")]
    NoEndpoints,
    /// An endpoint that is not `http(s)://host:port`.
    #[error("etcd endpoint {endpoint:?}: {message}")]
    BadEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        message: String,
    },
    /// Plain `http://` to an address that is not loopback, without `insecure`.
    #[error(
        "etcd endpoint {endpoint} is plain http:// to an address that is not loopback: \
         use https:// with a CA file (and a client certificate), or allow insecure \
         connections to send objects unencrypted"
    )]
    PlainHttp {
        /// The endpoint as given.
        endpoint: String,
    },
    /// Some endpoints are `http://` and some `https://`.
    #[error("etcd endpoints mix http:// ({http}) and https:// ({https}): use one scheme")]
    MixedSchemes {
        /// The first `http://` endpoint.
        http: String,
        /// The first `https://` endpoint.
        https: String,
    },
    /// `https://` without a CA to check the members' certificates.
    #[error(
        "etcd endpoint {endpoint} is https:// but no CA file is given to check the members' certificates"
    )]
    NoCa {
        /// The first `https://` endpoint.
        endpoint: String,
    },
    /// TLS files given for `http://` endpoints.
    #[error("an etcd {what} is given but the endpoints are plain http://: use https://")]
    TlsWithoutHttps {
        /// Which file.
        what: &'static str,
    },
    /// A client certificate without its key, or a key without its certificate.
    #[error(
        "an etcd client certificate needs its key and a key its certificate (certificate: {cert:?}, key: {key:?})"
    )]
    HalfIdentity {
        /// The certificate file, if given.
        cert: Option<PathBuf>,
        /// The key file, if given.
        key: Option<PathBuf>,
    },
    /// A TLS file that cannot be read.
    #[error("etcd {what} {path}: {message}")]
    ReadFile {
        /// Which file (`CA file`, `client certificate`, `client key`).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why it cannot be read.
        message: String,
    },
    /// A TLS file without a PEM block.
    #[error("etcd {what} {path} holds no PEM block (-----BEGIN ...)")]
    NotPem {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
    },
    /// A key prefix that cannot be used.
    #[error("etcd key prefix {prefix:?}: {message}")]
    BadPrefix {
        /// The prefix as given.
        prefix: String,
        /// What is wrong with it.
        message: String,
    },
    /// A number that must be positive is not.
    #[error("etcd option {name}: {message}")]
    BadOption {
        /// The option's name.
        name: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// etcd-client refused the options (after the checks above: rare).
    #[error("etcd client for {endpoints}: {message}")]
    Client {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// What etcd-client said.
        message: String,
    },
}

/// An endpoint's parts that matter here.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Endpoint {
    /// `https://`.
    pub tls: bool,
    /// The host is a loopback address or `localhost`.
    pub loopback: bool,
}

/// Parses `http(s)://host:port` (an IPv6 host in brackets; a trailing `/` allowed).
pub(super) fn parse_endpoint(endpoint: &str) -> Result<Endpoint, ConnectError> {
    let bad = |message: &str| ConnectError::BadEndpoint {
        endpoint: endpoint.to_owned(),
        message: message.to_owned(),
    };
    let (tls, rest) = if let Some(rest) = endpoint.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = endpoint.strip_prefix("http://") {
        (false, rest)
    } else {
        return Err(bad(
            "no scheme: write https://HOST:PORT (or http://HOST:PORT for an etcd on loopback)",
        ));
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains(['/', '?', '#', '@']) {
        return Err(bad("only a host and a port may follow the scheme"));
    }
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => {
            let (host, port) = v6
                .split_once("]:")
                .ok_or_else(|| bad("no port after the IPv6 address"))?;
            (host, port)
        }
        None => authority
            .rsplit_once(':')
            .ok_or_else(|| bad("no port (etcd's client port is usually 2379)"))?,
    };
    if host.is_empty() {
        return Err(bad("no host"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err(bad(&format!("port {port:?} is not 1-65535"))),
    }
    let loopback = match host.parse::<IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) if authority.starts_with('[') => {
            return Err(bad(&format!("{host:?} is not an IPv6 address")));
        }
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    };
    Ok(Endpoint { tls, loopback })
}

/// A PEM file's bytes; refused when unreadable or not PEM.
fn read_pem(what: &'static str, path: &Path) -> Result<Vec<u8>, ConnectError> {
    let bytes = std::fs::read(path).map_err(|e| ConnectError::ReadFile {
        what,
        path: path.to_owned(),
        message: e.to_string(),
    })?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(ConnectError::NotPem {
            what,
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}
