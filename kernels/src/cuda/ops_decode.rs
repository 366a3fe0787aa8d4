//! Launchers of `kernels/src/gpu/decode.cu` (Fill, Embedding, RmsNorm, AddRmsNorm, Rope,
//! QkvRope, SiluMul, Add): the Rust mirrors of its parameter structs, the grid and block of each
//! kernel, the alignment checks that pick its 16-byte path, and the family's twin cases.
//!
//! Must not: allocate or synchronise (every launch here is captured into the decode graph), or
//! pass per-token values as launch parameters (the kernels read ids and positions from device
//! memory).
//!
//! Alignment: every view must start at a multiple of its element size (else `Invalid`); views
//! aligned to 16 bytes (and rows a multiple of 4 elements) take the vector path, any other
//! view the scalar one, with the same results.

use super::launch::Launcher;
use super::mem::CudaBuf;
use super::program::Module;
use super::selftest::Rng;
use super::twin::{self, Buf, Tol, TwinCase};
use super::{CudaDevice, SelftestResult};
use crate::cpu::CpuDevice;
use crate::device::Op;
use crate::{ops, DType, KernelError, Result, View};

/// The kernels of decode.cu, in the order the launchers index them: the dtype-specific ones in
/// [`DType::ALL`] order (f32, f16, bf16) after their first index below.
pub(crate) const NAMES: &[&str] = &[
    "fill",
    "embedding_f32",
    "embedding_f16",
    "embedding_bf16",
    "rms_norm_f32",
    "rms_norm_f16",
    "rms_norm_bf16",
    "add_rms_norm_f32",
    "add_rms_norm_f16",
    "add_rms_norm_bf16",
    "rope",
    "qkv_rope_f32",
    "qkv_rope_f16",
    "qkv_rope_bf16",
    "silu_mul",
    "add",
    "sigmoid_mul",
];
const FILL: usize = 0;
/// + the table's dtype index.
const EMBEDDING: usize = 1;
/// + the weight's dtype index.
const RMS_NORM: usize = 4;
/// + the weight's dtype index.
const ADD_RMS_NORM: usize = 7;
const ROPE: usize = 10;
/// + the KV cache's dtype index.
const QKV_ROPE: usize = 11;
const SILU_MUL: usize = 14;
const ADD: usize = 15;
const SIGMOID_MUL: usize = 16;

/// Most threads of a norm block (decode.cu TP_NORM_THREADS).
const NORM_THREADS: usize = 1024;
/// Most threads of a rope / qkv_rope block (decode.cu TP_PAIR_THREADS).
const PAIR_THREADS: usize = 256;
/// Threads of the streaming kernels (decode.cu TP_THREADS).
const THREADS: u32 = 256;
/// Block sizes are multiples of this: a whole number of waves for 32- and 64-lane targets
/// (the block reduction needs full waves).
const WAVE_MULTIPLE: usize = 64;
/// The CUDA limit on grid.y (and z); kernels with rows on y loop past it.
const MAX_GRID_Y: usize = 65_535;
/// Row blocks of a norm launch at most (grid.x; the kernel loops over the rest): far more
/// than the 132 SMs of an H200 can run at once, well below the 2^31 − 1 limit.
const MAX_ROW_BLOCKS: usize = 1 << 20;

/// decode.cu `struct FillParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct FillParams {
    dst: u64,
    n: u64,
    word: u32,
    esize: u32,
}
const _: () = assert!(std::mem::size_of::<FillParams>() == 24);

/// decode.cu `struct EmbParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct EmbParams {
    table: u64,
    ids: u64,
    out: u64,
    vocab_start: u64,
    table_rows: u64,
    hidden: u64,
    m: u32,
    vec: u32,
}
const _: () = assert!(std::mem::size_of::<EmbParams>() == 56);

/// decode.cu `struct NormParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct NormParams {
    x: u64,
    delta: u64,
    w: u64,
    out: u64,
    dim: u64,
    rows: u32,
    eps: f32,
    vec: u32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<NormParams>() == 56);

/// decode.cu `struct RopeParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct RopeParams {
    x: u64,
    inv_freq: u64,
    pos: u64,
    rows: u32,
    heads: u32,
    half: u32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<RopeParams>() == 40);

/// decode.cu `struct QkvParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct QkvParams {
    qkv: u64,
    q: u64,
    k_cache: u64,
    v_cache: u64,
    pos: u64,
    inv_freq: u64,
    q_norm: u64,
    k_norm: u64,
    cap: u64,
    rows: u32,
    heads: u32,
    kv_heads: u32,
    half: u32,
    eps: f32,
    norm: u32,
    qn_dtype: u32,
    kn_dtype: u32,
    rhalf: u32,
    nslots: u32,
    slots: u64,
}
const _: () = assert!(std::mem::size_of::<QkvParams>() == 120);

/// decode.cu `struct BinParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct BinParams {
    a: u64,
    b: u64,
    out: u64,
    n: u64,
    vec: u32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<BinParams>() == 40);

/// Queues one op of this family.
pub(crate) fn launch(l: &Launcher<'_>, op: &Op<'_, CudaBuf>) -> Result<()> {
    match op {
        Op::Fill(a) => fill(l, a),
        Op::Embedding(a) => embedding(l, a),
        Op::RmsNorm(a) => norm(l, &a.x, None, &a.w, &a.out, (a.rows, a.dim, a.eps)),
        Op::AddRmsNorm(a) => norm(
            l,
            &a.x,
            Some(&a.delta),
            &a.w,
            &a.out,
            (a.rows, a.dim, a.eps),
        ),
        Op::Rope(a) => rope(l, a),
        Op::QkvRope(a) => qkv_rope(l, a),
        Op::SiluMul(a) => binary(l, SILU_MUL, &a.gate, &a.up, &a.out),
        Op::Add(a) => binary(l, ADD, &a.a, &a.b, &a.out),
        Op::SigmoidMul(a) => binary(l, SIGMOID_MUL, &a.x, &a.gate, &a.out),
        other => Err(KernelError::Unavailable {
            backend: "cuda",
            why: format!("no CUDA kernel for '{}' in decode.cu", other.name()),
        }),
    }
}

