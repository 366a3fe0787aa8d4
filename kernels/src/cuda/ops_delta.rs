//! Launchers of `kernels/src/gpu/delta.cu` (CausalConv, GatedDelta, GatedRmsNorm: the ops of a
//! Gated DeltaNet layer): the Rust mirrors of its parameter structs, the grid and block of
//! each kernel, the shape limits of the kernels, and the family's twin cases.
//!
//! Must not: allocate or synchronise (every launch here is captured into the decode graph).
//!
//! Grids depend only on the shapes, never on data: one captured launch serves every token.
//! Every view must start at a multiple of 4 bytes (f32; else `Invalid`); the kernels make
//! scalar accesses only, so no other alignment matters.

use super::launch::Launcher;
use super::mem::CudaBuf;
use super::ops_decode::f32s;
use super::program::Module;
use super::selftest::Rng;
use super::twin::{self, Buf, Tol, TwinCase};
use super::{CudaDevice, SelftestResult};
use crate::cpu::CpuDevice;
use crate::device::Op;
use crate::{ops, DType, KernelError, Result, View};

/// The kernels of delta.cu, in the order the launchers index them.
pub(crate) const NAMES: &[&str] = &[
    "causal_conv",
    "gated_delta_dk128",
    "gated_delta_dk256",
    "gated_rms_norm",
];
const CAUSAL_CONV: usize = 0;
/// dk ≤ 128; the next one takes dk ≤ [`DELTA_DKMAX`].
const GATED_DELTA_DK128: usize = 1;
const GATED_DELTA_DK256: usize = 2;
const GATED_RMS_NORM: usize = 3;

/// Threads of a causal_conv block (delta.cu TP_CONV_THREADS): one channel each.
const CONV_THREADS: u32 = 256;
/// Most conv taps (delta.cu TP_CONV_KMAX).
const CONV_KMAX: usize = 8;
/// Value columns per gated_delta block (delta.cu TP_DELTA_COLS).
const DELTA_COLS: usize = 16;
/// Threads of a gated_delta block (delta.cu TP_DELTA_THREADS).
const DELTA_THREADS: u32 = 256;
/// Largest dk the gated_delta kernels take (delta.cu TP_DELTA_DKMAX).
const DELTA_DKMAX: usize = 256;
/// What a model must fit ([`crate::Device::op_limits`]): the two bounds above.
pub(crate) const LIMITS: crate::device::OpLimits = crate::device::OpLimits {
    conv_taps: CONV_KMAX,
    delta_dk: DELTA_DKMAX,
};
/// Most threads of a gated_rms_norm block (delta.cu TP_GNORM_THREADS).
const GNORM_THREADS: usize = 256;
/// Block sizes are multiples of this: whole waves on 32- and 64-lane targets (the block
/// reduction needs full waves).
const WAVE_MULTIPLE: usize = 64;
/// CUDA's limit on grid y (gated_delta's value heads).
const MAX_GRID_Y: usize = 65_535;
/// Row blocks of a gated_rms_norm launch at most (the kernel loops over the rest), as
/// ops_decode's norms.
const MAX_ROW_BLOCKS: usize = 1 << 20;

/// delta.cu `struct ConvParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct ConvParams {
    x: u64,
    w: u64,
    state: u64,
    out: u64,
    rows: u32,
    channels: u32,
    kernel: u32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<ConvParams>() == 48);

/// delta.cu `struct DeltaParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DeltaParams {
    qkv: u64,
    b: u64,
    a: u64,
    a_log: u64,
    dt_bias: u64,
    state: u64,
    out: u64,
    rows: u32,
    k_heads: u32,
    v_heads: u32,
    dk: u32,
    dv: u32,
    scale: f32,
}
const _: () = assert!(std::mem::size_of::<DeltaParams>() == 80);

/// delta.cu `struct GnormParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct GnormParams {
    x: u64,
    z: u64,
    w: u64,
    out: u64,
    rows: u32,
    dim: u32,
    eps: f32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<GnormParams>() == 48);

