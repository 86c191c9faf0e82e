//! The nftables data plane: service VIPs DNATed in the kernel by nftables, for
//! kernels that cannot run the eBPF programs.
//!
//! Everything lives in the agent's own table `inet rune` (no other table is ever
//! touched). [`ruleset`] computes the table from the endpoint cache and the commands
//! that get the kernel there from what was programmed last; [`nft`] applies them as
//! one `nft -f` transaction per delta, or [`netlink`] as one nfnetlink batch when the
//! planner says the delta is element commands only. Conntrack keeps each flow on its
//! backend and translates the replies, so established flows survive endpoint changes
//! and agent restarts; a restarted agent adopts the table it finds in one
//! transaction.

pub mod netlink;
pub mod nft;
pub mod policy;
pub mod ruleset;

#[cfg(test)]
mod tests;

use super::{DataPlane, DataPlaneError, ServicePortStatus, TrafficCounters, vip};
use crate::{
    endpoints::{Delta, ServiceView},
    lock::lock,
    model::ServiceKey,
    policy::{PolicyBook, PolicyState, ServicePolicyStatus},
};
use async_trait::async_trait;
use nft::{Nft, NftError};
use policy::PolicyObjects;
use ruleset::{Ruleset, port_plans};
use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

const MODE: &str = "nftables";

/// Settings of the nftables data plane.
#[derive(Clone, Debug, Default)]
pub struct NftablesConfig {
    /// This node's name, for locality preference.
    pub node_name: String,
    /// Leave the table in the kernel on stop (traffic keeps flowing while the agent
    /// is away); `rune-agent cleanup` removes it.
    pub keep_rules_on_stop: bool,
    /// Most elements each policy verdict map holds (`size`); none: unbounded. More
    /// is refused by the kernel, and policy fails closed.
    pub policy_set_size: Option<u32>,
}

struct State {
    ruleset: Ruleset,
    /// The desired state policy is compiled from.
    book: PolicyBook,
    /// The policy objects in the kernel.
    policy: PolicyObjects,
    /// Why the policy objects were refused, when the failure objects (fail
    /// closed) stand in for them.
    policy_failure: Option<String>,
    views: BTreeMap<ServiceKey, ServiceView>,
    /// Opened by the first element-only change; dropped after a failure.
    netlink: Option<netlink::Socket>,
}

/// The nftables data plane.
pub struct NftablesDataPlane {
    nft: Nft,
    config: NftablesConfig,
    state: Arc<Mutex<State>>,
    shut: AtomicBool,
}

impl NftablesDataPlane {
    /// Checks that `nft` runs with the rights it needs. The table is adopted (or
    /// created) by the first full delta.
    pub fn new(config: NftablesConfig) -> Result<Self, DataPlaneError> {
        let nft = Nft::default();
        nft.check().map_err(apply_err)?;
        Ok(Self {
            nft,
            state: Arc::new(Mutex::new(State {
                ruleset: Ruleset::new(config.node_name.clone()),
                book: PolicyBook::new(&config.node_name),
                policy: PolicyObjects::default(),
                policy_failure: None,
                views: BTreeMap::new(),
                netlink: None,
            })),
            config,
            shut: AtomicBool::new(false),
        })
    }
}

fn apply_err(e: NftError) -> DataPlaneError {
    DataPlaneError::Apply {
        mode: MODE,
        reason: e.to_string(),
    }
}

/// Removes table `inet rune` and everything in it (nothing when there is none).
/// For `rune-agent cleanup` and mode switches.
pub fn cleanup() -> Result<bool, NftError> {
    Nft::default().delete_table()
}

fn apply_blocking(
    nft: &Nft,
    state: &Mutex<State>,
    delta: &Delta,
    set_size: Option<u32>,
) -> Result<(), NftError> {
    let started = Instant::now();
    let existing = if delta.full {
        nft.existing()?
    } else {
        ruleset::Existing::default()
    };
    let mut st = lock(state);
    let plan = st.ruleset.plan(delta, &existing);
    let lines = plan.script.lines().count();
    // Policy: recompiled when the delta may change it, in the same transaction.
    let policy_changed = st.book.apply(delta);
    let policy_plan = (delta.full || policy_changed).then(|| st.book.plan());
    let policy_script = |objects: &PolicyObjects, old: &PolicyObjects| {
        if delta.full {
            policy::full_script(objects, &existing.chains, set_size)
        } else {
            policy::change_script(old, objects)
        }
    };
    let desired = policy_plan.as_ref().map(policy::objects);
    let policy_part = desired
        .as_ref()
        .map(|o| policy_script(o, &st.policy))
        .unwrap_or_default();
    // An element-only change goes to the kernel as one netlink batch; should the
    // kernel refuse it (nothing applied), `nft` gets the same transaction.
    let sent = match (&plan.element_ops, policy_part.is_empty()) {
        (Some(ops), true) => {
            let result = match st.netlink.take() {
                Some(socket) => Ok(socket),
                None => netlink::Socket::open(),
            }
            .and_then(|mut socket| socket.apply(ops).map(|()| socket));
            match result {
                Ok(socket) => {
                    st.netlink = Some(socket);
                    true
                }
                Err(e) => {
                    tracing::warn!(error = %e, "netlink batch failed, retrying with nft");
                    false
                }
            }
        }
        _ => false,
    };
    if !sent {
        let script = format!("{}{policy_part}", plan.script);
        match nft.apply(&script) {
            Ok(()) => {
                if let Some(objects) = desired {
                    st.policy = objects;
                    st.policy_failure = None;
                }
            }
            Err(e) if !policy_part.is_empty() => {
                // Fail closed: the same transaction with every guarded address
                // refused instead of the policy the kernel did not take.
                let policy_plan = policy_plan.as_ref().expect("policy_part comes from a plan");
                let failed = policy::failed_objects(policy_plan);
                let script = format!("{}{}", plan.script, policy_script(&failed, &st.policy));
                nft.apply(&script)?;
                tracing::error!(error = %e, "the kernel refused the policy: guarded traffic is refused");
                st.policy = failed;
                st.policy_failure = Some(e.to_string());
            }
            Err(e) => return Err(e),
        }
    }
    st.ruleset.commit(plan);
    if delta.full {
        st.views.clear();
    }
    for key in &delta.removed {
        st.views.remove(key);
    }
    for view in &delta.upserted {
        st.views.insert(view.key(), view.clone());
    }
    tracing::debug!(
        full = delta.full,
        adopted = existing.table,
        commands = lines,
        policy_commands = policy_part.lines().count(),
        netlink = sent,
        elapsed_us = started.elapsed().as_micros() as u64,
        "nftables table updated"
    );
    Ok(())
}

