//! The arguments of every op [`crate::Op`] carries: one struct per op with its shape docs and
//! one `validate()` that checks lengths, dtypes and parameters once, in
//! [`crate::Device::run`], before any backend sees them. Backends then only bounds-check the
//! views against their buffers (that needs the buffer) and launch.
//!
//! Conventions: activations are f32; weights and the KV cache may be f32, f16 or bf16; token
//! ids, positions and step counters are u32 and live in device buffers, never in launch
//! arguments, so that one captured graph replays for every token. Shapes are written
//! `[rows, cols]`, row-major.
//!
//! Must not: touch memory (no backend types here).

use crate::{DType, KernelError, Result, View};

fn bad(op: &str, why: impl std::fmt::Display) -> KernelError {
    KernelError::Invalid(format!("{op}: {why}"))
}

/// `v` must hold exactly `len` elements of `dtype` (`None`: any float dtype).
fn expect<B>(
    op: &str,
    what: &str,
    v: &View<'_, B>,
    len: usize,
    dtype: Option<DType>,
) -> Result<()> {
    if v.len != len {
        return Err(bad(
            op,
            format!("{what} has {} elements, expected {len}", v.len),
        ));
    }
    match dtype {
        Some(d) if v.dtype != d => Err(bad(op, format!("{what} is {}, expected {d}", v.dtype))),
        None if !v.dtype.is_float() => Err(bad(op, format!("{what} must be f32, f16 or bf16"))),
        _ => Ok(()),
    }
}

/// Output `name` must share no byte with any of `inputs` (named), which the op reads while
/// its outputs are being written.
fn apart<B>(
    op: &str,
    name: &str,
    out: &View<'_, B>,
    inputs: &[(&str, &View<'_, B>)],
) -> Result<()> {
    match inputs.iter().find(|(_, v)| out.overlaps(v)) {
        Some((what, _)) => Err(bad(
            op,
            format!("{name} (against {what}) overlaps an input it is computed from"),
        )),
        None => Ok(()),
    }
}

/// An in-place op's output: exactly `input` (every backend reads an element before the same
/// thread writes it) or no byte of it (a shifted overlap would read elements already written).
fn in_place_or_apart<B>(
    op: &str,
    what: &str,
    out: &View<'_, B>,
    input: &View<'_, B>,
) -> Result<()> {
    let same = out.offset == input.offset && out.bytes() == input.bytes();
    if out.overlaps(input) && !same {
        return Err(bad(op, format!("{what} partly overlaps an input")));
    }
    Ok(())
}

/// A product's outputs against its inputs ([`Matmul`], [`AddNormMatmul`], and through them
/// [`QkvMatmul`]): every wave reads all of `x` (and `delta`) while others write, so `y` shares
/// no byte with `x`, `w`, `bias` or `delta`, and `x_out` none with `x`, `delta` or `y`.
fn product_apart<B>(
    op: &str,
    [x, w, y]: [&View<'_, B>; 3],
    bias: Option<&View<'_, B>>,
    delta: Option<&View<'_, B>>,
    x_out: Option<&View<'_, B>>,
) -> Result<()> {
    let mut reads = vec![("x", x)];
    reads.extend(delta.map(|d| ("delta", d)));
    let mut weights = vec![("w", w)];
    weights.extend(bias.map(|b| ("bias", b)));
    apart(op, "y", y, &[reads.as_slice(), &weights].concat())?;
    match x_out {
        Some(o) => apart(op, "x_out", o, &[reads.as_slice(), &[("y", y)]].concat()),
        None => Ok(()),
    }
}

const F32: Option<DType> = Some(DType::F32);
const U32: Option<DType> = Some(DType::U32);

/// `dst ← src`, converting between float dtypes if they differ (u32 only to u32). Same length.
pub struct Copy<'a, B> {
    pub src: View<'a, B>,
    pub dst: View<'a, B>,
}

impl<B> Copy<'_, B> {
    pub fn validate(&self) -> Result<()> {
        if self.src.len != self.dst.len {
            return Err(bad(
                "copy",
                format!("{} elements into {}", self.src.len, self.dst.len),
            ));
        }
        if (self.src.dtype == DType::U32) != (self.dst.dtype == DType::U32) {
            return Err(bad("copy", "u32 copies only to u32"));
        }
        Ok(())
    }
}

/// `out[i] = Σ_r inputs[r][i]`, summed in the order given with f32 accumulation, rounded once
/// to `out.dtype`. `out` may be one of the inputs. Float dtypes, all the same.
pub struct ReduceSum<'a, B> {
    pub inputs: &'a [View<'a, B>],
    pub out: View<'a, B>,
}

impl<B> ReduceSum<'_, B> {
    pub fn validate(&self) -> Result<()> {
        if self.inputs.is_empty() {
            return Err(bad("reduce_sum", "no inputs"));
        }
        for v in self.inputs {
            expect(
                "reduce_sum",
                "an input",
                v,
                self.out.len,
                Some(self.out.dtype),
            )?;
        }
        expect("reduce_sum", "out", &self.out, self.out.len, None)
    }
}

/// `dst[i] ← value` for every element (float dtypes; u32 takes `value as u32`).
pub struct Fill<'a, B> {
    pub dst: View<'a, B>,
    pub value: f32,
}

/// Embedding lookup in one vocab shard. `table`: [rows, hidden] (any float dtype) holding
/// vocab ids `vocab_start..vocab_start + rows`; `ids`: [m] u32 (device memory); `out`:
/// [m, hidden] f32. Row `i` of `out` is the table row of `ids[i]`, or zeros when that id lies
/// outside this shard (the sum over all shards is then the full lookup).
pub struct Embedding<'a, B> {
    pub table: View<'a, B>,
    pub vocab_start: usize,
    pub ids: View<'a, B>,
    pub hidden: usize,
    pub out: View<'a, B>,
}

impl<B> Embedding<'_, B> {
    pub fn validate(&self) -> Result<()> {
        if self.hidden == 0 || !self.table.len.is_multiple_of(self.hidden) {
            return Err(bad(
                "embedding",
                format!("table of {} is not rows of {}", self.table.len, self.hidden),
            ));
        }
        expect("embedding", "table", &self.table, self.table.len, None)?;
        expect("embedding", "ids", &self.ids, self.ids.len, U32)?;
        expect(
            "embedding",
            "out",
            &self.out,
            self.ids.len * self.hidden,
            F32,
        )
    }
}

/// RMSNorm over `rows` rows of `dim`: `out[r] = x[r] / sqrt(mean(x[r]²) + eps) · w`, with `x`,
/// `out`: [rows, dim] f32 (may be the same view), `w`: [dim] (any float dtype). Per-head q/k
/// norm is the same op with rows = tokens · heads and dim = head_dim.
pub struct RmsNorm<'a, B> {
    pub x: View<'a, B>,
    pub w: View<'a, B>,
    pub out: View<'a, B>,
    pub rows: usize,
    pub dim: usize,
    pub eps: f32,
}

