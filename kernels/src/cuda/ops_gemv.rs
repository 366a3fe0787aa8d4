//! Launchers of `kernels/src/gpu/gemv.cu`: `Matmul` (`y = f(x) · wᵀ (+ bias)`), one launch
//! per call, the decode matrix–vector product when m = 1 and the token-tiled product of
//! prefill when m > 1; `AddNormMatmul` and `QkvMatmul` (the q|k|v product with QkvRope's work
//! in its epilogue); and their twin cases.
//!
//! Owns: the kernel choice (m, prologue, weight dtype), the grid, the 16-byte-path decision.
//! Must not: allocate or synchronise (captured into the decode graph).
//!
//! Bandwidth measured on one H200 (bf16, m = 1; the table and its method are in gemv.cu's
//! header): [28672, 4096], [4096, 14336] and [128256, 4096] at 100–107 % of the 4.2 TB/s copy
//! ceiling, [4096, 14336] with the SiluMul prologue at 90–92 %, [6144, 4096] at 86 % and
//! [4096, 4096] at 79 %: a fixed ~2 µs per launch weighs on the short kernels.

use super::launch::Launcher;
use super::mem::CudaBuf;
use super::program::Module;
use super::selftest::Rng;
use super::twin::{self, Buf, Tol, TwinCase};
use super::{CudaDevice, SelftestResult};
use crate::cpu::CpuDevice;
use crate::device::{Op, View};
use crate::ops::{AddNormMatmul, Epilogue, Matmul, Prologue, QkvRope};
use crate::{DType, KernelError, Result};

/// The kernels of gemv.cu, in the order the launchers index them: [`kernel_index`].
pub(crate) const NAMES: &[&str] = &[
    "gemv_f32",
    "gemv_f16",
    "gemv_bf16",
    "gemv_silu_f32",
    "gemv_silu_f16",
    "gemv_silu_bf16",
    "gemv_norm_f32",
    "gemv_norm_f16",
    "gemv_norm_bf16",
    "gemv_glu_f32",
    "gemv_glu_f16",
    "gemv_glu_bf16",
    "gemm4_f32",
    "gemm4_f16",
    "gemm4_bf16",
    "gemm4_silu_f32",
    "gemm4_silu_f16",
    "gemm4_silu_bf16",
    "gemm4_norm_f32",
    "gemm4_norm_f16",
    "gemm4_norm_bf16",
    "gemm4_glu_f32",
    "gemm4_glu_f16",
    "gemm4_glu_bf16",
    "gemm_f32",
    "gemm_f16",
    "gemm_bf16",
    "gemm_silu_f32",
    "gemm_silu_f16",
    "gemm_silu_bf16",
    "gemm_norm_f32",
    "gemm_norm_f16",
    "gemm_norm_bf16",
    "gemm_glu_f32",
    "gemm_glu_f16",
    "gemm_glu_bf16",
    "gemm16_tc_bf16",
    "gemm16_tc_norm_bf16",
    "gemm16_tc_glu_bf16",
    "gemm32_tc_bf16",
    "gemm32_tc_norm_bf16",
    "gemm32_tc_glu_bf16",
    "gemv_rope_f32",
    "gemv_rope_f16",
    "gemv_rope_bf16",
    "gemv_norm_rope_f32",
    "gemv_norm_rope_f16",
    "gemv_norm_rope_bf16",
];

/// What a kernel does around the product (gemv.cu TP_ACT_*): a [`Matmul`]'s prologue on x,
/// [`AddNormMatmul`]'s residual add + RMSNorm, or a [`Matmul`]'s SiluMul epilogue (`Glu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Act {
    None,
    Silu,
    Norm,
    Glu,
}

impl Act {
    /// A [`Matmul`]'s kernel kind (validate() refuses a SiluMul prologue with the epilogue).
    fn of(a: &Matmul<'_, CudaBuf>) -> Act {
        match (a.prologue, a.epilogue) {
            (_, Epilogue::SiluMul) => Act::Glu,
            (Prologue::SiluMul, _) => Act::Silu,
            (Prologue::None, Epilogue::None) => Act::None,
        }
    }
}

/// Output rows per wave (gemv.cu TP_GEMV_ROWS): every kernel but `gemv_silu_*`.
const ROWS: usize = 2;
/// Output rows per wave of `gemv_silu_*` (gemv.cu TP_GEMV_ROWS_SILU).
const ROWS_SILU: usize = 4;
/// Output rows per wave of `gemv_norm_*` (gemv.cu TP_GEMV_ROWS_NORM).
const ROWS_NORM: usize = 4;
/// Product rows per wave of `gemv_glu_*`, half gate and half up (gemv.cu TP_GEMV_ROWS_GLU).
const ROWS_GLU: usize = 4;
/// Tokens per tile of `gemm_*` (gemv.cu TP_GEMV_TOKENS).
const TOKENS: usize = 8;
/// Tokens per tile of `gemm4_*`, for 2 to 4 tokens (gemv.cu TP_GEMV_TOKENS_SMALL).
const TOKENS_SMALL: usize = 4;
/// Output rows per wave of the tiled kernels (gemv.cu TP_GEMM_ROWS).
const ROWS_TILED: usize = 4;
/// Lanes of a wave on every NVIDIA GPU (portable.h TP_WAVE).
const WAVE: u32 = 32;
/// Waves per block when the shape gives every SM at least two blocks of them. Measured on the
/// H200: 2, 4 and 8 waves per block within 2 % of each other on the decode shapes; fewer
/// waves per block only matter for small n, where they spread the waves over more SMs.
const MAX_WAVES: usize = 4;
/// CUDA's limit on gridDim.y; the kernel loops over the row groups beyond it.
const MAX_GRID_Y: usize = 65535;
/// First of the tensor-core kernels in [`NAMES`] (gemv.cu `gemm_tc`): 3 · family (16, 32
/// tokens per tile) + act (none, norm, glu).
const TC_BASE: usize = 36;
/// First of the q|k|v epilogue's kernels in [`NAMES`] (`ops::QkvMatmul`): 3 · act (none,
/// norm) + weight dtype.
const ROPE_BASE: usize = 42;
/// Warps per block of the tensor-core kernels, splitting k (gemv.cu TP_TC_WARPS).
const TC_WARPS: u32 = 8;
/// 16-row mma tiles per block of the tensor-core kernels (gemv.cu TP_TC_TILES).
const TC_TILES: usize = 2;

/// gemv.cu `struct GemvParams`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GemvParams {
    x: u64,
    w: u64,
    bias: u64,
    y: u64,
    m: u32,
    k: u32,
    n: u32,
    vec: u32,
    delta: u64,
    norm_w: u64,
    x_out: u64,
    eps: f32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<GemvParams>() == 80);

