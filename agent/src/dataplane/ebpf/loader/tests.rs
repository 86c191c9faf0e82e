use super::*;

#[test]
fn embedded_object_matches_build_mode() {
    // Either a real ELF object or, with AYA_BUILD_SKIP=1, nothing at all.
    if programs_embedded() {
        assert_eq!(&EMBEDDED_OBJECT[..4], b"\x7fELF");
    } else {
        assert!(matches!(
            load_embedded(Path::new("/nonexistent")),
            Err(EbpfError::NotEmbedded)
        ));
    }
}