impl<B> RmsNorm<'_, B> {
    pub fn validate(&self) -> Result<()> {
        let n = self.rows * self.dim;
        expect("rms_norm", "x", &self.x, n, F32)?;
        expect("rms_norm", "out", &self.out, n, F32)?;
        expect("rms_norm", "w", &self.w, self.dim, None)?;
        in_place_or_apart("rms_norm", "out", &self.out, &self.x)?;
        apart("rms_norm", "out", &self.out, &[("w", &self.w)])
    }
}

/// The residual add and the next block's norm in one pass: `x ← x + delta`, then
/// `out = rms_norm(x) · w`. `x`, `delta`, `out`: [rows, dim] f32 (`out` may be `delta`, not
/// `x`); `w`: [dim]. The GPU allreduce fuses the same epilogue into its reduce
/// ([`crate::comm::AllreduceArgs::add_norm`]).
pub struct AddRmsNorm<'a, B> {
    pub x: View<'a, B>,
    pub delta: View<'a, B>,
    pub w: View<'a, B>,
    pub out: View<'a, B>,
    pub rows: usize,
    pub dim: usize,
    pub eps: f32,
}

impl<B> AddRmsNorm<'_, B> {
    pub fn validate(&self) -> Result<()> {
        let n = self.rows * self.dim;
        expect("add_rms_norm", "x", &self.x, n, F32)?;
        expect("add_rms_norm", "delta", &self.delta, n, F32)?;
        expect("add_rms_norm", "out", &self.out, n, F32)?;
        expect("add_rms_norm", "w", &self.w, self.dim, None)?;
        in_place_or_apart("add_rms_norm", "out (against x)", &self.out, &self.x)?;
        in_place_or_apart(
            "add_rms_norm",
            "out (against delta)",
            &self.out,
            &self.delta,
        )?;
        in_place_or_apart("add_rms_norm", "x (against delta)", &self.x, &self.delta)?;
        apart("add_rms_norm", "out", &self.out, &[("w", &self.w)])?;
        apart("add_rms_norm", "x", &self.x, &[("w", &self.w)])
    }
}

/// Rotary position embedding, Hugging Face "rotate halves" convention, in place on `x`:
/// [rows, heads, head_dim] f32, row `r` at position `pos[r]` (`pos`: [rows] u32, device
/// memory). `inv_freq`: [head_dim / 2] f32 (theta and any `rope_scaling` already applied). For
/// `i < head_dim / 2`, with `a = pos · inv_freq[i]` in f32: `(x[i], x[i+h/2]) ←
/// (x[i]·cos a − x[i+h/2]·sin a, x[i+h/2]·cos a + x[i]·sin a)`.
pub struct Rope<'a, B> {
    pub x: View<'a, B>,
    pub inv_freq: View<'a, B>,
    pub pos: View<'a, B>,
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl<B> Rope<'_, B> {
    pub fn validate(&self) -> Result<()> {
        if !self.head_dim.is_multiple_of(2) {
            return Err(bad("rope", format!("odd head_dim {}", self.head_dim)));
        }
        expect(
            "rope",
            "x",
            &self.x,
            self.rows * self.heads * self.head_dim,
            F32,
        )?;
        expect("rope", "inv_freq", &self.inv_freq, self.head_dim / 2, F32)?;
        expect("rope", "pos", &self.pos, self.rows, U32)
    }
}

/// The gated delta rule of a Gated DeltaNet layer (Qwen3.5's `linear_attention`), `rows`
/// tokens one after another through one sequence's state, as transformers'
/// `torch_recurrent_gated_delta_rule` with the q/k L2 norm inside. Per row r and value head h
/// (key head kh = h / (v_heads / k_heads)):
///
/// - `qkv`: [rows, 2·k_heads·dk + v_heads·dv] f32, each row [q | k | v] (the causal conv's
///   output after SiLU); q_h = q[kh] / √(Σq² + 1e-6) / √dk, k_h = k[kh] / √(Σk² + 1e-6);
/// - `b`, `a`: [rows, v_heads] f32; β = σ(b), g = −exp(a_log[h]) · softplus(a + dt_bias[h]),
///   with `a_log`, `dt_bias`: [v_heads] f32;
/// - `state`: [v_heads, dk, dv] f32, S_h, read and written: S ← e^g·S; δ = β·(v_h − Sᵀk_h);
///   S ← S + k_h δᵀ; and `out`: [rows, v_heads, dv] f32 gets o = Sᵀq_h.
///
/// Rows are tokens of the same sequence in order, so a prompt run as one call leaves the state
/// that running its tokens one by one leaves.
///
/// `state` (and the weights) must not be written by the op queued just before this one: under
/// programmatic dependent launch the CUDA kernel reads them while that op still runs (the
/// model writes the state only here and in the fill that starts a sequence).
pub struct GatedDelta<'a, B> {
    pub qkv: View<'a, B>,
    pub b: View<'a, B>,
    pub a: View<'a, B>,
    pub a_log: View<'a, B>,
    pub dt_bias: View<'a, B>,
    pub state: View<'a, B>,
    pub out: View<'a, B>,
    pub rows: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
}

/// A Gated DeltaNet layer's short causal convolution, `rows` tokens in order: per channel c,
/// over the window [the `kernel − 1` previous inputs (from `state`), this row's `x`],
/// `out[r, c] = silu(Σ_j w[c, j] · window[j])` (depthwise, no bias, as Qwen3.5's `conv1d`),
/// then the window slides. `x`, `out`: [rows, channels] f32 (may not alias); `w`:
/// [channels, kernel] f32 (transformers' [channels, 1, kernel]); `state`: [channels,
/// kernel − 1] f32, oldest first, read and written (zeros at the start of a sequence).
///
/// `state` and `w` must not be written by the op queued just before this one, as in
/// [`GatedDelta`].
pub struct CausalConv<'a, B> {
    pub x: View<'a, B>,
    pub w: View<'a, B>,
    pub state: View<'a, B>,
    pub out: View<'a, B>,
    pub rows: usize,
    pub channels: usize,
    pub kernel: usize,
}

impl<B> CausalConv<'_, B> {
    pub fn validate(&self) -> Result<()> {
        if self.kernel < 2 || self.channels == 0 {
            return Err(bad(
                "causal_conv",
                format!("kernel {} over {} channels", self.kernel, self.channels),
            ));
        }
        let (n, c) = (self.rows * self.channels, self.channels);
        expect("causal_conv", "x", &self.x, n, F32)?;
        expect("causal_conv", "out", &self.out, n, F32)?;
        expect("causal_conv", "w", &self.w, c * self.kernel, F32)?;
        expect(
            "causal_conv",
            "state",
            &self.state,
            c * (self.kernel - 1),
            F32,
        )?;
        // out is written row by row while later rows of x are still to be read, and the
        // window after the last row as the state is read.
        let (x, w) = (("x", &self.x), ("w", &self.w));
        apart(
            "causal_conv",
            "out",
            &self.out,
            &[x, w, ("state", &self.state)],
        )?;
        apart("causal_conv", "state", &self.state, &[x, w])
    }
}