/// gemv.cu `struct GemvRope`: the q|k|v epilogue's outputs.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GemvRope {
    q: u64,
    k_cache: u64,
    v_cache: u64,
    pos: u64,
    slots: u64,
    inv_freq: u64,
    cap: u64,
    heads: u32,
    kv_heads: u32,
    half: u32,
    nslots: u32,
    kv_dtype: u32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<GemvRope>() == 80);

/// gemv.cu `struct GemvRopeParams`, passed by value to gemv_rope_* and gemv_norm_rope_*.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GemvRopeParams {
    g: GemvParams,
    r: GemvRope,
}
const _: () = assert!(std::mem::size_of::<GemvRopeParams>() == 160);

/// Index into [`NAMES`]: 12 · family (m = 1, m ≤ [`TOKENS_SMALL`], more) + 3 · act (none,
/// silu, norm, glu) + weight dtype (f32, f16, bf16).
fn kernel_index(m: usize, act: Act, dtype: DType) -> Result<usize> {
    let d = super::ops_decode::dtype_index(dtype)
        .map_err(|_| KernelError::Invalid("matmul: u32 weights".into()))?;
    let family = match m {
        0 | 1 => 0,
        2..=TOKENS_SMALL => 1,
        _ => 2,
    };
    Ok(12 * family + 3 * act as usize + d)
}

/// What one launch needs: the kernel, grid and block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    index: usize,
    grid: (u32, u32, u32),
    block: u32,
}

/// One wave per row group of R outputs; `MAX_WAVES` waves per block, halved while that would
/// leave fewer than two blocks per SM. When m > 1, the token tiles go along grid x and the
/// row groups' blocks along y (gemv.cu: a row group's tiles side by side share its weights
/// through L2).
fn plan(m: usize, n: usize, act: Act, rope: bool, dtype: DType, sms: u32) -> Result<Plan> {
    let index = match rope {
        // m = 1 and act None or Norm (QkvMatmul's validate and the launcher).
        true => ROPE_BASE + 3 * usize::from(act == Act::Norm) + kernel_index(1, Act::None, dtype)?,
        false => kernel_index(m, act, dtype)?,
    };
    let rows = match (m, act) {
        (1, Act::Silu) => ROWS_SILU,
        (1, Act::Norm) => ROWS_NORM,
        (1, Act::None) => ROWS,
        (1, Act::Glu) => ROWS_GLU,
        _ => ROWS_TILED,
    };
    // A row group of the epilogues' kernels is rows / 2 outputs (their gate and up rows) or
    // rows / 2 rope pairs.
    let groups = match act {
        _ if rope => (n / 2).div_ceil(rows / 2),
        Act::Glu => (n / 2).div_ceil(rows / 2),
        _ => n.div_ceil(rows),
    };
    let mut waves = MAX_WAVES;
    while waves > 1 && groups.div_ceil(waves) < 2 * sms as usize {
        waves /= 2;
    }
    // groups <= n < 2^31 (checked by the caller), so both fit the grid's u32.
    let blocks = groups.div_ceil(waves);
    let grid = match m {
        0 | 1 => (blocks as u32, 1, 1),
        2..=TOKENS_SMALL => (1, blocks.min(MAX_GRID_Y) as u32, 1),
        _ => (m.div_ceil(TOKENS) as u32, blocks.min(MAX_GRID_Y) as u32, 1),
    };
    Ok(Plan {
        index,
        grid,
        block: waves as u32 * WAVE,
    })
}

/// The tensor-core kernel for a batch of bf16 products, where one applies: m > 4 (below, the
/// SIMT kernels' few tokens per weight load already keep up with HBM), sm_80+ (`mma`), the
/// 16-byte path (`vec`), and no SiluMul prologue (int4's down_proj input; dense models take the
/// epilogue instead). Tiles of 16 tokens up to m = 16, else of 32, along grid x; blocks of
/// [`TC_TILES`] · 16 rows (8 outputs per tile with the epilogue) along y.
fn tc_plan(m: usize, n: usize, act: Act, dtype: DType, mma: bool, vec: bool) -> Option<Plan> {
    if !(mma && vec && dtype == DType::BF16 && m > TOKENS_SMALL) {
        return None;
    }
    let a = match act {
        Act::None => 0,
        Act::Norm => 1,
        Act::Glu => 2,
        Act::Silu => return None,
    };
    let (family, tile) = if m <= 16 { (0, 16) } else { (1, 32) };
    let outs = match act {
        Act::Glu => n / 2,
        _ => n,
    };
    let per_block = TC_TILES * if act == Act::Glu { 8 } else { 16 };
    Some(Plan {
        index: TC_BASE + 3 * family + a,
        grid: (
            m.div_ceil(tile) as u32,
            outs.div_ceil(per_block).min(MAX_GRID_Y) as u32,
            1,
        ),
        block: TC_WARPS * WAVE,
    })
}

/// AddNormMatmul's extra inputs, as the kernel takes them.
struct NormIn<'v> {
    delta: &'v View<'v, CudaBuf>,
    norm_w: &'v View<'v, CudaBuf>,
    x_out: Option<&'v View<'v, CudaBuf>>,
    eps: f32,
}

/// Queues one op of this family.
pub(crate) fn launch(l: &Launcher<'_>, op: &Op<'_, CudaBuf>) -> Result<()> {
    match op {
        Op::Matmul(a) => gemv(
            l,
            (&a.x, &a.w, a.bias.as_ref(), &a.y),
            (a.m, a.k, a.n),
            Act::of(a),
            None,
            None,
        ),
        Op::AddNormMatmul(a) => gemv(
            l,
            (&a.x, &a.w, a.bias.as_ref(), &a.y),
            (a.m, a.k, a.n),
            Act::Norm,
            Some(NormIn {
                delta: &a.delta,
                norm_w: &a.norm_w,
                x_out: a.x_out.as_ref(),
                eps: a.eps,
            }),
            None,
        ),
        // y is the op's scratch: the kernel writes q and the caches instead.
        Op::QkvMatmul(a) => gemv(
            l,
            (&a.x, &a.w, a.bias.as_ref(), &a.rope.qkv),
            (1, a.k, a.n()),
            if a.seam.is_some() {
                Act::Norm
            } else {
                Act::None
            },
            a.seam.as_ref().map(|s| NormIn {
                delta: &s.delta,
                norm_w: &s.norm_w,
                x_out: s.x_out.as_ref(),
                eps: s.eps,
            }),
            Some(&a.rope),
        ),
        _ => Err(KernelError::Invalid(format!(
            "gemv launcher got '{}'",
            op.name()
        ))),
    }
}

type Operands<'v> = (
    &'v View<'v, CudaBuf>,
    &'v View<'v, CudaBuf>,
    Option<&'v View<'v, CudaBuf>>,
    &'v View<'v, CudaBuf>,
);