/// The index of a float dtype in [`DType::ALL`] (and in each dtype-specific run of NAMES).
pub(super) fn dtype_index(d: DType) -> Result<usize> {
    match d {
        DType::F32 => Ok(0),
        DType::F16 => Ok(1),
        DType::BF16 => Ok(2),
        DType::U32 => Err(KernelError::Invalid(
            "a u32 view where a float is meant".into(),
        )),
    }
}

/// The device address of a view, bounds-checked, which must be aligned to its element size.
fn addr(v: &View<'_, CudaBuf>) -> Result<u64> {
    let a = v.buf.addr(v.offset, v.bytes())?;
    if !a.is_multiple_of(v.dtype.size() as u64) {
        return Err(KernelError::Invalid(format!(
            "a {} view at byte offset {} is not aligned to its elements",
            v.dtype, v.offset
        )));
    }
    Ok(a)
}

pub(super) fn to_u32(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| KernelError::Invalid(format!("{what} = {v} does not fit a u32")))
}

/// Threads of a norm block for rows of `dim`: the fewest whole 64-thread groups (≤ 1024) that
/// give every thread the same number of 4-element packs, so no thread carries an extra one
/// (5120 = 1280 packs: 640 threads × 2, not 1024 threads with a quarter of them doing 2).
fn norm_threads(dim: usize) -> u32 {
    let packs = dim.div_ceil(4).max(1);
    let per_thread = packs.div_ceil(NORM_THREADS);
    let t = packs.div_ceil(per_thread).next_multiple_of(WAVE_MULTIPLE);
    t.min(NORM_THREADS) as u32
}

/// Threads of a rope / qkv_rope block: one per rotated pair, in whole 64-thread groups, at
/// most PAIR_THREADS (longer heads loop).
fn pair_threads(half: usize) -> u32 {
    half.max(1)
        .next_multiple_of(WAVE_MULTIPLE)
        .min(PAIR_THREADS) as u32
}

/// Launches kernel `index` of decode.cu.
///
/// # Safety
/// `P` is the exact parameter struct of that kernel and every device address in `p` is
/// bounds-checked and stays valid until the stream passes this launch.
unsafe fn go<P>(
    l: &Launcher<'_>,
    index: usize,
    grid: (u32, u32, u32),
    block: u32,
    p: &mut P,
) -> Result<()> {
    let f = l.kernels.func(Module::Decode, index);
    // SAFETY: forwarded from the caller.
    unsafe { l.launch_fn(f, grid, block, 0, p) }
}

fn fill(l: &Launcher<'_>, a: &ops::Fill<'_, CudaBuf>) -> Result<()> {
    let dst = addr(&a.dst)?;
    if a.dst.len == 0 {
        return Ok(());
    }
    // The element's bits as the CPU twin computes them (`Elem::from_f32`): round to nearest
    // even for f16/bf16, Rust's saturating `as` for u32. 16-bit patterns fill both halves of
    // the word so that 16-byte stores write whole elements.
    let word = match a.dst.dtype {
        DType::F32 => a.value.to_bits(),
        DType::U32 => a.value as u32,
        DType::F16 => u32::from(half::f16::from_f32(a.value).to_bits()) * 0x1_0001,
        DType::BF16 => u32::from(half::bf16::from_f32(a.value).to_bits()) * 0x1_0001,
    };
    let esize = a.dst.dtype.size();
    let mut p = FillParams {
        dst,
        n: a.dst.len as u64,
        word,
        esize: esize as u32,
    };
    let grid = l.grid_for((a.dst.len * esize).div_ceil(16), THREADS);
    // SAFETY: FillParams is fill's parameter; dst bounds-checked above.
    unsafe { go(l, FILL, (grid, 1, 1), THREADS, &mut p) }
}

fn embedding(l: &Launcher<'_>, a: &ops::Embedding<'_, CudaBuf>) -> Result<()> {
    let (table, ids, out) = (addr(&a.table)?, addr(&a.ids)?, addr(&a.out)?);
    let m = a.ids.len;
    if m == 0 {
        return Ok(());
    }
    let esize = a.table.dtype.size() as u64;
    let vec =
        a.hidden.is_multiple_of(4) && table.is_multiple_of(4 * esize) && out.is_multiple_of(16);
    let mut p = EmbParams {
        table,
        ids,
        out,
        vocab_start: a.vocab_start as u64,
        table_rows: (a.table.len / a.hidden) as u64,
        hidden: a.hidden as u64,
        m: to_u32("embedding ids", m)?,
        vec: u32::from(vec),
    };
    let gx = a
        .hidden
        .div_ceil(4)
        .div_ceil(THREADS as usize)
        .min(MAX_ROW_BLOCKS) as u32;
    let kernel = EMBEDDING + dtype_index(a.table.dtype)?;
    // SAFETY: EmbParams is embedding_*'s parameter; every address bounds-checked (`validate`
    // made out m·hidden elements; the kernel reads only table rows below table_rows).
    unsafe {
        go(
            l,
            kernel,
            (gx, m.min(MAX_GRID_Y) as u32, 1),
            THREADS,
            &mut p,
        )
    }
}

