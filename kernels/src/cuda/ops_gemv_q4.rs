//! Launchers of `kernels/src/gpu/gemv_q4.cu`: `MatmulInt4` (`y = f(x) · wᵀ` over GPTQ int4
//! weights in the layout of [`crate::int4`]), one launch per call; and its twin cases.
//!
//! Owns: the kernel choice (m, prologue, kq: the by-chunk `_k` kernels for decode when their
//! block fits, the row-group ones otherwise), the grid (persistent for `_k`: the occupancy
//! times the SMs), the 16-byte-path decision.
//! Must not: allocate or synchronise (captured into the decode graph).
//!
//! Bandwidth (`tprun bench gemv --quant int4`, H200, 27B MLP shapes at group 128): gate|up
//! [34816, 5120] 33.0 µs (2.81 TB/s), down + silu [5120, 17408] 26.1 µs (1.78 TB/s); the
//! header of gemv_q4.cu says where the rest goes.

use super::launch::Launcher;
use super::mem::CudaBuf;
use super::program::Module;
use super::selftest::Rng;
use super::twin::{self, Buf, Tol, TwinCase};
use super::{CudaDevice, SelftestResult};
use crate::cpu::CpuDevice;
use crate::device::{Op, View};
use crate::int4::{Int4Host, PACK};
use crate::ops::{Epilogue, MatmulInt4, Prologue};
use crate::{DType, KernelError, Result};

/// The kernels of gemv_q4.cu, in the order the launcher indexes them: [`kernel_index`].
pub(crate) const NAMES: &[&str] = &[
    "gemv_q4",
    "gemv_q4_silu",
    "gemm_q4",
    "gemm_q4_silu",
    "gemv_q4_k",
    "gemv_q4_k_silu",
    "gemv_q4_kb",
    "gemv_q4_kb_silu",
    "gemv_q4_e",
    "gemm_q4_e",
    "gemv_q4_k_e",
    "gemv_q4_kb_e",
];

/// Rows per batch of `gemv_q4_k*` (gemv_q4.cu TP_Q4K_ROWS) and of `gemv_q4_kb*`
/// (TP_Q4K_ROWS_BIG).
const K_ROWS: usize = 4;
const K_ROWS_BIG: usize = 4;
/// Threads per block the `gemv_q4_k*` kernels are built for (their launch bounds), and the
/// `gemv_q4_kb*` ones: one thread per 32 stored inputs, so kq up to 20480 takes this path.
const K_MAX_THREADS: usize = 256;
const K_MAX_THREADS_BIG: usize = 640;

/// Output rows per wave (gemv_q4.cu TP_Q4_ROWS): `gemv_q4`.
const ROWS: usize = 4;
/// Output rows per wave of `gemv_q4_silu` (TP_Q4_ROWS_SILU).
const ROWS_SILU: usize = 8;
/// Output rows per wave of `gemm_q4*` (TP_Q4_ROWS_TILE).
const ROWS_TILE: usize = 2;
/// Tokens per tile of `gemm_q4*` (TP_Q4_TOKENS).
const TOKENS: usize = 8;
/// Lanes of a wave on every NVIDIA GPU (portable.h TP_WAVE).
const WAVE: u32 = 32;
/// Waves per block while every SM still gets two blocks; gemv.cu's figure (2, 4 and 8 were
/// within 2 % there), not yet tuned for this kernel.
const MAX_WAVES: usize = 4;
/// CUDA's limit on gridDim.y; the kernel loops over the tiles beyond it.
const MAX_GRID_Y: usize = 65535;

/// gemv_q4.cu `struct GemvQ4Params`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GemvQ4Params {
    x: u64,
    qweight: u64,
    scales: u64,
    zeros: u64,
    perm: u64,
    y: u64,
    m: u32,
    k: u32,
    n: u32,
    kq: u32,
    group: u32,
    groups: u32,
    vec: u32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<GemvQ4Params>() == 80);

/// Index into [`NAMES`] of the row-group kernels: 2 · (m > 1) + (SiluMul prologue), or
/// 8 + (m > 1) with the SiluMul epilogue (validate() excludes both together).
fn kernel_index(m: usize, prologue: Prologue, epilogue: Epilogue) -> usize {
    if epilogue == Epilogue::SiluMul {
        return 8 + usize::from(m > 1);
    }
    2 * usize::from(m > 1) + usize::from(prologue == Prologue::SiluMul)
}