/// Queues one op of this family.
pub(crate) fn launch(l: &Launcher<'_>, op: &Op<'_, CudaBuf>) -> Result<()> {
    match op {
        Op::CausalConv(a) => causal_conv(l, a),
        Op::GatedDelta(a) => gated_delta(l, a),
        Op::GatedRmsNorm(a) => gated_rms_norm(l, a),
        other => Err(KernelError::Invalid(format!(
            "delta.cu has no kernel for '{}'",
            other.name()
        ))),
    }
}

/// The device address of an f32 view, bounds-checked and aligned to its elements.
fn addr(v: &View<'_, CudaBuf>, op: &str) -> Result<u64> {
    let a = v.buf.addr(v.offset, v.bytes())?;
    if !a.is_multiple_of(v.dtype.size() as u64) {
        return Err(KernelError::Invalid(format!(
            "{op}: a {} view at byte offset {} is not aligned to its elements",
            v.dtype, v.offset
        )));
    }
    Ok(a)
}

fn to_u32(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| KernelError::Invalid(format!("{what} = {v} does not fit a u32")))
}

/// Launches kernel `index` of delta.cu.
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
    let f = l.kernels.func(Module::Delta, index);
    // SAFETY: forwarded from the caller.
    unsafe { l.launch_fn(f, grid, block, 0, p) }
}

fn causal_conv(l: &Launcher<'_>, a: &ops::CausalConv<'_, CudaBuf>) -> Result<()> {
    const OP: &str = "causal_conv";
    if a.kernel > CONV_KMAX {
        return Err(KernelError::Unavailable {
            backend: "cuda",
            why: format!("causal_conv with {} taps (at most {CONV_KMAX})", a.kernel),
        });
    }
    let mut p = ConvParams {
        x: addr(&a.x, OP)?,
        w: addr(&a.w, OP)?,
        state: addr(&a.state, OP)?,
        out: addr(&a.out, OP)?,
        rows: to_u32("causal_conv rows", a.rows)?,
        channels: to_u32("causal_conv channels", a.channels)?,
        kernel: a.kernel as u32,
        pad: 0,
    };
    if a.rows == 0 {
        return Ok(());
    }
    let grid = to_u32(
        "causal_conv blocks",
        a.channels.div_ceil(CONV_THREADS as usize),
    )?;
    // SAFETY: ConvParams is causal_conv's parameter; x and out bounds-checked for
    // rows·channels elements, w for channels·kernel, state for channels·(kernel − 1)
    // (`validate` tied them to the shape), and the kernel reads and writes nothing else.
    unsafe { go(l, CAUSAL_CONV, (grid, 1, 1), CONV_THREADS, &mut p) }
}

fn gated_delta(l: &Launcher<'_>, a: &ops::GatedDelta<'_, CudaBuf>) -> Result<()> {
    const OP: &str = "gated_delta";
    if a.dk > DELTA_DKMAX || a.v_heads > MAX_GRID_Y {
        return Err(KernelError::Unavailable {
            backend: "cuda",
            why: format!(
                "gated_delta with dk {} over {} value heads (at most dk {DELTA_DKMAX}, \
                 {MAX_GRID_Y} heads)",
                a.dk, a.v_heads
            ),
        });
    }
    // The twin's 1/√dk, rounded to f32 the same way.
    let scale = 1.0 / (a.dk as f32).sqrt();
    let mut p = DeltaParams {
        qkv: addr(&a.qkv, OP)?,
        b: addr(&a.b, OP)?,
        a: addr(&a.a, OP)?,
        a_log: addr(&a.a_log, OP)?,
        dt_bias: addr(&a.dt_bias, OP)?,
        state: addr(&a.state, OP)?,
        out: addr(&a.out, OP)?,
        rows: to_u32("gated_delta rows", a.rows)?,
        k_heads: to_u32("gated_delta k_heads", a.k_heads)?,
        v_heads: a.v_heads as u32,
        dk: a.dk as u32,
        dv: to_u32("gated_delta dv", a.dv)?,
        scale,
    };
    if a.rows == 0 {
        return Ok(());
    }
    let kernel = if a.dk <= 128 {
        GATED_DELTA_DK128
    } else {
        GATED_DELTA_DK256
    };
    let grid = (
        to_u32("gated_delta column blocks", a.dv.div_ceil(DELTA_COLS))?,
        a.v_heads as u32,
        1,
    );
    // SAFETY: DeltaParams is the parameter of both gated_delta kernels; every address was
    // bounds-checked for the lengths `validate` tied to (rows, k_heads, v_heads, dk, dv), the
    // kernel for dk (≤ 128 or ≤ 256) was picked above, and the kernel touches only elements
    // below those lengths (columns ≥ dv and rows ≥ dk are masked).
    unsafe { go(l, kernel, grid, DELTA_THREADS, &mut p) }
}

