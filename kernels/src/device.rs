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
}
