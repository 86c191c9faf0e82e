use super::*;
use crate::{
    dataplane::ebpf::{EMBEDDED_OBJECT, programs_embedded},
    preflight::object,
};
use std::collections::BTreeSet;

#[test]
fn cap_eff_is_read_from_the_status_line() {
    let status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
    let caps = parse_cap_eff(status).unwrap();
    assert_ne!(caps & (1 << CAP_BPF), 0);
    assert_ne!(caps & (1 << CAP_NET_BIND_SERVICE), 0);
    assert_eq!(
        parse_cap_eff("CapEff:\t0000000000001000\n").unwrap(),
        1 << CAP_NET_ADMIN
    );
    assert!(parse_cap_eff("CapPrm:\t0\n").is_err());
    assert!(parse_cap_eff("CapEff:\tzz\n").is_err());
}

#[test]
fn helper_names_read_like_the_kernels() {
    assert_eq!(
        helper_name(BpfHelper::BPF_FUNC_get_netns_cookie),
        "bpf_get_netns_cookie"
    );
}

/// The helper ids called (`call imm` with src_reg 0) in each code section.
fn helper_calls(object: &[u8]) -> Vec<(String, BTreeSet<u32>)> {
    object::sections(object)
        .unwrap()
        .into_iter()
        .filter(|s| s.is_code())
        .map(|s| {
            let calls = object[s.offset..s.offset + s.size]
                .chunks_exact(8)
                .filter(|insn| insn[0] == 0x85 && insn[1] >> 4 == 0)
                .map(|insn| u32::from_le_bytes([insn[4], insn[5], insn[6], insn[7]]))
                .collect();
            (s.name, calls)
        })
        .collect()
}

#[test]
fn every_helper_the_programs_call_is_probed_for_their_program_type() {
    if !programs_embedded() {
        return;
    }
    let mut seen = 0;
    for (section, calls) in helper_calls(EMBEDDED_OBJECT) {
        let type_name = match section.as_str() {
            "xdp" => "xdp",
            "classifier" => "sched_cls",
            s if s.starts_with("cgroup/") => "cgroup_sock_addr",
            ".text" => {
                assert!(
                    calls.is_empty(),
                    "subprograms call helpers {calls:?}: probe them"
                );
                continue;
            }
            other => panic!("code section {other} has no program type in preflight"),
        };
        let probed: BTreeSet<u32> = HELPERS
            .iter()
            .find(|(n, _, _)| *n == type_name)
            .map(|(_, _, h)| h.iter().map(|h| *h as u32).collect())
            .unwrap_or_default();
        let missing: Vec<u32> = calls
            .iter()
            .copied()
            .filter(|id| !probed.contains(id))
            .collect();
        assert!(
            missing.is_empty(),
            "{section} calls helpers {missing:?} that preflight does not probe"
        );
        seen += calls.len();
    }
    assert!(seen > 0, "no helper calls found: the scan is broken");
}
