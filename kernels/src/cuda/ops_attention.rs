//! Launchers of `kernels/src/gpu/attention.cu` (`Op::Attention`) and its twin cases.
//!
//! With a workspace: `attn_split_g{G}_{dtype}` on a grid (kv_heads · chunks, parts, rows),
//! one block per (KV head, ≤ 8 of its query heads, part of the row's positions, row), then
//! `attn_merge` on (heads, rows). `parts` is chosen here (about two blocks per SM over the
//! grid, at most one per 256 positions of the cache); how many positions a part holds, the
//! kernels decide from the position on the device. Without: `attn_single_g{G}_{dtype}` on (kv_heads · chunks,
//! rows). The grid depends on `cap`, never on the positions (they are on the device), so one
//! captured launch serves every token. Heads per block: the query heads of one KV head
//! together (GQA), G the power of two that holds min(group, 8).
//!
//! Owns: the kernel table of attention.cu and the mirror of its parameter struct.
//! Must not: allocate or synchronise (captured into the decode graph).

use super::launch::Launcher;
use super::mem::CudaBuf;
use super::ops_decode::dtype_index;
use super::program::Module;
use super::twin::{self, Buf, Tol, TwinCase};
use super::{CudaDevice, SelftestResult};
use crate::cpu::CpuDevice;
use crate::device::{Op, View};
use crate::dtype::{encode, encode_u32};
use crate::ops::{self, ATTN_SPLIT};
use crate::{DType, KernelError, Result};

/// The kernels of attention.cu, in the order the launchers index them:
/// `(kind · 4 + log2 G) · 3 + dtype` with kind 0 = split, 1 = single, dtype in
/// [`DType::ALL`] order; then the merge.
pub(crate) const NAMES: &[&str] = &[
    "attn_split_g1_f32",
    "attn_split_g1_f16",
    "attn_split_g1_bf16",
    "attn_split_g2_f32",
    "attn_split_g2_f16",
    "attn_split_g2_bf16",
    "attn_split_g4_f32",
    "attn_split_g4_f16",
    "attn_split_g4_bf16",
    "attn_split_g8_f32",
    "attn_split_g8_f16",
    "attn_split_g8_bf16",
    "attn_single_g1_f32",
    "attn_single_g1_f16",
    "attn_single_g1_bf16",
    "attn_single_g2_f32",
    "attn_single_g2_f16",
    "attn_single_g2_bf16",
    "attn_single_g4_f32",
    "attn_single_g4_f16",
    "attn_single_g4_bf16",
    "attn_single_g8_f32",
    "attn_single_g8_f16",
    "attn_single_g8_bf16",
    "attn_merge",
];
const MERGE: usize = 24;

/// attention.cu TP_ATTN_THREADS.
const THREADS: u32 = 256;
/// attention.cu TP_ATTN_MERGE_THREADS.
const MERGE_THREADS: u32 = 256;
/// attention.cu TP_ATTN_DMAX: the largest head_dim the kernels take.
const DMAX: usize = 256;
/// attention.cu TP_ATTN_GMAX: most query heads per block.
const GMAX: usize = 8;
/// CUDA's limit on grid y and z.
const GRID_YZ_MAX: usize = 65_535;

/// attention.cu `struct AttnParams`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct AttnParams {
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    pos: u64,
    ws: u64,
    slots: u64,
    gate: u64,
    rows: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    cap: u32,
    parts: u32,
    group: u32,
    chunks: u32,
    vec: u32,
    scale: f32,
    nslots: u32,
    pad: u32,
}
const _: () = assert!(std::mem::size_of::<AttnParams>() == 112);

/// The index of the attention kernel for `single` (no workspace), `group` query heads per KV
/// head and the cache dtype (a float dtype: `validate()` keeps the cache one).
fn kernel_index(single: bool, group: usize, dtype: DType) -> Result<usize> {
    let g = match group.min(GMAX) {
        1 => 0,
        2 => 1,
        3 | 4 => 2,
        _ => 3,
    };
    Ok((usize::from(single) * 4 + g) * 3 + dtype_index(dtype)?)
}

/// The device address of `v`, which must be aligned to its element size.
fn addr(v: &View<'_, CudaBuf>, what: &str) -> Result<u64> {
    let a = v.buf.addr(v.offset, v.bytes())?;
    if !a.is_multiple_of(v.dtype.size() as u64) {
        return Err(KernelError::Invalid(format!(
            "attention: {what} is not aligned to its {}",
            v.dtype
        )));
    }
    Ok(a)
}

