//! The Rune node agent as a library: every concern in its own module, wired together
//! by [`run`] and driven by the thin `rune-agent` binary.
//!
//! State flows one way: ordered log → [`endpoints`] cache → data plane reconcilers →
//! kernel or proxies. The [`agent`] module owns the lifecycle of the subsystems, each
//! of which keeps the contract of [`subsystem`].

pub mod agent;
pub mod applied;
pub mod certs;
pub mod cli;
pub mod config;
pub mod dataplane;
pub mod dns;
pub mod endpoints;
pub mod error_chain;
pub mod heap;
pub mod identity;
pub mod ingress;
pub mod localapi;
mod lock;
pub mod maglev;
pub mod metrics;
pub mod model;
pub mod node;
pub mod orderedlog;
pub mod outbox;
pub mod policy;
pub mod preflight;
pub mod run;
pub mod status;
pub mod subsystem;
