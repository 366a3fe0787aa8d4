//! One rank's weights on its device: the slices of each tensor that the [`ShardPlan`] gives
//! this rank, read from the checkpoint and converted to the chosen dtype. Shapes are written
//! global → per rank, with `nq = q_heads.len()`, `nkv = kv_heads.len()`, `I = inter.len()`,
//! `V = vocab.len()` of this rank's plan, `d = head_dim`, `h = hidden`; for Qwen3.5's
//! DeltaNet layers `nk = lin_k_heads.len()`, `nv = lin_v_heads.len()`, `dk`, `dv` the head
//! dims, `C = 2·nk·dk + nv·dv` the rank's conv channels (global `conv_dim`).
//!
//! Qwen3.5's RMSNorms are zero-centred (x · rsqrt(mean x² + ε) · (1 + w), in f32): their
//! weights are loaded as the f32 `1 + w`, so that the norm ops serve unchanged. Its DeltaNet
//! gated norm uses plain w.
//!
//! A GPTQ checkpoint's quantized MLP (the linears its `quantization_config` rules quantize)
//! is read into the int4 device layout of `tprun_kernels::int4` ([`Matrix::Int4`]); every
//! other matrix stays dense. Quantized attention or DeltaNet projections are refused.

use tprun_kernels::dtype::{decode, encode};
use tprun_kernels::int4::Int4Host;
use tprun_kernels::{DType, Device, View};

use super::config::LayerKind;
use super::gptq::{k_shard, GptqConfig, LinearPart};
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

/// A GPTQ int4 matrix of `n` outputs over `k` inputs in the device layout of
/// `tprun_kernels::int4` (the buffers [`tprun_kernels::ops::MatmulInt4`] reads).
pub struct Int4<B> {
    /// [n, kq/8] u32, kq = groups · group stored inputs.
    pub qweight: B,
    /// [n, groups] f16.
    pub scales: B,
    /// [n, ⌈groups/8⌉] u32.
    pub zeros: B,
    /// [kq] u32: the input each stored input multiplies (`desc_act`); `None`: the identity.
    pub perm: Option<B>,
    pub n: usize,
    pub k: usize,
    pub group: usize,
    pub groups: usize,
}

/// A weight matrix [n, k]: dense in the load dtype, or GPTQ int4.
pub enum Matrix<B> {
    Dense(Tensor<B>),
    Int4(Int4<B>),
}

/// One decoder layer. The column-parallel projections that read the same input are fused at
/// load (concatenated per rank along their output rows), so that decode runs one
/// matrix–vector product where the checkpoint has two or more.
pub struct LayerWeights<B> {
    /// `input_layernorm`: [h] → [h] (replicated), f32.
    pub attn_norm: Tensor<B>,
    /// The token mixer: attention or (Qwen3.5) a gated DeltaNet.
    pub mixer: Mixer<B>,
    /// `post_attention_layernorm`: [h] → [h] (replicated), f32.
    pub ffn_norm: Tensor<B>,
    /// `gate_proj | up_proj`: [2·intermediate, h] → [2·I, h]: this rank's gate rows, then
    /// its up rows (the layout `Epilogue::SiluMul` pairs: output j is silu(gate j) · up j).
    /// GPTQ: int4, gate and up fused the same way.
    pub w_gate_up: Matrix<B>,
    /// `down_proj`: [h, intermediate] → [h, I]. GPTQ: int4, I on group boundaries.
    pub w_down: Matrix<B>,
}

/// What mixes tokens in one layer.
pub enum Mixer<B> {
    Attention(AttnWeights<B>),
    Delta(DeltaWeights<B>),
}

/// `self_attn`.
pub struct AttnWeights<B> {
    /// `q_proj | k_proj | v_proj`: [heads·d + 2·kv_heads·d, h] → [(nq + 2·nkv)·d, h]: this
    /// rank's query-head rows, then its KV-head rows of k, then of v. With Qwen3.5's output
    /// gate, q_proj is [heads·2d, h], each head's rows [query | gate]; the query rows go
    /// first as above and the gate rows of the rank's heads last: [(2·nq + 2·nkv)·d, h].
    pub wqkv: Tensor<B>,
    /// Qwen2 biases, concatenated the same way: [(nq + 2·nkv)·d], f32.
    pub bqkv: Option<Tensor<B>>,
    /// Qwen3 / Qwen3.5 `q_norm`, `k_norm`: [d] → [d] (replicated), f32.
    pub q_norm: Option<Tensor<B>>,
    pub k_norm: Option<Tensor<B>>,
    /// `o_proj`: [h, heads·d] → [h, nq·d] (columns of this rank's query heads).
    pub wo: Tensor<B>,
}

