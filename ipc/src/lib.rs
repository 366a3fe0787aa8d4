//! tprun-ipc: everything that crosses a process boundary on the host.
//!
//! Owns the wire protocol ([`wire`]: postcard frames on a Unix `SOCK_SEQPACKET` socket, with a
//! magic, a protocol version and the job token), file-descriptor passing (`SCM_RIGHTS`), and the
//! shared control block ([`control`]: memfd + mmap, futex barrier, abort word, per-rank slots,
//! token ring).
//!
//! Must not: know about GPUs or models. Payloads that only ranks and the coordinator understand
//! (job specs, buffer exports, reports) travel here as opaque bytes.

pub mod control;
pub mod error;
pub mod wire;

pub use control::{AbortReason, BatchStats, ControlBlock};
pub use error::{IpcError, Result};
pub use wire::{Conn, Msg, PROTOCOL_VERSION};
