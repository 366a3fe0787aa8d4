//! [`Model`]: one rank's shard of a Llama-family model on one device: its weights, its KV
//! cache, its scratch buffers, and the forward pass (prefill of a whole prompt in batched
//! matrix–matrix products, then one token per `step`).
//!
//! Every piece of math is an [`Op`] run through [`Device::run`], so a GPU backend runs this
//! same forward; the model never touches a raw pointer. Per forward pass there are
//! `2 · layers + 2` calls to [`Collectives::allreduce`], all on f32 buffers:
//!
//! - the vocab-parallel embedding: each rank looks up the ids in its vocab rows and writes
//!   zeros for the others, so the sum over ranks is the full lookup (exact: one non-zero term);
//! - after o_proj and after down_proj (row-parallel: each rank's partial product);
//! - the vocab-parallel LM head: each rank writes its vocab rows' logits into a zero-filled
//!   full-vocab buffer and the allreduce of that buffer is an all-gather (again exact). It
//!   moves `world` times the bytes a real all-gather would, which for one row of logits per
//!   step is a few hundred KiB at most, and needs no second collective.
//!
//! Only the row-parallel sums depend on the world size (their f32 addition order), so logits
//! at different world sizes agree to about 1e-6 relative; on one world size every rank holds
//! bitwise the same logits and so samples the same token.
//!
//! Must not: pick tokens (see `sample`), know about processes or print.

use std::path::Path;
use std::sync::Arc;

use tprun_kernels::{DType, Device, Op, View};

use super::safetensors::Checkpoint;
use super::weights::{self, Weights};
use super::{ModelConfig, ModelError, ShardPlan};
use crate::{Collectives, RankError};

/// Choices made when loading a shard.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Dtype the matrices are stored in on the device (`None` = "auto": as in the checkpoint).
    /// Norm weights and biases are always f32; activations are f32.
    pub dtype: Option<DType>,
    /// Dtype of the KV cache (f32 by default; bf16 or f16 halve its memory, and each new
    /// key/value is rounded once as it is stored).
    pub kv_dtype: DType,
    /// KV-cache length in tokens (`None`: `max_position_embeddings`, at most 4096).
    pub max_seq: Option<usize>,
    /// Most prompt tokens run through one batched pass; longer prompts are prefilled in
    /// chunks of this size. Sizes the scratch buffers and the largest allreduce.
    pub prefill_chunk: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            dtype: None,
            kv_dtype: DType::F32,
            max_seq: None,
            // 512 tokens: a typical prompt in one pass; scratch is then 2 KiB × hidden per
            // activation buffer (16 MiB at hidden 8192).
            prefill_chunk: 512,
        }
    }
}

/// Default KV-cache length cap when the caller gives none: bounds memory for models whose
/// `max_position_embeddings` is 128k.
pub const DEFAULT_MAX_SEQ: usize = 4096;

/// Per-layer KV cache: [max_seq, nkv·d] each, in `Model::kv_dtype`, row `p` holding
/// position `p`.
struct KvCache<B> {
    k: B,
    v: B,
}

/// Scratch activations, all f32, sized for `chunk` tokens (`C`). Names follow llama2.c.
struct Scratch<B> {
    /// Residual stream [C, h].
    x: B,
    /// Normed input of a sub-block [C, h].
    xb: B,
    /// Queries [C, nq·d], keys and values of the new tokens [C, nkv·d].
    q: B,
    k: B,
    v: B,
    /// Attention output [C, nq·d].
    att: B,
    /// Partial output of a row-parallel projection, allreduced in place [C, h].
    o: B,
    /// MLP gate and up activations [C, I].
    hb: B,
    hb2: B,
    /// Full-vocab logits [vocab]; this rank fills its rows, the rest stay 0 until the
    /// allreduce.
    logits: B,
    /// RoPE inverse frequencies [d / 2].
    inv_freq: B,
}

/// One rank's shard of the model.
pub struct Model<D: Device> {
    dev: Arc<D>,
    cfg: ModelConfig,
    plan: ShardPlan,
    w: Weights<D::Buf>,
    kv: Vec<KvCache<D::Buf>>,
    kv_dtype: DType,
    s: Scratch<D::Buf>,
    max_seq: usize,
    chunk: usize,
    /// Positions 0..len of the KV cache hold the current sequence.
    len: usize,
    /// Host copy of the last full-vocab logits.
    logits: Vec<f32>,
    logit_bytes: Vec<u8>,
}

