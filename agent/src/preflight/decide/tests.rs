use super::*;
use DataplaneMode::{Ebpf, Nftables, Userspace};

/// The checks of a capable kernel, as the probes name them (names matter only
/// to the messages; `needed_by` drives the decision).
fn capable() -> Vec<Check> {
    let ebpf = &[Ebpf];
    vec![
        Check::new("kernel", true, "6.18.0", &[]),
        Check::new("bpf-syscall", true, "ok", ebpf),
        Check::new("btf", true, "/sys/kernel/btf/vmlinux", ebpf),
        Check::new("cap-bpf", true, "CAP_BPF", ebpf),
        Check::new(
            "cap-net-admin",
            true,
            "CAP_NET_ADMIN",
            &[Ebpf, Nftables, Userspace],
        ),
        Check::new("cap-net-bind-service", true, "ok", &[Userspace]),
        Check::new("cap-perfmon", true, "ok", &[]),
        Check::new("prog:cgroup_sock_addr", true, "ok", ebpf),
        Check::new("load:rune_tc_ingress", true, "ok", ebpf),
        Check::new("nft", true, "nftables v1.0.6", &[Nftables]),
        Check::new("nft-netlink", true, "ok", &[Nftables]),
    ]
}

fn failing(mut checks: Vec<Check>, names: &[&str]) -> Vec<Check> {
    for c in &mut checks {
        if names.contains(&c.name.as_str()) {
            c.passed = false;
            c.detail = format!("{} missing", c.name);
        }
    }
    checks
}

#[test]
fn everything_fine_picks_ebpf_in_auto_and_any_forced_mode_runs() {
    let checks = capable();
    let s = decide(DataplaneRequest::Auto, &checks).unwrap();
    assert_eq!(s.mode, Ebpf);
    assert_eq!(s.reason, "auto: all 6 ebpf checks passed");
    for (choice, mode) in [
        (DataplaneRequest::Forced(Ebpf), Ebpf),
        (DataplaneRequest::Forced(Nftables), Nftables),
        (DataplaneRequest::Forced(Userspace), Userspace),
    ] {
        let s = decide(choice, &checks).unwrap();
        assert_eq!(s.mode, mode);
        assert!(
            s.reason
                .starts_with(&format!("forced by --dataplane {mode}")),
            "{}",
            s.reason
        );
    }
}

#[test]
fn no_btf_falls_back_to_nftables_and_says_why() {
    let checks = failing(capable(), &["btf"]);
    let s = decide(DataplaneRequest::Auto, &checks).unwrap();
    assert_eq!(s.mode, Nftables);
    assert_eq!(
        s.reason,
        "auto: ebpf unavailable: btf (btf missing); all 3 nftables checks passed"
    );
}

#[test]
fn no_cap_bpf_falls_back_to_nftables() {
    let checks = failing(capable(), &["cap-bpf"]);
    let s = decide(DataplaneRequest::Auto, &checks).unwrap();
    assert_eq!(s.mode, Nftables);
    assert!(
        s.reason.contains("cap-bpf (cap-bpf missing)"),
        "{}",
        s.reason
    );
}

#[test]
fn old_kernel_without_btf_program_types_or_nft_gets_userspace() {
    // A 4.19 kernel: no BTF, no cgroup sock_addr hooks our programs load into,
    // a verifier that rejects them, and no nft binary on the host.
    let mut checks = failing(
        capable(),
        &[
            "btf",
            "prog:cgroup_sock_addr",
            "load:rune_tc_ingress",
            "nft",
            "nft-netlink",
        ],
    );
    checks[0].detail = "4.19.0".into();
    let s = decide(DataplaneRequest::Auto, &checks).unwrap();
    assert_eq!(s.mode, Userspace);
    assert!(
        s.reason.starts_with(
            "auto: ebpf unavailable: btf (btf missing), prog:cgroup_sock_addr (prog:cgroup_sock_addr missing), load:rune_tc_ingress (load:rune_tc_ingress missing); nftables unavailable: nft (nft missing), nft-netlink (nft-netlink missing); all 2 userspace checks passed"
        ),
        "{}",
        s.reason
    );
}

#[test]
fn no_nft_keeps_ebpf_in_auto_and_refuses_forced_nftables() {
    let checks = failing(capable(), &["nft"]);
    assert_eq!(decide(DataplaneRequest::Auto, &checks).unwrap().mode, Ebpf);
    let err = decide(DataplaneRequest::Forced(Nftables), &checks).unwrap_err();
    assert_eq!(
        err,
        DecideError::Unavailable {
            mode: Nftables,
            failed: "nft (nft missing)".into()
        }
    );
    assert!(
        err.to_string().starts_with(
            "--dataplane nftables cannot run here: preflight checks failed: nft (nft missing)"
        ),
        "{err}"
    );
}

#[test]
fn forced_ebpf_with_a_failed_check_names_every_failed_check() {
    let checks = failing(capable(), &["btf", "load:rune_tc_ingress", "nft"]);
    let err = decide(DataplaneRequest::Forced(Ebpf), &checks).unwrap_err();
    assert_eq!(
        err,
        DecideError::Unavailable {
            mode: Ebpf,
            failed: "btf (btf missing), load:rune_tc_ingress (load:rune_tc_ingress missing)".into()
        }
    );
}

#[test]
fn many_failures_are_detailed_then_named_then_counted() {
    let checks: Vec<Check> = (0..14)
        .map(|i| Check::new(format!("c{i}"), false, format!("why{i}"), &[Ebpf]))
        .collect();
    let err = decide(DataplaneRequest::Forced(Ebpf), &checks).unwrap_err();
    let DecideError::Unavailable { failed, .. } = err else {
        panic!("{err:?}")
    };
    assert_eq!(
        failed,
        "c0 (why0), c1 (why1), c2 (why2), c3, c4, c5, c6, c7, c8, c9, and 4 more"
    );
}

#[test]
fn informational_checks_never_decide() {
    let checks = failing(capable(), &["kernel", "cap-perfmon"]);
    assert_eq!(decide(DataplaneRequest::Auto, &checks).unwrap().mode, Ebpf);
    assert_eq!(
        decide(DataplaneRequest::Forced(Ebpf), &checks)
            .unwrap()
            .mode,
        Ebpf
    );
}

#[test]
fn nothing_available_is_an_error_with_each_modes_reasons() {
    let checks = failing(capable(), &["cap-net-admin"]);
    let err = decide(DataplaneRequest::Auto, &checks).unwrap_err();
    let text = err.to_string();
    for mode in ["ebpf", "nftables", "userspace"] {
        assert!(
            text.contains(&format!(
                "{mode} unavailable: cap-net-admin (cap-net-admin missing)"
            )),
            "{text}"
        );
    }
    assert!(decide(DataplaneRequest::Forced(Userspace), &checks).is_err());
}
