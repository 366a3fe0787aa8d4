//! The decode loop every rank runs: prefill the prompt, then sample and step until a stop id
//! or the token budget. All ranks run it in lockstep with the same sampler seed, so they pick
//! the same tokens; only what each caller does with `on_token` differs (rank 0 publishes).

use std::time::{Duration, Instant};

use tprun_kernels::Device;

use super::{Model, SamplerConfig};
use crate::{Collectives, RankError};

#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    /// Most tokens to generate after the prompt (also capped by the KV cache).
    pub max_new_tokens: usize,
    /// Generation stops when one of these is sampled (not passed to `on_token`); usually the
    /// config's eos ids.
    pub stop: Vec<u32>,
}

impl GenerateOptions {
    /// Tokens a prompt of `prompt_len` may be followed by: `max_new_tokens`, at most what a
    /// KV cache of `max_seq` holds (the last token needs no cache row of its own).
    pub fn budget(&self, max_seq: usize, prompt_len: usize) -> usize {
        self.max_new_tokens
            .min(max_seq.saturating_sub(prompt_len) + 1)
    }
}

/// What a generation did, for the CLI's summary line.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub generated: usize,
    /// A stop id ended generation (rather than the budget or `on_token`).
    pub stopped: bool,
    /// Wall time of the prefill (prompt forward + first sample).
    pub prefill: Duration,
    /// Wall time of all decode steps.
    pub decode: Duration,
    /// The decode steps ran as replays of one captured device graph.
    pub graph: bool,
    /// Collective calls per decode step.
    pub allreduces_per_step: u32,
    /// Kernel launches per decode step (GPU backends).
    pub launches_per_step: u64,
}

impl GenerateStats {
    /// Decode throughput in tokens per second (steps after the first token).
    pub fn decode_tokens_per_s(&self) -> f64 {
        let steps = self.generated.saturating_sub(1);
        if steps == 0 || self.decode.is_zero() {
            0.0
        } else {
            steps as f64 / self.decode.as_secs_f64()
        }
    }
}

/// Prefills `prompt` and generates up to `opts.max_new_tokens` tokens, calling
/// `on_token(id)` for each; `on_token` returns `false` to stop early. Tokens are sampled on
/// the device ([`Model::begin`], [`Model::decode`]). Every rank must call this with the same
/// prompt, options and sampler settings.
pub fn generate<D: Device>(
    model: &mut Model<D>,
    comm: &mut dyn Collectives<D>,
    sampler: &SamplerConfig,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> Result<bool, RankError>,
) -> Result<GenerateStats, RankError> {
    let mut st = GenerateStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let budget = opts.budget(model.max_seq(), prompt.len());
    if budget == 0 {
        return Ok(st);
    }
    let p = sampler.params();
    let t0 = Instant::now();
    let first = model.begin(comm, prompt, &p)?;
    st.prefill = t0.elapsed();
    let t1 = Instant::now();
    let mut take = |t: u32, st: &mut GenerateStats| -> Result<bool, RankError> {
        if opts.stop.contains(&t) {
            st.stopped = true;
            return Ok(false);
        }
        st.generated += 1;
        Ok(on_token(t)? && st.generated < budget)
    };
    if take(first, &mut st)? {
        let info = model.decode(comm, &p, budget - 1, &mut |t| take(t, &mut st))?;
        st.graph = info.graph;
        st.allreduces_per_step = info.allreduces;
        st.launches_per_step = info.launches;
    }
    st.decode = t1.elapsed();
    Ok(st)
}
