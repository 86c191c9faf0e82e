//! Network policy: Rune's per-service `networkPolicy` rules turned into what the
//! data planes enforce.
//!
//! The model (`model::NetworkPolicy`) says, per service, which peers may reach its
//! endpoints (ingress) and which its endpoints may reach (egress), by service,
//! namespace or CIDR and by port. The data planes cannot evaluate names: [`plan`]
//! holds the same rules resolved against the endpoint cache into addresses,
//! prefixes and ports, per endpoint of this node, which the eBPF maps, the nftables
//! sets and the userspace proxies each program in their own way.

pub mod book;
pub mod compile;
pub mod events;
pub mod metrics;
pub mod plan;
pub mod status;

pub use book::PolicyBook;
pub use plan::{DirectionRules, GuardedEndpoint, PolicyMode, PolicyPlan, PortMatch, Rule};
pub use status::{PolicyState, ServicePolicyStatus};