/// `linear_attn` (Qwen3.5's gated DeltaNet).
pub struct DeltaWeights<B> {
    /// `in_proj_qkv | in_proj_z | in_proj_b | in_proj_a`: [conv_dim + V_heads·dv + 2·V_heads,
    /// h] → [C + nv·dv + 2·nv, h]: the rank's conv channels (q rows of its key heads, k rows
    /// of them, v rows of its value heads), then its z rows, b rows, a rows.
    pub w_in: Tensor<B>,
    /// `conv1d.weight`: [conv_dim, 1, kernel] → [C, kernel] (the same channels), f32.
    pub conv: Tensor<B>,
    /// `A_log`, `dt_bias`: [V_heads] → [nv], f32.
    pub a_log: Tensor<B>,
    pub dt_bias: Tensor<B>,
    /// `norm.weight` (the gated RMSNorm, plain w): [dv] (replicated), f32.
    pub norm: Tensor<B>,
    /// `out_proj`: [h, V_heads·dv] → [h, nv·dv] (columns of this rank's value heads).
    pub w_out: Tensor<B>,
}

impl<B> LayerWeights<B> {
    /// The dtype of the layer's matrices.
    pub fn matrix_dtype(&self) -> DType {
        match &self.mixer {
            Mixer::Attention(a) => a.wqkv.dtype,
            Mixer::Delta(dn) => dn.w_in.dtype,
        }
    }
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

    /// An int4 matrix, uploaded buffer by buffer.
    fn load_int4(&self, h: &Int4Host) -> Result<Int4<D::Buf>, ModelError> {
        let put = |bytes: Vec<u8>| -> Result<D::Buf, ModelError> {
            let buf = self.dev.alloc(bytes.len())?;
            self.dev.write(&buf, 0, &bytes)?;
            self.done.set(self.done.get() + bytes.len() as u64);
            (self.progress.borrow_mut())(self.done.get());
            Ok(buf)
        };
        let words = |v: &[u32]| v.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
        Ok(Int4 {
            qweight: put(words(&h.qweight))?,
            scales: put(h.scales.iter().flat_map(|s| s.to_le_bytes()).collect())?,
            zeros: put(words(&h.zeros))?,
            perm: h.perm.as_deref().map(|p| put(words(p))).transpose()?,
            n: h.n,
            k: h.k,
            group: h.group,
            groups: h.groups,
        })
    }

