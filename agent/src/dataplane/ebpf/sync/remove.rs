//! Removal: a service's frontends deleted when it goes, and backends whose last
//! use ended (a drain over, or never claimed after a restart) freed together with
//! the flows that still lead to them.

use super::{
    LbSync, SyncError, prune,
    uses::{Use, Uses},
};
use crate::{
    dataplane::ebpf::{backend_table::BackendAddr, maps::LbMaps},
    model::ServiceKey,
};
use agent_common::{codec::FrontendKey, lb::Backend};
use std::time::Instant;

/// What the per-apply scratch sets keep between applies: enough for any change
/// of a few services without growing.
const SCRATCH_CAPACITY: usize = 1024;

impl<M: LbMaps> LbSync<M> {
    /// Removes service `key`: its frontends, and its uses of backends, so that the
    /// backends no other service uses are freed with their flows.
    pub(super) fn remove_service(
        &mut self,
        key: &ServiceKey,
        now: Instant,
    ) -> Result<(), SyncError> {
        let Some(state) = self.services.get(key) else {
            return Ok(());
        };
        for fk in state.frontends.clone() {
            self.delete_owned_frontend(key, &fk)?;
        }
        self.set_uses(key, Uses::default());
        self.services.remove(key);
        self.release_unused(now)
    }

    /// Deletes frontend `key` if `service` still owns it: a frontend another service
    /// claimed since (a VIP that moved in the same delta) is not this one's to delete.
    pub(super) fn delete_owned_frontend(
        &mut self,
        service: &ServiceKey,
        key: &FrontendKey,
    ) -> Result<(), SyncError> {
        match self.frontends.get(key).and_then(|f| f.service.as_ref()) {
            Some(owner) if **owner != *service => Ok(()),
            _ => self.delete_frontend(key),
        }
    }

    /// Deletes frontend `key` from the maps and the prefilter, freeing its id.
    pub(super) fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), SyncError> {
        if let Some(frontend) = self.frontends.get(key) {
            let id = frontend.value.id;
            self.maps.delete_frontend(key)?;
            self.frontends.remove(key);
            self.filter.remove(key);
            self.free_frontends.insert(id);
        }
        Ok(())
    }

    /// Frees backends no service uses any more (drain over, or never claimed after
    /// a full sync), removing the flows that still lead to them.
    pub(super) fn release_unused(&mut self, now: Instant) -> Result<(), SyncError> {
        // Drains that are over end the use (only the due ones are looked at).
        while let Some((until, key, addr)) = self.drains.first().cloned() {
            if until > now {
                break;
            }
            self.drains.pop_first();
            let current = self.services.get(&key).and_then(|s| s.uses.get(&addr));
            if current == Some(&Use::Draining { until }) {
                let mut uses = self
                    .services
                    .get(&key)
                    .map(|s| s.uses.clone())
                    .unwrap_or_default();
                uses.remove(&addr);
                self.set_uses(&key, uses);
            }
        }
        let unused: Vec<BackendAddr> = self
            .unused
            .iter()
            .filter(|a| {
                self.backends
                    .get(a)
                    .is_some_and(|b| b.users.is_empty() && b.id != 0)
            })
            .copied()
            .collect();
        if !unused.is_empty() {
            // Flows first, then the slots: if a write fails in between, no flow is
            // left naming a free id that a new backend may get (the next sync retries).
            let ids: std::collections::HashSet<u32> =
                unused.iter().filter_map(|a| self.slot_of(a)).collect();
            let purged = self.maps.purge_flows(&ids)?;
            for addr in &unused {
                if let Some(b) = self.backends.get_mut(addr).filter(|b| b.id != 0) {
                    let id = b.id;
                    self.maps.put_backend(id, &Backend::default())?;
                    b.id = 0;
                    b.state = 0;
                    self.free_backends.insert(id);
                }
                prune(&mut self.backends, addr);
            }
            tracing::debug!(backends = ids.len(), flows = purged, "backends released");
        }
        self.unused.clear();
        let mut touched: Vec<BackendAddr> = self.touched.drain().collect();
        // A full sync fills these with every backend: give that memory back
        // instead of keeping it for the next full sync.
        self.unused.shrink_to(SCRATCH_CAPACITY);
        self.touched.shrink_to(SCRATCH_CAPACITY);
        touched.sort_unstable();
        self.refresh_backend_states_of(touched.iter())
    }
}
