//! The `Device` trait: the one interface every backend implements.
//!
//! Kept small on purpose (STYLE.md, candle's lesson): memory, copies, synchronisation,
//! shareable buffers, timing, and a single dispatch point [`Device::run`] that takes an [`Op`].
//! A new op is a new `Op` variant plus one arm per backend, not a new trait method.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::comm::AllreduceArgs;
use crate::{ops, DType, Result};

/// What a backend says about the device a rank runs on (for error messages and `tprun info`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeviceInfo {
    /// "cpu", "cuda" or "hip".
    pub backend: String,
    /// Ordinal within the process's visible devices (always 0 after CUDA_VISIBLE_DEVICES).
    pub ordinal: usize,
    /// Human-readable name ("cpu", "NVIDIA H200").
    pub name: String,
    /// Bytes of device memory (0 when not meaningful).
    pub memory: u64,
    /// Architecture string ("x86_64", "sm_90", "gfx906").
    pub arch: String,
    /// A stable identity of the physical device (PCI bus id or UUID), used to detect ranks that
    /// share one device.
    pub uuid: String,
}

/// Shape limits of a backend's kernels that a model must fit ([`Device::op_limits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpLimits {
    /// Most taps of [`crate::ops::CausalConv`] (`kernel`).
    pub conv_taps: usize,
    /// Largest key head dimension of [`crate::ops::GatedDelta`] (`dk`).
    pub delta_dk: usize,
}

impl OpLimits {
    /// No limit (the CPU backend).
    pub const NONE: OpLimits = OpLimits {
        conv_taps: usize::MAX,
        delta_dk: usize::MAX,
    };
}

/// How GPU backends export shareable buffers to other processes (`--ipc`); the CPU backend
/// always uses memfds and ignores it. The one type for this choice: the job spec carries it
/// and the CLI parses it with [`IpcMode::parse`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum IpcMode {
    /// VMM (`cuMemCreate`) exported as a POSIX fd that travels by SCM_RIGHTS: works across
    /// containers and PID namespaces, and can be imported in the exporting process too.
    Fd,
    /// `cuMemAlloc` + `cuIpcGetMemHandle` (64 bytes, no fd): works where VMM fds do not, but
    /// needs a shared PID namespace, and a process cannot open its own handles.
    Legacy,
    /// `Fd` when the device supports it (checked by exporting a small test allocation), else
    /// `Legacy`.
    Auto,
}

impl IpcMode {
    pub const ALL: [IpcMode; 3] = [IpcMode::Auto, IpcMode::Fd, IpcMode::Legacy];

    /// "auto", "fd" or "legacy" (the CLI's spelling).
    pub fn name(self) -> &'static str {
        match self {
            IpcMode::Fd => "fd",
            IpcMode::Legacy => "legacy",
            IpcMode::Auto => "auto",
        }
    }

    pub fn parse(s: &str) -> Option<IpcMode> {
        IpcMode::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// How a shareable buffer is described to another process. The file descriptor, if any,
/// travels separately (SCM_RIGHTS); this part is serialised into the wire message.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum ExportMeta {
    /// A memfd of `bytes` bytes, mapped shared (CPU backend). Carries one fd.
    Memfd { bytes: usize },
    /// A CUDA VMM allocation exported as a POSIX fd (`cuMemExportToShareableHandle`).
    /// Carries one fd. `bytes` is the padded allocation size.
    CudaVmmFd { bytes: usize },
    /// A legacy CUDA IPC handle (`cuIpcGetMemHandle`, 64 bytes). Carries no fd.
    CudaLegacy { bytes: usize, handle: Vec<u8> },
}

impl ExportMeta {
    pub fn bytes(&self) -> usize {
        match self {
            ExportMeta::Memfd { bytes }
            | ExportMeta::CudaVmmFd { bytes }
            | ExportMeta::CudaLegacy { bytes, .. } => *bytes,
        }
    }
}

/// A shareable buffer's description plus the descriptor that must travel with it.
#[derive(Debug)]
pub struct Export {
    pub meta: ExportMeta,
    pub fd: Option<OwnedFd>,
}