/// Threads of a gated_rms_norm block for rows of `dim`: one element per thread up to
/// [`GNORM_THREADS`] (longer rows loop), in whole 64-thread groups.
fn gnorm_threads(dim: usize) -> u32 {
    dim.max(1)
        .next_multiple_of(WAVE_MULTIPLE)
        .min(GNORM_THREADS) as u32
}

fn gated_rms_norm(l: &Launcher<'_>, a: &ops::GatedRmsNorm<'_, CudaBuf>) -> Result<()> {
    const OP: &str = "gated_rms_norm";
    let mut p = GnormParams {
        x: addr(&a.x, OP)?,
        z: addr(&a.z, OP)?,
        w: addr(&a.w, OP)?,
        out: addr(&a.out, OP)?,
        rows: to_u32("gated_rms_norm rows", a.rows)?,
        dim: to_u32("gated_rms_norm dim", a.dim)?,
        eps: a.eps,
        pad: 0,
    };
    if a.rows == 0 {
        return Ok(());
    }
    let grid = (a.rows.min(MAX_ROW_BLOCKS) as u32, 1, 1);
    // SAFETY: GnormParams is gated_rms_norm's parameter; x, z, out bounds-checked for
    // rows·dim elements and w for dim (`validate`).
    unsafe { go(l, GATED_RMS_NORM, grid, gnorm_threads(a.dim), &mut p) }
}

// ---- twin cases ---------------------------------------------------------------------------
//
// Tolerances (twin::Tol, |gpu − cpu| ≤ t·(1 + |cpu|)):
// - causal_conv 1e-6: the weighted sum is bit-exact (the twin's order from 0, products and
//   adds rounded separately: the modules compile with --fmad=false); only silu's expf differs
//   (≤ 2 ulp against Rust's exp), as silu_mul in ops_decode.rs. The window is exact.
// - gated_rms_norm 1e-5: as rms_norm's (the sum of squares in a block tree against the twin's
//   sequential sum, halved by the square root), plus silu's few ulp.
// - gated_delta 1e-4: the two column sums (Sᵀk̂, Sᵀq̂; dk ≤ 256 terms) are in another order
//   than the twin's and use fused multiply-adds, and every row feeds the state the next row
//   reads. A reordered sum of n terms moves by at most ~n · 2⁻²⁴ of the sum of magnitudes;
//   with |k̂| = 1 and |q̂| = 1/√dk, state entries of a few units and dk = 256 that is ≤ 4e-5 of
//   the outputs' scale in the worst case, ~1e-6 in practice (errors cancel). The recurrence
//   does not amplify it: e^g ≤ 1 and (I − β k̂ k̂ᵀ) has norm ≤ 1 for β in (0, 1). As the
//   attention twins' 1e-4, it still catches a wrong head, column or gate (those move outputs
//   by O(0.1)).

/// A uniform draw in [0, 1) from `rng` (24 bits).
fn unit(rng: &mut Rng) -> f32 {
    (rng.next() >> 40) as f32 / (1u32 << 24) as f32
}

struct ConvCase {
    rows: usize,
    channels: usize,
    kernel: usize,
    x: Vec<u8>,
    w: Vec<u8>,
    state: Vec<u8>,
}

