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

/// One decoder layer.
pub struct LayerWeights<B> {
    /// `input_layernorm`: [h] → [h] (replicated), f32.
    pub attn_norm: Tensor<B>,
    /// `q_proj`: [heads·d, h] → [nq·d, h] (rows of this rank's query heads).
    pub wq: Tensor<B>,
    /// `k_proj`, `v_proj`: [kv_heads·d, h] → [nkv·d, h].
    pub wk: Tensor<B>,
    pub wv: Tensor<B>,
    /// Qwen2 biases: [heads·d] → [nq·d] and [kv_heads·d] → [nkv·d], f32.
    pub bq: Option<Tensor<B>>,
    pub bk: Option<Tensor<B>>,
    pub bv: Option<Tensor<B>>,
    /// Qwen3 `q_norm`, `k_norm`: [d] → [d] (replicated), f32.
    pub q_norm: Option<Tensor<B>>,
    pub k_norm: Option<Tensor<B>>,
    /// `o_proj`: [h, heads·d] → [h, nq·d] (columns of this rank's query heads).
    pub wo: Tensor<B>,
    /// `post_attention_layernorm`: [h] → [h] (replicated), f32.
    pub ffn_norm: Tensor<B>,
    /// `gate_proj`, `up_proj`: [intermediate, h] → [I, h].
    pub w_gate: Tensor<B>,
    pub w_up: Tensor<B>,
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
}

impl<D: Device> Loader<'_, D> {
    fn load(
        &self,
        name: &str,
        shape: &[usize],
        slice: Slice,
        dtype: Option<DType>,
    ) -> Result<Tensor<D::Buf>, ModelError> {
        let dtype = match dtype.or(self.dtype) {
            Some(d) => d,
            None => self.ck.dtype_of(name)?,
        };
        let len = match &slice {
            Slice::Full => shape.iter().product(),
            Slice::Rows(r) => r.len() * shape.iter().skip(1).product::<usize>(),
            Slice::Cols(c) => shape[0] * c.len(),
        };
        let buf = self.dev.alloc(len * dtype.size())?;
        self.ck
            .read(name, shape, &slice, dtype, &mut |off, bytes| {
                self.dev.write(&buf, off, bytes).map_err(ModelError::from)
            })?;
        Ok(Tensor { buf, dtype, len })
    }

    /// Small tensors the ops read as f32 (norm weights, biases). With an explicit weight
    /// dtype they are first rounded to it, as loading with transformers' `torch_dtype` would,
    /// so that a model converted at load time equals the same model stored in that dtype.
    fn load_f32(
        &self,
        name: &str,
        shape: &[usize],
        slice: Slice,
    ) -> Result<Tensor<D::Buf>, ModelError> {
        let Some(dtype) = self.dtype.filter(|&d| d != DType::F32) else {
            return self.load(name, shape, slice, Some(DType::F32));
        };
        let mut vals = Vec::new();
        self.ck.read(name, shape, &slice, dtype, &mut |_, b| {
            vals.extend(decode(dtype, b));
            Ok(())
        })?;
        let buf = self.dev.alloc(vals.len() * 4)?;
        self.dev.write(&buf, 0, &encode(DType::F32, &vals))?;
        Ok(Tensor {
            buf,
            dtype: DType::F32,
            len: vals.len(),
        })
    }
}

/// Loads this rank's slices of every tensor, calling `progress(layers_done, layers)` after
/// each layer.
pub fn load<D: Device>(
    dev: &D,
    ck: &Checkpoint,
    cfg: &ModelConfig,
    plan: &ShardPlan,
    dtype: Option<DType>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Weights<D::Buf>, ModelError> {
    let l = Loader { dev, ck, dtype };
    let (h, d) = (cfg.hidden, cfg.head_dim);
    let q_rows = plan.q_heads.start * d..plan.q_heads.end * d;
    let kv_rows = plan.kv_heads.start * d..plan.kv_heads.end * d;
    let (qd, kvd) = (cfg.heads * d, cfg.kv_heads * d);
    let mut layers = Vec::with_capacity(cfg.layers);
    for i in 0..cfg.layers {
        let p = format!("model.layers.{i}.");
        let t = |s: &str| format!("{p}{s}");
        let bias = |s: &str, n: usize, rows: &std::ops::Range<usize>| {
            cfg.qkv_bias
                .then(|| l.load_f32(&t(s), &[n], Slice::Rows(rows.clone())))
                .transpose()
        };
        let qk_norm = |s: &str| {
            cfg.qk_norm
                .then(|| l.load_f32(&t(s), &[d], Slice::Full))
                .transpose()
        };
        layers.push(LayerWeights {
            attn_norm: l.load_f32(&t("input_layernorm.weight"), &[h], Slice::Full)?,
            wq: l.load(
                &t("self_attn.q_proj.weight"),
                &[qd, h],
                Slice::Rows(q_rows.clone()),
                None,
            )?,
            wk: l.load(
                &t("self_attn.k_proj.weight"),
                &[kvd, h],
                Slice::Rows(kv_rows.clone()),
                None,
            )?,
            wv: l.load(
                &t("self_attn.v_proj.weight"),
                &[kvd, h],
                Slice::Rows(kv_rows.clone()),
                None,
            )?,
            bq: bias("self_attn.q_proj.bias", qd, &q_rows)?,
            bk: bias("self_attn.k_proj.bias", kvd, &kv_rows)?,
            bv: bias("self_attn.v_proj.bias", kvd, &kv_rows)?,
            q_norm: qk_norm("self_attn.q_norm.weight")?,
            k_norm: qk_norm("self_attn.k_norm.weight")?,
            wo: l.load(
                &t("self_attn.o_proj.weight"),
                &[h, qd],
                Slice::Cols(q_rows.clone()),
                None,
            )?,
            ffn_norm: l.load_f32(&t("post_attention_layernorm.weight"), &[h], Slice::Full)?,
            w_gate: l.load(
                &t("mlp.gate_proj.weight"),
                &[cfg.intermediate, h],
                Slice::Rows(plan.inter.clone()),
                None,
            )?,
            w_up: l.load(
                &t("mlp.up_proj.weight"),
                &[cfg.intermediate, h],
                Slice::Rows(plan.inter.clone()),
                None,
            )?,
            w_down: l.load(
                &t("mlp.down_proj.weight"),
                &[h, cfg.intermediate],
                Slice::Cols(plan.inter.clone()),
                None,
            )?,
        });
        progress(i + 1, cfg.layers);
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
        norm: l.load_f32("model.norm.weight", &[h], Slice::Full)?,
        lm_head: if cfg.tie_embeddings {
            None
        } else {
            Some(l.load("lm_head.weight", &[cfg.vocab, h], vocab_rows, None)?)
        },
    })
}
