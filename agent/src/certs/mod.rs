//! Certificates for etcd's mutual TLS, made without openssl: [`init`] creates a CA,
//! the etcd members' server certificate and the admin's client certificate in one
//! directory; [`issue_node`] signs a node's client certificate (CN = node id) with
//! that CA. etcd started with `--client-cert-auth` takes a client certificate's CN
//! as its user name, which is what the roles of [`rbac`] are granted to.
//!
//! The directory is made private (0700), keys are written 0600, and no existing
//! file is replaced unless asked (`force`). The user-facing description is the
//! "Security" section of docs/etcd.md.

pub mod client;
mod files;
pub mod rbac;

pub use files::{Written, private_dir};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use std::{
    io,
    net::IpAddr,
    path::{Path, PathBuf},
};
use thiserror::Error;
use time::{Duration, OffsetDateTime};

/// The CA's certificate, in the directory [`init`] makes.
pub const CA_CERT: &str = "ca.pem";
/// The CA's private key.
pub const CA_KEY: &str = "ca-key.pem";
/// The etcd members' certificate (server and peer).
pub const SERVER_CERT: &str = "server.pem";
/// The etcd members' private key.
pub const SERVER_KEY: &str = "server-key.pem";
/// The admin's client certificate (CN [`ADMIN_CN`]).
pub const ADMIN_CERT: &str = "admin.pem";
/// The admin's private key.
pub const ADMIN_KEY: &str = "admin-key.pem";
/// The admin certificate's CN: its etcd user name, granted etcd's `root` role.
pub const ADMIN_CN: &str = "rune-admin";
/// The server certificate's CN (etcd checks the SANs; the CN is for people).
pub const SERVER_CN: &str = "rune-etcd";
/// Names the server certificate always holds, so that etcd's own tools and a
/// local client reach a member on its host.
pub const DEFAULT_SANS: [&str; 2] = ["localhost", "127.0.0.1"];
/// Validity of the certificates when not told otherwise.
pub const DEFAULT_DAYS: u32 = 365;
/// Validity of the CA when not told otherwise.
pub const DEFAULT_CA_DAYS: u32 = 3650;
/// Node ids (and so etcd user names) that would take an admin's powers: never
/// issued to a node.
pub const RESERVED_NODE_IDS: [&str; 2] = ["root", ADMIN_CN];

/// Why certificates could not be made.
#[derive(Debug, Error)]
pub enum CertsError {
    /// A file to be written exists and `force` was not given.
    #[error("{} exists: not replaced (use --force to replace it)", .path.display())]
    Exists {
        /// The file.
        path: PathBuf,
    },
    /// The directory has no CA to sign with.
    #[error(
        "{} holds no CA ({} missing): run `rune-agent certs init {}` first",
        .dir.display(), .missing.display(), .dir.display()
    )]
    NoCa {
        /// The directory.
        dir: PathBuf,
        /// The CA file that is missing.
        missing: PathBuf,
    },
    /// A file could not be read.
    #[error("cannot read {}: {source}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A file or the directory could not be written.
    #[error("cannot write {}: {source}", .path.display())]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The CA's certificate or key cannot be used.
    #[error("CA {}: {message}", .path.display())]
    BadCa {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A node id or subject alternative name that cannot go into a certificate.
    #[error("{what} {value:?}: {reason}")]
    BadName {
        /// `node id` or `SAN`.
        what: &'static str,
        /// The value as given.
        value: String,
        /// Why it is refused.
        reason: String,
    },
    /// A validity that cannot be used.
    #[error("validity: {0}")]
    BadValidity(String),
    /// rcgen failed to make a key or a certificate (rare).
    #[error("making {what}: {message}")]
    Generate {
        /// Which certificate or key.
        what: String,
        /// rcgen's error.
        message: String,
    },
}

/// When a certificate is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    /// Not before this instant.
    pub not_before: OffsetDateTime,
    /// Not after this instant.
    pub not_after: OffsetDateTime,
}

