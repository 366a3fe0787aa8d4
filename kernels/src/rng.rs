//! A small seeded random number generator (SplitMix64, Steele, Lea & Flood, "Fast splittable
//! pseudorandom number generators", OOPSLA 2014). Used by the sampler, where every rank must
//! draw the same numbers from the same seed, by `synth` for reproducible weights, and by the
//! op tests for their random inputs. Not for anything that needs unpredictability.

#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        // The constants are SplitMix64's (the golden-ratio increment and Stafford's "Mix13").
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), 53 random bits.
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [-1, 1), 24 random bits.
    pub fn f32_sym(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `n` values uniform in [-1, 1).
    pub fn vec_sym(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32_sym()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_range() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..1000 {
            let x = a.f64();
            assert_eq!(x, b.f64());
            assert!((0.0..1.0).contains(&x));
            let y = a.f32_sym();
            assert_eq!(y, b.f32_sym());
            assert!((-1.0..1.0).contains(&y));
        }
        assert_ne!(Rng::new(1).next_u64(), Rng::new(2).next_u64());
    }
}
