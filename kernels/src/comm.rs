//! Communication-buffer layout and the arguments of the peer-buffer allreduce ops.
//!
//! Every rank owns one shareable communication buffer laid out as
//!
//! ```text
//! [ signal area: SIGNAL_BYTES ][ data slot 0: data_bytes ][ data slot 1: data_bytes ]
//! [ low-latency slot 0: ll_slot_bytes ][ low-latency slot 1: ll_slot_bytes ]
//! ```
//!
//! Call number `epoch` (1, 2, 3, … never reset; every algorithm counts, `host` included) uses
//! data slot `epoch % 2`. Two slots are needed
//! because a fast rank may start call e+1 while a slow peer is still reading its slot of call e;
//! it cannot reach call e+2 (and overwrite slot e % 2 again) before every peer has signalled
//! call e+1 (a flag, a low-latency line, or the `host` barrier after its stream sync), which
//! each peer does only after it finished reading call e.
//!
//! The signal area holds the flags, one u32 per (phase, sender), each on its own 64-byte line
//! so that different senders never write the same cache line. Rank `s` raises flag
//! (phase, s) in peer `q`'s signal area by storing the epoch there. Epochs wrap at 2^32: a
//! waiter compares with `(flag - epoch) as i32 >= 0`, which is right while no flag is 2^31
//! calls stale; the CPU backend moves every flag on every call (phases a call does not wait on
//! without a wake), so none is more than one call old. GPU backends keep 64-bit epochs on the
//! device and their own flag layout (kernels/src/gpu/comm.cu).
//!
//! The low-latency slots belong to GPU backends' `oneshot` for messages of up to
//! [`CommLayout::ll_bytes`]: each holds one region of `ll_stride` bytes per sender, into which
//! the sender stores 16-byte lines of 8 message bytes plus flags (kernels/src/gpu/comm.cu says
//! why). The CPU backend leaves them untouched (memfd pages that are never touched cost
//! nothing).

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{DType, View};

/// Largest world size the layout has room for.
pub const MAX_WORLD: usize = 64;
/// Phases that have their own flags: 0 = inputs published, 1 = reduced slices published.
pub const PHASES: usize = 2;
/// Bytes between two flags (one cache line; 64 B on x86-64 and the GPUs we target).
pub const FLAG_STRIDE: usize = 64;
/// The signal area: room for the CPU flags (PHASES × MAX_WORLD × FLAG_STRIDE = 8 KiB) and for
/// GPU backends' per-block flags.
pub const SIGNAL_BYTES: usize = 256 * 1024;

/// Largest message the low-latency `oneshot` carries (GPU backends; larger ones, or any
/// message when the layout has less room, use the flag-and-slot `oneshot`).
pub const LL_MAX_BYTES: usize = 64 * 1024;

/// Which algorithm a peer-buffer allreduce uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommAlgo {
    /// Every rank publishes its input, then reads every peer's and reduces all of it.
    Oneshot,
    /// Reduce-scatter (rank r reduces slice r) then all-gather of the reduced slices.
    Twoshot,
    /// The device half of the `host` algorithm, which the rank composes out of a `Copy` into
    /// its own slot for this epoch, a stream sync and a host barrier: sum every rank's slot in
    /// rank order into `data`, and count the call (GPU backends keep a device-side epoch
    /// counter that every algorithm must advance).
    HostReduce,
}

/// Job-wide settings of GPU backends' allreduce kernels, applied when a rank opens its device.
/// Every rank of a job must use the same ones (a block waits for the peers' block of the same
/// number, and the low-latency and flag-and-slot kernels do not meet each other), so they
/// travel in the job spec from the coordinator; nothing below the coordinator reads them from
/// the environment. The CPU backend ignores them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommSettings {
    /// `oneshot` sends messages of up to [`CommLayout::ll_bytes`] with their flags inside the
    /// data (the low-latency kernel); off: the flag-and-slot kernel for every size.
    pub low_latency: bool,
    /// Same-dtype copies of up to 1 MiB (the `host` allreduce's copy-in) as a kernel; off:
    /// always a device memcpy.
    pub small_copy_kernel: bool,
    /// Most blocks one allreduce launch uses (clamped to 1..=128). `None`: the device's default
    /// (a fifth of the allreduce blocks that fit on it), the same on every rank only when the
    /// ranks' GPUs are the same model.
    pub comm_blocks: Option<u32>,
}

