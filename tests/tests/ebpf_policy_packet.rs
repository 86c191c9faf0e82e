//! The network policy programs (`rune_tc_policy_to`, `rune_tc_policy_from`) on
//! crafted packets through `BPF_PROG_TEST_RUN`, with their maps filled by the
//! agent's own policy sync from a `PolicyPlan`: nothing is sent on any network.
//! Needs root (loading programs, bpffs).

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use agent_common::policy::{self as pol, EVENTS_PER_WINDOW, Verdict, VerdictEvent};
use aya::{
    Ebpf, EbpfLoader,
    maps::{MapData, RingBuf},
    programs::SchedClassifier,
};
use rune_agent::{
    dataplane::ebpf::{
        EMBEDDED_OBJECT,
        policy::{KernelPolicyMaps, POLICY_MAPS, PolicyMaps as _, PolicySync, sync::INGRESS},
    },
    model::{Protocol, ServiceKey},
    policy::{
        DirectionRules, GuardedEndpoint, PolicyMode, PolicyPlan, PolicyState, PortMatch, Rule,
    },
};
use rune_harness::{
    bpffs::PinDir,
    netns::require_root,
    packet::{PacketSpec, TCP_ACK, TCP_SYN},
    prog_test_run::test_run,
};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;

/// `web`'s endpoint (enforce), guarded by ingress rules.
const WEB: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 2);
/// `audit`'s endpoint: the same rules in audit mode.
const AUDITED: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 3);
/// `lockdown`'s endpoint: egress rules that allow nothing, no ingress rules.
const LOCKED: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 4);
/// An address no policy guards.
const OPEN: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 9);
/// `web6`'s endpoint.
const WEB6: Ipv6Addr = Ipv6Addr::new(0xfd00, 1, 0, 0, 0, 0, 0, 2);
/// The allowed client.
const CLIENT_A: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
/// A client no rule names.
const CLIENT_B: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 11);
const CLIENT_A6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xc, 0, 0, 0, 0, 0, 10);

fn svc(name: &str) -> ServiceKey {
    ServiceKey::new("default", name)
}

/// Rules allowing `peers` on TCP `ports` (all ports when empty).
fn rules(service: &str, mode: PolicyMode, peers: &[&str], ports: &[u16]) -> DirectionRules {
    DirectionRules {
        mode,
        service: svc(service),
        rules: vec![Rule {
            peers: peers.iter().map(|p| p.parse().unwrap()).collect(),
            ports: ports
                .iter()
                .map(|port| PortMatch {
                    protocol: Protocol::Tcp,
                    port: *port,
                })
                .collect(),
        }],
    }
}

fn plan() -> PolicyPlan {
    let mut plan = PolicyPlan::default();
    let mut guard = |addr: IpAddr, service: &str, ingress, egress| {
        plan.endpoints.insert(
            addr,
            GuardedEndpoint {
                services: [svc(service)].into(),
                ingress,
                egress,
            },
        );
        plan.services.insert(svc(service), 1);
    };
    let a = "198.19.0.10/32";
    guard(
        WEB.into(),
        "web",
        Some(rules("web", PolicyMode::Enforce, &[a], &[8080])),
        None,
    );
    guard(
        AUDITED.into(),
        "audit",
        Some(rules("audit", PolicyMode::Audit, &[a], &[8080])),
        None,
    );
    guard(
        LOCKED.into(),
        "lockdown",
        None,
        Some(DirectionRules {
            mode: PolicyMode::Enforce,
            service: svc("lockdown"),
            rules: Vec::new(),
        }),
    );
    guard(
        WEB6.into(),
        "web6",
        Some(rules("web6", PolicyMode::Enforce, &["fd00:c::/64"], &[])),
        None,
    );
    plan
}

/// The programs loaded, their maps pinned in a fresh directory and filled by the
/// agent's policy sync.
struct Policy {
    ebpf: Ebpf,
    sync: PolicySync<KernelPolicyMaps>,
    events: RingBuf<MapData>,
    _pins: PinDir,
}