/// RmsNorm (`delta` None) or AddRmsNorm; `shape` = (rows, dim, eps).
fn norm(
    l: &Launcher<'_>,
    x: &View<'_, CudaBuf>,
    delta: Option<&View<'_, CudaBuf>>,
    w: &View<'_, CudaBuf>,
    out: &View<'_, CudaBuf>,
    (rows, dim, eps): (usize, usize, f32),
) -> Result<()> {
    let what = if delta.is_some() {
        "add_rms_norm"
    } else {
        "rms_norm"
    };
    let (xa, wa, oa) = (addr(x)?, addr(w)?, addr(out)?);
    let da = delta.map(addr).transpose()?.unwrap_or(0);
    if rows == 0 || dim == 0 {
        return Ok(());
    }
    let vec = dim.is_multiple_of(4)
        && [xa, da, oa].iter().all(|a| a.is_multiple_of(16))
        && wa.is_multiple_of(4 * w.dtype.size() as u64);
    let mut p = NormParams {
        x: xa,
        delta: da,
        w: wa,
        out: oa,
        dim: dim as u64,
        rows: to_u32(what, rows)?,
        eps,
        vec: u32::from(vec),
        pad: 0,
    };
    let first = if delta.is_some() {
        ADD_RMS_NORM
    } else {
        RMS_NORM
    };
    let kernel = first + dtype_index(w.dtype)?;
    let grid = (rows.min(MAX_ROW_BLOCKS) as u32, 1, 1);
    // SAFETY: NormParams is the parameter of rms_norm_* and add_rms_norm_*; every address
    // bounds-checked above for rows·dim (x, delta, out) and dim (w) elements (`validate`).
    unsafe { go(l, kernel, grid, norm_threads(dim), &mut p) }
}

fn rope(l: &Launcher<'_>, a: &ops::Rope<'_, CudaBuf>) -> Result<()> {
    let (x, inv_freq, pos) = (addr(&a.x)?, addr(&a.inv_freq)?, addr(&a.pos)?);
    if a.rows == 0 || a.heads == 0 || a.head_dim == 0 {
        return Ok(());
    }
    let half = a.head_dim / 2;
    let mut p = RopeParams {
        x,
        inv_freq,
        pos,
        rows: to_u32("rope rows", a.rows)?,
        heads: to_u32("rope heads", a.heads)?,
        half: to_u32("rope head_dim", half)?,
        pad: 0,
    };
    let grid = (p.heads, a.rows.min(MAX_GRID_Y) as u32, 1);
    // SAFETY: RopeParams is rope's parameter; addresses bounds-checked for the lengths
    // `validate` tied to rows, heads and head_dim.
    unsafe { go(l, ROPE, grid, pair_threads(half), &mut p) }
}

fn qkv_rope(l: &Launcher<'_>, a: &ops::QkvRope<'_, CudaBuf>) -> Result<()> {
    let norm_addr = |v: &Option<View<'_, CudaBuf>>| -> Result<(u64, u32)> {
        match v {
            Some(v) => Ok((addr(v)?, dtype_index(v.dtype)? as u32)),
            None => Ok((0, 0)),
        }
    };
    let (q_norm, qn_dtype) = norm_addr(&a.q_norm)?;
    let (k_norm, kn_dtype) = norm_addr(&a.k_norm)?;
    let mut p = QkvParams {
        qkv: addr(&a.qkv)?,
        q: addr(&a.q)?,
        k_cache: addr(&a.k_cache)?,
        v_cache: addr(&a.v_cache)?,
        pos: addr(&a.pos)?,
        inv_freq: addr(&a.inv_freq)?,
        q_norm,
        k_norm,
        cap: a.cap() as u64,
        rows: to_u32("qkv_rope rows", a.rows)?,
        heads: to_u32("qkv_rope heads", a.heads)?,
        kv_heads: to_u32("qkv_rope kv_heads", a.kv_heads)?,
        half: to_u32("qkv_rope head_dim", a.head_dim / 2)?,
        eps: a.eps,
        norm: u32::from(a.q_norm.is_some()),
        qn_dtype,
        kn_dtype,
        rhalf: to_u32("qkv_rope rotary_dim", a.rotary_dim / 2)?,
        nslots: to_u32("qkv_rope slots", a.slots.map_or(1, |s| s.count))?,
        slots: a.slots.map(|s| addr(&s.ids)).transpose()?.unwrap_or(0),
    };
    let heads = to_u32("qkv_rope heads", a.heads + 2 * a.kv_heads)?;
    if a.rows == 0 || heads == 0 || a.head_dim == 0 {
        return Ok(());
    }
    let kernel = QKV_ROPE + dtype_index(a.k_cache.dtype)?;
    let grid = (heads, a.rows.min(MAX_GRID_Y) as u32, 1);
    // SAFETY: QkvParams is qkv_rope_*'s parameter; every address bounds-checked for the
    // lengths `validate` tied to the shape; cache rows are written only below cap.
    unsafe { go(l, kernel, grid, pair_threads(a.head_dim / 2), &mut p) }
}

fn binary(
    l: &Launcher<'_>,
    kernel: usize,
    a: &View<'_, CudaBuf>,
    b: &View<'_, CudaBuf>,
    out: &View<'_, CudaBuf>,
) -> Result<()> {
    let (aa, ba, oa) = (addr(a)?, addr(b)?, addr(out)?);
    if out.len == 0 {
        return Ok(());
    }
    let vec = [aa, ba, oa].iter().all(|x| x.is_multiple_of(16));
    let mut p = BinParams {
        a: aa,
        b: ba,
        out: oa,
        n: out.len as u64,
        vec: u32::from(vec),
        pad: 0,
    };
    let grid = l.grid_for(out.len.div_ceil(4), THREADS);
    // SAFETY: BinParams is silu_mul's and add's parameter; addresses bounds-checked for n
    // elements each (`validate` made the three lengths equal).
    unsafe { go(l, kernel, (grid, 1, 1), THREADS, &mut p) }
}