impl Default for CommSettings {
    /// What measured best on the H200 (docs/perf-notes.md): low-latency oneshot and small-copy
    /// kernel on, the device's block count.
    fn default() -> Self {
        CommSettings {
            low_latency: true,
            small_copy_kernel: true,
            comm_blocks: None,
        }
    }
}

/// Sizes of one rank's communication buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommLayout {
    /// Capacity of each data slot in bytes (the largest message).
    pub data_bytes: usize,
    /// Largest message the low-latency slots carry.
    pub ll_bytes: usize,
    /// Bytes of one sender's region in a low-latency slot (16 per 8 message bytes).
    pub ll_stride: usize,
    /// Bytes of one low-latency slot (`world` regions).
    pub ll_slot_bytes: usize,
}

impl CommLayout {
    /// The layout for messages of up to `max_message_bytes` among `world` ranks.
    pub fn new(max_message_bytes: usize, world: usize) -> Self {
        // Round to 4 KiB so that every slot starts page- (and 16-byte vector-) aligned.
        let page = |b: usize| b.max(1).div_ceil(4096) * 4096;
        let ll_bytes = max_message_bytes.clamp(1, LL_MAX_BYTES);
        let ll_stride = ll_bytes.div_ceil(8) * 16;
        CommLayout {
            data_bytes: page(max_message_bytes),
            ll_bytes,
            ll_stride,
            ll_slot_bytes: page(world.max(1) * ll_stride),
        }
    }

    pub fn total_bytes(&self) -> usize {
        SIGNAL_BYTES + 2 * self.data_bytes + 2 * self.ll_slot_bytes
    }

    pub fn slot_offset(&self, epoch: u32) -> usize {
        SIGNAL_BYTES + (epoch as usize % 2) * self.data_bytes
    }

    /// Start of the low-latency slot that call `epoch` uses.
    pub fn ll_offset(&self, epoch: u32) -> usize {
        SIGNAL_BYTES + 2 * self.data_bytes + (epoch as usize % 2) * self.ll_slot_bytes
    }

    /// Byte offset of the flag that `sender` raises in a receiver's signal area for `phase`.
    pub fn flag_offset(phase: usize, sender: usize) -> usize {
        debug_assert!(phase < PHASES && sender < MAX_WORLD);
        (phase * MAX_WORLD + sender) * FLAG_STRIDE
    }
}

/// The elements of `len` that rank `r` of `world` owns in the reduce-scatter: contiguous,
/// as even as possible, the first `len % world` ranks one element more.
pub fn shard_range(len: usize, world: usize, r: usize) -> std::ops::Range<usize> {
    let base = len / world;
    let extra = len % world;
    let start = r * base + r.min(extra);
    let end = start + base + usize::from(r < extra);
    start..end
}

/// Arguments of [`crate::Op::Allreduce`].
pub struct AllreduceArgs<'a, B> {
    pub algo: CommAlgo,
    pub rank: usize,
    pub world: usize,
    /// This call's number, starting at 1 and increasing by one per call on every rank.
    pub epoch: u32,
    /// In: this rank's partial. Out: the sum over ranks. Must fit in `layout.data_bytes`.
    pub data: View<'a, B>,
    /// Every rank's communication buffer, this rank's own at index `rank`.
    pub comm: &'a [&'a B],
    pub layout: CommLayout,
    /// The longest a flag wait may take before the op fails with a timeout.
    pub timeout: Duration,
    /// The job's abort word (non-zero = stop); host-side waits check it.
    pub abort: Option<&'a AtomicU32>,
    /// A residual add + RMSNorm after the sum (the decode layer's seam): when given, the op
    /// also does [`crate::ops::AddRmsNorm`] with `delta` = the sum, and `data` is left
    /// unspecified (a fused GPU kernel need not store it).
    pub add_norm: Option<AddNorm<'a, B>>,
}

