//! The GPU backend: [`CudaDevice`] implements [`Device`] over the driver table
//! ([`crate::driver::Driver`]), with two implementations loaded at run time: CUDA
//! ([`driver::CudaDriver`]: cudarc, driver + NVRTC) and HIP ([`crate::hip::driver::HipDriver`]:
//! libamdhip64 + hiprtc), so the crate builds and runs where neither is installed. The names
//! say CUDA for history (renaming is deferred); [`Gpu`] picks the runtime.
//!
//! Layers (STYLE.md, cudarc's): raw bindings (cudarc's `sys`, the HIP table's fn pointers) →
//! the driver table (thin calls returning `Result`; for CUDA through cudarc's `result` and
//! our [`result`]: VMM, legacy IPC, mapped host memory) → owning types in [`ctx`], [`mem`]
//! and here, with `Drop`. One stream per device: `run` queues on it, `sync` waits for it and
//! turns device-reported errors (flag-wait timeouts, epoch mismatches, written into
//! host-mapped words by the kernels) into [`KernelError`]s.
//!
//! Kernels are `kernels/src/gpu/*.cu`, compiled by NVRTC or hiprtc for the device's
//! architecture and cached on disk ([`program`]). What a runtime cannot be trusted with
//! ([`Caps`]: the low-latency oneshot, PDL, `mma.sync` kernels) is masked here.
//!
//! Must not: know about processes or sockets: a peer's buffer arrives as an [`Export`] whose
//! fd was already received.

pub mod ctx;
pub mod decode;
pub mod driver;
pub mod launch;
pub mod mem;
mod ops_attention;
mod ops_decode;
mod ops_delta;
mod ops_gemv;
mod ops_gemv_q4;
mod ops_sample;
pub mod probe;
pub mod program;
pub mod result;
pub mod selftest;
mod twin;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub(crate) use ctx::driver_err;
use ctx::{GpuCtx, GpuEvent, GpuStream};
pub use mem::CudaBuf;
pub use probe::{device_count, driver_present, nvrtc_present, peer_matrix, probe};
pub use selftest::{selftest, SelftestResult};

use crate::comm::CommSettings;
pub use crate::device::IpcMode;
use crate::device::{Device, DeviceInfo, Export, Op, OpTime};
use crate::driver::{Attr, Caps, DevPtr, Driver};
use crate::{KernelError, Result};
use launch::{Kernels, Launcher};
use mem::HostWords;

/// Which runtime the GPU backend runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gpu {
    Cuda,
    Hip,
}

impl Gpu {
    pub fn name(self) -> &'static str {
        match self {
            Gpu::Cuda => "cuda",
            Gpu::Hip => "hip",
        }
    }

    /// The runtime's driver table, loaded and initialised, or `Unavailable` with the one line
    /// that says why ("no CUDA driver (libcuda.so.1) found", "hip: runtime not found
    /// (libamdhip64.so)", "no HIP device (hipInit: hipErrorNoDevice)").
    pub fn driver(self) -> Result<Arc<dyn Driver>> {
        match self {
            Gpu::Cuda => Ok(driver::CudaDriver::new()?),
            Gpu::Hip => crate::hip::driver::HipDriver::get()
                .map(|d| d as Arc<dyn Driver>)
                .map_err(|why| KernelError::Unavailable {
                    backend: "hip",
                    why,
                }),
        }
    }
}