impl Validity {
    /// From an hour ago (clocks of members and nodes differ a little) for `days`
    /// days; at least 1 day.
    pub fn days(days: u32) -> Result<Validity, CertsError> {
        if days == 0 {
            return Err(CertsError::BadValidity("must be at least 1 day".to_owned()));
        }
        if days > 100 * 365 {
            return Err(CertsError::BadValidity(format!(
                "{days} days is more than 100 years"
            )));
        }
        let now = OffsetDateTime::now_utc();
        Ok(Validity {
            not_before: now - Duration::hours(1),
            not_after: now + Duration::days(i64::from(days)),
        })
    }

    /// Exactly `not_before..=not_after` (a validity in the past makes an expired
    /// certificate, which tests need); `not_after` must not precede `not_before`.
    pub fn between(
        not_before: OffsetDateTime,
        not_after: OffsetDateTime,
    ) -> Result<Validity, CertsError> {
        if not_after < not_before {
            return Err(CertsError::BadValidity(format!(
                "ends ({not_after}) before it starts ({not_before})"
            )));
        }
        Ok(Validity {
            not_before,
            not_after,
        })
    }
}

impl Validity {
    /// This validity, ending no later than `ca` does: a certificate is of no use
    /// once its CA has expired.
    pub fn within(&self, ca: &Validity) -> Validity {
        Validity {
            not_before: self.not_before,
            not_after: self.not_after.min(ca.not_after),
        }
    }
}

/// What [`init`] makes.
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// Host names and IP addresses of the etcd members, for the server certificate
    /// (besides [`DEFAULT_SANS`]).
    pub sans: Vec<String>,
    /// Validity of the server and admin certificates.
    pub validity: Validity,
    /// Validity of the CA.
    pub ca_validity: Validity,
    /// Replace existing files.
    pub force: bool,
}

