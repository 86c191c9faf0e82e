//! The agent's side of the VIP prefilter (`agent_common::filter`): the bitmap the
//! tc/XDP programs test before their frontend lookup, kept equal to the set of
//! frontends in the maps.
//!
//! [`VipFilter`] counts the frontends per bit, so removing one of two frontends
//! that share a bit keeps the bit; a change marks its word, and [`VipFilter::write`]
//! rewrites only the marked words, each recomputed from the frontends hashing into
//! it. [`VipFilter::reset`] (after the engine re-read the maps, as on a restart
//! over pinned maps) marks every word, so whatever an earlier agent left in the
//! pinned map is replaced. A map that was never written is all zeros, which filters
//! nothing (see `agent_common::filter`): an upgrade that adds the map is safe before
//! the first write.

use super::{error::MapsError, maps::LbMaps};
use agent_common::codec::FrontendKey;
use agent_common::filter::{VIP_FILTER_WORDS, vip_filter_bit_v4, vip_filter_bit_v6};
use std::collections::{BTreeMap, BTreeSet};

/// Frontends per filter bit, and the words to rewrite.
#[derive(Debug, Default)]
pub struct VipFilter {
    /// Bit → how many frontends hash to it (only bits with at least one).
    counts: BTreeMap<u32, u32>,
    /// Words changed since the last [`Self::write`].
    dirty: BTreeSet<u32>,
}

/// The filter bit of `key`.
#[must_use]
pub fn bit_of(key: &FrontendKey) -> u32 {
    match key {
        FrontendKey::V4(k) => vip_filter_bit_v4(k.addr, k.port, k.proto),
        FrontendKey::V6(k) => vip_filter_bit_v6(&k.addr, k.port, k.proto),
    }
}

impl VipFilter {
    /// Starts over from `keys`, every word to be rewritten.
    pub fn reset<'a>(&mut self, keys: impl IntoIterator<Item = &'a FrontendKey>) {
        self.counts.clear();
        for key in keys {
            *self.counts.entry(bit_of(key)).or_default() += 1;
        }
        self.dirty = (0..VIP_FILTER_WORDS).collect();
    }

    /// A frontend was added to the maps (each key once until it is removed).
    pub fn add(&mut self, key: &FrontendKey) {
        let bit = bit_of(key);
        *self.counts.entry(bit).or_default() += 1;
        self.dirty.insert(bit / 64);
    }

    /// A frontend was removed from the maps.
    pub fn remove(&mut self, key: &FrontendKey) {
        let bit = bit_of(key);
        if let Some(count) = self.counts.get_mut(&bit) {
            *count -= 1;
            if *count == 0 {
                self.counts.remove(&bit);
            }
        }
        self.dirty.insert(bit / 64);
    }

    /// Word `index` of the map: a bit set where no frontend hashes.
    #[must_use]
    pub fn word(&self, index: u32) -> u64 {
        let first = index * 64;
        let present = self
            .counts
            .range(first..first + 64)
            .fold(0u64, |w, (bit, _)| w | 1 << (bit - first));
        !present
    }

    /// Writes the changed words into `maps`; on error they stay marked.
    pub fn write<M: LbMaps>(&mut self, maps: &mut M) -> Result<(), MapsError> {
        if self.dirty.is_empty() {
            return Ok(());
        }
        let words: Vec<(u32, u64)> = self.dirty.iter().map(|&w| (w, self.word(w))).collect();
        maps.put_vip_filter(&words)?;
        self.dirty.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests;