/// The gated RMSNorm that closes a Gated DeltaNet layer, per (row, head) of `dim` elements:
/// `out = x / √(mean(x²) + eps) · w · silu(z)`. `x`, `z`, `out`: [rows, dim] f32 (`rows`
/// counts every head of every token; out may be x); `w`: [head_dim] f32, where `dim` is the
/// head dim (plain weights, not zero-centred). `w` must not be written by the op queued just
/// before this one, as in [`GatedDelta`].
pub struct GatedRmsNorm<'a, B> {
    pub x: View<'a, B>,
    pub z: View<'a, B>,
    pub w: View<'a, B>,
    pub out: View<'a, B>,
    pub rows: usize,
    pub dim: usize,
    pub eps: f32,
}

impl<B> GatedRmsNorm<'_, B> {
    pub fn validate(&self) -> Result<()> {
        let n = self.rows * self.dim;
        if self.dim == 0 {
            return Err(bad("gated_rms_norm", "dim 0"));
        }
        expect("gated_rms_norm", "x", &self.x, n, F32)?;
        expect("gated_rms_norm", "z", &self.z, n, F32)?;
        expect("gated_rms_norm", "out", &self.out, n, F32)?;
        expect("gated_rms_norm", "w", &self.w, self.dim, F32)?;
        in_place_or_apart("gated_rms_norm", "out (against x)", &self.out, &self.x)?;
        in_place_or_apart("gated_rms_norm", "out (against z)", &self.out, &self.z)?;
        apart("gated_rms_norm", "out", &self.out, &[("w", &self.w)])
    }
}

/// The ε of the gated delta rule's q and k L2 norms (transformers' `l2norm`).
pub const DELTA_L2_EPS: f32 = 1e-6;

impl<B> GatedDelta<'_, B> {
    pub fn validate(&self) -> Result<()> {
        let (kh, vh, dk, dv) = (self.k_heads, self.v_heads, self.dk, self.dv);
        if kh == 0 || vh == 0 || dk == 0 || dv == 0 || vh % kh != 0 {
            return Err(bad(
                "gated_delta",
                format!("{vh} value heads over {kh} key heads, dk {dk}, dv {dv}"),
            ));
        }
        let width = 2 * kh * dk + vh * dv;
        expect("gated_delta", "qkv", &self.qkv, self.rows * width, F32)?;
        expect("gated_delta", "b", &self.b, self.rows * vh, F32)?;
        expect("gated_delta", "a", &self.a, self.rows * vh, F32)?;
        expect("gated_delta", "a_log", &self.a_log, vh, F32)?;
        expect("gated_delta", "dt_bias", &self.dt_bias, vh, F32)?;
        expect("gated_delta", "state", &self.state, vh * dk * dv, F32)?;
        expect("gated_delta", "out", &self.out, self.rows * vh * dv, F32)?;
        // The state is read once before any row and written once after the last; out is
        // written row by row while later rows' inputs are read.
        let reads = [
            ("qkv", &self.qkv),
            ("b", &self.b),
            ("a", &self.a),
            ("a_log", &self.a_log),
            ("dt_bias", &self.dt_bias),
        ];
        apart("gated_delta", "state", &self.state, &reads)?;
        apart(
            "gated_delta",
            "out",
            &self.out,
            &[&reads[..], &[("state", &self.state)]].concat(),
        )
    }
}

/// Everything between the fused q|k|v projection and attention, for `rows` tokens: splits
/// `qkv`: [rows, (heads + 2·kv_heads)·head_dim] f32 (this rank's q heads, then k heads, then
/// v heads) and, per head, applies the optional q/k RMSNorm (Qwen3; weights [head_dim]) and
/// RoPE at `pos[r]` over the head's first `rotary_dim` dims (all of them but in Qwen3.5's
/// partial RoPE: rotate-half pairs i with i + rotary_dim/2, `inv_freq`: [rotary_dim / 2], the
/// dims past rotary_dim kept); writes q to `q`: [rows, heads·head_dim] f32 and k, v to row
/// `pos[r]` of `k_cache`, `v_cache`: [cap, kv_heads·head_dim] (KV dtype, rounded once; with
/// `slots`, of row r's slot). Rows whose position is `cap` or more are not stored. The result
/// equals RmsNorm + Rope + Copy.
pub struct QkvRope<'a, B> {
    pub qkv: View<'a, B>,
    pub q: View<'a, B>,
    pub k_cache: View<'a, B>,
    pub v_cache: View<'a, B>,
    pub pos: View<'a, B>,
    /// Row r's cache slot (continuous batching; see [`CacheSlots`]); `None`: one sequence.
    pub slots: Option<CacheSlots<'a, B>>,
    pub inv_freq: View<'a, B>,
    pub q_norm: Option<View<'a, B>>,
    pub k_norm: Option<View<'a, B>>,
    pub eps: f32,
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
}

/// The cache slots of a batch of sequences: `k_cache` and `v_cache` hold `count` slots of
/// `cap` rows each (`cap` = their rows / `count`), and row r of the op uses slot `ids[r]`
/// (u32 in device memory, like the positions; an id ≥ `count` is clamped to the last slot),
/// with its position counted within the slot.
pub struct CacheSlots<'a, B> {
    pub ids: View<'a, B>,
    pub count: usize,
}

impl<B> Clone for CacheSlots<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> std::marker::Copy for CacheSlots<'_, B> {}

impl<B> CacheSlots<'_, B> {
    /// Checks the slots of `op` for `rows` rows over a cache of `cache_rows` rows.
    fn validate(&self, op: &'static str, rows: usize, cache_rows: usize) -> Result<()> {
        if self.count == 0 || !cache_rows.is_multiple_of(self.count) {
            return Err(bad(
                op,
                format!("a cache of {cache_rows} rows is not {} slots", self.count),
            ));
        }
        expect(op, "slots", &self.ids, rows, U32)
    }
}

/// Rows of one sequence's cache: all of it, or one slot's share.
fn slot_rows<B>(slots: &Option<CacheSlots<'_, B>>, cache_rows: usize) -> usize {
    cache_rows / slots.as_ref().map_or(1, |s| s.count.max(1))
}

