//! The resolvers the settings' declarations share: a value or its default, checked.
//! Each returns the refusal's message; the declaration adds the setting's flag.

use super::{DEFAULT_DEV_DNS_ADDR, DEFAULT_DNS_ADDR, DEFAULT_DNS_DOMAIN, Mode};
use std::{fmt::Display, net::SocketAddr, ops::RangeInclusive, path::PathBuf};

/// `value`, or `default` when unset; any value is fine.
pub(super) fn or<T>(value: Option<T>, default: T) -> Result<T, String> {
    Ok(value.unwrap_or(default))
}

/// `value` (or `default`), refused when 0.
pub(super) fn at_least_1<T: PartialOrd + From<u8>>(
    value: Option<T>,
    default: T,
) -> Result<T, String> {
    let value = value.unwrap_or(default);
    if value < T::from(1) {
        return Err("must be at least 1".into());
    }
    Ok(value)
}

/// The CPUs this process may run on (at least 1): the default of the thread
/// counts.
pub(super) fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// `value` (or `default`), refused outside `range`.
pub(super) fn in_range<T: PartialOrd + Display + Copy>(
    value: Option<T>,
    default: T,
    range: RangeInclusive<T>,
) -> Result<T, String> {
    let value = value.unwrap_or(default);
    if !range.contains(&value) {
        return Err(format!(
            "{value} is out of range {}-{}",
            range.start(),
            range.end()
        ));
    }
    Ok(value)
}

/// An `ADDR:PORT` (or `default`).
pub(super) fn socket_addr(value: Option<String>, default: &str) -> Result<SocketAddr, String> {
    let text = value.as_deref().unwrap_or(default);
    text.parse()
        .map_err(|_| format!("{text:?} is not an address:port"))
}

/// Interface names from a list whose items may be comma-separated lists themselves
/// (`--interfaces a,b`, `interfaces: [a, b]`), blanks dropped.
pub(super) fn names(list: Vec<String>) -> Vec<String> {
    list.iter()
        .flat_map(|s| s.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The cgroup of the socket-LB hooks: unset the cgroup v2 root (`None`), `none` (or
/// empty) socket LB off (`Some(None)`).
pub(super) fn cgroup(value: Option<String>) -> Result<Option<Option<PathBuf>>, String> {
    Ok(value.map(|c| match c.trim() {
        "none" | "" => None,
        path => Some(PathBuf::from(path)),
    }))
}

/// The Maglev table size: a prime from 101 to [`crate::maglev::MAX_TABLE_SIZE`].
pub(super) fn maglev_table_size(value: Option<u32>, default: u32) -> Result<u32, String> {
    let size = value.unwrap_or(default);
    if !(101..=crate::maglev::MAX_TABLE_SIZE).contains(&size) || !crate::maglev::is_prime(size) {
        return Err(format!(
            "{size} is not a prime from 101 to {}",
            crate::maglev::MAX_TABLE_SIZE
        ));
    }
    Ok(size)
}

/// Upstream resolvers as socket addresses, duplicates dropped: `ADDR` means port 53;
/// IPv6 with a port is written `[ADDR]:PORT`.
pub(super) fn dns_upstreams(upstreams: Option<Vec<String>>) -> Result<Vec<SocketAddr>, String> {
    let upstreams = upstreams.unwrap_or_default();
    let mut out: Vec<SocketAddr> = Vec::with_capacity(upstreams.len());
    for raw in &upstreams {
        let text = raw.trim();
        let addr = text
            .parse::<SocketAddr>()
            .ok()
            .or_else(|| {
                text.parse::<std::net::IpAddr>()
                    .ok()
                    .map(|ip| SocketAddr::new(ip, 53))
            })
            .filter(|a| a.port() != 0 && !a.ip().is_unspecified())
            .ok_or_else(|| format!("{raw:?} is not an ADDR or ADDR:PORT"))?;
        if !out.contains(&addr) {
            out.push(addr);
        }
    }
    Ok(out)
}

/// The DNS listen addresses, duplicates dropped, or the mode's default when none are
/// given.
pub(super) fn dns_addrs(addrs: Option<Vec<String>>, mode: Mode) -> Result<Vec<SocketAddr>, String> {
    let addrs = addrs.filter(|a| !a.is_empty()).unwrap_or_else(|| {
        vec![
            match mode {
                Mode::Dev => DEFAULT_DEV_DNS_ADDR,
                Mode::Production => DEFAULT_DNS_ADDR,
            }
            .to_owned(),
        ]
    });
    let mut out: Vec<SocketAddr> = Vec::with_capacity(addrs.len());
    for a in addrs {
        let addr = socket_addr(Some(a), "")?;
        if !out.contains(&addr) {
            out.push(addr);
        }
    }
    Ok(out)
}

/// The DNS zone as a lower-case absolute name (`rune.`), checked to be a valid,
/// non-root domain name.
pub(super) fn dns_domain(domain: Option<String>) -> Result<String, String> {
    let raw = domain.as_deref().unwrap_or(DEFAULT_DNS_DOMAIN);
    let mut domain = raw.trim().to_ascii_lowercase();
    if !domain.ends_with('.') {
        domain.push('.');
    }
    let valid = domain.len() > 1
        && domain.len() <= 200
        && domain[..domain.len() - 1].split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if !valid {
        return Err(format!(
            "{raw:?} is not a domain name (e.g. \"rune\" or \"cluster.example.\")"
        ));
    }
    Ok(domain)
}

/// A listener's address: the one given, else `production` or, in dev mode,
/// `127.0.0.1:<dev_port + offset>` (shifted as the dev proxies' ports are). An
/// offset that shifts the default beyond 65535 is refused only when the listener
/// is `used`.
pub(super) fn listen_addr(
    value: Option<String>,
    mode: Mode,
    offset: u16,
    used: bool,
    (production, dev_port): (&str, u16),
) -> Result<SocketAddr, String> {
    let dev = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
    match (value, mode) {
        (Some(v), _) => socket_addr(Some(v), production),
        (None, Mode::Production) => socket_addr(None, production),
        (None, Mode::Dev) => match dev_port.checked_add(offset) {
            Some(p) => Ok(dev(p)),
            None if !used => Ok(dev(dev_port)),
            None => Err(format!(
                "port {dev_port} + --dev-port-offset {offset} is above 65535"
            )),
        },
    }
}

/// CIDRs (or single addresses), each checked.
pub(super) fn cidrs(list: Vec<String>) -> Result<Vec<ipnet::IpNet>, String> {
    list.iter()
        .filter(|s| !s.trim().is_empty())
        .map(|s| crate::model::parse_cidr(s.trim()))
        .collect()
}

/// A Secret named `NAME` (namespace `default`) or `NAMESPACE/NAME`, both DNS labels.
pub(super) fn secret_ref(
    value: Option<String>,
) -> Result<Option<crate::model::ServiceKey>, String> {
    let Some(value) = value.filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    let (namespace, name) = value
        .split_once('/')
        .unwrap_or((crate::model::DEFAULT_NAMESPACE, &value));
    let label = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !s.starts_with('-')
            && !s.ends_with('-')
    };
    if !label(namespace) || !label(name) {
        return Err(format!(
            "{value:?} is not a Secret name (NAME or NAMESPACE/NAME)"
        ));
    }
    Ok(Some(crate::model::ServiceKey::new(namespace, name)))
}
