//! The etcd settings ([`super::EtcdSettings`]) checked together and turned into the
//! etcd backend's [`EtcdOptions`]: every command that reaches etcd (`run`, `apply`,
//! `get`, `delete`, `status`, and later ones) goes through
//! [`Config::etcd_options`], so a refusal always names the flag to change.

use super::{Config, ConfigError};
use crate::orderedlog::etcd::{ConnectError, EtcdOptions};

impl Config {
    /// The etcd backend's options, or `None` without `--etcd-endpoints` (the
    /// embedded store). Checks the endpoints, TLS files and prefix as the backend
    /// would (reading the TLS files), naming the flag at fault: plain `http://` to an
    /// address that is not loopback is refused unless `--etcd-insecure`.
    pub fn etcd_options(&self) -> Result<Option<EtcdOptions>, ConfigError> {
        if self.etcd_endpoints.is_empty() {
            let tls_flag = [
                ("--etcd-ca", &self.etcd_ca),
                ("--etcd-cert", &self.etcd_cert),
                ("--etcd-key", &self.etcd_key),
            ]
            .into_iter()
            .find_map(|(flag, file)| file.as_ref().map(|_| flag));
            if let Some(flag) = tls_flag {
                return Err(ConfigError::Invalid {
                    setting: flag,
                    message: "is given without --etcd-endpoints (the embedded store needs no \
                              TLS files)"
                        .to_owned(),
                });
            }
            return Ok(None);
        }
        let options = EtcdOptions {
            prefix: self.etcd_prefix.clone(),
            ca_file: self.etcd_ca.clone(),
            cert_file: self.etcd_cert.clone(),
            key_file: self.etcd_key.clone(),
            insecure: self.etcd_insecure,
            max_txn_ops: self.etcd_max_txn_ops,
            max_request_bytes: self.etcd_max_request_bytes,
            ..EtcdOptions::new(self.etcd_endpoints.iter().cloned())
        };
        options.connect_options().map_err(refusal)?;
        Ok(Some(options))
    }
}

/// A [`ConnectError`] as a refusal of the flag that caused it.
fn refusal(e: ConnectError) -> ConfigError {
    let setting = match &e {
        ConnectError::PlainHttp { endpoint } => {
            return ConfigError::Invalid {
                setting: "--etcd-endpoints",
                message: format!(
                    "etcd endpoint {endpoint} is plain http:// to an address that is not \
                     loopback: use https:// with --etcd-ca (and --etcd-cert/--etcd-key), or \
                     pass --etcd-insecure to send objects unencrypted and unauthenticated"
                ),
            };
        }
        ConnectError::NoEndpoints
        | ConnectError::BadEndpoint { .. }
        | ConnectError::MixedSchemes { .. }
        | ConnectError::Client { .. } => "--etcd-endpoints",
        ConnectError::NoCa { .. } => "--etcd-ca",
        ConnectError::TlsWithoutHttps { what } | ConnectError::ReadFile { what, .. } => {
            file_flag(what)
        }
        ConnectError::NotPem { what, .. } => file_flag(what),
        ConnectError::HalfIdentity { cert: None, .. } => "--etcd-cert",
        ConnectError::HalfIdentity { .. } => "--etcd-key",
        ConnectError::BadPrefix { .. } => "--etcd-prefix",
        ConnectError::BadOption { name, .. } => match *name {
            "max_txn_ops" => "--etcd-max-txn-ops",
            "max_request_bytes" => "--etcd-max-request-bytes",
            _ => "--etcd-endpoints",
        },
    };
    ConfigError::Invalid {
        setting,
        message: e.to_string(),
    }
}

/// The flag of a TLS file as [`ConnectError`] names it.
fn file_flag(what: &str) -> &'static str {
    match what {
        "client certificate" => "--etcd-cert",
        "client key" => "--etcd-key",
        _ => "--etcd-ca",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FileConfig;

    fn options(layer: FileConfig) -> Result<Option<EtcdOptions>, String> {
        layer
            .resolve()
            .map_err(|e| e.to_string())?
            .etcd_options()
            .map_err(|e| e.to_string())
    }

    fn endpoints(list: &[&str]) -> FileConfig {
        FileConfig {
            etcd_endpoints: Some(list.iter().map(|s| (*s).to_owned()).collect()),
            ..FileConfig::default()
        }
    }

    #[test]
    fn no_endpoints_is_the_embedded_store() {
        assert_eq!(options(FileConfig::default()), Ok(None));
        let ca_alone = FileConfig {
            etcd_ca: Some("/ca.pem".into()),
            ..FileConfig::default()
        };
        let err = options(ca_alone).unwrap_err();
        assert!(err.starts_with("setting --etcd-ca:"), "{err}");
    }

    #[test]
    fn plain_http_is_refused_off_loopback_naming_the_flag_that_allows_it() {
        let err = options(endpoints(&["http://198.51.100.7:2379"])).unwrap_err();
        assert!(err.starts_with("setting --etcd-endpoints:"), "{err}");
        assert!(err.contains("--etcd-insecure"), "{err}");
        let insecure = FileConfig {
            etcd_insecure: Some(true),
            ..endpoints(&["http://198.51.100.7:2379"])
        };
        let got = options(insecure).unwrap().unwrap();
        assert!(got.insecure);
        let local = options(endpoints(&[
            "http://127.0.0.1:2379",
            "http://localhost:2380",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            local.endpoints,
            ["http://127.0.0.1:2379", "http://localhost:2380"]
        );
        assert_eq!(local.prefix, crate::orderedlog::etcd::DEFAULT_PREFIX);
    }

    #[test]
    fn each_refusal_names_its_flag() {
        let https = endpoints(&["https://10.0.0.5:2379"]);
        for (layer, flag) in [
            (endpoints(&["10.0.0.5:2379"]), "--etcd-endpoints"),
            (https.clone(), "--etcd-ca"),
            (
                FileConfig {
                    etcd_ca: Some("/nonexistent/ca.pem".into()),
                    ..https.clone()
                },
                "--etcd-ca",
            ),
            (
                FileConfig {
                    etcd_key: Some("/nonexistent/key.pem".into()),
                    ..endpoints(&["http://127.0.0.1:2379"])
                },
                "--etcd-key",
            ),
            (
                FileConfig {
                    etcd_prefix: Some("rune".into()),
                    ..endpoints(&["http://127.0.0.1:2379"])
                },
                "--etcd-prefix",
            ),
        ] {
            let err = options(layer).unwrap_err();
            assert!(
                err.starts_with(&format!("setting {flag}:")),
                "{flag}: {err}"
            );
        }
    }
}
