//! What the kernel data planes (eBPF, nftables) derive alike from a service: the
//! backends that get new flows (socket addresses: an endpoint's address and its
//! port for the service port) and the `status` rows.

use crate::{
    dataplane::{BackendState, BackendStatus, PortState, ServicePortStatus},
    endpoints::ServiceView,
    model::{Endpoint, LocalityPreference, ServicePort},
};
use std::net::{IpAddr, SocketAddr};

/// Backends of `view`'s port `port` for VIP `vip` that get new flows: ready,
/// non-terminating, same family, filtered by locality preference as seen from
/// `node`; sorted, each socket address once (endpoints on one address are as many
/// backends as they have distinct ports).
pub fn eligible(
    view: &ServiceView,
    port: &ServicePort,
    vip: IpAddr,
    node: &str,
) -> Vec<SocketAddr> {
    let ready: Vec<&Endpoint> = view
        .endpoint_list()
        .iter()
        .filter(|e| e.address.is_ipv4() == vip.is_ipv4() && e.accepts_new())
        .collect();
    let local: Vec<&Endpoint> = ready.iter().copied().filter(|e| *e.node == *node).collect();
    let chosen = match view.service.spec.discovery.locality_preference {
        LocalityPreference::Any => ready,
        LocalityPreference::LocalOnly => local,
        LocalityPreference::PreferLocal if !local.is_empty() => local,
        LocalityPreference::PreferLocal => ready,
    };
    let mut out: Vec<SocketAddr> = chosen
        .iter()
        .map(|e| SocketAddr::new(e.address, e.port_for(port)))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// The `status` rows of `view`'s ports in a kernel data plane (state, listen
/// address, backends), without counters: each plane adds its own.
pub fn port_status(view: &ServiceView) -> Vec<ServicePortStatus> {
    let spec = &view.service.spec;
    let mut out = Vec::new();
    for port in &spec.ports {
        // `desired` gives every non-headless service a frontend per VIP × port.
        let vip = spec.discovery.vips.first().copied();
        let state = if spec.discovery.headless {
            PortState::Failed {
                reason: "headless: no VIP to balance (DNS only)".into(),
            }
        } else if vip.is_none() {
            PortState::Failed {
                reason: "the service has no VIP".into(),
            }
        } else {
            PortState::Listening
        };
        let backends = view
            .port_backends(port)
            .into_iter()
            .map(|b| BackendStatus {
                address: b.addr.ip(),
                port: b.addr.port(),
                node: b.endpoint.node.to_string(),
                state: BackendState::of(b.endpoint),
                counters: None,
            })
            .collect();
        out.push(ServicePortStatus {
            service: view.key().to_string(),
            port: port.port,
            protocol: port.protocol,
            listen: vip.map(|v| SocketAddr::new(v, port.port)),
            state,
            endpoints_known: view.endpoints.is_some(),
            backends,
            counters: None,
        });
    }
    out
}