fn gemv(
    l: &Launcher<'_>,
    (x, w, bias, y): Operands<'_>,
    (m, k, n): (usize, usize, usize),
    act: Act,
    norm: Option<NormIn<'_>>,
    rope: Option<&QkvRope<'_, CudaBuf>>,
) -> Result<()> {
    let op = match (rope, act) {
        (Some(_), _) => "qkv_matmul",
        (None, Act::Norm) => "add_norm_matmul",
        (None, _) => "matmul",
    };
    let bad = |why: String| KernelError::Invalid(format!("{op}: {why}"));
    // The kernel indexes with u32 (row groups, tiles, packs); i32::MAX leaves it headroom.
    let limit = i32::MAX as usize;
    if m > limit || k > limit || n > limit {
        return Err(bad(format!("[{m}, {k}] x [{n}, {k}] exceeds 2^31")));
    }
    let addr = |v: &View<'_, CudaBuf>| v.buf.addr(v.offset, v.bytes());
    let (xa, wa, ya) = (addr(x)?, addr(w)?, addr(y)?);
    let ba = bias.map(addr).transpose()?.unwrap_or(0);
    let (da, na, oa) = match &norm {
        Some(nm) => (
            addr(nm.delta)?,
            addr(nm.norm_w)?,
            nm.x_out.map(addr).transpose()?.unwrap_or(0),
        ),
        None => (0, 0, 0),
    };
    let esize = w.dtype.size() as u64;
    let f32s = [xa, ya, ba, da, na, oa];
    if !(f32s.iter().all(|a| a.is_multiple_of(4)) && wa.is_multiple_of(esize)) {
        return Err(bad("a view is not aligned to its element size".into()));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    // The 16-byte path: every f32 row and w aligned, k whole packs (4 f32 or 8 f16/bf16 per
    // 16 bytes), so that every row of x, gate, up, delta, x_out and w starts aligned too.
    let pack = 16 / w.dtype.size();
    let vec = k.is_multiple_of(pack)
        && wa.is_multiple_of(16)
        && [xa, da, na, oa].iter().all(|a| a.is_multiple_of(16));
    let p = match tc_plan(m, n, act, w.dtype, l.mma, vec) {
        Some(p) if rope.is_none() => p,
        _ => plan(m, n, act, rope.is_some(), w.dtype, l.sms)?,
    };
    let mut params = GemvParams {
        x: xa,
        w: wa,
        bias: ba,
        y: ya,
        m: m as u32,
        k: k as u32,
        n: n as u32,
        vec: u32::from(vec),
        delta: da,
        norm_w: na,
        x_out: oa,
        eps: norm.as_ref().map_or(0.0, |nm| nm.eps),
        pad: 0,
    };
    let f = l.kernels.func(Module::Gemv, p.index);
    let Some(r) = rope else {
        // SAFETY: GemvParams mirrors gemv.cu's parameter struct (size asserted above); every
        // address was bounds-checked for the whole view (validate() fixed the views' lengths
        // to the shapes the kernel reads and writes), and the views' buffers outlive the
        // queued launch (callers keep them until the stream is synchronised or the graph
        // destroyed).
        return unsafe { l.launch_fn(f, p.grid, p.block, 0, &mut params) };
    };
    let u32_of = |what: &str, v: usize| super::ops_decode::to_u32(&format!("{op} {what}"), v);
    let mut rp = GemvRopeParams {
        g: params,
        r: GemvRope {
            q: addr(&r.q)?,
            k_cache: addr(&r.k_cache)?,
            v_cache: addr(&r.v_cache)?,
            pos: addr(&r.pos)?,
            slots: r.slots.map(|s| addr(&s.ids)).transpose()?.unwrap_or(0),
            inv_freq: addr(&r.inv_freq)?,
            cap: r.cap() as u64,
            heads: u32_of("heads", r.heads)?,
            kv_heads: u32_of("kv_heads", r.kv_heads)?,
            half: u32_of("head_dim", r.head_dim / 2)?,
            nslots: u32_of("slots", r.slots.map_or(1, |s| s.count))?,
            kv_dtype: super::ops_decode::dtype_index(r.k_cache.dtype)? as u32,
            pad: 0,
        },
    };
    // SAFETY: as above, with GemvRopeParams mirroring gemv.cu's (size asserted); q, the
    // caches, pos, the slot ids and inv_freq were bounds-checked for the lengths QkvRope's
    // validate() tied to the shape, and cache rows are written only below cap.
    unsafe { l.launch_fn(f, p.grid, p.block, 0, &mut rp) }
}

/// The shape of a twin case: `y = f(x) · wᵀ (+ bias)` with x and w starting `offset`
/// elements into their buffers (a non-zero offset breaks 16-byte alignment, so the scalar
/// path runs).
#[derive(Clone, Copy, Debug)]
struct Spec {
    m: usize,
    k: usize,
    n: usize,
    dtype: DType,
    bias: bool,
    act: Act,
    offset: usize,
}

impl Spec {
    /// Elements of one row of x.
    fn xk(&self) -> usize {
        match self.act {
            Act::Silu => 2 * self.k,
            Act::None | Act::Norm | Act::Glu => self.k,
        }
    }

    /// Elements of one row of y.
    fn yn(&self) -> usize {
        match self.act {
            Act::Glu => self.n / 2,
            _ => self.n,
        }
    }
}

/// A twin case: its shape and its inputs (`d`, `g`: AddNormMatmul's delta and norm weights).
struct MatmulCase {
    s: Spec,
    x: Vec<u8>,
    w: Vec<u8>,
    b: Vec<u8>,
    d: Vec<u8>,
    g: Vec<u8>,
}

/// The cases of [`specs`], generated one at a time so that only one case's inputs are in
/// memory; consecutive specs of the same weight shape share the weights (most of the data).
/// |x| in [1/8, 4), |w| in [1/32, 1): |y| of a few units at k = 4096, so the tolerance
/// (relative to 1 + |y|) is neither loose nor dominated by the 1.
fn cases(seed: u64) -> impl Iterator<Item = MatmulCase> {
    let mut rng = Rng::new(seed);
    let mut last: Option<(Spec, Vec<u8>)> = None;
    specs().into_iter().map(move |s| {
        let w = match &last {
            Some((p, w)) if (p.dtype, p.k, p.n, p.offset) == (s.dtype, s.k, s.n, s.offset) => {
                w.clone()
            }
            _ => pooled(&mut rng, s.dtype, s.offset + s.n * s.k, -5..=-1),
        };
        last = Some((s, w.clone()));
        let norm = s.act == Act::Norm;
        let mk = if norm { s.offset + s.m * s.k } else { 0 };
        MatmulCase {
            s,
            x: pooled(&mut rng, DType::F32, s.offset + s.m * s.xk(), -3..=1),
            w,
            b: pooled(&mut rng, DType::F32, s.n, -2..=2),
            d: pooled(&mut rng, DType::F32, mk, -3..=1),
            g: pooled(
                &mut rng,
                DType::F32,
                if norm { s.offset + s.k } else { 0 },
                -1..=1,
            ),
        }
    })
}

/// `n` random elements of `dtype` drawn from a pool of 4096 values of [`Rng::value`], five
/// 12-bit pool indices per generator step: ~30 times cheaper than a fresh value per element
/// (the cases hold ~60 M elements in all), and still a different-looking value at every
/// position, which is what catches a misplaced index.
fn pooled(rng: &mut Rng, dtype: DType, n: usize, exps: std::ops::RangeInclusive<i32>) -> Vec<u8> {
    const POOL: usize = 4096;
    let size = dtype.size();
    let pool = rng.bytes(dtype, POOL, exps);
    let mut out = vec![0u8; n * size];
    let mut r = 0u64;
    for (e, dst) in out.chunks_exact_mut(size).enumerate() {
        if e % 5 == 0 {
            r = rng.next();
        }
        let i = (r as usize) % POOL;
        r >>= 12;
        match size {
            2 => dst.copy_from_slice(&pool[i * 2..i * 2 + 2]),
            _ => dst.copy_from_slice(&pool[i * 4..i * 4 + 4]),
        }
    }
    out
}

impl TwinCase for MatmulCase {
    fn name(&self) -> String {
        format!(
            "matmul {} m {} k {} n {}{}{}{}",
            self.s.dtype,
            self.s.m,
            self.s.k,
            self.s.n,
            if self.s.bias { " bias" } else { "" },
            match self.s.act {
                Act::None => "",
                Act::Silu => " silu_mul",
                Act::Norm => " add_norm",
                Act::Glu => " then silu_mul",
            },
            if self.s.offset > 0 { " unaligned" } else { "" },
        )
    }

    fn shape(&self) -> (DType, usize) {
        (self.s.dtype, self.s.n * self.s.k)
    }

    /// x, w, [bias], y, then with AddNorm: delta, norm_w, x_out (written).
    fn bufs(&self) -> Vec<Buf> {
        let s = &self.s;
        let mut b = vec![
            Buf::input(DType::F32, self.x.clone()),
            Buf::input(s.dtype, self.w.clone()),
        ];
        if s.bias {
            b.push(Buf::input(DType::F32, self.b.clone()));
        }
        b.push(Buf::output(DType::F32, s.m * s.yn()));
        if s.act == Act::Norm {
            b.push(Buf::input(DType::F32, self.d.clone()));
            b.push(Buf::input(DType::F32, self.g.clone()));
            b.push(Buf::output(DType::F32, s.m * s.k));
        }
        b
    }

    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        let s = &self.s;
        let x = v[0].slice(s.offset, s.m * s.xk());
        let w = v[1].slice(s.offset, s.n * s.k);
        let bias = s.bias.then(|| v[2]);
        let y = v[2 + usize::from(s.bias)];
        match s.act {
            Act::Norm => {
                let e = 3 + usize::from(s.bias);
                Op::AddNormMatmul(AddNormMatmul {
                    x,
                    delta: v[e].slice(s.offset, s.m * s.k),
                    norm_w: v[e + 1].slice(s.offset, s.k),
                    x_out: Some(v[e + 2]),
                    eps: 1e-5,
                    w,
                    bias,
                    y,
                    m: s.m,
                    k: s.k,
                    n: s.n,
                })
            }
            act => Op::Matmul(Matmul {
                x,
                w,
                bias,
                y,
                m: s.m,
                k: s.k,
                n: s.n,
                prologue: if act == Act::Silu {
                    Prologue::SiluMul
                } else {
                    Prologue::None
                },
                epilogue: if act == Act::Glu {
                    Epilogue::SiluMul
                } else {
                    Epilogue::None
                },
            }),
        }
    }

    /// Both sides sum k f32 products in different orders (CPU: 16 lanes of k/16 terms, then
    /// a pairwise fold; GPU: fmaf chains of k/32 per lane, then a 5-level butterfly), each
    /// with a random-walk error of a few ε·sqrt(k)·max|partial sum| ≈ 6e-8 · 64 · |y| ≈ 4e-6
    /// · |y| at k = 4101; the GPU's __expf / __fdividef add a few 1e-7 relative per activated
    /// element, again ~sqrt(k) · 1e-7 · |y|. 1e-4 of (1 + |y|) is ~20× that; a wrong element,
    /// a missed row or a misplaced token is off by O(|y|).
    fn tol(&self) -> Tol {
        Tol::Rel(1e-4)
    }

    /// With the SiluMul epilogue, y = silu(a) · b of two such sums a and b (gate and up rows),
    /// each off by the error above relative to 1 + |a| (1 + |b|); y's error is then about
    /// |b| · |silu'(a)| · δa + |silu(a)| · δb, bounded by that relative error times
    /// (1 + |a|) · (1 + |b|), which can be ~30× 1 + |y| at k = 4096 (|a| ~ 27 and y small
    /// where a is near 0: a simulation of both summation orders gave 1.4e-3 of 1 + |y| but
    /// 2.8e-5 of (1 + |a|)(1 + |b|)). So the tolerance is taken relative to the latter,
    /// computed here in f64 from the inputs. A wrong row, token, bias or missing activation
    /// is still off by O(|y|).
    fn magnitudes(&self, buf: usize) -> Option<Vec<f32>> {
        let s = &self.s;
        if s.act != Act::Glu || buf != 2 + usize::from(s.bias) {
            return None;
        }
        let x = crate::dtype::decode(DType::F32, &self.x);
        let w = crate::dtype::decode(s.dtype, &self.w);
        let bias = crate::dtype::decode(DType::F32, &self.b);
        let (x, w) = (&x[s.offset..], &w[s.offset..]);
        Some(twin::glu_magnitudes(s.m, s.n / 2, |t, row| {
            let (xr, wr) = (&x[t * s.k..(t + 1) * s.k], &w[row * s.k..(row + 1) * s.k]);
            let d: f64 = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
            d + if s.bias { bias[row] as f64 } else { 0.0 }
        }))
    }
}

