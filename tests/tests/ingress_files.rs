//! Files of tens of MB through the ingress, as real clients move them: uploads
//! (`PUT`) and downloads over HTTP/1.1 and over h2 with TLS, to Debian's nginx
//! storing and serving them (WebDAV); every byte is compared, and the agent's peak
//! memory shows that the bodies streamed instead of being held. Needs no root.

use rune_agent_tests::{
    http::{TestCa, tls_secret, write_file},
    ingress::{Ingress, exposed_at},
    nginx::FileServer,
};
use std::path::Path;

/// The file size: tens of MB, below the default body limit (64 MiB).
const SIZE: usize = 40 << 20;

/// What the peak resident memory of the agent may grow by while the files pass:
/// well under one file, so a body held whole would show.
const PEAK_GROWTH_LIMIT: u64 = 16 << 20;

/// `len` bytes of a fixed pseudo-random sequence (xorshift64), so that a byte
/// dropped, repeated or reordered anywhere changes what follows.
fn pattern(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The agent's peak resident set (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kib * 1024
}

/// Asserts that `path` holds exactly `want`, naming the first differing byte.
fn assert_same(path: &Path, want: &[u8], what: &str) {
    let got = std::fs::read(path).unwrap_or_default();
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: first difference at byte {at}");
    }
}

#[test]
fn files_of_tens_of_megabytes_stream_both_ways_intact() {
    let files = FileServer::start(64);
    let ingress = Ingress::start();
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("files test CA");
    let (cert, key) = ca.leaf("vault.test");
    let ca_file = write_file(dir.path(), "ca.pem", &ca.pem);
    let mut yaml = tls_secret("vault-cert", &cert, &key) + "\n---\n";
    yaml += &exposed_at("files", "host: files.test", &[files.addr]);
    yaml += &exposed_at(
        "vault",
        "host: vault.test, tls: {secret: vault-cert}",
        &[files.addr],
    );
    ingress.apply(&yaml);
    // nginx answers 404 for a file it does not have: the route is live.
    ingress.until("files.test", "/nothing", 404);
    ingress.until("vault.test", "/nothing", 308);

    let data = pattern(SIZE);
    let source = dir.path().join("source.bin");
    std::fs::write(&source, &data).unwrap();
    let src = source.to_str().unwrap();
    let before = peak_rss(ingress.agent.pid());

    // Uploads: HTTP/1.1 on the plain listener, h2 over TLS.
    let up = ingress.get("files.test", "/up/plain.bin", &["-T", src]);
    assert_eq!(up.code, 201, "{up:?}");
    assert_same(&files.file("up/plain.bin"), &data, "uploaded over HTTP/1.1");
    let up = ingress.get_tls(
        "vault.test",
        "/up/h2.bin",
        &ca_file,
        &["--http2", "-T", src],
    );
    assert_eq!((up.code, up.version.as_str()), (201, "2"), "{up:?}");
    assert_same(&files.file("up/h2.bin"), &data, "uploaded over h2");

    // Downloads of what was stored, both ways.
    let out = dir.path().join("plain.out");
    let down = ingress.get(
        "files.test",
        "/up/plain.bin",
        &["-o", out.to_str().unwrap()],
    );
    assert_eq!(down.code, 200, "{down:?}");
    assert_same(&out, &data, "downloaded over HTTP/1.1");
    let out = dir.path().join("h2.out");
    let down = ingress.get_tls(
        "vault.test",
        "/up/h2.bin",
        &ca_file,
        &["--http2", "-o", out.to_str().unwrap()],
    );
    assert_eq!((down.code, down.version.as_str()), (200, "2"), "{down:?}");
    assert_same(&out, &data, "downloaded over h2");

    let growth = peak_rss(ingress.agent.pid()).saturating_sub(before);
    assert!(
        growth < PEAK_GROWTH_LIMIT,
        "the agent's peak memory grew by {} MiB while {} MiB files passed",
        growth >> 20,
        SIZE >> 20
    );
}
