//! What the sync engine keeps per frontend, backend and service between applies,
//! compactly, and the records an apply's upserts pass along (the frontends asked
//! for, a service's backend ids).

use super::uses::{Users, Uses};
use crate::{
    dataplane::ebpf::backend_table::BackendAddr,
    endpoints::ServiceView,
    maglev::{BackendKey, Maglev, MaglevError},
    model::ServiceKey,
};
use agent_common::{codec::FrontendKey, lb::ServiceValue};
use smallvec::SmallVec;
use std::{net::SocketAddr, sync::Arc};

/// One frontend as the maps hold it.
#[derive(Clone, Debug)]
pub(super) struct Frontend {
    pub(super) value: ServiceValue,
    /// The service it belongs to (`None` for one adopted from the maps and not yet
    /// claimed by a service); the key shared with the service's backends' users.
    pub(super) service: Option<Arc<ServiceKey>>,
}

/// Everything the engine knows of one backend address, in one record of a
/// [`BackendTable`](crate::dataplane::ebpf::backend_table::BackendTable), kept
/// small because there is one per backend.
#[derive(Clone, Debug, Default)]
pub(super) struct BackendState {
    /// Its slot in the backends map; 0: none (id 0 is never handed out).
    pub(super) id: u32,
    /// The slot's state as the maps hold it (0 for no slot).
    pub(super) state: u8,
    /// How many services have it in their tables ([`Use::Active`](super::uses::Use::Active)): its state is
    /// active exactly when this is not 0. Kept equal to the services' `uses`, so that
    /// one service's change does not rescan every service.
    pub(super) active: u32,
    /// The services that use it in any way (active or draining).
    pub(super) users: Users,
}

impl BackendState {
    /// Its slot id, if it has a slot.
    pub(super) fn slot(&self) -> Option<u32> {
        (self.id != 0).then_some(self.id)
    }

    /// Nothing left to remember: no slot, no use.
    pub(super) fn is_empty(&self) -> bool {
        self.id == 0 && self.active == 0 && self.users.is_empty()
    }
}

/// A few frontends (one inline).
pub(super) type Frontends = SmallVec<[FrontendKey; 1]>;

/// What the sync engine remembers of a service.
#[derive(Clone, Debug, Default)]
pub(super) struct ServiceState {
    /// Its frontends, sorted (inline for one, which most services have).
    pub(super) frontends: Frontends,
    pub(super) uses: Uses,
    /// The service as last applied: `status` is derived from it when asked (it
    /// shares the cache's objects rather than copying them).
    pub(super) view: Option<ServiceView>,
}

/// A service's backends (sorted) with their slot ids, as its upsert left them
/// (ids do not change until the end of the apply): its tables take their ids from
/// here instead of a lookup in the backend table per eligible backend.
pub(super) struct BackendIds {
    pub(super) addrs: Vec<BackendAddr>,
    pub(super) ids: Vec<u32>,
}

impl BackendIds {
    /// The id of `addr`, if it is one of the service's backends.
    pub(super) fn get(&self, addr: &SocketAddr) -> Option<u32> {
        self.addrs
            .binary_search(&BackendAddr::from(*addr))
            .ok()
            .map(|i| self.ids[i])
    }
}

/// A frontend the cache asks for.
pub(super) struct DesiredFrontend {
    pub(super) key: FrontendKey,
    pub(super) eligible: Vec<SocketAddr>,
    pub(super) affinity_timeout: u32,
    /// The maps hold its table for `eligible` already: nothing to build or compare.
    pub(super) keep_table: bool,
}

impl DesiredFrontend {
    /// Whether its Maglev table is to be built.
    pub(super) fn needs_table(&self) -> bool {
        !self.keep_table && !self.eligible.is_empty()
    }

    /// Its Maglev table: slots hold indexes into `eligible`.
    pub(super) fn build_table(&self, table_size: u32) -> Result<Maglev, MaglevError> {
        let keys: Vec<BackendKey> = self.eligible.iter().copied().map(BackendKey).collect();
        Maglev::new(&keys, table_size)
    }
}

#[cfg(test)]
mod tests;
