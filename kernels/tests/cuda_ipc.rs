//! Cross-process CUDA buffer sharing: a child process (this test binary, re-executed) imports
//! a buffer the parent exported, checks what the parent wrote, and writes an answer that the
//! parent checks. Legacy IPC handles can only be opened by another process, so this is where
//! the legacy import is tested; the VMM fd path is tested the same way with an inherited fd.
//!
//! The full multi-process allreduce (rendezvous, fd passing over the socket, MPS) is the
//! coordinator's integration test.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;

use tprun_kernels::cuda::{self, CudaDevice, IpcMode};
use tprun_kernels::{Device, Export, ExportMeta};

const BYTES: usize = 1 << 20;
const CHILD_ENV: &str = "TPRUN_CUDA_IPC_CHILD";

fn gpu_or_skip() -> bool {
    if cuda::device_count() > 0 && cuda::nvrtc_present() {
        return true;
    }
    if std::env::var("TPRUN_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("TPRUN_REQUIRE_GPU=1 but no usable CUDA GPU (driver + NVRTC)");
    }
    println!("skipped: no GPU");
    false
}

fn pattern(salt: u8) -> Vec<u8> {
    (0..BYTES)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt))
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// The parent's half: export, write, run the child, check the child's answer.
fn round_trip(mode: IpcMode) {
    let dev = CudaDevice::new(0, mode).unwrap();
    assert_eq!(dev.ipc_mode(), mode);
    let (buf, export) = dev.alloc_shared(BYTES).unwrap();
    dev.write(&buf, 0, &pattern(1)).unwrap();
    dev.sync().unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "child", "--nocapture"]);
    // Keeps the inherited fd (if any) alive until the child has run.
    let mut _keep: Option<OwnedFd> = None;
    match &export.meta {
        ExportMeta::CudaLegacy { bytes, handle } => {
            cmd.env(CHILD_ENV, format!("legacy:{bytes}:{}", hex(handle)));
        }
        ExportMeta::CudaVmmFd { bytes } => {
            // A duplicate without CLOEXEC, so that exec hands it to the child.
            let fd = export.fd.as_ref().unwrap();
            // SAFETY: F_DUPFD (not F_DUPFD_CLOEXEC) on a descriptor we own; the new fd is
            // wrapped at once so it is closed exactly once.
            let dup = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD, 100) };
            assert!(dup >= 0, "dup failed");
            // SAFETY: `dup` is a fresh descriptor nobody else owns.
            _keep = Some(unsafe { OwnedFd::from_raw_fd(dup) });
            cmd.env(CHILD_ENV, format!("fd:{bytes}:{dup}"));
        }
        other => panic!("unexpected export {other:?}"),
    }
    let out = cmd.output().unwrap();
    let log =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{log}");
    assert!(
        log.contains("CHILD OK"),
        "the child did not run its check:\n{log}"
    );
    let mut back = vec![0u8; BYTES];
    dev.read(&buf, 0, &mut back).unwrap();
    assert!(
        back == pattern(2),
        "the child's write is not visible to the parent"
    );
}

/// The child's half (does nothing unless started by `round_trip`).
#[test]
fn child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut it = spec.splitn(3, ':');
    let (kind, bytes, rest) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let bytes: usize = bytes.parse().unwrap();
    let (mode, export) = match kind {
        "legacy" => (
            IpcMode::Legacy,
            Export {
                meta: ExportMeta::CudaLegacy {
                    bytes,
                    handle: unhex(rest),
                },
                fd: None,
            },
        ),
        "fd" => (
            IpcMode::Fd,
            Export {
                meta: ExportMeta::CudaVmmFd { bytes },
                // SAFETY: the parent passed us this inherited descriptor; we own it now.
                fd: Some(unsafe { OwnedFd::from_raw_fd(rest.parse().unwrap()) }),
            },
        ),
        k => panic!("unknown kind {k}"),
    };
    let dev = CudaDevice::new(0, mode).unwrap();
    let buf = dev.import(export).unwrap();
    let mut got = vec![0u8; BYTES];
    dev.read(&buf, 0, &mut got).unwrap();
    assert!(
        got == pattern(1),
        "the parent's data is not visible in the child"
    );
    dev.write(&buf, 0, &pattern(2)).unwrap();
    dev.sync().unwrap();
    println!("CHILD OK");
}

#[test]
fn legacy_handle_opens_in_another_process() {
    if std::env::var(CHILD_ENV).is_ok() || !gpu_or_skip() {
        return;
    }
    round_trip(IpcMode::Legacy);
}

#[test]
fn vmm_fd_imports_in_another_process() {
    if std::env::var(CHILD_ENV).is_ok() || !gpu_or_skip() {
        return;
    }
    round_trip(IpcMode::Fd);
}
