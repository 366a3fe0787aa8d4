//! The sampler's settings ([`SamplerConfig`], turned into the device sampler's
//! `ops::SampleParams`: tokens are picked on the device, `ops::Sample`), and [`argmax`] over
//! host logits for the logit-dump mode.

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// 0 = greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches top_p (1 = all).
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// The device sampler's parameters (`ops::Sample`): the same settings, with `top_k`
    /// capped at the candidates the device gathers (`ops::TOPK_MAX`).
    pub fn params(&self) -> tprun_kernels::ops::SampleParams {
        tprun_kernels::ops::SampleParams {
            temperature: self.temperature.max(0.0),
            top_k: self.top_k.min(tprun_kernels::ops::TOPK_MAX) as u32,
            top_p: self.top_p,
            seed: self.seed,
        }
    }
}

/// The index of the largest logit; the first one on ties (as `torch.argmax`). NaNs lose.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] || logits[best].is_nan() && !l.is_nan() {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_max() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5]), 1);
    }
}
