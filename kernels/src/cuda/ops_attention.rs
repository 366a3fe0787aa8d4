//! Launchers of `kernels/src/gpu/attention.cu` (being written).

use super::launch::Launcher;
use super::mem::CudaBuf;
use super::{CudaDevice, SelftestResult};
use crate::cpu::CpuDevice;
use crate::device::Op;
use crate::{KernelError, Result};

/// The kernels of attention.cu, in the order the launchers index them.
pub(crate) const NAMES: &[&str] = &[];

/// Queues one op of this family.
pub(crate) fn launch(_l: &Launcher<'_>, op: &Op<'_, CudaBuf>) -> Result<()> {
    Err(KernelError::Unavailable {
        backend: "cuda",
        why: format!("no CUDA kernel for '{}' yet", op.name()),
    })
}

/// This family's twin cases (see `twin`).
pub(crate) fn selftest(
    _gpu: &CudaDevice,
    _cpu: &CpuDevice,
    _seed: u64,
) -> Result<Vec<SelftestResult>> {
    Ok(Vec::new())
}
