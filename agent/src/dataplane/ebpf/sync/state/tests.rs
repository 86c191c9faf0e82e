use super::*;

/// The per-backend record stays compact: there is one per backend.
#[test]
fn backend_records_stay_compact() {
    assert_eq!(size_of::<Users>(), 16);
    assert!(
        size_of::<BackendState>() <= 32,
        "{}",
        size_of::<BackendState>()
    );
}