/// Queues one op of this family.
pub(crate) fn launch(l: &Launcher<'_>, op: &Op<'_, CudaBuf>) -> Result<()> {
    let Op::Attention(a) = op else {
        return Err(KernelError::Invalid(format!(
            "attention.cu has no kernel for '{}'",
            op.name()
        )));
    };
    let (d, cap) = (a.head_dim, a.cap());
    if d > DMAX {
        return Err(KernelError::Unavailable {
            backend: "cuda",
            why: format!("attention with head_dim {d} (at most {DMAX})"),
        });
    }
    if a.rows == 0 {
        return Ok(());
    }
    let splits = cap.div_ceil(ATTN_SPLIT);
    let group = a.heads / a.kv_heads;
    let chunks = group.div_ceil(GMAX);
    // Two blocks per SM (the kernels' launch bounds) over the grid's x and z; never more
    // parts than the workspace holds (one per ATTN_SPLIT positions of the cache).
    let others = (a.kv_heads * chunks).saturating_mul(a.rows).max(1);
    let parts = (2 * l.sms as usize).div_ceil(others).clamp(1, splits);
    // Rows go on grid z (split kernel) or y (single kernel), parts on y.
    if a.rows > GRID_YZ_MAX
        || splits > GRID_YZ_MAX
        || cap > u32::MAX as usize
        || a.kv_heads * chunks > u32::MAX as usize
    {
        return Err(KernelError::Invalid(format!(
            "attention: {} rows over a cache of {cap} exceed the CUDA grid",
            a.rows
        )));
    }
    let (k, v) = (addr(&a.k_cache, "k_cache")?, addr(&a.v_cache, "v_cache")?);
    let esize = a.k_cache.dtype.size();
    let mut p = AttnParams {
        q: addr(&a.q, "q")?,
        k,
        v,
        out: addr(&a.out, "out")?,
        pos: addr(&a.pos, "pos")?,
        ws: 0,
        slots: a
            .slots
            .map(|s| addr(&s.ids, "slots"))
            .transpose()?
            .unwrap_or(0),
        // (validate() refuses a gate that overlaps out.)
        gate: a.gate.map(|g| addr(&g, "gate")).transpose()?.unwrap_or(0),
        rows: a.rows as u32,
        heads: a.heads as u32,
        kv_heads: a.kv_heads as u32,
        head_dim: d as u32,
        cap: cap as u32,
        parts: parts as u32,
        group: group as u32,
        chunks: chunks as u32,
        // A row of one KV head starts at a multiple of d · size bytes from the base.
        vec: u32::from(
            k.is_multiple_of(16) && v.is_multiple_of(16) && (d * esize).is_multiple_of(16),
        ),
        scale: a.scale,
        nslots: a.slots.map_or(1, |s| s.count).min(u32::MAX as usize) as u32,
        pad: 0,
    };
    let x = (a.kv_heads * chunks) as u32;
    match &a.workspace {
        Some(ws) => {
            let need = ops::Attention::<CudaBuf>::workspace_len(a.rows, a.heads, d, cap);
            p.ws = addr(&ws.slice(0, need), "workspace")?;
            let split = l.kernels.func(
                Module::Attention,
                kernel_index(false, group, a.k_cache.dtype)?,
            );
            // SAFETY: AttnParams is the parameter of every attention.cu kernel; every address
            // was bounds-checked above (the workspace for the rows · heads · parts partials
            // the kernels write) and stays valid while the stream runs (the caller keeps its
            // buffers alive until a sync).
            unsafe { l.launch_fn(split, (x, parts as u32, a.rows as u32), THREADS, 0, &mut p)? };
            let merge = l.kernels.func(Module::Attention, MERGE);
            // SAFETY: as above.
            unsafe {
                l.launch_fn(
                    merge,
                    (a.heads as u32, a.rows as u32, 1),
                    MERGE_THREADS,
                    0,
                    &mut p,
                )
            }
        }
        None => {
            let f = l.kernels.func(
                Module::Attention,
                kernel_index(true, group, a.k_cache.dtype)?,
            );
            // SAFETY: as for the split kernel; this kernel does not touch the workspace (0).
            unsafe { l.launch_fn(f, (x, a.rows as u32, 1), THREADS, 0, &mut p) }
        }
    }
}

