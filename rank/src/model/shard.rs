//! The Megatron split of one model over `world` ranks: which query heads, KV heads, MLP
//! columns and vocab rows rank `rank` owns. Pure arithmetic on the config, no I/O.
//!
//! - q/k/v and gate/up are column-parallel: a rank holds the output rows of its heads / its
//!   MLP columns. o_proj and down_proj are row-parallel: the matching input columns, and the
//!   partial outputs are summed with an allreduce.
//! - KV heads, when `kv_heads >= world`: rank r owns KV heads `shard_range(kv_heads, world,
//!   r)` (uneven when it does not divide) and exactly the query heads that read them, i.e.
//!   `kv_start·g .. kv_end·g` with `g = heads / kv_heads`.
//! - KV heads, when `kv_heads < world`: each KV head is replicated on `rep = world /
//!   kv_heads` consecutive ranks (world must be a multiple of kv_heads); rank r holds KV head
//!   `r / rep` and the query heads `shard_range(g, rep, r % rep)` of that head's group. Every
//!   rank must get at least one query head (`g >= rep`), otherwise the split is refused.
//! - MLP columns (`intermediate_size`) and vocab rows are split with `shard_range`, unevenly
//!   where they do not divide (172 over 8 ranks: 22,22,22,22,21,21,21,21).

use std::ops::Range;

use tprun_kernels::comm::shard_range;

use super::{ModelConfig, ModelError};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    pub rank: usize,
    pub world: usize,
    /// Global query-head indices this rank computes.
    pub q_heads: Range<usize>,
    /// Global KV-head indices this rank holds (and caches).
    pub kv_heads: Range<usize>,
    /// Columns of the MLP (rows of gate/up, columns of down).
    pub inter: Range<usize>,
    /// Vocab rows of the embedding table and LM head.
    pub vocab: Range<usize>,
}

impl ShardPlan {
    pub fn new(cfg: &ModelConfig, rank: usize, world: usize) -> Result<ShardPlan, ModelError> {
        let err = |why: String| ModelError::Shard { world, why };
        if world == 0 || rank >= world {
            return Err(err(format!("rank {rank} is outside the world")));
        }
        let (h, k) = (cfg.heads, cfg.kv_heads);
        let g = h / k;
        let (q_heads, kv_heads) = if k >= world {
            let kv = shard_range(k, world, rank);
            (kv.start * g..kv.end * g, kv)
        } else {
            if !world.is_multiple_of(k) {
                return Err(err(format!(
                    "num_key_value_heads {k} is fewer than the ranks, and {world} ranks is not a \
                     multiple of it, so the KV heads cannot be replicated evenly"
                )));
            }
            let rep = world / k;
            if g < rep {
                return Err(err(format!(
                    "each KV head would be replicated on {rep} ranks but has only {g} query heads \
                     (num_attention_heads {h} / num_key_value_heads {k}) to share among them"
                )));
            }
            let kv = rank / rep;
            let q = shard_range(g, rep, rank % rep);
            (kv * g + q.start..kv * g + q.end, kv..kv + 1)
        };
        Ok(ShardPlan {
            rank,
            world,
            q_heads,
            kv_heads,
            inter: shard_range(cfg.intermediate, world, rank),
            vocab: shard_range(cfg.vocab, world, rank),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    fn cfg(heads: usize, kv: usize) -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            hidden: 64,
            intermediate: 172,
            layers: 1,
            heads,
            kv_heads: kv,
            head_dim: 8,
            vocab: 512,
            max_positions: 64,
            rms_eps: 1e-5,
            rope_theta: 1e4,
            rope_scaling: None,
            qkv_bias: false,
            qk_norm: false,
            tie_embeddings: true,
            dtype: None,
            bos: None,
            eos: vec![],
        }
    }

    #[test]
    fn every_query_head_is_computed_once_next_to_its_kv_head() {
        for (h, k) in [(8, 4), (8, 8), (8, 1), (32, 8), (6, 2)] {
            for world in 1..=8 {
                let c = cfg(h, k);
                let plans: Result<Vec<_>, _> =
                    (0..world).map(|r| ShardPlan::new(&c, r, world)).collect();
                let Ok(plans) = plans else { continue };
                let mut seen = vec![0; h];
                for p in &plans {
                    assert!(!p.q_heads.is_empty(), "h{h} k{k} w{world}");
                    for q in p.q_heads.clone() {
                        seen[q] += 1;
                        assert!(p.kv_heads.contains(&(q / (h / k))));
                    }
                    // Local group arithmetic of the attention op holds.
                    assert_eq!(p.q_heads.len() % p.kv_heads.len(), 0);
                }
                assert!(seen.iter().all(|&s| s == 1), "h{h} k{k} w{world}");
            }
        }
    }

    #[test]
    fn impossible_splits_are_refused_with_a_reason() {
        let e = ShardPlan::new(&cfg(8, 4), 0, 6).unwrap_err().to_string();
        assert!(
            e.contains("6 ranks") && e.contains("num_key_value_heads"),
            "{e}"
        );
        let e = ShardPlan::new(&cfg(4, 2), 0, 8).unwrap_err().to_string();
        assert!(e.contains("query heads"), "{e}");
        assert!(ShardPlan::new(&cfg(8, 4), 0, 8).is_ok());
        assert_eq!(ShardPlan::new(&cfg(8, 4), 7, 8).unwrap().inter, 151..172);
    }
}
