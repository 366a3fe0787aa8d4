//! tprun-ipc
