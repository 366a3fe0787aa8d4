//! tprun-rank
