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

    fn run(&self, op: &Op<'_, CpuBuf>) -> Result<()> {
        match op {
            Op::Copy { src, dst } => reduce::copy(self, src, dst),
            Op::ReduceSum { inputs, out } => reduce::reduce_sum(self, inputs, out),
            Op::Allreduce(args) => allreduce::allreduce(self, args),
            Op::Fill { dst, value } => ops::elementwise::fill(self, dst, *value),
            Op::Embedding {
                table,
                vocab_start,
                ids,
                hidden,
                out,
            } => ops::embedding::embedding(self, table, *vocab_start, ids, *hidden, out),
            Op::RmsNorm {
                x,
                w,
                out,
                rows,
                dim,
                eps,
            } => ops::norm::rms_norm(self, x, w, out, *rows, *dim, *eps),
            Op::Rope {
                x,
                inv_freq,
                rows,
                heads,
                head_dim,
                pos0,
            } => ops::rope::rope(self, x, inv_freq, *rows, *heads, *head_dim, *pos0),
            Op::Attention {
                q,
                k_cache,
                v_cache,
                out,
                rows,
                heads,
                kv_heads,
                head_dim,
                pos0,
                scale,
            } => ops::attention::attention(
                self,
                ops::attention::AttnArgs {
                    q,
                    k_cache,
                    v_cache,
                    out,
                    rows: *rows,
                    heads: *heads,
                    kv_heads: *kv_heads,
                    head_dim: *head_dim,
                    pos0: *pos0,
                    scale: *scale,
                },
            ),
            Op::SiluMul { gate, up, out } => ops::elementwise::silu_mul(self, gate, up, out),
            Op::Add { a, b, out } => ops::elementwise::add(self, a, b, out),
            Op::Matmul {
                x,
                w,
                bias,
                y,
                m,
                k,
                n,
            } => ops::matmul::matmul(self, x, w, bias.as_ref(), y, *m, *k, *n),
        }
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
