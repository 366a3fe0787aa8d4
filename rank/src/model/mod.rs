//! The model shard: what one rank holds of a Llama-family model and how it runs its part of
//! the forward pass, plus what the coordinator needs around it (config, sampler, synthetic
//! checkpoints; the tokenizer is the coordinator's own).
//!
//! | module | owns |
//! | --- | --- |
//! | `config` | parsing and validating `config.json` / `generation_config.json` |
//! | `shard` | which heads, MLP columns and vocab rows a rank owns (Megatron split) |
//! | `gptq` | GPTQ int4: `quantization_config`, reading and dequantising packed layers, the quantiser |
//! | `safetensors` | mapping checkpoint files and reading one rank's slices |
//! | `weights` | a rank's weights on its device, shapes global and per rank |
//! | `forward` | [`Model`]: KV cache, scratch, prefill and step |
//! | `generate` | the prefill → sample → step loop every rank runs |
//! | `sample` | greedy / temperature / top-k / top-p with a seeded RNG |
//! | `synth` | writing a complete random-weight HF model folder |
//! | `local` | ranks as threads in one process (tests and single-process embedding) |

pub mod config;
pub mod error;
pub mod forward;
pub mod generate;
pub mod gptq;
pub mod local;
pub mod safetensors;
pub mod sample;
pub mod shard;
pub mod synth;
pub mod weights;

/// The seeded generator of the sampler and `synth` (shared with the op tests).
pub use tprun_kernels::rng;

#[cfg(test)]
mod tests;

pub use config::{Arch, Hybrid, LayerKind, Llama3Scaling, ModelConfig};
pub use error::ModelError;
pub use forward::{shard_memory, BatchRow, BatchStart, LoadOptions, Model};
pub use generate::{generate, GenerateOptions, GenerateStats};
pub use local::LocalComm;
pub use sample::SamplerConfig;
pub use shard::ShardPlan;
pub use synth::{synth, Preset, SynthOptions, SynthQuant};
