use super::*;
use crate::{config::DataplaneRequest, preflight::decide};

fn start_checks() -> Vec<Check> {
    let mut checks = vec![
        Check::new("btf", true, "parsed", EBPF),
        Check::new("nft", true, "nftables v1.0.6", &[DataplaneMode::Nftables]),
    ];
    checks.extend(placeholders(true));
    checks
}

fn find<'a>(checks: &'a [Check], name: &str) -> &'a Check {
    checks.iter().find(|c| c.name == name).expect(name)
}

#[test]
fn placeholders_name_every_program_and_hook_and_let_ebpf_be_chosen() {
    let checks = start_checks();
    for p in PROGRAMS {
        assert_eq!(find(&checks, &format!("load:{p}")).detail, DEFERRED);
    }
    assert_eq!(
        decide(DataplaneRequest::Auto, &checks).unwrap().mode,
        DataplaneMode::Ebpf
    );
    let without_cgroup = placeholders(false);
    let cgroup = find(&without_cgroup, "attach:cgroup");
    assert!(cgroup.needed_by.is_empty(), "{cgroup:?}");
}

#[test]
fn a_successful_load_fills_in_what_it_loaded_and_marks_the_rest_not_probed() {
    let mut checks = start_checks();
    let attached = [
        Attachment {
            program: lb::PROG_TC_INGRESS,
            hook: "tc-ingress",
            target: "eth0".into(),
        },
        Attachment {
            program: lb::PROG_TC_EGRESS,
            hook: "tc-egress",
            target: "eth0".into(),
        },
    ];
    record_loaded(&mut checks, &attached);
    let tc = find(&checks, &format!("load:{}", lb::PROG_TC_INGRESS));
    assert!(tc.passed && tc.needed_by == EBPF, "{tc:?}");
    assert!(tc.detail.contains("verifier accepts it"), "{tc:?}");
    assert_eq!(
        find(&checks, "attach:tc").detail,
        "attached at start to eth0"
    );
    let xdp = find(&checks, &format!("load:{}", lb::PROG_XDP_LB));
    assert!(xdp.passed && xdp.needed_by.is_empty(), "{xdp:?}");
    assert!(
        xdp.detail.starts_with("not probed at this start"),
        "{xdp:?}"
    );
    assert!(checks.iter().all(|c| c.detail != DEFERRED), "{checks:?}");
}

#[test]
fn a_rejected_program_fails_its_load_check_and_auto_falls_back_to_nftables() {
    let mut checks = start_checks();
    let error = EbpfError::ProgramLoad {
        name: lb::PROG_TC_INGRESS,
        source: Box::new(ProgramError::AlreadyLoaded),
    };
    let failed = failed_checks(&error, &Hooks::default());
    assert_eq!(failed.len(), 1);
    record_failed(&mut checks, failed);
    let name = format!("load:{}", lb::PROG_TC_INGRESS);
    assert!(!find(&checks, &name).passed);
    let s = decide(DataplaneRequest::Auto, &checks).unwrap();
    assert_eq!(s.mode, DataplaneMode::Nftables);
    assert!(
        s.reason
            .starts_with(&format!("auto: ebpf unavailable: {name} (")),
        "{}",
        s.reason
    );
    let err = decide(DataplaneRequest::Forced(DataplaneMode::Ebpf), &checks)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("{name} (")), "{err}");
    record_not_probed(&mut checks, DataplaneMode::Nftables);
    assert!(!find(&checks, &name).passed, "a failure stays recorded");
    assert!(checks.iter().all(|c| c.detail != DEFERRED), "{checks:?}");
}

#[test]
fn a_failed_attachment_fails_its_hook_and_passes_the_programs_verified_before_it() {
    let hooks = Hooks {
        cgroup: Some("/sys/fs/cgroup/x".into()),
        tc: vec!["eth0".into()],
        ..Hooks::default()
    };
    let hook = EbpfError::Hook {
        name: lb::PROG_SENDMSG6,
        target: "/sys/fs/cgroup/x".into(),
        source: "no such file".into(),
    };
    let failed = failed_checks(&hook, &hooks);
    assert_eq!(failed.len(), 1 + 10, "{failed:?}");
    let attach = find(&failed, "attach:cgroup");
    assert!(!attach.passed, "{attach:?}");
    assert!(attach.detail.contains("no such file"), "{failed:?}");

    let mut checks = start_checks();
    record_failed(&mut checks, failed);
    let s = decide(DataplaneRequest::Auto, &checks).unwrap();
    assert_eq!(s.mode, DataplaneMode::Nftables, "{}", s.reason);
    record_not_probed(&mut checks, DataplaneMode::Nftables);
    for program in [lb::PROG_SENDMSG6, lb::PROG_TC_EGRESS] {
        let c = find(&checks, &format!("load:{program}"));
        assert!(
            c.passed && c.detail.contains("verifier accepts it"),
            "{c:?}"
        );
    }
    let xdp = find(&checks, &format!("load:{}", lb::PROG_XDP_LB));
    assert!(
        xdp.detail.starts_with("not probed at this start"),
        "{xdp:?}"
    );
    assert!(checks.iter().all(|c| c.detail != DEFERRED), "{checks:?}");
}

#[test]
fn pin_errors_are_no_check() {
    let pin = EbpfError::Pin {
        path: "/sys/fs/bpf/x".into(),
        reason: "busy".into(),
    };
    assert!(failed_checks(&pin, &Hooks::default()).is_empty());
}

#[test]
fn hooks_name_the_programs_they_run() {
    assert!(Hooks::default().programs().is_empty());
    let all = Hooks {
        cgroup: Some("/sys/fs/cgroup".into()),
        tc: vec!["eth0".into()],
        xdp: vec!["eth1".into()],
        policy: vec!["veth0".into()],
        ..Hooks::default()
    };
    assert_eq!(all.programs(), PROGRAMS);
    let xdp = Hooks {
        xdp: vec!["eth1".into()],
        ..Hooks::default()
    };
    assert_eq!(xdp.programs(), [lb::PROG_XDP_LB]);
}