/// `bytes` bytes at `offset` must lie inside a buffer of `len` bytes: the bounds check every
/// backend's buffer makes before touching memory.
pub(crate) fn check_range(offset: usize, bytes: usize, len: usize) -> Result<()> {
    match offset.checked_add(bytes) {
        Some(end) if end <= len => Ok(()),
        _ => Err(crate::KernelError::Invalid(format!(
            "range {offset}..{offset}+{bytes} is outside a {len}-byte buffer"
        ))),
    }
}

/// A typed window into a buffer: `len` elements of `dtype` starting `offset` bytes in.
pub struct View<'a, B> {
    pub buf: &'a B,
    /// Byte offset into `buf`.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
    pub dtype: DType,
}

impl<B> Clone for View<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for View<'_, B> {}

impl<'a, B> View<'a, B> {
    pub fn new(buf: &'a B, offset: usize, len: usize, dtype: DType) -> Self {
        View {
            buf,
            offset,
            len,
            dtype,
        }
    }

    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// Whether the byte ranges of this view and `other` share any byte.
    pub fn overlaps(&self, other: &View<'_, B>) -> bool {
        std::ptr::eq(self.buf, other.buf)
            && self.offset < other.offset + other.bytes()
            && other.offset < self.offset + self.bytes()
    }

    /// The sub-view of elements `start..start + len`.
    pub fn slice(&self, start: usize, len: usize) -> Self {
        debug_assert!(start + len <= self.len);
        View {
            buf: self.buf,
            offset: self.offset + start * self.dtype.size(),
            len,
            dtype: self.dtype,
        }
    }
}

