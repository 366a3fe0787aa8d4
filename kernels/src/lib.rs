//! tprun-kernels: the device layer.
//!
//! Owns the [`Device`] trait (buffers, copies, synchronisation, shareable buffers and the one
//! op dispatch point [`Device::run`]) and its backends. The `cpu` backend runs everything on
//! host memory, with shareable buffers as memfds, so that the whole multi-process machinery
//! works on any machine. The `cuda` backend loads the driver and NVRTC at run time and reports
//! itself unavailable where they are missing.
//!
//! Must not: know about processes, sockets or models. Anything that crosses a process boundary
//! arrives here as an already-received file descriptor or handle ([`Export`]).

pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod driver;
pub mod dtype;
pub mod error;
pub mod hip;
pub mod int4;
pub mod ops;
pub mod rng;

pub use comm::{AllreduceArgs, CommAlgo, CommLayout, CommSettings};
pub use device::{Device, DeviceInfo, Export, ExportMeta, IpcMode, Op, OpLimits, OpTime, View};
pub use dtype::DType;
pub use error::{KernelError, Result};
pub use ops::{Epilogue, Prologue};
