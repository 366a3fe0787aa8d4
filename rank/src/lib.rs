//! tprun-rank: one rank of a tprun job.
//!
//! Owns joining a job, the communicator (peer buffers + allreduce algorithms), the model shard
//! and sampling, and the library API for embedding a rank in another program.
//!
//! Must not: print to the terminal (it logs through `tracing` and reports to the coordinator)
//! or parse command-line flags.

pub mod collective;
pub mod error;
pub mod model;

pub use collective::Collectives;
pub use error::RankError;
