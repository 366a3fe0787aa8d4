//! What the model shard needs from the communicator: its place in the world and an in-place
//! sum over ranks. Implemented by [`crate::comm::Communicator`] (peer buffers + the chosen
//! algorithm); tests may implement it with threads.

use tprun_kernels::{Device, View};

pub trait Collectives<D: Device> {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Sums `data` over all ranks in place (f32/f16/bf16; f32 accumulation in rank order), so
    /// that every rank ends with bitwise the same values. Every rank must call it with the
    /// same length and dtype, in the same order.
    fn allreduce(&mut self, data: View<'_, D::Buf>) -> Result<(), crate::RankError>;
}