// ---- twin cases ---------------------------------------------------------------------------
//
// Tolerances (twin::Tol, |gpu − cpu| ≤ t·(1 + |cpu|)):
// - Exact: fill (bits computed on the host as the twin does), embedding (exact widening), add
//   (one IEEE f32 add on both sides).
// - silu_mul 1e-6: expf ≤ 2 ulp (CUDA Programming Guide, mathematical functions appendix)
//   against Rust's exp ≤ 1 ulp, plus the division and product each rounded: a few ulp
//   (~3e-7 relative), no cancellation (1 + e^−g ≥ 1).
// - rms_norm, add_rms_norm 1e-5: the sum of squares is added in a different order (a block
//   tree against the twin's 16 lanes), ~1e-6 relative for 16k random terms, halved by the
//   square root; then two products rounded alike.
// - rope 1e-5: sincosf ≤ 2 ulp against the twin's correctly rounded f64 sin/cos, i.e. ≤ 1.5e-7
//   absolute on each of cos and sin, times |x1| + |x2| < 16 (inputs below 8): ≤ 2.4e-6.
// - qkv_rope with an f32 cache 2e-5: rope's error on normed heads, whose elements reach
//   √(2·head_dim)·|w| (a head whose energy sits in one pair: 16·2 for head_dim 128), plus the
//   norm's. With an f16 / bf16 cache: one ulp of that dtype (2^-10 / 2^-7 relative): the f32
//   values may straddle a rounding boundary. q is the same code for every cache dtype, so the
//   f32-cache cases check it at the tight tolerance.

/// Random f32 values, bytes: ±m·2^k, k in `exps` (see selftest::Rng).
pub(super) fn f32s(rng: &mut Rng, n: usize, exps: std::ops::RangeInclusive<i32>) -> Vec<u8> {
    rng.bytes(DType::F32, n, exps)
}

pub(super) fn u32s(v: &[u32]) -> Vec<u8> {
    crate::dtype::encode_u32(v)
}

/// RoPE inverse frequencies for `half` pairs: theta^(−2i/head_dim), rounded to f32 (what
/// transformers computes for default RoPE).
pub(super) fn inv_freq(half: usize, theta: f64) -> Vec<u8> {
    let v: Vec<f32> = (0..half)
        .map(|i| theta.powf(-2.0 * i as f64 / (2 * half) as f64) as f32)
        .collect();
    crate::dtype::encode(DType::F32, &v)
}

struct FillCase {
    dtype: DType,
    n: usize,
    /// Elements before the view (misaligns it, and they must stay poisoned).
    shift: usize,
    value: f32,
}

impl TwinCase for FillCase {
    fn name(&self) -> String {
        format!(
            "fill {} n {} shift {} value {}",
            self.dtype, self.n, self.shift, self.value
        )
    }
    fn shape(&self) -> (DType, usize) {
        (self.dtype, self.n)
    }
    fn bufs(&self) -> Vec<Buf> {
        vec![Buf::output(self.dtype, self.shift + self.n)]
    }
    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        Op::Fill(ops::Fill {
            dst: v[0].slice(self.shift, self.n),
            value: self.value,
        })
    }
    fn tol(&self) -> Tol {
        Tol::Exact
    }
}

fn fill_cases() -> Vec<FillCase> {
    let mut out = Vec::new();
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::U32] {
        // 0.1 rounds differently in each float dtype; u32 takes `as`: 3.7 → 3, −1 → 0
        // (saturating), 1e10 → u32::MAX.
        let values: &[f32] = match dtype {
            DType::U32 => &[3.7, -1.0, 1e10],
            _ => &[0.1, -2.5, 1e10],
        };
        for (i, &(n, shift)) in [(1usize, 0usize), (7, 1), (4096, 0), (100_003, 3)]
            .iter()
            .enumerate()
        {
            out.push(FillCase {
                dtype,
                n,
                shift,
                value: values[i % values.len()],
            });
        }
    }
    out
}

struct EmbeddingCase {
    dtype: DType,
    hidden: usize,
    vocab_start: usize,
    ids: Vec<u32>,
    /// Elements before the table and out views.
    shift: usize,
    table: Vec<u8>,
}

impl TwinCase for EmbeddingCase {
    fn name(&self) -> String {
        format!(
            "embedding {} hidden {} ids {} shift {}",
            self.dtype,
            self.hidden,
            self.ids.len(),
            self.shift
        )
    }
    fn shape(&self) -> (DType, usize) {
        (self.dtype, self.ids.len() * self.hidden)
    }
    fn bufs(&self) -> Vec<Buf> {
        vec![
            Buf::input(self.dtype, self.table.clone()),
            Buf::input(DType::U32, u32s(&self.ids)),
            Buf::output(DType::F32, self.shift + self.ids.len() * self.hidden),
        ]
    }
    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        let table_len = v[0].len - self.shift;
        Op::Embedding(ops::Embedding {
            table: v[0].slice(self.shift, table_len),
            vocab_start: self.vocab_start,
            ids: v[1],
            hidden: self.hidden,
            out: v[2].slice(self.shift, self.ids.len() * self.hidden),
        })
    }
    fn tol(&self) -> Tol {
        Tol::Exact
    }
}

fn embedding_cases(rng: &mut Rng) -> Vec<EmbeddingCase> {
    let mut out = Vec::new();
    // A shard of 37 rows holding vocab ids 100..137: ids inside, at both ends, just outside
    // each end, far outside, repeated.
    let (rows, start) = (37usize, 100usize);
    let many = vec![100u32, 136, 99, 137, u32::MAX, 120, 100, 0];
    for dtype in DType::ALL {
        for &(hidden, shift, ref ids) in &[
            (1usize, 0usize, many.clone()),
            (7, 1, many.clone()),
            (4096, 0, vec![117u32]),
            (4096, 1, vec![101u32]),
            (5120, 0, many.clone()),
            (8192, 0, vec![5u32]),
        ] {
            let table = rng.bytes(dtype, shift + rows * hidden, -20..=10);
            out.push(EmbeddingCase {
                dtype,
                hidden,
                vocab_start: start,
                ids: ids.clone(),
                shift,
                table,
            });
        }
    }
    out
}

