//! How each service's policy stands in the data plane, as `status` shows it.

use super::PolicyMode;
use serde::{Deserialize, Serialize};
use std::fmt;

/// One service's policy as a data plane carries it out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicePolicyStatus {
    /// `namespace/name`.
    pub service: String,
    /// Enforce or audit.
    pub mode: PolicyMode,
    /// Rules in the policy's ingress list.
    pub ingress_rules: usize,
    /// Rules in the policy's egress list.
    pub egress_rules: usize,
    /// Whether the data plane enforces it.
    pub state: PolicyState,
}

/// Whether a service's policy is enforced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum PolicyState {
    /// The rules are programmed for every guarded address on this node.
    Programmed,
    /// They could not be programmed: the traffic they guard is refused (fail
    /// closed), for `reason`.
    Failed {
        /// Why, in words a user can act on.
        reason: String,
    },
    /// The data plane enforces only part of the policy (e.g. userspace: VIP
    /// traffic only), for `reason`.
    Partial {
        /// What is not covered.
        reason: String,
    },
}

impl fmt::Display for ServicePolicyStatus {
    /// `NS/NAME  MODE, N ingress rule(s), M egress  STATE`: one `status` line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match self.mode {
            PolicyMode::Enforce => "enforce",
            PolicyMode::Audit => "audit",
        };
        write!(
            f,
            "{}  {mode}, ingress rules {}, egress rules {}  ",
            self.service, self.ingress_rules, self.egress_rules
        )?;
        match &self.state {
            PolicyState::Programmed => f.write_str("programmed"),
            PolicyState::Failed { reason } => write!(f, "failed: {reason}"),
            PolicyState::Partial { reason } => write!(f, "partial: {reason}"),
        }
    }
}