/// The ops a backend runs, each with its validated argument struct ([`crate::ops`]). Outputs
/// may not overlap inputs unless the op says so. (An op is built on the stack for one `run`
/// and never stored, so the size of its largest variant costs nothing worth a box.)
#[allow(clippy::large_enum_variant)]
pub enum Op<'a, B> {
    Copy(ops::Copy<'a, B>),
    ReduceSum(ops::ReduceSum<'a, B>),
    /// A peer-buffer allreduce (`oneshot`, `twoshot` or the device half of `host`), in place
    /// on `args.data`, optionally followed by a residual add + RMSNorm; see [`crate::comm`].
    Allreduce(AllreduceArgs<'a, B>),
    Fill(ops::Fill<'a, B>),
    Embedding(ops::Embedding<'a, B>),
    RmsNorm(ops::RmsNorm<'a, B>),
    AddRmsNorm(ops::AddRmsNorm<'a, B>),
    Rope(ops::Rope<'a, B>),
    QkvRope(ops::QkvRope<'a, B>),
    Attention(ops::Attention<'a, B>),
    GatedDelta(ops::GatedDelta<'a, B>),
    CausalConv(ops::CausalConv<'a, B>),
    GatedRmsNorm(ops::GatedRmsNorm<'a, B>),
    SiluMul(ops::SiluMul<'a, B>),
    SigmoidMul(ops::SigmoidMul<'a, B>),
    Add(ops::Add<'a, B>),
    Matmul(ops::Matmul<'a, B>),
    AddNormMatmul(ops::AddNormMatmul<'a, B>),
    QkvMatmul(ops::QkvMatmul<'a, B>),
    MatmulInt4(ops::MatmulInt4<'a, B>),
    ShardTopK(ops::ShardTopK<'a, B>),
    Sample(ops::Sample<'a, B>),
}

impl<B> Op<'_, B> {
    /// The op's name, for errors ("the cuda backend has no kernel for rms_norm yet").
    /// [`Op::name`], with the shape where one op serves several (the profile's label).
    pub fn label(&self) -> String {
        match self {
            Op::Matmul(a) => format!(
                "matmul {}x{}{}{}{}",
                a.n,
                a.k,
                if a.prologue == crate::ops::Prologue::SiluMul {
                    " silu"
                } else {
                    ""
                },
                if a.epilogue == crate::ops::Epilogue::SiluMul {
                    " then silu"
                } else {
                    ""
                },
                if a.m > 1 { " (prefill)" } else { "" }
            ),
            Op::MatmulInt4(a) => format!(
                "matmul_int4 {}x{}{}{}",
                a.n,
                a.k,
                if a.prologue == crate::ops::Prologue::SiluMul {
                    " silu"
                } else {
                    ""
                },
                if a.m > 1 { " (prefill)" } else { "" }
            ),
            Op::Allreduce(a) if a.add_norm_op().is_some() => "allreduce+add_rms_norm".into(),
            Op::AddNormMatmul(a) => format!(
                "add_norm+matmul {}x{}{}",
                a.n,
                a.k,
                if a.m > 1 { " (prefill)" } else { "" }
            ),
            Op::QkvMatmul(a) => format!(
                "{}matmul+qkv_rope {}x{}",
                if a.seam.is_some() { "add_norm+" } else { "" },
                a.n(),
                a.k
            ),
            Op::Attention(a) if a.rows > 1 => "attention (prefill)".into(),
            other => other.name().into(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Op::Copy(_) => "copy",
            Op::ReduceSum(_) => "reduce_sum",
            Op::Allreduce(_) => "allreduce",
            Op::Fill(_) => "fill",
            Op::Embedding(_) => "embedding",
            Op::RmsNorm(_) => "rms_norm",
            Op::AddRmsNorm(_) => "add_rms_norm",
            Op::Rope(_) => "rope",
            Op::QkvRope(_) => "qkv_rope",
            Op::GatedDelta(_) => "gated_delta",
            Op::CausalConv(_) => "causal_conv",
            Op::GatedRmsNorm(_) => "gated_rms_norm",
            Op::Attention(_) => "attention",
            Op::SiluMul(_) => "silu_mul",
            Op::SigmoidMul(_) => "sigmoid_mul",
            Op::Add(_) => "add",
            Op::Matmul(_) => "matmul",
            Op::AddNormMatmul(_) => "add_norm_matmul",
            Op::QkvMatmul(_) => "qkv_matmul",
            Op::MatmulInt4(_) => "matmul_int4",
            Op::ShardTopK(_) => "shard_topk",
            Op::Sample(_) => "sample",
        }
    }

    /// The checks of the op's argument struct: shapes, dtypes, parameters, and which outputs
    /// may share bytes with which inputs. [`Device::run`] calls it once; backends'
    /// [`Device::launch`] may assume it passed.
    pub fn validate(&self) -> Result<()> {
        match self {
            Op::Copy(a) => a.validate(),
            Op::ReduceSum(a) => a.validate(),
            Op::Allreduce(a) => a.validate(),
            Op::Fill(_) => Ok(()),
            Op::Embedding(a) => a.validate(),
            Op::RmsNorm(a) => a.validate(),
            Op::AddRmsNorm(a) => a.validate(),
            Op::Rope(a) => a.validate(),
            Op::QkvRope(a) => a.validate(),
            Op::GatedDelta(a) => a.validate(),
            Op::CausalConv(a) => a.validate(),
            Op::GatedRmsNorm(a) => a.validate(),
            Op::Attention(a) => a.validate(),
            Op::SiluMul(a) => a.validate(),
            Op::SigmoidMul(a) => a.validate(),
            Op::Add(a) => a.validate(),
            Op::Matmul(a) => a.validate(),
            Op::AddNormMatmul(a) => a.validate(),
            Op::QkvMatmul(a) => a.validate(),
            Op::MatmulInt4(a) => a.validate(),
            Op::ShardTopK(a) => a.validate(),
            Op::Sample(a) => a.validate(),
        }
    }
}

/// Device time of one kind of op over a profiled run ([`Device::set_profiling`]).
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    /// The op's name, with the shape where one kind has several (`matmul 6144x4096`).
    pub label: String,
    pub calls: u64,
    pub seconds: f64,
}

/// A compute device as seen by one rank.
pub trait Device: Send + Sync + 'static {
    /// Device memory owned by (or mapped into) this process. Dropping it frees or unmaps it.
    type Buf: Send + Sync;
    /// A captured graph of queued work ([`Device::capture`]); `()` where there are none.
    type Graph: Send;
    /// A point in the queued work ([`Device::mark`]).
    type Mark: Send;

    fn info(&self) -> DeviceInfo;

    /// Private device memory, zeroed.
    fn alloc(&self, bytes: usize) -> Result<Self::Buf>;

    /// Device memory that other processes can map, zeroed, with its export.
    fn alloc_shared(&self, bytes: usize) -> Result<(Self::Buf, Export)>;

    /// Maps a peer's shareable buffer into this process.
    fn import(&self, export: Export) -> Result<Self::Buf>;

    /// Kernel launches this device has queued or captured so far (GPU backends; 0 on the CPU,
    /// which runs ops as calls).
    fn launches(&self) -> u64 {
        0
    }

    /// Turns per-op timing on or off: while on, every op launched outside a capture is
    /// bracketed by device events (a measurement mode: it adds a little time per op, and
    /// graphs cannot be timed per op). Returns whether the backend can profile (GPUs).
    fn set_profiling(&self, _on: bool) -> bool {
        false
    }

    /// Device time per op label since profiling was turned on, largest first; waits for the
    /// queued work. Empty where the backend cannot profile.
    fn profile(&self) -> Result<Vec<OpTime>> {
        Ok(Vec::new())
    }

    /// (free, total) bytes of device memory, where the backend can tell (GPUs).
    fn mem_info(&self) -> Option<(u64, u64)> {
        None
    }

    /// The shapes this backend's kernels take, where they are bounded (GPUs), for a model to
    /// check once at load, before any weight is read.
    fn op_limits(&self) -> OpLimits {
        OpLimits::NONE
    }

    /// Host → device copy of `src` to `dst` at byte `offset`.
    fn write(&self, dst: &Self::Buf, offset: usize, src: &[u8]) -> Result<()>;

    /// Device → host copy from `src` at byte `offset` into `dst`. Waits for queued work.
    fn read(&self, src: &Self::Buf, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Runs (or queues, on a GPU stream) one op after validating its arguments once.
    fn run(&self, op: &Op<'_, Self::Buf>) -> Result<()> {
        op.validate()?;
        // SAFETY: validated just above.
        unsafe { self.launch(op) }
    }

    /// Runs (or queues) one op whose arguments passed [`Op::validate`]; backends still
    /// bounds-check each view against its buffer. Call [`Device::run`] instead.
    ///
    /// # Safety
    /// `op.validate()` must have passed: backends rely on it for what no buffer can check,
    /// above all which outputs may share bytes with which inputs (the CPU's threads would
    /// race on an overlap that validate() refuses).
    unsafe fn launch(&self, op: &Op<'_, Self::Buf>) -> Result<()>;

    /// Waits until all queued work is done.
    fn sync(&self) -> Result<()>;

    /// Times the device work `f` queues: host clock around `f` and a sync by default; GPU
    /// backends override it with events.
    fn time(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Duration> {
        self.sync()?;
        let t0 = Instant::now();
        f()?;
        self.sync()?;
        Ok(t0.elapsed())
    }

    /// Captures the work `f` queues, without running it, as a graph to replay; `None` where
    /// the backend has no graphs (CPU: the caller runs the ops directly instead). The work
    /// must be capturable: no host synchronisation, no host reads, every per-call value in
    /// device memory.
    fn capture(&self, _f: &mut dyn FnMut() -> Result<()>) -> Result<Option<Self::Graph>> {
        Ok(None)
    }

    /// Queues one replay of a captured graph.
    fn replay(&self, graph: &Self::Graph) -> Result<()>;

    /// Marks the point the queued work has reached (an event on GPUs).
    fn mark(&self) -> Result<Self::Mark>;

    /// Waits until the work queued before `mark` is done (work queued after it keeps
    /// running) and reports errors the device raised.
    fn wait_mark(&self, mark: &Self::Mark) -> Result<()>;

    /// Page-locked host memory that device work can write and the host can read without a
    /// copy or a stream sync ([`Device::read_mapped`]), zeroed. Default: device memory.
    fn alloc_mapped(&self, bytes: usize) -> Result<Self::Buf> {
        self.alloc(bytes)
    }

    /// Reads a buffer of [`Device::alloc_mapped`] without waiting for queued work: what a
    /// waited [`Device::mark`] covers is there. Default: [`Device::read`].
    fn read_mapped(&self, src: &Self::Buf, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.read(src, offset, dst)
    }

    /// Captures the work `f` queues into a graph once, replays it `replays` times back to
    /// back and returns the time per replay; `None` where the backend has no graphs (CPU).
    fn time_graph(
        &self,
        replays: u32,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Option<Duration>> {
        self.sync()?;
        let Some(graph) = self.capture(f)? else {
            return Ok(None);
        };
        let t = self.time(&mut || {
            for _ in 0..replays {
                self.replay(&graph)?;
            }
            Ok(())
        })?;
        Ok(Some(t / replays.max(1)))
    }
}
