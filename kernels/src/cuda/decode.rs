//! Dispatch of the decode ops to their families' launchers: `ops_decode` (decode.cu:
//! embedding, norms, RoPE, the q|k|v epilogue, elementwise), `ops_gemv` (gemv.cu: Matmul),
//! `ops_gemv_q4` (gemv_q4.cu: MatmulInt4), `ops_attention` (attention.cu), `ops_sample` (sample.cu:
//! per-shard top-k, sampling), `ops_delta` (delta.cu: the Gated DeltaNet ops).
//!
//! Must not: allocate or synchronise (every op here is captured into the decode graph).

use super::launch::Launcher;
use super::mem::CudaBuf;
use super::{ops_attention, ops_decode, ops_delta, ops_gemv, ops_gemv_q4, ops_sample};
use crate::device::Op;
use crate::Result;

impl Launcher<'_> {
    /// Queues one decode op (arguments already validated by `Device::run`).
    pub(crate) fn decode_op(&self, op: &Op<'_, CudaBuf>) -> Result<()> {
        match op {
            Op::Matmul(_) | Op::AddNormMatmul(_) | Op::QkvMatmul(_) => ops_gemv::launch(self, op),
            Op::MatmulInt4(_) => ops_gemv_q4::launch(self, op),
            Op::Attention(_) => ops_attention::launch(self, op),
            Op::ShardTopK(_) | Op::Sample(_) => ops_sample::launch(self, op),
            Op::CausalConv(_) | Op::GatedDelta(_) | Op::GatedRmsNorm(_) => {
                ops_delta::launch(self, op)
            }
            _ => ops_decode::launch(self, op),
        }
    }
}

/// The kernel names of the decode modules, in the order their launchers index them.
pub(crate) fn kernel_names(module: &str) -> Option<Vec<String>> {
    let names = match module {
        "decode" => ops_decode::NAMES,
        "gemv" => ops_gemv::NAMES,
        "gemv_q4" => ops_gemv_q4::NAMES,
        "attention" => ops_attention::NAMES,
        "sample" => ops_sample::NAMES,
        "delta" => ops_delta::NAMES,
        _ => return None,
    };
    Some(names.iter().map(|s| s.to_string()).collect())
}
