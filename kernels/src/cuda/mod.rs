//! The CUDA backend: [`CudaDevice`] implements [`Device`] on cudarc (driver + NVRTC, both
//! loaded at run time, so the crate builds and runs where no CUDA is installed).
//!
//! Layers (STYLE.md, cudarc's): `cudarc::driver::sys` (raw bindings) → cudarc's `result` and
//! our [`result`] (the calls cudarc does not wrap: VMM, legacy IPC, mapped host memory) →
//! owning types here and in [`mem`] with `Drop`. One stream per device: `run` queues on it,
//! `sync` waits for it and turns device-reported errors (flag-wait timeouts, epoch mismatches,
//! written into host-mapped words by the kernels) into [`KernelError`]s.
//!
//! Kernels are `kernels/src/gpu/*.cu`, compiled by NVRTC for the device's architecture and
//! cached on disk ([`program`]).
//!
//! Must not: know about processes or sockets: a peer's buffer arrives as an [`Export`] whose
//! fd was already received.

pub mod decode;
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

use cudarc::driver::result::DriverError;
use cudarc::driver::{result as dr, sys, CudaContext, CudaStream};

pub use mem::CudaBuf;
pub use probe::{device_count, driver_present, nvrtc_present, peer_matrix, probe};
pub use selftest::{selftest, SelftestResult};

use crate::comm::CommSettings;
pub use crate::device::IpcMode;
use crate::device::{Device, DeviceInfo, Export, Op, OpTime};
use crate::{KernelError, Result};
use launch::{Kernels, Launcher};
use mem::HostWords;

/// Turns a driver error into a backend error naming the call.
pub(crate) fn driver_err(what: impl Into<String>) -> impl FnOnce(DriverError) -> KernelError {
    let what = what.into();
    move |e| KernelError::Backend(format!("{what}: {e:?}"))
}

/// One rank's CUDA device: a context (the device's primary context, shared with every other
/// `CudaDevice` of this process on the same ordinal), one stream, the loaded kernels and the
/// error words.
pub struct CudaDevice {
    ordinal: usize,
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
    /// Compute capability, major version.
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
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

impl CudaDevice {
    /// [`CudaDevice::open`] with the default [`CommSettings`] (tests, tools, the selftest).
    pub fn new(ordinal: usize, mode: IpcMode) -> Result<CudaDevice> {
        Self::open(ordinal, mode, &CommSettings::default())
    }

