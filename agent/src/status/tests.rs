use super::*;
use crate::{config::DataplaneMode, preflight::Check};

#[test]
fn render_shows_the_data_plane_reason_and_failed_preflight_checks() {
    let st = AgentStatus {
        running: true,
        dataplane: Some("nftables".into()),
        dataplane_reason: Some("auto: ebpf unavailable: btf (missing)".into()),
        preflight: vec![
            Check::new("btf", false, "missing", &[DataplaneMode::Ebpf]),
            Check::new("nft", true, "nftables v1.0.6", &[DataplaneMode::Nftables]),
        ],
        ..AgentStatus::default()
    };
    let text = st.render();
    assert!(
        text.contains("data plane: nftables (auto: ebpf unavailable: btf (missing))\n"),
        "{text}"
    );
    assert!(
        text.contains("preflight:  1 of 2 checks passed\n"),
        "{text}"
    );
    assert!(text.contains("  failed btf: missing\n"), "{text}");
    assert!(!text.contains("failed nft"), "{text}");
    let json = serde_json::to_value(&st).unwrap();
    assert_eq!(
        json["dataplaneReason"],
        "auto: ebpf unavailable: btf (missing)"
    );
    assert_eq!(json["preflight"][0]["neededBy"][0], "ebpf");
    let back: AgentStatus = serde_json::from_value(json).unwrap();
    assert_eq!(back, st);
}