    /// Small tensors the ops read as f32 (norm weights, biases). With an explicit weight
    /// dtype they are first rounded to it, as loading with transformers' `torch_dtype` would,
    /// so that a model converted at load time equals the same model stored in that dtype.
    fn load_f32(&self, parts: &[Part<'_>]) -> Result<Tensor<D::Buf>, ModelError> {
        self.load_f32_plus(parts, 0.0)
    }

    /// A norm weight: plain, or as `1 + w` in f32 when the model's norms are zero-centred.
    fn load_norm(
        &self,
        name: &str,
        dim: usize,
        centred: bool,
    ) -> Result<Tensor<D::Buf>, ModelError> {
        let parts: &[Part<'_>] = &[(name, &[dim], Slice::Full)];
        self.load_f32_plus(parts, if centred { 1.0 } else { 0.0 })
    }

    /// [`Loader::load_f32`] with `add` added to every value (in f32, after any rounding).
    fn load_f32_plus(&self, parts: &[Part<'_>], add: f32) -> Result<Tensor<D::Buf>, ModelError> {
        let dtype = match self.dtype.filter(|&d| d != DType::F32) {
            Some(d) => d,
            None if add == 0.0 => return self.load_concat(parts, Some(DType::F32)),
            None => DType::F32,
        };
        let mut vals = Vec::new();
        for (name, shape, slice) in parts {
            self.ck.read(name, shape, slice, dtype, &mut |_, b| {
                vals.extend(decode(dtype, b).into_iter().map(|v| v + add));
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
    let gate = match &cfg.hybrid {
        Some(hy) if hy.attn_gate => nq,
        _ => 0,
    };
    let attn = ((nq + 2 * nkv + gate) * h + h * nq) as u64;
    let delta = match &cfg.hybrid {
        Some(hy) => {
            let (nk, nv) = (plan.lin_k_heads.len(), plan.lin_v_heads.len());
            let rows = 2 * nk * hy.dk + 2 * nv * hy.dv + 2 * nv;
            (rows * h + h * nv * hy.dv) as u64
        }
        None => 0,
    };
    let w = wsize as u64;
    let pre = text_prefix(cfg);
    // The MLP's bytes: dense, or int4 (qweight, scales, zeros, perm) where GPTQ-quantized.
    let mlp = |l: usize| -> u64 {
        let p = format!("{pre}layers.{l}.mlp.");
        let q = |m: &str| {
            cfg.gptq
                .as_ref()
                .and_then(|g| g.settings(&format!("{p}{m}")))
        };
        let dense = |n: usize, k: usize| (n * k) as u64 * w;
        let gate_up = match q("gate_proj") {
            Some(s) => int4_bytes(2 * i, h, s.group_len(h), s.desc_act),
            None => dense(2 * i, h),
        };
        let down = match q("down_proj") {
            Some(s) => int4_bytes(h, i, s.group_len(cfg.intermediate), s.desc_act),
            None => dense(h, i),
        };
        gate_up + down
    };
    let layers: u64 = (0..cfg.layers)
        .map(|l| match cfg.kind(l) {
            LayerKind::Attention => attn * w + mlp(l),
            LayerKind::Delta => delta * w + mlp(l),
        })
        .sum();
    let vocab = (plan.vocab.len() * h) as u64;
    let heads = if cfg.tie_embeddings { 1 } else { 2 };
    let total = layers + heads * vocab * w;
    let per_token = layers + vocab * w;
    (total, per_token)
}

/// Bytes of an int4 matrix of `n` outputs over `k` inputs in groups of `group` (the layout of
/// `tprun_kernels::int4`: [`Int4Host::bytes`]): qweight k/2 per row, an f16 scale and a
/// nibble of zero (in whole u32 words) per group and row, and with `desc_act` a u32 per input
/// of `perm` (a shard whose groups are ragged pads them; not counted).
fn int4_bytes(n: usize, k: usize, group: usize, desc_act: bool) -> u64 {
    let groups = k.div_ceil(group.max(1));
    let perm = if desc_act { 4 * k } else { 0 };
    (n * k / 2 + n * groups * 2 + n * Int4Host::zero_words(groups) * 4 + perm) as u64
}

/// The prefix of the text model's tensors: `model.language_model.` in Qwen3.5's multimodal
/// checkpoints, else `model.`.
pub fn text_prefix(cfg: &ModelConfig) -> &'static str {
    match &cfg.hybrid {
        Some(h) if h.multimodal => "model.language_model.",
        _ => "model.",
    }
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
    let pre = text_prefix(cfg);
    if cfg.hybrid.is_some() {
        // The vision tower and the multi-token-prediction head are not part of text decode.
        let skipped = ck
            .names()
            .filter(|n| {
                n.starts_with("model.visual.") || n.starts_with("visual.") || n.starts_with("mtp.")
            })
            .count();
        if skipped > 0 {
            tracing::info!("not loading {skipped} vision (visual.*) and multi-token prediction (mtp.*) tensors: text decode does not use them");
        }
    }
    let h = cfg.hidden;
    let centred = cfg.zero_centred_norms();
    let mut layers = Vec::with_capacity(cfg.layers);
    for i in 0..cfg.layers {
        let p = format!("{pre}layers.{i}.");
        let t = |s: &str| format!("{p}{s}");
        let mixer = match cfg.kind(i) {
            LayerKind::Attention => Mixer::Attention(load_attention(&l, cfg, plan, &p)?),
            LayerKind::Delta => Mixer::Delta(load_delta(&l, cfg, plan, &p)?),
        };
        let (w_gate_up, w_down) = load_mlp(&l, cfg, plan, &p)?;
        layers.push(LayerWeights {
            attn_norm: l.load_norm(&t("input_layernorm.weight"), h, centred)?,
            mixer,
            ffn_norm: l.load_norm(&t("post_attention_layernorm.weight"), h, centred)?,
            w_gate_up,
            w_down,
        });
    }
    let vocab_rows = Slice::Rows(plan.vocab.clone());
    Ok(Weights {
        embed: l.load(
            &format!("{pre}embed_tokens.weight"),
            &[cfg.vocab, h],
            vocab_rows.clone(),
            None,
        )?,
        layers,
        norm: l.load_norm(&format!("{pre}norm.weight"), h, centred)?,
        lm_head: if cfg.tie_embeddings {
            None
        } else {
            Some(l.load("lm_head.weight", &[cfg.vocab, h], vocab_rows, None)?)
        },
    })
}

/// gate|up and down of one layer.
type Mlp<B> = (Matrix<B>, Matrix<B>);

/// `mlp` of layer prefix `p`: gate|up fused, and down; int4 where the GPTQ rules quantize
/// them.
fn load_mlp<D: Device>(
    l: &Loader<'_, D>,
    cfg: &ModelConfig,
    plan: &ShardPlan,
    p: &str,
) -> Result<Mlp<D::Buf>, ModelError> {
    let (h, inter) = (cfg.hidden, cfg.intermediate);
    let m = |s: &str| format!("{p}mlp.{s}");
    let (gate, up, down) = (m("gate_proj"), m("up_proj"), m("down_proj"));
    let quantized = |q: &GptqConfig| [&gate, &up, &down].map(|m| q.is_quantized(m));
    match cfg.gptq.as_ref().map(|q| (q, quantized(q))) {
        None | Some((_, [false, false, false])) => {
            let shape = [inter, h];
            let rows = Slice::Rows(plan.inter.clone());
            let gate_up = l.load_concat(
                &[
                    (&(gate + ".weight"), &shape, rows.clone()),
                    (&(up + ".weight"), &shape, rows),
                ],
                None,
            )?;
            let down = l.load(
                &(down + ".weight"),
                &[h, inter],
                Slice::Cols(plan.inter.clone()),
                None,
            )?;
            Ok((Matrix::Dense(gate_up), Matrix::Dense(down)))
        }
        Some((q, [true, true, true])) => {
            // down_proj's input columns on group boundaries; ShardPlan split them by layer
            // 0's settings, so a layer quantized otherwise cannot share the split.
            let s = q.settings(&down).expect("quantized");
            let k = k_shard(inter, &s, plan.world, plan.rank)?;
            if k != plan.inter {
                return Err(ModelError::Invalid(format!(
                    "gptq: {down} is quantized in groups that split its inputs as {k:?} on rank \
                     {} but layer 0's split them as {:?}: every layer's down_proj must be \
                     grouped alike",
                    plan.rank, plan.inter
                )));
            }
            let read = |module: &str, n: usize, k: usize, part_n, part_k| {
                let part = LinearPart {
                    module,
                    out_features: n,
                    in_features: k,
                    n: part_n,
                    k: part_k,
                };
                q.read_linear(l.ck, &part)?.to_int4()
            };
            let rows = plan.inter.clone();
            let gate_up = Int4Host::concat_rows(&[
                read(&gate, inter, h, rows.clone(), 0..h)?,
                read(&up, inter, h, rows.clone(), 0..h)?,
            ])
            .map_err(|why| ModelError::Invalid(format!("gptq: {p}mlp gate_proj|up_proj: {why}")))?;
            let down = read(&down, h, inter, 0..h, rows)?;
            Ok((
                Matrix::Int4(l.load_int4(&gate_up)?),
                Matrix::Int4(l.load_int4(&down)?),
            ))
        }
        Some((_, q)) => Err(ModelError::Invalid(format!(
            "gptq: {p}mlp: gate_proj, up_proj, down_proj quantized {q:?}: tprun needs all three \
             quantized or none"
        ))),
    }
}

/// Refuses a GPTQ checkpoint whose rules quantize a projection of the token mixer: only the
/// MLP has an int4 path (the official Qwen3.5 GPTQ checkpoints keep attention and DeltaNet
/// in bf16).
fn check_mixer_dense(cfg: &ModelConfig, p: &str, modules: &[&str]) -> Result<(), ModelError> {
    let Some(q) = &cfg.gptq else { return Ok(()) };
    match modules.iter().find(|m| q.is_quantized(&format!("{p}{m}"))) {
        Some(m) => Err(ModelError::Invalid(format!(
            "gptq: {p}{m} is quantized, but tprun reads only the MLP as int4 (a dynamic rule \
             `-:.*(self_attn|linear_attn).*` keeps the token mixers dense)"
        ))),
        None => Ok(()),
    }
}

/// `self_attn` of layer prefix `p`.
fn load_attention<D: Device>(
    l: &Loader<'_, D>,
    cfg: &ModelConfig,
    plan: &ShardPlan,
    p: &str,
) -> Result<AttnWeights<D::Buf>, ModelError> {
    let (h, d) = (cfg.hidden, cfg.head_dim);
    check_mixer_dense(
        cfg,
        p,
        &[
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
        ],
    )?;
    let t = |s: &str| format!("{p}{s}");
    let q_rows = plan.q_heads.start * d..plan.q_heads.end * d;
    let kv_rows = plan.kv_heads.start * d..plan.kv_heads.end * d;
    let (qd, kvd) = (cfg.heads * d, cfg.kv_heads * d);
    let gated = cfg.hybrid.as_ref().is_some_and(|hy| hy.attn_gate);
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
    let centred = cfg.zero_centred_norms();
    let qk_norm = |s: &str| {
        cfg.qk_norm
            .then(|| l.load_norm(&t(s), d, centred))
            .transpose()
    };
    // transformers (Qwen3.5): q_proj(x).view(.., heads, 2·d).chunk(2) — each head's 2d rows
    // are [query | gate].
    let q_shape = [if gated { 2 * qd } else { qd }, h];
    let kv_shape = [kvd, h];
    let mut parts: Vec<Part<'_>> = Vec::new();
    if gated {
        for j in plan.q_heads.clone() {
            parts.push((&wq, &q_shape, Slice::Rows(2 * j * d..(2 * j + 1) * d)));
        }
    } else {
        parts.push((&wq, &q_shape, Slice::Rows(q_rows.clone())));
    }
    parts.push((&wk, &kv_shape, Slice::Rows(kv_rows.clone())));
    parts.push((&wv, &kv_shape, Slice::Rows(kv_rows.clone())));
    if gated {
        for j in plan.q_heads.clone() {
            parts.push((&wq, &q_shape, Slice::Rows((2 * j + 1) * d..(2 * j + 2) * d)));
        }
    }
    Ok(AttnWeights {
        wqkv: l.load_concat(&parts, None)?,
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
            Slice::Cols(q_rows),
            None,
        )?,
    })
}

/// `linear_attn` (gated DeltaNet) of layer prefix `p`, as transformers'
/// `Qwen3_5GatedDeltaNet` names and lays it out: in_proj_qkv's rows are [q (k_heads·dk) |
/// k (k_heads·dk) | v (v_heads·dv)], the conv's channels the same.
fn load_delta<D: Device>(
    l: &Loader<'_, D>,
    cfg: &ModelConfig,
    plan: &ShardPlan,
    p: &str,
) -> Result<DeltaWeights<D::Buf>, ModelError> {
    let hy = cfg.hybrid.as_ref().expect("a DeltaNet layer is a hybrid's");
    check_mixer_dense(
        cfg,
        p,
        &[
            "linear_attn.in_proj_qkv",
            "linear_attn.in_proj_z",
            "linear_attn.in_proj_b",
            "linear_attn.in_proj_a",
            "linear_attn.out_proj",
        ],
    )?;
    let h = cfg.hidden;
    let t = |s: &str| format!("{p}linear_attn.{s}");
    let (kr, vr) = (plan.lin_k_heads.clone(), plan.lin_v_heads.clone());
    let key_dim = hy.k_heads * hy.dk;
    let rows = |r: &std::ops::Range<usize>, dim: usize, base: usize| {
        Slice::Rows(base + r.start * dim..base + r.end * dim)
    };
    // The rank's conv channels: its q, its k, its v.
    let channels = [
        rows(&kr, hy.dk, 0),
        rows(&kr, hy.dk, key_dim),
        rows(&vr, hy.dv, 2 * key_dim),
    ];
    let (wqkv, wz, wb, wa, conv) = (
        t("in_proj_qkv.weight"),
        t("in_proj_z.weight"),
        t("in_proj_b.weight"),
        t("in_proj_a.weight"),
        t("conv1d.weight"),
    );
    let qkv_shape = [hy.conv_dim(), h];
    let z_shape = [hy.v_heads * hy.dv, h];
    let ba_shape = [hy.v_heads, h];
    let conv_shape = [hy.conv_dim(), 1, hy.conv_kernel];
    let mut w_in: Vec<Part<'_>> = channels
        .iter()
        .map(|s| (wqkv.as_str(), &qkv_shape[..], s.clone()))
        .collect();
    w_in.push((&wz, &z_shape, rows(&vr, hy.dv, 0)));
    w_in.push((&wb, &ba_shape, rows(&vr, 1, 0)));
    w_in.push((&wa, &ba_shape, rows(&vr, 1, 0)));
    let conv_parts: Vec<Part<'_>> = channels
        .iter()
        .map(|s| (conv.as_str(), &conv_shape[..], s.clone()))
        .collect();
    let (a_log, dt_bias) = (t("A_log"), t("dt_bias"));
    Ok(DeltaWeights {
        w_in: l.load_concat(&w_in, None)?,
        conv: l.load_f32(&conv_parts)?,
        a_log: l.load_f32(&[(&a_log, &[hy.v_heads], rows(&vr, 1, 0))])?,
        dt_bias: l.load_f32(&[(&dt_bias, &[hy.v_heads], rows(&vr, 1, 0))])?,
        norm: l.load_norm(&t("norm.weight"), hy.dv, false)?,
        w_out: l.load(
            &t("out_proj.weight"),
            &[h, hy.v_heads * hy.dv],
            Slice::Cols(vr.start * hy.dv..vr.end * hy.dv),
            None,
        )?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gptq::ZeroFormat;
    use crate::model::synth::{config_for, SynthQuant};
    use crate::model::{Arch, Preset, SynthOptions};

    /// The bytes a decode step reads (`decode --json`'s GB/s numerator) count a GPTQ MLP
    /// at its packed size: for the 27B at TP=1, qweight (4 bits a weight), f16 scales and
    /// u32 zero words per group of 128, in place of 3 bf16 matrices per layer; the whole step
    /// is the issue's ~26 GB.
    #[test]
    fn step_bytes_count_an_int4_mlp_at_its_packed_size() {
        let q = config_for(&SynthOptions {
            arch: Arch::Qwen3_5,
            preset: Preset::Qwen3_5_27b,
            dtype: DType::BF16,
            seed: 0,
            tie_embeddings: None,
            quant: Some(SynthQuant {
                group_size: Some(128),
                desc_act: false,
                format: ZeroFormat::V1,
                dequantised: false,
            }),
        });
        let mut dense = q.clone();
        dense.gptq = None;
        let plan = ShardPlan::new(&q, 0, 1).unwrap();
        let (_, int4) = shard_bytes(&q, &plan, 2);
        let (_, bf16) = shard_bytes(&dense, &plan, 2);
        let (h, i) = (5120u64, 17408u64);
        let bf16_mlp = 3 * h * i * 2;
        // gate|up: 2i rows over h inputs (40 groups); down: h rows over i inputs (136).
        let int4_mlp = (2 * i * h / 2 + 2 * i * 40 * 2 + 2 * i * 5 * 4)
            + (h * i / 2 + h * 136 * 2 + h * 17 * 4);
        assert_eq!(bf16 - int4, 64 * (bf16_mlp - int4_mlp));
        assert!((25.5e9..26.5e9).contains(&(int4 as f64)), "{int4}");
    }
}
