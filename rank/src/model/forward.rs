//! [`Model`]: one rank's shard of a Llama-family model on one device: its weights, its KV
//! cache (and, for Qwen3.5's gated DeltaNet layers, their conv and recurrent states), its
//! scratch and step-state buffers, and the forward pass (prefill of a prompt in batched
//! matrix–matrix products, then one token per step).
//!
//! Every piece of math is an [`Op`] run through [`Device::run`], so every backend runs this
//! same forward; the model never touches a raw pointer. Token ids and positions live in a
//! device buffer (`step`), never in op arguments, so that the single-token step — all layers,
//! both allreduces per layer, the LM head, the candidate gather, sampling and the
//! token/position update — is captured once as a device graph and replayed per token
//! ([`Model::decode`]); the CPU backend runs the same ops directly.
//!
//! Collective calls per forward, all on f32 buffers (none at world 1):
//! - the vocab-parallel embedding: each rank looks up the ids in its vocab rows and writes
//!   zeros for the others, so the sum over ranks is the full lookup (exact: one non-zero term);
//! - after o_proj and after down_proj (row-parallel: each rank's partial product), each
//!   followed by the residual add and the next norm;
//! - sampling: each rank's best [`TOPK_MAX`] logits of its vocab shard, as (logit, id) pairs in
//!   its own part of a zero-filled buffer, so that the allreduce of that small buffer is an
//!   all-gather (adding only zeros: exact). Every rank then picks the same token from the
//!   same candidates with the same seeded draw.
//!
//! A DeltaNet layer ends with out_proj, row-parallel like o_proj, so every layer kind has
//! the same two allreduces.
//!
//! Only the row-parallel sums depend on the world size (their f32 addition order), so logits
//! at different world sizes agree to about 1e-6 relative; on one world size every rank holds
//! bitwise the same values and so picks the same token.
//!
//! Must not: know about processes or print.

use std::path::Path;
use std::sync::Arc;

use tprun_kernels::comm::AddNorm;
use tprun_kernels::dtype::{decode_u32, encode_u32};
use tprun_kernels::ops::{self, Epilogue, Prologue, SampleParams, TOPK_MAX};
use tprun_kernels::{DType, Device, Op, OpLimits, View};

use super::config::LayerKind;
use super::safetensors::Checkpoint;
use super::weights::{self, AttnWeights, DeltaWeights, Matrix, Mixer, Tensor, Weights};
use super::{ModelConfig, ModelError, ShardPlan};
use crate::{Collectives, RankError};

/// Choices made when loading a shard.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Dtype the matrices are stored in on the device (`None` = "auto": as in the checkpoint).
    /// Norm weights and biases are always f32; activations are f32.
    pub dtype: Option<DType>,
    /// Dtype of the KV cache (f32, bf16 or f16; each new key/value is rounded once as it is
    /// stored).
    pub kv_dtype: DType,
    /// KV-cache length in tokens (`None`: `max_position_embeddings`, at most 4096).
    pub max_seq: Option<usize>,
    /// Most prompt tokens run through one batched pass; longer prompts are prefilled in
    /// chunks of this size. Sizes the scratch buffers and the largest allreduce.
    pub prefill_chunk: usize,
    /// Sequences the KV cache holds at once (cache slots, each `max_seq` long): the most a
    /// batched step ([`Model::step_batch`]) runs. 1 for plain decoding; more than 1 is only
    /// for attention-only models (a DeltaNet layer's recurrent state has one slot).
    pub slots: usize,
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
            slots: 1,
        }
    }
}

/// Default KV-cache length cap when the caller gives none: bounds memory for models whose
/// `max_position_embeddings` is 128k.
pub const DEFAULT_MAX_SEQ: usize = 4096;

impl LoadOptions {
    /// The KV-cache length these options give `cfg`: `max_seq`, else the model's context
    /// capped at [`DEFAULT_MAX_SEQ`]; at least 1.
    pub fn context(&self, cfg: &ModelConfig) -> usize {
        self.max_seq
            .unwrap_or(cfg.max_positions.min(DEFAULT_MAX_SEQ))
            .max(1)
    }
}

/// Everything a shard allocates besides its weights, computed once for the memory check,
/// the allocation and the report.
struct Sizes {
    max_seq: usize,
    chunk: usize,
    slots: usize,
    /// Bytes of one attention layer's K (or V) cache, all slots.
    kv_bytes: usize,
    /// f32 elements of one DeltaNet layer's conv state and recurrent state (0, 0 if none).
    delta: (usize, usize),
    /// f32 elements of each scratch buffer, in [`Scratch`]'s field order.
    scratch: [usize; 14],
}

impl Sizes {
    fn new(cfg: &ModelConfig, plan: &ShardPlan, opts: &LoadOptions) -> Result<Sizes, ModelError> {
        let max_seq = opts.context(cfg);
        if max_seq >= u32::MAX as usize {
            return Err(ModelError::Invalid(format!(
                "a KV cache of {max_seq} tokens: positions are 32-bit"
            )));
        }
        let slots = opts.slots.max(1);
        if slots > 1 && cfg.hybrid.is_some() {
            return Err(ModelError::Invalid(format!(
                "{slots} cache slots: a hybrid model's DeltaNet state holds one sequence, so it \
                 runs one at a time (batch 1)"
            )));
        }
        // A batched step's rows share the prefill scratch: a chunk holds at least a batch.
        let chunk = opts.prefill_chunk.clamp(1, max_seq).max(slots);
        let (d, h) = (cfg.head_dim, cfg.hidden);
        let (nqh, nkv, ni) = (
            plan.q_heads.len(),
            plan.kv_heads.len() * d,
            plan.inter.len(),
        );
        let nq = nqh * d;
        let kv_bytes = max_seq
            .checked_mul(nkv * opts.kv_dtype.size())
            .and_then(|b| b.checked_mul(slots))
            .ok_or_else(|| {
                ModelError::Invalid(format!("a KV cache of {slots} × {max_seq} tokens"))
            })?;
        // The attention projection's width (with Qwen3.5's output gate: nq more), and the
        // DeltaNet's: its conv channels C, then z, b, a; its output nv·dv.
        let gate = match &cfg.hybrid {
            Some(hy) if hy.attn_gate => nq,
            _ => 0,
        };
        let (mut delta_in, mut delta_out, mut channels, mut delta) = (0, 0, 0, (0, 0));
        if let Some(hy) = &cfg.hybrid {
            let (nk, nv) = (plan.lin_k_heads.len(), plan.lin_v_heads.len());
            channels = 2 * nk * hy.dk + nv * hy.dv;
            delta_in = channels + nv * hy.dv + 2 * nv;
            delta_out = nv * hy.dv;
            delta = (channels * (hy.conv_kernel - 1), nv * hy.dk * hy.dv);
        }
        let scratch = [
            chunk * h,
            chunk * h,
            chunk * (nq + 2 * nkv + gate).max(delta_in),
            chunk * nq,
            chunk * nq.max(delta_out),
            chunk * h,
            chunk * ni,
            slots * plan.vocab.len().max(1),
            slots * plan.world * 2 * TOPK_MAX,
            ops::Attention::<()>::workspace_len(slots, nqh, d, max_seq),
            cfg.rotary_dim() / 2,
            cfg.vocab,
            chunk * h,
            (chunk * channels).max(1),
        ];
        Ok(Sizes {
            max_seq,
            chunk,
            slots,
            kv_bytes,
            delta,
            scratch,
        })
    }

    /// u32 words of the step state ([`Step`]).
    fn step_words(&self) -> usize {
        2 + 3 * self.chunk + 2 * self.slots
    }

    /// u32 words of the token histories (one per slot).
    fn history_words(&self) -> usize {
        self.slots * (self.max_seq + 1)
    }

    /// Device bytes: KV cache, DeltaNet states, scratch, step state and token history.
    fn bytes(&self, cfg: &ModelConfig) -> u64 {
        let words = self.scratch.iter().sum::<usize>() + self.step_words() + self.history_words();
        let layers = (0..cfg.layers).map(|l| match cfg.kind(l) {
            LayerKind::Attention => 2 * self.kv_bytes as u64,
            LayerKind::Delta => 4 * (self.delta.0 + self.delta.1) as u64,
        });
        layers.sum::<u64>() + 4 * words as u64
    }
}

/// Bytes one rank's shard of `cfg` holds once loaded with `opts`, its matrices `wsize` bytes
/// an element: (weights, KV cache + recurrent state + scratch). What a rank checks against
/// its device's free memory before it allocates; the coordinator adds up every rank's where
/// the ranks share the host's memory (the CPU backend).
pub fn shard_memory(
    cfg: &ModelConfig,
    rank: usize,
    world: usize,
    opts: &LoadOptions,
    wsize: usize,
) -> Result<(u64, u64), ModelError> {
    let plan = ShardPlan::new(cfg, rank, world)?;
    let (weights, _) = weights::shard_bytes(cfg, &plan, wsize);
    Ok((weights, Sizes::new(cfg, &plan, opts)?.bytes(cfg)))
}

