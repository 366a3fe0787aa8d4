//! The CPU backend: "device memory" is host memory, shareable buffers are memfds mapped
//! `MAP_SHARED`, and ops run on this process's threads (`threads`, see [`CpuDevice::new`]).
//!
//! Every op has the same semantics as on a GPU backend, so the CPU versions double as the
//! reference (the "CPU twin") that GPU kernels are tested against.

mod allreduce;
mod buf;
mod ops;
mod reduce;
pub mod wait;

pub use buf::CpuBuf;

use std::os::fd::AsFd;

use crate::device::{Device, DeviceInfo, Export, ExportMeta, Op};
use crate::{KernelError, Result};

/// One rank's CPU "device".
pub struct CpuDevice {
    /// Threads an op may use (available cores / ranks on the machine, at least 1).
    threads: usize,
    /// Spin iterations before a flag wait sleeps on its futex; small when ranks outnumber
    /// cores, so that a waiting rank yields its core to the rank it waits for.
    spin: u32,
    ordinal: usize,
}

impl CpuDevice {
    pub fn new(ordinal: usize, threads: usize, spin: u32) -> Self {
        CpuDevice {
            threads: threads.max(1),
            spin,
            ordinal,
        }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    pub(crate) fn spin(&self) -> u32 {
        self.spin
    }
}

impl Device for CpuDevice {
    type Buf = CpuBuf;
    type Graph = ();
    type Mark = ();

    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            backend: "cpu".into(),
            ordinal: self.ordinal,
            name: "cpu".into(),
            memory: 0,
            arch: std::env::consts::ARCH.into(),
            uuid: format!("cpu:{}", self.ordinal),
        }
    }

    fn alloc(&self, bytes: usize) -> Result<CpuBuf> {
        CpuBuf::heap(bytes)
    }

    fn alloc_shared(&self, bytes: usize) -> Result<(CpuBuf, Export)> {
        let (buf, fd) = CpuBuf::memfd(bytes)?;
        Ok((
            buf,
            Export {
                meta: ExportMeta::Memfd { bytes },
                fd: Some(fd),
            },
        ))
    }

    fn import(&self, export: Export) -> Result<CpuBuf> {
        match (export.meta, export.fd) {
            (ExportMeta::Memfd { bytes }, Some(fd)) => CpuBuf::map_memfd(fd.as_fd(), bytes),
            (meta, _) => Err(KernelError::Invalid(format!(
                "the cpu backend cannot import {meta:?} (a peer on another backend?)"
            ))),
        }
    }

    fn write(&self, dst: &CpuBuf, offset: usize, src: &[u8]) -> Result<()> {
        dst.check(offset, src.len())?;
        // SAFETY: the range was bounds-checked above; `src` is a host slice that cannot alias
        // device memory handed out as `&mut` (callers never hold slices of a CpuBuf across ops).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.ptr().add(offset), src.len()) };
        Ok(())
    }

    fn read(&self, src: &CpuBuf, offset: usize, dst: &mut [u8]) -> Result<()> {
        src.check(offset, dst.len())?;
        // SAFETY: bounds-checked above; `dst` is a separate host slice.
        unsafe {
            std::ptr::copy_nonoverlapping(src.ptr().add(offset), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    unsafe fn launch(&self, op: &Op<'_, CpuBuf>) -> Result<()> {
        match op {
            Op::Copy(a) => reduce::copy(self, &a.src, &a.dst),
            Op::ReduceSum(a) => reduce::reduce_sum(self, a.inputs, &a.out),
            Op::Allreduce(a) => {
                allreduce::allreduce(self, a)?;
                match a.add_norm_op() {
                    Some(e) => ops::decode::add_rms_norm(self, &e),
                    None => Ok(()),
                }
            }
            Op::Fill(a) => ops::elementwise::fill(self, &a.dst, a.value),
            Op::Embedding(a) => {
                let ids = ops::decode::read_u32(&a.ids)?;
                ops::embedding::embedding(self, &a.table, a.vocab_start, &ids, a.hidden, &a.out)
            }
            Op::RmsNorm(a) => ops::norm::rms_norm(self, &a.x, &a.w, &a.out, a.rows, a.dim, a.eps),
            Op::AddRmsNorm(a) => ops::decode::add_rms_norm(self, a),
            Op::Rope(a) => ops::decode::rope(self, a),
            Op::QkvRope(a) => ops::decode::qkv_rope(self, a),
            Op::Attention(a) => ops::decode::attention(self, a),
            Op::GatedDelta(a) => ops::delta::gated_delta(a),
            Op::CausalConv(a) => ops::delta::causal_conv(a),
            Op::GatedRmsNorm(a) => ops::delta::gated_rms_norm(a),
            Op::SiluMul(a) => ops::elementwise::silu_mul(self, &a.gate, &a.up, &a.out),
            Op::SigmoidMul(a) => ops::elementwise::sigmoid_mul(self, &a.x, &a.gate, &a.out),
            Op::Add(a) => ops::elementwise::add(self, &a.a, &a.b, &a.out),
            Op::Matmul(a) => ops::decode::matmul(self, a),
            Op::AddNormMatmul(a) => ops::decode::add_norm_matmul(self, a),
            // The two steps apart, through the op's scratch (ops::QkvMatmul).
            Op::QkvMatmul(a) => {
                // SAFETY: QkvMatmul::validate() validated the product.
                unsafe { self.launch(&a.product())? };
                ops::decode::qkv_rope(self, &a.rope)
            }
            Op::MatmulInt4(a) => ops::int4::matmul_int4(self, a),
            Op::ShardTopK(a) => ops::decode::shard_topk(a),
            Op::Sample(a) => ops::decode::sample(a),
        }
    }

    fn replay(&self, _graph: &()) -> Result<()> {
        Err(KernelError::Unavailable {
            backend: "cpu",
            why: "the cpu backend has no graphs (capture returns None)".into(),
        })
    }

    fn mark(&self) -> Result<()> {
        Ok(())
    }

    fn wait_mark(&self, _mark: &()) -> Result<()> {
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        // Ops run synchronously on the calling thread (and scoped helpers): nothing is queued.
        Ok(())
    }
}

/// Splits `0..len` into at most `threads` contiguous ranges and runs `f` on each, in parallel
/// on this process's worker pool when the work is large enough to pay for waking workers.
///
/// One pool per process (a process is one rank), created on first use with `threads` workers
/// (rayon's pool: workers spin briefly, then sleep). Spawning threads per call instead cost
/// milliseconds on a loaded 2-core machine (docs/perf-notes.md).
pub(crate) fn par_ranges(
    threads: usize,
    len: usize,
    min_per_thread: usize,
    f: impl Fn(std::ops::Range<usize>) + Sync,
) {
    let n = threads.min(len / min_per_thread.max(1)).max(1);
    if n == 1 {
        f(0..len);
        return;
    }
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    let pool = POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("tprun-cpu-{i}"))
            .build()
            .ok()
    });
    match pool {
        Some(pool) => pool.scope(|s| {
            for t in 0..n {
                let f = &f;
                s.spawn(move |_| f(crate::comm::shard_range(len, n, t)));
            }
        }),
        None => f(0..len),
    }
}
