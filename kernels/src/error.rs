//! Typed errors of the device layer. Callers (the rank) add rank and phase context.

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("backend '{backend}' is not usable: {why}")]
    Unavailable { backend: &'static str, why: String },
    #[error("{what}: {source}")]
    Os {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("timed out after {waited:?} in {what}, waiting for peer(s) {peers:?}")]
    Timeout {
        what: &'static str,
        waited: Duration,
        peers: Vec<usize>,
    },
    #[error("aborted by the job while in {what}")]
    Aborted { what: &'static str },
    #[error("{0}")]
    Backend(String),
}

pub type Result<T, E = KernelError> = std::result::Result<T, E>;

impl KernelError {
    pub fn os(what: impl Into<String>, source: impl Into<std::io::Error>) -> Self {
        KernelError::Os {
            what: what.into(),
            source: source.into(),
        }
    }
}
