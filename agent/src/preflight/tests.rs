use super::*;

fn report() -> Report {
    Report {
        kernel: "6.18.0".into(),
        checks: vec![
            Check::new("btf", true, "found", &[DataplaneMode::Ebpf]),
            Check::new("nft", true, "nftables v1.0.6", &[DataplaneMode::Nftables]),
        ],
    }
}

#[test]
fn injected_failure_marks_the_check_failed_and_keeps_the_probe_detail() {
    let mut r = report();
    r.inject_failures(&["btf".to_owned()]).unwrap();
    let btf = &r.checks[0];
    assert!(!btf.passed);
    assert!(btf.detail.contains(INJECT_ENV), "{}", btf.detail);
    assert!(btf.detail.contains("found"), "{}", btf.detail);
    assert!(r.checks[1].passed);
}

#[test]
fn injecting_an_unknown_check_is_an_error_listing_the_known_ones() {
    let err = report()
        .inject_failures(&["btff".to_owned()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"btff\""), "{err}");
    assert!(err.contains("btf, nft"), "{err}");
}

#[test]
fn outcome_lists_available_modes_and_renders_failures() {
    let mut r = report();
    r.inject_failures(&["btf".to_owned()]).unwrap();
    let o = Outcome::new(&r, DataplaneRequest::Auto);
    assert_eq!(o.mode, Some(DataplaneMode::Nftables));
    assert_eq!(
        o.available,
        [DataplaneMode::Nftables, DataplaneMode::Userspace]
    );
    let text = o.render();
    assert!(
        text.lines()
            .any(|l| l.starts_with("btf") && l.contains("FAIL")),
        "{text}"
    );
    assert!(
        text.contains("data plane: nftables (requested auto)"),
        "{text}"
    );
    let json: Outcome = serde_json::from_str(&serde_json::to_string(&o).unwrap()).unwrap();
    assert_eq!(json, o);
}