impl NftablesDataPlane {
    /// The policy metrics, read from the table's named counters at each scrape.
    pub fn collector(&self) -> PolicyCollector {
        PolicyCollector {
            nft: self.nft.clone(),
            state: self.state.clone(),
        }
    }
}

/// Exports the policy metric families from the table's counters.
pub struct PolicyCollector {
    nft: Nft,
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for PolicyCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PolicyCollector")
    }
}

impl prometheus_client::collector::Collector for PolicyCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        let rules = lock(&self.state).book.rule_counts();
        if rules.is_empty() {
            return crate::policy::metrics::encode(&mut encoder, &Default::default(), &rules);
        }
        let counts = self
            .nft
            .named_counters()
            .map(|c| policy::verdict_counts(&c))
            .unwrap_or_default();
        crate::policy::metrics::encode(&mut encoder, &counts, &rules)
    }
}

#[async_trait]
impl DataPlane for NftablesDataPlane {
    fn mode(&self) -> &'static str {
        MODE
    }

    async fn apply(&self, delta: &Delta) -> Result<(), DataPlaneError> {
        if self.shut.load(Ordering::SeqCst) {
            return Err(DataPlaneError::ShutDown { mode: MODE });
        }
        let nft = self.nft.clone();
        let state = self.state.clone();
        let delta = delta.clone();
        let set_size = self.config.policy_set_size;
        tokio::task::spawn_blocking(move || apply_blocking(&nft, &state, &delta, set_size))
            .await
            .map_err(|e| DataPlaneError::Apply {
                mode: MODE,
                reason: e.to_string(),
            })?
            .map_err(apply_err)
    }

    fn status(&self) -> Vec<ServicePortStatus> {
        let counters = self.nft.port_counters().unwrap_or_default();
        let st = lock(&self.state);
        let node = &self.config.node_name;
        let mut out = Vec::new();
        for view in st.views.values() {
            let plans = port_plans(view, node);
            for mut row in vip::port_status(view) {
                let flows: Option<u64> = plans
                    .iter()
                    .filter(|p| p.port == row.port && p.protocol == row.protocol)
                    .filter(|p| !p.backends.is_empty())
                    .map(|p| {
                        let key = (p.vip, ruleset::proto(p.protocol).to_owned(), p.port);
                        counters.get(&key).copied()
                    })
                    .sum();
                row.counters = flows.map(|flows| TrafficCounters {
                    flows,
                    ..TrafficCounters::default()
                });
                out.push(row);
            }
        }
        out
    }

    fn programs(&self) -> Vec<String> {
        let refused = self.nft.refused().ok().flatten();
        let services = lock(&self.state).ruleset.len();
        vec![format!(
            "nftables table {}: {services} services; connections refused (no endpoints): {}",
            ruleset::TABLE,
            refused.map_or_else(|| "unknown".to_owned(), |n| n.to_string())
        )]
    }

    fn policy(&self) -> Vec<ServicePolicyStatus> {
        let st = lock(&self.state);
        let state = match &st.policy_failure {
            None => PolicyState::Programmed,
            Some(reason) => PolicyState::Failed {
                reason: format!(
                    "the kernel refused the policy sets or rules ({reason}); guarded traffic is refused"
                ),
            },
        };
        st.book.statuses(state)
    }

    async fn shutdown(&self) {
        if self.shut.swap(true, Ordering::SeqCst) {
            return;
        }
        if self.config.keep_rules_on_stop {
            tracing::info!(
                table = ruleset::TABLE,
                "keeping the nftables table (--keep-rules-on-stop); `rune-agent cleanup` removes it"
            );
            return;
        }
        let nft = self.nft.clone();
        let state = self.state.clone();
        let result = tokio::task::spawn_blocking(move || {
            let _guard = lock(&state);
            nft.apply(&ruleset::delete_script())
        })
        .await;
        match result {
            Ok(Ok(())) => tracing::info!(table = ruleset::TABLE, "nftables table removed"),
            Ok(Err(e)) => tracing::error!(error = %e, "removing the nftables table failed"),
            Err(e) => tracing::error!(error = %e, "removing the nftables table failed"),
        }
    }
}
