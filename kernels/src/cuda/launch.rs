//! Loading the compiled modules and launching the ops: the Rust mirrors of the kernels'
//! parameter structs and of the GPU signal-area layout, argument checks, grid sizes.
//!
//! Owns: every `cuLaunchKernel` of the backend.
//! Must not: allocate (a launch needs no scratch memory, so every op can be captured in a
//! graph) or synchronise.
//!
//! GPU signal-area layout (the authoritative comment, with the reasons, is at the top of
//! `kernels/src/gpu/comm.cu`; the constants below are checked against that file's `#define`s
//! by a test, and against `comm.rs` at compile time):
//!
//! ```text
//! 0 .. 8192                 CPU backend's (phase, sender) flag lines (unused on GPUs)
//! 8192 + 8 * block          u64 epoch counter per block: the last epoch this rank completed
//! 9216 + ((phase * MAX_BLOCKS + block) * MAX_WORLD + sender) * 8
//!                           u64 flag raised by `sender`'s block `block` for `phase`
//! .. 9216 + 128 KiB         (end of the flags; the rest of the 256 KiB is free)
//! ```
//!
//! The low-latency slots after the data slots are laid out by [`CommLayout`].

use std::ffi::c_void;
use std::sync::Arc;

use super::ctx::{driver_err, GpuCtx, GpuModule};
use super::mem::CudaBuf;
use super::program;
use crate::comm::{
    AllreduceArgs, CommAlgo, CommLayout, FLAG_STRIDE, MAX_WORLD, PHASES, SIGNAL_BYTES,
};
use crate::driver::{Function, Stream};
use crate::{DType, KernelError, Result, View};

/// Where the GPU part of the signal area starts: after the CPU backend's flags.
pub const SIG_BASE: usize = PHASES * MAX_WORLD * FLAG_STRIDE;
/// The device-resident epoch counters, one u64 per block.
pub const SIG_EPOCHS: usize = SIG_BASE;
/// First per-block flag (u64).
pub const SIG_FLAGS: usize = SIG_BASE + 1024;
/// Most blocks one allreduce launch may use (flags exist for this many).
pub const MAX_BLOCKS: usize = 128;
/// Threads per allreduce block (comm.cu TP_AR_THREADS; at least MAX_WORLD, since threads
/// 0..world signal and poll).
pub const AR_THREADS: u32 = 512;
/// Threads per block of copy / reduce_sum (reduce.cu TP_THREADS).
pub const THREADS: u32 = 256;
/// Same-dtype copies up to this size run as a kernel (reduce.cu copy_bytes), larger ones as a
/// device memcpy.
pub const SMALL_COPY_BYTES: usize = 1 << 20;
/// Most inputs of one ReduceSum launch (reduce.cu TP_MAX_INPUTS).
pub const MAX_INPUTS: usize = 64;

const _: () = assert!(SIG_BASE == 8192, "comm.cu hard-codes 8192");
const _: () = assert!(SIG_EPOCHS + 8 * MAX_BLOCKS <= SIG_FLAGS);
const _: () = assert!(SIG_FLAGS + PHASES * MAX_BLOCKS * MAX_WORLD * 8 <= SIGNAL_BYTES);
const _: () = assert!(AR_THREADS as usize >= MAX_WORLD);
const _: () = assert!(AR_THREADS as usize >= MAX_BLOCKS);

/// Host-mapped error words (comm.cu TP_ERR_*).
pub const ERR_CODE: usize = 0;
pub const ERR_DEV_EPOCH: usize = 1;
pub const ERR_HOST_EPOCH: usize = 2;
pub const ERR_PEERS: usize = 4;
pub const ERR_WORDS: usize = ERR_PEERS + MAX_WORLD;
pub const ERR_TIMEOUT: u32 = 1;
pub const ERR_EPOCH: u32 = 2;

/// comm.cu `struct ArParams`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct ArParams {
    comm: [u64; MAX_WORLD],
    data: u64,
    n: u64,
    data_bytes: u64,
    ll: u64,
    ll_slot_bytes: u64,
    ll_stride: u64,
    timeout_ns: u64,
    err: u64,
    rank: u32,
    world: u32,
    host_epoch: u32,
    vec: u32,
    norm: ArNorm,
}
const _: () = assert!(std::mem::size_of::<ArParams>() == 624);

