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
pub mod ruleset;

#[cfg(test)]
mod tests;

use super::{DataPlane, DataPlaneError, ServicePortStatus, TrafficCounters, vip};
use crate::{
    endpoints::{Delta, ServiceView},
    model::ServiceKey,
    sync::lock,
};
use async_trait::async_trait;
use nft::{Nft, NftError};
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
}

struct State {
    ruleset: Ruleset,
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

fn apply_blocking(nft: &Nft, state: &Mutex<State>, delta: &Delta) -> Result<(), NftError> {
    let started = Instant::now();
    let existing = if delta.full {
        nft.existing()?
    } else {
        ruleset::Existing::default()
    };
    let mut st = lock(state);
    let plan = st.ruleset.plan(delta, &existing);
    let lines = plan.script.lines().count();
    // An element-only change goes to the kernel as one netlink batch; should the
    // kernel refuse it (nothing applied), `nft` gets the same transaction.
    let sent = match &plan.element_ops {
        Some(ops) => {
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
        None => false,
    };
    if !sent {
        nft.apply(&plan.script)?;
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
        netlink = sent,
        elapsed_us = started.elapsed().as_micros() as u64,
        "nftables table updated"
    );
    Ok(())
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
        tokio::task::spawn_blocking(move || apply_blocking(&nft, &state, &delta))
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