/// One rank's GPU device: a context (the device's primary context, shared with every other
/// `CudaDevice` of this process on the same ordinal), one stream, the loaded kernels and the
/// error words.
pub struct CudaDevice {
    ordinal: usize,
    /// What the runtime can be trusted with (masks `ll`, `pdl`, the mma kernels).
    caps: Caps,
    mode: IpcMode,
    info: DeviceInfo,
    sms: u32,
    /// Most blocks one allreduce launch uses; see [`CudaDevice::set_comm_blocks`].
    comm_blocks: AtomicU32,
    /// Whether small `oneshot` messages take the low-latency kernel; see
    /// [`CudaDevice::set_low_latency`].
    ll: AtomicBool,
    /// Small same-dtype copies as a kernel (default) or always a memcpy
    /// ([`CommSettings::small_copy_kernel`]).
    small_copy_kernel: bool,
    /// Decode kernels launched with programmatic dependent launch; see
    /// [`CudaDevice::set_pdl`].
    pdl: AtomicBool,
    /// Compute capability, major version (HIP reports gfx9 as 9).
    cc_major: i32,
    /// Kernel launches queued (or captured) so far.
    launches: AtomicU64,
    /// The timeout of the last allreduce queued, for the error message.
    last_timeout_ns: AtomicU64,
    err: HostWords,
    /// Page-locked staging for large host → device writes (weights), made on first use.
    staging: std::sync::Mutex<Option<Staging>>,
    /// Per-op event pairs while profiling ([`Device::set_profiling`]); `None` when off.
    profiler: std::sync::Mutex<Option<Profiler>>,
    /// Set while [`Device::capture`] runs `f` (ops captured then are not timed).
    capturing: AtomicBool,
    kernels: Kernels,
    stream: GpuStream,
    ctx: Arc<GpuCtx>,
}

impl CudaDevice {
    /// [`CudaDevice::open`] with the default [`CommSettings`] (tests, tools, the selftest).
    pub fn new(ordinal: usize, mode: IpcMode) -> Result<CudaDevice> {
        Self::open(ordinal, mode, &CommSettings::default())
    }

    /// Opens CUDA device `ordinal` (after CUDA_VISIBLE_DEVICES), compiles or loads the
    /// kernels, resolves `mode` (Auto → Fd or Legacy) and applies the job's allreduce settings
    /// `comm`. `Unavailable` when there is no driver, no such device, or no NVRTC.
    pub fn open(ordinal: usize, mode: IpcMode, comm: &CommSettings) -> Result<CudaDevice> {
        Self::open_with(Gpu::Cuda.driver()?, ordinal, mode, comm)
    }

    /// [`CudaDevice::open`] on the runtime of `driver` ([`Gpu::driver`]).
    pub fn open_with(
        driver: Arc<dyn Driver>,
        ordinal: usize,
        mode: IpcMode,
        comm: &CommSettings,
    ) -> Result<CudaDevice> {
        let caps = driver.caps();
        let backend = caps.backend;
        let count = driver
            .device_count()
            .map_err(driver_err("counting devices"))?;
        if ordinal >= count {
            return Err(KernelError::Unavailable {
                backend,
                why: format!(
                    "no {} device {ordinal} ({count} visible)",
                    backend.to_uppercase()
                ),
            });
        }
        let ctx = GpuCtx::retain(driver, ordinal)?;
        let stream = GpuStream::new(&ctx)?;
        // Only the opened device is probed (a peer's device may be busy or broken).
        let info = probe::info_of(ctx.driver(), ordinal)?;
        let attr = |a| {
            ctx.driver()
                .attribute(ordinal, a)
                .map_err(driver_err("reading a device attribute"))
        };
        let sms = attr(Attr::MultiprocessorCount)? as u32;
        let cc_major = attr(Attr::ComputeCapabilityMajor)?;
        let mode = Self::resolve_mode(&ctx, mode)?;
        let kernels = Kernels::load(&ctx, &info.arch)?;
        let err = HostWords::new(&ctx, launch::ERR_WORDS)?;
        // Grid cap: the job's, else the default: all blocks of up to 4 ranks sharing this
        // device must be resident at once (their flag waits spin on each other; a block that
        // cannot be scheduled would leave its peers waiting until the timeout), so a fifth of
        // what fits: four ranks plus room for other work. A quarter, filling the GPU exactly,
        // timed out on the first H200 run (2026-12-02).
        let fit = kernels.allreduce_blocks_per_sm()? * sms;
        let comm_blocks = comm
            .comm_blocks
            .unwrap_or(fit / 5)
            .clamp(1, launch::MAX_BLOCKS as u32);
        // The low-latency oneshot only where 8-byte peer stores are seen whole (Caps).
        let ll = comm.low_latency && caps.atomic_u64_peer_stores;
        tracing::debug!(
            "{backend} device {ordinal}: {} {}, {sms} SMs, ipc {mode:?}, {comm_blocks} comm \
             blocks, low latency {ll}, small-copy kernel {}",
            info.name,
            info.arch,
            comm.small_copy_kernel
        );
        Ok(CudaDevice {
            ordinal,
            caps,
            mode,
            info,
            sms,
            comm_blocks: AtomicU32::new(comm_blocks),
            ll: AtomicBool::new(ll),
            small_copy_kernel: comm.small_copy_kernel,
            pdl: AtomicBool::new(false),
            cc_major,
            launches: AtomicU64::new(0),
            last_timeout_ns: AtomicU64::new(0),
            err,
            staging: std::sync::Mutex::new(None),
            profiler: std::sync::Mutex::new(None),
            capturing: AtomicBool::new(false),
            kernels,
            stream,
            ctx,
        })
    }

