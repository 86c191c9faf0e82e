//! The agent's map layouts in tests that fill or read the maps by hand.

/// Sets Maglev slot `slot` to backend `id` in `RUNE_MAGLEV` (two slots per entry,
/// see `agent_common::lb::MAGLEV`).
pub fn set_maglev_slot<T: std::borrow::BorrowMut<aya::maps::MapData>>(
    map: &mut aya::maps::Array<T, [u32; 2]>,
    slot: u32,
    id: u32,
) {
    let mut pair = map.get(&(slot / 2), 0).expect("reading a Maglev entry");
    pair[(slot % 2) as usize] = id;
    map.set(slot / 2, pair, 0).expect("writing a Maglev entry");
}

/// Reads Maglev slot `slot` of `RUNE_MAGLEV`.
pub fn maglev_slot<T: std::borrow::Borrow<aya::maps::MapData>>(
    map: &aya::maps::Array<T, [u32; 2]>,
    slot: u32,
) -> u32 {
    map.get(&(slot / 2), 0).expect("reading a Maglev entry")[(slot % 2) as usize]
}
