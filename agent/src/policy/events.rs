//! Verdict events: flows a network policy refused (or, in audit mode, would have
//! refused), as `rune-agent observe` streams them.
//!
//! A data plane that sees them (eBPF: its ring buffer reader) publishes to the
//! process's [`hub`]; the local API subscribes a receiver per `observe` call. A
//! receiver that falls behind loses the oldest events (the hub's capacity is
//! [`HUB_CAPACITY`]), never blocks the publisher.

use serde::Serialize;
use std::sync::OnceLock;
use tokio::sync::broadcast;

/// Events the hub keeps for a slow receiver.
pub const HUB_CAPACITY: usize = 4096;

/// One flow a policy refused or would have refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FlowVerdict {
    /// `ADDR:PORT` (`[ADDR]:PORT` for IPv6) of the packet's source.
    pub source: String,
    /// `ADDR:PORT` of its destination.
    pub destination: String,
    /// `TCP`, `UDP` or the IP protocol number.
    pub protocol: String,
    /// `denied` or `audit` (passed, would have been denied).
    pub verdict: &'static str,
    /// `no_matching_rule`, `port_not_allowed` or `policy_unprogrammable`.
    pub reason: &'static str,
    /// `ingress` (to the guarded endpoint) or `egress` (from it).
    pub direction: &'static str,
    /// The namespace of the service whose rules decided.
    pub namespace: String,
    /// That service's name.
    pub service: String,
}

/// The process's verdict channel.
pub fn hub() -> &'static broadcast::Sender<FlowVerdict> {
    static HUB: OnceLock<broadcast::Sender<FlowVerdict>> = OnceLock::new();
    HUB.get_or_init(|| broadcast::channel(HUB_CAPACITY).0)
}
