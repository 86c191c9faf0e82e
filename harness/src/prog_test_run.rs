//! `BPF_PROG_TEST_RUN` on a loaded program: runs it on a packet given in memory and
//! returns its return code, the packet as it left, and the mean time per run.
//!
//! aya 0.14 does not expose this command for packet programs, so it is issued
//! directly. Nothing is sent on any network. Note (docs/performance.md): with
//! `repeat > 1` every run works on the same buffer, so a program that rewrites the
//! packet times the rewritten packet's path from the second run on.

use std::os::fd::{AsFd, AsRawFd as _};

use anyhow::{Context as _, bail};

/// `BPF_PROG_TEST_RUN` in `enum bpf_cmd`.
const BPF_PROG_TEST_RUN: libc::c_long = 10;

/// The `test` member of `union bpf_attr` (include/uapi/linux/bpf.h), zero-padded.
#[repr(C, align(8))]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    pad: u32,
}

const _: () = assert!(size_of::<TestRunAttr>() == 80);

/// One `BPF_PROG_TEST_RUN`'s result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestRun {
    /// The program's return code (XDP action, tc action).
    pub retval: u32,
    /// The packet after the (last) run.
    pub data: Vec<u8>,
    /// Mean nanoseconds per run, as the kernel measured it.
    pub duration_ns: u32,
}

/// Runs the program `prog` on `packet`, `repeat` times (0 and 1 both mean once).
///
/// The output buffer has room for the packet plus 256 bytes, enough for programs
/// that grow it a little.
pub fn test_run(prog: impl AsFd, packet: &[u8], repeat: u32) -> anyhow::Result<TestRun> {
    let mut out = vec![0u8; packet.len() + 256];
    let mut attr = TestRunAttr {
        prog_fd: prog.as_fd().as_raw_fd() as u32,
        data_size_in: u32::try_from(packet.len()).context("packet too large")?,
        data_size_out: out.len() as u32,
        data_in: packet.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat,
        ..TestRunAttr::default()
    };
    // SAFETY: `attr` is a valid `bpf_attr` prefix of the size passed; the buffers it
    // points to outlive the call and `out` is writable for `data_size_out` bytes.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_TEST_RUN,
            &mut attr as *mut TestRunAttr,
            size_of::<TestRunAttr>(),
        )
    };
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        bail!("BPF_PROG_TEST_RUN failed: {err}");
    }
    out.truncate(attr.data_size_out as usize);
    Ok(TestRun {
        retval: attr.retval,
        data: out,
        duration_ns: attr.duration,
    })
}