struct NormCase {
    w_dtype: DType,
    rows: usize,
    dim: usize,
    /// AddRmsNorm (else RmsNorm).
    add: bool,
    /// `out` is `x` (RmsNorm) or `delta` (AddRmsNorm) instead of its own buffer.
    alias: bool,
    /// Elements before the x, delta and out views.
    shift: usize,
    eps: f32,
    x: Vec<u8>,
    delta: Vec<u8>,
    w: Vec<u8>,
}

impl TwinCase for NormCase {
    fn name(&self) -> String {
        format!(
            "{} w {} rows {} dim {}{} shift {}",
            if self.add { "add_rms_norm" } else { "rms_norm" },
            self.w_dtype,
            self.rows,
            self.dim,
            if self.alias { " in place" } else { "" },
            self.shift
        )
    }
    fn shape(&self) -> (DType, usize) {
        (self.w_dtype, self.rows * self.dim)
    }
    fn bufs(&self) -> Vec<Buf> {
        let n = self.shift + self.rows * self.dim;
        // [x, w, (out)] or [x, delta, w, (out)]; x is written back by AddRmsNorm and by an
        // in-place RmsNorm.
        let mut b = Vec::new();
        if self.add || self.alias {
            b.push(Buf::inout(DType::F32, self.x.clone()));
        } else {
            b.push(Buf::input(DType::F32, self.x.clone()));
        }
        if self.add {
            b.push(match self.alias {
                true => Buf::inout(DType::F32, self.delta.clone()),
                false => Buf::input(DType::F32, self.delta.clone()),
            });
        }
        b.push(Buf::input(self.w_dtype, self.w.clone()));
        if !self.alias {
            b.push(Buf::output(DType::F32, n));
        }
        b
    }
    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        let rows_of = |v: &View<'a, B>| v.slice(self.shift, self.rows * self.dim);
        let (rows, dim, eps) = (self.rows, self.dim, self.eps);
        if self.add {
            let (x, delta, w) = (rows_of(&v[0]), rows_of(&v[1]), v[2]);
            let out = if self.alias { delta } else { rows_of(&v[3]) };
            Op::AddRmsNorm(ops::AddRmsNorm {
                x,
                delta,
                w,
                out,
                rows,
                dim,
                eps,
            })
        } else {
            let (x, w) = (rows_of(&v[0]), v[1]);
            let out = if self.alias { x } else { rows_of(&v[2]) };
            Op::RmsNorm(ops::RmsNorm {
                x,
                w,
                out,
                rows,
                dim,
                eps,
            })
        }
    }
    fn tol(&self) -> Tol {
        Tol::Rel(1e-5)
    }
}

fn norm_cases(rng: &mut Rng) -> Vec<NormCase> {
    let mut out = Vec::new();
    // (rows, dim, shift): odd sizes (scalar path), the decode widths (4096 at 1024 threads,
    // 5120 at 640 × 2 packs, 8192 at 1024 × 2), a misaligned view, and rows longer than the
    // register cache (16388: 832 threads × 5 packs; 16387 also on the scalar path).
    let shapes = [
        (1usize, 1usize, 0usize),
        (3, 7, 0),
        (3, 128, 1),
        (1, 4096, 0),
        (1, 4096, 1),
        (3, 5120, 0),
        (1, 8192, 0),
        (3, 16388, 0),
        (1, 16387, 0),
    ];
    for w_dtype in DType::ALL {
        for (i, &(rows, dim, shift)) in shapes.iter().enumerate() {
            for add in [false, true] {
                let n = shift + rows * dim;
                out.push(NormCase {
                    w_dtype,
                    rows,
                    dim,
                    add,
                    // Every other shape in place, alternating between the two ops.
                    alias: (i + usize::from(add)) % 2 == 1,
                    shift,
                    eps: if i % 2 == 0 { 1e-6 } else { 1e-5 },
                    x: f32s(rng, n, -6..=2),
                    delta: f32s(rng, n, -6..=2),
                    w: rng.bytes(w_dtype, dim, -1..=0),
                });
            }
        }
    }
    out
}

struct RopeCase {
    heads: usize,
    head_dim: usize,
    pos: Vec<u32>,
    x: Vec<u8>,
    inv_freq: Vec<u8>,
}

impl TwinCase for RopeCase {
    fn name(&self) -> String {
        format!(
            "rope rows {} heads {} head_dim {} pos {:?}",
            self.pos.len(),
            self.heads,
            self.head_dim,
            self.pos
        )
    }
    fn shape(&self) -> (DType, usize) {
        (DType::F32, self.pos.len() * self.heads * self.head_dim)
    }
    fn bufs(&self) -> Vec<Buf> {
        vec![
            Buf::inout(DType::F32, self.x.clone()),
            Buf::input(DType::F32, self.inv_freq.clone()),
            Buf::input(DType::U32, u32s(&self.pos)),
        ]
    }
    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        Op::Rope(ops::Rope {
            x: v[0],
            inv_freq: v[1],
            pos: v[2],
            rows: self.pos.len(),
            heads: self.heads,
            head_dim: self.head_dim,
        })
    }
    fn tol(&self) -> Tol {
        Tol::Rel(1e-5)
    }
}