/// Candidates each rank contributes to sampling. Greedy needs only each shard's best; the
/// sampler looks at no more than [`TOPK_MAX`] tokens in all.
fn topk_for(p: &SampleParams) -> usize {
    if p.temperature <= 0.0 || p.top_k == 1 {
        1
    } else {
        TOPK_MAX
    }
}

/// Per-layer KV cache: [max_seq, nkv·d] each, in `Model::kv_dtype`, row `p` holding
/// position `p`.
struct KvCache<B> {
    k: B,
    v: B,
}

/// Per-layer recurrent state of a gated DeltaNet layer, f32, zeroed at the start of each
/// sequence: the conv's last inputs [C, kernel − 1] (oldest first) and the delta rule's
/// S [nv, dk, dv].
struct DeltaState<B> {
    conv: B,
    rec: B,
}

/// What a layer keeps of the sequence so far, by its mixer.
enum LayerCache<B> {
    Kv(KvCache<B>),
    Delta(DeltaState<B>),
}

/// Scratch activations, all f32, sized for `chunk` tokens (`C`). Names follow llama2.c.
struct Scratch<B> {
    /// Residual stream [C, h].
    x: B,
    /// Normed input of a sub-block [C, h].
    xb: B,
    /// Output of the fused q|k|v projection [C, (nq + 2·nkv)·d] (with Qwen3.5's output gate,
    /// followed by the gate block [C, nq·d]); in a DeltaNet layer, the in-projection's blocks
    /// (see [`Model::fused_matmul`]).
    qkv: B,
    /// Queries after norm and RoPE [C, nq·d].
    q: B,
    /// Attention output [C, nq·d]; a DeltaNet layer's output [C, nv·dv].
    att: B,
    /// Partial output of a row-parallel projection, allreduced in place [C, h].
    o: B,
    /// silu(gate) · up [C, I]: the fused gate|up projection's output through its epilogue.
    hb: B,
    /// This rank's vocab shard of the last position's logits [V]; of a batched step's rows
    /// [slots, V].
    logits: B,
    /// Gathered sampling candidates, per sampled row [slots, world · 2·TOPK_MAX] f32: (logit,
    /// id) pairs, k ≤ TOPK_MAX per rank, this rank's at `rank · 2·k` of the row's region.
    cands: B,
    /// Split-sequence attention scratch for one query (ops::Attention::workspace_len).
    attn_ws: B,
    /// RoPE inverse frequencies [rotary_dim / 2].
    inv_freq: B,
    /// Full-vocab logits [vocab] for [`Model::prefill`] / [`Model::step`] (tests and logit
    /// dumps; the decode loop never gathers them).
    full_logits: B,
    /// The other residual buffer [C, h]: at world 1 the residual stream alternates between
    /// `x` and `x2` (see `forward`).
    x2: B,
    /// A DeltaNet layer's conv output (q|k|v after SiLU) [C, channels].
    conv: B,
}

/// The step state, u32 in device memory: `[token, position, ids[C], positions[C],
/// slots[C], pairs[S][2]]`. A single-token step reads its id and position from the first two
/// words and the sampler overwrites them with the next ones; a prefill chunk reads the ids and
/// positions, a batched step also each row's cache slot, and its sampler takes row r's
/// (token, position) from `pairs[r]`.
struct Step<B> {
    buf: B,
    chunk: usize,
}

impl<B> Step<B> {
    // The layout, in words: the only place it is spelled out.
    const IDS: usize = 2;
    fn positions_at(&self) -> usize {
        Self::IDS + self.chunk
    }
    fn slots_at(&self) -> usize {
        Self::IDS + 2 * self.chunk
    }
    fn pairs_at(&self) -> usize {
        Self::IDS + 3 * self.chunk
    }

    fn words(&self, word: usize, len: usize) -> View<'_, B> {
        View::new(&self.buf, 4 * word, len, DType::U32)
    }
    fn token(&self) -> View<'_, B> {
        self.words(0, 1)
    }
    fn position(&self) -> View<'_, B> {
        self.words(1, 1)
    }
    fn state(&self) -> View<'_, B> {
        self.words(0, 2)
    }
    fn ids(&self, m: usize) -> View<'_, B> {
        self.words(Self::IDS, m)
    }
    fn positions(&self, m: usize) -> View<'_, B> {
        self.words(self.positions_at(), m)
    }
    fn slot_ids(&self, m: usize) -> View<'_, B> {
        self.words(self.slots_at(), m)
    }
    fn pair(&self, r: usize) -> View<'_, B> {
        self.words(self.pairs_at() + 2 * r, 2)
    }

    /// The host words that set this state: the single-token `state` (token, position), and
    /// rows of (id, position, slot) (at most `chunk`), the first `paired` of which are also
    /// the sampler's (token, position) pairs. Written at word 0.
    fn encode(&self, state: [u32; 2], rows: &[(u32, u32, u32)], paired: usize) -> Vec<u8> {
        let mut w = vec![0u32; self.pairs_at() + 2 * paired];
        w[..2].copy_from_slice(&state);
        for (i, &(t, p, slot)) in rows.iter().enumerate() {
            w[Self::IDS + i] = t;
            w[self.positions_at() + i] = p;
            w[self.slots_at() + i] = slot;
            if i < paired {
                w[self.pairs_at() + 2 * i..][..2].copy_from_slice(&[t, p]);
            }
        }
        encode_u32(&w)
    }
}

/// The rows one forward runs: `m` tokens whose ids and positions are in `ids`, `pos`, in
/// the cache slot(s) `slots` says.
struct Rows<'a, B> {
    m: usize,
    ids: View<'a, B>,
    pos: View<'a, B>,
    slots: Slots<'a, B>,
}

/// Whose KV cache the rows of a forward use.
#[derive(Clone, Copy)]
enum Slots<'a, B> {
    /// All rows are one sequence's (a prompt chunk, a single-token step).
    One(usize),
    /// Row r is the sequence in the slot the r-th id says (u32 in device memory: a batched
    /// step, one token each).
    Each(View<'a, B>),
}

/// Which rows' logits a forward computes.
#[derive(Clone, Copy, PartialEq)]
enum Logits {
    None,
    Last,
    /// The first k rows', row r's vocab shard at `r · V` of `s.logits` (k ≤ slots).
    First(usize),
}

/// One sequence of a batched step ([`Model::step_batch`]): its cache slot, the token to run
/// at `pos` (its last one), and how its next token is picked.
#[derive(Clone, Copy, Debug)]
pub struct BatchRow {
    pub slot: usize,
    pub token: u32,
    pub pos: usize,
    pub params: SampleParams,
}

/// A sequence that starts in a batched step ([`Model::step_batch`]): its cache slot, its
/// prompt (prefilled in that step) and how its tokens are picked.
#[derive(Clone, Copy, Debug)]
pub struct BatchStart<'a> {
    pub slot: usize,
    pub prompt: &'a [u32],
    pub params: SampleParams,
}

/// One row the sampler picks a token for: its logits row, its parameters, its step state
/// (token, position) and the token history of its slot.
struct SampleRow<'a, B> {
    row: usize,
    params: SampleParams,
    state: View<'a, B>,
    history: View<'a, B>,
}

/// Work queued on a model's device for [`Model::capture_step`]: the model and the
/// communicator are passed in, as the capture holds both.
type StepFn<'a, M, D> = &'a mut dyn FnMut(&M, &mut dyn Collectives<D>) -> Result<(), RankError>;

/// One rank's shard of the model.
pub struct Model<D: Device> {
    dev: Arc<D>,
    cfg: ModelConfig,
    plan: ShardPlan,
    w: Weights<D::Buf>,
    caches: Vec<LayerCache<D::Buf>>,
    kv_dtype: DType,
    s: Scratch<D::Buf>,
    step: Step<D::Buf>,
    /// Token histories [slots, max_seq + 1] u32 in host-mapped memory: the sampler writes the
    /// token of position p of slot s at index s·(max_seq + 1) + p, and the host reads it
    /// without stopping the stream.
    history: D::Buf,
    max_seq: usize,
    chunk: usize,
    /// Cache slots ([`LoadOptions::slots`]); the single-sequence API uses slot 0.
    slots: usize,
    /// Positions 0..len of the KV cache hold the current sequence.
    len: usize,
    /// Tokens the DeltaNet states have taken in (≥ len: a decode may run one step past the
    /// last token it returns); a recurrent state cannot rewind, so [`Model::step`] of a hybrid
    /// model must continue from here.
    state_len: usize,
    /// f32 elements of each DeltaNet layer's conv state and recurrent state.
    delta_len: (usize, usize),
    /// Host copy of the last full-vocab logits.
    logits: Vec<f32>,
    /// Weight bytes one decode step reads (matrices; the embedding is only looked up).
    step_bytes: u64,
    load_bytes: u64,
    state_bytes: u64,
    /// Measurement only ([`Model::set_no_allreduce`]).
    no_allreduce: bool,
    /// Whether [`Model::decode`] captures the step as a graph ([`Model::set_graph`]).
    use_graph: bool,
    /// The captured single-token step, and the allreduces it holds.
    graph: Option<(D::Graph, u32, SampleParams)>,
    /// The captured forward of a batched decode step ([`Model::step_batch`] without prompts),
    /// one per row count (at most the prefill chunk), and the allreduces each holds; `None`
    /// where the capture failed or the device has no graphs (those steps run directly).
    batch_graphs: std::collections::HashMap<usize, Option<(D::Graph, u32)>>,
}