impl<B> QkvRope<'_, B> {
    /// Rows of one sequence's cache (of one slot, with [`QkvRope::slots`]).
    pub fn cap(&self) -> usize {
        slot_rows(
            &self.slots,
            self.k_cache.len / (self.kv_heads * self.head_dim).max(1),
        )
    }

    pub fn validate(&self) -> Result<()> {
        let (d, kv) = (self.head_dim, self.kv_heads * self.head_dim);
        if let Some(s) = &self.slots {
            s.validate("qkv_rope", self.rows, self.k_cache.len / kv.max(1))?;
        }
        if !d.is_multiple_of(2) || kv == 0 || !self.k_cache.len.is_multiple_of(kv) {
            return Err(bad(
                "qkv_rope",
                format!(
                    "cache of {} is not rows of {kv} (head_dim {d})",
                    self.k_cache.len
                ),
            ));
        }
        let w = (self.heads + 2 * self.kv_heads) * d;
        expect("qkv_rope", "qkv", &self.qkv, self.rows * w, F32)?;
        expect("qkv_rope", "q", &self.q, self.rows * self.heads * d, F32)?;
        expect("qkv_rope", "k_cache", &self.k_cache, self.k_cache.len, None)?;
        expect(
            "qkv_rope",
            "v_cache",
            &self.v_cache,
            self.k_cache.len,
            Some(self.k_cache.dtype),
        )?;
        let rd = self.rotary_dim;
        if rd == 0 || !rd.is_multiple_of(2) || rd > d {
            return Err(bad(
                "qkv_rope",
                format!("rotary_dim {rd} must be even, positive and at most head_dim {d}"),
            ));
        }
        expect("qkv_rope", "pos", &self.pos, self.rows, U32)?;
        expect("qkv_rope", "inv_freq", &self.inv_freq, rd / 2, F32)?;
        if self.q_norm.is_some() != self.k_norm.is_some() {
            return Err(bad("qkv_rope", "q_norm and k_norm come together"));
        }
        for n in self.q_norm.iter().chain(&self.k_norm) {
            expect("qkv_rope", "a q/k norm weight", n, d, None)?;
        }
        Ok(())
    }
}

/// Causal grouped-query attention of `rows` queries over a KV cache. `q`, `out`: [rows,
/// heads, head_dim] f32; `k_cache`, `v_cache`: [cap, kv_heads, head_dim] (any float dtype);
/// `pos`: [rows] u32 (device memory): query `r` sees cache rows `0..=pos[r]`, which must
/// already hold its keys and values (positions ≥ cap are clamped to cap − 1); with `slots`,
/// the rows of its own slot. Query head `h` reads KV head `h / (heads / kv_heads)`. Scores
/// `q·k · scale` and the softmax are f32. `workspace`: f32 scratch for backends that split
/// the sequence across blocks ([`Attention::workspace_len`]); CPU ignores it. `out` shares no
/// byte with `q` or the caches.
///
/// With one row (a decode step), `pos`, `slots` and the cache rows before `pos` must not be
/// written by the op queued just before this one (under programmatic dependent launch the
/// CUDA kernel reads them while that op still runs; the model's KV append writes row `pos`
/// only).
///
/// `gate`: Qwen3.5's output gate, [rows, heads, head_dim] f32: `out` is then the attention's
/// output times σ(gate), element by element, exactly as [`SigmoidMul`] on it (one launch fewer
/// per attention layer than the two ops). It may not overlap `out`.
pub struct Attention<'a, B> {
    pub q: View<'a, B>,
    pub k_cache: View<'a, B>,
    pub v_cache: View<'a, B>,
    pub out: View<'a, B>,
    pub gate: Option<View<'a, B>>,
    pub pos: View<'a, B>,
    /// Row r's cache slot (continuous batching; see [`CacheSlots`]); `None`: one sequence.
    pub slots: Option<CacheSlots<'a, B>>,
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub workspace: Option<View<'a, B>>,
}

/// Cache positions one split of the GPU attention covers (flash-decoding): a 4096-token cache
/// is 16 splits, each block reading 256 keys and values of one head.
pub const ATTN_SPLIT: usize = 256;

impl<B> Attention<'_, B> {
    /// Rows of one sequence's cache (of one slot, with [`Attention::slots`]).
    pub fn cap(&self) -> usize {
        slot_rows(
            &self.slots,
            self.k_cache.len / (self.kv_heads * self.head_dim).max(1),
        )
    }

    /// f32 elements of workspace the split-sequence GPU kernel needs for `rows` queries of
    /// `heads` heads over a cache of `cap` rows: per (row, head, split) a running max, a sum
    /// and `head_dim` partial outputs.
    pub fn workspace_len(rows: usize, heads: usize, head_dim: usize, cap: usize) -> usize {
        rows * heads * cap.div_ceil(ATTN_SPLIT) * (head_dim + 2)
    }

    pub fn validate(&self) -> Result<()> {
        let (h, kvh, d) = (self.heads, self.kv_heads, self.head_dim);
        if h == 0 || kvh == 0 || d == 0 || h % kvh != 0 {
            return Err(bad(
                "attention",
                format!("{h} query heads over {kvh} KV heads"),
            ));
        }
        if !self.k_cache.len.is_multiple_of(kvh * d) || self.cap() == 0 {
            return Err(bad("attention", "the cache is not whole rows"));
        }
        if let Some(s) = &self.slots {
            s.validate("attention", self.rows, self.k_cache.len / (kvh * d))?;
        }
        expect("attention", "q", &self.q, self.rows * h * d, F32)?;
        expect("attention", "out", &self.out, self.rows * h * d, F32)?;
        if let Some(g) = &self.gate {
            expect("attention", "gate", g, self.rows * h * d, F32)?;
            // Every backend writes out as it reads the gate: out would overwrite it first.
            apart("attention", "out", &self.out, &[("the gate", g)])?;
        }
        expect(
            "attention",
            "k_cache",
            &self.k_cache,
            self.k_cache.len,
            None,
        )?;
        expect(
            "attention",
            "v_cache",
            &self.v_cache,
            self.k_cache.len,
            Some(self.k_cache.dtype),
        )?;
        expect("attention", "pos", &self.pos, self.rows, U32)?;
        let reads = [
            ("q", &self.q),
            ("k_cache", &self.k_cache),
            ("v_cache", &self.v_cache),
        ];
        apart("attention", "out", &self.out, &reads)?;
        if let Some(ws) = &self.workspace {
            let need = Self::workspace_len(self.rows, h, d, self.cap());
            if ws.dtype != DType::F32 || ws.len < need {
                return Err(bad(
                    "attention",
                    format!("workspace of {} {}, need {need} f32", ws.len, ws.dtype),
                ));
            }
        }
        Ok(())
    }
}

/// `out[i] = silu(gate[i]) · up[i]`, `silu(g) = g / (1 + e^−g)`; f32, same length; `out`
/// may be `gate` or `up`.
pub struct SiluMul<'a, B> {
    pub gate: View<'a, B>,
    pub up: View<'a, B>,
    pub out: View<'a, B>,
}