    fn resolve_mode(ctx: &Arc<GpuCtx>, mode: IpcMode) -> Result<IpcMode> {
        let supported = |a| {
            ctx.driver()
                .attribute(ctx.ordinal(), a)
                .map(|v| v != 0)
                .unwrap_or(false)
        };
        // HIP's table has no VMM export (not on gfx906; Caps::vmm), whatever it reports.
        let vmm = ctx.caps().vmm
            && supported(Attr::VirtualMemoryManagement)
            && supported(Attr::PosixFdHandles);
        match mode {
            IpcMode::Legacy => Ok(IpcMode::Legacy),
            IpcMode::Fd if vmm => Ok(IpcMode::Fd),
            IpcMode::Fd => Err(KernelError::Unavailable {
                backend: ctx.caps().backend,
                why: "this device does not support VMM POSIX-fd export (use --ipc legacy)".into(),
            }),
            IpcMode::Auto => {
                // The attributes can claim support where a container forbids it: try it.
                let works = vmm && CudaBuf::alloc_shared(ctx, IpcMode::Fd, 1).is_ok();
                Ok(if works { IpcMode::Fd } else { IpcMode::Legacy })
            }
        }
    }

    /// The resolved IPC mode (never `Auto`).
    pub fn ipc_mode(&self) -> IpcMode {
        self.mode
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Streaming multiprocessors.
    pub fn sms(&self) -> u32 {
        self.sms
    }

    /// Most blocks one allreduce launch uses.
    pub fn comm_blocks(&self) -> u32 {
        // Relaxed: a plain setting that publishes nothing else; pairs with set_comm_blocks.
        self.comm_blocks.load(Ordering::Relaxed)
    }

    /// Sets the most blocks one allreduce launch uses (1..=128). Every rank of a job must use
    /// the same value (ranks compute the grid alike, and block b waits for the peers' block
    /// b). The default (a fifth of [`CudaDevice::comm_block_capacity`]) suits up to 4 ranks
    /// per device; with one rank per device it can be raised towards the capacity, with more
    /// ranks per device it must be lowered below capacity / ranks.
    pub fn set_comm_blocks(&self, n: u32) {
        // Relaxed: a plain setting read at the next launch by the thread that queues it.
        self.comm_blocks
            .store(n.clamp(1, launch::MAX_BLOCKS as u32), Ordering::Relaxed);
    }

    /// Whether `oneshot` runs the low-latency kernel for messages of up to
    /// `CommLayout::ll_bytes` ([`CommSettings::low_latency`] when opened; default on).
    pub fn low_latency(&self) -> bool {
        // Relaxed: a plain setting, like comm_blocks.
        self.ll.load(Ordering::Relaxed)
    }

    /// Turns the low-latency `oneshot` on or off (stays off where the runtime cannot be
    /// trusted with it: [`CudaDevice::low_latency_supported`]). Every rank of a job must
    /// agree (the two kernels do not meet each other).
    pub fn set_low_latency(&self, on: bool) {
        // Relaxed: a plain setting read at the next launch by the thread that queues it.
        self.ll
            .store(on && self.low_latency_supported(), Ordering::Relaxed);
    }

    /// Whether the low-latency `oneshot` can run here ([`Caps::atomic_u64_peer_stores`]).
    pub fn low_latency_supported(&self) -> bool {
        self.caps.atomic_u64_peer_stores
    }

    /// Launches the decode kernels with programmatic dependent launch (sm_90 and newer, CUDA
    /// only; a no-op request elsewhere): each may start while the one before it finishes, and
    /// waits in-kernel (tp_pdl_wait) before reading its outputs.
    pub fn set_pdl(&self, on: bool) {
        // Relaxed: a plain setting read at the next launch by the thread that queues it.
        self.pdl
            .store(on && self.caps.pdl && self.cc_major >= 9, Ordering::Relaxed);
    }

    /// Whether kernels built on warp-level `mma.sync` may be picked (NVIDIA sm_80+ only).
    pub fn mma_sync(&self) -> bool {
        self.caps.mma_sync && self.cc_major >= 8
    }

    /// The runtime's name ("cuda", "hip").
    pub fn backend(&self) -> &'static str {
        self.caps.backend
    }

