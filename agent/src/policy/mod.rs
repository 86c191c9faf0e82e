//! Network policy: Rune's per-service `networkPolicy` rules turned into what the
//! data planes enforce.
//!
//! The model (`model::NetworkPolicy`) says, per service, which peers may reach its
//! endpoints (ingress) and which its endpoints may reach (egress), by service,
//! namespace or CIDR and by port. The data planes cannot evaluate names: [`plan`]
//! holds the same rules resolved against the endpoint cache into addresses,
//! prefixes and ports, per endpoint of this node, which the eBPF maps, the nftables
//! verdict maps and the userspace proxies each program in their own way.
//!
//! A data plane keeps a [`PolicyBook`] fed with the endpoint cache's deltas;
//! [`compile`] turns it into the plan (the semantics live there), per service
//! ([`contribution`]), and [`incremental`] keeps the plan up to date by
//! recompiling only what a delta affects, telling the data planes which guarded
//! addresses changed ([`PlanChange`]); [`metrics`] writes
//! the verdict counts every data plane hands over as the `rune_policy_*` families;
//! [`status`] is what `status` shows per policy. User documentation:
//! `docs/policy.md`.

pub mod book;
pub mod compile;
pub mod contribution;
pub mod events;
pub mod incremental;
pub mod metrics;
pub mod plan;
pub mod status;

pub use book::PolicyBook;
pub use incremental::PlanChange;
pub use plan::{DirectionRules, GuardedEndpoint, PolicyMode, PolicyPlan, PortMatch, Rule};
pub use status::{PolicyState, ServicePolicyStatus};