fn rope_cases(rng: &mut Rng) -> Vec<RopeCase> {
    let mut out = Vec::new();
    // (heads, head_dim, positions, theta): one pair; three pairs; consecutive rows (prefill);
    // the Llama shape at decode; a long head (320 pairs: the block loops); non-consecutive and
    // large positions (angles of 1e5 rad); Qwen3.5's head_dim.
    let cases: [(usize, usize, Vec<u32>, f64); 7] = [
        (1, 2, vec![0, 1, 2], 10_000.0),
        (1, 6, vec![3], 10_000.0),
        (8, 128, vec![0, 1, 2], 500_000.0),
        (32, 128, vec![4095], 500_000.0),
        (3, 640, vec![7, 8, 9], 10_000.0),
        (5, 64, vec![131_071, 3, 100_000], 1_000_000.0),
        (2, 256, vec![0], 10_000.0),
    ];
    for (heads, head_dim, pos, theta) in cases {
        let n = pos.len() * heads * head_dim;
        out.push(RopeCase {
            heads,
            head_dim,
            x: f32s(rng, n, -6..=2),
            inv_freq: inv_freq(head_dim / 2, theta),
            pos,
        });
    }
    out
}

/// The tolerance of a case whose outputs are rounded once to a KV cache of dtype `kv`: the two
/// sides may round on either side of a boundary, one unit in the last place (up to 2^-7 of the
/// value for bf16, 2^-10 for f16); `f32` for an f32 cache.
pub(super) fn cache_tol(kv: DType, f32: f32) -> Tol {
    match kv {
        DType::F16 => Tol::Rel(1.0 / 1024.0),
        DType::BF16 => Tol::Rel(1.0 / 128.0),
        _ => Tol::Rel(f32),
    }
}

struct QkvCase {
    kv: DType,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// head_dim, or fewer for partial RoPE (Qwen3.5).
    rotary_dim: usize,
    cap: usize,
    pos: Vec<u32>,
    /// Each row's cache slot (empty: one sequence) and the slots in the cache (each `cap`
    /// rows).
    slots: Vec<u32>,
    nslots: usize,
    /// The q and k norm weights' dtypes (Qwen3), or none.
    norm: Option<(DType, DType)>,
    qkv: Vec<u8>,
    k_cache: Vec<u8>,
    v_cache: Vec<u8>,
    inv_freq: Vec<u8>,
    q_norm: Vec<u8>,
    k_norm: Vec<u8>,
}

impl TwinCase for QkvCase {
    fn name(&self) -> String {
        let norm = match self.norm {
            Some((q, k)) => format!(" q_norm {q} k_norm {k}"),
            None => String::new(),
        };
        let partial = match self.rotary_dim < self.head_dim {
            true => format!(" rotary_dim {}", self.rotary_dim),
            false => String::new(),
        };
        format!(
            "qkv_rope kv {} heads {}/{} head_dim {}{partial} cap {} pos {:?} slots {:?}{norm}",
            self.kv, self.heads, self.kv_heads, self.head_dim, self.cap, self.pos, self.slots
        )
    }
    fn shape(&self) -> (DType, usize) {
        (
            self.kv,
            self.pos.len() * (self.heads + 2 * self.kv_heads) * self.head_dim,
        )
    }
    fn bufs(&self) -> Vec<Buf> {
        let mut b = vec![
            Buf::input(DType::F32, self.qkv.clone()),
            Buf::output(DType::F32, self.pos.len() * self.heads * self.head_dim),
            // Random contents, compared in full: rows not at a position must stay as they are.
            Buf::partial(self.kv, self.k_cache.clone()),
            Buf::partial(self.kv, self.v_cache.clone()),
            Buf::input(DType::U32, u32s(&self.pos)),
            Buf::input(DType::F32, self.inv_freq.clone()),
            // (a slot buffer in every case, so that the norms are always buffers 7 and 8)
            Buf::input(
                DType::U32,
                u32s(if self.slots.is_empty() {
                    &[0]
                } else {
                    &self.slots
                }),
            ),
        ];
        if let Some((qd, kd)) = self.norm {
            b.push(Buf::input(qd, self.q_norm.clone()));
            b.push(Buf::input(kd, self.k_norm.clone()));
        }
        b
    }
    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        Op::QkvRope(ops::QkvRope {
            qkv: v[0],
            q: v[1],
            k_cache: v[2],
            v_cache: v[3],
            pos: v[4],
            slots: (!self.slots.is_empty()).then_some(ops::CacheSlots {
                ids: v[6],
                count: self.nslots,
            }),
            inv_freq: v[5],
            q_norm: v.get(7).copied(),
            k_norm: v.get(8).copied(),
            eps: 1e-6,
            rows: self.pos.len(),
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            rotary_dim: self.rotary_dim,
        })
    }
    fn tol(&self) -> Tol {
        cache_tol(self.kv, 2e-5)
    }
}

