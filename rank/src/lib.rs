//! tprun-rank: one rank of a tprun job.
//!
//! Owns joining a job, the communicator (peer buffers + allreduce algorithms), the model shard
//! and sampling, and the library API for embedding a rank in another program ([`join`]).
//!
//! Must not: print to the terminal (it logs through `tracing` and reports to the coordinator)
//! or parse command-line flags.

pub mod bench;
pub mod bench_gemv;
pub mod collective;
pub mod comm;
pub mod decode;
pub mod error;
pub mod fault;
pub mod files;
#[doc(hidden)]
pub mod fuzzing;
pub mod job;
pub mod model;
pub mod phase;
pub mod run;
pub mod selftest;
pub mod serve;

pub use collective::Collectives;
pub use error::{FailKind, Failure, RankError};
pub use phase::Phase;
pub use run::join_job as join;
