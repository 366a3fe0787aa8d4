//! The `Device` trait: the one interface every backend implements.
//!
//! Kept small on purpose (STYLE.md, candle's lesson): memory, copies, synchronisation,
//! shareable buffers, timing, and a single dispatch point [`Device::run`] that takes an [`Op`].
//! A new op is a new `Op` variant plus one arm per backend, not a new trait method.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::comm::AllreduceArgs;
use crate::{DType, Result};

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

/// The ops a backend runs. Outputs may not overlap inputs unless the op says so.
pub enum Op<'a, B> {
    /// `dst ← src`, converting dtype if they differ. Same length.
    Copy { src: View<'a, B>, dst: View<'a, B> },
    /// `out[i] = Σ_r inputs[r][i]`, summed in the order given with f32 accumulation, rounded
    /// once to `out.dtype`. `out` may be one of the inputs.
    ReduceSum {
        inputs: &'a [View<'a, B>],
        out: View<'a, B>,
    },
    /// A peer-buffer allreduce (`oneshot` or `twoshot`), in place on `args.data`; see
    /// [`crate::comm`].
    Allreduce(AllreduceArgs<'a, B>),

    // ---- Decode ops (CPU twins in `cpu/ops/`). Activations are f32; weights any dtype. ----
    /// `dst[i] ← value` for every element (any dtype).
    Fill { dst: View<'a, B>, value: f32 },
    /// Embedding lookup in one vocab shard. `table`: [rows, hidden] (any dtype) holding vocab
    /// ids `vocab_start..vocab_start + rows`; `out`: [ids.len(), hidden] f32. Row `i` of `out`
    /// is the table row of `ids[i]`, or zeros when that id lies outside this shard (the sum
    /// over all shards is then the full lookup). `ids` are host memory; a GPU backend uploads
    /// them with the launch.
    Embedding {
        table: View<'a, B>,
        vocab_start: usize,
        ids: &'a [u32],
        hidden: usize,
        out: View<'a, B>,
    },
    /// RMSNorm over `rows` rows of `dim`: `out[r] = x[r] / sqrt(mean(x[r]²) + eps) · w`, with
    /// `x`, `out`: [rows, dim] f32 (may be the same view), `w`: [dim] (any dtype). Per-head
    /// q/k norm is the same op with rows = tokens · heads and dim = head_dim.
    RmsNorm {
        x: View<'a, B>,
        w: View<'a, B>,
        out: View<'a, B>,
        rows: usize,
        dim: usize,
        eps: f32,
    },
    /// Rotary position embedding, Hugging Face "rotate halves" convention, in place on `x`:
    /// [rows, heads, head_dim] f32, row `r` at position `pos0 + r`. `inv_freq`: [head_dim / 2]
    /// f32 (theta and any `rope_scaling` already applied). For `i < head_dim / 2`, with
    /// `a = (pos · inv_freq[i])` in f32: `(x[i], x[i+h/2]) ← (x[i]·cos a − x[i+h/2]·sin a,
    /// x[i+h/2]·cos a + x[i]·sin a)`.
    Rope {
        x: View<'a, B>,
        inv_freq: View<'a, B>,
        rows: usize,
        heads: usize,
        head_dim: usize,
        pos0: usize,
    },
    /// Causal grouped-query attention of `rows` query positions `pos0..pos0 + rows` over a KV
    /// cache. `q`, `out`: [rows, heads, head_dim] f32; `k_cache`, `v_cache`: [≥ pos0 + rows,
    /// kv_heads, head_dim] (any dtype), already holding these positions. Query head `h` reads
    /// KV head `h / (heads / kv_heads)`; query `r` sees cache positions `0..=pos0 + r`.
    /// Scores `q·k · scale` and the softmax are f32.
    Attention {
        q: View<'a, B>,
        k_cache: View<'a, B>,
        v_cache: View<'a, B>,
        out: View<'a, B>,
        rows: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        pos0: usize,
        scale: f32,
    },
    /// `out[i] = silu(gate[i]) · up[i]`, `silu(g) = g / (1 + e^−g)`; f32, same length; `out`
    /// may be `gate` or `up`.
    SiluMul {
        gate: View<'a, B>,
        up: View<'a, B>,
        out: View<'a, B>,
    },
    /// `out[i] = a[i] + b[i]` (the residual add); f32, same length; `out` may be `a` or `b`.
    Add {
        a: View<'a, B>,
        b: View<'a, B>,
        out: View<'a, B>,
    },
    /// `y = x · wᵀ (+ bias)`: `x`: [m, k] f32, `w`: [n, k] (f32, f16 or bf16; a Linear's
    /// [out, in] layout), `bias`: [n] f32, `y`: [m, n] f32, accumulated in f32. `m = 1` is the
    /// decode matrix–vector product; prefill uses `m` = prompt tokens. `y` must not overlap `x`.
    Matmul {
        x: View<'a, B>,
        w: View<'a, B>,
        bias: Option<View<'a, B>>,
        y: View<'a, B>,
        m: usize,
        k: usize,
        n: usize,
    },
}

impl<B> Op<'_, B> {
    /// The op's name, for errors ("the cuda backend has no kernel for rms_norm yet").
    pub fn name(&self) -> &'static str {
        match self {
            Op::Copy { .. } => "copy",
            Op::ReduceSum { .. } => "reduce_sum",
            Op::Allreduce(_) => "allreduce",
            Op::Fill { .. } => "fill",
            Op::Embedding { .. } => "embedding",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Rope { .. } => "rope",
            Op::Attention { .. } => "attention",
            Op::SiluMul { .. } => "silu_mul",
            Op::Add { .. } => "add",
            Op::Matmul { .. } => "matmul",
        }
    }
}

/// A compute device as seen by one rank.
pub trait Device: Send + Sync + 'static {
    /// Device memory owned by (or mapped into) this process. Dropping it frees or unmaps it.
    type Buf: Send + Sync;

    fn info(&self) -> DeviceInfo;

    /// Private device memory, zeroed.
    fn alloc(&self, bytes: usize) -> Result<Self::Buf>;

    /// Device memory that other processes can map, zeroed, with its export.
    fn alloc_shared(&self, bytes: usize) -> Result<(Self::Buf, Export)>;

    /// Maps a peer's shareable buffer into this process.
    fn import(&self, export: Export) -> Result<Self::Buf>;

    /// Host → device copy of `src` to `dst` at byte `offset`.
    fn write(&self, dst: &Self::Buf, offset: usize, src: &[u8]) -> Result<()>;

    /// Device → host copy from `src` at byte `offset` into `dst`. Waits for queued work.
    fn read(&self, src: &Self::Buf, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Runs (or queues, on a GPU stream) one op.
    fn run(&self, op: &Op<'_, Self::Buf>) -> Result<()>;

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

    /// Captures the work `f` queues into a graph once, replays it `replays` times back to back
    /// and returns the time per replay; `None` where the backend has no graphs (CPU). The work
    /// `f` queues must be capturable (no host synchronisation inside).
    fn time_graph(
        &self,
        _replays: u32,
        _f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Option<Duration>> {
        Ok(None)
    }
}