/// One attention twin case: random q, K and V (already rounded to the cache dtype), the
/// positions given, outputs poisoned, the workspace (when used) poisoned too: the merge must
/// read only partials the split kernel wrote.
struct AttnCase {
    dtype: DType,
    heads: usize,
    kv_heads: usize,
    d: usize,
    cap: usize,
    pos: Vec<u32>,
    /// Each row's cache slot (empty: one sequence) and the slots in the cache (each `cap`
    /// rows).
    slots: Vec<u32>,
    nslots: usize,
    workspace: bool,
    /// Qwen3.5's output gate (`ops::Attention::gate`).
    gate: bool,
    /// Elements the caches' views start after the buffer's start (1: misaligned, the scalar
    /// path).
    shift: usize,
    seed: u64,
}

impl AttnCase {
    fn rows(&self) -> usize {
        self.pos.len()
    }
    fn cache_len(&self) -> usize {
        self.nslots * self.cap * self.kv_heads * self.d
    }
}

impl TwinCase for AttnCase {
    fn name(&self) -> String {
        format!(
            "attention {} heads {}/{} d {} cap {} pos {:?} slots {:?}{}{}{}",
            self.dtype,
            self.heads,
            self.kv_heads,
            self.d,
            self.cap,
            self.pos,
            self.slots,
            if self.workspace { " split" } else { " single" },
            if self.gate { " gated" } else { "" },
            if self.shift > 0 { " misaligned" } else { "" }
        )
    }

    fn shape(&self) -> (DType, usize) {
        (self.dtype, self.rows() * self.heads * self.d)
    }

    fn bufs(&self) -> Vec<Buf> {
        let mut rng = super::selftest::Rng::new(self.seed);
        let n = self.rows() * self.heads * self.d;
        // Magnitudes 1/8 .. 2: scores of a few units, so that the softmax is neither flat nor
        // one-hot.
        let mut out = vec![
            Buf::input(DType::F32, rng.bytes(DType::F32, n, -3..=0)),
            Buf::input(
                self.dtype,
                rng.bytes(self.dtype, self.shift + self.cache_len(), -3..=0),
            ),
            Buf::input(
                self.dtype,
                rng.bytes(self.dtype, self.shift + self.cache_len(), -4..=1),
            ),
            Buf::output(DType::F32, n),
            Buf::input(DType::U32, encode_u32(&self.pos)),
            // (a slot buffer and a gate in every case, so that the workspace is always buffer
            // 7)
            Buf::input(
                DType::U32,
                encode_u32(if self.slots.is_empty() {
                    &[0]
                } else {
                    &self.slots
                }),
            ),
            // Gates of magnitude 1/8 .. 16, either sign: σ from ~1e-7 to ~1.
            Buf::input(DType::F32, rng.bytes(DType::F32, n, -3..=3)),
        ];
        if self.workspace {
            let len =
                ops::Attention::<()>::workspace_len(self.rows(), self.heads, self.d, self.cap);
            out.push(Buf::input(
                DType::F32,
                encode(DType::F32, &vec![f32::NAN; len]),
            ));
        }
        out
    }

    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        Op::Attention(ops::Attention {
            q: v[0],
            k_cache: v[1].slice(self.shift, self.cache_len()),
            v_cache: v[2].slice(self.shift, self.cache_len()),
            out: v[3],
            gate: self.gate.then_some(v[6]),
            pos: v[4],
            slots: (!self.slots.is_empty()).then_some(ops::CacheSlots {
                ids: v[5],
                count: self.nslots,
            }),
            rows: self.rows(),
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.d,
            scale: 1.0 / (self.d as f32).sqrt(),
            workspace: v.get(7).copied(),
        })
    }

    /// f32 math in another order than the CPU's: the dot products (≤ 256 terms), the softmax
    /// sums (≤ 1000 keys here, per split and then across splits) and the weighted sums of V.
    /// A sum of n terms reordered moves by at most about n · 2⁻²⁴ of the sum of magnitudes:
    /// 6e-5 for 1000 positive terms in the worst case, far less in practice (errors cancel);
    /// scores of a few units keep the dot products' absolute errors near 1e-6, which e^s turns
    /// into relative errors of the same size. 1e-4 · (1 + |out|) holds all of it with margin
    /// and still catches any wrong key, position or head (those move outputs by O(0.1)).
    fn tol(&self) -> Tol {
        Tol::Rel(1e-4)
    }
}