/// What one launch needs: the kernel, grid and block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    index: usize,
    grid: (u32, u32, u32),
    block: u32,
}

/// One wave per R rows (R/2 rows of y with the epilogue: a wave's gate rows and their up
/// rows); `MAX_WAVES` waves per block, halved while that would leave fewer than two blocks
/// per SM; one grid row per tile of [`TOKENS`] tokens when m > 1.
fn plan(m: usize, n: usize, prologue: Prologue, epilogue: Epilogue, sms: u32) -> Plan {
    let index = kernel_index(m, prologue, epilogue);
    let rows = match (m > 1, prologue) {
        (true, _) => ROWS_TILE,
        (false, Prologue::None) => ROWS,
        (false, Prologue::SiluMul) => ROWS_SILU,
    };
    let groups = match epilogue {
        Epilogue::None => n.div_ceil(rows),
        Epilogue::SiluMul => (n / 2).div_ceil(rows / 2),
    };
    let mut waves = MAX_WAVES;
    while waves > 1 && groups.div_ceil(waves) < 2 * sms as usize {
        waves /= 2;
    }
    let tiles = if m > 1 { m.div_ceil(TOKENS) } else { 1 };
    // groups <= n < 2^31 (checked by the caller), so both fit the grid's u32.
    Plan {
        index,
        grid: (
            groups.div_ceil(waves) as u32,
            tiles.min(MAX_GRID_Y) as u32,
            1,
        ),
        block: waves as u32 * WAVE,
    }
}

/// The by-chunk decode kernels (gemv_q4.cu `_k`): (kernel index, threads, rows of y per
/// batch: half the rows read with the epilogue) when m = 1, the 16-byte path applies and
/// kq / 32 threads fit a block; else `None`.
fn k_plan(
    m: usize,
    kq: usize,
    vec: bool,
    prologue: Prologue,
    epilogue: Epilogue,
) -> Option<(usize, u32, usize)> {
    let threads = (kq / 32).div_ceil(WAVE as usize) * WAVE as usize;
    if m != 1 || !vec || threads == 0 || threads > K_MAX_THREADS_BIG {
        return None;
    }
    let big = threads > K_MAX_THREADS;
    let rows = if big { K_ROWS_BIG } else { K_ROWS };
    Some(match epilogue {
        Epilogue::SiluMul => (10 + usize::from(big), threads as u32, rows / 2),
        Epilogue::None => {
            let silu = usize::from(prologue == Prologue::SiluMul);
            (4 + 2 * usize::from(big) + silu, threads as u32, rows)
        }
    })
}

