//! An upsert: a service's backends and their uses first, then its Maglev tables
//! and frontends, each written only where it differs from the maps.

use super::{
    LbSync, SyncError,
    state::{BackendIds, BackendState, DesiredFrontend, Frontend, ServiceState},
    uses::{Use, Uses},
};
use crate::{
    dataplane::{
        ebpf::{backend_table::BackendAddr, codec::proto_number, maps::LbMaps},
        vip,
    },
    endpoints::ServiceView,
    maglev::{Maglev, MaglevError},
    model::{ServiceKey, SessionAffinity},
};
use agent_common::{
    codec::{backend_value, frontend_key},
    lb::{BACKEND_ACTIVE, BACKEND_DRAINING, ServiceValue},
};
use std::{
    collections::BTreeSet,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

impl<M: LbMaps> LbSync<M> {
    /// First half of a service's upsert: its backend uses and backends, before any
    /// table names them. Returns its backends' ids, for
    /// [`Self::program_frontends`].
    pub(super) fn prepare_backends(
        &mut self,
        view: &ServiceView,
        desired: &[DesiredFrontend],
        now: Instant,
    ) -> Result<BackendIds, SyncError> {
        let key = view.key();
        let spec = &view.service.spec;
        let drain = Duration::from_secs(u64::from(spec.drain_seconds));

        // Backend uses: eligible ones are active; ones that were in use (by this
        // service before, or in the maps after a restart) and no longer are drain.
        let previous = self
            .services
            .get(&key)
            .map(|s| s.uses.clone())
            .unwrap_or_default();
        let mut uses = Uses::default();
        uses.reserve_active(desired.iter().map(|f| f.eligible.len()).sum());
        for f in desired {
            for addr in &f.eligible {
                uses.insert(BackendAddr::from(*addr), Use::Active);
            }
        }
        for (addr, old) in previous.iter() {
            if !uses.contains_key(addr) {
                let until = match old {
                    Use::Active => now + drain,
                    Use::Draining { until } => *until,
                };
                if until > now {
                    uses.insert(*addr, Use::Draining { until });
                }
            }
        }
        // (An address listed twice is in `uses` after its first time.)
        for addr in listed_backends(view) {
            let adopted = self
                .backends
                .get(&addr)
                .is_some_and(|b| b.id != 0 && b.state != 0);
            if adopted && !uses.contains_key(&addr) && !previous.contains_key(&addr) {
                // In the maps from before a restart: let its flows drain.
                uses.insert(addr, Use::Draining { until: now + drain });
            }
        }
        // Backends this service's adopted tables still lead to but it no longer
        // lists (an endpoint removed while no agent ran): their flows drain too.
        if !self.orphans.is_empty() {
            for f in desired {
                let Some(id) = self
                    .frontends
                    .get(&f.key)
                    .filter(|fr| fr.service.is_none())
                    .map(|fr| fr.value.id)
                else {
                    continue;
                };
                let led_to: BTreeSet<u32> = self.maps.table(id)?.iter().copied().collect();
                for slot in led_to {
                    if let Some(addr) = self.orphans.get(&slot)
                        && !uses.contains_key(addr)
                    {
                        uses.insert(*addr, Use::Draining { until: now + drain });
                    }
                }
            }
        }

        // Backends, before any table names them. In address order (`uses` is
        // sorted): ids must not depend on hash order (same maps for the same input,
        // on every run).
        let addrs: Vec<BackendAddr> = uses.keys().copied().collect();
        if !self.services.contains_key(&key) {
            self.services
                .insert(Arc::new(key.clone()), ServiceState::default());
        }
        self.set_uses(&key, uses);
        if let Some(state) = self.services.get_mut(&key) {
            state.view = Some(view.clone());
        }
        let mut ids = Vec::with_capacity(addrs.len());
        for addr in &addrs {
            ids.push(self.ensure_backend(*addr)?);
        }
        // Only this service's backends can have changed state (the rest are brought
        // up to date by `release_unused` at the end of every apply).
        self.refresh_backend_states_of(addrs.iter().chain(previous.keys()))?;
        // Their states are now what their uses ask for: no second look at the end
        // of the apply (a later change to their uses touches them again).
        for addr in addrs.iter().chain(previous.keys()) {
            self.touched.remove(addr);
        }
        Ok(BackendIds { addrs, ids })
    }

    /// Second half of a service's upsert: its tables and frontends (after
    /// [`Self::prepare_backends`] put their backends in the maps), and the removal
    /// of frontends it no longer has. `ids` is what the first half returned;
    /// `tables` holds, one per desired frontend, the table built elsewhere, if it
    /// was (else it is built here).
    pub(super) fn program_frontends(
        &mut self,
        view: &ServiceView,
        desired: &[DesiredFrontend],
        ids: &BackendIds,
        tables: &mut impl Iterator<Item = Option<Result<Maglev, MaglevError>>>,
    ) -> Result<(), SyncError> {
        let key = view.key();
        let mut keep = BTreeSet::new();
        for f in desired {
            self.write_frontend(&key, f, ids, tables.next().flatten())?;
            keep.insert(f.key);
        }
        let old_frontends = self
            .services
            .get(&key)
            .map(|s| s.frontends.clone())
            .unwrap_or_default();
        for fk in old_frontends.iter().filter(|k| !keep.contains(*k)) {
            self.delete_owned_frontend(&key, fk)?;
        }
        if let Some(state) = self.services.get_mut(&key) {
            state.frontends = keep.into_iter().collect();
            state.view = Some(view.clone());
        }
        Ok(())
    }

    /// The frontends `view` asks for, each with its eligible backends (sorted), and
    /// whether the maps hold its table for exactly those backends already: the
    /// service owned the frontend and had the same eligible backends when last
    /// applied (their ids cannot have changed: a backend keeps its slot while a
    /// service has it in a table), and no write failed since. After a failed apply
    /// the next one must be a full delta (the reconciler asks for one), whose
    /// adoption leaves no frontend owned: a partial delta would clear `stale` with
    /// a table the failed apply left behind still trusted.
    pub(super) fn desired(&self, view: &ServiceView) -> Vec<DesiredFrontend> {
        let mut out = self.frontends_of(view);
        let key = view.key();
        let before = self
            .services
            .get(&key)
            .and_then(|s| s.view.as_ref())
            .map(|old| self.frontends_of(old));
        let (Some(before), false) = (before, self.stale) else {
            return out;
        };
        let table_size = self.capacity.table_size;
        for f in &mut out {
            let owned = self.frontends.get(&f.key).filter(|existing| {
                existing.service.as_deref() == Some(&key)
                    && existing.value.maglev_size
                        == if f.eligible.is_empty() { 0 } else { table_size }
            });
            f.keep_table = owned.is_some()
                && before
                    .iter()
                    .any(|old| old.key == f.key && old.eligible == f.eligible);
        }
        out
    }

    /// The frontends `view` asks for, each with its eligible backends (sorted).
    pub(super) fn frontends_of(&self, view: &ServiceView) -> Vec<DesiredFrontend> {
        let spec = &view.service.spec;
        if spec.discovery.headless {
            return Vec::new();
        }
        let affinity_timeout = match spec.session_affinity {
            SessionAffinity::None => 0,
            SessionAffinity::ClientIp { timeout_seconds } => timeout_seconds.max(1),
        };
        let mut out = Vec::new();
        for port in &spec.ports {
            let proto = proto_number(port.protocol);
            for vip in &spec.discovery.vips {
                let eligible = vip::eligible(view, port, *vip, &self.node);
                out.push(DesiredFrontend {
                    key: frontend_key(*vip, port.port, proto),
                    eligible,
                    affinity_timeout,
                    keep_table: false,
                });
            }
        }
        out
    }

    /// Gives backend `addr` a slot unless it has one; returns the slot's id.
    pub(super) fn ensure_backend(&mut self, addr: BackendAddr) -> Result<u32, SyncError> {
        if let Some(id) = self.slot_of(&addr) {
            return Ok(id);
        }
        let id = self.free_backends.pop_first().ok_or(SyncError::Full {
            what: "backends",
            capacity: self.capacity.backends,
            setting: "--lb-max-backends",
        })?;
        let backend = backend_value(addr.socket_addr(), BACKEND_ACTIVE);
        if let Err(e) = self.maps.put_backend(id, &backend) {
            self.free_backends.insert(id);
            return Err(e.into());
        }
        let b = self.backends.get_or_default(addr);
        b.id = id;
        b.state = BACKEND_ACTIVE;
        Ok(id)
    }

    /// Writes the state of the backends at `addrs` (active when some service has
    /// it in a table, else draining) where it differs from the maps.
    pub(super) fn refresh_backend_states_of<'a>(
        &mut self,
        addrs: impl IntoIterator<Item = &'a BackendAddr>,
    ) -> Result<(), SyncError> {
        for addr in addrs {
            if let Some(b) = self.backends.get_mut(addr).filter(|b| b.id != 0) {
                refresh_backend_state(&mut self.maps, addr, b)?;
            }
        }
        Ok(())
    }

    /// Writes frontend `f` of `service` and its table (`built`, when built
    /// elsewhere; else built here unless the maps hold it already), its backends'
    /// ids taken from `known` (the service's, as its upsert left them).
    pub(super) fn write_frontend(
        &mut self,
        service: &ServiceKey,
        f: &DesiredFrontend,
        known: &BackendIds,
        built: Option<Result<Maglev, MaglevError>>,
    ) -> Result<(), SyncError> {
        let existing = self.frontends.get(&f.key).cloned();
        if let Some(Frontend {
            service: Some(owner),
            ..
        }) = &existing
            && **owner != *service
        {
            // Validation keeps VIPs unique; a clash means the other service was not
            // removed yet in this delta. The newer claim wins.
            tracing::warn!(frontend = ?f.key, %owner, %service, "frontend moves to another service");
        }
        let id = match &existing {
            Some(e) => e.value.id,
            None => self.free_frontends.pop_first().ok_or(SyncError::Full {
                what: "frontends",
                capacity: self.capacity.frontends,
                setting: "--lb-max-frontends",
            })?,
        };
        let table_size = self.capacity.table_size;
        // Still this service's table (another service of this delta may have
        // claimed the frontend since `desired` looked).
        let keep_table = f.keep_table
            && existing
                .as_ref()
                .is_some_and(|e| e.service.as_deref() == Some(service));
        let ids: Vec<u32> = if keep_table {
            Vec::new()
        } else {
            f.eligible
                .iter()
                .filter_map(|a| known.get(a).or_else(|| self.backend_id(a)))
                .collect()
        };
        let maglev_size = if let (true, Some(e)) = (keep_table, &existing) {
            e.value.maglev_size
        } else if ids.is_empty() {
            0
        } else {
            match built.unwrap_or_else(|| f.build_table(table_size)) {
                Ok(maglev) => {
                    // Only the slots that differ are stored.
                    if let Err(e) = self.maps.write_table(id, &maglev.map_slots(&ids)) {
                        if existing.is_none() {
                            self.free_frontends.insert(id);
                        }
                        return Err(e.into());
                    }
                    table_size
                }
                Err(e) => {
                    tracing::error!(frontend = ?f.key, error = %e, "cannot build the maglev table: refusing new flows");
                    0
                }
            }
        };
        let value = ServiceValue {
            id,
            maglev_base: id * table_size,
            maglev_size,
            affinity_timeout: f.affinity_timeout,
        };
        if existing.as_ref().map(|e| e.value) != Some(value)
            && let Err(e) = self.maps.put_frontend(&f.key, &value)
        {
            if existing.is_none() {
                self.free_frontends.insert(id);
            }
            return Err(e.into());
        }
        if existing.is_none() {
            self.filter.add(&f.key);
        }
        self.frontends.insert(
            f.key,
            Frontend {
                value,
                service: Some(
                    self.services
                        .get_key_value(service)
                        .map(|(k, _)| k.clone())
                        .unwrap_or_else(|| Arc::new(service.clone())),
                ),
            },
        );
        Ok(())
    }
}

/// Writes backend `addr`'s state when it differs from what its active count asks
/// for.
fn refresh_backend_state<M: LbMaps>(
    maps: &mut M,
    addr: &BackendAddr,
    slot: &mut BackendState,
) -> Result<(), SyncError> {
    let want = if slot.active != 0 {
        BACKEND_ACTIVE
    } else {
        BACKEND_DRAINING
    };
    if slot.state != want {
        maps.put_backend(slot.id, &backend_value(addr.socket_addr(), want))?;
        slot.state = want;
    }
    Ok(())
}

/// Every endpoint's socket address for each port of `view` (any state; one may come
/// twice: endpoints on one address meet on a port none of them overrides).
fn listed_backends(view: &ServiceView) -> impl Iterator<Item = BackendAddr> + '_ {
    let endpoints = view
        .endpoints
        .as_ref()
        .map(|e| &e.spec.endpoints[..])
        .unwrap_or_default();
    view.service.spec.ports.iter().flat_map(move |p| {
        endpoints
            .iter()
            .map(move |e| SocketAddr::new(e.address, e.port_for(p)).into())
    })
}
