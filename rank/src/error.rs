//! Typed errors of a rank. Each carries enough context (phase, peer, file, field) for the
//! coordinator to print one clear line, and a [`FailKind`] that travels with the message
//! ([`Failure`]) so that the coordinator picks the exit code and the hint without reading
//! the text.

use serde::{Deserialize, Serialize};
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
    /// The rank could not join the job (connect, handshake, refused): the coordinator never
    /// admitted it, so the rank itself must say why.
    #[error("{0}")]
    Join(String),
    /// A wait in which no rank made progress for longer than its deadline.
    #[error("{0}")]
    Stalled(String),
    #[error("{0}")]
    Other(String),
}

/// What kind of failure stopped a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailKind {
    /// The job's input: the model folder, a checkpoint, a setting the model cannot take.
    Input,
    /// The device or its driver: unusable, out of memory, a failed call.
    Device,
    /// A wait ran past its deadline; the message names the peers waited for (exit 4).
    Timeout,
    /// The job was aborted elsewhere (a peer failed first, or the coordinator stopped it).
    Aborted,
    /// Anything else: the protocol, the OS, a bug.
    Internal,
}

/// A rank's last words to the coordinator (the payload of `Msg::Failed`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    pub kind: FailKind,
    /// The phase the rank was in ([`crate::Phase`]'s name).
    pub phase: String,
    /// The error, one line, with its context.
    pub message: String,
}

impl RankError {
    pub fn kind(&self) -> FailKind {
        match self {
            RankError::Kernel(KernelError::Timeout { .. })
            | RankError::Ipc(IpcError::BarrierTimeout { .. })
            | RankError::Ipc(IpcError::Timeout(_))
            | RankError::Stalled(_) => FailKind::Timeout,
            RankError::Kernel(KernelError::Aborted { .. })
            | RankError::Ipc(IpcError::Aborted(_)) => FailKind::Aborted,
            // Invalid op arguments are the caller's bug, not the device's.
            RankError::Kernel(KernelError::Invalid(_)) => FailKind::Internal,
            RankError::Kernel(_) => FailKind::Device,
            RankError::Model(_) => FailKind::Input,
            RankError::Ipc(_) | RankError::Join(_) | RankError::Other(_) => FailKind::Internal,
        }
    }

    /// True when the rank never joined the job: nobody else has heard of the failure.
    pub fn is_join(&self) -> bool {
        matches!(self, RankError::Join(_))
    }

    /// True for errors caused by a wait that ran past its deadline (exit code 4).
    pub fn is_timeout(&self) -> bool {
        self.kind() == FailKind::Timeout
    }

    /// True when this rank only stopped because the job was aborted elsewhere.
    pub fn is_abort(&self) -> bool {
        self.kind() == FailKind::Aborted
    }

    /// What the coordinator is told.
    pub fn failure(&self, phase: String) -> Failure {
        Failure {
            kind: self.kind(),
            phase,
            message: self.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn kinds_follow_the_error_not_its_text() {
        let timeout = RankError::Ipc(IpcError::BarrierTimeout {
            waited: Duration::from_secs(1),
            phase: "decode".into(),
            missing: vec![2],
        });
        assert_eq!(timeout.kind(), FailKind::Timeout);
        assert!(timeout.is_timeout());
        let abort = RankError::Kernel(KernelError::Aborted { what: "allreduce" });
        assert!(abort.is_abort());
        let device = RankError::Kernel(KernelError::Unavailable {
            backend: "cuda",
            why: "no device".into(),
        });
        assert_eq!(device.kind(), FailKind::Device);
        let input = RankError::from(crate::model::ModelError::Invalid("timed out".into()));
        assert_eq!(
            input.kind(),
            FailKind::Input,
            "the word 'timed out' changes nothing"
        );
        let stalled = RankError::Stalled("waiting for the peers' exports: ...".into());
        assert!(stalled.is_timeout());
        let join = RankError::Join("rank 0 could not join: ...".into());
        assert!(join.is_join() && !join.is_timeout() && !join.is_abort());
        let f = input.failure("loading".into());
        assert_eq!((f.kind, f.phase.as_str()), (FailKind::Input, "loading"));
    }
}