/// This family's twin cases (see `twin`): every (m, k, n) of m ∈ {1, 3, 9}, k ∈ {8, 1000,
/// 4096, 4101}, n ∈ {1, 37, 512} for every weight dtype, bias and prologue rotating through
/// the four combinations; unaligned views; and one decode-sized product whose grid fills
/// every SM. ~200 M multiply-adds on the CPU twin in all.
pub(crate) fn selftest(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    seed: u64,
) -> Result<Vec<SelftestResult>> {
    let mut out: Vec<SelftestResult> = cases(seed ^ 0x6765_6d76) // "gemv"
        .map(|c| twin::run(gpu, cpu, &c))
        .collect::<Result<_>>()?;
    for c in rope_cases(&mut Rng::new(seed ^ 0x7172_6f70)) {
        // "qrop"
        out.push(twin::run(gpu, cpu, &c)?);
    }
    Ok(out)
}

/// A twin case of [`QkvMatmul`](crate::ops::QkvMatmul): the q|k|v product of one token, its
/// seam folded in or not, with QkvRope's work as the epilogue.
struct RopeCase {
    dtype: DType,
    kv: DType,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    k: usize,
    cap: usize,
    pos: u32,
    /// The row's cache slot and the slots in the cache, or none (one sequence).
    slot: Option<(u32, usize)>,
    seam: bool,
    bias: bool,
    /// x, w, bias, delta, norm weights, the caches' initial contents, inv_freq.
    x: Vec<u8>,
    w: Vec<u8>,
    b: Vec<u8>,
    d: Vec<u8>,
    g: Vec<u8>,
    k_cache: Vec<u8>,
    v_cache: Vec<u8>,
    inv_freq: Vec<u8>,
}