/// Creates in `dir` (made 0700) a CA, the etcd server certificate for `sans` plus
/// [`DEFAULT_SANS`] (serverAuth and clientAuth: etcd members use it towards their
/// peers too) and the admin client certificate (CN [`ADMIN_CN`]), these ending no
/// later than the CA. Nothing is written when any of the files exists, unless
/// `force`.
pub fn init(dir: &Path, options: &InitOptions) -> Result<Vec<Written>, CertsError> {
    let sans = server_sans(&options.sans)?;
    let targets = [
        CA_CERT,
        CA_KEY,
        SERVER_CERT,
        SERVER_KEY,
        ADMIN_CERT,
        ADMIN_KEY,
    ]
    .map(|name| dir.join(name));
    if !options.force {
        files::refuse_existing(&targets)?;
    }
    let ca_key = new_key("the CA key")?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name = name(&format!(
        "rune CA {}",
        OffsetDateTime::now_utc().unix_timestamp()
    ));
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    set_validity(&mut ca, &options.ca_validity);
    ca.serial_number = Some(serial());
    let ca_cert = ca
        .self_signed(&ca_key)
        .map_err(|e| generate("the CA certificate", e))?;
    let issuer = Issuer::new(ca, ca_key);
    let validity = options.validity.within(&options.ca_validity);

    let server = leaf(
        &issuer,
        SERVER_CN,
        sans,
        &[
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
        &validity,
    )?;
    let admin = leaf(
        &issuer,
        ADMIN_CN,
        Vec::new(),
        &[ExtendedKeyUsagePurpose::ClientAuth],
        &validity,
    )?;

    private_dir(dir)?;
    let [
        ca_cert_path,
        ca_key_path,
        server_cert,
        server_key,
        admin_cert,
        admin_key,
    ] = targets;
    let force = options.force;
    Ok(vec![
        files::write(&ca_key_path, &issuer.key().serialize_pem(), true, force)?,
        files::write(&ca_cert_path, &ca_cert.pem(), false, force)?,
        files::write(&server_key, &server.1, true, force)?,
        files::write(&server_cert, &server.0, false, force)?,
        files::write(&admin_key, &admin.1, true, force)?,
        files::write(&admin_cert, &admin.0, false, force)?,
    ])
}

/// The certificate file of node `node_id` in a directory of [`init`].
pub fn node_cert_file(dir: &Path, node_id: &str) -> PathBuf {
    dir.join(format!("node-{node_id}.pem"))
}

/// The key file of node `node_id` in a directory of [`init`].
pub fn node_key_file(dir: &Path, node_id: &str) -> PathBuf {
    dir.join(format!("node-{node_id}-key.pem"))
}

/// Signs with `dir`'s CA a client certificate for node `node_id` (CN = the node
/// id, clientAuth only), ending no later than the CA: `node-<id>.pem` and
/// `node-<id>-key.pem` (0600). Refused when either exists, unless `force`.
pub fn issue_node(
    dir: &Path,
    node_id: &str,
    validity: &Validity,
    force: bool,
) -> Result<Vec<Written>, CertsError> {
    check_node_id(node_id)?;
    let (cert_path, key_path) = (node_cert_file(dir, node_id), node_key_file(dir, node_id));
    if !force {
        files::refuse_existing(&[cert_path.clone(), key_path.clone()])?;
    }
    let (issuer, ca_validity) = load_ca(dir)?;
    let (cert, key) = leaf(
        &issuer,
        node_id,
        Vec::new(),
        &[ExtendedKeyUsagePurpose::ClientAuth],
        &validity.within(&ca_validity),
    )?;
    private_dir(dir)?;
    Ok(vec![
        files::write(&key_path, &key, true, force)?,
        files::write(&cert_path, &cert, false, force)?,
    ])
}

/// Refuses node ids that cannot be an etcd user name and a key segment
/// (`<prefix>nodes/<id>`): 1 to 128 of `A-Z a-z 0-9 . _ -`, not `.` or `..`, and
/// not a name with an admin's powers ([`RESERVED_NODE_IDS`]).
pub fn check_node_id(node_id: &str) -> Result<(), CertsError> {
    let bad = |reason: &str| CertsError::BadName {
        what: "node id",
        value: node_id.to_owned(),
        reason: reason.to_owned(),
    };
    if node_id.is_empty() || node_id.len() > 128 {
        return Err(bad("must be 1 to 128 characters long"));
    }
    if let Some(c) = node_id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(bad(&format!(
            "contains {c:?}: only A-Z a-z 0-9 . _ - may be used (it becomes an etcd user name and a key segment)"
        )));
    }
    if node_id == "." || node_id == ".." {
        return Err(bad("is not a key segment"));
    }
    if RESERVED_NODE_IDS.contains(&node_id) {
        return Err(bad(
            "is the name of an etcd user with an admin's powers: a node must not get it",
        ));
    }
    Ok(())
}

/// `sans` plus [`DEFAULT_SANS`], each once, as IP addresses or DNS names.
fn server_sans(sans: &[String]) -> Result<Vec<SanType>, CertsError> {
    let mut out: Vec<SanType> = Vec::new();
    for value in sans.iter().map(String::as_str).chain(DEFAULT_SANS) {
        let bad = |reason: &str| CertsError::BadName {
            what: "SAN",
            value: value.to_owned(),
            reason: reason.to_owned(),
        };
        let san = match value.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => {
                let host = value.strip_prefix("*.").unwrap_or(value);
                if host.is_empty()
                    || host.len() > 253
                    || host.split('.').any(|label| {
                        label.is_empty()
                            || label.len() > 63
                            || !label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                    })
                {
                    return Err(bad(
                        "is neither an IP address nor a DNS name (labels of A-Z a-z 0-9 -, \
                         optionally starting with *.)",
                    ));
                }
                SanType::DnsName(
                    value
                        .to_ascii_lowercase()
                        .try_into()
                        .map_err(|e: rcgen::Error| bad(&e.to_string()))?,
                )
            }
        };
        if !out.contains(&san) {
            out.push(san);
        }
    }
    Ok(out)
}

/// A new P-256 key.
fn new_key(what: &str) -> Result<KeyPair, CertsError> {
    KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|e| generate(what, e))
}