fn qkv_cases(rng: &mut Rng) -> Vec<QkvCase> {
    let mut out = Vec::new();
    // (heads, kv_heads, head_dim, cap, positions): rows with a position at or past cap
    // (nothing stored, q still written), the last cache row, an 8B model's shard at decode,
    // head_dim 256 (Qwen3.5) with one KV head, a single pair, a head longer than one block
    // pass (320 pairs); and partial RoPE (rotary_dim < head_dim: Qwen3.5's 64 of 256, a
    // tiny one, one whose unrotated part is longer than a block pass).
    // Then a batch in cache slots: three slots of 10 rows, an id past the last slot (clamped),
    // a position past the slot (not stored).
    let shapes: [(usize, usize, usize, usize, usize, Vec<u32>); 10] = [
        (4, 2, 8, 8, 10, vec![5, 6, 12]),
        (32, 8, 128, 128, 16, vec![15]),
        (8, 1, 256, 256, 16, vec![16]),
        (2, 2, 2, 2, 4, vec![0, 1, 2]),
        (1, 1, 640, 640, 4, vec![3, 0, 9]),
        (4, 4, 64, 64, 8, vec![1, 100_000, 2]),
        (6, 1, 256, 64, 16, vec![16, 3]),
        (8, 4, 32, 8, 12, vec![0, 5, 11]),
        (1, 1, 640, 2, 4, vec![2]),
        (4, 2, 8, 8, 10, vec![5, 9, 12, 0, 3]),
    ];
    for kv in DType::ALL {
        for (heads, kv_heads, head_dim, rotary_dim, cap, pos) in shapes.iter().cloned() {
            for norm in [
                None,
                Some((DType::BF16, DType::BF16)),
                Some((DType::F32, DType::F16)),
            ] {
                let width = (heads + 2 * kv_heads) * head_dim;
                let (slots, nslots) = match pos.len() {
                    5 => (vec![2u32, 0, 1, 9, 2], 3),
                    _ => (vec![], 1),
                };
                let cache = nslots * cap * kv_heads * head_dim;
                let (qd, kd) = norm.unwrap_or((DType::F32, DType::F32));
                out.push(QkvCase {
                    kv,
                    heads,
                    kv_heads,
                    head_dim,
                    rotary_dim,
                    cap,
                    pos: pos.clone(),
                    slots,
                    nslots,
                    norm,
                    qkv: f32s(rng, pos.len() * width, -6..=2),
                    k_cache: rng.bytes(kv, cache, -3..=3),
                    v_cache: rng.bytes(kv, cache, -3..=3),
                    inv_freq: inv_freq(rotary_dim / 2, 1_000_000.0),
                    q_norm: rng.bytes(qd, head_dim, -1..=0),
                    k_norm: rng.bytes(kd, head_dim, -1..=0),
                });
            }
        }
    }
    out
}

#[derive(Clone, Copy, PartialEq)]
enum Alias {
    None,
    /// out is the first input.
    A,
    /// out is the second input.
    B,
}

/// Which elementwise op a [`BinaryCase`] runs.
#[derive(Clone, Copy, PartialEq)]
enum BinKind {
    Add,
    SiluMul,
    SigmoidMul,
}

struct BinaryCase {
    kind: BinKind,
    n: usize,
    alias: Alias,
    /// Elements before all three views.
    shift: usize,
    a: Vec<u8>,
    b: Vec<u8>,
}

impl TwinCase for BinaryCase {
    fn name(&self) -> String {
        let alias = match self.alias {
            Alias::None => "",
            Alias::A => " out=a",
            Alias::B => " out=b",
        };
        format!(
            "{} n {}{alias} shift {}",
            match self.kind {
                BinKind::Add => "add",
                BinKind::SiluMul => "silu_mul",
                BinKind::SigmoidMul => "sigmoid_mul",
            },
            self.n,
            self.shift
        )
    }
    fn shape(&self) -> (DType, usize) {
        (DType::F32, self.n)
    }
    fn bufs(&self) -> Vec<Buf> {
        let buf = |bytes: &Vec<u8>, written: bool| match written {
            true => Buf::inout(DType::F32, bytes.clone()),
            false => Buf::input(DType::F32, bytes.clone()),
        };
        let mut v = vec![
            buf(&self.a, self.alias == Alias::A),
            buf(&self.b, self.alias == Alias::B),
        ];
        if self.alias == Alias::None {
            v.push(Buf::output(DType::F32, self.shift + self.n));
        }
        v
    }
    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        let (a, b) = (
            v[0].slice(self.shift, self.n),
            v[1].slice(self.shift, self.n),
        );
        let out = match self.alias {
            Alias::None => v[2].slice(self.shift, self.n),
            Alias::A => a,
            Alias::B => b,
        };
        match self.kind {
            BinKind::SiluMul => Op::SiluMul(ops::SiluMul {
                gate: a,
                up: b,
                out,
            }),
            BinKind::SigmoidMul => Op::SigmoidMul(ops::SigmoidMul { x: a, gate: b, out }),
            BinKind::Add => Op::Add(ops::Add { a, b, out }),
        }
    }
    fn tol(&self) -> Tol {
        match self.kind {
            // expf ≤ 2 ulp, then one division (and a product): a few ulp.
            BinKind::SiluMul | BinKind::SigmoidMul => Tol::Rel(1e-6),
            BinKind::Add => Tol::Exact,
        }
    }
}

fn binary_cases(rng: &mut Rng) -> Vec<BinaryCase> {
    let mut out = Vec::new();
    let shapes = [
        (1usize, 0usize),
        (7, 0),
        (4096, 0),
        (4096, 1),
        (5120, 0),
        (100_003, 2),
    ];
    for kind in [BinKind::Add, BinKind::SiluMul, BinKind::SigmoidMul] {
        for &(n, shift) in &shapes {
            for alias in [Alias::None, Alias::A, Alias::B] {
                // Gates up to 32 (e^32 is finite; e^−g overflows only below −88): silu_mul's
                // is a, sigmoid_mul's is b.
                let (ea, eb) = match kind {
                    BinKind::Add => (-20..=10, -6..=2),
                    BinKind::SiluMul => (-6..=4, -6..=2),
                    BinKind::SigmoidMul => (-6..=2, -6..=4),
                };
                let a = f32s(rng, shift + n, ea);
                let b = f32s(rng, shift + n, eb);
                out.push(BinaryCase {
                    kind,
                    n,
                    alias,
                    shift,
                    a,
                    b,
                });
            }
        }
    }
    out
}

/// Runs every case of one kind.
fn run_all<C: TwinCase>(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    cases: Vec<C>,
    out: &mut Vec<SelftestResult>,
) -> Result<()> {
    for c in &cases {
        out.push(twin::run(gpu, cpu, c)?);
    }
    Ok(())
}