impl RopeCase {
    fn n(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// The product's n sums in f64 (with the seam's add + norm), bias added.
    fn sums(&self) -> Vec<f64> {
        let dec = |t: DType, b: &[u8]| -> Vec<f64> {
            crate::dtype::decode(t, b)
                .into_iter()
                .map(f64::from)
                .collect()
        };
        let mut x = dec(DType::F32, &self.x);
        if self.seam {
            let (d, g) = (dec(DType::F32, &self.d), dec(DType::F32, &self.g));
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
            let ms = x.iter().map(|a| a * a).sum::<f64>() / self.k as f64;
            let inv = 1.0 / (ms + 1e-5).sqrt();
            x.iter_mut().zip(&g).for_each(|(a, b)| *a *= inv * b);
        }
        let w = dec(self.dtype, &self.w);
        let b = dec(DType::F32, &self.b);
        (0..self.n())
            .map(|r| {
                let dot: f64 = w[r * self.k..(r + 1) * self.k]
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| a * b)
                    .sum();
                dot + if self.bias { b[r] } else { 0.0 }
            })
            .collect()
    }
}

impl TwinCase for RopeCase {
    fn name(&self) -> String {
        format!(
            "qkv_matmul {} kv {} heads {}/{} head_dim {} k {} cap {} pos {}{}{}{}",
            self.dtype,
            self.kv,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.k,
            self.cap,
            self.pos,
            match self.slot {
                Some((s, c)) => format!(" slot {s} of {c}"),
                None => String::new(),
            },
            if self.seam { " add_norm" } else { "" },
            if self.bias { " bias" } else { "" },
        )
    }

    fn shape(&self) -> (DType, usize) {
        (self.dtype, self.n() * self.k)
    }

    /// x, w, bias, qkv (scratch), q, k_cache, v_cache, pos, inv_freq, slot id, delta,
    /// norm_w, x_out: every case has every buffer, so the indices are fixed.
    fn bufs(&self) -> Vec<Buf> {
        let k = self.k;
        vec![
            Buf::input(DType::F32, self.x.clone()),
            Buf::input(self.dtype, self.w.clone()),
            Buf::input(DType::F32, self.b.clone()),
            // The CPU writes the product here, the fused kernel nothing: not compared.
            Buf::input(DType::F32, vec![0; self.n() * 4]),
            Buf::output(DType::F32, self.heads * self.head_dim),
            // Random contents, compared in full: rows but the position's must stay as they are.
            Buf::partial(self.kv, self.k_cache.clone()),
            Buf::partial(self.kv, self.v_cache.clone()),
            Buf::input(DType::U32, super::ops_decode::u32s(&[self.pos])),
            Buf::input(DType::F32, self.inv_freq.clone()),
            Buf::input(
                DType::U32,
                super::ops_decode::u32s(&[self.slot.map_or(0, |s| s.0)]),
            ),
            Buf::input(DType::F32, self.d.clone()),
            Buf::input(DType::F32, self.g.clone()),
            Buf::output(DType::F32, if self.seam { k } else { 1 }),
        ]
    }

    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        Op::QkvMatmul(crate::ops::QkvMatmul {
            x: v[0],
            seam: self.seam.then_some(crate::ops::Seam {
                delta: v[10],
                norm_w: v[11],
                x_out: Some(v[12]),
                eps: 1e-5,
            }),
            w: v[1],
            bias: self.bias.then_some(v[2]),
            k: self.k,
            rope: QkvRope {
                qkv: v[3],
                q: v[4],
                k_cache: v[5],
                v_cache: v[6],
                pos: v[7],
                slots: self
                    .slot
                    .map(|(_, count)| crate::ops::CacheSlots { ids: v[9], count }),
                inv_freq: v[8],
                q_norm: None,
                k_norm: None,
                eps: 0.0,
                rows: 1,
                heads: self.heads,
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
                rotary_dim: self.head_dim,
            },
        })
    }

    /// Relative to [`RopeCase::magnitudes`]: the product's error as in [`MatmulCase::tol`],
    /// and a 16-bit cache's rounding (`cache_tol`).
    fn tol(&self) -> Tol {
        super::ops_decode::cache_tol(self.kv, 1e-4)
    }

    /// A rotated element o = a·c − b·s carries the errors of both sums of its pair: 1 + |a| +
    /// |b| (f64 sums), which can be far above 1 + |o|. Cache rows the op does not write: 1 +
    /// |value| (they must not change). x_out: the default.
    fn magnitudes(&self, buf: usize) -> Option<Vec<f32>> {
        let (half, d) = (self.head_dim / 2, self.head_dim);
        let y = self.sums();
        let pair = |head: usize, e: usize| {
            let i = head * d + e % half;
            (1.0 + y[i].abs() + y[i + half].abs()) as f32
        };
        match buf {
            // q is f32 whatever the cache: 1e-4 of its magnitude, whatever tol() allows the cache.
            4 => {
                let Tol::Rel(t) = self.tol() else {
                    unreachable!("tol() is relative")
                };
                let q = (0..self.heads * d).map(|j| pair(j / d, j % d) * 1e-4 / t);
                Some(q.collect())
            }
            5 | 6 => {
                let init = if buf == 5 {
                    &self.k_cache
                } else {
                    &self.v_cache
                };
                let mut m: Vec<f32> = crate::dtype::decode(self.kv, init)
                    .iter()
                    .map(|v| 1.0 + v.abs())
                    .collect();
                if (self.pos as usize) < self.cap {
                    let slot = self.slot.map_or(0, |(s, c)| (s as usize).min(c - 1));
                    let row = self.kv_heads * d;
                    let at = (slot * self.cap + self.pos as usize) * row;
                    let first = self.heads + if buf == 5 { 0 } else { self.kv_heads };
                    for j in 0..row {
                        m[at + j] = pair(first + j / d, j % d);
                    }
                }
                Some(m)
            }
            _ => None,
        }
    }
}

