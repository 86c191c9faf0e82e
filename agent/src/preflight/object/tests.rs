use super::*;
use crate::dataplane::ebpf::{EMBEDDED_OBJECT, programs_embedded};

fn pinnings(object: &[u8]) -> Vec<u32> {
    let maps = sections(object)
        .unwrap()
        .into_iter()
        .find(|s| s.name == "maps")
        .expect("a maps section");
    (maps.offset..maps.offset + maps.size)
        .step_by(MAP_DEF_SIZE)
        .map(|d| u32_at(object, d + PINNING_OFFSET).unwrap())
        .collect()
}

#[test]
fn copy_clears_every_pinning_and_changes_nothing_else() {
    if !programs_embedded() {
        return;
    }
    let before = pinnings(EMBEDDED_OBJECT);
    assert!(
        before.contains(&1),
        "the agent's maps are pinned: {before:?}"
    );
    let copy = without_pins(EMBEDDED_OBJECT).unwrap();
    let after = pinnings(copy.bytes());
    assert_eq!(after.len(), before.len());
    assert!(after.iter().all(|p| *p == 0), "{after:?}");
    assert_eq!(copy.bytes().as_ptr().align_offset(8), 0);
    let changed = EMBEDDED_OBJECT
        .iter()
        .zip(copy.bytes())
        .filter(|(a, b)| a != b)
        .count();
    // One byte per pinned map (1 → 0, little-endian).
    assert_eq!(changed, before.iter().filter(|p| **p == 1).count());
}

#[test]
fn garbage_and_truncated_objects_are_errors() {
    assert!(without_pins(b"not an elf file").is_err());
    if programs_embedded() {
        assert!(without_pins(&EMBEDDED_OBJECT[..0x100]).is_err());
    }
}