/// comm.cu `struct ArNorm`: the fused add + RMSNorm epilogue.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ArNorm {
    x: u64,
    w: u64,
    out: u64,
    eps: f32,
    pad: u32,
}

/// reduce.cu `struct ReduceParams`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct ReduceParams {
    inputs: [u64; MAX_INPUTS],
    out: u64,
    n: u64,
    nin: u32,
    vec: u32,
}
const _: () = assert!(std::mem::size_of::<ReduceParams>() == 536);

/// reduce.cu `struct CopyParams`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct CopyParams {
    src: u64,
    dst: u64,
    n: u64,
}

/// The loaded modules and their kernels as a typed table: (module, index in its name list).
/// A launch picks its kernel by index, never by building or hashing a name.
pub(crate) struct Kernels {
    table: Vec<Vec<Function>>,
    /// Keeps the functions valid; unloaded when the device drops (after its stream synced).
    _modules: Vec<GpuModule>,
    /// For occupancy queries (kernels are launched through the [`Launcher`]'s copy).
    ctx: Arc<GpuCtx>,
}

/// The allreduce kernels of one dtype, in comm.cu's name order (`allreduce_{algo}_{dtype}`).
const COMM_ALGOS: [&str; 4] = ["oneshot", "oneshot_ll", "twoshot", "host_reduce"];
/// `allreduce_oneshot_ll_addnorm_f32`: after the per-dtype kernels.
const COMM_ADDNORM: usize = COMM_ALGOS.len() * DType::ALL.len();
/// `copy_bytes`: first of the reduce module.
const COPY_BYTES: usize = 0;

fn float_index(d: DType) -> usize {
    DType::ALL
        .iter()
        .position(|&x| x == d)
        .expect("allreduce, reduce and copy kernels exist for float dtypes (validated)")
}

/// Index of `allreduce_{algo}_{d}` in the comm module.
fn comm_index(algo: &str, d: DType) -> usize {
    let a = COMM_ALGOS
        .iter()
        .position(|&x| x == algo)
        .expect("a comm.cu algorithm");
    float_index(d) * COMM_ALGOS.len() + a
}

/// Index of `reduce_sum_{d}` in the reduce module: after copy_bytes, each dtype's reduce_sum
/// followed by its converting copies from the other dtypes.
fn reduce_sum_index(d: DType) -> usize {
    1 + float_index(d) * DType::ALL.len()
}

/// Index of `copy_{s}_{d}` (s ≠ d) in the reduce module.
fn copy_index(s: DType, d: DType) -> usize {
    let from = DType::ALL
        .iter()
        .filter(|&&x| x != d)
        .position(|&x| x == s)
        .expect("a converting copy");
    reduce_sum_index(d) + 1 + from
}

fn kernel_names(module: &str) -> Vec<String> {
    let mut v = Vec::new();
    match module {
        "reduce" => {
            v.push("copy_bytes".to_string());
            for d in DType::ALL {
                v.push(format!("reduce_sum_{d}"));
                for s in DType::ALL.into_iter().filter(|&s| s != d) {
                    v.push(format!("copy_{s}_{d}"));
                }
            }
        }
        "comm" => {
            for d in DType::ALL {
                for algo in ["oneshot", "oneshot_ll", "twoshot", "host_reduce"] {
                    v.push(format!("allreduce_{algo}_{d}"));
                }
            }
            v.push("allreduce_oneshot_ll_addnorm_f32".to_string());
        }
        other => {
            return super::decode::kernel_names(other)
                .unwrap_or_else(|| unreachable!("unknown module {other}"))
        }
    }
    v
}