/// A subject of one CN.
fn name(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn
}

fn set_validity(params: &mut CertificateParams, validity: &Validity) {
    params.not_before = validity.not_before;
    params.not_after = validity.not_after;
}

/// A random positive serial number of 16 bytes.
fn serial() -> SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    bytes[0] = (bytes[0] & 0x7f) | 0x01;
    SerialNumber::from_slice(&bytes)
}

/// A certificate signed by `issuer` for `cn` (and `sans`), with `usages`, and its
/// new key: both PEM.
fn leaf(
    issuer: &Issuer<'_, KeyPair>,
    cn: &str,
    sans: Vec<SanType>,
    usages: &[ExtendedKeyUsagePurpose],
    validity: &Validity,
) -> Result<(String, String), CertsError> {
    let what = format!("the certificate of {cn}");
    let key = new_key(&what)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = name(cn);
    params.subject_alt_names = sans;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = usages.to_vec();
    params.use_authority_key_identifier_extension = true;
    params.serial_number = Some(serial());
    set_validity(&mut params, validity);
    let cert = params
        .signed_by(&key, issuer)
        .map_err(|e| generate(&what, e))?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// `dir`'s CA, checked: a CA certificate whose public key is its key's; and when it
/// is valid.
fn load_ca(dir: &Path) -> Result<(Issuer<'static, KeyPair>, Validity), CertsError> {
    let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
    for path in [&cert_path, &key_path] {
        if !path.exists() {
            return Err(CertsError::NoCa {
                dir: dir.to_owned(),
                missing: path.clone(),
            });
        }
    }
    let read = |path: &PathBuf| {
        std::fs::read_to_string(path).map_err(|source| CertsError::Read {
            path: path.clone(),
            source,
        })
    };
    let (cert_pem, key_pem) = (read(&cert_path)?, read(&key_path)?);
    let bad = |path: &Path, message: String| CertsError::BadCa {
        path: path.to_owned(),
        message,
    };
    let key = KeyPair::from_pem(&key_pem)
        .map_err(|e| bad(&key_path, format!("not a private key rcgen can use: {e}")))?;
    let validity = check_ca(&cert_path, &cert_pem, &key)?;
    let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)
        .map_err(|e| bad(&cert_path, format!("not a certificate: {e}")))?;
    Ok((issuer, validity))
}

/// Refuses a CA certificate that is not a CA, has expired, or whose public key is
/// not `key`'s (certificates signed with it would not verify); returns when it is
/// valid.
fn check_ca(path: &Path, pem: &str, key: &KeyPair) -> Result<Validity, CertsError> {
    let bad = |message: String| CertsError::BadCa {
        path: path.to_owned(),
        message,
    };
    let (_, block) = x509_parser::pem::parse_x509_pem(pem.as_bytes())
        .map_err(|e| bad(format!("no PEM certificate: {e}")))?;
    let cert = block
        .parse_x509()
        .map_err(|e| bad(format!("not an X.509 certificate: {e}")))?;
    if !cert.is_ca() {
        return Err(bad(
            "is not a CA certificate (basicConstraints CA:FALSE)".to_owned()
        ));
    }
    if cert.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
        return Err(bad(format!(
            "does not belong to the key {CA_KEY} next to it"
        )));
    }
    let not_after = cert.validity().not_after.timestamp();
    if not_after < OffsetDateTime::now_utc().unix_timestamp() {
        return Err(bad(format!(
            "expired on {}: make a new CA (`rune-agent certs init --force`) and reissue every certificate",
            cert.validity().not_after
        )));
    }
    let instant = |t: i64| {
        OffsetDateTime::from_unix_timestamp(t)
            .map_err(|e| bad(format!("a validity date out of range: {e}")))
    };
    Ok(Validity {
        not_before: instant(cert.validity().not_before.timestamp())?,
        not_after: instant(not_after)?,
    })
}

fn generate(what: &str, e: rcgen::Error) -> CertsError {
    CertsError::Generate {
        what: what.to_owned(),
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests;
