//! One rank's weights on its device: the slices of each tensor that the [`ShardPlan`] gives
//! this rank, read from the checkpoint and converted to the chosen dtype. Shapes are written
//! global → per rank, with `nq = q_heads.len()`, `nkv = kv_heads.len()`, `I = inter.len()`,
//! `V = vocab.len()` of this rank's plan, `d = head_dim`, `h = hidden`.

use tprun_kernels::dtype::{decode, encode};
use tprun_kernels::{DType, Device, View};

use super::safetensors::{Checkpoint, Slice};
use super::{ModelConfig, ModelError, ShardPlan};

/// A weight tensor in device memory: `len` elements of `dtype`.
pub struct Tensor<B> {
    pub buf: B,
    pub dtype: DType,
    pub len: usize,
}

impl<B> Tensor<B> {
    pub fn view(&self) -> View<'_, B> {
        View::new(&self.buf, 0, self.len, self.dtype)
    }
}

/// One decoder layer. The column-parallel projections that read the same input are fused at
/// load (concatenated per rank along their output rows), so that decode runs one
/// matrix–vector product where the checkpoint has two or three.
pub struct LayerWeights<B> {
    /// `input_layernorm`: [h] → [h] (replicated), f32.
    pub attn_norm: Tensor<B>,
    /// `q_proj | k_proj | v_proj`: [heads·d + 2·kv_heads·d, h] → [(nq + 2·nkv)·d, h]: this
    /// rank's query-head rows, then its KV-head rows of k, then of v.
    pub wqkv: Tensor<B>,
    /// Qwen2 biases, concatenated the same way: [(nq + 2·nkv)·d], f32.
    pub bqkv: Option<Tensor<B>>,
    /// Qwen3 `q_norm`, `k_norm`: [d] → [d] (replicated), f32.
    pub q_norm: Option<Tensor<B>>,
    pub k_norm: Option<Tensor<B>>,
    /// `o_proj`: [h, heads·d] → [h, nq·d] (columns of this rank's query heads).
    pub wo: Tensor<B>,
    /// `post_attention_layernorm`: [h] → [h] (replicated), f32.
    pub ffn_norm: Tensor<B>,
    /// `gate_proj | up_proj`: [2·intermediate, h] → [2·I, h]: this rank's gate rows, then
    /// its up rows (so each output row is [gate | up], what `Prologue::SiluMul` reads).
    pub w_gate_up: Tensor<B>,
    /// `down_proj`: [h, intermediate] → [h, I].
    pub w_down: Tensor<B>,
}

/// All of a rank's weights.
pub struct Weights<B> {
    /// `embed_tokens`: [vocab, h] → [V, h] (this rank's vocab rows).
    pub embed: Tensor<B>,
    pub layers: Vec<LayerWeights<B>>,
    /// `model.norm`: [h] → [h] (replicated), f32.
    pub norm: Tensor<B>,
    /// `lm_head`: [vocab, h] → [V, h]; `None` when tied to `embed`.
    pub lm_head: Option<Tensor<B>>,
}

impl<B> Weights<B> {
    /// The LM head's rows: `lm_head` or, when tied, the embedding table.
    pub fn head(&self) -> &Tensor<B> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Reads tensors of one checkpoint into one device.
struct Loader<'a, D: Device> {
    dev: &'a D,
    ck: &'a Checkpoint,
    /// `None`: keep each tensor's stored dtype.
    dtype: Option<DType>,
    /// Bytes written to the device so far, and the callback that hears of them.
    done: std::cell::Cell<u64>,
    progress: std::cell::RefCell<&'a mut dyn FnMut(u64)>,
}

/// One part of a (possibly fused) tensor: checkpoint name, full shape, this rank's slice.
type Part<'a> = (&'a str, &'a [usize], Slice);

fn slice_len(shape: &[usize], slice: &Slice) -> usize {
    match slice {
        Slice::Full => shape.iter().product(),
        Slice::Rows(r) => r.len() * shape.iter().skip(1).product::<usize>(),
        Slice::Cols(c) => shape[0] * c.len(),
    }
}