/// This family's twin cases (see `twin`).
pub(crate) fn selftest(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    seed: u64,
) -> Result<Vec<SelftestResult>> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    run_all(gpu, cpu, fill_cases(), &mut out)?;
    run_all(gpu, cpu, embedding_cases(&mut rng), &mut out)?;
    run_all(gpu, cpu, norm_cases(&mut rng), &mut out)?;
    run_all(gpu, cpu, rope_cases(&mut rng), &mut out)?;
    run_all(gpu, cpu, qkv_cases(&mut rng), &mut out)?;
    run_all(gpu, cpu, binary_cases(&mut rng), &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuBuf;
    use crate::Device;

    const SOURCE: &str = include_str!("../gpu/decode.cu");

    #[test]
    fn names_are_indexed_by_dtype_and_defined_in_the_source() {
        for (i, d) in DType::ALL.into_iter().enumerate() {
            assert_eq!(dtype_index(d).unwrap(), i);
            assert_eq!(NAMES[EMBEDDING + i], format!("embedding_{d}"));
            assert_eq!(NAMES[RMS_NORM + i], format!("rms_norm_{d}"));
            assert_eq!(NAMES[ADD_RMS_NORM + i], format!("add_rms_norm_{d}"));
            assert_eq!(NAMES[QKV_ROPE + i], format!("qkv_rope_{d}"));
        }
        assert_eq!(
            [
                NAMES[FILL],
                NAMES[ROPE],
                NAMES[SILU_MUL],
                NAMES[ADD],
                NAMES[SIGMOID_MUL]
            ],
            ["fill", "rope", "silu_mul", "add", "sigmoid_mul"]
        );
        for name in NAMES {
            let defined = SOURCE
                .lines()
                .filter(|l| l.starts_with("extern \"C\" __global__"))
                .any(|l| l.contains(&format!(" {name}(")));
            assert!(defined, "{name} is not an extern \"C\" kernel of decode.cu");
        }
    }

    #[test]
    fn cu_defines_match_rust_constants() {
        let def = |name: &str| crate::cuda::twin::testing::cu_define(SOURCE, name);
        assert_eq!(def("TP_NORM_THREADS"), NORM_THREADS.to_string());
        assert_eq!(def("TP_PAIR_THREADS"), PAIR_THREADS.to_string());
        assert_eq!(def("TP_THREADS"), THREADS.to_string());
    }

    #[test]
    fn blocks_are_whole_waves_and_balanced() {
        for dim in [
            1usize, 3, 4, 7, 128, 4096, 5120, 8192, 16384, 16387, 16388, 100_000,
        ] {
            let t = norm_threads(dim) as usize;
            assert!(
                t.is_multiple_of(WAVE_MULTIPLE) && (WAVE_MULTIPLE..=NORM_THREADS).contains(&t),
                "{dim}: {t}"
            );
            let packs = dim.div_ceil(4);
            let per = packs.div_ceil(t);
            // No more packs per thread than the fewest 1024 threads would need.
            assert_eq!(per, packs.div_ceil(NORM_THREADS), "{dim}: {t}");
        }
        assert_eq!(norm_threads(4096), 1024);
        assert_eq!(norm_threads(5120), 640);
        assert_eq!(norm_threads(8192), 1024);
        for (half, t) in [(1usize, 64u32), (64, 64), (65, 128), (128, 128), (320, 256)] {
            assert_eq!(pair_threads(half), t);
        }
    }

    fn cpu_bufs(dev: &CpuDevice, spec: &[Buf]) -> Vec<CpuBuf> {
        spec.iter()
            .map(|b| {
                let bytes = b.len * b.dtype.size();
                let buf = dev.alloc(bytes.max(1)).unwrap();
                let init = b.init.clone().unwrap_or_else(|| vec![0xff; bytes]);
                dev.write(&buf, 0, &init).unwrap();
                buf
            })
            .collect()
    }

    /// Every case is a valid op (shapes, aliasing) that the CPU twin runs.
    fn cpu_runs<C: TwinCase>(cases: Vec<C>) -> usize {
        let dev = CpuDevice::new(0, 2, 0);
        for c in &cases {
            let spec = c.bufs();
            let bufs = cpu_bufs(&dev, &spec);
            let views: Vec<View<'_, CpuBuf>> = bufs
                .iter()
                .zip(&spec)
                .map(|(b, s)| View::new(b, 0, s.len, s.dtype))
                .collect();
            dev.run(&c.op(&views))
                .unwrap_or_else(|e| panic!("{}: {e}", c.name()));
            assert!(!c.name().is_empty() && c.shape().1 > 0);
        }
        cases.len()
    }

    #[test]
    fn every_twin_case_runs_on_the_cpu() {
        let mut rng = Rng::new(5);
        let n = cpu_runs(fill_cases())
            + cpu_runs(embedding_cases(&mut rng))
            + cpu_runs(norm_cases(&mut rng))
            + cpu_runs(rope_cases(&mut rng))
            + cpu_runs(qkv_cases(&mut rng))
            + cpu_runs(binary_cases(&mut rng));
        assert!(n > 150, "{n} cases");
    }

    #[test]
    fn qkv_cases_cover_positions_past_the_cache_and_both_norms() {
        let cases = qkv_cases(&mut Rng::new(1));
        assert!(cases
            .iter()
            .any(|c| c.pos.iter().any(|&p| p as usize >= c.cap)));
        assert!(cases
            .iter()
            .any(|c| c.pos.iter().any(|&p| p as usize == c.cap - 1)));
        assert!(cases.iter().any(|c| c.norm.is_some()) && cases.iter().any(|c| c.norm.is_none()));
        for kv in DType::ALL {
            assert!(cases.iter().any(|c| c.kv == kv));
        }
    }
}