/// Position patterns for `rows` queries over a cache of `cap` rows: first, middle and last
/// row, past the end (clamped), consecutive and not.
fn positions(cap: usize, pattern: usize) -> Vec<u32> {
    let c = cap as u32;
    let mid = c / 2;
    match pattern % 7 {
        0 => vec![0],
        1 => vec![mid],
        2 => vec![c - 1],
        3 => vec![c + 5],
        // Consecutive (a prefill chunk), the last two clamped when the cache is small.
        4 => vec![mid, mid + 1, mid + 2],
        // Not consecutive, one past the end.
        5 => vec![c - 1, 0, c + 100],
        _ => vec![u32::MAX, mid, c.saturating_sub(2)],
    }
}

/// The twin cases: every KV dtype × head layouts (1/1, 4/2, 8/1, 6/6) × head_dim 8, 64, 128 ×
/// caps 1, 10, 300, 1000, each shape with the next position pattern, with and without a
/// workspace; then odd shapes, and parts of several chunks.
fn cases(seed: u64) -> Vec<AttnCase> {
    let mut out = Vec::new();
    let mut case_seed = seed;
    let mut next_seed = || {
        case_seed = case_seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        case_seed
    };
    let mut pattern = 0usize;
    for dtype in DType::ALL {
        for (heads, kv_heads) in [(1usize, 1usize), (4, 2), (8, 1), (6, 6)] {
            for d in [8usize, 64, 128] {
                for cap in [1usize, 10, 300, 1000] {
                    let pos = positions(cap, pattern);
                    pattern += 1;
                    for workspace in [true, false] {
                        out.push(AttnCase {
                            dtype,
                            heads,
                            kv_heads,
                            d,
                            cap,
                            pos: pos.clone(),
                            slots: vec![],
                            nslots: 1,
                            workspace,
                            gate: false,
                            shift: 0,
                            seed: next_seed(),
                        });
                    }
                }
            }
        }
        // Head_dim not a multiple of a pack (the scalar path), the largest head_dim (f32: two
        // packs per lane), groups of 3, 12 and 12 over 2 KV heads (an idle head; two chunks),
        // misaligned caches (the scalar path for every head_dim), head_dim 2.
        for (heads, kv_heads, d, cap, shift) in [
            (2usize, 1usize, 6usize, 300usize, 0usize),
            (3, 1, 256, 700, 0),
            (12, 1, 64, 520, 0),
            (24, 2, 128, 257, 0),
            (4, 2, 128, 300, 1),
            (6, 6, 8, 1000, 1),
            (8, 1, 2, 33, 0),
        ] {
            for workspace in [true, false] {
                out.push(AttnCase {
                    dtype,
                    heads,
                    kv_heads,
                    d,
                    cap,
                    pos: positions(cap, pattern),
                    slots: vec![],
                    nslots: 1,
                    workspace,
                    gate: false,
                    shift,
                    seed: next_seed(),
                });
                pattern += 1;
            }
        }
        // Three rows over a long cache and 8 KV heads: fewer parts than 256-position splits
        // (on any GPU of under ~700 SMs), so a part walks several chunks, merging them as it
        // goes (attn_range's running state in the split kernel).
        out.push(AttnCase {
            dtype,
            heads: 32,
            kv_heads: 8,
            d: 128,
            cap: 16384,
            pos: vec![16383, 5000, 300],
            slots: vec![],
            nslots: 1,
            workspace: true,
            gate: false,
            shift: 0,
            seed: next_seed(),
        });
        // One query over 8 KV heads of 4 query heads (Llama-3-8B's layout at TP=1): at the
        // decode benchmark's last position and at 1023, where (with 16 parts: any GPU of 64 SMs
        // or more) the parts are short enough for the split kernel to load K and V before its
        // PDL wait, and at 1500, where they are not.
        for pos in [383u32, 1023, 1500] {
            out.push(AttnCase {
                dtype,
                heads: 32,
                kv_heads: 8,
                d: 128,
                cap: 4096,
                pos: vec![pos],
                slots: vec![],
                nslots: 1,
                workspace: true,
                gate: false,
                shift: 0,
                seed: next_seed(),
            });
        }
        // Qwen3.5-27B's full attention at TP=1 (24 query heads over 4 KV heads of 256) with its
        // output gate, one query and a prompt of three, split and single.
        for workspace in [true, false] {
            for pos in [vec![150u32], vec![20, 21, 22]] {
                out.push(AttnCase {
                    dtype,
                    heads: 24,
                    kv_heads: 4,
                    d: 256,
                    cap: 300,
                    pos,
                    slots: vec![],
                    nslots: 1,
                    workspace,
                    gate: true,
                    shift: 0,
                    seed: next_seed(),
                });
            }
        }
        // A batch of sequences in cache slots (an id past the last slot is clamped to it),
        // a prompt of three positions in one slot among them, and one sequence in a slot (one
        // row: the early loads from its slot).
        for workspace in [true, false] {
            for (pos, slots) in [
                (vec![5u32, 299, 0, 150], vec![2u32, 0, 1, 7]),
                (vec![7, 8, 9, 40], vec![1, 1, 1, 0]),
                (vec![150], vec![2]),
            ] {
                out.push(AttnCase {
                    dtype,
                    heads: 8,
                    kv_heads: 2,
                    d: 64,
                    cap: 300,
                    pos,
                    slots,
                    nslots: 3,
                    workspace,
                    gate: false,
                    shift: 0,
                    seed: next_seed(),
                });
            }
        }
    }
    out
}