impl Kernels {
    /// Compiles (or takes from the cache) and loads every module for `arch` ("sm_90",
    /// "gfx90a"), through the context's driver table (NVRTC or hiprtc).
    pub(crate) fn load(ctx: &Arc<GpuCtx>, arch: &str) -> Result<Kernels> {
        let mut table = Vec::new();
        let mut modules = Vec::new();
        for (name, src) in program::SOURCES {
            let bin = ctx.driver().module_image(name, src, arch, false)?;
            let module = match GpuModule::load(ctx, &bin) {
                Ok(m) => m,
                // A stale or damaged cache file: compile afresh once.
                Err(_) => {
                    let bin = ctx.driver().module_image(name, src, arch, true)?;
                    GpuModule::load(ctx, &bin).map_err(|e| {
                        KernelError::Backend(format!("loading module {name} for {arch}: {e}"))
                    })?
                }
            };
            let list = kernel_names(name)
                .into_iter()
                .map(|k| module.function(&k))
                .collect::<Result<Vec<_>>>()?;
            table.push(list);
            modules.push(module);
        }
        Ok(Kernels {
            table,
            _modules: modules,
            ctx: ctx.clone(),
        })
    }

    /// Kernel `index` of `module`'s name list.
    #[inline]
    pub(crate) fn func(&self, module: program::Module, index: usize) -> Function {
        self.table[module as usize][index]
    }

    /// Blocks of `threads` threads of `f` (a kernel of these modules) that fit on one SM.
    pub(crate) fn occupancy(&self, f: Function, threads: u32) -> Result<u32> {
        self.ctx.bind()?;
        // SAFETY: `f` belongs to one of our loaded modules.
        unsafe { self.ctx.driver().occupancy(f, threads, 0) }
            .map_err(driver_err("occupancy (max active blocks per SM)"))
    }

    /// Blocks of `AR_THREADS` threads that fit on one SM, for the allreduce kernel that fits
    /// fewest (they differ in registers; a grid sized for one must fit for all).
    pub(crate) fn allreduce_blocks_per_sm(&self) -> Result<u32> {
        let all = self.allreduce_occupancy()?;
        Ok(all.iter().map(|(_, n)| *n).min().unwrap_or(1))
    }

    /// (kernel, blocks of AR_THREADS that fit on one SM) for every allreduce kernel.
    pub(crate) fn allreduce_occupancy(&self) -> Result<Vec<(String, u32)>> {
        kernel_names("comm")
            .into_iter()
            .zip(&self.table[program::Module::Comm as usize])
            .map(|(name, &f)| Ok((name, self.occupancy(f, AR_THREADS)?.max(1))))
            .collect()
    }
}

/// What a launch needs from the device.
pub(crate) struct Launcher<'a> {
    pub ctx: &'a GpuCtx,
    pub stream: Stream,
    pub kernels: &'a Kernels,
    pub sms: u32,
    pub comm_blocks: u32,
    /// Whether `oneshot` uses the low-latency kernel for messages that fit its slots.
    pub ll: bool,
    /// Whether small same-dtype copies run as a kernel (else always a memcpy).
    pub small_copy_kernel: bool,
    pub err_words: u64,
    /// Decode kernels launched with programmatic stream serialization (sm_90+; every decode
    /// kernel calls tp_pdl_wait() before reading what an earlier kernel wrote).
    pub pdl: bool,
    /// Whether the tensor-core kernels may run (sm_80+: mma.sync with bf16).
    pub mma: bool,
    /// Kernel launches so far on this device (`Device::launches`).
    pub launches: &'a std::sync::atomic::AtomicU64,
}