/// `out[i] = x[i] · σ(gate[i])`, `σ(g) = 1 / (1 + e^−g)`: Qwen3.5's attention output gate
/// (transformers: `attn_output * torch.sigmoid(gate)`); f32, same length; `out` may be `x`
/// or `gate`.
pub struct SigmoidMul<'a, B> {
    pub x: View<'a, B>,
    pub gate: View<'a, B>,
    pub out: View<'a, B>,
}

/// `out[i] = a[i] + b[i]`; f32, same length; `out` may be `a` or `b`.
pub struct Add<'a, B> {
    pub a: View<'a, B>,
    pub b: View<'a, B>,
    pub out: View<'a, B>,
}

fn same3<B>(op: &str, a: &View<'_, B>, b: &View<'_, B>, out: &View<'_, B>) -> Result<()> {
    expect(op, "the first input", a, a.len, F32)?;
    expect(op, "the second input", b, a.len, F32)?;
    expect(op, "out", out, a.len, F32)?;
    in_place_or_apart(op, "out (against the first input)", out, a)?;
    in_place_or_apart(op, "out (against the second input)", out, b)
}

impl<B> SiluMul<'_, B> {
    pub fn validate(&self) -> Result<()> {
        same3("silu_mul", &self.gate, &self.up, &self.out)
    }
}

impl<B> SigmoidMul<'_, B> {
    pub fn validate(&self) -> Result<()> {
        same3("sigmoid_mul", &self.x, &self.gate, &self.out)
    }
}

impl<B> Add<'_, B> {
    pub fn validate(&self) -> Result<()> {
        same3("add", &self.a, &self.b, &self.out)
    }
}

/// What a [`Matmul`] applies to its input rows before the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prologue {
    /// `x`: [m, k], used as it is.
    None,
    /// `x`: [m, 2k], each row `[gate | up]` (the fused gate|up projection's output); the input
    /// is `silu(gate) · up` ([`SiluMul`]), computed as the rows are read.
    SiluMul,
}

impl Prologue {
    /// Elements of one row of the product's `x` for `k` inputs: k, or 2k ([gate | up]).
    pub fn x_width(self, k: usize) -> usize {
        match self {
            Prologue::None => k,
            Prologue::SiluMul => 2 * k,
        }
    }
}

/// What a [`Matmul`] does with its output rows after the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// `y`: [m, n], the product (+ bias) as it is.
    None,
    /// The gated MLP's activation on the fused gate|up projection: `w`'s rows are the gate
    /// rows then the up rows (n even), and `y`: [m, n/2] gets `silu(gate) · up` ([`SiluMul`])
    /// of each row's two halves (bias added before). The down projection then reads a plain
    /// input: the activation is computed once per element instead of once per reading wave,
    /// and its input is half as wide.
    SiluMul,
}

impl Epilogue {
    /// Elements of one row of the product's `y` for `n` product outputs: n, or n/2.
    pub fn y_width(self, n: usize) -> usize {
        match self {
            Epilogue::None => n,
            Epilogue::SiluMul => n / 2,
        }
    }
}

/// `y = g(f(x) · wᵀ (+ bias))`: `w`: [n, k] (f32, f16 or bf16; a Linear's [out, in] layout),
/// `bias`: [n] f32, `y`: [m, n] f32, accumulated in f32; `x` and `f` as the [`Prologue`]
/// says, `g` and `y`'s width as the [`Epilogue`] says (at most one of the two is SiluMul).
/// `m = 1` is the decode matrix–vector product; prefill uses `m` = prompt tokens. `y` must not
/// overlap `x` or `w`.
pub struct Matmul<'a, B> {
    pub x: View<'a, B>,
    pub w: View<'a, B>,
    pub bias: Option<View<'a, B>>,
    pub y: View<'a, B>,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub prologue: Prologue,
    pub epilogue: Epilogue,
}

/// The rules a product's prologue and epilogue keep together ([`Matmul`], [`MatmulInt4`]): at
/// most one of them SiluMul, and an even n (gate rows, then up rows) under the epilogue.
fn check_acts(op: &str, prologue: Prologue, epilogue: Epilogue, n: usize) -> Result<()> {
    if epilogue == Epilogue::SiluMul {
        if prologue == Prologue::SiluMul {
            return Err(bad(op, "a SiluMul prologue and epilogue together"));
        }
        if !n.is_multiple_of(2) {
            return Err(bad(
                op,
                format!("the SiluMul epilogue needs an even n (gate | up), got {n}"),
            ));
        }
    }
    Ok(())
}

impl<B> Matmul<'_, B> {
    pub fn validate(&self) -> Result<()> {
        check_acts("matmul", self.prologue, self.epilogue, self.n)?;
        let xk = self.prologue.x_width(self.k);
        expect("matmul", "x", &self.x, self.m * xk, F32)?;
        expect("matmul", "w", &self.w, self.n * self.k, None)?;
        let yn = self.epilogue.y_width(self.n);
        expect("matmul", "y", &self.y, self.m * yn, F32)?;
        if let Some(b) = &self.bias {
            expect("matmul", "bias", b, self.n, F32)?;
        }
        let xwy = [&self.x, &self.w, &self.y];
        product_apart("matmul", xwy, self.bias.as_ref(), None, None)
    }
}

/// The residual seam folded into the projection that reads it, for world 1 where no allreduce
/// carries the add + norm: `s = x + delta` (also written to `x_out` when given), then
/// `y = (rms_norm(s) · norm_w) · wᵀ (+ bias)`, accumulated in f32. Equals [`AddRmsNorm`]
/// followed by a [`Matmul`] without prologue (up to rounding: the GPU scales the dot
/// products by the row's 1/rms instead of scaling the input). `x`, `delta`: [m, k] f32;
/// `x_out`: [m, k] f32, not overlapping `x`, `delta` or `y` (the residual stream ping-pongs
/// between two buffers, since every block reads all of `x`); `norm_w`: [k] f32; `w`: [n, k]
/// (f32, f16 or bf16); `bias`: [n] f32; `y`: [m, n] f32, not overlapping the inputs.
pub struct AddNormMatmul<'a, B> {
    pub x: View<'a, B>,
    pub delta: View<'a, B>,
    pub norm_w: View<'a, B>,
    pub x_out: Option<View<'a, B>>,
    pub eps: f32,
    pub w: View<'a, B>,
    pub bias: Option<View<'a, B>>,
    pub y: View<'a, B>,
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

impl<B> AddNormMatmul<'_, B> {
    pub fn validate(&self) -> Result<()> {
        let op = "add_norm_matmul";
        let mk = self.m * self.k;
        expect(op, "x", &self.x, mk, F32)?;
        expect(op, "delta", &self.delta, mk, F32)?;
        if let Some(o) = &self.x_out {
            expect(op, "x_out", o, mk, F32)?;
        }
        expect(op, "norm_w", &self.norm_w, self.k, F32)?;
        expect(op, "w", &self.w, self.n * self.k, None)?;
        expect(op, "y", &self.y, self.m * self.n, F32)?;
        if let Some(b) = &self.bias {
            expect(op, "bias", b, self.n, F32)?;
        }
        let delta = Some(&self.delta);
        let xwy = [&self.x, &self.w, &self.y];
        product_apart(op, xwy, self.bias.as_ref(), delta, self.x_out.as_ref())
    }
}