    /// Opens device `ordinal` (after CUDA_VISIBLE_DEVICES), compiles or loads the kernels,
    /// resolves `mode` (Auto → Fd or Legacy) and applies the job's allreduce settings `comm`.
    /// `Unavailable` when there is no driver, no such device, or no NVRTC.
    pub fn open(ordinal: usize, mode: IpcMode, comm: &CommSettings) -> Result<CudaDevice> {
        probe::init()?;
        let count = dr::device::get_count().map_err(driver_err("cuDeviceGetCount"))?;
        if ordinal >= count.max(0) as usize {
            return Err(KernelError::Unavailable {
                backend: "cuda",
                why: format!("no CUDA device {ordinal} ({count} visible)"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| KernelError::Unavailable {
            backend: "cuda",
            why: format!("cannot open device {ordinal}: {e:?}"),
        })?;
        let stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let info = probe::probe()?
            .into_iter()
            .nth(ordinal)
            .expect("ordinal checked above");
        let attr = |a| ctx.attribute(a).map_err(driver_err("cuDeviceGetAttribute"));
        let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let cc = ctx
            .compute_capability()
            .map_err(driver_err("compute capability"))?;
        let mode = Self::resolve_mode(&ctx, mode)?;
        let kernels = Kernels::load(&ctx, cc)?;
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
        tracing::debug!(
            "cuda device {ordinal}: {} {}, {sms} SMs, ipc {mode:?}, {comm_blocks} comm blocks, \
             low latency {}, small-copy kernel {}",
            info.name,
            info.arch,
            comm.low_latency,
            comm.small_copy_kernel
        );
        Ok(CudaDevice {
            ordinal,
            mode,
            info,
            sms,
            comm_blocks: AtomicU32::new(comm_blocks),
            ll: AtomicBool::new(comm.low_latency),
            small_copy_kernel: comm.small_copy_kernel,
            pdl: AtomicBool::new(false),
            cc_major: cc.0,
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

    fn resolve_mode(ctx: &Arc<CudaContext>, mode: IpcMode) -> Result<IpcMode> {
        let supported = |a| ctx.attribute(a).map(|v| v != 0).unwrap_or(false);
        let vmm = supported(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        ) && supported(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        );
        match mode {
            IpcMode::Legacy => Ok(IpcMode::Legacy),
            IpcMode::Fd if vmm => Ok(IpcMode::Fd),
            IpcMode::Fd => Err(KernelError::Unavailable {
                backend: "cuda",
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

    /// Turns the low-latency `oneshot` on or off. Every rank of a job must agree (the two
    /// kernels do not meet each other).
    pub fn set_low_latency(&self, on: bool) {
        // Relaxed: a plain setting read at the next launch by the thread that queues it.
        self.ll.store(on, Ordering::Relaxed);
    }

    /// Launches the decode kernels with programmatic dependent launch (sm_90 and newer; a
    /// no-op request elsewhere): each may start while the one before it finishes, and waits
    /// in-kernel (tp_pdl_wait) before reading its outputs.
    pub fn set_pdl(&self, on: bool) {
        // Relaxed: a plain setting read at the next launch by the thread that queues it.
        self.pdl.store(on && self.cc_major >= 9, Ordering::Relaxed);
    }

    /// (kernel, blocks per SM) of every allreduce kernel, for `tprun info` and tuning notes.
    pub fn allreduce_occupancy(&self) -> Result<Vec<(String, u32)>> {
        self.kernels.allreduce_occupancy()
    }

    /// Allreduce blocks that fit on the device at once.
    pub fn comm_block_capacity(&self) -> Result<u32> {
        Ok(self.kernels.allreduce_blocks_per_sm()? * self.sms)
    }

    /// This device's stream (graph-capture tests; nothing above this crate sees raw handles).
    #[cfg(test)]
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(driver_err("binding the context"))
    }

    /// An event for timing, recorded on the stream now.
    fn timing_event(&self) -> Result<cudarc::driver::CudaEvent> {
        self.stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver_err("cuEventRecord"))
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
            stream: &self.stream,
            kernels: &self.kernels,
            sms: self.sms,
            comm_blocks: self.comm_blocks(),
            ll: self.low_latency(),
            small_copy_kernel: self.small_copy_kernel,
            err_words: self.err.device_addr(),
            // Relaxed: a plain setting, like comm_blocks.
            pdl: self.pdl.load(Ordering::Relaxed),
            mma: self.cc_major >= 8,
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
                ev.synchronize().map_err(driver_err("cuEventSynchronize"))?;
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
                dr::memcpy_htod_async(
                    d + (i * STAGE_BYTES) as u64,
                    pinned,
                    self.stream.cu_stream(),
                )
            }
            .map_err(driver_err("cuMemcpyHtoDAsync"))?;
            st.done[j] = Some(
                self.stream
                    .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(driver_err("cuEventRecord"))?,
            );
        }
        Ok(())
    }

    /// Zeroes `buf` and waits, so that other streams (peers') see zeros too.
    fn zero(&self, buf: &CudaBuf) -> Result<()> {
        // SAFETY: the whole buffer is live device memory; we wait below.
        unsafe {
            result::mem::memset_d8_async(
                buf.device_ptr(),
                0,
                buf.len().max(1),
                self.stream.cu_stream(),
            )
        }
        .map_err(driver_err("cuMemsetD8Async"))?;
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
        if self.bind().is_ok() {
            if let Err(e) = self.stream.synchronize() {
                tracing::warn!("cuda device {}: sync at drop: {e:?}", self.ordinal);
            }
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
    done: [Option<cudarc::driver::CudaEvent>; 2],
}

/// A captured, instantiated CUDA graph ([`Device::capture`]). Dropping it destroys both; the
/// caller must not drop it while a replay is queued (the model syncs first).
pub struct CudaGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    /// Keeps the context (and its modules' lifetime owner) alive and current-able until the
    /// graph is destroyed: a graph must go before the context its kernels live in.
    ctx: Arc<CudaContext>,
}

// SAFETY: graph handles are plain driver objects, usable from any thread of the process.
unsafe impl Send for CudaGraph {}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::warn!("destroying a graph: cannot bind its context: {e:?}");
            return;
        }
        // SAFETY: created by `capture`, destroyed once, in its live context; no replay is
        // pending (see above).
        unsafe {
            let _ = dr::graph::exec_destroy(self.exec);
            let _ = dr::graph::destroy(self.graph);
        }
    }
}

/// A recorded event ([`Device::mark`]).
pub struct CudaMark(cudarc::driver::CudaEvent);

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
        // SAFETY: bounds-checked. From pageable memory the driver copies `src` to a staging
        // buffer before returning (CUDA "API synchronization behavior"), so `src` may be
        // reused at once; the copy is ordered on our stream with the ops.
        unsafe { dr::memcpy_htod_async(d, src, self.stream.cu_stream()) }
            .map_err(driver_err("cuMemcpyHtoDAsync"))
    }

    fn read(&self, src: &CudaBuf, offset: usize, dst: &mut [u8]) -> Result<()> {
        let s = src.addr(offset, dst.len())?;
        if dst.is_empty() {
            return self.sync();
        }
        self.bind()?;
        // SAFETY: bounds-checked; `dst` stays borrowed until the sync below has completed the
        // copy.
        unsafe { dr::memcpy_dtoh_async(dst, s, self.stream.cu_stream()) }
            .map_err(driver_err("cuMemcpyDtoHAsync"))?;
        self.sync()
    }

    fn launch(&self, op: &Op<'_, CudaBuf>) -> Result<()> {
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
        unsafe { dr::graph::launch(graph.exec, self.stream.cu_stream()) }
            .map_err(driver_err("cuGraphLaunch"))
    }

    fn capture(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<CudaGraph>> {
        self.sync()?;
        let st = self.stream.cu_stream();
        // SAFETY: our live stream. Relaxed mode: other threads of this process (the output
        // forwarders, the heartbeat; nothing on the GPU) may make driver calls meanwhile.
        unsafe {
            dr::stream::begin_capture(st, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        }
        .map_err(driver_err("cuStreamBeginCapture"))?;
        self.capturing.store(true, Ordering::Relaxed);
        let queued = f();
        self.capturing.store(false, Ordering::Relaxed);
        // SAFETY: capture was begun above on this stream; end it even if `f` failed.
        let graph =
            unsafe { dr::stream::end_capture(st) }.map_err(driver_err("cuStreamEndCapture"));
        queued?;
        let graph = graph?;
        // SAFETY: `graph` is the complete graph captured above.
        match unsafe { dr::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
            Ok(exec) => Ok(Some(CudaGraph {
                graph,
                exec,
                ctx: self.ctx.clone(),
            })),
            Err(e) => {
                // SAFETY: created above, destroyed once.
                let _ = unsafe { dr::graph::destroy(graph) };
                Err(driver_err("cuGraphInstantiate")(e))
            }
        }
    }

    fn mark(&self) -> Result<CudaMark> {
        self.bind()?;
        let ev = self
            .stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(driver_err("cuEventRecord"))?;
        Ok(CudaMark(ev))
    }

    fn wait_mark(&self, mark: &CudaMark) -> Result<()> {
        self.bind()?;
        mark.0
            .synchronize()
            .map_err(driver_err("cuEventSynchronize"))?;
        self.take_device_error()
    }

    fn launches(&self) -> u64 {
        // Relaxed: a statistic.
        self.launches.load(Ordering::Relaxed)
    }

    fn mem_info(&self) -> Option<(u64, u64)> {
        self.bind().ok()?;
        dr::mem_get_info()
            .ok()
            .map(|(free, total)| (free as u64, total as u64))
    }

    fn alloc_mapped(&self, bytes: usize) -> Result<CudaBuf> {
        CudaBuf::alloc_mapped(&self.ctx, bytes)
    }

    fn read_mapped(&self, src: &CudaBuf, offset: usize, dst: &mut [u8]) -> Result<()> {
        src.read_host(offset, dst)
    }

    fn sync(&self) -> Result<()> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        self.take_device_error()
    }

    /// Times with CUDA events around the work `f` queues (no host clock, no launch gaps
    /// before the first op).
    fn time(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Duration> {
        self.sync()?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self
            .stream
            .record_event(flags)
            .map_err(driver_err("cuEventRecord"))?;
        f()?;
        let end = self
            .stream
            .record_event(flags)
            .map_err(driver_err("cuEventRecord"))?;
        self.sync()?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(driver_err("cuEventElapsedTime"))?;
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
    pending: Vec<(String, cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
    totals: std::collections::BTreeMap<String, (u64, f64)>,
}

impl Profiler {
    /// Most event pairs held before they are read (each read waits for the stream to reach
    /// the last one: at most one stall per this many ops).
    const BATCH: usize = 4096;

    fn push(
        &mut self,
        label: String,
        start: cudarc::driver::CudaEvent,
        end: cudarc::driver::CudaEvent,
    ) -> Result<()> {
        self.pending.push((label, start, end));
        if self.pending.len() >= Self::BATCH {
            self.drain()?;
        }
        Ok(())
    }

    fn drain(&mut self) -> Result<()> {
        if let Some((_, _, last)) = self.pending.last() {
            last.synchronize()
                .map_err(driver_err("cuEventSynchronize"))?;
        }
        for (label, start, end) in self.pending.drain(..) {
            let ms = start
                .elapsed_ms(&end)
                .map_err(driver_err("cuEventElapsedTime"))?;
            let t = self.totals.entry(label).or_insert((0, 0.0));
            t.0 += 1;
            t.1 += f64::from(ms) / 1e3;
        }
        Ok(())
    }
}