fn f32v<B>(b: &B, len: usize) -> View<'_, B> {
    View::new(b, 0, len, DType::F32)
}

/// x = x + allreduce(input · wᵀ): a row-parallel projection (each rank holds a partial sum of
/// the [m, h] output over its slice of the k inputs), the sum over ranks, the residual add.
/// Used after attention (o_proj) and after the MLP (down_proj).
#[allow(clippy::too_many_arguments)]
fn row_parallel<D: Device>(
    dev: &D,
    comm: &mut dyn Collectives<D>,
    s: &Scratch<D::Buf>,
    input: View<'_, D::Buf>,
    w: View<'_, D::Buf>,
    m: usize,
    k: usize,
    h: usize,
) -> Result<(), RankError> {
    dev.run(&Op::Matmul {
        x: input,
        w,
        bias: None,
        y: f32v(&s.o, m * h),
        m,
        k,
        n: h,
    })?;
    comm.allreduce(f32v(&s.o, m * h))?;
    dev.run(&Op::Add {
        a: f32v(&s.x, m * h),
        b: f32v(&s.o, m * h),
        out: f32v(&s.x, m * h),
    })?;
    Ok(())
}

impl<D: Device> Model<D> {
    /// Loads rank `rank` of `world`'s shard of the Hugging Face model in `dir`.
    pub fn load(
        dev: Arc<D>,
        dir: &Path,
        rank: usize,
        world: usize,
        opts: &LoadOptions,
    ) -> Result<Model<D>, ModelError> {
        Self::load_with_progress(dev, dir, rank, world, opts, &mut |_, _| {})
    }

