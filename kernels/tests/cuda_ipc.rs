//! Cross-process CUDA buffer sharing: a child process (this test binary, re-executed) imports
//! a buffer the parent exported, checks what the parent wrote, and writes an answer that the
//! parent checks. Legacy IPC handles can only be opened by another process, so this is where
//! the legacy import is tested; the VMM fd path is tested the same way with an inherited fd.
//!
//! `legacy_allreduce_across_processes` runs oneshot and twoshot between two processes on
//! one GPU through legacy IPC handles (exchanged over the child's stdin/stdout), checking both
//! ranks against the CPU twin. Without the MPS daemon the two contexts time-slice, so each
//! flag handshake costs milliseconds: it checks correctness, not speed. The full multi-process
//! allreduce (rendezvous, fd passing over the socket, MPS) is the coordinator's integration
//! test.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tprun_kernels::cpu::CpuDevice;
use tprun_kernels::cuda::{self, CudaBuf, CudaDevice, IpcMode};
use tprun_kernels::dtype::encode;
use tprun_kernels::{AllreduceArgs, CommAlgo, CommLayout, DType, Op, View};
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

/// The child's half (does nothing unless started by `round_trip` or the allreduce test).
#[test]
fn child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    if let Some(handle) = spec.strip_prefix("ar:") {
        allreduce_rank(1, Some(handle));
        println!("CHILD OK");
        return;
    }
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

/// The calls both processes make, in order: (algo, low-latency oneshot on, dtype, elements).
/// The kernels alternate call by call, so each one also starts from the state the others
/// leave behind.
fn schedule() -> Vec<(CommAlgo, bool, DType, usize)> {
    let mut v = Vec::new();
    for dtype in DType::ALL {
        for n in [1usize, 17, 4099] {
            for (algo, ll) in [
                (CommAlgo::Oneshot, true),
                (CommAlgo::Oneshot, false),
                (CommAlgo::Twoshot, false),
            ] {
                v.push((algo, ll, dtype, n));
            }
        }
    }
    v
}

/// Deterministic inputs both processes can compute: call `i`, rank `r`.
fn input(i: usize, r: usize, dtype: DType, n: usize) -> Vec<u8> {
    let mut x = (i as u64 * 2654435761 + r as u64 * 97 + 1) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x % 20001) as f32 - 10000.0) / 256.0
        })
        .collect();
    encode(dtype, &v)
}

/// The CPU twin's rank-order sum of call `i`.
fn expected(i: usize, dtype: DType, n: usize) -> Vec<u8> {
    let cpu = CpuDevice::new(0, 1, 0);
    let bufs: Vec<_> = (0..2)
        .map(|r| {
            let b = cpu.alloc(n * dtype.size()).unwrap();
            cpu.write(&b, 0, &input(i, r, dtype, n)).unwrap();
            b
        })
        .collect();
    let out = cpu.alloc(n * dtype.size()).unwrap();
    let views: Vec<_> = bufs.iter().map(|b| View::new(b, 0, n, dtype)).collect();
    cpu.run(&Op::ReduceSum(tprun_kernels::ops::ReduceSum {
        inputs: &views,
        out: View::new(&out, 0, n, dtype),
    }))
    .unwrap();
    let mut r = vec![0u8; n * dtype.size()];
    cpu.read(&out, 0, &mut r).unwrap();
    r
}

/// One rank of the two-process allreduce. Rank 0 (the parent) spawns rank 1 and exchanges
/// handles over its pipes; rank 1 gets rank 0's handle in the environment and prints its own.
fn allreduce_rank(rank: usize, peer_handle: Option<&str>) {
    let layout = CommLayout::new(4099 * 4, 2);
    let dev = CudaDevice::new(0, IpcMode::Legacy).unwrap();
    let (own, export) = dev.alloc_shared(layout.total_bytes()).unwrap();
    let ExportMeta::CudaLegacy { handle, .. } = &export.meta else {
        panic!("legacy mode exports a legacy handle")
    };
    let open = |h: &str| -> CudaBuf {
        dev.import(Export {
            meta: ExportMeta::CudaLegacy {
                bytes: layout.total_bytes(),
                handle: unhex(h),
            },
            fd: None,
        })
        .unwrap()
    };
    let mut child = None;
    let peer = match peer_handle {
        Some(h) => {
            println!("HANDLE {}", hex(handle));
            std::io::stdout().flush().unwrap();
            open(h)
        }
        None => {
            let mut c = Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "child", "--nocapture"])
                .env(CHILD_ENV, format!("ar:{}", hex(handle)))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut lines = BufReader::new(c.stdout.take().unwrap()).lines();
            let h = loop {
                let l = lines
                    .next()
                    .expect("child exited before its handle")
                    .unwrap();
                if let Some(h) = l.strip_prefix("HANDLE ") {
                    break h.to_string();
                }
            };
            // Keep draining the child's output so it never blocks on a full pipe.
            let drain = std::thread::spawn(move || lines.map_while(|l| l.ok()).collect::<Vec<_>>());
            child = Some((c, drain));
            open(&h)
        }
    };
    let comm: Vec<&CudaBuf> = if rank == 0 {
        vec![&own, &peer]
    } else {
        vec![&peer, &own]
    };
    let t0 = Instant::now();
    let calls = schedule();
    for (i, &(algo, ll, dtype, n)) in calls.iter().enumerate() {
        dev.set_low_latency(ll);
        let data = dev.alloc(n * dtype.size()).unwrap();
        dev.write(&data, 0, &input(i, rank, dtype, n)).unwrap();
        dev.run(&Op::Allreduce(AllreduceArgs {
            algo,
            rank,
            world: 2,
            epoch: i as u32 + 1,
            data: View::new(&data, 0, n, dtype),
            comm: &comm,
            layout,
            timeout: Duration::from_secs(20),
            abort: None,
            add_norm: None,
        }))
        .unwrap();
        let mut got = vec![0u8; n * dtype.size()];
        dev.read(&data, 0, &mut got).unwrap();
        assert!(
            got == expected(i, dtype, n),
            "rank {rank}: call {i} ({algo:?} ll={ll} {dtype} n={n}) differs from the CPU twin"
        );
    }
    println!(
        "rank {rank}: {} cross-process calls, {:.2} ms each (no MPS: contexts time-slice)",
        calls.len(),
        t0.elapsed().as_secs_f64() * 1e3 / calls.len() as f64
    );
    // Neither rank may free (or exit with) its buffer while the other may still read it in
    // its last call: the child waits for the parent's "done", and the parent frees its own
    // buffer only after the child has exited.
    if rank == 1 {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
    }
    if let Some((mut c, drain)) = child {
        writeln!(c.stdin.take().unwrap(), "done").unwrap();
        let status = c.wait().unwrap();
        let out = drain.join().unwrap().join("\n");
        assert!(
            status.success() && out.contains("CHILD OK"),
            "child failed:\n{out}"
        );
        println!("{out}");
    }
}

#[test]
fn legacy_allreduce_across_processes() {
    if std::env::var(CHILD_ENV).is_ok() || !gpu_or_skip() {
        return;
    }
    allreduce_rank(0, None);
}
