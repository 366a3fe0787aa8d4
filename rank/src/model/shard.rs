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
//!   where they do not divide (172 over 8 ranks: 22,22,22,22,21,21,21,21). A GPTQ int4 MLP
//!   splits them in whole quantization groups instead (`gptq::k_shard`).
//! - Gated DeltaNet heads (Qwen3.5): rank r owns key heads `shard_range(k_heads, world, r)`
//!   and exactly the value heads that read them (`k_start·g .. k_end·g`, g = v_heads /
//!   k_heads), so the recurrence of each value head runs on one rank with its key head. With
//!   them go their conv channels (their q, k and v columns of in_proj_qkv), their z, b and a
//!   columns, their A_log, dt_bias, and out_proj's input columns (row-parallel: the partial
//!   outputs are allreduced like o_proj's). Fewer key heads than ranks is refused (splitting
//!   a key head's value heads between ranks would replicate the key head; not needed by any
//!   checkpoint: Qwen3.5-27B has 16).

use std::ops::Range;

use tprun_kernels::comm::shard_range;

use super::gptq::k_shard;
use super::weights::text_prefix;
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
    /// Global DeltaNet key heads and value heads this rank runs (empty unless hybrid).
    pub lin_k_heads: Range<usize>,
    pub lin_v_heads: Range<usize>,
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
        let (lin_k_heads, lin_v_heads) = match &cfg.hybrid {
            None => (0..0, 0..0),
            Some(hy) if hy.k_heads < world => {
                return Err(err(format!(
                    "linear_num_key_heads {} is fewer than the ranks: each rank needs at least \
                     one DeltaNet key head",
                    hy.k_heads
                )))
            }
            Some(hy) => {
                let k = shard_range(hy.k_heads, world, rank);
                let g = hy.v_heads / hy.k_heads;
                (k.clone(), k.start * g..k.end * g)
            }
        };
        // A GPTQ down_proj is split along its inputs on group boundaries (`k_shard`), so that
        // no group's scale and zero straddle two ranks; gate/up's output rows follow it. The
        // loader checks that every layer's down_proj splits the same as layer 0's.
        let down = format!("{}layers.0.mlp.down_proj", text_prefix(cfg));
        let inter = match cfg.gptq.as_ref().and_then(|q| q.settings(&down)) {
            Some(s) => k_shard(cfg.intermediate, &s, world, rank).map_err(|e| match e {
                ModelError::Shard { world, why } => ModelError::Shard {
                    world,
                    why: format!("{down} (GPTQ): {why}"),
                },
                other => other,
            })?,
            None => shard_range(cfg.intermediate, world, rank),
        };
        Ok(ShardPlan {
            lin_k_heads,
            lin_v_heads,
            rank,
            world,
            q_heads,
            kv_heads,
            inter,
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
            hybrid: None,
            gptq: None,
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

    #[test]
    fn deltanet_value_heads_stay_with_their_key_head() {
        let mut c = cfg(64, 32);
        c.hybrid = Some(crate::model::Hybrid {
            kinds: vec![crate::model::LayerKind::Delta],
            k_heads: 16,
            v_heads: 48,
            dk: 128,
            dv: 128,
            conv_kernel: 4,
            rotary_dim: 4,
            attn_gate: true,
            multimodal: false,
        });
        // Qwen3.5-27B at TP=4: 4 key heads and 12 value heads per rank.
        let p = ShardPlan::new(&c, 2, 4).unwrap();
        assert_eq!((p.lin_k_heads, p.lin_v_heads), (8..12, 24..36));
        for world in [1, 3, 5, 16] {
            let mut seen = [0; 48];
            for r in 0..world {
                let p = ShardPlan::new(&c, r, world).unwrap();
                for v in p.lin_v_heads.clone() {
                    seen[v] += 1;
                    assert!(p.lin_k_heads.contains(&(v / 3)), "w{world}");
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "w{world}");
        }
        let e = ShardPlan::new(&c, 0, 32).unwrap_err().to_string();
        assert!(e.contains("linear_num_key_heads 16"), "{e}");
    }
}
