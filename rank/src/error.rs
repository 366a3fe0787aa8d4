//! Typed errors of a rank. Each carries enough context (phase, peer, file, field) for the
//! coordinator to print one clear line.

use tprun_ipc::IpcError;
use tprun_kernels::KernelError;

#[derive(Debug, thiserror::Error)]
pub enum RankError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Ipc(#[from] IpcError),
    #[error("{0}")]
    Model(String),
    #[error("{0}")]
    Other(String),
}

impl RankError {
    /// True for errors caused by a wait that ran past its deadline (exit code 4).
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            RankError::Kernel(KernelError::Timeout { .. })
                | RankError::Ipc(IpcError::BarrierTimeout { .. })
                | RankError::Ipc(IpcError::Timeout(_))
        )
    }

    /// True when this rank only stopped because the job was aborted elsewhere.
    pub fn is_abort(&self) -> bool {
        matches!(
            self,
            RankError::Kernel(KernelError::Aborted { .. }) | RankError::Ipc(IpcError::Aborted(_))
        )
    }
}