impl TwinCase for ConvCase {
    fn name(&self) -> String {
        format!(
            "causal_conv rows {} channels {} kernel {}",
            self.rows, self.channels, self.kernel
        )
    }
    fn shape(&self) -> (DType, usize) {
        (DType::F32, self.rows * self.channels)
    }
    fn bufs(&self) -> Vec<Buf> {
        vec![
            Buf::input(DType::F32, self.x.clone()),
            Buf::input(DType::F32, self.w.clone()),
            Buf::inout(DType::F32, self.state.clone()),
            Buf::output(DType::F32, self.rows * self.channels),
        ]
    }
    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        Op::CausalConv(ops::CausalConv {
            x: v[0],
            w: v[1],
            state: v[2],
            out: v[3],
            rows: self.rows,
            channels: self.channels,
            kernel: self.kernel,
        })
    }
    fn tol(&self) -> Tol {
        Tol::Rel(1e-6)
    }
}

fn conv_cases(rng: &mut Rng) -> Vec<ConvCase> {
    // (rows, channels, kernel): Qwen3.5-27B's conv at decode on a TP = 4 rank (2 · 4 · 128 +
    // 12 · 128 channels) and at TP = 1, a prefill of 6 rows, odd channel counts (a partial
    // block), the smallest and the largest kernel, a prefill longer than the window.
    let shapes = [
        (1usize, 2560usize, 4usize),
        (1, 10240, 4),
        (6, 2560, 4),
        (5, 7, 4),
        (3, 300, 2),
        (4, 33, 8),
        (17, 1, 3),
    ];
    shapes
        .iter()
        .map(|&(rows, channels, kernel)| ConvCase {
            rows,
            channels,
            kernel,
            // Projections of a few units; taps below 1 (the conv weights' scale).
            x: f32s(rng, rows * channels, -4..=2),
            w: f32s(rng, channels * kernel, -5..=-1),
            state: f32s(rng, channels * (kernel - 1), -4..=2),
        })
        .collect()
}

struct DeltaCase {
    rows: usize,
    k_heads: usize,
    v_heads: usize,
    dk: usize,
    dv: usize,
    /// a of up to 64: a + dt_bias past softplus's threshold of 20 (the linear branch).
    wide_a: bool,
    seed: u64,
}

impl DeltaCase {
    fn width(&self) -> usize {
        2 * self.k_heads * self.dk + self.v_heads * self.dv
    }
}

impl TwinCase for DeltaCase {
    fn name(&self) -> String {
        format!(
            "gated_delta rows {} heads {}/{} dk {} dv {}{}",
            self.rows,
            self.v_heads,
            self.k_heads,
            self.dk,
            self.dv,
            if self.wide_a { " wide a" } else { "" }
        )
    }
    fn shape(&self) -> (DType, usize) {
        (DType::F32, self.rows * self.v_heads * self.dv)
    }
    /// The model's ranges, as the twin's own test: conv outputs of a few units, b and a around
    /// 0 (or up to 64), A_log = ln(1..16) as transformers initialises it, small dt_bias, a
    /// warm state.
    fn bufs(&self) -> Vec<Buf> {
        let mut rng = Rng::new(self.seed);
        let (rows, vh) = (self.rows, self.v_heads);
        let a_log: Vec<f32> = (0..vh)
            .map(|_| (1.0 + 15.0 * unit(&mut rng)).ln())
            .collect();
        vec![
            Buf::input(DType::F32, f32s(&mut rng, rows * self.width(), -3..=1)),
            Buf::input(DType::F32, f32s(&mut rng, rows * vh, -3..=1)),
            Buf::input(
                DType::F32,
                f32s(
                    &mut rng,
                    rows * vh,
                    if self.wide_a { 3..=5 } else { -3..=1 },
                ),
            ),
            Buf::input(DType::F32, crate::dtype::encode(DType::F32, &a_log)),
            Buf::input(DType::F32, f32s(&mut rng, vh, -4..=-1)),
            Buf::inout(DType::F32, f32s(&mut rng, vh * self.dk * self.dv, -5..=-2)),
            Buf::output(DType::F32, rows * vh * self.dv),
        ]
    }
    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        Op::GatedDelta(ops::GatedDelta {
            qkv: v[0],
            b: v[1],
            a: v[2],
            a_log: v[3],
            dt_bias: v[4],
            state: v[5],
            out: v[6],
            rows: self.rows,
            k_heads: self.k_heads,
            v_heads: self.v_heads,
            dk: self.dk,
            dv: self.dv,
        })
    }
    fn tol(&self) -> Tol {
        Tol::Rel(1e-4)
    }
}