/// [`AddNormMatmul`]'s residual seam, where another product takes it ([`QkvMatmul`]): the
/// product's input is `rms_norm(x + delta) · norm_w`, and `x + delta` is also written to `x_out`.
pub struct Seam<'a, B> {
    pub delta: View<'a, B>,
    pub norm_w: View<'a, B>,
    pub x_out: Option<View<'a, B>>,
    pub eps: f32,
}

impl<B> Clone for Seam<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> std::marker::Copy for Seam<'_, B> {}

/// `y = f(x) · wᵀ (+ bias)` for `m` rows of `k` into `n` outputs, f the identity or, with
/// `seam`, its add + RMSNorm (`x` then the residual): a [`Matmul`] or an [`AddNormMatmul`].
#[allow(clippy::too_many_arguments)]
pub fn seam_matmul<'a, B>(
    x: View<'a, B>,
    seam: Option<Seam<'a, B>>,
    w: View<'a, B>,
    bias: Option<View<'a, B>>,
    y: View<'a, B>,
    m: usize,
    k: usize,
    n: usize,
) -> crate::device::Op<'a, B> {
    match seam {
        None => crate::device::Op::Matmul(Matmul {
            x,
            w,
            bias,
            y,
            m,
            k,
            n,
            prologue: Prologue::None,
            epilogue: Epilogue::None,
        }),
        Some(s) => crate::device::Op::AddNormMatmul(AddNormMatmul {
            x,
            delta: s.delta,
            norm_w: s.norm_w,
            x_out: s.x_out,
            eps: s.eps,
            w,
            bias,
            y,
            m,
            k,
            n,
        }),
    }
}

/// The q|k|v projection of one decode token with [`QkvRope`]'s work as its epilogue, where that
/// work needs nothing across a head (no q/k norm, RoPE over the whole head: Llama, Mistral,
/// Qwen2): the product `f(x) · wᵀ (+ bias)` of `x`: [1, k] f32 (f the identity, or with `seam`
/// the residual add + RMSNorm of [`AddNormMatmul`]) and `w`: [(heads + 2·kv_heads)·head_dim,
/// k] (f32, f16 or bf16), then `rope` on it. Equals that product ([`Matmul`] or
/// [`AddNormMatmul`]) into `rope.qkv` followed by `rope`; `rope.qkv` is scratch for a backend
/// that runs the two apart (the CPU), and is left alone by one that does both in one pass
/// (the GPU's GEMV, whose waves sum rows i and i + head_dim/2 of a head together): its
/// contents afterwards are unspecified. `rope.rows` = 1, `rope.rotary_dim` = `rope.head_dim`,
/// no q/k norm.
pub struct QkvMatmul<'a, B> {
    pub x: View<'a, B>,
    pub seam: Option<Seam<'a, B>>,
    pub w: View<'a, B>,
    pub bias: Option<View<'a, B>>,
    pub k: usize,
    pub rope: QkvRope<'a, B>,
}

impl<'a, B> QkvMatmul<'a, B> {
    /// Rows of `w`: the q, k and v heads' dims.
    pub fn n(&self) -> usize {
        let r = &self.rope;
        (r.heads + 2 * r.kv_heads) * r.head_dim
    }

    /// The product alone, into `rope.qkv`.
    pub fn product(&self) -> crate::device::Op<'a, B> {
        let y = self.rope.qkv;
        seam_matmul(self.x, self.seam, self.w, self.bias, y, 1, self.k, self.n())
    }

    pub fn validate(&self) -> Result<()> {
        let r = &self.rope;
        if r.rows != 1 || r.q_norm.is_some() || r.rotary_dim != r.head_dim {
            return Err(bad(
                "qkv_matmul",
                format!(
                    "one row, no q/k norm and RoPE over the whole head (got {} rows, {}, \
                     rotary_dim {} of head_dim {})",
                    r.rows,
                    if r.q_norm.is_some() {
                        "a q/k norm"
                    } else {
                        "no norm"
                    },
                    r.rotary_dim,
                    r.head_dim
                ),
            ));
        }
        r.validate()?;
        self.product().validate()?;
        // The GPU writes q and the cache rows in the product's epilogue, as others read x.
        let mut reads = vec![("x", &self.x)];
        reads.extend(self.seam.as_ref().map(|s| ("delta", &s.delta)));
        for (name, out) in [
            ("q", &r.q),
            ("k_cache", &r.k_cache),
            ("v_cache", &r.v_cache),
        ] {
            apart("qkv_matmul", name, out, &reads)?;
        }
        Ok(())
    }
}

/// [`Matmul`] over GPTQ int4 weights in the layout of [`crate::int4`]: `y = f(x) · wᵀ`, with
/// `w[row][perm[j]] += (q[row][j] − z[row][j / group]) · s[row][j / group]` over the `kq =
/// groups · group` stored inputs j, accumulated in f32. `x`, `f`, `y`, `m` as in [`Matmul`]
/// (`x`: [m, k] or, with [`Prologue::SiluMul`], [m, 2k]; `y`: [m, n] f32, or [m, n/2] with
/// [`Epilogue::SiluMul`], not overlapping x or qweight);
/// `qweight`: [n, kq/8] u32; `scales`: [n, groups] f16; `zeros`: [n, ⌈groups/8⌉] u32;
/// `perm`: [kq] u32, each < k (None: kq = k and stored input j is input j): a contract of the
/// caller, since the values live in device memory where `validate` cannot read them (the CPU
/// twin checks them; the GPU kernel would read x out of bounds). `group` is a multiple of 8.
pub struct MatmulInt4<'a, B> {
    pub x: View<'a, B>,
    pub qweight: View<'a, B>,
    pub scales: View<'a, B>,
    pub zeros: View<'a, B>,
    pub perm: Option<View<'a, B>>,
    pub y: View<'a, B>,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub group: usize,
    pub groups: usize,
    pub prologue: Prologue,
    /// As [`Matmul`]'s: with SiluMul, `qweight`'s rows are the gate rows then the up rows and
    /// `y`: [m, n/2] (the int4 gate|up writing the activation that down_proj reads plain).
    pub epilogue: Epilogue,
}