/// This family's twin cases (see `twin`).
pub(crate) fn selftest(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    seed: u64,
) -> Result<Vec<SelftestResult>> {
    cases(seed).iter().map(|c| twin::run(gpu, cpu, c)).collect()
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::device::Device;

    #[test]
    fn names_match_the_source_and_the_index() {
        let src = super::super::program::SOURCES[Module::Attention as usize].1;
        for name in NAMES {
            assert!(
                src.contains(&format!("({name},")) || src.contains(&format!(" {name}(")),
                "{name} not in attention.cu"
            );
        }
        assert_eq!(
            NAMES[kernel_index(false, 1, DType::F32).unwrap()],
            "attn_split_g1_f32"
        );
        assert_eq!(
            NAMES[kernel_index(false, 3, DType::BF16).unwrap()],
            "attn_split_g4_bf16"
        );
        assert_eq!(
            NAMES[kernel_index(true, 6, DType::F16).unwrap()],
            "attn_single_g8_f16"
        );
        assert_eq!(
            NAMES[kernel_index(true, 12, DType::BF16).unwrap()],
            "attn_single_g8_bf16"
        );
        assert_eq!(NAMES[MERGE], "attn_merge");
        assert_eq!(NAMES.len(), MERGE + 1);
    }

    #[test]
    fn cu_defines_match_rust_constants() {
        let src = super::super::program::SOURCES[Module::Attention as usize].1;
        let def = |name: &str| crate::cuda::twin::testing::cu_define(src, name);
        assert_eq!(def("TP_ATTN_SPLIT"), ATTN_SPLIT.to_string());
        assert_eq!(def("TP_ATTN_THREADS"), THREADS.to_string());
        assert_eq!(def("TP_ATTN_MERGE_THREADS"), MERGE_THREADS.to_string());
        assert_eq!(def("TP_ATTN_DMAX"), DMAX.to_string());
        assert_eq!(def("TP_ATTN_GMAX"), GMAX.to_string());
    }

    /// Every case is valid and runs on the CPU twin (no GPU needed).
    #[test]
    fn cases_run_on_the_cpu() {
        let cpu = CpuDevice::new(0, 2, 0);
        let all = cases(3);
        assert!(all.len() > 300);
        for c in &all {
            let bufs = crate::cuda::twin::run_alone(&cpu, c)
                .unwrap_or_else(|e| panic!("{}: {e}", c.name()));
            assert!(
                crate::dtype::decode(DType::F32, &bufs[3])
                    .iter()
                    .all(|x| x.is_finite()),
                "{}",
                c.name()
            );
        }
    }

    /// The position patterns stay meaningful for every cap the cases use.
    #[test]
    fn position_patterns_cover_the_edges() {
        for cap in [1usize, 10, 300, 1000] {
            let all: Vec<u32> = (0..7).flat_map(|p| positions(cap, p)).collect();
            assert!(all.contains(&0) && all.contains(&(cap as u32 - 1)));
            assert!(all.iter().any(|&p| p as usize >= cap));
        }
    }

    /// Every twin case on a GPU, when there is one (`TPRUN_REQUIRE_GPU=1` makes its absence a
    /// failure).
    #[test]
    fn attention_twins_on_the_gpu() {
        let Some(gpu) = crate::cuda::twin::testing::gpu_or_skip() else {
            return;
        };
        let cpu = CpuDevice::new(0, 2, 0);
        let results = selftest(&gpu, &cpu, 1).unwrap();
        crate::cuda::twin::testing::assert_all_ok("attention", &results);
    }

    /// Device time of one `op`: 50 of them captured into one graph, replayed (once to warm
    /// up, then 5 times timed), so that no host launch cost is counted.
    pub(in crate::cuda) fn graph_time(
        gpu: &CudaDevice,
        op: &Op<'_, CudaBuf>,
    ) -> std::time::Duration {
        const REPS: u32 = 50;
        let graph = gpu
            .capture(&mut || (0..REPS).try_for_each(|_| gpu.run(op)))
            .unwrap()
            .unwrap();
        gpu.replay(&graph).unwrap();
        gpu.time(&mut || (0..5).try_for_each(|_| gpu.replay(&graph)))
            .unwrap()
            / (5 * REPS)
    }

    /// Timings for the report (run with --ignored on a GPU machine): decode attention (one
    /// query at the last position) for Llama-3-8B-like shapes, bf16 cache, split kernels
    /// and merge (or the single kernel), device time from graph replays; bandwidth counts
    /// the K and V bytes read.
    #[test]
    #[ignore]
    fn attention_timings() {
        let Some(gpu) = crate::cuda::twin::testing::gpu_or_skip() else {
            return;
        };
        // (heads, KV heads, cache rows, rows, positions in use): a short sequence in a
        // large cache is the decode benchmark's case (a 128-token prompt, 4096 rows).
        for (heads, kvh, cap, rows, used) in [
            (32usize, 8usize, 4096usize, 1usize, 256usize),
            (32, 8, 4096, 1, 1024),
            (32, 8, 4096, 1, 4096),
            (32, 8, 32_768, 1, 32_768),
            (8, 2, 4096, 1, 256),
            (8, 2, 32_768, 1, 32_768),
            (8, 2, 131_072, 1, 131_072),
            (32, 8, 512, 1, 512),
            (32, 8, 4096, 4, 4096),
        ] {
            let d = 128;
            let dtype = DType::BF16;
            let n = cap * kvh * d;
            let (k, v) = (gpu.alloc(n * 2).unwrap(), gpu.alloc(n * 2).unwrap());
            let mut rng = crate::rng::Rng::new(1);
            gpu.write(&k, 0, &encode(dtype, &rng.vec_sym(n))).unwrap();
            gpu.write(&v, 0, &encode(dtype, &rng.vec_sym(n))).unwrap();
            let qn = rows * heads * d;
            let q = gpu.alloc(qn * 4).unwrap();
            gpu.write(&q, 0, &encode(DType::F32, &rng.vec_sym(qn)))
                .unwrap();
            let o = gpu.alloc(qn * 4).unwrap();
            let pos: Vec<u32> = (0..rows as u32)
                .map(|r| used as u32 - rows as u32 + r)
                .collect();
            let pb = gpu.alloc(rows * 4).unwrap();
            gpu.write(&pb, 0, &encode_u32(&pos)).unwrap();
            let wl = ops::Attention::<()>::workspace_len(rows, heads, d, cap);
            let ws = gpu.alloc(wl * 4).unwrap();
            for split in [true, false] {
                let op = Op::Attention(ops::Attention {
                    q: View::new(&q, 0, qn, DType::F32),
                    k_cache: View::new(&k, 0, n, dtype),
                    v_cache: View::new(&v, 0, n, dtype),
                    out: View::new(&o, 0, qn, DType::F32),
                    gate: None,
                    pos: View::new(&pb, 0, rows, DType::U32),
                    slots: None,
                    rows,
                    heads,
                    kv_heads: kvh,
                    head_dim: d,
                    scale: 0.088,
                    workspace: split.then(|| View::new(&ws, 0, wl, DType::F32)),
                });
                let t = graph_time(&gpu, &op);
                let bytes = 2.0 * (used * kvh * d * 2) as f64;
                println!(
                    "TIMING attention {} split {ATTN_SPLIT} heads {heads}/{kvh} d {d} bf16 cap {cap} used {used} rows {rows}: {:.2} us, {:.0} GB/s of K+V",
                    if split { "split+merge" } else { "single" },
                    t.as_secs_f64() * 1e6,
                    bytes / t.as_secs_f64() / 1e9
                );
            }
        }
    }
}