fn delta_cases(seed: u64) -> Vec<DeltaCase> {
    // (rows, key heads, value heads, dk, dv, wide a): Qwen3.5-27B at decode on a TP = 4 rank
    // (4 key heads, 12 value heads of 128) and at TP = 1 (16 / 48), a 5-token prefill of the
    // TP = 4 shard, three value heads per key head alone and twice, GQA ratio 1, odd sizes
    // (dk, dv not multiples of 16: masked rows and columns), the largest dk (the second
    // kernel) with dv off the column blocks, a 33-row prefill, the linear softplus branch.
    let shapes = [
        (1usize, 4usize, 12usize, 128usize, 128usize, false),
        (1, 16, 48, 128, 128, false),
        (5, 4, 12, 128, 128, false),
        (1, 1, 3, 128, 128, false),
        (3, 2, 6, 128, 128, false),
        (4, 2, 2, 16, 8, false),
        (7, 1, 3, 5, 7, false),
        (2, 1, 1, 256, 40, false),
        (3, 1, 3, 200, 33, false),
        (33, 2, 4, 64, 64, false),
        (3, 2, 6, 128, 128, true),
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(i, &(rows, k_heads, v_heads, dk, dv, wide_a))| DeltaCase {
            rows,
            k_heads,
            v_heads,
            dk,
            dv,
            wide_a,
            seed: seed.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        })
        .collect()
}

struct GnormCase {
    rows: usize,
    dim: usize,
    /// `out` is `x`.
    alias: bool,
    eps: f32,
    x: Vec<u8>,
    z: Vec<u8>,
    w: Vec<u8>,
}

impl TwinCase for GnormCase {
    fn name(&self) -> String {
        format!(
            "gated_rms_norm rows {} dim {}{}",
            self.rows,
            self.dim,
            if self.alias { " in place" } else { "" }
        )
    }
    fn shape(&self) -> (DType, usize) {
        (DType::F32, self.rows * self.dim)
    }
    fn bufs(&self) -> Vec<Buf> {
        let mut b = vec![
            match self.alias {
                true => Buf::inout(DType::F32, self.x.clone()),
                false => Buf::input(DType::F32, self.x.clone()),
            },
            Buf::input(DType::F32, self.z.clone()),
            Buf::input(DType::F32, self.w.clone()),
        ];
        if !self.alias {
            b.push(Buf::output(DType::F32, self.rows * self.dim));
        }
        b
    }
    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        Op::GatedRmsNorm(ops::GatedRmsNorm {
            x: v[0],
            z: v[1],
            w: v[2],
            out: if self.alias { v[0] } else { v[3] },
            rows: self.rows,
            dim: self.dim,
            eps: self.eps,
        })
    }
    fn tol(&self) -> Tol {
        Tol::Rel(1e-5)
    }
}

fn gnorm_cases(rng: &mut Rng) -> Vec<GnormCase> {
    // (rows, dim, in place): the value heads of one token on a TP = 4 rank (12 of 128) and at
    // TP = 1 (48), a 5-token prefill of the rank, odd dims (a partial wave), one element,
    // rows longer than a block (300: threads loop; 1000).
    let shapes = [
        (12usize, 128usize, false),
        (48, 128, true),
        (60, 128, false),
        (3, 7, false),
        (1, 1, true),
        (4, 300, false),
        (2, 1000, true),
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(i, &(rows, dim, alias))| GnormCase {
            rows,
            dim,
            alias,
            eps: if i % 2 == 0 { 1e-6 } else { 1e-5 },
            x: f32s(rng, rows * dim, -6..=2),
            // z up to 16: e^−z never overflows to a NaN; down to −16 (silu ≈ 0).
            z: f32s(rng, rows * dim, -4..=3),
            w: f32s(rng, dim, -2..=0),
        })
        .collect()
}

