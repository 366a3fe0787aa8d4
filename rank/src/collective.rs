//! What the model shard needs from the communicator: its place in the world and an in-place
//! sum over ranks. Implemented by [`crate::comm::Communicator`] (peer buffers + the chosen
//! algorithm); tests may implement it with threads.

use tprun_kernels::comm::AddNorm;
use tprun_kernels::{Device, View};

pub trait Collectives<D: Device> {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Sums `data` over all ranks in place (f32/f16/bf16; f32 accumulation in rank order), so
    /// that every rank ends with bitwise the same values. Every rank must call it with the
    /// same length and dtype, in the same order.
    fn allreduce(&mut self, data: View<'_, D::Buf>) -> Result<(), crate::RankError>;

    /// [`Collectives::allreduce`] of `data`, then `x ← x + sum; out = rms_norm(x) · w` with
    /// the epilogue's views ([`AddNorm`]), one fused kernel where the backend has one (the
    /// decode layer's seam). `data` is left unspecified.
    fn allreduce_add_norm(
        &mut self,
        data: View<'_, D::Buf>,
        add_norm: AddNorm<'_, D::Buf>,
    ) -> Result<(), crate::RankError>;

    /// The communicator's call counter (what the next call derives its epoch from). A graph
    /// that captured `n` allreduces advances the device's counters by `n` per replay; the
    /// caller keeps the host's in step with [`Collectives::set_epoch`].
    fn epoch(&self) -> u32 {
        0
    }

    fn set_epoch(&mut self, _epoch: u32) {}

    /// Whether an allreduce of `bytes` can be captured in a device graph (`host` cannot: it
    /// synchronises and meets the peers on the host).
    fn capturable(&self, _bytes: usize) -> bool {
        true
    }
}
