//! Each service's objects in table `inet rune`: its ports' plans (backends,
//! affinity, refusal), the map elements and chains they make, and the element
//! types the scripts and the netlink encoder write.

use super::*;

/// The key of a map element, written in nft's syntax by `Display`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ElementKey {
    /// In the service maps (`service-vips…`, `no-endpoints…`): `VIP . proto . port`.
    Port {
        /// The VIP.
        vip: IpAddr,
        /// TCP or UDP.
        protocol: Protocol,
        /// The service port.
        port: u16,
    },
    /// In the data maps (`backends…`): `VIP . port . index`.
    Backend {
        /// The VIP.
        vip: IpAddr,
        /// The service port.
        port: u16,
        /// The backend's index among the port's eligible backends (`numgen`'s value).
        index: u32,
    },
}

impl fmt::Display for ElementKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ElementKey::Port {
                vip,
                protocol,
                port,
            } => write!(f, "{vip} . {} . {port}", proto(*protocol)),
            ElementKey::Backend { vip, port, index } => write!(f, "{vip} . {port} . {index}"),
        }
    }
}

/// The value of a map element, written in nft's syntax by `Display`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ElementValue {
    /// In the service maps: `goto CHAIN`.
    Goto(String),
    /// In the data maps: the backend, `addr . port`.
    Backend(SocketAddr),
}

impl fmt::Display for ElementValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ElementValue::Goto(chain) => write!(f, "goto {chain}"),
            ElementValue::Backend(b) => write!(f, "{} . {}", b.ip(), b.port()),
        }
    }
}

/// One element command of an element-only transaction (what the netlink batch
/// sends instead of the script).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElementOp {
    /// The map.
    pub map: &'static str,
    /// The element's key.
    pub key: ElementKey,
    /// The value to add; `None` deletes the element.
    pub value: Option<ElementValue>,
}

/// The nftables objects one service owns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceObjects {
    /// Map elements: (map, key) → value.
    pub elements: BTreeMap<(&'static str, ElementKey), ElementValue>,
    /// Chains with their rules (affinity only: the pick chains are shared).
    pub chains: BTreeMap<String, Vec<String>>,
    /// Sets (affinity) with their definition.
    pub sets: BTreeMap<String, String>,
}

/// One service port and family as programmed: where it sends new connections.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortPlan {
    /// The VIP.
    pub vip: IpAddr,
    /// TCP or UDP.
    pub protocol: Protocol,
    /// The service port.
    pub port: u16,
    /// Eligible backends (sorted); empty: the port refuses.
    pub backends: Vec<SocketAddr>,
    /// The service port's own chain (with ClientIP affinity; the name it would have
    /// otherwise).
    pub chain: String,
}

/// Whether a chain of the table belongs to network policy (`pol…`, planned by
/// `policy.rs`): the service planner leaves those alone.
pub fn is_policy_chain(name: &str) -> bool {
    name.starts_with("pol")
}

/// The protocol as nft names it.
pub fn proto(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
    }
}

fn family(ip: IpAddr) -> (&'static str, char) {
    if ip.is_ipv4() {
        ("ip", '4')
    } else {
        ("ip6", '6')
    }
}

/// The match that picks backend `i` of `n` with probability 1/n overall: backend
/// `i` is taken by 1/(n−i) of the connections the earlier rules left (the last one
/// by all of them). Plain rules rather than `numgen … map { … }`: every such map is
/// an anonymous set, and the kernel's cost per anonymous set in a large transaction
/// is an order of magnitude above these rules' (docs/modes/nftables.md).
fn pick(i: usize, n: usize) -> String {
    if i + 1 == n {
        String::new()
    } else {
        format!("numgen random mod {} 0 ", n - i)
    }
}

/// `addr:port` as a DNAT target (`[addr]:port` for IPv6).
fn dnat_dest(b: SocketAddr) -> String {
    match b.ip() {
        IpAddr::V4(ip) => format!("{ip}:{}", b.port()),
        IpAddr::V6(ip) => format!("[{ip}]:{}", b.port()),
    }
}

/// An address as it may appear inside an nft identifier (no `:`).
fn ident_addr(ip: IpAddr) -> String {
    ip.to_string().replace(':', "-")
}

