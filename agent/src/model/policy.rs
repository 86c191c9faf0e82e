//! `spec.networkPolicy` of a Service: which peers may reach the service's endpoints
//! (ingress) and which peers its endpoints may reach (egress).
//!
//! Peers and ports stay as written (strings) so that validation can name the bad
//! value exactly; [`Service::validate`](super::Service) checks them at apply and the
//! compiler (`crate::policy`) parses them again, knowing they are valid.

use super::{ModelError, Protocol, ServiceSpec, check_dns_label};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// A service's network policy: any ingress rule makes ingress to its endpoints
/// default-deny, any egress rule egress from them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NetworkPolicy {
    /// Enforce (drop what no rule allows) or audit (count it, allow it).
    #[serde(default)]
    pub mode: PolicyMode,
    /// Who may reach the service's endpoints.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<IngressRule>,
    /// What the service's endpoints may reach.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<EgressRule>,
}

/// Whether a policy drops what its rules do not allow.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum PolicyMode {
    /// Packets no rule allows are dropped.
    #[default]
    Enforce,
    /// Nothing is dropped; packets no rule allows are counted and reported.
    Audit,
}

/// One ingress allow rule.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngressRule {
    /// The sources allowed; empty means any source.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub from: Vec<Peer>,
    /// The ports allowed; empty means every port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<String>,
}

/// One egress allow rule.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressRule {
    /// The destinations allowed; empty means any destination.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub to: Vec<Peer>,
    /// The destination ports allowed; empty means every port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<String>,
}

/// One peer of a rule: exactly one of a service (optionally in another
/// namespace), every service of a namespace, or a CIDR prefix.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Peer {
    /// A service's name: its endpoints (on any node) and its VIPs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// With `service`: the service's namespace (default: the policy's own). Alone:
    /// every service of that namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Any address in the prefix, IPv4 or IPv6.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr: Option<String>,
}

/// A peer as the compiler uses it, from a valid [`Peer`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PeerSelector {
    /// The service `namespace/name`.
    Service {
        /// Its namespace (already defaulted).
        namespace: String,
        /// Its name.
        name: String,
    },
    /// Every service of the namespace.
    Namespace(String),
    /// A prefix.
    Cidr(IpNet),
}

impl Peer {
    /// What the peer selects, the service's namespace defaulting to `own_namespace`;
    /// `None` for a peer [`Peer::check`] refuses.
    pub fn selector(&self, own_namespace: &str) -> Option<PeerSelector> {
        match (&self.service, &self.namespace, &self.cidr) {
            (Some(name), ns, None) => Some(PeerSelector::Service {
                namespace: ns.as_deref().unwrap_or(own_namespace).to_owned(),
                name: name.clone(),
            }),
            (None, Some(ns), None) => Some(PeerSelector::Namespace(ns.clone())),
            (None, None, Some(cidr)) => parse_cidr(cidr).ok().map(PeerSelector::Cidr),
            _ => None,
        }
    }

    /// Checks that the peer names exactly one selector, with valid values.
    fn check(&self, object: &str, field: &str) -> Result<(), ModelError> {
        match (&self.service, &self.namespace, &self.cidr) {
            (Some(name), ns, None) => {
                check_dns_label(object, &format!("{field}.service"), name)?;
                if let Some(ns) = ns {
                    check_dns_label(object, &format!("{field}.namespace"), ns)?;
                }
                Ok(())
            }
            (None, Some(ns), None) => check_dns_label(object, &format!("{field}.namespace"), ns),
            (None, None, Some(cidr)) => parse_cidr(cidr)
                .map(|_| ())
                .map_err(|message| ModelError::invalid(object, format!("{field}.cidr"), message)),
            (None, None, None) => Err(ModelError::invalid(
                object,
                field,
                "a peer needs one of service, namespace or cidr",
            )),
            _ => Err(ModelError::invalid(
                object,
                field,
                format!(
                    "a peer names exactly one of service (with an optional namespace), \
                     namespace or cidr; this one names {}",
                    self.named().join(" and ")
                ),
            )),
        }
    }

    /// The selector fields set, for error messages.
    fn named(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.service.is_some() {
            out.push("service");
        }
        if self.namespace.is_some() {
            out.push("namespace");
        }
        if self.cidr.is_some() {
            out.push("cidr");
        }
        out
    }
}