    /// (kernel, blocks per SM) of every allreduce kernel, for `tprun info` and tuning notes.
    pub fn allreduce_occupancy(&self) -> Result<Vec<(String, u32)>> {
        self.kernels.allreduce_occupancy()
    }

    /// Allreduce blocks that fit on the device at once.
    pub fn comm_block_capacity(&self) -> Result<u32> {
        Ok(self.kernels.allreduce_blocks_per_sm()? * self.sms)
    }

    /// This device's stream and driver table (graph-capture tests; nothing above this crate
    /// sees raw handles).
    #[cfg(test)]
    pub(crate) fn raw_stream(&self) -> (crate::driver::Stream, &dyn Driver) {
        (self.stream.raw(), self.ctx.driver())
    }

    #[inline]
    fn bind(&self) -> Result<()> {
        self.ctx.bind()
    }

    /// An event for timing, recorded on the stream now.
    fn timing_event(&self) -> Result<GpuEvent> {
        self.stream.record(true)
    }

    /// [`Device::launch`] without the profiler.
    fn launch_op(&self, op: &Op<'_, CudaBuf>) -> Result<()> {
        let l = self.launcher();
        match op {
            Op::Copy(a) => l.copy(&a.src, &a.dst),
            Op::ReduceSum(a) => l.reduce_sum(a.inputs, &a.out),
            Op::Allreduce(args) => {
                // Relaxed: only read back by this device's own error report, after a sync.
                self.last_timeout_ns.store(
                    u64::try_from(args.timeout.as_nanos()).unwrap_or(u64::MAX),
                    Ordering::Relaxed,
                );
                let fused = l.allreduce(args)?;
                // The residual add + norm after the sum, where the kernel did not fuse it.
                match args.add_norm_op() {
                    Some(e) if !fused => l.decode_op(&Op::AddRmsNorm(e)),
                    _ => Ok(()),
                }
            }
            other => l.decode_op(other),
        }
    }