/// The epilogue of [`AllreduceArgs::add_norm`]: `x ← x + sum`, `out = rms_norm(x) · w`, with
/// `x`, `out`: [rows, dim] f32 and the message [rows, dim] f32 too.
pub struct AddNorm<'a, B> {
    pub x: View<'a, B>,
    pub w: View<'a, B>,
    pub out: View<'a, B>,
    pub rows: usize,
    pub dim: usize,
    pub eps: f32,
}

impl<B> Clone for AddNorm<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for AddNorm<'_, B> {}

impl<'a, B> AddNorm<'a, B> {
    /// The epilogue as an op with `delta` (the summed message) added.
    pub fn op(self, delta: View<'a, B>) -> crate::ops::AddRmsNorm<'a, B> {
        crate::ops::AddRmsNorm {
            x: self.x,
            delta,
            w: self.w,
            out: self.out,
            rows: self.rows,
            dim: self.dim,
            eps: self.eps,
        }
    }
}

impl<'a, B> AllreduceArgs<'a, B> {
    /// The epilogue as an op on the summed data.
    pub fn add_norm_op(&self) -> Option<crate::ops::AddRmsNorm<'a, B>> {
        self.add_norm.map(|e| e.op(self.data))
    }
}

impl<B> AllreduceArgs<'_, B> {
    /// The checks every backend makes before touching memory: a rank inside a world the
    /// layout has room for, one buffer per rank, a message that fits a data slot.
    pub fn validate(&self) -> crate::Result<()> {
        if self.world == 0
            || self.world > MAX_WORLD
            || self.rank >= self.world
            || self.comm.len() != self.world
        {
            return Err(crate::KernelError::Invalid(format!(
                "allreduce: rank {} of world {} with {} comm buffers",
                self.rank,
                self.world,
                self.comm.len()
            )));
        }
        if !self.data.dtype.is_float() {
            return Err(crate::KernelError::Invalid(
                "allreduce of u32 data (float dtypes only)".into(),
            ));
        }
        if let Some(op) = self.add_norm_op() {
            if self.data.dtype != DType::F32 {
                return Err(crate::KernelError::Invalid(
                    "allreduce with add_norm: f32 data only".into(),
                ));
            }
            op.validate()?;
        }
        let bytes = self.data.bytes();
        if bytes > self.layout.data_bytes {
            return Err(crate::KernelError::Invalid(format!(
                "allreduce of {bytes} bytes exceeds the {}-byte communication buffer",
                self.layout.data_bytes
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_ranges_cover_without_overlap() {
        for len in [0, 1, 2, 7, 172, 1000] {
            for world in 1..=9 {
                let mut next = 0;
                for r in 0..world {
                    let s = shard_range(len, world, r);
                    assert_eq!(s.start, next);
                    next = s.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn flags_fit_in_signal_area() {
        assert!(CommLayout::flag_offset(PHASES - 1, MAX_WORLD - 1) + FLAG_STRIDE <= SIGNAL_BYTES);
        let l = CommLayout::new(5, 3);
        assert_eq!(l.slot_offset(1) - l.slot_offset(2), 4096);
        assert_eq!((l.ll_bytes, l.ll_stride, l.ll_slot_bytes), (5, 16, 4096));
        assert_eq!(l.ll_offset(0), l.slot_offset(1) + 4096);
        assert_eq!(l.ll_offset(1) + l.ll_slot_bytes, l.total_bytes());
        // Large messages: the low-latency slots stop at LL_MAX_BYTES, one region per rank.
        let l = CommLayout::new(64 << 20, 4);
        assert_eq!(l.ll_bytes, LL_MAX_BYTES);
        assert_eq!(l.ll_slot_bytes, 4 * 2 * LL_MAX_BYTES);
    }
}
