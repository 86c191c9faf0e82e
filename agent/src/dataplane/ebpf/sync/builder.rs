//! The table builder: a large apply builds its Maglev tables on a second thread, a
//! chunk of services ahead of the one whose backends, tables and frontends this
//! thread writes.

use super::{LbSync, SyncError, state::DesiredFrontend};
use crate::{
    dataplane::ebpf::maps::LbMaps,
    endpoints::ServiceView,
    maglev::{Maglev, MaglevError},
};
use std::time::Instant;

/// Applies that build at least this many tables build them on another thread
/// ([`LbSync::upsert_with_table_builder`]); smaller ones stay on one, where
/// starting a thread would cost more than building their tables.
pub(super) const PARALLEL_TABLES: usize = 256;

/// Services per chunk of [`LbSync::upsert_with_table_builder`]: their backends
/// go to the kernel in one batch write.
const TABLE_CHUNK: usize = 512;

/// Chunks of tables built ahead of the one being written: tables waiting to be
/// written hold memory.
const TABLE_CHUNKS_AHEAD: usize = 1;

impl<M: LbMaps> LbSync<M> {
    /// Upserts `views` (with their `desired` frontends) a chunk of services at a
    /// time, each chunk's backends before its tables and frontends, while another
    /// thread builds the Maglev tables of the chunks ahead: a table depends only on
    /// the backend addresses (its slots hold indexes into them, mapped to ids when
    /// stored), so the second core builds them while this one writes backends. At
    /// most [`TABLE_CHUNKS_AHEAD`] chunks of tables wait (bounded memory).
    pub(super) fn upsert_with_table_builder(
        &mut self,
        views: &[ServiceView],
        desired: &[Vec<DesiredFrontend>],
        now: Instant,
    ) -> Result<(), SyncError> {
        let table_size = self.capacity.table_size;
        std::thread::scope(|scope| {
            let (send, receive) = std::sync::mpsc::sync_channel(TABLE_CHUNKS_AHEAD);
            let builder = scope.spawn(move || {
                for chunk in desired.chunks(TABLE_CHUNK) {
                    let tables: Vec<Option<Result<Maglev, MaglevError>>> = chunk
                        .iter()
                        .flatten()
                        .map(|f| f.needs_table().then(|| f.build_table(table_size)))
                        .collect();
                    // The receiver is gone when the apply failed: stop.
                    if send.send(tables).is_err() {
                        return;
                    }
                }
            });
            let mut upsert = || {
                for (views, desired) in views.chunks(TABLE_CHUNK).zip(desired.chunks(TABLE_CHUNK)) {
                    let mut ids = Vec::with_capacity(desired.len());
                    for (view, desired) in views.iter().zip(desired) {
                        ids.push(self.prepare_backends(view, desired, now)?);
                    }
                    // Without the builder (it panicked), tables are built here.
                    let mut tables = receive.recv().unwrap_or_default().into_iter();
                    for ((view, desired), ids) in views.iter().zip(desired).zip(&ids) {
                        self.program_frontends(view, desired, ids, &mut tables)?;
                    }
                }
                Ok(())
            };
            let result = upsert();
            // The builder stops at its next send, and is joined here by hand: a
            // panic of its own was made up for above, and `scope` would repeat it
            // for a thread nobody joined.
            drop(receive);
            let _ = builder.join();
            result
        })
    }
}