/// Queues one `MatmulInt4`.
pub(crate) fn launch(l: &Launcher<'_>, op: &Op<'_, CudaBuf>) -> Result<()> {
    let Op::MatmulInt4(a) = op else {
        return Err(KernelError::Invalid(format!(
            "gemv_q4 launcher got '{}'",
            op.name()
        )));
    };
    let bad = |why: String| KernelError::Invalid(format!("matmul_int4: {why}"));
    // The kernel indexes with u32 (rows, tiles, stored inputs); i32::MAX leaves it headroom.
    let limit = i32::MAX as usize;
    if a.m > limit || a.k > limit || a.n > limit || a.kq() > limit {
        return Err(bad(format!(
            "[{}, {}] x [{}, {}] exceeds 2^31",
            a.m,
            a.k,
            a.n,
            a.kq()
        )));
    }
    let addr = |v: &View<'_, CudaBuf>| v.buf.addr(v.offset, v.bytes());
    let (x, qweight, scales, zeros, y) = (
        addr(&a.x)?,
        addr(&a.qweight)?,
        addr(&a.scales)?,
        addr(&a.zeros)?,
        addr(&a.y)?,
    );
    let perm = a.perm.as_ref().map(addr).transpose()?.unwrap_or(0);
    let aligned4 = [x, qweight, zeros, perm, y]
        .iter()
        .all(|p| p.is_multiple_of(4));
    if !(aligned4 && scales.is_multiple_of(2)) {
        return Err(bad("a view is not aligned to its element size".into()));
    }
    if a.m == 0 || a.n == 0 {
        return Ok(());
    }
    // The 16-byte path: 32-input chunks that never straddle a group, qweight rows and perm
    // (or, without perm, x rows: k = kq is then a multiple of 32) 16-byte aligned.
    let acts_aligned = if a.perm.is_some() {
        perm.is_multiple_of(16)
    } else {
        x.is_multiple_of(16)
    };
    let vec = a.kq().is_multiple_of(32)
        && a.group.is_multiple_of(32)
        && qweight.is_multiple_of(16)
        && acts_aligned;
    let p = match k_plan(a.m, a.kq(), vec, a.prologue, a.epilogue) {
        Some((index, threads, rows)) => {
            // A persistent grid: as many blocks as fit at once, each walking batches of rows.
            let f = l.kernels.func(Module::GemvQ4, index);
            let per_sm = l.kernels.occupancy(f, threads)?.max(1) as usize;
            let batches = a.epilogue.y_width(a.n).div_ceil(rows);
            Plan {
                index,
                grid: (batches.min(per_sm * l.sms as usize) as u32, 1, 1),
                block: threads,
            }
        }
        None => plan(a.m, a.n, a.prologue, a.epilogue, l.sms),
    };
    let mut params = GemvQ4Params {
        x,
        qweight,
        scales,
        zeros,
        perm,
        y,
        m: a.m as u32,
        k: a.k as u32,
        n: a.n as u32,
        kq: a.kq() as u32,
        group: a.group as u32,
        groups: a.groups as u32,
        vec: u32::from(vec),
        pad: 0,
    };
    let f = l.kernels.func(Module::GemvQ4, p.index);
    // SAFETY: GemvQ4Params mirrors gemv_q4.cu's parameter struct (size asserted above); every
    // address was bounds-checked for its whole view (validate() fixed the views' lengths to
    // the shapes the kernel reads and writes; perm's values are each < k by the op's contract,
    // which kernels/src/int4.rs keeps when it builds them), and
    // the views' buffers outlive the queued launch (callers keep them until the stream is
    // synchronised or the graph destroyed).
    unsafe { l.launch_fn(f, p.grid, p.block, 0, &mut params) }
}

/// The shape of a twin case.
#[derive(Clone, Copy, Debug)]
struct Spec {
    m: usize,
    k: usize,
    n: usize,
    /// GPTQ group length (k: one group).
    gl: usize,
    desc_act: bool,
    prologue: Prologue,
    epilogue: Epilogue,
}

/// A twin case: its shape, its weights in the device layout and its activations.
struct Int4Case {
    s: Spec,
    h: Int4Host,
    x: Vec<u8>,
}

/// A random GPTQ layer of the spec's shape, in the device layout: random nibbles and zeros,
/// f16 scales in [1/64, 1/8) (|w| up to ~2), the group order shuffled for `desc_act`.
pub(crate) fn random_layer(
    rng: &mut Rng,
    n: usize,
    k: usize,
    gl: usize,
    desc_act: bool,
) -> Int4Host {
    let ng = k / gl;
    let mut order: Vec<usize> = (0..k).collect();
    if desc_act {
        for i in (1..k).rev() {
            order.swap(i, rng.next() as usize % (i + 1));
        }
    }
    let mut g_idx = vec![0u32; k];
    for (pos, &c) in order.iter().enumerate() {
        g_idx[c] = (pos / gl) as u32;
    }
    let qw: Vec<u32> = (0..k / PACK * n).map(|_| rng.next() as u32).collect();
    let z: Vec<u8> = (0..ng * n).map(|_| (rng.next() % 16) as u8).collect();
    let s: Vec<f32> = (0..ng * n)
        .map(|_| rng.value(-6..=-4).abs())
        .map(|v| half::f16::from_f32(v).to_f32())
        .collect();
    Int4Host::from_gptq(n, k, &qw, &z, &s, &g_idx).expect("a valid random layer")
}

fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes()).collect()
}

