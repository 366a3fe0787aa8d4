//! Typed errors of loading and running a model shard. Each names the file and the field or
//! tensor at fault, so that the coordinator can print one clear line.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A missing or malformed field of `config.json` / `generation_config.json`.
    #[error("{}: field `{field}`: {why}", file.display())]
    Config {
        file: PathBuf,
        field: String,
        why: String,
    },
    /// A well-formed config that asks for something tprun does not implement.
    #[error("{}: field `{field}`: {value} is not supported ({supported})", file.display())]
    Unsupported {
        file: PathBuf,
        field: String,
        value: String,
        supported: String,
    },
    /// A safetensors file whose header or size is broken.
    #[error("{}: {why}", file.display())]
    Header { file: PathBuf, why: String },
    /// A tensor that is missing, or has the wrong shape or dtype.
    #[error("{}: tensor `{tensor}`: {why}", file.display())]
    Tensor {
        file: PathBuf,
        tensor: String,
        why: String,
    },
    /// The model cannot be split over this many ranks.
    #[error("cannot shard the model over {world} ranks: {why}")]
    Shard { world: usize, why: String },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Kernel(#[from] tprun_kernels::KernelError),
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}

impl From<ModelError> for crate::RankError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Kernel(k) => crate::RankError::Kernel(k),
            other => crate::RankError::Model(other.to_string()),
        }
    }
}
