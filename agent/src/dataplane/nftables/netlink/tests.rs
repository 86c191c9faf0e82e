use super::{batch, policy_elements};
use crate::dataplane::nftables::policy::PolicyKey;

#[test]
fn prefixes_encode_as_a_start_and_the_address_after_the_end() {
    let net = |s: &str| PolicyKey::Prefix(s.parse().unwrap());
    let v6 = policy_elements("s", &net("fd00:1::/64"), None, true);
    assert_eq!(v6.len(), 2);
    assert_eq!(v6[0].key[..8], [0xfd, 0, 0, 1, 0, 0, 0, 0]);
    assert_eq!(v6[1].key[..8], [0xfd, 0, 0, 1, 0, 0, 0, 1]);
    assert_eq!((v6[0].flags, v6[1].flags), (0, 1));
    // The whole space has no end: one element, marked open for `nft list`.
    let all = policy_elements("s", &net("0.0.0.0/0"), None, false);
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].key, [0, 0, 0, 0]);
    assert_eq!(all[0].udata.as_deref(), Some(&[1, 4, 1, 0, 0, 0][..]));
    let top = policy_elements("s", &net("255.255.255.254/31"), None, true);
    assert_eq!(top.len(), 1);
}

#[test]
fn a_batch_sends_each_run_of_one_set_and_one_command_as_one_message() {
    let net = PolicyKey::Prefix("198.19.64.1/32".parse().unwrap());
    let mut ops = policy_elements("s", &net, None, false);
    ops.extend(policy_elements("s", &net, None, true));
    ops.extend(policy_elements("t", &net, None, true));
    let (bytes, acked) = batch(&ops, 7);
    assert_eq!(acked, [8, 9, 10], "delete s, add s, add t");
    // The interval end's flag travels big-endian in NFTA_SET_ELEM_FLAGS.
    let flags = [8, 0, 3, 0, 0, 0, 0, 1];
    assert_eq!(bytes.windows(8).filter(|w| *w == flags).count(), 3);
}