impl TwinCase for Int4Case {
    fn name(&self) -> String {
        format!(
            "matmul_int4 m {} k {} n {} group {}{}{}{}",
            self.s.m,
            self.s.k,
            self.s.n,
            self.s.gl,
            if self.s.desc_act { " desc_act" } else { "" },
            if self.s.prologue == Prologue::SiluMul {
                " silu_mul"
            } else {
                ""
            },
            if self.s.epilogue == Epilogue::SiluMul {
                " then silu_mul"
            } else {
                ""
            },
        )
    }

    fn shape(&self) -> (DType, usize) {
        (DType::U32, self.h.qweight.len())
    }

    fn bufs(&self) -> Vec<Buf> {
        let h = &self.h;
        let mut b = vec![
            Buf::input(DType::F32, self.x.clone()),
            Buf::input(DType::U32, u32_bytes(&h.qweight)),
            Buf::input(
                DType::F16,
                h.scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            ),
            Buf::input(DType::U32, u32_bytes(&h.zeros)),
        ];
        if let Some(p) = &h.perm {
            b.push(Buf::input(DType::U32, u32_bytes(p)));
        }
        b.push(Buf::output(
            DType::F32,
            self.s.m * self.s.epilogue.y_width(self.s.n),
        ));
        b
    }

    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        Op::MatmulInt4(MatmulInt4 {
            x: v[0],
            qweight: v[1],
            scales: v[2],
            zeros: v[3],
            perm: self.h.perm.is_some().then(|| v[4]),
            y: v[v.len() - 1],
            m: self.s.m,
            k: self.s.k,
            n: self.s.n,
            group: self.h.group,
            groups: self.h.groups,
            prologue: self.s.prologue,
            epilogue: self.s.epilogue,
        })
    }

    /// The CPU dequantises each weight exactly and sums a·w in 16 lanes; the GPU sums a·q per
    /// 32-input chunk in four accumulators and folds the zero as z · Σa, which cancels
    /// against Σ a·q (|Σ a q| up to ~15 |Σ a| against |Σ a (q − z)|): a few ε · 16 ·
    /// sqrt(k) · max|a w| ≈ 1e-5 · |y| at k = 4096, plus the fast exp of the prologue as in
    /// gemv.cu. 1e-4 of (1 + |y|) is ~10× that; a wrong nibble, group or row is off by O(|w|).
    fn tol(&self) -> Tol {
        Tol::Rel(1e-4)
    }

    /// With the epilogue, y = silu(a) · b of two f32 sums: its error is ~|b| · δa (see
    /// ops_gemv.rs's cases), so the tolerance is relative to (1 + |a|)(1 + |b|), computed in
    /// f64 from the dequantised weights (exact in f32) and the inputs.
    fn magnitudes(&self, buf: usize) -> Option<Vec<f32>> {
        let s = &self.s;
        let y_buf = 4 + usize::from(self.h.perm.is_some());
        if s.epilogue != Epilogue::SiluMul || buf != y_buf {
            return None;
        }
        let x = crate::dtype::decode(DType::F32, &self.x);
        let w = self.h.dequantize();
        let k = s.k;
        Some(twin::glu_magnitudes(s.m, s.n / 2, |t, row| {
            let (xr, wr) = (&x[t * k..(t + 1) * k], &w[row * k..(row + 1) * k]);
            xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum()
        }))
    }
}