impl Policy {
    /// Loads the object with `peers` entries per peer trie and applies `plan`.
    fn new(peers: u32, plan: &PolicyPlan) -> Self {
        if let Err(e) = require_root() {
            panic!("{e}");
        }
        assert!(!EMBEDDED_OBJECT.is_empty(), "agent built without eBPF");
        let pins = PinDir::create("ebpf-policy").unwrap_or_else(|e| panic!("{e:#}"));
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(pol::PEERS_V4, peers)
            .map_max_entries(pol::PEERS_V6, peers)
            .default_map_pin_directory(pins.path())
            .load(EMBEDDED_OBJECT)
            .unwrap_or_else(|e| panic!("load the object: {e:#}"));
        for name in [pol::PROG_POLICY_TO, pol::PROG_POLICY_FROM] {
            let tc: &mut SchedClassifier = ebpf.program_mut(name).expect(name).try_into().unwrap();
            tc.load().unwrap_or_else(|e| panic!("load {name}: {e:#?}"));
        }
        let mut taken = BTreeMap::new();
        for name in POLICY_MAPS {
            taken.insert(name.to_owned(), ebpf.take_map(name).expect(name));
        }
        let events = RingBuf::try_from(ebpf.take_map(pol::EVENTS).expect(pol::EVENTS)).unwrap();
        let mut sync = PolicySync::new(KernelPolicyMaps::new(&mut taken).unwrap());
        sync.apply(plan).unwrap_or_else(|e| panic!("apply: {e}"));
        Self {
            ebpf,
            sync,
            events,
            _pins: pins,
        }
    }

    /// The next verdict event in the ring buffer.
    fn next_event(&mut self) -> Option<VerdictEvent> {
        let item = self.events.next()?;
        assert!(item.len() >= size_of::<VerdictEvent>());
        // SAFETY: a `VerdictEvent`, plain integers; read unaligned.
        Some(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<VerdictEvent>()) })
    }

    fn run(&self, prog: &str, spec: &PacketSpec) -> u32 {
        let p: &SchedClassifier = self.ebpf.program(prog).unwrap().try_into().unwrap();
        let run = test_run(p.fd().unwrap(), &spec.build(), 1).unwrap();
        assert_eq!(run.data, spec.build(), "the policy programs never rewrite");
        run.retval
    }

    /// A packet to a local endpoint (tc egress of the policy interface).
    fn to(&self, spec: &PacketSpec) -> u32 {
        self.run(pol::PROG_POLICY_TO, spec)
    }

    /// A packet from a local endpoint (tc ingress).
    fn from(&self, spec: &PacketSpec) -> u32 {
        self.run(pol::PROG_POLICY_FROM, spec)
    }

    fn count(&self, service: &str, dir: u8, verdict: Verdict) -> u64 {
        let counter = self.sync.counters()[&(svc(service), dir)];
        self.sync.maps().verdicts(counter).unwrap()[verdict as usize]
    }
}

fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> PacketSpec {
    PacketSpec {
        tcp_flags: flags,
        ..PacketSpec::tcp(src.into(), sport, dst.into(), dport)
    }
}

#[test]
fn allowed_peer_and_port_pass_others_are_dropped_and_counted() {
    let p = Policy::new(64, &plan());
    assert_eq!(p.to(&tcp(CLIENT_A, 40000, WEB, 8080, TCP_SYN)), TC_ACT_OK);
    assert_eq!(p.count("web", INGRESS, Verdict::Allow), 1);
    assert_eq!(p.to(&tcp(CLIENT_B, 40000, WEB, 8080, TCP_SYN)), TC_ACT_SHOT);
    assert_eq!(p.count("web", INGRESS, Verdict::DropNoMatchingRule), 1);
    assert_eq!(p.to(&tcp(CLIENT_A, 40001, WEB, 9090, TCP_SYN)), TC_ACT_SHOT);
    assert_eq!(p.count("web", INGRESS, Verdict::DropPortNotAllowed), 1);
    // UDP to the TCP-only port: not allowed either.
    let udp = PacketSpec::udp(CLIENT_A.into(), 40002, WEB.into(), 8080);
    assert_eq!(p.to(&udp), TC_ACT_SHOT);
    assert_eq!(p.count("web", INGRESS, Verdict::DropPortNotAllowed), 2);
    // No policy: anything passes, nothing counted.
    assert_eq!(p.to(&tcp(CLIENT_B, 40000, OPEN, 22, TCP_SYN)), TC_ACT_OK);
    assert_eq!(p.count("web", INGRESS, Verdict::Allow), 1);
}

