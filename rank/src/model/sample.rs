//! Picking the next token from full-vocab logits: greedy (temperature 0), or temperature with
//! optional top-k and top-p (nucleus), drawing from a seeded [`Rng`].
//!
//! Every rank holds bitwise the same logits (the allreduce sums in rank order) and runs the
//! same sampler from the same seed, so all ranks pick the same token without a message.

use super::rng::Rng;

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

pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    /// Candidate token ids (reused between calls).
    idx: Vec<u32>,
    probs: Vec<f64>,
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

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        Sampler {
            rng: Rng::new(cfg.seed),
            cfg,
            idx: Vec::new(),
            probs: Vec::new(),
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let c = &self.cfg;
        if c.temperature <= 0.0 || logits.len() <= 1 || c.top_k == 1 {
            return argmax(logits);
        }
        // Candidates sorted by logit, highest first (ties: lower id first), NaNs dropped.
        self.idx.clear();
        self.idx
            .extend((0..logits.len() as u32).filter(|&i| !logits[i as usize].is_nan()));
        if self.idx.is_empty() {
            return 0;
        }
        let cmp = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        if c.top_k > 0 && c.top_k < self.idx.len() {
            self.idx.select_nth_unstable_by(c.top_k - 1, cmp);
            self.idx.truncate(c.top_k);
        }
        self.idx.sort_unstable_by(cmp);
        // softmax(logits / T) over the candidates, in f64.
        let max = logits[self.idx[0] as usize] as f64;
        let t = c.temperature as f64;
        self.probs.clear();
        self.probs.extend(
            self.idx
                .iter()
                .map(|&i| ((logits[i as usize] as f64 - max) / t).exp()),
        );
        let total: f64 = self.probs.iter().sum();
        let mut keep = self.probs.len();
        if c.top_p < 1.0 {
            let mut cum = 0.0;
            for (j, p) in self.probs.iter().enumerate() {
                cum += p / total;
                if cum >= c.top_p as f64 {
                    keep = j + 1;
                    break;
                }
            }
        }
        let kept: f64 = self.probs[..keep].iter().sum();
        let mut u = self.rng.f64() * kept;
        for j in 0..keep {
            u -= self.probs[j];
            if u < 0.0 {
                return self.idx[j];
            }
        }
        self.idx[keep - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_max() {
        let mut s = Sampler::new(SamplerConfig::default());
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5]), 1);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_choice() {
        let logits = [0.0f32, 5.0, 4.9, 4.8, -3.0];
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 1,
        });
        for _ in 0..200 {
            assert!(matches!(s.sample(&logits), 1 | 2));
        }
        // top_p small enough that only the best token reaches it.
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.2,
            seed: 1,
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&logits), 1);
        }
    }

    #[test]
    fn temperature_sampling_follows_the_distribution_and_the_seed() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = 1/4, 3/4
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 42,
        };
        let (mut a, mut b) = (Sampler::new(cfg.clone()), Sampler::new(cfg));
        let mut ones = 0;
        for _ in 0..20_000 {
            let x = a.sample(&logits);
            assert_eq!(x, b.sample(&logits), "same seed, same picks");
            ones += x as usize;
        }
        let p = ones as f64 / 20_000.0;
        assert!((p - 0.75).abs() < 0.02, "{p}");
    }
}