/// Per-token statistics of [`Model::decode`].
#[derive(Clone, Debug, Default)]
pub struct DecodeInfo {
    /// Whether the steps ran as replays of one captured graph.
    pub graph: bool,
    /// Collective calls per step.
    pub allreduces: u32,
    /// Kernel launches one step makes (GPU backends; 0 on the CPU).
    pub launches: u64,
}

impl<D: Device> Drop for Model<D> {
    fn drop(&mut self) {
        // The graph goes first, while the device (declared first, so dropped first among the
        // fields, and possibly its last owner) is alive: a graph destroyed after its context
        // was released is a use-after-free in the driver, which hung the first H200 run at
        // exit. And not while a replay of it is queued (an error can leave one queued): wait
        // for the device before. Never panics; a failure can only be logged.
        if self.graph.is_some() || self.batch_graphs.values().any(Option::is_some) {
            if let Err(e) = self.dev.sync() {
                tracing::warn!("model drop: device sync: {e}");
            }
            self.graph = None;
            self.batch_graphs.clear();
            tracing::debug!("model drop: graphs destroyed");
        }
    }
}

/// The error of a logit row that is not finite: the `n`th generated token, at `position`,
/// had NaN or infinite logits (found by the sampler's candidate scan, `ops::ShardTopK`, or in
/// the host's full row, [`Model::prefill`] / [`Model::step`]).
pub fn not_finite(n: usize, position: usize) -> RankError {
    RankError::Model(format!(
        "decode step {n} (position {position}): the logits are not finite (NaN or infinity): \
         the weights hold NaN or infinity, or the activations overflowed"
    ))
}

fn f32v<B>(b: &B, len: usize) -> View<'_, B> {
    View::new(b, 0, len, DType::F32)
}