impl<B> MatmulInt4<'_, B> {
    /// Stored inputs per row.
    pub fn kq(&self) -> usize {
        self.groups * self.group
    }

    pub fn validate(&self) -> Result<()> {
        let op = "matmul_int4";
        let (g, kq) = (self.group, self.kq());
        check_acts(op, self.prologue, self.epilogue, self.n)?;
        if g == 0 || !g.is_multiple_of(8) || self.groups == 0 || self.k == 0 {
            return Err(bad(
                op,
                format!(
                    "{} groups of {g} (a multiple of 8) over k {}",
                    self.groups, self.k
                ),
            ));
        }
        match &self.perm {
            None if kq != self.k => {
                return Err(bad(
                    op,
                    format!("{kq} stored inputs for k {} and no perm", self.k),
                ))
            }
            Some(p) => expect(op, "perm", p, kq, U32)?,
            None => {}
        }
        let xk = self.prologue.x_width(self.k);
        expect(op, "x", &self.x, self.m * xk, F32)?;
        expect(op, "qweight", &self.qweight, self.n * kq / 8, U32)?;
        expect(
            op,
            "scales",
            &self.scales,
            self.n * self.groups,
            Some(DType::F16),
        )?;
        expect(
            op,
            "zeros",
            &self.zeros,
            self.n * self.groups.div_ceil(8),
            U32,
        )?;
        expect(
            op,
            "y",
            &self.y,
            self.m * self.epilogue.y_width(self.n),
            F32,
        )?;
        apart(
            op,
            "y",
            &self.y,
            &[("x", &self.x), ("qweight", &self.qweight)],
        )
    }
}

/// The token [`Sample`] gives when the logits were not finite: no token id can be this
/// (vocab ids are below 2^24), and the embedding of a step fed with it is zeros (an id outside
/// every rank's shard), so a step queued behind it runs harmlessly until the host reads it.
pub const NO_TOKEN: u32 = u32::MAX;

/// The NaN [`ShardTopK`] writes for a non-finite row: the quiet NaN of Rust's `f32::NAN`,
/// the same bits on every backend.
pub const NAN_BITS: u32 = 0x7fc0_0000;

/// Most candidates one shard contributes to sampling ([`ShardTopK`]), and so the most tokens
/// sampling ever considers: the 64 most likely of the whole vocab are always among the union
/// of every shard's 64 most likely.
pub const TOPK_MAX: usize = 64;

/// This rank's best `k` logits: `logits`: [n] f32 for vocab ids `vocab_start..vocab_start+n`;
/// `out`: [2k] f32, pairs (logit, id as f32) sorted by logit descending, ties to the lower id,
/// NaN logits never chosen, slots beyond `n` filled with (−∞, 0). Ids are below 2^24, so f32
/// holds them exactly. Every rank writes its pairs into its own part of a zero-filled buffer
/// and an allreduce of that buffer (adding only zeros, exact) gathers all shards' candidates.
///
/// A shard with any non-finite logit (NaN, ±∞: NaN weights, or activations that overflowed)
/// has pair 0's logit replaced by NaN ([`NAN_BITS`]), so that [`Sample`] sees the bad row
/// among the candidates and gives [`NO_TOKEN`]: the scan that picks the candidates checks the
/// whole row for free, and no full-vocab read reaches the host.
pub struct ShardTopK<'a, B> {
    pub logits: View<'a, B>,
    pub vocab_start: usize,
    pub k: usize,
    pub out: View<'a, B>,
}

impl<B> ShardTopK<'_, B> {
    pub fn validate(&self) -> Result<()> {
        if self.k == 0 || self.k > TOPK_MAX {
            return Err(bad(
                "shard_topk",
                format!("k = {} (1..={TOPK_MAX})", self.k),
            ));
        }
        if self.vocab_start + self.logits.len > 1 << 24 {
            return Err(bad("shard_topk", "vocab ids must stay below 2^24"));
        }
        expect("shard_topk", "logits", &self.logits, self.logits.len, F32)?;
        expect("shard_topk", "out", &self.out, 2 * self.k, F32)
    }
}

/// How [`Sample`] picks a token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// Keep the k most likely candidates (0 = all candidates, at most [`TOPK_MAX`]).
    pub top_k: u32,
    /// Keep the smallest prefix whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    pub seed: u64,
}

/// Picks the next token from gathered candidates and advances the step state.
/// `cands`: [2c] f32 pairs (logit, id) from [`ShardTopK`] of every shard (any order; pairs
/// with a −∞ logit are padding). `state`: [2] u32 = (token, position): the token just run and
/// its position. The op picks `t` (greedy: the largest logit, ties to the lower id; else
/// temperature, top-k, top-p over the best [`TOPK_MAX`] candidates, with the uniform draw a
/// hash of (`seed`, position + 1)), then sets `state = (t, position + 1)` and
/// `tokens[position + 1] = t` (`tokens`: [cap] u32, the sequence's token history; positions
/// past its end are not stored). Run inside a captured step, so a replay feeds itself.
/// Any NaN candidate logit (a non-finite row, as [`ShardTopK`] marks it) gives
/// `t = `[`NO_TOKEN`], which the host reports as an error.
pub struct Sample<'a, B> {
    pub cands: View<'a, B>,
    pub params: SampleParams,
    pub state: View<'a, B>,
    pub tokens: View<'a, B>,
}

impl<B> Sample<'_, B> {
    pub fn validate(&self) -> Result<()> {
        if self.cands.len == 0
            || !self.cands.len.is_multiple_of(2)
            || self.cands.len > 2 * TOPK_MAX * crate::comm::MAX_WORLD
        {
            return Err(bad(
                "sample",
                format!("{} candidate values", self.cands.len),
            ));
        }
        let p = &self.params;
        let ok = p.temperature >= 0.0 && p.temperature.is_finite();
        if !(ok && p.top_p > 0.0 && p.top_p <= 1.0) {
            return Err(bad(
                "sample",
                format!("temperature {} top_p {}", p.temperature, p.top_p),
            ));
        }
        expect("sample", "cands", &self.cands, self.cands.len, F32)?;
        expect("sample", "state", &self.state, 2, U32)?;
        expect("sample", "tokens", &self.tokens, self.tokens.len, U32)
    }
}