#[test]
fn an_allowed_flow_continues_and_its_replies_pass_without_a_rule_lookup() {
    let p = Policy::new(64, &plan());
    assert_eq!(p.to(&tcp(CLIENT_A, 40000, WEB, 8080, TCP_SYN)), TC_ACT_OK);
    assert_eq!(p.to(&tcp(CLIENT_A, 40000, WEB, 8080, TCP_ACK)), TC_ACT_OK);
    assert_eq!(
        p.from(&tcp(WEB, 8080, CLIENT_A, 40000, TCP_SYN | TCP_ACK)),
        TC_ACT_OK
    );
    // Counted once, as a new flow.
    assert_eq!(p.count("web", INGRESS, Verdict::Allow), 1);
    // A mid-stream packet of a flow never allowed is checked (and dropped).
    assert_eq!(p.to(&tcp(CLIENT_B, 40000, WEB, 8080, TCP_ACK)), TC_ACT_SHOT);
}

#[test]
fn egress_rules_drop_new_flows_but_not_replies_to_allowed_ingress() {
    let p = Policy::new(64, &plan());
    // lockdown has no ingress rules: the client's flow is let in, and remembered
    // so the reply passes lockdown's (deny-everything) egress rules.
    assert_eq!(p.to(&tcp(CLIENT_B, 40000, LOCKED, 80, TCP_SYN)), TC_ACT_OK);
    assert_eq!(
        p.from(&tcp(LOCKED, 80, CLIENT_B, 40000, TCP_SYN | TCP_ACK)),
        TC_ACT_OK
    );
    // A connection lockdown opens itself is dropped.
    assert_eq!(
        p.from(&tcp(LOCKED, 40000, CLIENT_B, 80, TCP_SYN)),
        TC_ACT_SHOT
    );
    assert_eq!(
        p.count("lockdown", pol::DIR_EGRESS, Verdict::DropNoMatchingRule),
        1
    );
}

#[test]
fn replies_find_their_flow_whichever_end_the_key_puts_first() {
    let p = Policy::new(64, &plan());
    // The conntrack key puts the lower end first (as the program loads the
    // addresses: the last octet weighs most on little-endian): 198.19.0.1 sorts
    // below LOCKED, CLIENT_B above it.
    for client in [Ipv4Addr::new(198, 19, 0, 1), CLIENT_B] {
        assert_eq!(p.to(&tcp(client, 40000, LOCKED, 80, TCP_SYN)), TC_ACT_OK);
        assert_eq!(
            p.from(&tcp(LOCKED, 80, client, 40000, TCP_SYN | TCP_ACK)),
            TC_ACT_OK,
            "{client}: the reply"
        );
        // Another port of the same two ends is no known flow: lockdown's egress
        // rules drop it.
        assert_eq!(
            p.from(&tcp(LOCKED, 80, client, 40001, TCP_ACK)),
            TC_ACT_SHOT,
            "{client}: another flow"
        );
    }
}

#[test]
fn audit_mode_passes_and_counts_what_it_would_drop_once_per_flow() {
    let p = Policy::new(64, &plan());
    assert_eq!(
        p.to(&tcp(CLIENT_B, 40000, AUDITED, 8080, TCP_SYN)),
        TC_ACT_OK
    );
    assert_eq!(
        p.to(&tcp(CLIENT_B, 40000, AUDITED, 8080, TCP_ACK)),
        TC_ACT_OK
    );
    assert_eq!(p.to(&tcp(CLIENT_A, 40000, AUDITED, 22, TCP_SYN)), TC_ACT_OK);
    assert_eq!(p.count("audit", INGRESS, Verdict::AuditNoMatchingRule), 1);
    assert_eq!(p.count("audit", INGRESS, Verdict::AuditPortNotAllowed), 1);
    assert_eq!(p.count("audit", INGRESS, Verdict::DropNoMatchingRule), 0);
}