/// This family's twin cases (see `twin`).
pub(crate) fn selftest(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    seed: u64,
) -> Result<Vec<SelftestResult>> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    for c in conv_cases(&mut rng) {
        out.push(twin::run(gpu, cpu, &c)?);
    }
    for c in delta_cases(rng.next()) {
        out.push(twin::run(gpu, cpu, &c)?);
    }
    for c in gnorm_cases(&mut rng) {
        out.push(twin::run(gpu, cpu, &c)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    const SOURCE: &str = include_str!("../gpu/delta.cu");

    #[test]
    fn names_are_the_source_kernels_in_index_order() {
        assert_eq!(
            [
                NAMES[CAUSAL_CONV],
                NAMES[GATED_DELTA_DK128],
                NAMES[GATED_DELTA_DK256],
                NAMES[GATED_RMS_NORM]
            ],
            [
                "causal_conv",
                "gated_delta_dk128",
                "gated_delta_dk256",
                "gated_rms_norm"
            ]
        );
        assert_eq!(NAMES.len(), 4);
        for name in NAMES {
            let defined = SOURCE
                .lines()
                .filter(|l| l.starts_with("extern \"C\" __global__"))
                .any(|l| l.contains(&format!(" {name}(")));
            assert!(defined, "{name} is not an extern \"C\" kernel of delta.cu");
        }
        assert_eq!(
            super::super::program::SOURCES[Module::Delta as usize],
            ("delta", SOURCE)
        );
    }

    #[test]
    fn cu_defines_match_rust_constants() {
        let def = |name: &str| crate::cuda::twin::testing::cu_define(SOURCE, name);
        assert_eq!(def("TP_CONV_THREADS"), CONV_THREADS.to_string());
        assert_eq!(def("TP_CONV_KMAX"), CONV_KMAX.to_string());
        assert_eq!(def("TP_DELTA_COLS"), DELTA_COLS.to_string());
        assert_eq!(def("TP_DELTA_THREADS"), DELTA_THREADS.to_string());
        assert_eq!(def("TP_DELTA_DKMAX"), DELTA_DKMAX.to_string());
        assert_eq!(def("TP_GNORM_THREADS"), GNORM_THREADS.to_string());
        // Columns × row groups = threads, and every thread of a block loads one element of q
        // and k: dk ≤ threads.
        let groups: usize = def("TP_DELTA_GROUPS").parse().unwrap();
        assert_eq!(groups * DELTA_COLS, DELTA_THREADS as usize);
        assert!(DELTA_DKMAX <= DELTA_THREADS as usize);
        assert_eq!(def("TP_DELTA_L2_EPS"), format!("{:e}f", ops::DELTA_L2_EPS));
    }

    #[test]
    fn norm_blocks_are_whole_waves() {
        for (dim, t) in [(1usize, 64u32), (7, 64), (128, 128), (129, 192), (300, 256)] {
            assert_eq!(gnorm_threads(dim), t, "{dim}");
        }
    }

    /// Every case is a valid op that the CPU twin runs, with finite outputs (no case is
    /// degenerate enough to compare NaN with NaN).
    #[test]
    fn every_twin_case_runs_on_the_cpu() {
        fn check<C: TwinCase>(cpu: &CpuDevice, cases: Vec<C>) -> usize {
            for c in &cases {
                let bufs = twin::run_alone(cpu, c).unwrap_or_else(|e| panic!("{}: {e}", c.name()));
                for (b, spec) in bufs.iter().zip(c.bufs()).filter(|(_, s)| s.check) {
                    let v = crate::dtype::decode(spec.dtype, b);
                    assert!(v.iter().all(|x| x.is_finite()), "{}", c.name());
                }
            }
            cases.len()
        }
        let cpu = CpuDevice::new(0, 2, 0);
        let mut rng = Rng::new(4);
        let n = check(&cpu, conv_cases(&mut rng))
            + check(&cpu, delta_cases(9))
            + check(&cpu, gnorm_cases(&mut rng));
        assert_eq!(n, 25);
        // Both gated_delta kernels, ratio 3, rows > 1 and the linear softplus branch are
        // covered.
        let d = delta_cases(1);
        assert!(d.iter().any(|c| c.dk > 128) && d.iter().any(|c| c.dk == 128));
        assert!(d.iter().any(|c| c.v_heads == 3 * c.k_heads && c.rows > 1));
        assert!(d.iter().any(|c| c.wide_a) && d.iter().any(|c| c.rows == 1));
    }

    /// The buffers of `spec` on `dev`, outputs filled with `fill` bytes.
    fn upload<D: Device>(dev: &D, spec: &[Buf], fill: u8) -> Vec<D::Buf> {
        spec.iter()
            .map(|s| {
                let bytes = s.len * s.dtype.size();
                let b = dev.alloc(bytes.max(1)).unwrap();
                let init = s.init.clone().unwrap_or_else(|| vec![fill; bytes]);
                dev.write(&b, 0, &init).unwrap();
                b
            })
            .collect()
    }

    /// Ops over one buffer of 1024 f32 whose output either overlaps an input (`bad`) or not:
    /// a conv whose out starts inside x, a gated norm whose out starts inside x (against
    /// exactly x, which is allowed).
    fn overlap_ops<B>(buf: &B, bad: bool) -> [Op<'_, B>; 2] {
        let v = |at: usize, n: usize| View::new(buf, at * 4, n, DType::F32);
        [
            Op::CausalConv(ops::CausalConv {
                x: v(0, 8),
                w: v(100, 16),
                state: v(200, 12),
                out: if bad { v(4, 8) } else { v(300, 8) },
                rows: 2,
                channels: 4,
                kernel: 4,
            }),
            Op::GatedRmsNorm(ops::GatedRmsNorm {
                x: v(0, 8),
                z: v(100, 8),
                w: v(200, 4),
                out: if bad { v(2, 8) } else { v(0, 8) },
                rows: 2,
                dim: 4,
                eps: 1e-6,
            }),
        ]
    }

    /// Outputs that partly overlap their inputs are refused (the GPU kernels would read them
    /// after writing; the CPU twin, which reads everything first, refuses them as well, so
    /// that an op valid on one backend is valid on every one), the others run.
    fn overlapping_outputs_are_refused<D: Device>(dev: &D) {
        let buf = dev.alloc(4096).unwrap();
        for op in overlap_ops(&buf, true) {
            let e = dev.run(&op).unwrap_err().to_string();
            assert!(e.contains("overlaps"), "{e}");
        }
        for op in overlap_ops(&buf, false) {
            dev.run(&op).unwrap();
        }
        dev.sync().unwrap();
    }

    #[test]
    fn overlapping_outputs_are_refused_on_the_cpu() {
        overlapping_outputs_are_refused(&CpuDevice::new(0, 1, 0));
    }

    /// A prompt run as one call leaves the same state and outputs, bit for bit, as its rows
    /// run one call each: on the GPU because the kernel's arithmetic per row does not depend
    /// on where the state sat between rows (registers or memory). The row-by-row calls are
    /// queued back to back, each reading the state the one before wrote, which `GatedDelta`'s
    /// contract forbids under programmatic dependent launch: this holds because test devices
    /// launch without it (`CudaDevice::new`; only decode turns it on).
    fn prefill_equals_token_by_token<D: Device>(dev: &D) {
        let case = DeltaCase {
            rows: 6,
            k_heads: 4,
            v_heads: 12,
            dk: 128,
            dv: 128,
            wide_a: false,
            seed: 17,
        };
        let whole = twin::run_alone(dev, &case).unwrap();
        let spec = case.bufs();
        let bufs = upload(dev, &spec, 0xff);
        let (vh, width) = (case.v_heads, case.width());
        let f = |i: usize, at: usize, n: usize| View::new(&bufs[i], at * 4, n, DType::F32);
        for r in 0..case.rows {
            dev.run(&Op::GatedDelta(ops::GatedDelta {
                qkv: f(0, r * width, width),
                b: f(1, r * vh, vh),
                a: f(2, r * vh, vh),
                a_log: f(3, 0, vh),
                dt_bias: f(4, 0, vh),
                state: f(5, 0, spec[5].len),
                out: f(6, r * vh * case.dv, vh * case.dv),
                rows: 1,
                k_heads: case.k_heads,
                v_heads: vh,
                dk: case.dk,
                dv: case.dv,
            }))
            .unwrap();
        }
        for i in [5usize, 6] {
            let mut got = vec![0u8; spec[i].len * 4];
            dev.read(&bufs[i], 0, &mut got).unwrap();
            assert!(got == whole[i], "buffer {i} differs");
        }
    }

    #[test]
    fn prefill_equals_token_by_token_on_the_cpu() {
        prefill_equals_token_by_token(&CpuDevice::new(0, 2, 0));
    }

    /// Every twin case on a GPU, when there is one (`TPRUN_REQUIRE_GPU=1` makes its absence a
    /// failure), plus the checks above that need one.
    #[test]
    fn delta_twins_on_the_gpu() {
        let Some(gpu) = crate::cuda::twin::testing::gpu_or_skip() else {
            return;
        };
        let cpu = CpuDevice::new(0, 2, 0);
        let results = selftest(&gpu, &cpu, 1).unwrap();
        crate::cuda::twin::testing::assert_all_ok("delta", &results);
        overlapping_outputs_are_refused(&gpu);
        prefill_equals_token_by_token(&gpu);
    }

    /// Timings for the report (run with --ignored on a GPU machine): the three ops at decode
    /// (one token) for Qwen3.5-27B's shapes at TP = 4 and TP = 1, and a 64-token prefill at
    /// TP = 4; device time from graph replays. gated_delta's bandwidth counts the state read
    /// and written (the bytes that matter), beside a device copy of the same bytes; the
    /// others' every byte moved.
    #[test]
    #[ignore]
    fn delta_timings() {
        let Some(gpu) = crate::cuda::twin::testing::gpu_or_skip() else {
            return;
        };
        fn time<C: TwinCase>(gpu: &CudaDevice, case: &C, bytes: usize) {
            let spec = case.bufs();
            let bufs = upload(gpu, &spec, 0);
            let v: Vec<View<'_, CudaBuf>> = bufs
                .iter()
                .zip(&spec)
                .map(|(b, s)| View::new(b, 0, s.len, s.dtype))
                .collect();
            let t = super::super::ops_attention::tests::graph_time(gpu, &case.op(&v));
            println!(
                "TIMING {}: {:.2} us, {:.0} GB/s",
                case.name(),
                t.as_secs_f64() * 1e6,
                bytes as f64 / t.as_secs_f64() / 1e9
            );
        }
        let mut rng = Rng::new(3);
        for (kh, vh, rows) in [(4usize, 12usize, 1usize), (16, 48, 1), (4, 12, 64)] {
            let (d, channels) = (128usize, 2 * kh * 128 + vh * 128);
            let delta = DeltaCase {
                rows,
                k_heads: kh,
                v_heads: vh,
                dk: d,
                dv: d,
                wide_a: false,
                seed: 3,
            };
            time(&gpu, &delta, 2 * vh * d * d * 4);
            // The reference: a device copy of the state's size (read + written), which pays
            // the same fixed costs.
            let n = vh * d * d;
            let (src, dst) = (gpu.alloc(n * 4).unwrap(), gpu.alloc(n * 4).unwrap());
            let copy = Op::Copy(ops::Copy {
                src: View::new(&src, 0, n, DType::F32),
                dst: View::new(&dst, 0, n, DType::F32),
            });
            let t = super::super::ops_attention::tests::graph_time(&gpu, &copy);
            println!(
                "TIMING copy of the state ({} KiB): {:.2} us, {:.0} GB/s",
                n * 4 / 1024,
                t.as_secs_f64() * 1e6,
                (2 * n * 4) as f64 / t.as_secs_f64() / 1e9
            );
            let conv = ConvCase {
                rows,
                channels,
                kernel: 4,
                x: f32s(&mut rng, rows * channels, -4..=2),
                w: f32s(&mut rng, channels * 4, -5..=-1),
                state: f32s(&mut rng, channels * 3, -4..=2),
            };
            // x and out, the taps, the window read and written.
            time(&gpu, &conv, channels * 4 * (2 * rows + 4 + 2 * 3));
            let n = rows * vh * d;
            let norm = GnormCase {
                rows: rows * vh,
                dim: d,
                alias: false,
                eps: 1e-6,
                x: f32s(&mut rng, n, -6..=2),
                z: f32s(&mut rng, n, -4..=3),
                w: f32s(&mut rng, d, -2..=0),
            };
            time(&gpu, &norm, n * 4 * 3);
        }
    }
}