/// The ports of `view` as they are programmed (none for headless services).
pub fn port_plans(view: &ServiceView, node: &str) -> Vec<PortPlan> {
    let spec = &view.service.spec;
    if spec.discovery.headless {
        return Vec::new();
    }
    let key = view.key();
    let mut out = Vec::new();
    for port in &spec.ports {
        for vip in &spec.discovery.vips {
            let (_, f) = family(*vip);
            out.push(PortPlan {
                vip: *vip,
                protocol: port.protocol,
                port: port.port,
                backends: vip::eligible(view, port, *vip, node),
                chain: format!(
                    "svc{f}-{}/{}/{}/{}",
                    key.namespace,
                    key.name,
                    proto(port.protocol),
                    port.port
                ),
            });
        }
    }
    out
}

/// The objects `view` needs.
pub fn service_objects(view: &ServiceView, node: &str) -> ServiceObjects {
    let affinity = match view.service.spec.session_affinity {
        SessionAffinity::None => None,
        SessionAffinity::ClientIp { timeout_seconds } => Some(timeout_seconds.max(1)),
    };
    let mut objects = ServiceObjects::default();
    for plan in port_plans(view, node) {
        add_port(&mut objects, &plan, affinity);
    }
    objects
}

fn add_port(objects: &mut ServiceObjects, plan: &PortPlan, affinity: Option<u32>) {
    let (ipf, f) = family(plan.vip);
    let p = proto(plan.protocol);
    let key = ElementKey::Port {
        vip: plan.vip,
        protocol: plan.protocol,
        port: plan.port,
    };
    let v4 = plan.vip.is_ipv4();
    if plan.backends.is_empty() {
        let map = if v4 { REFUSE_MAP_V4 } else { REFUSE_MAP_V6 };
        objects
            .elements
            .insert((map, key), ElementValue::Goto(REJECT_CHAIN.to_owned()));
        return;
    }
    let map = if v4 { SERVICE_MAP_V4 } else { SERVICE_MAP_V6 };
    let n = plan.backends.len();
    let Some(timeout) = affinity else {
        // Shared layout: the backends are data, the pick chain is shared.
        let data = backend_map(f, p);
        for (index, b) in (0..).zip(&plan.backends) {
            let key = ElementKey::Backend {
                vip: plan.vip,
                port: plan.port,
                index,
            };
            objects
                .elements
                .insert((data, key), ElementValue::Backend(*b));
        }
        objects
            .elements
            .insert((map, key), ElementValue::Goto(pick_chain(f, n)));
        return;
    };
    objects
        .elements
        .insert((map, key), ElementValue::Goto(plan.chain.clone()));
    // The counter comes first: it counts every new flow of the port.
    let mut rules = vec!["counter".to_owned()];
    let base = plan.chain.trim_start_matches(&format!("svc{f}-")[..]);
    let mut picks = Vec::new();
    for (i, b) in plan.backends.iter().enumerate() {
        let id = format!("{base}/{}/{}", ident_addr(b.ip()), b.port());
        let set = format!("aff{f}-{id}");
        let chain = format!("ep{f}-{id}");
        let addr_type = if v4 { "ipv4_addr" } else { "ipv6_addr" };
        objects.sets.insert(
            set.clone(),
            format!("{{ type {addr_type}; flags dynamic,timeout; timeout {timeout}s; }}"),
        );
        objects.chains.insert(
            chain.clone(),
            vec![format!(
                "update @{set} {{ {ipf} saddr }} meta l4proto {p} dnat {ipf} to {}",
                dnat_dest(*b)
            )],
        );
        rules.push(format!("{ipf} saddr @{set} goto {chain}"));
        picks.push(format!("{}goto {chain}", pick(i, n)));
    }
    rules.extend(picks);
    objects.chains.insert(plan.chain.clone(), rules);
}

/// The shared pick chains `objects` sends packets to.
pub(super) fn picks_used(objects: &ServiceObjects) -> impl Iterator<Item = &str> {
    objects.elements.values().filter_map(|v| match v {
        ElementValue::Goto(chain) if is_pick_chain(chain) => Some(chain.as_str()),
        _ => None,
    })
}

/// The rules of a shared pick chain, from its name.
pub(super) fn pick_chain_rules(chain: &str) -> Vec<String> {
    let parsed = chain
        .strip_prefix("pick")
        .and_then(|rest| rest.split_once('-'))
        .and_then(|(f, n)| Some((f.chars().next()?, n.parse().ok()?)));
    parsed.map_or_else(Vec::new, |(f, n)| pick_rules(f, n))
}