impl Launcher<'_> {
    /// Launches kernel `index` of `module` on a 1-D grid, without programmatic dependent
    /// launch (the communication and copy kernels do not wait in-kernel).
    ///
    /// # Safety
    /// `params` is the exact parameter struct of that kernel, and every device address in it
    /// stays valid until the stream passes this launch.
    unsafe fn launch<P>(
        &self,
        module: program::Module,
        index: usize,
        grid: u32,
        block: u32,
        params: &mut P,
    ) -> Result<()> {
        let f = self.kernels.func(module, index);
        // SAFETY: per the contract.
        unsafe { self.launch_with(f, (grid, 1, 1), block, 0, false, params) }
    }

    /// Launches `f` with a 3-D grid, `block` threads and `smem` bytes of dynamic shared
    /// memory.
    ///
    /// # Safety
    /// `params` is the exact parameter struct of `f`, and every device address in it stays
    /// valid until the stream passes this launch.
    pub(crate) unsafe fn launch_fn<P>(
        &self,
        f: Function,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &mut P,
    ) -> Result<()> {
        // SAFETY: per the contract; decode kernels wait in-kernel, so PDL as configured.
        unsafe { self.launch_with(f, grid, block, smem, self.pdl, params) }
    }

    /// # Safety
    /// As [`Launcher::launch_fn`].
    unsafe fn launch_with<P>(
        &self,
        f: Function,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        pdl: bool,
        params: &mut P,
    ) -> Result<()> {
        // Relaxed: a statistic, read by the same thread after the op returns.
        self.launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut args = [(params as *mut P).cast::<c_void>()];
        let grid = (grid.0.max(1), grid.1.max(1), grid.2.max(1));
        // SAFETY: per the contract; the runtime copies the parameter values before it
        // returns, so `args` and `params` may go after the call. `pdl` is only set where the
        // driver has it (CudaDevice::set_pdl masks it by Caps::pdl).
        unsafe {
            self.ctx.driver().launch(
                f,
                grid,
                (block, 1, 1),
                smem,
                self.stream,
                args.as_mut_ptr(),
                pdl,
            )
        }
        .map_err(driver_err("launching a kernel"))
    }

    pub(crate) fn grid_for(&self, items: usize, threads: u32) -> u32 {
        // Enough blocks to give every thread one item, at most 8 per SM (grid-stride loops
        // cover the rest): a launch-size heuristic, not tuned.
        let cap = (self.sms as usize * 8).max(1);
        items.div_ceil(threads as usize).clamp(1, cap) as u32
    }

    pub(crate) fn copy(&self, src: &View<'_, CudaBuf>, dst: &View<'_, CudaBuf>) -> Result<()> {
        if src.len != dst.len {
            return Err(KernelError::Invalid(format!(
                "copy of {} elements into {}",
                src.len, dst.len
            )));
        }
        let s = src.buf.addr(src.offset, src.bytes())?;
        let d = dst.buf.addr(dst.offset, dst.bytes())?;
        if src.len == 0 {
            return Ok(());
        }
        let bytes = src.bytes();
        if src.dtype == dst.dtype && (bytes > SMALL_COPY_BYTES || !self.small_copy_kernel) {
            // SAFETY: both ranges bounds-checked; the buffers outlive the queued copy (callers
            // sync before dropping buffers).
            return unsafe {
                self.ctx.driver().memcpy_dtod_async(
                    crate::driver::DevPtr(d),
                    crate::driver::DevPtr(s),
                    bytes,
                    self.stream,
                )
            }
            .map_err(driver_err("device-to-device copy"));
        }
        // (kernel, its n, work items for the grid): bytes for copy_bytes (16 per thread),
        // elements for the converting copies.
        let (index, n, items) = if src.dtype == dst.dtype {
            (COPY_BYTES, bytes, bytes.div_ceil(16))
        } else {
            if !s.is_multiple_of(src.dtype.size() as u64)
                || !d.is_multiple_of(dst.dtype.size() as u64)
            {
                return Err(KernelError::Invalid("copy: misaligned view".into()));
            }
            (copy_index(src.dtype, dst.dtype), src.len, src.len)
        };
        let mut p = CopyParams {
            src: s,
            dst: d,
            n: n as u64,
        };
        // SAFETY: CopyParams is the parameter of copy_bytes and copy_*_*; addresses checked
        // above.
        unsafe {
            self.launch(
                program::Module::Reduce,
                index,
                self.grid_for(items, THREADS),
                THREADS,
                &mut p,
            )
        }
    }

    pub(crate) fn reduce_sum(
        &self,
        inputs: &[View<'_, CudaBuf>],
        out: &View<'_, CudaBuf>,
    ) -> Result<()> {
        if inputs.is_empty() || inputs.len() > MAX_INPUTS {
            return Err(KernelError::Invalid(format!(
                "reduce_sum of {} inputs (1..={MAX_INPUTS} on cuda)",
                inputs.len()
            )));
        }
        let mut p = ReduceParams {
            inputs: [0; MAX_INPUTS],
            out: out.buf.addr(out.offset, out.bytes())?,
            n: out.len as u64,
            nin: inputs.len() as u32,
            vec: 0,
        };
        for (i, v) in inputs.iter().enumerate() {
            if v.len != out.len || v.dtype != out.dtype {
                return Err(KernelError::Invalid(format!(
                    "reduce_sum input of {} {} into {} {}",
                    v.len, v.dtype, out.len, out.dtype
                )));
            }
            p.inputs[i] = v.buf.addr(v.offset, v.bytes())?;
        }
        let all = p.inputs[..inputs.len()].iter().chain([&p.out]);
        if all
            .clone()
            .any(|a| !a.is_multiple_of(out.dtype.size() as u64))
        {
            return Err(KernelError::Invalid("reduce_sum: misaligned view".into()));
        }
        p.vec = u32::from(all.into_iter().all(|a| a.is_multiple_of(16)));
        if out.len == 0 {
            return Ok(());
        }
        let packs = out.len.div_ceil(16 / out.dtype.size());
        // SAFETY: ReduceParams is reduce_sum_*'s parameter; addresses checked above.
        unsafe {
            self.launch(
                program::Module::Reduce,
                reduce_sum_index(out.dtype),
                self.grid_for(packs, THREADS),
                THREADS,
                &mut p,
            )
        }
    }

    /// The kernel one allreduce runs: (name without the dtype, blocks). One block per
    /// AR_THREADS work items of a block's share (16-byte packs; 8-byte lines for the
    /// low-latency oneshot), at most `comm_blocks` for the kernels that wait on peers (their
    /// blocks must all be resident at once) and MAX_BLOCKS for `host_reduce`. Depends only on
    /// (n, dtype, world, algo, the layout, comm_blocks, ll), so every rank of a job computes
    /// the same kernel and grid, which the per-block flags require.
    pub(crate) fn allreduce_kernel(
        comm_blocks: u32,
        ll: bool,
        layout: &CommLayout,
        n: usize,
        dtype: DType,
        world: usize,
        algo: CommAlgo,
    ) -> (&'static str, u32) {
        let bytes = n * dtype.size();
        let packs = n.div_ceil(16 / dtype.size());
        let (name, items, cap) = match algo {
            CommAlgo::Oneshot if ll && bytes <= layout.ll_bytes => {
                ("oneshot_ll", bytes.div_ceil(8).max(1), comm_blocks)
            }
            CommAlgo::Oneshot => ("oneshot", packs, comm_blocks),
            CommAlgo::Twoshot => ("twoshot", packs.div_ceil(world.max(1)), comm_blocks),
            CommAlgo::HostReduce => ("host_reduce", packs, MAX_BLOCKS as u32),
        };
        let grid = items
            .div_ceil(AR_THREADS as usize)
            .clamp(1, cap.clamp(1, MAX_BLOCKS as u32) as usize) as u32;
        (name, grid)
    }

    /// Queues `a`; `true` when its add + norm epilogue was fused into the allreduce kernel
    /// (one f32 row that fits the low-latency oneshot), `false` when the caller must run it.
    pub(crate) fn allreduce(&self, a: &AllreduceArgs<'_, CudaBuf>) -> Result<bool> {
        let bytes = a.data.bytes();
        // `a.abort` is not looked at: it is host memory (the control block) that a kernel
        // cannot read without registering it; device waits are bounded by `a.timeout`
        // instead, and the caller checks the abort word after `sync`.
        let mut p = ArParams {
            comm: [0; MAX_WORLD],
            data: a.data.buf.addr(a.data.offset, bytes)?,
            n: a.data.len as u64,
            data_bytes: a.layout.data_bytes as u64,
            ll: a.layout.ll_offset(0) as u64,
            ll_slot_bytes: a.layout.ll_slot_bytes as u64,
            ll_stride: a.layout.ll_stride as u64,
            timeout_ns: u64::try_from(a.timeout.as_nanos()).unwrap_or(u64::MAX),
            err: self.err_words,
            rank: a.rank as u32,
            world: a.world as u32,
            // Checked against the device epoch's low 32 bits; 0 (the host's u32 count after a
            // wrap, or a capture, below) is not checked.
            host_epoch: a.epoch,
            vec: 0,
            norm: ArNorm::default(),
        };
        for (i, b) in a.comm.iter().enumerate() {
            p.comm[i] = b.addr(0, a.layout.total_bytes())?;
        }
        if !p.data.is_multiple_of(a.data.dtype.size() as u64) {
            return Err(KernelError::Invalid(
                "allreduce: misaligned data view".into(),
            ));
        }
        // Comm buffers are VMM- or cuMemAlloc-aligned (>= 256 bytes) and slots start at 4 KiB
        // multiples (CommLayout), so only the data view can break 16-byte alignment.
        let comm_aligned = p.comm[..a.world].iter().all(|c| c.is_multiple_of(16));
        p.vec = u32::from(comm_aligned && p.data.is_multiple_of(16));
        self.ctx.bind()?;
        // While the stream is captured into a graph the host epoch would be frozen into the
        // graph, so the kernel must not check it (comm.cu: "Where the epoch comes from").
        // SAFETY: our live stream.
        if unsafe { self.ctx.driver().stream_is_capturing(self.stream) }
            .map_err(driver_err("asking whether the stream captures"))?
        {
            p.host_epoch = 0;
        }
        let (algo, grid) = Self::allreduce_kernel(
            self.comm_blocks,
            self.ll,
            &a.layout,
            a.data.len,
            a.data.dtype,
            a.world,
            a.algo,
        );
        // The decode seam: one row, f32 weights, low-latency path → one fused kernel of one
        // block (every rank decides alike: the same shapes and settings).
        if let (Some(e), "oneshot_ll") = (&a.add_norm, algo) {
            if e.rows == 1 && e.dim == a.data.len && e.w.dtype == DType::F32 {
                p.norm = ArNorm {
                    x: e.x.buf.addr(e.x.offset, e.x.bytes())?,
                    w: e.w.buf.addr(e.w.offset, e.w.bytes())?,
                    out: e.out.buf.addr(e.out.offset, e.out.bytes())?,
                    eps: e.eps,
                    pad: 0,
                };
                // SAFETY: as below; the epilogue's views were bounds-checked just above.
                unsafe { self.launch(program::Module::Comm, COMM_ADDNORM, 1, AR_THREADS, &mut p)? };
                return Ok(true);
            }
        }
        let index = comm_index(algo, a.data.dtype);
        // SAFETY: ArParams is allreduce_*'s parameter; every address bounds-checked above; the
        // error words outlive the device, which syncs before dropping them.
        unsafe { self.launch(program::Module::Comm, index, grid, AR_THREADS, &mut p)? };
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::LL_MAX_BYTES;

    /// The `#define`s of the .cu sources must equal the Rust mirrors.
    #[test]
    fn cu_defines_match_rust_constants() {
        let comm = program::SOURCES[1].1;
        let reduce = program::SOURCES[0].1;
        let def = |src: &str, name: &str| crate::cuda::twin::testing::cu_define(src, name);
        assert_eq!(def(comm, "TP_MAX_WORLD"), MAX_WORLD.to_string());
        assert_eq!(def(comm, "TP_MAX_BLOCKS"), MAX_BLOCKS.to_string());
        assert_eq!(def(comm, "TP_AR_THREADS"), AR_THREADS.to_string());
        assert_eq!(def(comm, "TP_SIG_EPOCHS"), format!("{SIG_EPOCHS}u"));
        assert_eq!(def(comm, "TP_SIG_FLAGS"), "(8192u + 1024u)");
        assert_eq!(SIG_FLAGS, 8192 + 1024);
        assert_eq!(def(comm, "TP_SIGNAL_BYTES"), "(256ull * 1024ull)");
        assert_eq!(SIGNAL_BYTES, 256 * 1024);
        assert_eq!(def(comm, "TP_ERR_PEERS"), ERR_PEERS.to_string());
        assert_eq!(def(comm, "TP_ERR_TIMEOUT"), format!("{ERR_TIMEOUT}u"));
        assert_eq!(def(comm, "TP_ERR_EPOCH"), format!("{ERR_EPOCH}u"));
        assert_eq!(def(comm, "TP_ERR_DEV_EPOCH"), ERR_DEV_EPOCH.to_string());
        assert_eq!(def(comm, "TP_ERR_HOST_EPOCH"), ERR_HOST_EPOCH.to_string());
        assert_eq!(def(comm, "TP_ERR_CODE"), ERR_CODE.to_string());
        assert_eq!(def(reduce, "TP_THREADS"), THREADS.to_string());
        assert_eq!(def(reduce, "TP_MAX_INPUTS"), MAX_INPUTS.to_string());
    }

    /// The launchers' kernel indices name the kernels `kernel_names` loads at those indices.
    #[test]
    fn kernel_indices_match_the_name_lists() {
        let comm = kernel_names("comm");
        let reduce = kernel_names("reduce");
        for d in DType::ALL {
            for algo in COMM_ALGOS {
                assert_eq!(comm[comm_index(algo, d)], format!("allreduce_{algo}_{d}"));
            }
            assert_eq!(reduce[reduce_sum_index(d)], format!("reduce_sum_{d}"));
            for s in DType::ALL.into_iter().filter(|&s| s != d) {
                assert_eq!(reduce[copy_index(s, d)], format!("copy_{s}_{d}"));
            }
        }
        assert_eq!(comm[COMM_ADDNORM], "allreduce_oneshot_ll_addnorm_f32");
        assert_eq!(comm.len(), COMM_ADDNORM + 1);
        assert_eq!(reduce[COPY_BYTES], "copy_bytes");
    }

    #[test]
    fn allreduce_grid_is_small_for_decode_and_capped() {
        let big = CommLayout::new(64 << 20, 4);
        let g = |n, d, w, a| Launcher::allreduce_kernel(64, false, &big, n, d, w, a);
        assert_eq!(g(1, DType::F32, 4, CommAlgo::Oneshot), ("oneshot", 1));
        // 16 KiB of f32 = 1024 packs = 2 blocks of 512 threads.
        assert_eq!(g(4096, DType::F32, 4, CommAlgo::Oneshot), ("oneshot", 2));
        assert_eq!(
            g(64 << 20, DType::BF16, 4, CommAlgo::Twoshot),
            ("twoshot", 64)
        );
        // host_reduce waits on nobody: not held to comm_blocks.
        assert_eq!(
            g(64 << 20, DType::BF16, 4, CommAlgo::HostReduce),
            ("host_reduce", 128)
        );
        assert_eq!(
            Launcher::allreduce_kernel(
                1000,
                false,
                &big,
                1 << 30,
                DType::F32,
                2,
                CommAlgo::Oneshot
            ),
            ("oneshot", 128)
        );
    }

    #[test]
    fn small_oneshots_take_the_low_latency_kernel_where_it_fits() {
        let big = CommLayout::new(64 << 20, 4);
        let g = |l: &CommLayout, n| {
            Launcher::allreduce_kernel(64, true, l, n, DType::F32, 4, CommAlgo::Oneshot)
        };
        // 16 KiB = 2048 lines of 8 bytes = 4 blocks.
        assert_eq!(g(&big, 4096), ("oneshot_ll", 4));
        assert_eq!(g(&big, LL_MAX_BYTES / 4), ("oneshot_ll", 16));
        assert_eq!(g(&big, LL_MAX_BYTES / 4 + 1).0, "oneshot");
        // A layout for small messages only has room for those.
        let small = CommLayout::new(1000, 4);
        assert_eq!(g(&small, 250), ("oneshot_ll", 1));
        // Twoshot never takes it.
        assert_eq!(
            Launcher::allreduce_kernel(64, true, &big, 4096, DType::F32, 4, CommAlgo::Twoshot).0,
            "twoshot"
        );
    }
}
