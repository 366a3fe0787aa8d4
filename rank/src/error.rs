//! Typed errors of a rank. Each carries enough context (phase, peer, file, field) for the
//! coordinator to print one clear line.

#[derive(Debug, thiserror::Error)]
pub enum RankError {
    #[error(transparent)]
    Kernel(#[from] tprun_kernels::KernelError),
    #[error("{0}")]
    Model(String),
    #[error("{0}")]
    Other(String),
}
