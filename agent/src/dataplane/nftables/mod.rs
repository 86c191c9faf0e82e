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
pub mod nflog;
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
use ruleset::{Ruleset, port_plans};
use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Instant,
};

use tokio_util::sync::CancellationToken;

const MODE: &str = "nftables";

/// Settings of the nftables data plane.
#[derive(Clone, Debug, Default)]
pub struct NftablesConfig {
    /// This node's name, for locality preference.
    pub node_name: String,
    /// Leave the table in the kernel on stop (traffic keeps flowing while the agent
    /// is away); `rune-agent cleanup` removes it.
    pub keep_rules_on_stop: bool,
    /// Most elements each policy set and verdict map holds (`size`); none:
    /// unbounded. More is refused by the kernel, and policy fails closed.
    pub policy_set_size: Option<u32>,
    /// NFLOG group the policy's refusals are logged to and read from, for
    /// `observe`; none: not logged.
    pub policy_log_group: Option<u16>,
}

struct State {
    ruleset: Ruleset,
    /// The desired state policy is compiled from.
    book: PolicyBook,
    /// The policy objects in the kernel.
    policy: policy::Programmed,
    /// Why the policy objects were refused, when the failure objects (fail
    /// closed) stand in for them.
    policy_failure: Option<String>,
    views: BTreeMap<ServiceKey, ServiceView>,
    /// Opened by the first element-only change; dropped after a failure.
    netlink: Option<netlink::Socket>,
    /// The NFLOG group the policy chains log to; none when not configured or
    /// when the agent cannot read it (so the kernel is never asked for a log
    /// statement it may lack).
    log_group: Option<u16>,
}

/// The nftables data plane.
pub struct NftablesDataPlane {
    nft: Nft,
    config: NftablesConfig,
    state: Arc<Mutex<State>>,
    shut: AtomicBool,
    /// Policy log events lost to a full socket buffer.
    events_lost: Arc<AtomicU64>,
    /// Stops the NFLOG reader.
    cancel: CancellationToken,
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
                policy: policy::Programmed::default(),
                policy_failure: None,
                views: BTreeMap::new(),
                netlink: None,
                log_group: None,
            })),
            config,
            shut: AtomicBool::new(false),
            events_lost: Arc::default(),
            cancel: CancellationToken::new(),
        })
    }

    /// Binds the policy's NFLOG group and publishes what it logs to `observe`'s
    /// hub until shutdown; only then do the refusing chains log to it. Needs a
    /// tokio runtime and runs before the first delta. A group that cannot be
    /// bound (another process holds it, or the kernel has no NFLOG) is named in
    /// the log and leaves `observe` empty and the rules without a log
    /// statement: enforcement never depends on logging.
    pub fn start_policy_events(&self) {
        let Some(group) = self.config.policy_log_group else {
            return;
        };
        let socket = match nflog::open(group) {
            Ok(socket) => socket,
            Err(e) => {
                tracing::warn!(error = %e, group, "cannot read the policy's NFLOG group (--nft-policy-log-group): observe shows nothing");
                return;
            }
        };
        lock(&self.state).log_group = Some(group);
        let state = self.state.clone();
        let resolve = move |digest: &str| {
            lock(&state)
                .book
                .rule_counts()
                .into_keys()
                .find(|k| nflog::digest(k) == digest)
        };
        tokio::spawn(nflog::read(
            socket,
            resolve,
            self.events_lost.clone(),
            self.cancel.clone(),
        ));
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
    let mut guard = lock(state);
    let st = &mut *guard;
    let plan = st.ruleset.plan(delta, &existing);
    let lines = plan.script.lines().count();
    // Policy: what the delta changed (a full delta: everything; after a refusal
    // every transaction tries the whole plan again), in the same transaction.
    let change = st.book.apply(delta);
    let policy_plan = st.book.plan();
    let pending = |kind: policy::Objects| {
        if delta.full {
            let chains = &existing.chains;
            Some(policy::Programmed::full(
                policy_plan,
                kind,
                chains,
                set_size,
            ))
        } else if st.policy_failure.is_some() || kind == policy::Objects::Failed {
            let all = st.policy.all_addresses(policy_plan);
            Some(st.policy.change(policy_plan, &all, kind))
        } else if !change.addresses.is_empty() {
            Some(st.policy.change(policy_plan, &change.addresses, kind))
        } else {
            None
        }
    };
    let desired = pending(policy::Objects::Rules {
        log_group: st.log_group,
        size: set_size,
    });
    let policy_part = desired
        .as_ref()
        .map(|p| p.script.clone())
        .unwrap_or_default();
    // An element-only change (DNAT maps, policy sets and maps) goes to the kernel
    // as one netlink batch; should the kernel refuse it (nothing applied), `nft`
    // gets the same transaction.
    let policy_ops = desired
        .as_ref()
        .filter(|p| !p.script.is_empty())
        .map(|p| p.elements.as_ref());
    let ops: Option<Vec<netlink::Element>> = match (&plan.element_ops, policy_ops) {
        (Some(ops), None) => Some(ops.iter().map(Into::into).collect()),
        (Some(ops), Some(Some(policy))) => Some(
            ops.iter()
                .map(Into::into)
                .chain(policy.iter().cloned())
                .collect(),
        ),
        (None, Some(Some(policy))) if plan.is_empty() => Some(policy.clone()),
        _ => None,
    };
    let sent = match ops {
        Some(ops) => {
            let result = match st.netlink.take() {
                Some(socket) => Ok(socket),
                None => netlink::Socket::open(),
            }
            .and_then(|mut socket| socket.apply(&ops).map(|()| socket));
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
    if sent {
        if let Some(pending) = desired {
            st.policy.commit(pending);
            st.policy_failure = None;
        }
    } else {
        let script = format!("{}{policy_part}", plan.script);
        match nft.apply(&script) {
            Ok(()) => {
                if let Some(pending) = desired {
                    st.policy.commit(pending);
                    st.policy_failure = None;
                }
            }
            Err(e) if !policy_part.is_empty() => {
                // Fail closed: the same transaction with every guarded address
                // refused instead of the policy the kernel did not take.
                let failed =
                    pending(policy::Objects::Failed).expect("policy_part comes from a change");
                let script = format!("{}{}", plan.script, failed.script);
                nft.apply(&script)?;
                tracing::error!(error = %e, "the kernel refused the policy: guarded traffic is refused");
                st.policy.commit(failed);
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
            events_lost: self.events_lost.clone(),
        }
    }
}

/// Exports the policy metric families from the table's counters.
pub struct PolicyCollector {
    nft: Nft,
    state: Arc<Mutex<State>>,
    events_lost: Arc<AtomicU64>,
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
        let counts = if rules.is_empty() {
            Default::default()
        } else {
            self.nft
                .named_counters()
                .map(|c| policy::verdict_counts(&c))
                .unwrap_or_default()
        };
        crate::policy::metrics::encode(&mut encoder, &counts, &rules)?;
        let mut family = encoder.encode_descriptor(
            "policy_events_dropped",
            "Policy verdict events not written for `observe`, by reason",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        let lost = self.events_lost.load(Ordering::Relaxed);
        prometheus_client::encoding::EncodeMetric::encode(
            &prometheus_client::metrics::counter::ConstCounter::new(lost),
            family.encode_family(&[("reason", "buffer_full")])?,
        )
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
        self.cancel.cancel();
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
