//! Typed errors of the host IPC layer.

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    #[error("{what}: {source}")]
    Os {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("the peer closed the connection")]
    Closed,
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("timed out after {waited:?} at a barrier in phase {phase}; rank(s) {missing:?} did not arrive")]
    BarrierTimeout {
        waited: Duration,
        phase: String,
        missing: Vec<usize>,
    },
    #[error("the job was aborted ({0})")]
    Aborted(String),
}

pub type Result<T, E = IpcError> = std::result::Result<T, E>;

impl IpcError {
    pub fn os(what: impl Into<String>, source: impl Into<std::io::Error>) -> Self {
        IpcError::Os {
            what: what.into(),
            source: source.into(),
        }
    }
}