/// [`RopeCase`]s: every weight dtype and cache dtype, with and without the seam and bias, over
/// small heads (one pair each, odd head counts, k not a whole pack so the scalar path runs),
/// the last cache row, a position past the cache (q written, nothing stored) at an angle where
/// sincosf's slow reduction runs, a slot past the last (clamped); and Llama-3-8B's layout (32/8
/// heads of 128, k 4096).
fn rope_cases(rng: &mut Rng) -> Vec<RopeCase> {
    // (heads, kv_heads, head_dim, k, cap, pos, slot)
    type Shape = (usize, usize, usize, usize, usize, u32, Option<(u32, usize)>);
    let shapes: [Shape; 6] = [
        (4, 2, 8, 64, 10, 5, None),
        (3, 1, 2, 37, 4, 3, None),
        (2, 2, 6, 1000, 4, 100_000, None),
        (4, 2, 8, 64, 5, 2, Some((9, 3))),
        (1, 1, 64, 256, 6, 1, Some((1, 2))),
        (32, 8, 128, 4096, 16, 15, None),
    ];
    let mut out = Vec::new();
    for (di, dtype) in DType::ALL.into_iter().enumerate() {
        for (si, (heads, kv_heads, head_dim, k, cap, pos, slot)) in shapes.into_iter().enumerate() {
            for seam in [false, true] {
                // Every shape meets every cache dtype over the three weight dtypes, and bias
                // goes with and without the seam (alternating by shape).
                let kv = DType::ALL[(si + di) % 3];
                let bias = (si % 2 == 1) != seam;
                let n = (heads + 2 * kv_heads) * head_dim;
                let cache = slot.map_or(1, |s| s.1) * cap * kv_heads * head_dim;
                out.push(RopeCase {
                    dtype,
                    kv,
                    heads,
                    kv_heads,
                    head_dim,
                    k,
                    cap,
                    pos,
                    slot,
                    seam,
                    bias,
                    x: pooled(rng, DType::F32, k, -3..=1),
                    w: pooled(rng, dtype, n * k, -5..=-1),
                    b: pooled(rng, DType::F32, n, -2..=2),
                    d: pooled(rng, DType::F32, k, -3..=1),
                    g: pooled(rng, DType::F32, k, -1..=1),
                    k_cache: rng.bytes(kv, cache, -3..=3),
                    v_cache: rng.bytes(kv, cache, -3..=3),
                    inv_freq: super::ops_decode::inv_freq(head_dim / 2, 500_000.0),
                });
            }
        }
    }
    out
}

