use super::PolicyGate;
use crate::{
    endpoints::Delta,
    model::{Protocol, ServiceKey},
    policy::{
        compile::tests::{service, views},
        metrics::{Direction, DropReason, Verdict},
    },
};
use std::net::IpAddr;

fn gate(policy: &str) -> PolicyGate {
    let yaml = service(
        "shop",
        "web",
        "[{name: http, port: 80, targetPort: 8080}]",
        "198.18.100.1",
        policy,
        "[{address: 198.18.11.2}, {address: 198.18.12.2, node: node-z}]",
    );
    let gate = PolicyGate::new();
    gate.apply(&Delta {
        full: true,
        upserted: views(&yaml).into_values().collect(),
        ..Delta::default()
    });
    gate
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn the_client_and_the_backends_target_port_decide() {
    let g = gate("{ingress: [{from: [{cidr: 198.18.1.2/32}], ports: [http]}]}");
    let backend = "198.18.11.2:8080".parse().unwrap();
    assert!(g.admit(ip("198.18.1.2"), backend, Protocol::Tcp));
    assert!(!g.admit(ip("198.18.1.3"), backend, Protocol::Tcp));
    assert!(!g.admit(ip("198.18.1.2"), backend, Protocol::Udp));
    assert!(
        !g.admit(
            ip("198.18.1.3"),
            "198.18.12.2:8080".parse().unwrap(),
            Protocol::Tcp
        ),
        "another node's endpoint: checked here too (no other node checks it)"
    );
    let counts = g.counts.lock().unwrap().clone();
    let web = ServiceKey::new("shop", "web");
    assert_eq!(
        counts[&(web.clone(), Direction::Ingress, Verdict::Allow)],
        1
    );
    assert_eq!(
        counts[&(
            web.clone(),
            Direction::Ingress,
            Verdict::Drop(DropReason::NoMatchingRule)
        )],
        2
    );
    assert_eq!(
        counts[&(
            web,
            Direction::Ingress,
            Verdict::Drop(DropReason::PortNotAllowed)
        )],
        1
    );
    let status = g.statuses();
    assert_eq!(status.len(), 1);
    assert!(
        matches!(&status[0].state, crate::policy::PolicyState::Partial { reason } if reason.contains("VIPs only"))
    );
}

#[test]
fn audit_mode_admits_and_counts() {
    let g = gate("{mode: audit, ingress: [{from: [{cidr: 198.18.1.2/32}]}]}");
    assert!(g.admit(
        ip("198.18.1.3"),
        "198.18.11.2:8080".parse().unwrap(),
        Protocol::Tcp
    ));
    let counts = g.counts.lock().unwrap().clone();
    assert_eq!(
        counts[&(
            ServiceKey::new("shop", "web"),
            Direction::Ingress,
            Verdict::AuditWouldDrop
        )],
        1
    );
}