#[test]
fn ipv6_peers_match_by_prefix() {
    let p = Policy::new(64, &plan());
    let spec = |src: Ipv6Addr| PacketSpec::tcp(src.into(), 40000, WEB6.into(), 443);
    assert_eq!(p.to(&spec(CLIENT_A6)), TC_ACT_OK);
    assert_eq!(
        p.to(&spec(Ipv6Addr::new(0xfd00, 0xd, 0, 0, 0, 0, 0, 10))),
        TC_ACT_SHOT
    );
}

#[test]
fn a_policy_that_does_not_fit_denies_its_endpoints_and_reports_the_cause() {
    // One IPv4 peer entry: web's and audit's rules share one rule set and fit.
    // lockdown needs none; a bigger policy for web does not fit.
    let mut plan = plan();
    plan.endpoints.get_mut(&IpAddr::V4(WEB)).unwrap().ingress = Some(rules(
        "web",
        PolicyMode::Enforce,
        &["198.19.0.10/32", "198.19.0.20/32"],
        &[8080],
    ));
    let p = Policy::new(1, &plan);
    assert_eq!(p.to(&tcp(CLIENT_A, 40000, WEB, 8080, TCP_SYN)), TC_ACT_SHOT);
    assert_eq!(p.count("web", INGRESS, Verdict::DropUnprogrammable), 1);
    let state = &p.sync.services()[&svc("web")].2;
    match state {
        PolicyState::Failed { reason } => assert!(
            reason.contains(pol::PEERS_V4) && reason.contains("--policy-max-entries"),
            "{reason}"
        ),
        other => panic!("web's policy: {other:?}"),
    }
    // audit's rule set fitted and is enforced (as audit).
    assert_eq!(p.sync.services()[&svc("audit")].2, PolicyState::Programmed);
    assert_eq!(
        p.to(&tcp(CLIENT_A, 40000, AUDITED, 8080, TCP_SYN)),
        TC_ACT_OK
    );
    assert_eq!(p.count("audit", INGRESS, Verdict::Allow), 1);
}

#[test]
fn refused_flows_become_events_rate_limited_per_cpu() {
    let mut p = Policy::new(64, &plan());
    let denied = tcp(CLIENT_B, 40000, WEB, 8080, TCP_SYN);
    assert_eq!(p.to(&denied), TC_ACT_SHOT);
    let e = p.next_event().expect("an event for the refused SYN");
    assert_eq!(e.saddr[0], u32::from_ne_bytes(CLIENT_B.octets()));
    assert_eq!(e.daddr[0], u32::from_ne_bytes(WEB.octets()));
    assert_eq!(
        (u16::from_be(e.sport), u16::from_be(e.dport)),
        (40000, 8080)
    );
    assert_eq!(e.verdict, Verdict::DropNoMatchingRule as u8);
    assert_eq!(e.dir, pol::DIR_INGRESS);
    assert_eq!(e.counter, p.sync.counters()[&(svc("web"), INGRESS)]);
    // Allowed flows make none.
    assert_eq!(p.to(&tcp(CLIENT_A, 40000, WEB, 8080, TCP_SYN)), TC_ACT_OK);
    assert!(p.next_event().is_none());
    // A flood in one run (one CPU, far shorter than a window): the budget is
    // written, the rest counted.
    let prog: &SchedClassifier = p
        .ebpf
        .program(pol::PROG_POLICY_TO)
        .unwrap()
        .try_into()
        .unwrap();
    let run = test_run(prog.fd().unwrap(), &denied.build(), 1000).unwrap();
    assert_eq!(run.retval, TC_ACT_SHOT);
    let mut events = 0u64;
    while p.next_event().is_some() {
        events += 1;
    }
    let [rate_limited, full] = p.sync.maps().event_drops().unwrap();
    assert_eq!(events + rate_limited + full, 1000);
    assert!(events < EVENTS_PER_WINDOW * 2, "{events} events written");
    assert!(rate_limited > 0);
}