/// Parses a CIDR prefix, refusing one with host bits set (it names the prefix the
/// user probably meant).
pub fn parse_cidr(text: &str) -> Result<IpNet, String> {
    let net: IpNet = text.parse().map_err(|_| {
        format!("{text:?} is not a CIDR prefix (address/length, e.g. 198.18.0.0/24)")
    })?;
    if net.trunc() != net {
        return Err(format!("{text} has host bits set: write {}", net.trunc()));
    }
    Ok(net)
}

/// One entry of a rule's `ports`, parsed.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PortEntry {
    /// `N`, `N/tcp`, `N/udp` (TCP when no protocol is given, as for service ports).
    Number {
        /// The port.
        port: u16,
        /// Its protocol.
        protocol: Protocol,
    },
    /// A port name of the policy's own service.
    Name(String),
}

impl PortEntry {
    /// Parses one `ports` entry of a policy of a service with `spec`.
    pub fn parse(text: &str, spec: &ServiceSpec) -> Result<PortEntry, String> {
        let (number, protocol) = match text.split_once('/') {
            Some((n, p)) => {
                let protocol = match p.to_ascii_lowercase().as_str() {
                    "tcp" => Protocol::Tcp,
                    "udp" => Protocol::Udp,
                    _ => {
                        return Err(format!("{text:?}: unknown protocol {p:?} (tcp or udp)"));
                    }
                };
                (n, Some(protocol))
            }
            None => (text, None),
        };
        if !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()) {
            return match number.parse::<u32>() {
                Ok(port @ 1..=65535) => Ok(PortEntry::Number {
                    port: port as u16,
                    protocol: protocol.unwrap_or_default(),
                }),
                _ => Err(format!("{text:?}: port {number} is out of range 1-65535")),
            };
        }
        if protocol.is_some() {
            return Err(format!(
                "{text:?} is not a port: write N, N/tcp, N/udp or a port name"
            ));
        }
        if spec
            .ports
            .iter()
            .any(|p| !p.name.is_empty() && p.name == text)
        {
            return Ok(PortEntry::Name(text.to_owned()));
        }
        let names: Vec<&str> = spec
            .ports
            .iter()
            .filter(|p| !p.name.is_empty())
            .map(|p| p.name.as_str())
            .collect();
        Err(format!(
            "{text:?} is neither a port number (N, N/tcp, N/udp) nor a port name of this \
             service (names: {})",
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            }
        ))
    }
}

impl NetworkPolicy {
    /// Checks every peer and port of the policy of a service with `spec`.
    pub(super) fn check(&self, object: &str, spec: &ServiceSpec) -> Result<(), ModelError> {
        let base = "spec.networkPolicy";
        for (i, rule) in self.ingress.iter().enumerate() {
            let field = format!("{base}.ingress[{i}]");
            check_peers(object, &format!("{field}.from"), &rule.from)?;
            check_ports(object, &format!("{field}.ports"), &rule.ports, spec, true)?;
        }
        for (i, rule) in self.egress.iter().enumerate() {
            let field = format!("{base}.egress[{i}]");
            check_peers(object, &format!("{field}.to"), &rule.to)?;
            check_ports(object, &format!("{field}.ports"), &rule.ports, spec, false)?;
        }
        Ok(())
    }
}

fn check_peers(object: &str, field: &str, peers: &[Peer]) -> Result<(), ModelError> {
    for (j, peer) in peers.iter().enumerate() {
        peer.check(object, &format!("{field}[{j}]"))?;
    }
    Ok(())
}

/// Checks a rule's ports. Egress ports are destination ports of other services,
/// so a name of this service means nothing there: egress takes numbers only.
fn check_ports(
    object: &str,
    field: &str,
    ports: &[String],
    spec: &ServiceSpec,
    names_allowed: bool,
) -> Result<(), ModelError> {
    for (j, text) in ports.iter().enumerate() {
        let field = format!("{field}[{j}]");
        match PortEntry::parse(text, spec) {
            Ok(PortEntry::Name(_)) if !names_allowed => {
                return Err(ModelError::invalid(
                    object,
                    field,
                    format!(
                        "{text:?}: egress ports are destination port numbers \
                         (N, N/tcp, N/udp); port names are for ingress rules"
                    ),
                ));
            }
            Ok(_) => {}
            Err(message) => return Err(ModelError::invalid(object, field, message)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