/// Whether the backend's kernels take this model's shapes (`Device::op_limits`): checked at
/// load, before any weight is read, so that a model the GPU kernels cannot run fails with one
/// line instead of at its first step.
pub fn fits_kernels(cfg: &ModelConfig, backend: &str, lim: OpLimits) -> Result<(), ModelError> {
    let Some(h) = &cfg.hybrid else {
        return Ok(());
    };
    let mut bad = Vec::new();
    if h.conv_kernel > lim.conv_taps {
        bad.push(format!(
            "linear_conv_kernel_dim {} (at most {})",
            h.conv_kernel, lim.conv_taps
        ));
    }
    if h.dk > lim.delta_dk {
        bad.push(format!(
            "linear_key_head_dim {} (at most {})",
            h.dk, lim.delta_dk
        ));
    }
    if bad.is_empty() {
        return Ok(());
    }
    Err(ModelError::Invalid(format!(
        "the {backend} backend's gated DeltaNet kernels cannot run this model: {} \
         (--backend cpu runs it)",
        bad.join(", ")
    )))
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
        let cfg = ModelConfig::from_dir(dir)?;
        Self::load_with_progress(dev, dir, cfg, rank, world, opts, &mut |_, _| {})
    }

    /// [`Model::load`] of an already parsed config, calling `progress(bytes_loaded,
    /// bytes_total)` as the weights reach the device.
    pub fn load_with_progress(
        dev: Arc<D>,
        dir: &Path,
        cfg: ModelConfig,
        rank: usize,
        world: usize,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Model<D>, ModelError> {
        let ck = Checkpoint::open(dir)?;
        Self::load_checkpoint(dev, &ck, cfg, rank, world, opts, progress)
    }

    /// [`Model::load_with_progress`] from an open checkpoint (one made in memory included:
    /// `synth::in_memory`).
    pub fn load_checkpoint(
        dev: Arc<D>,
        ck: &Checkpoint,
        cfg: ModelConfig,
        rank: usize,
        world: usize,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Model<D>, ModelError> {
        let plan = ShardPlan::new(&cfg, rank, world)?;
        fits_kernels(&cfg, &dev.info().backend, dev.op_limits())?;
        let wsize = match opts.dtype {
            Some(d) => d.size(),
            None => ck
                .dtype_of(&format!(
                    "{}embed_tokens.weight",
                    weights::text_prefix(&cfg)
                ))?
                .size(),
        };
        let (total, _) = weights::shard_bytes(&cfg, &plan, wsize);
        // Out of memory is found before the first allocation, with the figures.
        let sizes = Sizes::new(&cfg, &plan, opts)?;
        if let Some((free, _)) = dev.mem_info() {
            let need = total + sizes.bytes(&cfg);
            if need > free {
                let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
                return Err(ModelError::Invalid(format!(
                    "rank {rank}'s shard needs {:.2} GiB of device memory ({:.2} GiB of \
                     weights, {:.2} GiB of KV cache and scratch) but {:.2} GiB are free \
                     (a smaller --max-seq, --kv-dtype bf16 or more ranks would fit)",
                    gib(need),
                    gib(total),
                    gib(need - total),
                    gib(free)
                )));
            }
        }
        let w = weights::load(&*dev, ck, &cfg, &plan, opts.dtype, &mut |b| {
            progress(b, total)
        })?;
        let mut m = Self::from_weights(dev, cfg, plan, w, opts.kv_dtype, sizes)?;
        m.load_bytes = total;
        Ok(m)
    }

    /// Measurement only: run every step without its allreduces (each rank's partial sums stay
    /// unsummed, so the tokens are wrong at world > 1), to time what the allreduces cost per
    /// token against a normal run.
    pub fn set_no_allreduce(&mut self, on: bool) {
        self.no_allreduce = on;
        self.graph = None;
        self.batch_graphs.clear();
    }

    /// Whether [`Model::decode`] replays the step as one captured graph (where the device
    /// has graphs) or runs its ops one by one (default: graphs).
    pub fn set_graph(&mut self, on: bool) {
        self.use_graph = on;
        self.graph = None;
        self.batch_graphs.clear();
    }

    /// Weight bytes moved to the device at load.
    pub fn load_bytes(&self) -> u64 {
        self.load_bytes
    }

    /// Device bytes this model holds: weights, KV cache, scratch.
    pub fn device_bytes(&self) -> u64 {
        self.load_bytes + self.state_bytes
    }

    fn from_weights(
        dev: Arc<D>,
        cfg: ModelConfig,
        plan: ShardPlan,
        w: Weights<D::Buf>,
        kv_dtype: DType,
        sizes: Sizes,
    ) -> Result<Model<D>, ModelError> {
        let caches = (0..cfg.layers)
            .map(|l| {
                Ok(match cfg.kind(l) {
                    LayerKind::Attention => LayerCache::Kv(KvCache {
                        k: dev.alloc(sizes.kv_bytes)?,
                        v: dev.alloc(sizes.kv_bytes)?,
                    }),
                    LayerKind::Delta => LayerCache::Delta(DeltaState {
                        conv: dev.alloc(sizes.delta.0 * 4)?,
                        rec: dev.alloc(sizes.delta.1 * 4)?,
                    }),
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let mut f = sizes.scratch.iter().map(|&n| dev.alloc(n * 4));
        let mut next = || f.next().expect("one size per field");
        let s = Scratch {
            x: next()?,
            xb: next()?,
            qkv: next()?,
            q: next()?,
            att: next()?,
            o: next()?,
            hb: next()?,
            logits: next()?,
            cands: next()?,
            attn_ws: next()?,
            inv_freq: next()?,
            full_logits: next()?,
            x2: next()?,
            conv: next()?,
        };
        dev.write(
            &s.inv_freq,
            0,
            &tprun_kernels::dtype::encode(DType::F32, &cfg.inv_freq()),
        )?;
        let step = Step {
            buf: dev.alloc(sizes.step_words() * 4)?,
            chunk: sizes.chunk,
        };
        let history = dev.alloc_mapped(sizes.history_words() * 4)?;
        let wsize = w.layers.first().map_or(4, |l| l.matrix_dtype().size());
        let (_, step_bytes) = weights::shard_bytes(&cfg, &plan, wsize);
        let state_bytes = sizes.bytes(&cfg);
        Ok(Model {
            no_allreduce: false,
            use_graph: true,
            load_bytes: 0,
            state_bytes,
            logits: vec![0.0; cfg.vocab],
            dev,
            cfg,
            plan,
            w,
            caches,
            kv_dtype,
            s,
            step,
            history,
            max_seq: sizes.max_seq,
            chunk: sizes.chunk,
            slots: sizes.slots,
            len: 0,
            state_len: 0,
            delta_len: sizes.delta,
            step_bytes,
            graph: None,
            batch_graphs: std::collections::HashMap::new(),
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

    /// Weight bytes this rank reads per decode step (its matrices; the embedding is only
    /// looked up): the numerator of the effective bandwidth.
    pub fn step_bytes(&self) -> u64 {
        self.step_bytes
    }

    /// The largest message this model passes to [`Collectives::allreduce`], in bytes (f32):
    /// a prefill chunk of hidden states or the full-vocab logits of [`Model::prefill`].
    pub fn max_allreduce_bytes(&self) -> usize {
        let cands = self.slots * self.plan.world * 2 * TOPK_MAX;
        (self.chunk * self.cfg.hidden)
            .max(self.cfg.vocab)
            .max(cands)
            * 4
    }

    /// The full-vocab f32 logits of the last [`Model::prefill`] or [`Model::step`]
    /// (identical on every rank).
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    fn check_comm(&self, comm: &dyn Collectives<D>) -> Result<(), RankError> {
        if comm.rank() != self.plan.rank || comm.world() != self.plan.world {
            return Err(RankError::Model(format!(
                "the model was sharded for rank {} of {}, the communicator is rank {} of {}",
                self.plan.rank,
                self.plan.world,
                comm.rank(),
                comm.world()
            )));
        }
        Ok(())
    }

    /// Runs the prompt from position 0 in batched passes of up to `prefill_chunk` tokens,
    /// leaving the last position's vocab-shard logits in `s.logits` and the step state at
    /// (last token, its position).
    fn run_prompt(
        &mut self,
        comm: &mut dyn Collectives<D>,
        slot: usize,
        tokens: &[u32],
    ) -> Result<(), RankError> {
        self.check_comm(comm)?;
        if tokens.is_empty() {
            return Err(ModelError::Invalid("prefill of an empty prompt".into()).into());
        }
        if tokens.len() > self.max_seq {
            return Err(RankError::Model(format!(
                "a prompt of {} tokens does not fit the KV cache of {}",
                tokens.len(),
                self.max_seq
            )));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(RankError::Model(format!(
                "token id {t} is outside the vocab of {}",
                self.cfg.vocab
            )));
        }
        self.len = 0;
        self.reset_states()?;
        let chunks: Vec<&[u32]> = tokens.chunks(self.chunk).collect();
        for (i, c) in chunks.iter().enumerate() {
            let m = c.len();
            let rows: Vec<(u32, u32, u32)> = c
                .iter()
                .enumerate()
                .map(|(i, &t)| (t, (self.len + i) as u32, slot as u32))
                .collect();
            let (last_tok, last_pos, _) = rows[m - 1];
            let words = self.step.encode([last_tok, last_pos], &rows, 0);
            self.dev.write(&self.step.buf, 0, &words)?;
            let step = &self.step;
            let rows = Rows {
                m,
                ids: step.ids(m),
                pos: step.positions(m),
                slots: Slots::One(slot),
            };
            let last = i + 1 == chunks.len();
            self.forward(
                comm,
                &rows,
                if last { Logits::Last } else { Logits::None },
                false,
            )?;
            self.len += m;
        }
        self.state_len = self.len;
        Ok(())
    }

    /// Zeroes every DeltaNet layer's conv and recurrent state: a new sequence.
    fn reset_states(&self) -> Result<(), RankError> {
        let (nc, nr) = self.delta_len;
        for c in &self.caches {
            if let LayerCache::Delta(st) = c {
                for (b, n) in [(&st.conv, nc), (&st.rec, nr)] {
                    self.dev.run(&Op::Fill(ops::Fill {
                        dst: f32v(b, n),
                        value: 0.0,
                    }))?;
                }
            }
        }
        Ok(())
    }

    /// Starts a new sequence: runs the whole prompt and returns the full-vocab logits of its
    /// last position (gathered for the caller; [`Model::begin`] samples on the device
    /// instead).
    pub fn prefill(
        &mut self,
        comm: &mut dyn Collectives<D>,
        tokens: &[u32],
    ) -> Result<&[f32], RankError> {
        self.run_prompt(comm, 0, tokens)?;
        self.gather_logits(comm)?;
        Ok(&self.logits)
    }

    /// Runs one token at position `pos` (≤ the current length; a smaller `pos` rewinds the
    /// sequence there, except in a hybrid model, whose recurrent state cannot rewind) and
    /// returns the full-vocab logits.
    pub fn step(
        &mut self,
        comm: &mut dyn Collectives<D>,
        token: u32,
        pos: usize,
    ) -> Result<&[f32], RankError> {
        self.check_comm(comm)?;
        if pos > self.len || pos >= self.max_seq || token as usize >= self.cfg.vocab {
            return Err(RankError::Model(format!(
                "cannot run token {token} at position {pos}: {} cached, room for {} (KV \
                 cache), vocab {}",
                self.len, self.max_seq, self.cfg.vocab
            )));
        }
        if self.cfg.hybrid.is_some() && pos != self.state_len {
            return Err(RankError::Model(format!(
                "cannot run a token at position {pos}: the DeltaNet layers' recurrent state \
                 holds {} tokens and cannot rewind (start the sequence again)",
                self.state_len
            )));
        }
        self.dev
            .write(&self.step.buf, 0, &encode_u32(&[token, pos as u32]))?;
        self.run_step(comm, None)?;
        self.len = pos + 1;
        self.state_len = self.len;
        self.gather_logits(comm)?;
        Ok(&self.logits)
    }

    /// The single-token step on the step state: forward, and with `sample`, the candidate
    /// gather and the sampler (which advances the state).
    fn run_step(
        &self,
        comm: &mut dyn Collectives<D>,
        sample: Option<&SampleParams>,
    ) -> Result<(), RankError> {
        let rows = Rows {
            m: 1,
            ids: self.step.token(),
            pos: self.step.position(),
            slots: Slots::One(0),
        };
        self.forward(comm, &rows, Logits::Last, true)?;
        if let Some(p) = sample {
            self.sample(comm, &[self.sample_row(0, p, self.step.state(), 0)])?;
        }
        Ok(())
    }

    /// Logits row `row` sampled with `p` into `state`, and slot `slot`'s history.
    fn sample_row<'a>(
        &'a self,
        row: usize,
        p: &SampleParams,
        state: View<'a, D::Buf>,
        slot: usize,
    ) -> SampleRow<'a, D::Buf> {
        let n = self.max_seq + 1;
        SampleRow {
            row,
            params: *p,
            state,
            history: View::new(&self.history, slot * n * 4, n, DType::U32),
        }
    }

    /// Gathers this rank's best logits of each row with every other rank's (one allreduce
    /// for all rows) and picks each row's next token (its state ← (token, position + 1), its
    /// history[position + 1] ← token).
    fn sample(
        &self,
        comm: &mut dyn Collectives<D>,
        rows: &[SampleRow<'_, D::Buf>],
    ) -> Result<(), RankError> {
        let dev = &*self.dev;
        let (world, rank, vs) = (self.plan.world, self.plan.rank, self.plan.vocab.len());
        // Row r's candidates: every rank's k pairs back to back (rank q's at 2k·q) from
        // r · region. Only written pairs are gathered (a zero-filled pair would read as a
        // candidate of logit 0 for id 0); the allreduce covers up to the last row's.
        let region = world * 2 * TOPK_MAX;
        let seg = |p: &SampleParams| 2 * topk_for(p);
        let last = rows.last().expect("at least one row");
        let used = (rows.len() - 1) * region + world * seg(&last.params);
        let all = f32v(&self.s.cands, used);
        if world > 1 {
            dev.run(&Op::Fill(ops::Fill {
                dst: all,
                value: 0.0,
            }))?;
        }
        for (i, r) in rows.iter().enumerate() {
            let k = topk_for(&r.params);
            dev.run(&Op::ShardTopK(ops::ShardTopK {
                logits: View::new(&self.s.logits, r.row * vs * 4, vs, DType::F32),
                vocab_start: self.plan.vocab.start,
                k,
                out: View::new(
                    &self.s.cands,
                    (i * region + rank * 2 * k) * 4,
                    2 * k,
                    DType::F32,
                ),
            }))?;
        }
        if world > 1 && !self.no_allreduce {
            comm.allreduce(all)?;
        }
        for (i, r) in rows.iter().enumerate() {
            dev.run(&Op::Sample(ops::Sample {
                cands: View::new(
                    &self.s.cands,
                    i * region * 4,
                    world * seg(&r.params),
                    DType::F32,
                ),
                params: r.params,
                state: r.state,
                tokens: r.history,
            }))?;
        }
        Ok(())
    }

    /// Full-vocab logits of the last forward into `self.logits`: each rank writes its shard
    /// into a zero-filled vocab buffer and the allreduce of that buffer gathers them (exact).
    fn gather_logits(&mut self, comm: &mut dyn Collectives<D>) -> Result<(), RankError> {
        let dev = &*self.dev;
        let v = self.cfg.vocab;
        let shard = self.plan.vocab.clone();
        dev.run(&Op::Fill(ops::Fill {
            dst: f32v(&self.s.full_logits, v),
            value: 0.0,
        }))?;
        dev.run(&Op::Copy(ops::Copy {
            src: f32v(&self.s.logits, shard.len()),
            dst: View::new(
                &self.s.full_logits,
                shard.start * 4,
                shard.len(),
                DType::F32,
            ),
        }))?;
        if self.plan.world > 1 {
            comm.allreduce(f32v(&self.s.full_logits, v))?;
        }
        let mut bytes = vec![0u8; v * 4];
        dev.read(&self.s.full_logits, 0, &mut bytes)?;
        for (l, b) in self.logits.iter_mut().zip(bytes.chunks_exact(4)) {
            *l = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }

    /// Starts a new sequence: prefills `prompt` and samples the first new token on the
    /// device with `p` (identical on every rank).
    pub fn begin(
        &mut self,
        comm: &mut dyn Collectives<D>,
        prompt: &[u32],
        p: &SampleParams,
    ) -> Result<u32, RankError> {
        self.begin_in(comm, 0, prompt, p)
    }

    /// [`Model::begin`] in cache slot `slot` (< [`Model::slots`]), for a batch of sequences
    /// ([`Model::step_batch`]).
    pub fn begin_in(
        &mut self,
        comm: &mut dyn Collectives<D>,
        slot: usize,
        prompt: &[u32],
        p: &SampleParams,
    ) -> Result<u32, RankError> {
        if slot >= self.slots {
            return Err(RankError::Model(format!(
                "cache slot {slot} of {}",
                self.slots
            )));
        }
        self.run_prompt(comm, slot, prompt)?;
        self.sample(comm, &[self.sample_row(0, p, self.step.state(), slot)])?;
        let mark = self.dev.mark()?;
        self.dev.wait_mark(&mark)?;
        self.read_history(slot, self.len, 1)
    }

    /// Cache slots: the most sequences a batched step runs.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// One token for each of `rows` (sequences begun with [`Model::begin_in`] or here), and
    /// the first token of each of `starts` (new sequences, whose prompts are prefilled in the
    /// same pass): every row runs its token at its position in its own slot's cache, all in
    /// one forward (the matrix products take the rows together), and each sequence's next
    /// token is sampled with its own parameters. At most [`Model::slots`] sequences in
    /// distinct slots, and at most the prefill chunk of rows in all (see
    /// [`Model::batch_room`]); prompts only for attention-only models. Returns the new tokens
    /// of `rows`, then of `starts`, in order. A sequence's tokens do not depend on the others
    /// (on the CPU backend, bitwise the tokens of [`Model::begin`] and [`Model::decode`]).
    pub fn step_batch(
        &mut self,
        comm: &mut dyn Collectives<D>,
        rows: &[BatchRow],
        starts: &[BatchStart<'_>],
    ) -> Result<Vec<u32>, RankError> {
        self.check_comm(comm)?;
        let (n, p) = (rows.len(), starts.len());
        let prompt_rows: usize = starts.iter().map(|s| s.prompt.len()).sum();
        let m = n + prompt_rows;
        let mut seen = vec![false; self.slots];
        let mut fresh =
            |slot: usize| slot < self.slots && !std::mem::replace(&mut seen[slot], true);
        for r in rows {
            if !fresh(r.slot) || r.pos >= self.max_seq || r.token as usize >= self.cfg.vocab {
                return Err(RankError::Model(format!(
                    "cannot run token {} at position {} in slot {}: {} slots (each once), \
                     room for {} (KV cache), vocab {}",
                    r.token, r.pos, r.slot, self.slots, self.max_seq, self.cfg.vocab
                )));
            }
        }
        for st in starts {
            let bad = |why: String| {
                Err(RankError::Model(format!(
                    "a prompt in slot {}: {why}",
                    st.slot
                )))
            };
            if !fresh(st.slot) {
                return bad(format!("{} slots, each used once", self.slots));
            }
            if st.prompt.is_empty() || st.prompt.len() > self.max_seq {
                return bad(format!(
                    "{} tokens (the KV cache holds {})",
                    st.prompt.len(),
                    self.max_seq
                ));
            }
            if let Some(&t) = st.prompt.iter().find(|&&t| t as usize >= self.cfg.vocab) {
                return bad(format!(
                    "token id {t} is outside the vocab of {}",
                    self.cfg.vocab
                ));
            }
        }
        if p > 0 && self.cfg.hybrid.is_some() {
            return Err(RankError::Model(
                "a hybrid model's prompts are prefilled alone (Model::begin_in)".into(),
            ));
        }
        if m > self.chunk {
            return Err(RankError::Model(format!(
                "{m} rows in one step: at most {} (the prefill chunk)",
                self.chunk
            )));
        }
        if m == 0 {
            return Ok(Vec::new());
        }
        // Rows: the running sequences' tokens, then each prompt's last token (these n + p rows
        // get logits and a sampled token), then the prompts' other tokens. The cache append of
        // every row comes before any row's attention, so a prompt's rows may be in any order.
        let mut order: Vec<(u32, usize, usize)> =
            rows.iter().map(|r| (r.token, r.pos, r.slot)).collect();
        for st in starts {
            let last = st.prompt.len() - 1;
            order.push((st.prompt[last], last, st.slot));
        }
        for st in starts {
            let last = st.prompt.len() - 1;
            order.extend(
                st.prompt[..last]
                    .iter()
                    .enumerate()
                    .map(|(i, &t)| (t, i, st.slot)),
            );
        }
        let step_rows: Vec<(u32, u32, u32)> = order
            .iter()
            .map(|&(t, pos, slot)| (t, pos as u32, slot as u32))
            .collect();
        let words = self.step.encode([0, 0], &step_rows, n + p);
        self.dev.write(&self.step.buf, 0, &words)?;
        // The forward reads every row's token, position and slot from the step buffer, so a
        // decode-only step (no prompts) of m rows is one graph whatever the rows are: captured
        // the first time m rows run, replayed after. The sampling below stays direct: its
        // launches name each row's slot history and parameters.
        // (Attention-only models: a hybrid's recurrent state is one sequence's.)
        let capturable = p == 0
            && self.use_graph
            && self.cfg.hybrid.is_none()
            && comm.capturable(m * self.cfg.hidden * 4);
        if capturable && !self.batch_graphs.contains_key(&m) {
            tracing::debug!("step_batch: capturing the forward of {m} rows");
            let fwd = self.batch_rows(m);
            let (captured, held) = self.capture_step(comm, &mut |this, comm| {
                this.forward(comm, &fwd, Logits::First(m), true)
            });
            // A failed capture costs only speed: such steps run directly (and report any
            // error that is not the capture's own).
            let graph = match captured {
                Ok(g) => g.map(|g| (g, held)),
                Err(e) => {
                    tracing::warn!("step_batch: {m} rows run without a graph: {e}");
                    None
                }
            };
            self.batch_graphs.insert(m, graph);
        }
        match self.batch_graphs.get(&m).filter(|_| capturable) {
            Some(Some((g, held))) => {
                self.dev.replay(g)?;
                comm.set_epoch(comm.epoch().wrapping_add(*held));
            }
            _ => self.forward(comm, &self.batch_rows(m), Logits::First(n + p), true)?,
        }
        let step = &self.step;
        let params = rows
            .iter()
            .map(|r| r.params)
            .chain(starts.iter().map(|s| s.params));
        let sample: Vec<_> = order
            .iter()
            .zip(params)
            .enumerate()
            .map(|(i, (&(_, _, slot), p))| self.sample_row(i, &p, step.pair(i), slot))
            .collect();
        self.sample(comm, &sample)?;
        let mark = self.dev.mark()?;
        self.dev.wait_mark(&mark)?;
        order[..n + p]
            .iter()
            .map(|&(_, pos, slot)| self.read_history(slot, pos + 1, pos + 1))
            .collect()
    }

    /// Captures what `step` queues as one device graph, without running it. Capturing
    /// queues nothing, so the communicator's epoch is put back where it was; returns the
    /// capture's outcome and how many allreduces the graph holds (what each replay must add
    /// to the epoch).
    fn capture_step(
        &self,
        comm: &mut dyn Collectives<D>,
        step: StepFn<'_, Self, D>,
    ) -> (tprun_kernels::Result<Option<D::Graph>>, u32) {
        let e0 = comm.epoch();
        let captured = self.dev.capture(&mut || {
            step(self, comm).map_err(|e| match e {
                RankError::Kernel(k) => k,
                other => tprun_kernels::KernelError::Backend(other.to_string()),
            })
        });
        let held = comm.epoch().wrapping_sub(e0);
        comm.set_epoch(e0);
        (captured, held)
    }

    /// The first `m` rows of the step buffer, each in the cache slot its id says.
    fn batch_rows(&self, m: usize) -> Rows<'_, D::Buf> {
        Rows {
            m,
            ids: self.step.ids(m),
            pos: self.step.positions(m),
            slots: Slots::Each(self.step.slot_ids(m)),
        }
    }

    /// Whether a batched step of `rows` sequences can also prefill new prompts of
    /// `prompt_tokens` tokens in all ([`Model::step_batch`]'s `starts`).
    pub fn batch_room(&self, rows: usize, prompt_tokens: usize) -> bool {
        self.cfg.hybrid.is_none() && rows + prompt_tokens <= self.chunk
    }

    /// The token the sampler stored for `position` of slot `slot`, the `n`th generated one
    /// (named in the error when the sampler found the logits not finite).
    fn read_history(&self, slot: usize, position: usize, n: usize) -> Result<u32, RankError> {
        let mut b = [0u8; 4];
        let at = slot * (self.max_seq + 1) + position;
        self.dev.read_mapped(&self.history, at * 4, &mut b)?;
        let t = decode_u32(&b)[0];
        if t == ops::NO_TOKEN {
            return Err(not_finite(n, position));
        }
        Ok(t)
    }

    /// Generates after [`Model::begin`]: runs single-token steps (replays of one captured
    /// graph where the device has graphs and every allreduce of the step can be captured),
    /// calling `on_token(token)` for each new token, until `on_token` returns `false` or
    /// `max` steps ran. Each step's token is read from host-mapped memory while the next
    /// step is already queued, so the host never stalls the device between tokens; one step
    /// past the last one read may have run (its cache row is beyond `len`).
    pub fn decode(
        &mut self,
        comm: &mut dyn Collectives<D>,
        p: &SampleParams,
        max: usize,
        on_token: &mut dyn FnMut(u32) -> Result<bool, RankError>,
    ) -> Result<DecodeInfo, RankError> {
        self.check_comm(comm)?;
        // The last step must have a cache row: position len + steps − 1 < max_seq.
        let max = max.min(self.max_seq.saturating_sub(self.len));
        let mut info = DecodeInfo::default();
        if max == 0 {
            return Ok(info);
        }
        let capturable = comm.capturable(self.cfg.hidden * 4)
            && comm.capturable(self.plan.world * 2 * TOPK_MAX * 4);
        if self.use_graph && capturable && self.graph.as_ref().is_none_or(|g| g.2 != *p) {
            self.graph = None;
            let l0 = self.dev.launches();
            tracing::debug!("decode: capturing the step");
            let (captured, n) =
                self.capture_step(comm, &mut |this, comm| this.run_step(comm, Some(p)));
            self.graph = captured?.map(|g| (g, n, *p));
            info.launches = self.dev.launches() - l0;
            tracing::debug!(
                "decode: captured: {}, {n} allreduces, {} launches",
                self.graph.is_some(),
                info.launches
            );
        }
        info.graph = self.graph.is_some();
        let queue = |this: &Self, comm: &mut dyn Collectives<D>| -> Result<D::Mark, RankError> {
            match &this.graph {
                Some((g, n, _)) => {
                    this.dev.replay(g)?;
                    comm.set_epoch(comm.epoch().wrapping_add(*n));
                }
                None => this.run_step(comm, Some(p))?,
            }
            Ok(this.dev.mark()?)
        };
        let e0 = comm.epoch();
        // Every queued step advances the recurrent states, including one past the stop:
        // counted as each is queued, so that an error on the way leaves the count exact.
        let mut pending = std::collections::VecDeque::new();
        let l0 = self.dev.launches();
        pending.push_back(queue(self, comm)?);
        self.state_len += 1;
        if self.graph.is_none() {
            info.launches = self.dev.launches() - l0;
        }
        let mut done = 0;
        while let Some(mark) = pending.pop_front() {
            if done + pending.len() + 1 < max {
                pending.push_back(queue(self, comm)?);
                self.state_len += 1;
            }
            self.dev.wait_mark(&mark)?;
            done += 1;
            self.len += 1;
            let t = self.read_history(0, self.len, done + 1)?;
            if done <= 3 {
                tracing::debug!("decode: step {done} done: token {t}");
            }
            if !on_token(t)? {
                break;
            }
        }
        info.allreduces = if done > 0 {
            comm.epoch().wrapping_sub(e0) / (done + pending.len()) as u32
        } else {
            0
        };
        // A step queued past the stop still runs; wait for it so the caller sees a quiet
        // device (and its cache row is simply beyond `len`).
        for m in pending {
            self.dev.wait_mark(&m)?;
        }
        tracing::debug!("decode: {done} steps done");
        Ok(info)
    }

    /// The forward pass of `rows` (ids and positions in device memory), writing their K/V
    /// into the cache; with `logits`, the last row's vocab-shard logits into `s.logits`.
    /// `single` marks the one-token step (attention may split the sequence).
    fn forward(
        &self,
        comm: &mut dyn Collectives<D>,
        rows: &Rows<'_, D::Buf>,
        logits: Logits,
        single: bool,
    ) -> Result<(), RankError> {
        let (dev, cfg, plan, w, s) = (&*self.dev, &self.cfg, &self.plan, &self.w, &self.s);
        let m = rows.m;
        let world = plan.world;
        let h = cfg.hidden;
        let ni = plan.inter.len();
        let eps = cfg.rms_eps;
        let x = f32v(&s.x, m * h);
        let xb = f32v(&s.xb, m * h);
        let o = f32v(&s.o, m * h);

        // x = embed_tokens(ids): each rank looks up its vocab rows, the allreduce sums them.
        dev.run(&Op::Embedding(ops::Embedding {
            table: w.embed.view(),
            vocab_start: plan.vocab.start,
            ids: rows.ids,
            hidden: h,
            out: x,
        }))?;
        let world = if self.no_allreduce { 1 } else { world };
        if world > 1 {
            comm.allreduce(x)?;
        }
        // xb = input_layernorm(x) of the first layer; later layers get theirs from the
        // previous layer's closing add + norm.
        dev.run(&Op::RmsNorm(ops::RmsNorm {
            x,
            w: w.layers[0].attn_norm.view(),
            out: xb,
            rows: m,
            dim: h,
            eps,
        }))?;
        // The seam after each row-parallel projection: x = x + allreduce(o); xb = norm(x) ·
        // next_norm, one fused kernel. With no allreduce (world 1) it is one add + norm
        // kernel, or, where the next projection is narrow (n ≤ 2h: q|k|v), it is left pending
        // and folded into that projection (ops::AddNormMatmul), which writes the new residual
        // into the other of two buffers (every block of it reads all of the old one). The
        // fold saves a launch tail (~1.7 µs under PDL) but every wave of the GEMV then reads
        // x, delta and the norm weights, which grows with n: on the H200 it gains on q|k|v
        // and loses ~4 µs per call on gate|up and the LM head (docs/perf-notes.md).
        let fold = world == 1;
        let folds = |n: usize| fold && n <= 2 * h;
        let xs = [x, f32v(&s.x2, m * h)];
        let mut cur = 0; // xs[cur] holds the residual stream
                         // `next_n`: the output width of the projection that reads xb next, or
                         // `None` where it cannot fold (gate|up: AddNormMatmul has no SiluMul epilogue).
        let seam = |comm: &mut dyn Collectives<D>, next_norm, cur: usize, next_n: Option<usize>| {
            if next_n.is_some_and(folds) {
                return Ok::<_, RankError>(Some(next_norm));
            }
            let e = AddNorm {
                x: xs[cur],
                w: next_norm,
                out: xb,
                rows: m,
                dim: h,
                eps,
            };
            if fold {
                dev.run(&Op::AddRmsNorm(e.op(o)))?;
            } else {
                comm.allreduce_add_norm(o, e)?;
            }
            Ok(None)
        };
        // y = xb · wᵀ (+ bias), with a pending seam folded in (the product then reads the
        // residual xs[cur] and o, and writes their sum to the other buffer); with `rope`, one
        // token's q|k|v product doing QkvRope's work in its epilogue instead (ops::QkvMatmul).
        let project = |pending: Option<View<'_, D::Buf>>,
                       cur: &mut usize,
                       wt: View<'_, D::Buf>,
                       bias: Option<View<'_, D::Buf>>,
                       y: View<'_, D::Buf>,
                       n: usize,
                       rope: Option<ops::QkvRope<'_, D::Buf>>|
         -> Result<(), RankError> {
            let seam = pending.map(|norm_w| ops::Seam {
                delta: o,
                norm_w,
                x_out: Some(xs[1 - *cur]),
                eps,
            });
            let x = if seam.is_some() { xs[*cur] } else { xb };
            dev.run(&match rope {
                Some(rope) => Op::QkvMatmul(ops::QkvMatmul {
                    x,
                    seam,
                    w: wt,
                    bias,
                    k: h,
                    rope,
                }),
                None => ops::seam_matmul(x, seam, wt, bias, y, m, h, n),
            })?;
            if seam.is_some() {
                *cur = 1 - *cur;
            }
            Ok(())
        };
        // x = x + o; xb = norm(x) · norm_w: a pending seam settled on its own, before a
        // product it cannot fold into.
        let settle = |pending: Option<View<'_, D::Buf>>, cur: usize| -> Result<(), RankError> {
            if let Some(norm_w) = pending {
                dev.run(&Op::AddRmsNorm(ops::AddRmsNorm {
                    x: xs[cur],
                    delta: o,
                    w: norm_w,
                    out: xb,
                    rows: m,
                    dim: h,
                    eps,
                }))?;
            }
            Ok(())
        };
        let mut pending = None;
        let nl = w.layers.len();
        for (l, (lw, cache)) in w.layers.iter().zip(&self.caches).enumerate() {
            // The mixer's input projection, fused at load from `blocks` (attention: q|k|v,
            // and Qwen3.5's gate; DeltaNet: in_proj qkv|z|b|a) into s.qkv: one product,
            // into which a pending seam folds, where it is one (a single block, or a single
            // row); else the seam is settled first, since each block's product reads xb.
            let (wt, bias) = match &lw.mixer {
                Mixer::Attention(aw) => (&aw.wqkv, aw.bqkv.as_ref()),
                Mixer::Delta(dw) => (&dw.w_in, None),
            };
            let blocks = self.in_blocks(&lw.mixer);
            let n: usize = blocks.iter().sum();
            // One token's attention whose QkvRope needs nothing across a head and whose
            // projection is q|k|v alone (no output gate block): the product does that work in
            // its epilogue, and attention finds q and the cache rows written.
            let rope = match (&lw.mixer, cache) {
                (Mixer::Attention(aw), LayerCache::Kv(kv))
                    if m == 1 && blocks.len() == 1 && self.rope_folds(aw) =>
                {
                    Some(self.qkv_rope(aw, kv, rows))
                }
                _ => None,
            };
            let roped = rope.is_some();
            if m == 1 || blocks.len() == 1 {
                let y = f32v(&s.qkv, m * n);
                project(
                    pending.take(),
                    &mut cur,
                    wt.view(),
                    bias.map(|b| b.view()),
                    y,
                    n,
                    rope,
                )?;
            } else {
                settle(pending.take(), cur)?;
                self.fused_matmul(xb, wt, h, &blocks, &s.qkv, m)?;
            }
            // o = this rank's partial of the mixer's output projection
            match (&lw.mixer, cache) {
                (Mixer::Attention(aw), LayerCache::Kv(kv)) => {
                    self.attention(aw, kv, rows, single, roped)?
                }
                (Mixer::Delta(dw), LayerCache::Delta(st)) => self.delta(dw, st, m)?,
                _ => unreachable!("each layer's cache is allocated for its mixer"),
            }
            // x = x + allreduce(o); xb = post_attention_layernorm(x), settled here: gate|up
            // is too wide for the fold to pay, and takes the SiluMul epilogue instead (next_n
            // None: never pending).
            seam(comm, lw.ffn_norm.view(), cur, None)?;
            // hb = silu(gate_proj(xb)) · up_proj(xb), in gate|up's epilogue (dense and int4):
            // the activation is computed once per element, not by every block of down_proj
            // that reads it, and down_proj reads an input half as wide.
            let hb = f32v(&s.hb, m * ni);
            self.matmul(xb, &lw.w_gate_up, hb, m, Epilogue::SiluMul)?;
            // x = x + allreduce(down_proj(hb)); xb = the next layer's input_layernorm(x), or
            // the final norm after the last layer.
            self.matmul(hb, &lw.w_down, o, m, Epilogue::None)?;
            let next = if l + 1 < nl {
                w.layers[l + 1].attn_norm.view()
            } else {
                w.norm.view()
            };
            // The next layer's input projection (its blocks side by side), or the LM head.
            let next_n = match w.layers.get(l + 1) {
                Some(next) => self.in_blocks(&next.mixer).iter().sum(),
                None => plan.vocab.len(),
            };
            pending = seam(comm, next, cur, Some(next_n))?;
        }
        // logits[vocab shard] = lm_head(norm(x)) of the last position, or of every row
        let (first, lm) = match logits {
            Logits::None => return Ok(()),
            Logits::Last => (m - 1, 1),
            Logits::First(k) => (0, k),
        };
        let vs = plan.vocab.len();
        let (head, y) = (w.head().view(), f32v(&s.logits, lm * vs));
        let seam = pending.map(|norm_w| ops::Seam {
            delta: o.slice(first * h, lm * h),
            norm_w,
            x_out: None,
            eps,
        });
        let x = if seam.is_some() { xs[cur] } else { xb }.slice(first * h, lm * h);
        dev.run(&ops::seam_matmul(x, seam, head, None, y, lm, h, vs))?;
        Ok(())
    }

    /// `y = g(x · wᵀ)` for `m` rows of a dense or int4 weight (`Op::Matmul` or
    /// `Op::MatmulInt4`), `g` as `epilogue` says; the shapes the weight's.
    fn matmul(
        &self,
        x: View<'_, D::Buf>,
        w: &Matrix<D::Buf>,
        y: View<'_, D::Buf>,
        m: usize,
        epilogue: Epilogue,
    ) -> Result<(), RankError> {
        let op = match w {
            Matrix::Dense(t) => {
                let n = match epilogue {
                    Epilogue::None => y.len / m,
                    Epilogue::SiluMul => 2 * y.len / m,
                };
                Op::Matmul(ops::Matmul {
                    x,
                    w: t.view(),
                    bias: None,
                    y,
                    m,
                    k: t.len / n,
                    n,
                    prologue: Prologue::None,
                    epilogue,
                })
            }
            Matrix::Int4(q) => {
                // q.n counts the rows read (gate and up with the epilogue).
                let u32v = |b, len| View::new(b, 0, len, DType::U32);
                let kq = q.groups * q.group;
                Op::MatmulInt4(ops::MatmulInt4 {
                    x,
                    qweight: u32v(&q.qweight, q.n * kq / 8),
                    scales: View::new(&q.scales, 0, q.n * q.groups, DType::F16),
                    zeros: u32v(&q.zeros, q.n * q.groups.div_ceil(8)),
                    perm: q.perm.as_ref().map(|p| u32v(p, kq)),
                    y,
                    m,
                    k: q.k,
                    n: q.n,
                    group: q.group,
                    groups: q.groups,
                    prologue: Prologue::None,
                    epilogue,
                })
            }
        };
        self.dev.run(&op)?;
        Ok(())
    }

    /// The widths of the blocks a mixer's input projection was fused from at load, in order:
    /// attention [q|k|v] (and Qwen3.5's gate, nq), DeltaNet [qkv (its conv channels) | z | b |
    /// a].
    fn in_blocks(&self, mixer: &Mixer<D::Buf>) -> Vec<usize> {
        let (cfg, plan) = (&self.cfg, &self.plan);
        let d = cfg.head_dim;
        let (nq, nkv) = (plan.q_heads.len() * d, plan.kv_heads.len() * d);
        match (mixer, &cfg.hybrid) {
            (Mixer::Attention(_), Some(hy)) if hy.attn_gate => vec![nq + 2 * nkv, nq],
            (Mixer::Attention(_), _) => vec![nq + 2 * nkv],
            (Mixer::Delta(_), hy) => {
                let hy = hy.as_ref().expect("a DeltaNet layer is a hybrid's");
                let (nk, nv) = (plan.lin_k_heads.len(), plan.lin_v_heads.len());
                let vd = nv * hy.dv;
                vec![2 * nk * hy.dk + vd, vd, nv, nv]
            }
        }
    }

    /// `y = x · wᵀ` for `m` rows and a weight fused at load from row blocks of widths `ns`,
    /// one product per block over that block's rows of the weight, so that block p of the
    /// output is its own [m, ns[p]] matrix at element m·(ns[0] + … + ns[p−1]) of `y`,
    /// contiguous for the op that reads it. (For one row that is the fused product's row
    /// itself, which `forward` then runs as one product.)
    fn fused_matmul(
        &self,
        x: View<'_, D::Buf>,
        w: &Tensor<D::Buf>,
        k: usize,
        ns: &[usize],
        y: &D::Buf,
        m: usize,
    ) -> Result<(), RankError> {
        let mut off = 0;
        let blocks: Vec<(usize, usize)> = ns
            .iter()
            .map(|&b| {
                off += b;
                (off - b, b)
            })
            .collect();
        for (off, b) in blocks {
            self.dev.run(&Op::Matmul(ops::Matmul {
                x,
                w: View::new(&w.buf, off * k * w.dtype.size(), b * k, w.dtype),
                bias: None,
                y: View::new(y, m * off * 4, m * b, DType::F32),
                m,
                k,
                n: b,
                prologue: Prologue::None,
                epilogue: Epilogue::None,
            }))?;
        }
        Ok(())
    }

    /// Whether a layer's QkvRope needs nothing across a head, so that one token's q|k|v
    /// product can do it in its epilogue (ops::QkvMatmul): no q/k norm, RoPE over whole heads
    /// (Llama, Mistral, Qwen2; not Qwen3 or Qwen3.5).
    fn rope_folds(&self, aw: &AttnWeights<D::Buf>) -> bool {
        aw.q_norm.is_none() && self.cfg.rotary_dim() == self.cfg.head_dim
    }

    /// Everything between the q|k|v product (in `s.qkv`) and attention for `rows`: q =
    /// rope(q_norm(q)) into `s.q`; cache[pos] = rope(k_norm(k)), v   (norms: Qwen3, Qwen3.5;
    /// Qwen3.5 rotates only the first rotary_dim dims of each head).
    fn qkv_rope<'v>(
        &'v self,
        aw: &'v AttnWeights<D::Buf>,
        kv: &'v KvCache<D::Buf>,
        rows: &Rows<'v, D::Buf>,
    ) -> ops::QkvRope<'v, D::Buf> {
        let (cfg, plan, s) = (&self.cfg, &self.plan, &self.s);
        let (kvt, cap, m) = (self.kv_dtype, self.max_seq, rows.m);
        let (d, rd) = (cfg.head_dim, cfg.rotary_dim());
        let (nqh, nkvh) = (plan.q_heads.len(), plan.kv_heads.len());
        let (nq, nkv) = (nqh * d, nkvh * d);
        // One sequence's rows: its slot's share of the cache. A batched step's rows: the
        // whole cache, each row in the slot its id says.
        let (base, len, slots) = match rows.slots {
            Slots::One(slot) => (slot * cap * nkv, cap * nkv, None),
            Slots::Each(ids) => (
                0,
                self.slots * cap * nkv,
                Some(ops::CacheSlots {
                    ids,
                    count: self.slots,
                }),
            ),
        };
        let cache = |b| View::new(b, base * kvt.size(), len, kvt);
        ops::QkvRope {
            qkv: f32v(&s.qkv, m * (nq + 2 * nkv)),
            q: f32v(&s.q, m * nq),
            k_cache: cache(&kv.k),
            v_cache: cache(&kv.v),
            pos: rows.pos,
            slots,
            inv_freq: f32v(&s.inv_freq, rd / 2),
            q_norm: aw.q_norm.as_ref().map(|t| t.view()),
            k_norm: aw.k_norm.as_ref().map(|t| t.view()),
            eps: cfg.rms_eps,
            rows: m,
            heads: nqh,
            kv_heads: nkvh,
            head_dim: d,
            rotary_dim: rd,
        }
    }

    /// Attention of `rows` from `s.qkv` (or, `roped`, from q and the cache rows that
    /// ops::QkvMatmul wrote), writing their K/V into `kv`, leaving o_proj's partial output in
    /// `s.o`.
    fn attention(
        &self,
        aw: &AttnWeights<D::Buf>,
        kv: &KvCache<D::Buf>,
        rows: &Rows<'_, D::Buf>,
        single: bool,
        roped: bool,
    ) -> Result<(), RankError> {
        let (dev, cfg, plan, s) = (&*self.dev, &self.cfg, &self.plan, &self.s);
        let (cap, m) = (self.max_seq, rows.m);
        let (h, d) = (cfg.hidden, cfg.head_dim);
        let (nqh, nkvh) = (plan.q_heads.len(), plan.kv_heads.len());
        let (nq, nkv) = (nqh * d, nkvh * d);
        // s.qkv holds [q | k | v] (then the gate block): `forward` ran the projection.
        let wqkv = nq + 2 * nkv;
        let gated = cfg.hybrid.as_ref().is_some_and(|hy| hy.attn_gate);
        let r = self.qkv_rope(aw, kv, rows);
        let (k_cache, v_cache, slots) = (r.k_cache, r.v_cache, r.slots);
        if !roped {
            dev.run(&Op::QkvRope(r))?;
        }
        // att = softmax(q·kᵀ / √d + causal mask) · v (· sigmoid(gate), Qwen3.5's output
        // gate); a single token, or a batch of them (one each), may split each sequence
        // across blocks.
        let att = f32v(&s.att, m * nq);
        // (its workspace holds one query per cache slot)
        let split = single && (m == 1 || (slots.is_some() && m <= self.slots));
        dev.run(&Op::Attention(ops::Attention {
            q: f32v(&s.q, m * nq),
            k_cache,
            v_cache,
            out: att,
            gate: gated.then(|| View::new(&s.qkv, m * wqkv * 4, m * nq, DType::F32)),
            pos: rows.pos,
            slots,
            rows: m,
            heads: nqh,
            kv_heads: nkvh,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            workspace: split.then(|| {
                f32v(
                    &s.attn_ws,
                    ops::Attention::<D::Buf>::workspace_len(m, nqh, d, cap),
                )
            }),
        }))?;
        // o = o_proj(att)
        dev.run(&Op::Matmul(ops::Matmul {
            x: att,
            w: aw.wo.view(),
            bias: None,
            y: f32v(&s.o, m * h),
            m,
            k: nq,
            n: h,
            prologue: Prologue::None,
            epilogue: Epilogue::None,
        }))?;
        Ok(())
    }

    /// A gated DeltaNet (transformers' `Qwen3_5GatedDeltaNet`) over `m` rows of `s.xb`, in
    /// order through the sequence's conv and recurrent state `st`, leaving out_proj's partial
    /// output in `s.o`.
    fn delta(
        &self,
        dw: &DeltaWeights<D::Buf>,
        st: &DeltaState<D::Buf>,
        m: usize,
    ) -> Result<(), RankError> {
        let (dev, cfg, plan, s) = (&*self.dev, &self.cfg, &self.plan, &self.s);
        let hy = cfg.hybrid.as_ref().expect("a DeltaNet layer is a hybrid's");
        let h = cfg.hidden;
        let (nk, nv) = (plan.lin_k_heads.len(), plan.lin_v_heads.len());
        let c = 2 * nk * hy.dk + nv * hy.dv;
        let vd = nv * hy.dv;
        // s.qkv holds [qkv | z | b | a] = [in_proj_qkv | in_proj_z | in_proj_b |
        // in_proj_a](xb), as blocks: `forward` ran the projection.
        let block = |at: usize, n: usize| View::new(&s.qkv, m * at * 4, m * n, DType::F32);
        let (z, b, a) = (block(c, vd), block(c + vd, nv), block(c + vd + nv, nv));
        // qkv = silu(conv1d([past inputs, qkv]))   (depthwise, causal)
        let conv = f32v(&s.conv, m * c);
        dev.run(&Op::CausalConv(ops::CausalConv {
            x: block(0, c),
            w: dw.conv.view(),
            state: f32v(&st.conv, self.delta_len.0),
            out: conv,
            rows: m,
            channels: c,
            kernel: hy.conv_kernel,
        }))?;
        // att = the gated delta rule over S (q, k L2-normed; β = σ(b);
        // g = −exp(A_log)·softplus(a + dt_bias))
        let att = f32v(&s.att, m * vd);
        dev.run(&Op::GatedDelta(ops::GatedDelta {
            qkv: conv,
            b,
            a,
            a_log: dw.a_log.view(),
            dt_bias: dw.dt_bias.view(),
            state: f32v(&st.rec, self.delta_len.1),
            out: att,
            rows: m,
            k_heads: nk,
            v_heads: nv,
            dk: hy.dk,
            dv: hy.dv,
        }))?;
        // att = norm(att) · silu(z)   per value head (folded into gated_delta's last block
        // per head it measured level: docs/perf-notes.md, 2026-12-06)
        dev.run(&Op::GatedRmsNorm(ops::GatedRmsNorm {
            x: att,
            z,
            w: dw.norm.view(),
            out: att,
            rows: m * nv,
            dim: hy.dv,
            eps: cfg.rms_eps,
        }))?;
        // o = out_proj(att)
        dev.run(&Op::Matmul(ops::Matmul {
            x: att,
            w: dw.w_out.view(),
            bias: None,
            y: f32v(&s.o, m * h),
            m,
            k: vd,
            n: h,
            prologue: Prologue::None,
            epilogue: Epilogue::None,
        }))?;
        Ok(())
    }
}