fn specs() -> Vec<Spec> {
    let spec = |m, k, n, dtype, bias, act, offset| Spec {
        m,
        k,
        n,
        dtype,
        bias,
        act,
        offset,
    };
    let (none, silu, norm, glu) = (Act::None, Act::Silu, Act::Norm, Act::Glu);
    let mut v = Vec::new();
    let mut i = 0usize;
    for dtype in DType::ALL {
        for k in [8usize, 1000, 4096, 4101] {
            for n in [1usize, 37, 512] {
                for m in [1usize, 3, 9] {
                    let (bias, act) = [
                        (false, none),
                        (true, silu),
                        (false, norm),
                        (true, glu),
                        (true, none),
                        (false, silu),
                        (true, norm),
                        (false, glu),
                    ][i % 8];
                    // The epilogue pairs gate and up rows: an even n (1 → 2, 37 → 38).
                    let n = if act == glu { n + n % 2 } else { n };
                    v.push(spec(m, k, n, dtype, bias, act, 0));
                    i += 1;
                }
            }
        }
        // Views one element off 16-byte alignment (x by 4 bytes, w by one element), with a k
        // that would otherwise take the 16-byte path.
        for (m, act) in [(1usize, none), (1, silu), (3, silu), (1, norm), (3, norm)] {
            v.push(spec(m, 1024, 37, dtype, true, act, 1));
        }
        for m in [1usize, 3, 9] {
            v.push(spec(m, 1024, 38, dtype, true, glu, 1));
        }
    }
    // Decode-sized: 2048 row groups of 2, 4 waves per block, several blocks per SM; the
    // prologues' 4-row groups; and prefills of 2 full tiles and a partial one.
    v.push(spec(1, 2048, 4096, DType::BF16, false, none, 0));
    v.push(spec(1, 2048, 4096, DType::BF16, false, silu, 0));
    v.push(spec(1, 4096, 6144, DType::BF16, false, norm, 0));
    v.push(spec(1, 1024, 8192, DType::BF16, false, glu, 0));
    v.push(spec(16, 512, 1000, DType::BF16, true, glu, 0));
    v.push(spec(19, 512, 1000, DType::F16, true, silu, 0));
    v.push(spec(19, 512, 1000, DType::BF16, true, norm, 0));
    // The tensor-core kernels (bf16, m > 4, aligned; the m = 9 cases above take them too):
    // partial tiles of 16 and of 32 tokens, n not a whole block, k not a whole step (1000 =
    // 31 steps of 32 and one of 8), several tiles along x.
    v.push(spec(16, 1000, 520, DType::BF16, false, none, 0));
    v.push(spec(40, 1024, 264, DType::BF16, true, glu, 0));
    v.push(spec(33, 2048, 100, DType::BF16, false, norm, 0));
    v.push(spec(64, 512, 1000, DType::BF16, true, none, 0));
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::encode;

    #[test]
    fn names_follow_the_index() {
        for (m, mp) in [(1usize, "gemv"), (2, "gemm4"), (4, "gemm4"), (5, "gemm")] {
            for (act, pp) in [
                (Act::None, ""),
                (Act::Silu, "_silu"),
                (Act::Norm, "_norm"),
                (Act::Glu, "_glu"),
            ] {
                for d in DType::ALL {
                    let i = kernel_index(m, act, d).unwrap();
                    assert_eq!(NAMES[i], format!("{mp}{pp}_{d}"));
                }
            }
        }
        assert!(kernel_index(1, Act::None, DType::U32).is_err());
        for (m, fp) in [
            (5usize, "gemm16"),
            (16, "gemm16"),
            (17, "gemm32"),
            (64, "gemm32"),
        ] {
            for (act, pp) in [(Act::None, ""), (Act::Norm, "_norm"), (Act::Glu, "_glu")] {
                let p = tc_plan(m, 64, act, DType::BF16, true, true).unwrap();
                assert_eq!(NAMES[p.index], format!("{fp}_tc{pp}_bf16"));
            }
        }
        assert_eq!(ROPE_BASE, TC_BASE + 6);
        for (a, pp) in [(0usize, ""), (1, "_norm")] {
            for (i, d) in DType::ALL.iter().enumerate() {
                assert_eq!(NAMES[ROPE_BASE + 3 * a + i], format!("gemv{pp}_rope_{d}"));
            }
        }
        assert_eq!(NAMES.len(), ROPE_BASE + 6);
    }

    /// Every QkvMatmul twin case is valid and its magnitudes fit its buffers; on the CPU twin
    /// (the reference the GPU is judged against) q equals the case's own f64 rotation of the
    /// f64 sums within the tolerance selftest applies. (The Llama-sized shape is left to
    /// selftest: it is slow unoptimised.)
    #[test]
    fn rope_cases_agree_with_their_f64_reference() {
        let cpu = CpuDevice::new(0, 1, 0);
        for c in rope_cases(&mut Rng::new(3)).iter().filter(|c| c.k <= 1000) {
            let out = twin::run_alone(&cpu, c).unwrap_or_else(|e| panic!("{}: {e}", c.name()));
            let lens: Vec<usize> = c.bufs().iter().map(|b| b.len).collect();
            for b in [4, 5, 6] {
                assert_eq!(c.magnitudes(b).unwrap().len(), lens[b], "{}", c.name());
            }
            let (y, half, d) = (c.sums(), c.head_dim / 2, c.head_dim);
            let q = crate::dtype::decode(DType::F32, &out[4]);
            let mags = c.magnitudes(4).unwrap();
            let Tol::Rel(t) = c.tol() else { panic!() };
            for (j, (&got, &mag)) in q.iter().zip(&mags).enumerate() {
                let (h, e) = (j / d, j % d);
                let (a, b) = (y[h * d + e % half], y[h * d + e % half + half]);
                let ang = (c.pos as f32
                    * 500_000f64.powf(-2.0 * (e % half) as f64 / d as f64) as f32)
                    as f64;
                let want = if e < half {
                    a * ang.cos() - b * ang.sin()
                } else {
                    b * ang.cos() + a * ang.sin()
                };
                let err = (got as f64 - want).abs();
                assert!(
                    err <= (t * mag) as f64,
                    "{}: q[{j}] {got} against {want}",
                    c.name()
                );
            }
        }
    }

    /// The tensor-core kernels run only where they apply: bf16, m > 4, aligned, sm_80+, no
    /// prologue; tiles and row blocks as gemv.cu maps them.
    #[test]
    fn tc_plan_applies_only_where_it_can() {
        let bf = DType::BF16;
        assert!(tc_plan(4, 4096, Act::None, bf, true, true).is_none());
        assert!(tc_plan(16, 4096, Act::None, DType::F16, true, true).is_none());
        assert!(tc_plan(16, 4096, Act::None, bf, false, true).is_none());
        assert!(tc_plan(16, 4096, Act::None, bf, true, false).is_none());
        assert!(tc_plan(16, 4096, Act::Silu, bf, true, true).is_none());
        // [4096, 4096] at m = 16: one tile, 4096 / 32 row blocks of 8 warps.
        let p = tc_plan(16, 4096, Act::None, bf, true, true).unwrap();
        assert_eq!((p.grid, p.block), ((1, 128, 1), 256));
        // gate|up [28672, 4096] with the epilogue at m = 64: 2 tiles of 32, 14336 outputs in
        // blocks of 16.
        let p = tc_plan(64, 28672, Act::Glu, bf, true, true).unwrap();
        assert_eq!(p.grid, (2, 896, 1));
        // A partial block: 37 rows in 2 blocks of 32.
        assert_eq!(
            tc_plan(9, 37, Act::Norm, bf, true, true).unwrap().grid,
            (1, 2, 1)
        );
    }

    /// The `#define`s of gemv.cu must equal the Rust mirrors, and the kernel macro must
    /// instantiate every dtype in NAMES' order.
    #[test]
    fn cu_defines_match_rust_constants() {
        let src = super::super::program::SOURCES[Module::Gemv as usize].1;
        let def = |name: &str| crate::cuda::twin::testing::cu_define(src, name);
        assert_eq!(def("TP_GEMV_ROWS"), ROWS.to_string());
        assert_eq!(def("TP_GEMV_ROWS_SILU"), ROWS_SILU.to_string());
        assert_eq!(def("TP_GEMV_ROWS_NORM"), ROWS_NORM.to_string());
        assert_eq!(def("TP_GEMV_ROWS_GLU"), ROWS_GLU.to_string());
        assert_eq!(def("TP_GEMV_TOKENS"), TOKENS.to_string());
        assert_eq!(def("TP_GEMV_TOKENS_SMALL"), TOKENS_SMALL.to_string());
        assert_eq!(def("TP_GEMM_ROWS"), ROWS_TILED.to_string());
        assert_eq!(def("TP_TC_WARPS"), TC_WARPS.to_string());
        assert_eq!(def("TP_TC_TILES"), TC_TILES.to_string());
        let order: Vec<usize> = ["(f32, F32)", "(f16, GemvF16)", "(bf16, BF16)"]
            .iter()
            .map(|d| {
                src.find(&format!("TP_GEMV_DTYPE{d}"))
                    .expect("instantiated")
            })
            .collect();
        assert!(order.windows(2).all(|p| p[0] < p[1]));
    }

    #[test]
    fn plan_fills_the_sms_and_tiles_tokens() {
        let sms = 132;
        // [4096, 4096] decode: 2048 row groups, 4 waves per block = 512 blocks.
        let p = plan(1, 4096, Act::None, false, DType::BF16, sms).unwrap();
        assert_eq!(
            p,
            Plan {
                index: 2,
                grid: (512, 1, 1),
                block: 128
            }
        );
        // down_proj with the prologue: 1024 groups of 4; 256 blocks of 4 waves would be under
        // 2 per SM, so 512 blocks of 2 waves.
        let p = plan(1, 4096, Act::Silu, false, DType::BF16, sms).unwrap();
        assert_eq!(
            p,
            Plan {
                index: 5,
                grid: (512, 1, 1),
                block: 64
            }
        );
        // Small n: one wave per block.
        let p = plan(1, 37, Act::None, false, DType::F32, sms).unwrap();
        assert_eq!(
            p,
            Plan {
                index: 0,
                grid: (19, 1, 1),
                block: 32
            }
        );
        // Prefill: 4-row groups whatever the prologue, tiles of 8 tokens along x.
        let p = plan(9, 512, Act::Silu, false, DType::F16, sms).unwrap();
        assert_eq!(
            p,
            Plan {
                index: 28,
                grid: (2, 128, 1),
                block: 32
            }
        );
        // A batch of 3: one tile of 4.
        let p = plan(3, 4096, Act::None, false, DType::BF16, sms).unwrap();
        assert_eq!(
            p,
            Plan {
                index: 14,
                grid: (1, 512, 1),
                block: 64
            }
        );
        // qkv with the add + norm folded in: 1536 groups of 4, 384 blocks of 4 waves.
        let p = plan(1, 6144, Act::Norm, false, DType::BF16, sms).unwrap();
        assert_eq!(
            p,
            Plan {
                index: 8,
                grid: (384, 1, 1),
                block: 128
            }
        );
        // gate|up with the SiluMul epilogue: 14336 outputs in groups of 2 (each with its 2
        // gate and 2 up rows): 7168 groups, 1792 blocks of 4 waves.
        let p = plan(1, 28672, Act::Glu, false, DType::BF16, sms).unwrap();
        assert_eq!(
            p,
            Plan {
                index: 11,
                grid: (1792, 1, 1),
                block: 128
            }
        );
        // The same q|k|v with the rope epilogue: 3072 pairs in groups of 2, the same grid.
        let p = plan(1, 6144, Act::Norm, true, DType::BF16, sms).unwrap();
        assert_eq!(
            p,
            Plan {
                index: ROPE_BASE + 5,
                grid: (384, 1, 1),
                block: 128
            }
        );
        assert_eq!(NAMES[p.index], "gemv_norm_rope_bf16");
        // Without the seam: pairs one per wave, as gemv_*'s 2-row groups.
        let p = plan(1, 6144, Act::None, true, DType::F16, sms).unwrap();
        assert_eq!((NAMES[p.index], p.grid), ("gemv_rope_f16", (768, 1, 1)));
        let p = plan(1 << 20, 1 << 20, Act::None, false, DType::BF16, sms).unwrap();
        assert_eq!(p.grid, (1 << 17, MAX_GRID_Y as u32, 1));
    }

    #[test]
    fn twin_cases_encode_their_lengths() {
        let s = Spec {
            m: 3,
            k: 10,
            n: 5,
            dtype: DType::BF16,
            bias: true,
            act: Act::Silu,
            offset: 1,
        };
        let mut rng = Rng::new(1);
        let c = MatmulCase {
            s,
            x: pooled(&mut rng, DType::F32, 1 + 3 * s.xk(), 0..=0),
            w: pooled(&mut rng, DType::BF16, 1 + 5 * 10, 0..=0),
            b: pooled(&mut rng, DType::F32, 5, 0..=0),
            d: Vec::new(),
            g: Vec::new(),
        };
        let b = c.bufs();
        assert_eq!(b.len(), 4);
        assert_eq!(
            (b[0].len, b[1].len, b[2].len, b[3].len),
            (1 + 60, 1 + 50, 5, 15)
        );
        assert_eq!(encode(DType::F32, &[1.0]).len(), 4);
    }

    /// Every twin case builds a valid op and runs on the CPU twin (what the GPU selftest
    /// will compare against), and the whole set stays cheap.
    #[test]
    fn every_twin_case_runs_on_the_cpu() {
        use crate::cpu::CpuDevice;
        use crate::Device;
        let cpu = CpuDevice::new(0, 2, 10);
        let t = std::time::Instant::now();
        let mut count = 0;
        for c in cases(7) {
            count += 1;
            let spec = c.bufs();
            let bufs: Vec<_> = spec
                .iter()
                .map(|b| {
                    let buf = cpu.alloc(b.len * b.dtype.size()).unwrap();
                    if let Some(init) = &b.init {
                        cpu.write(&buf, 0, init).unwrap();
                    }
                    buf
                })
                .collect();
            let views: Vec<_> = bufs
                .iter()
                .zip(&spec)
                .map(|(b, s)| View::new(b, 0, s.len, s.dtype))
                .collect();
            cpu.run(&c.op(&views))
                .unwrap_or_else(|e| panic!("{}: {e}", c.name()));
            if c.s.act == Act::Glu {
                glu_matches_f64(&c, &cpu, &bufs[2 + usize::from(c.s.bias)]);
            }
        }
        println!("{count} cases in {:?}", t.elapsed());
    }

    /// The SiluMul epilogue's meaning on the CPU twin: y[t, j] = silu(gate_j) · up_j with the
    /// gate rows first and the up rows second, bias added before, in f64 within the twin's
    /// tolerance of the case's magnitudes (which must cover every element).
    fn glu_matches_f64(c: &MatmulCase, cpu: &CpuDevice, y: &crate::cpu::CpuBuf) {
        use crate::Device;
        let s = &c.s;
        let h = s.n / 2;
        let mut raw = vec![0u8; s.m * h * 4];
        cpu.read(y, 0, &mut raw).unwrap();
        let got = crate::dtype::decode(DType::F32, &raw);
        let mags = c
            .magnitudes(2 + usize::from(s.bias))
            .expect("glu magnitudes");
        assert_eq!(mags.len(), got.len());
        let x = crate::dtype::decode(DType::F32, &c.x);
        let w = crate::dtype::decode(s.dtype, &c.w);
        let b = crate::dtype::decode(DType::F32, &c.b);
        let (x, w) = (&x[s.offset..], &w[s.offset..]);
        let dot = |t: usize, r: usize| -> f64 {
            let d: f64 = (0..s.k)
                .map(|i| x[t * s.k + i] as f64 * w[r * s.k + i] as f64)
                .sum();
            d + if s.bias { b[r] as f64 } else { 0.0 }
        };
        for t in 0..s.m {
            for j in 0..h {
                let (g, u) = (dot(t, j), dot(t, h + j));
                let want = g / (1.0 + (-g).exp()) * u;
                let i = t * h + j;
                assert!(
                    (got[i] as f64 - want).abs() <= 1e-4 * mags[i] as f64,
                    "{}: y[{t}, {j}] = {} against {want}",
                    c.name(),
                    got[i]
                );
            }
        }
    }

    /// The twin cases on the GPU where there is one (the same cases `tprun selftest` runs);
    /// "skipped: no GPU" otherwise, a failure under TPRUN_REQUIRE_GPU=1.
    #[test]
    fn gpu_matmul_matches_cpu_twin() {
        let Some(gpu) = crate::cuda::twin::testing::gpu_or_skip() else {
            return;
        };
        let cpu = CpuDevice::new(0, 4, 0);
        let res = selftest(&gpu, &cpu, 0x0074_7072_756e).unwrap();
        crate::cuda::twin::testing::assert_all_ok("matmul", &res);
    }
}