    fn launcher(&self) -> Launcher<'_> {
        Launcher {
            ctx: &self.ctx,
            stream: self.stream.raw(),
            kernels: &self.kernels,
            sms: self.sms,
            comm_blocks: self.comm_blocks(),
            ll: self.low_latency(),
            small_copy_kernel: self.small_copy_kernel,
            err_words: self.err.device_addr(),
            // Relaxed: a plain setting, like comm_blocks.
            pdl: self.pdl.load(Ordering::Relaxed),
            mma: self.mma_sync(),
            launches: &self.launches,
        }
    }

    /// A large host → device copy through the two staging buffers (see [`Staging`]).
    fn write_staged(&self, d: u64, src: &[u8]) -> Result<()> {
        let mut guard = self
            .staging
            .lock()
            .map_err(|_| KernelError::Backend("staging lock poisoned".into()))?;
        if guard.is_none() {
            *guard = Some(Staging {
                bufs: [
                    CudaBuf::alloc_mapped(&self.ctx, STAGE_BYTES)?,
                    CudaBuf::alloc_mapped(&self.ctx, STAGE_BYTES)?,
                ],
                done: [None, None],
            });
        }
        let st = guard.as_mut().expect("made above");
        for (i, chunk) in src.chunks(STAGE_BYTES).enumerate() {
            let j = i % 2;
            if let Some(ev) = st.done[j].take() {
                ev.sync()?;
            }
            let host = st.bufs[j]
                .host_ptr()
                .expect("staging buffers are host-mapped");
            // SAFETY: the buffer holds STAGE_BYTES ≥ chunk.len() bytes and no copy reads it
            // (its last copy's event completed above).
            let pinned = unsafe {
                std::ptr::copy_nonoverlapping(chunk.as_ptr(), host, chunk.len());
                std::slice::from_raw_parts(host as *const u8, chunk.len())
            };
            // SAFETY: the destination range was bounds-checked by the caller (`d` covers
            // src.len() bytes); `pinned` stays untouched until the event recorded below has
            // completed.
            unsafe {
                self.ctx.driver().memcpy_htod_async(
                    DevPtr(d + (i * STAGE_BYTES) as u64),
                    pinned.as_ptr(),
                    pinned.len(),
                    self.stream.raw(),
                )
            }
            .map_err(driver_err("host-to-device copy"))?;
            st.done[j] = Some(self.stream.record(false)?);
        }
        Ok(())
    }

    /// Zeroes `buf` and waits, so that other streams (peers') see zeros too.
    fn zero(&self, buf: &CudaBuf) -> Result<()> {
        // SAFETY: the whole buffer is live device memory; we wait below.
        unsafe {
            self.ctx.driver().memset_d8_async(
                DevPtr(buf.device_ptr()),
                0,
                buf.len().max(1),
                self.stream.raw(),
            )
        }
        .map_err(driver_err("memset"))?;
        self.sync()
    }

    /// Turns what the kernels reported into an error, and clears it. Call only after the
    /// stream synchronised.
    fn take_device_error(&self) -> Result<()> {
        let code = self.err.get(launch::ERR_CODE);
        if code == 0 {
            return Ok(());
        }
        let dev_epoch = self.err.get(launch::ERR_DEV_EPOCH);
        let host_epoch = self.err.get(launch::ERR_HOST_EPOCH);
        let peers: Vec<usize> = (0..crate::comm::MAX_WORLD)
            .filter(|&p| self.err.get(launch::ERR_PEERS + p) != 0)
            .collect();
        for i in 0..launch::ERR_WORDS {
            self.err.set(i, 0);
        }
        Err(match code {
            // Relaxed load of last_timeout_ns: written by `run` on a thread that queued work we
            // have just synchronised with; it only labels the message.
            launch::ERR_TIMEOUT => KernelError::Timeout {
                what: "allreduce (device flag wait)",
                waited: Duration::from_nanos(self.last_timeout_ns.load(Ordering::Relaxed)),
                peers,
            },
            launch::ERR_EPOCH => KernelError::Invalid(format!(
                "allreduce called with epoch {host_epoch}, but the device's epoch counter is \
                 at {dev_epoch} (every call must advance the epoch by one)"
            )),
            c => KernelError::Backend(format!("unknown device error code {c}")),
        })
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Queued work may still use the error words and the kernels: wait for it. Never
        // panics; an error here can only be reported.
        if let Err(e) = self.stream.sync() {
            tracing::warn!(
                "{} device {}: sync at drop: {e}",
                self.caps.backend,
                self.ordinal
            );
        }
    }
}

/// Writes above this size go through [`Staging`]: below it the driver's own copy of pageable
/// memory is as fast and needs no buffer.
const STAGE_MIN: usize = 1 << 20;
/// One staging buffer: 32 MiB, big enough that a chunk's DMA (~1 ms at 25–50 GB/s) hides
/// the fixed costs, small enough to be nothing next to the weights.
const STAGE_BYTES: usize = 32 << 20;

/// Two page-locked host buffers: the host copies chunk i of a write into one (reading its
/// source: for weights, pages of an mmapped file) while the copy engine moves chunk i − 1
/// from the other to the device; an event per buffer says when it may be refilled.
struct Staging {
    bufs: [CudaBuf; 2],
    done: [Option<GpuEvent>; 2],
}

/// A captured, instantiated graph ([`Device::capture`]). Dropping it destroys both; the
/// caller must not drop it while a replay is queued (the model syncs first).
pub struct CudaGraph {
    graph: crate::driver::Graph,
    exec: crate::driver::GraphExec,
    /// Keeps the context (and its modules' lifetime owner) alive and current-able until the
    /// graph is destroyed: a graph must go before the context its kernels live in.
    ctx: Arc<GpuCtx>,
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind() {
            tracing::warn!("destroying a graph: cannot bind its context: {e}");
        }
        // SAFETY: created by `capture`, destroyed once, in its live context; no replay is
        // pending (see above).
        unsafe {
            let _ = self.ctx.driver().graph_exec_destroy(self.exec);
            let _ = self.ctx.driver().graph_destroy(self.graph);
        }
    }
}