/// This family's twin cases: group sizes 32, 64, 128 and k (one group), with and without
/// `desc_act`, decode and prefill, both prologues; a k that takes the word-at-a-time path; and
/// one decode-sized product of each prologue that fills every SM; the SiluMul epilogue on
/// every kernel that has it.
fn specs() -> Vec<Spec> {
    let spec = |m, k, n, gl, desc_act, silu: bool| Spec {
        m,
        k,
        n,
        gl,
        desc_act,
        prologue: if silu {
            Prologue::SiluMul
        } else {
            Prologue::None
        },
        epilogue: Epilogue::None,
    };
    let epi = |m, k, n, gl, desc_act| Spec {
        epilogue: Epilogue::SiluMul,
        ..spec(m, k, n, gl, desc_act, false)
    };
    let mut v = Vec::new();
    let mut i = 0usize;
    for (k, n) in [(256usize, 40usize), (1024, 136)] {
        for gl in [32usize, 64, 128, k] {
            for desc_act in [false, true] {
                for m in [1usize, 3, 9] {
                    v.push(spec(m, k, n, gl, desc_act, i % 2 == 1));
                    i += 1;
                }
            }
        }
    }
    // k = 200: 25 words, not whole 32-input chunks (the scalar path), one group and groups of 8.
    for (gl, silu) in [(200usize, false), (8, true), (40, false)] {
        v.push(spec(1, 200, 24, gl, false, silu));
        v.push(spec(5, 200, 24, gl, true, silu));
    }
    // kq / 32 = 384 threads: the `_kb` kernels (the others of m = 1 above take `_k`).
    v.push(spec(1, 12288, 40, 128, false, true));
    v.push(spec(1, 12288, 40, 128, true, false));
    // Enough rows that every block of the persistent grid (an H200's) walks several batches,
    // the last one partial.
    v.push(spec(1, 12288, 2200, 128, false, true));
    v.push(spec(1, 256, 70001, 64, false, false));
    v.push(spec(1, 4096, 4096, 128, false, false));
    v.push(spec(1, 4096, 4096, 128, false, true));
    v.push(spec(1, 2048, 1024, 128, true, true));
    // The epilogue: `_k_e` (one and many batches, the last partial), `_kb_e`, the row-group
    // kernel (the word path and the 16-byte path) and the prefill tiles, desc_act on two.
    v.push(epi(1, 256, 40, 32, false));
    v.push(epi(1, 5120, 2202, 128, false));
    v.push(epi(1, 4096, 4096, 128, true));
    v.push(epi(1, 12288, 40, 128, false));
    v.push(epi(1, 12288, 2202, 128, false));
    v.push(epi(1, 200, 24, 40, false));
    v.push(epi(1, 200, 26, 40, false)); // 13 rows of y: the last row group partial
    v.push(epi(1, 20608, 26, 128, false)); // kq / 32 = 644 > 640: the row-group kernel's 16-byte path
    v.push(epi(3, 1024, 136, 128, true));
    v.push(epi(9, 256, 40, 64, false));
    v
}

fn cases(seed: u64) -> impl Iterator<Item = Int4Case> {
    let mut rng = Rng::new(seed);
    specs().into_iter().map(move |s| {
        let h = random_layer(&mut rng, s.n, s.k, s.gl, s.desc_act);
        let xk = if s.prologue == Prologue::SiluMul {
            2 * s.k
        } else {
            s.k
        };
        Int4Case {
            s,
            h,
            x: rng.bytes(DType::F32, s.m * xk, -3..=1),
        }
    })
}