    /// [`Model::load`], calling `progress(layers_done, layers)` as the layers arrive.
    pub fn load_with_progress(
        dev: Arc<D>,
        dir: &Path,
        rank: usize,
        world: usize,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model<D>, ModelError> {
        let cfg = ModelConfig::from_dir(dir)?;
        let plan = ShardPlan::new(&cfg, rank, world)?;
        let ck = Checkpoint::open(dir)?;
        let w = weights::load(&*dev, &ck, &cfg, &plan, opts.dtype, progress)?;
        Self::from_weights(dev, cfg, plan, w, opts)
    }

    fn from_weights(
        dev: Arc<D>,
        cfg: ModelConfig,
        plan: ShardPlan,
        w: Weights<D::Buf>,
        opts: &LoadOptions,
    ) -> Result<Model<D>, ModelError> {
        let max_seq = opts
            .max_seq
            .unwrap_or(cfg.max_positions.min(DEFAULT_MAX_SEQ))
            .max(1);
        let chunk = opts.prefill_chunk.clamp(1, max_seq);
        let d = cfg.head_dim;
        let (nq, nkv, ni) = (
            plan.q_heads.len() * d,
            plan.kv_heads.len() * d,
            plan.inter.len(),
        );
        let f = |n: usize| dev.alloc(n * 4);
        let kv = (0..cfg.layers)
            .map(|_| {
                Ok(KvCache {
                    k: dev.alloc(max_seq * nkv * opts.kv_dtype.size())?,
                    v: dev.alloc(max_seq * nkv * opts.kv_dtype.size())?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let s = Scratch {
            x: f(chunk * cfg.hidden)?,
            xb: f(chunk * cfg.hidden)?,
            q: f(chunk * nq)?,
            k: f(chunk * nkv)?,
            v: f(chunk * nkv)?,
            att: f(chunk * nq)?,
            o: f(chunk * cfg.hidden)?,
            hb: f(chunk * ni)?,
            hb2: f(chunk * ni)?,
            logits: f(cfg.vocab)?,
            inv_freq: f(d / 2)?,
        };
        dev.write(
            &s.inv_freq,
            0,
            &tprun_kernels::dtype::encode(DType::F32, &cfg.inv_freq()),
        )?;
        Ok(Model {
            logits: vec![0.0; cfg.vocab],
            logit_bytes: vec![0; cfg.vocab * 4],
            dev,
            cfg,
            plan,
            w,
            kv,
            kv_dtype: opts.kv_dtype,
            s,
            max_seq,
            chunk,
            len: 0,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    pub fn device(&self) -> &Arc<D> {
        &self.dev
    }

    /// KV-cache capacity in tokens.
    pub fn max_seq(&self) -> usize {
        self.max_seq
    }

    /// Tokens currently in the KV cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The largest message this model passes to [`Collectives::allreduce`], in bytes (f32):
    /// a prefill chunk of hidden states or the full-vocab logits. Size the communicator for it.
    pub fn max_allreduce_bytes(&self) -> usize {
        (self.chunk * self.cfg.hidden).max(self.cfg.vocab) * 4
    }

    /// The full-vocab f32 logits of the last forward (identical on every rank).
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Starts a new sequence: runs the whole prompt from position 0 in batched passes of up to
    /// `prefill_chunk` tokens and returns the full-vocab logits of its last position.
    pub fn prefill(
        &mut self,
        comm: &mut dyn Collectives<D>,
        tokens: &[u32],
    ) -> Result<&[f32], RankError> {
        if tokens.is_empty() {
            return Err(ModelError::Invalid("prefill of an empty prompt".into()).into());
        }
        self.len = 0;
        let chunks: Vec<&[u32]> = tokens.chunks(self.chunk).collect();
        for (i, c) in chunks.iter().enumerate() {
            let pos = self.len;
            self.forward(comm, c, pos, i + 1 == chunks.len())?;
        }
        Ok(&self.logits)
    }

    /// Runs one token at position `pos` (≤ the current length; a smaller `pos` rewinds the
    /// sequence there) and returns the full-vocab logits.
    pub fn step(
        &mut self,
        comm: &mut dyn Collectives<D>,
        token: u32,
        pos: usize,
    ) -> Result<&[f32], RankError> {
        self.forward(comm, &[token], pos, true)?;
        Ok(&self.logits)
    }

    /// The forward pass of `tokens` at positions `pos0..`, writing their K/V into the cache;
    /// with `logits`, computes the full-vocab logits of the last token.
    fn forward(
        &mut self,
        comm: &mut dyn Collectives<D>,
        tokens: &[u32],
        pos0: usize,
        logits: bool,
    ) -> Result<(), RankError> {
        let (cfg, plan) = (&self.cfg, &self.plan);
        let m = tokens.len();
        if comm.rank() != plan.rank || comm.world() != plan.world {
            return Err(RankError::Model(format!(
                "the model was sharded for rank {} of {}, the communicator is rank {} of {}",
                plan.rank,
                plan.world,
                comm.rank(),
                comm.world()
            )));
        }
        if m == 0 || m > self.chunk || pos0 > self.len || pos0 + m > self.max_seq {
            return Err(RankError::Model(format!(
                "cannot run {m} tokens at position {pos0}: {} cached, room for {} (KV cache), at \
                 most {} per pass",
                self.len, self.max_seq, self.chunk
            )));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
            return Err(RankError::Model(format!(
                "token id {t} is outside the vocab of {}",
                cfg.vocab
            )));
        }
        let dev = &*self.dev;
        let (h, d) = (cfg.hidden, cfg.head_dim);
        let (nqh, nkvh) = (plan.q_heads.len(), plan.kv_heads.len());
        let (nq, nkv, ni) = (nqh * d, nkvh * d, plan.inter.len());
        let s = &self.s;
        let eps = cfg.rms_eps;

        // x = embed_tokens(tokens): each rank looks up its vocab rows, the allreduce sums them.
        dev.run(&Op::Embedding {
            table: self.w.embed.view(),
            vocab_start: plan.vocab.start,
            ids: tokens,
            hidden: h,
            out: f32v(&s.x, m * h),
        })?;
        comm.allreduce(f32v(&s.x, m * h))?;

        for (lw, kv) in self.w.layers.iter().zip(&self.kv) {
            // xb = input_layernorm(x)
            dev.run(&Op::RmsNorm {
                x: f32v(&s.x, m * h),
                w: lw.attn_norm.view(),
                out: f32v(&s.xb, m * h),
                rows: m,
                dim: h,
                eps,
            })?;
            // q, k, v = q_proj(xb), k_proj(xb), v_proj(xb)   (this rank's heads)
            for (wt, b, out, n) in [
                (&lw.wq, &lw.bq, &s.q, nq),
                (&lw.wk, &lw.bk, &s.k, nkv),
                (&lw.wv, &lw.bv, &s.v, nkv),
            ] {
                dev.run(&Op::Matmul {
                    x: f32v(&s.xb, m * h),
                    w: wt.view(),
                    bias: b.as_ref().map(|b| b.view()),
                    y: f32v(out, m * n),
                    m,
                    k: h,
                    n,
                })?;
            }
            // Qwen3: q = q_norm(q), k = k_norm(k), per head.
            if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
                dev.run(&Op::RmsNorm {
                    x: f32v(&s.q, m * nq),
                    w: qn.view(),
                    out: f32v(&s.q, m * nq),
                    rows: m * nqh,
                    dim: d,
                    eps,
                })?;
                dev.run(&Op::RmsNorm {
                    x: f32v(&s.k, m * nkv),
                    w: kn.view(),
                    out: f32v(&s.k, m * nkv),
                    rows: m * nkvh,
                    dim: d,
                    eps,
                })?;
            }
            // q, k = apply_rotary_pos_emb(q, k, cos, sin)
            dev.run(&Op::Rope {
                x: f32v(&s.q, m * nq),
                inv_freq: f32v(&s.inv_freq, d / 2),
                rows: m,
                heads: nqh,
                head_dim: d,
                pos0,
            })?;
            dev.run(&Op::Rope {
                x: f32v(&s.k, m * nkv),
                inv_freq: f32v(&s.inv_freq, d / 2),
                rows: m,
                heads: nkvh,
                head_dim: d,
                pos0,
            })?;
            // cache[pos0..pos0+m] = k, v
            let kvt = self.kv_dtype;
            let at = pos0 * nkv * kvt.size();
            dev.run(&Op::Copy {
                src: f32v(&s.k, m * nkv),
                dst: View::new(&kv.k, at, m * nkv, kvt),
            })?;
            dev.run(&Op::Copy {
                src: f32v(&s.v, m * nkv),
                dst: View::new(&kv.v, at, m * nkv, kvt),
            })?;
            // att = softmax(q·kᵀ / √d + causal mask) · v
            dev.run(&Op::Attention {
                q: f32v(&s.q, m * nq),
                k_cache: View::new(&kv.k, 0, (pos0 + m) * nkv, kvt),
                v_cache: View::new(&kv.v, 0, (pos0 + m) * nkv, kvt),
                out: f32v(&s.att, m * nq),
                rows: m,
                heads: nqh,
                kv_heads: nkvh,
                head_dim: d,
                pos0,
                scale: 1.0 / (d as f32).sqrt(),
            })?;
            // x = x + allreduce(o_proj(att))
            row_parallel(dev, comm, s, f32v(&s.att, m * nq), lw.wo.view(), m, nq, h)?;

            // xb = post_attention_layernorm(x)
            dev.run(&Op::RmsNorm {
                x: f32v(&s.x, m * h),
                w: lw.ffn_norm.view(),
                out: f32v(&s.xb, m * h),
                rows: m,
                dim: h,
                eps,
            })?;
            // hb = silu(gate_proj(xb)) * up_proj(xb)
            for (wt, out) in [(&lw.w_gate, &s.hb), (&lw.w_up, &s.hb2)] {
                dev.run(&Op::Matmul {
                    x: f32v(&s.xb, m * h),
                    w: wt.view(),
                    bias: None,
                    y: f32v(out, m * ni),
                    m,
                    k: h,
                    n: ni,
                })?;
            }
            dev.run(&Op::SiluMul {
                gate: f32v(&s.hb, m * ni),
                up: f32v(&s.hb2, m * ni),
                out: f32v(&s.hb, m * ni),
            })?;
            // x = x + allreduce(down_proj(hb))
            row_parallel(
                dev,
                comm,
                s,
                f32v(&s.hb, m * ni),
                lw.w_down.view(),
                m,
                ni,
                h,
            )?;
        }
        self.len = pos0 + m;
        if !logits {
            return Ok(());
        }
        // Last position only: xb = norm(x[m-1]); logits[vocab shard] = lm_head(xb); then the
        // allreduce of the zero-padded full-vocab buffer is the all-gather of the shards.
        let last = View::new(&s.x, (m - 1) * h * 4, h, DType::F32);
        dev.run(&Op::RmsNorm {
            x: last,
            w: self.w.norm.view(),
            out: f32v(&s.xb, h),
            rows: 1,
            dim: h,
            eps,
        })?;
        let v = cfg.vocab;
        dev.run(&Op::Fill {
            dst: f32v(&s.logits, v),
            value: 0.0,
        })?;
        let head = self.w.head();
        let shard = plan.vocab.clone();
        dev.run(&Op::Matmul {
            x: f32v(&s.xb, h),
            w: head.view(),
            bias: None,
            y: View::new(&s.logits, shard.start * 4, shard.len(), DType::F32),
            m: 1,
            k: h,
            n: shard.len(),
        })?;
        comm.allreduce(f32v(&s.logits, v))?;
        dev.read(&s.logits, 0, &mut self.logit_bytes)?;
        for (l, b) in self.logits.iter_mut().zip(self.logit_bytes.chunks_exact(4)) {
            *l = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }
}