/// A recorded event ([`Device::mark`]).
pub struct CudaMark(GpuEvent);

impl Device for CudaDevice {
    type Buf = CudaBuf;
    type Graph = CudaGraph;
    type Mark = CudaMark;

    fn info(&self) -> DeviceInfo {
        self.info.clone()
    }

    fn op_limits(&self) -> crate::device::OpLimits {
        ops_delta::LIMITS
    }

    fn alloc(&self, bytes: usize) -> Result<CudaBuf> {
        let buf = CudaBuf::alloc(&self.ctx, bytes)?;
        self.zero(&buf)?;
        Ok(buf)
    }

    fn alloc_shared(&self, bytes: usize) -> Result<(CudaBuf, Export)> {
        let (buf, export) = CudaBuf::alloc_shared(&self.ctx, self.mode, bytes)?;
        self.zero(&buf)?;
        Ok((buf, export))
    }

    fn import(&self, export: Export) -> Result<CudaBuf> {
        CudaBuf::import(&self.ctx, export)
    }

    fn write(&self, dst: &CudaBuf, offset: usize, src: &[u8]) -> Result<()> {
        let d = dst.addr(offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        if src.len() > STAGE_MIN {
            return self.write_staged(d, src);
        }
        // SAFETY: bounds-checked. From pageable memory CUDA copies `src` to a staging buffer
        // before returning ("API synchronization behavior"), so `src` may be reused at once;
        // the copy is ordered on our stream with the ops. Where the runtime does not promise
        // that (Caps::pageable_copy_staged: HIP), we wait for the copy below before `src`
        // can change.
        unsafe {
            self.ctx.driver().memcpy_htod_async(
                DevPtr(d),
                src.as_ptr(),
                src.len(),
                self.stream.raw(),
            )
        }
        .map_err(driver_err("host-to-device copy"))?;
        if !self.caps.pageable_copy_staged {
            self.stream.sync()?;
        }
        Ok(())
    }

    fn read(&self, src: &CudaBuf, offset: usize, dst: &mut [u8]) -> Result<()> {
        let s = src.addr(offset, dst.len())?;
        if dst.is_empty() {
            return self.sync();
        }
        self.bind()?;
        // SAFETY: bounds-checked; `dst` stays borrowed until the sync below has completed the
        // copy.
        unsafe {
            self.ctx.driver().memcpy_dtoh_async(
                dst.as_mut_ptr(),
                DevPtr(s),
                dst.len(),
                self.stream.raw(),
            )
        }
        .map_err(driver_err("device-to-host copy"))?;
        self.sync()
    }

    unsafe fn launch(&self, op: &Op<'_, CudaBuf>) -> Result<()> {
        self.bind()?;
        let mut prof = self.profiler.lock().map_err(|_| poisoned("profiler"))?;
        match prof.as_mut() {
            Some(p) if !self.capturing.load(Ordering::Relaxed) => {
                let start = self.timing_event()?;
                self.launch_op(op)?;
                let end = self.timing_event()?;
                p.push(op.label(), start, end)
            }
            _ => {
                drop(prof);
                self.launch_op(op)
            }
        }
    }

    fn set_profiling(&self, on: bool) -> bool {
        if let Ok(mut p) = self.profiler.lock() {
            *p = on.then(Profiler::default);
        }
        true
    }

    fn profile(&self) -> Result<Vec<OpTime>> {
        let mut prof = self.profiler.lock().map_err(|_| poisoned("profiler"))?;
        let Some(p) = prof.as_mut() else {
            return Ok(Vec::new());
        };
        p.drain()?;
        let mut v: Vec<OpTime> = p
            .totals
            .iter()
            .map(|(label, &(calls, seconds))| OpTime {
                label: label.clone(),
                calls,
                seconds,
            })
            .collect();
        v.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        Ok(v)
    }

    fn replay(&self, graph: &CudaGraph) -> Result<()> {
        self.bind()?;
        // SAFETY: an instantiated graph of this context; every buffer it uses is owned by
        // whoever captured it, who keeps them alive while replays are queued.
        unsafe {
            self.ctx
                .driver()
                .graph_launch(graph.exec, self.stream.raw())
        }
        .map_err(driver_err("launching a graph"))
    }

    fn capture(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<CudaGraph>> {
        self.sync()?;
        let drv = self.ctx.driver();
        let st = self.stream.raw();
        // SAFETY: our live stream. Relaxed mode: other threads of this process (the output
        // forwarders, the heartbeat; nothing on the GPU) may make driver calls meanwhile.
        unsafe { drv.begin_capture(st) }.map_err(driver_err("beginning a stream capture"))?;
        self.capturing.store(true, Ordering::Relaxed);
        let queued = f();
        self.capturing.store(false, Ordering::Relaxed);
        // SAFETY: capture was begun above on this stream; end it even if `f` failed.
        let graph = unsafe { drv.end_capture(st) }.map_err(driver_err("ending a stream capture"));
        if let Err(e) = queued {
            if let Ok(g) = graph {
                // SAFETY: the (partial) graph captured above, destroyed once.
                let _ = unsafe { drv.graph_destroy(g) };
            }
            return Err(e);
        }
        let graph = graph?;
        // SAFETY: `graph` is the complete graph captured above.
        match unsafe { drv.graph_instantiate(graph) } {
            Ok(exec) => Ok(Some(CudaGraph {
                graph,
                exec,
                ctx: self.ctx.clone(),
            })),
            Err(e) => {
                // SAFETY: created above, destroyed once.
                let _ = unsafe { drv.graph_destroy(graph) };
                Err(driver_err("instantiating a graph")(e))
            }
        }
    }

    fn mark(&self) -> Result<CudaMark> {
        self.bind()?;
        Ok(CudaMark(self.stream.record(false)?))
    }

    fn wait_mark(&self, mark: &CudaMark) -> Result<()> {
        self.bind()?;
        mark.0.sync()?;
        self.take_device_error()
    }

    fn launches(&self) -> u64 {
        // Relaxed: a statistic.
        self.launches.load(Ordering::Relaxed)
    }

    fn mem_info(&self) -> Option<(u64, u64)> {
        self.bind().ok()?;
        self.ctx.driver().mem_get_info().ok()
    }

    fn alloc_mapped(&self, bytes: usize) -> Result<CudaBuf> {
        CudaBuf::alloc_mapped(&self.ctx, bytes)
    }

    fn read_mapped(&self, src: &CudaBuf, offset: usize, dst: &mut [u8]) -> Result<()> {
        src.read_host(offset, dst)
    }

    fn sync(&self) -> Result<()> {
        self.stream.sync()?;
        self.take_device_error()
    }

    /// Times with GPU events around the work `f` queues (no host clock, no launch gaps
    /// before the first op).
    fn time(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Duration> {
        self.sync()?;
        let start = self.stream.record(true)?;
        f()?;
        let end = self.stream.record(true)?;
        self.sync()?;
        let ms = start.elapsed_ms(&end)?;
        Ok(Duration::from_secs_f64(f64::from(ms) / 1e3))
    }
}

fn poisoned(what: &str) -> KernelError {
    KernelError::Backend(format!("{what} lock poisoned"))
}

/// Event pairs around each op while profiling, turned into totals per label in batches (an
/// event pair is read only once the stream has passed it).
#[derive(Default)]
struct Profiler {
    pending: Vec<(String, GpuEvent, GpuEvent)>,
    totals: std::collections::BTreeMap<String, (u64, f64)>,
}

impl Profiler {
    /// Most event pairs held before they are read (each read waits for the stream to reach
    /// the last one: at most one stall per this many ops).
    const BATCH: usize = 4096;

    fn push(&mut self, label: String, start: GpuEvent, end: GpuEvent) -> Result<()> {
        self.pending.push((label, start, end));
        if self.pending.len() >= Self::BATCH {
            self.drain()?;
        }
        Ok(())
    }

    fn drain(&mut self) -> Result<()> {
        if let Some((_, _, last)) = self.pending.last() {
            last.sync()?;
        }
        for (label, start, end) in self.pending.drain(..) {
            let ms = start.elapsed_ms(&end)?;
            let t = self.totals.entry(label).or_insert((0, 0.0));
            t.0 += 1;
            t.1 += f64::from(ms) / 1e3;
        }
        Ok(())
    }
}
