use super::*;

#[test]
fn error_is_small_enough_to_return_by_value() {
    // clippy::result_large_err's threshold; large aya sources are boxed.
    assert!(
        size_of::<EbpfError>() < 128,
        "EbpfError {} ProgramError {} MapError {}",
        size_of::<EbpfError>(),
        size_of::<ProgramError>(),
        size_of::<MapError>()
    );
}

#[test]
fn not_embedded_message_says_how_to_fix() {
    let message = EbpfError::NotEmbedded.to_string();
    assert!(message.contains("AYA_BUILD_SKIP=1"), "{message}");
    assert!(message.contains("cargo xtask setup"), "{message}");
}