/// The twin cases of gemv_q4.cu, GPU against the CPU twin (`tprun selftest`).
pub(crate) fn selftest(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    seed: u64,
) -> Result<Vec<SelftestResult>> {
    cases(seed ^ 0x6771_3467) // "gq4g"
        .map(|c| twin::run(gpu, cpu, &c))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_index() {
        let (none, silu, epi) = (Prologue::None, Prologue::SiluMul, Epilogue::SiluMul);
        let ne = Epilogue::None;
        assert_eq!(NAMES[kernel_index(1, none, ne)], "gemv_q4");
        assert_eq!(NAMES[kernel_index(1, silu, ne)], "gemv_q4_silu");
        assert_eq!(NAMES[kernel_index(4, none, ne)], "gemm_q4");
        assert_eq!(NAMES[kernel_index(4, silu, ne)], "gemm_q4_silu");
        assert_eq!(NAMES[kernel_index(1, none, epi)], "gemv_q4_e");
        assert_eq!(NAMES[kernel_index(4, none, epi)], "gemm_q4_e");
        let ke = |kq| k_plan(1, kq, true, none, epi).map(|(i, t, r)| (NAMES[i], t, r));
        assert_eq!(ke(5120), Some(("gemv_q4_k_e", 160, 2)));
        assert_eq!(ke(17408), Some(("gemv_q4_kb_e", 544, 2)));
        let k = |kq, pro| k_plan(1, kq, true, pro, ne).map(|(i, t, r)| (NAMES[i], t, r));
        assert_eq!(k(5120, Prologue::None), Some(("gemv_q4_k", 160, 4)));
        assert_eq!(k(4352, Prologue::SiluMul), Some(("gemv_q4_k_silu", 160, 4)));
        assert_eq!(
            k(17408, Prologue::SiluMul),
            Some(("gemv_q4_kb_silu", 544, 4))
        );
        assert_eq!(k(17408, Prologue::None), Some(("gemv_q4_kb", 544, 4)));
        assert_eq!(k(20480, Prologue::None), Some(("gemv_q4_kb", 640, 4)));
        assert_eq!(k(20512, Prologue::None), None);
        assert_eq!(k_plan(2, 5120, true, none, ne), None);
        assert_eq!(k_plan(1, 5120, false, none, ne), None);
        assert_eq!(k_plan(2, 5120, true, none, epi), None);
    }

    /// The `#define`s of gemv_q4.cu must equal the Rust mirrors, and every kernel of NAMES
    /// must be instantiated, in order.
    #[test]
    fn cu_defines_match_rust_constants() {
        let src = super::super::program::SOURCES[Module::GemvQ4 as usize].1;
        let def = |name: &str| crate::cuda::twin::testing::cu_define(src, name);
        assert_eq!(def("TP_Q4_ROWS"), ROWS.to_string());
        assert_eq!(def("TP_Q4_ROWS_SILU"), ROWS_SILU.to_string());
        assert_eq!(def("TP_Q4_ROWS_TILE"), ROWS_TILE.to_string());
        assert_eq!(def("TP_Q4_TOKENS"), TOKENS.to_string());
        assert_eq!(def("TP_Q4K_ROWS"), K_ROWS.to_string());
        assert_eq!(def("TP_Q4K_ROWS_BIG"), K_ROWS_BIG.to_string());
        let at: Vec<usize> = NAMES
            .iter()
            .map(|n| {
                let plain = src.find(&format!("TP_GEMV_Q4_KERNEL({n},"));
                plain
                    .or_else(|| src.find(&format!("TP_GEMV_Q4K_KERNEL({n},")))
                    .unwrap_or_else(|| panic!("{n} instantiated"))
            })
            .collect();
        assert!(at.windows(2).all(|p| p[0] < p[1]));
    }

    #[test]
    fn plan_fills_the_sms() {
        let sms = 132;
        // gate|up of the 27B at TP=1: 8704 waves of 4 rows, 4 per block.
        let ne = Epilogue::None;
        let p = plan(1, 34816, Prologue::None, ne, sms);
        assert_eq!((p.index, p.grid, p.block), (0, (2176, 1, 1), 128));
        // The same with the epilogue: 8704 waves of 2 gate + 2 up rows.
        let p = plan(1, 34816, Prologue::None, Epilogue::SiluMul, sms);
        assert_eq!((p.index, p.grid, p.block), (8, (2176, 1, 1), 128));
        // down with the prologue: 640 waves of 8 rows; 160 blocks of 4 would be under 2 per
        // SM, so 320 blocks of 2 waves.
        let p = plan(1, 5120, Prologue::SiluMul, ne, sms);
        assert_eq!((p.index, p.grid, p.block), (1, (320, 1, 1), 64));
        let p = plan(19, 512, Prologue::SiluMul, ne, sms);
        assert_eq!((p.index, p.grid, p.block), (3, (256, 3, 1), 32));
    }

    /// Every twin case builds a valid op and runs on the CPU twin, cheaply.
    #[test]
    fn every_twin_case_runs_on_the_cpu() {
        let cpu = CpuDevice::new(0, 2, 10);
        let mut count = 0;
        for c in cases(7) {
            count += 1;
            let out = twin::run_alone(&cpu, &c).unwrap_or_else(|e| panic!("{}: {e}", c.name()));
            let y = crate::dtype::decode(DType::F32, out.last().unwrap());
            assert!(y.iter().all(|v| v.is_finite()), "{}", c.name());
        }
        assert_eq!(count, specs().len());
    }

    /// The twin cases on the GPU where there is one; "skipped: no GPU" otherwise.
    #[test]
    fn gpu_matmul_int4_matches_cpu_twin() {
        let Some(gpu) = crate::cuda::twin::testing::gpu_or_skip() else {
            return;
        };
        let cpu = CpuDevice::new(0, 4, 0);
        let res = selftest(&gpu, &cpu, 0x0074_7072_756e).unwrap();
        crate::cuda::twin::testing::assert_all_ok("matmul_int4", &res);
    }
}