impl<D: Device> Loader<'_, D> {
    fn load(
        &self,
        name: &str,
        shape: &[usize],
        slice: Slice,
        dtype: Option<DType>,
    ) -> Result<Tensor<D::Buf>, ModelError> {
        self.load_concat(&[(name, shape, slice)], dtype)
    }

    /// The parts one after another in one buffer, in the first part's dtype (or `dtype`, or
    /// the loader's): a fused projection.
    fn load_concat(
        &self,
        parts: &[Part<'_>],
        dtype: Option<DType>,
    ) -> Result<Tensor<D::Buf>, ModelError> {
        let dtype = match dtype.or(self.dtype) {
            Some(d) => d,
            None => self.ck.dtype_of(parts[0].0)?,
        };
        let len: usize = parts.iter().map(|(_, s, sl)| slice_len(s, sl)).sum();
        let buf = self.dev.alloc(len * dtype.size())?;
        let mut base = 0;
        for (name, shape, slice) in parts {
            self.ck.read(name, shape, slice, dtype, &mut |off, bytes| {
                self.dev.write(&buf, base + off, bytes)?;
                self.done.set(self.done.get() + bytes.len() as u64);
                (self.progress.borrow_mut())(self.done.get());
                Ok(())
            })?;
            base += slice_len(shape, slice) * dtype.size();
        }
        Ok(Tensor { buf, dtype, len })
    }

    /// Small tensors the ops read as f32 (norm weights, biases). With an explicit weight
    /// dtype they are first rounded to it, as loading with transformers' `torch_dtype` would,
    /// so that a model converted at load time equals the same model stored in that dtype.
    fn load_f32(&self, parts: &[Part<'_>]) -> Result<Tensor<D::Buf>, ModelError> {
        let Some(dtype) = self.dtype.filter(|&d| d != DType::F32) else {
            return self.load_concat(parts, Some(DType::F32));
        };
        let mut vals = Vec::new();
        for (name, shape, slice) in parts {
            self.ck.read(name, shape, slice, dtype, &mut |_, b| {
                vals.extend(decode(dtype, b));
                Ok(())
            })?;
        }
        let buf = self.dev.alloc(vals.len() * 4)?;
        self.dev.write(&buf, 0, &encode(DType::F32, &vals))?;
        Ok(Tensor {
            buf,
            dtype: DType::F32,
            len: vals.len(),
        })
    }
}

/// Bytes of matrices this rank's shard moves to its device (norms and biases aside): the
/// total of the loading progress, and what one decode step reads (less the embedding).
pub fn shard_bytes(cfg: &ModelConfig, plan: &ShardPlan, wsize: usize) -> (u64, u64) {
    let (h, d) = (cfg.hidden, cfg.head_dim);
    let (nq, nkv, i) = (
        plan.q_heads.len() * d,
        plan.kv_heads.len() * d,
        plan.inter.len(),
    );
    let layer = ((nq + 2 * nkv) * h + h * nq + 3 * i * h) as u64;
    let vocab = (plan.vocab.len() * h) as u64;
    let heads = if cfg.tie_embeddings { 1 } else { 2 };
    let w = wsize as u64;
    let total = (cfg.layers as u64 * layer + heads * vocab) * w;
    let per_token = (cfg.layers as u64 * layer + vocab) * w;
    (total, per_token)
}

/// Loads this rank's slices of every tensor, calling `progress(bytes_loaded)` as they reach
/// the device.
pub fn load<D: Device>(
    dev: &D,
    ck: &Checkpoint,
    cfg: &ModelConfig,
    plan: &ShardPlan,
    dtype: Option<DType>,
    progress: &mut dyn FnMut(u64),
) -> Result<Weights<D::Buf>, ModelError> {
    let l = Loader {
        dev,
        ck,
        dtype,
        done: std::cell::Cell::new(0),
        progress: std::cell::RefCell::new(progress),
    };
    let (h, d) = (cfg.hidden, cfg.head_dim);
    let q_rows = plan.q_heads.start * d..plan.q_heads.end * d;
    let kv_rows = plan.kv_heads.start * d..plan.kv_heads.end * d;
    let (qd, kvd) = (cfg.heads * d, cfg.kv_heads * d);
    let inter = [cfg.intermediate, h];
    let mut layers = Vec::with_capacity(cfg.layers);
    for i in 0..cfg.layers {
        let p = format!("model.layers.{i}.");
        let t = |s: &str| format!("{p}{s}");
        let (nq, nk, nv) = (
            t("self_attn.q_proj."),
            t("self_attn.k_proj."),
            t("self_attn.v_proj."),
        );
        let (wq, wk, wv) = (
            nq.clone() + "weight",
            nk.clone() + "weight",
            nv.clone() + "weight",
        );
        let (bq, bk, bv) = (nq + "bias", nk + "bias", nv + "bias");
        let qk_norm = |s: &str| {
            cfg.qk_norm
                .then(|| l.load_f32(&[(&t(s), &[d], Slice::Full)]))
                .transpose()
        };
        let (gate, up) = (t("mlp.gate_proj.weight"), t("mlp.up_proj.weight"));
        layers.push(LayerWeights {
            attn_norm: l.load_f32(&[(&t("input_layernorm.weight"), &[h], Slice::Full)])?,
            wqkv: l.load_concat(
                &[
                    (&wq, &[qd, h], Slice::Rows(q_rows.clone())),
                    (&wk, &[kvd, h], Slice::Rows(kv_rows.clone())),
                    (&wv, &[kvd, h], Slice::Rows(kv_rows.clone())),
                ],
                None,
            )?,
            bqkv: cfg
                .qkv_bias
                .then(|| {
                    l.load_f32(&[
                        (&bq, &[qd], Slice::Rows(q_rows.clone())),
                        (&bk, &[kvd], Slice::Rows(kv_rows.clone())),
                        (&bv, &[kvd], Slice::Rows(kv_rows.clone())),
                    ])
                })
                .transpose()?,
            q_norm: qk_norm("self_attn.q_norm.weight")?,
            k_norm: qk_norm("self_attn.k_norm.weight")?,
            wo: l.load(
                &t("self_attn.o_proj.weight"),
                &[h, qd],
                Slice::Cols(q_rows.clone()),
                None,
            )?,
            ffn_norm: l.load_f32(&[(&t("post_attention_layernorm.weight"), &[h], Slice::Full)])?,
            w_gate_up: l.load_concat(
                &[
                    (&gate, &inter, Slice::Rows(plan.inter.clone())),
                    (&up, &inter, Slice::Rows(plan.inter.clone())),
                ],
                None,
            )?,
            w_down: l.load(
                &t("mlp.down_proj.weight"),
                &[h, cfg.intermediate],
                Slice::Cols(plan.inter.clone()),
                None,
            )?,
        });
    }
    let vocab_rows = Slice::Rows(plan.vocab.clone());
    Ok(Weights {
        embed: l.load(
            "model.embed_tokens.weight",
            &[cfg.vocab, h],
            vocab_rows.clone(),
            None,
        )?,
        layers,
        norm: l.load_f32(&[("model.norm.weight", &[h], Slice::Full)])?,
        lm_head: if cfg.tie_embeddings {
            None
        } else {
            Some(l.load("lm_head.weight", &[cfg.vocab, h], vocab_rows, None)?)
        },
    })
}