/// The uniform draw of [`Sample`] for the token at `position`: splitmix64 (Steele, Lea, Flood
/// 2014; the constants are the published ones) of `seed ^ position·φ`, top 24 bits scaled to
/// [0, 1). Counter-based, so a replayed graph needs no RNG state; f32 with 24 bits so that
/// CPU and GPU get the same value.
pub fn sample_uniform(seed: u64, position: u32) -> f32 {
    let mut z = seed ^ u64::from(position).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct B(#[allow(dead_code)] u8);
    /// A view of its own buffer (leaked: a test's few bytes), so that views overlap only
    /// where a test makes them share one ([`at`]).
    fn v(len: usize, dtype: DType) -> View<'static, B> {
        View::new(Box::leak(Box::new(B(0))), 0, len, dtype)
    }
    /// `len` f32 at element `start` of `buf`.
    fn at(buf: &'static B, start: usize, len: usize) -> View<'static, B> {
        View::new(buf, 4 * start, len, DType::F32)
    }

    /// Aliasing is checked once, here, for every backend: in-place ops take their input
    /// exactly or not at all, products and attention no overlap of an output with an input.
    #[test]
    fn outputs_may_alias_inputs_only_where_the_op_says() {
        let buf: &'static B = Box::leak(Box::new(B(0)));
        let add = |out| Add {
            a: at(buf, 0, 8),
            b: at(buf, 8, 8),
            out,
        };
        add(at(buf, 0, 8)).validate().unwrap();
        add(at(buf, 8, 8)).validate().unwrap();
        add(at(buf, 16, 8)).validate().unwrap();
        let e = add(at(buf, 4, 8)).validate().unwrap_err().to_string();
        assert!(
            e.contains("add: out (against the first input) partly overlaps"),
            "{e}"
        );
        let norm = |x, delta, out| AddRmsNorm {
            x,
            delta,
            w: v(4, DType::F32),
            out,
            rows: 2,
            dim: 4,
            eps: 1e-6,
        };
        norm(at(buf, 0, 8), at(buf, 8, 8), at(buf, 8, 8))
            .validate()
            .unwrap();
        assert!(norm(at(buf, 0, 8), at(buf, 4, 8), at(buf, 16, 8))
            .validate()
            .is_err());
        let mm = |y| Matmul {
            x: at(buf, 0, 8),
            w: v(12, DType::BF16),
            bias: None,
            y,
            m: 2,
            k: 4,
            n: 3,
            prologue: Prologue::None,
            epilogue: Epilogue::None,
        };
        mm(at(buf, 8, 6)).validate().unwrap();
        let e = mm(at(buf, 7, 6)).validate().unwrap_err().to_string();
        assert!(e.contains("matmul: y (against x) overlaps an input"), "{e}");
        // Even exactly x: every wave reads all of x while others write y.
        let e = mm(at(buf, 0, 6)).validate().unwrap_err().to_string();
        assert!(e.contains("overlaps an input"), "{e}");
    }

    #[test]
    fn matmul_checks_every_shape() {
        let ok = Matmul {
            x: v(8, DType::F32),
            w: v(12, DType::BF16),
            bias: None,
            y: v(6, DType::F32),
            m: 2,
            k: 4,
            n: 3,
            prologue: Prologue::None,
            epilogue: Epilogue::None,
        };
        ok.validate().unwrap();
        let glu = Matmul {
            x: v(16, DType::F32),
            prologue: Prologue::SiluMul,
            ..ok
        };
        glu.validate().unwrap();
        let bad_y = Matmul {
            y: v(5, DType::F32),
            ..glu
        };
        assert!(
            bad_y
                .validate()
                .unwrap_err()
                .to_string()
                .contains("y has 5"),
            "{:?}",
            bad_y.validate().err()
        );
        let bad_w = Matmul {
            w: v(12, DType::U32),
            y: v(6, DType::F32),
            x: v(8, DType::F32),
            ..bad_y
        };
        assert!(bad_w.validate().is_err());
    }

    #[test]
    fn matmul_int4_checks_every_shape() {
        let ok = MatmulInt4 {
            x: v(256, DType::F32),
            qweight: v(4 * 32, DType::U32),
            scales: v(4 * 2, DType::F16),
            zeros: v(4, DType::U32),
            perm: None,
            y: v(4, DType::F32),
            m: 1,
            k: 256,
            n: 4,
            group: 128,
            groups: 2,
            prologue: Prologue::None,
            epilogue: Epilogue::None,
        };
        ok.validate().unwrap();
        // The epilogue halves y.
        MatmulInt4 {
            y: v(2, DType::F32),
            epilogue: Epilogue::SiluMul,
            ..ok
        }
        .validate()
        .unwrap();
        // A perm may cover more stored inputs than k (padded groups of a desc_act shard).
        MatmulInt4 {
            x: v(200, DType::F32),
            k: 200,
            perm: Some(v(256, DType::U32)),
            ..ok
        }
        .validate()
        .unwrap();
        for bad in [
            MatmulInt4 { group: 12, ..ok },
            MatmulInt4 { k: 200, ..ok },
            MatmulInt4 {
                scales: v(8, DType::BF16),
                ..ok
            },
            MatmulInt4 {
                zeros: v(8, DType::U32),
                ..ok
            },
            MatmulInt4 {
                prologue: Prologue::SiluMul,
                ..ok
            },
            // y of n rows under the epilogue; both SiluMuls; an odd n under the epilogue.
            MatmulInt4 {
                epilogue: Epilogue::SiluMul,
                ..ok
            },
            MatmulInt4 {
                x: v(512, DType::F32),
                y: v(2, DType::F32),
                prologue: Prologue::SiluMul,
                epilogue: Epilogue::SiluMul,
                ..ok
            },
            MatmulInt4 {
                qweight: v(3 * 32, DType::U32),
                scales: v(3 * 2, DType::F16),
                zeros: v(3, DType::U32),
                y: v(1, DType::F32),
                n: 3,
                epilogue: Epilogue::SiluMul,
                ..ok
            },
        ] {
            assert!(bad.validate().is_err());
        }
    }

    #[test]
    fn positions_must_be_u32() {
        let r = Rope {
            x: v(16, DType::F32),
            inv_freq: v(2, DType::F32),
            pos: v(2, DType::F32),
            rows: 2,
            heads: 2,
            head_dim: 4,
        };
        assert!(r.validate().unwrap_err().to_string().contains("pos is f32"));
        Rope {
            pos: v(2, DType::U32),
            ..r
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn topk_and_sample_bounds() {
        let t = ShardTopK {
            logits: v(10, DType::F32),
            vocab_start: 0,
            k: TOPK_MAX + 1,
            out: v(2 * TOPK_MAX + 2, DType::F32),
        };
        assert!(t.validate().is_err());
        ShardTopK {
            k: 5,
            out: v(10, DType::F32),
            ..t
        }
        .validate()
        .unwrap();
        let p = SampleParams {
            temperature: 0.7,
            top_k: 0,
            top_p: 0.0,
            seed: 1,
        };
        let s = Sample {
            cands: v(8, DType::F32),
            params: p,
            state: v(2, DType::U32),
            tokens: v(9, DType::U32),
        };
        assert!(s.validate().is_err());
        Sample {
            params: SampleParams { top_p: 1.0, ..p },
            ..s
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn uniform_draws_are_in_range_and_vary() {
        let a: Vec<f32> = (0..1000).map(|p| sample_uniform(7, p)).collect();
        assert!(a.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = a.iter().sum::<f32>() / 1000.0;
        assert!((mean - 0.5).abs() < 0.05, "{mean}");
        assert_ne!(sample_uniform(7, 3), sample_uniform(8, 3));
    }
}
