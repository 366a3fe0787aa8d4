//! Launchers of `kernels/src/gpu/sample.cu` (`Op::ShardTopK`, `Op::Sample`) and their twin
//! cases, plus the check that the device's uniform draw is `ops::sample_uniform` bit for bit.
//!
//! Both ops are one block each (sample.cu says why); their results are compared exactly.
//!
//! Owns: the kernel table of sample.cu and the mirrors of its parameter structs.
//! Must not: allocate or synchronise in a launcher (captured into the decode graph).

use super::launch::Launcher;
use super::mem::CudaBuf;
use super::program::Module;
use super::twin::{self, Buf, Tol, TwinCase};
use super::{CudaDevice, SelftestResult};
use crate::cpu::CpuDevice;
use crate::device::{Device, Op, View};
use crate::dtype::{encode, encode_u32};
use crate::ops::{self, SampleParams, TOPK_MAX};
use crate::{DType, KernelError, Result};

/// The kernels of sample.cu, in the order the launchers index them.
pub(crate) const NAMES: &[&str] = &["shard_topk", "sample", "sample_uniform_probe"];
const SHARD_TOPK: usize = 0;
const SAMPLE: usize = 1;
const UNIFORM_PROBE: usize = 2;

/// sample.cu TP_TOPK_THREADS: the one block of shard_topk and sample.
const THREADS: u32 = 1024;
/// sample.cu TP_SAMPLE_MAX_CANDS: most pairs `sample` sorts.
const MAX_CANDS: usize = 4096;
const _: () = assert!(MAX_CANDS == TOPK_MAX * crate::comm::MAX_WORLD);

/// sample.cu `struct TopkParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct TopkParams {
    logits: u64,
    out: u64,
    n: u32,
    vocab_start: u32,
    k: u32,
    vec: u32,
}
const _: () = assert!(std::mem::size_of::<TopkParams>() == 32);

/// sample.cu `struct SampleParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct SampleArgs {
    cands: u64,
    state: u64,
    tokens: u64,
    tokens_len: u64,
    seed: u64,
    ncands: u32,
    temperature: f32,
    top_k: u32,
    top_p: f32,
}
const _: () = assert!(std::mem::size_of::<SampleArgs>() == 56);

/// sample.cu `struct UniformProbeParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniformProbeParams {
    seeds: u64,
    positions: u64,
    out: u64,
    n: u64,
}
const _: () = assert!(std::mem::size_of::<UniformProbeParams>() == 32);

/// The device address of `v` (bounds-checked), which must be 4-byte aligned (f32 and u32).
fn addr4(v: &View<'_, CudaBuf>, what: &str) -> Result<u64> {
    let a = v.buf.addr(v.offset, v.bytes())?;
    if !a.is_multiple_of(4) {
        return Err(KernelError::Invalid(format!(
            "{what} is not 4-byte aligned"
        )));
    }
    Ok(a)
}

/// Queues one op of this family.
pub(crate) fn launch(l: &Launcher<'_>, op: &Op<'_, CudaBuf>) -> Result<()> {
    match op {
        Op::ShardTopK(a) => {
            let logits = addr4(&a.logits, "shard_topk logits")?;
            let mut p = TopkParams {
                logits,
                out: addr4(&a.out, "shard_topk out")?,
                // validate() keeps vocab_start + n below 2^24.
                n: a.logits.len as u32,
                vocab_start: a.vocab_start as u32,
                k: a.k as u32,
                vec: u32::from(logits.is_multiple_of(16)),
            };
            let f = l.kernels.func(Module::Sample, SHARD_TOPK);
            // SAFETY: TopkParams is shard_topk's parameter; both views bounds-checked above and
            // kept alive by the caller until the stream passes the launch.
            unsafe { l.launch_fn(f, (1, 1, 1), THREADS, 0, &mut p) }
        }
        Op::Sample(a) => {
            let mut p = SampleArgs {
                cands: addr4(&a.cands, "sample cands")?,
                state: addr4(&a.state, "sample state")?,
                tokens: addr4(&a.tokens, "sample tokens")?,
                tokens_len: a.tokens.len as u64,
                seed: a.params.seed,
                // validate(): at most 2 · TOPK_MAX · MAX_WORLD values.
                ncands: (a.cands.len / 2) as u32,
                temperature: a.params.temperature,
                top_k: a.params.top_k,
                top_p: a.params.top_p,
            };
            let f = l.kernels.func(Module::Sample, SAMPLE);
            // SAFETY: SampleArgs is sample's parameter; every view bounds-checked above.
            unsafe { l.launch_fn(f, (1, 1, 1), THREADS, 0, &mut p) }
        }
        other => Err(KernelError::Invalid(format!(
            "sample.cu has no kernel for '{}'",
            other.name()
        ))),
    }
}

/// How a ShardTopK case's logits look.
#[derive(Clone, Copy, Debug)]
enum Logits {
    /// Random values of both signs, a few ±0.
    Random,
    /// Whole numbers 0..4: every value many times (ties to the lower id).
    Ties,
    /// Random with every 5th value NaN and some −∞.
    NansAndInfs,
    /// Only NaN: every pair is padding.
    AllNan,
    /// Only −∞ (real candidates: `better` keeps them) with some NaN.
    NegInf,
    /// Large values only where `i % period < width`: with 16-byte loads (4096, 256) puts them
    /// all in 64 threads' packs, with scalar loads (1024, 64) in 64 threads, each thread's a
    /// step above the previous thread's: the threshold (the 64th best thread best) is thread
    /// 0's best, all the others' large values reach it, and for k = 64 more than 2048
    /// elements then pass: the kernel's fallback runs.
    Clustered { period: usize, width: usize },
    /// Increasing with the id (the best at the end of the shard).
    Ascending,
}

struct TopkCase {
    n: usize,
    k: usize,
    vocab_start: usize,
    logits: Logits,
    /// Elements the logits view starts after the buffer's start (1: the scalar path).
    shift: usize,
    seed: u64,
}

impl TopkCase {
    fn values(&self) -> Vec<f32> {
        let mut rng = super::selftest::Rng::new(self.seed);
        (0..self.n)
            .map(|i| {
                let r = rng.value(-6..=4);
                match self.logits {
                    Logits::Random => r,
                    Logits::Ties => (rng.next() % 5) as f32,
                    Logits::NansAndInfs if i % 5 == 3 => f32::NAN,
                    Logits::NansAndInfs if i % 7 == 1 => f32::NEG_INFINITY,
                    Logits::NansAndInfs => r,
                    Logits::AllNan => f32::NAN,
                    Logits::NegInf if i % 3 == 0 => f32::NAN,
                    Logits::NegInf => f32::NEG_INFINITY,
                    Logits::Clustered { period, width } if i % period < width => {
                        100.0
                            + ((i % period) * 1024 / period) as f32
                            + (rng.next() % 64) as f32 / 128.0
                    }
                    Logits::Clustered { .. } => r,
                    Logits::Ascending => i as f32 * 0.25,
                }
            })
            .collect()
    }
}

impl TwinCase for TopkCase {
    fn name(&self) -> String {
        format!(
            "shard_topk n {} k {} from {} {:?}{}",
            self.n,
            self.k,
            self.vocab_start,
            self.logits,
            if self.shift > 0 { " misaligned" } else { "" }
        )
    }
    fn shape(&self) -> (DType, usize) {
        (DType::F32, self.n)
    }
    fn bufs(&self) -> Vec<Buf> {
        let mut v = vec![0.5f32; self.shift];
        v.extend(self.values());
        vec![
            Buf::input(DType::F32, encode(DType::F32, &v)),
            Buf::output(DType::F32, 2 * self.k),
        ]
    }
    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        Op::ShardTopK(ops::ShardTopK {
            logits: v[0].slice(self.shift, self.n),
            vocab_start: self.vocab_start,
            k: self.k,
            out: v[1],
        })
    }
    /// A selection: the same pairs, bit for bit.
    fn tol(&self) -> Tol {
        Tol::Exact
    }
}

/// How a Sample case's candidates look.
#[derive(Clone, Copy, Debug)]
enum Cands {
    /// `world` shards of `k` pairs each as ShardTopK writes them (sorted, the last few of some
    /// shards padding), logits of a few units; some equal across shards.
    Shards { world: usize, k: usize },
    /// The same pairs in random order, with NaN logits among them (the token: NO_TOKEN).
    Shuffled { world: usize, k: usize },
    /// 64 equal logits: at temperature 1 the pick is candidate ⌊u · 64⌋ (in id order), so
    /// each position checks six bits of the uniform draw.
    Flat,
    /// Only padding: the token is 0.
    Empty,
}

struct SampleCase {
    cands: Cands,
    params: SampleParams,
    state: [u32; 2],
    tokens_len: usize,
    seed: u64,
}

impl SampleCase {
    fn pairs(&self) -> Vec<f32> {
        let mut rng = super::selftest::Rng::new(self.seed);
        let shards = |world: usize, k: usize, rng: &mut super::selftest::Rng| -> Vec<f32> {
            let mut v = Vec::new();
            for s in 0..world {
                // Shard s holds ids s·1000 .. s·1000 + 1000; shard 1 has only 3 real pairs.
                let real = if s == 1 { k.min(3) } else { k };
                let mut pairs: Vec<(f32, u32)> = (0..real)
                    .map(|j| {
                        // Coarse values (multiples of 1/8) so that shards share some logits.
                        let l = (rng.next() % 64) as f32 / 8.0 - 4.0;
                        (l, (s * 1000 + j * 7 + (rng.next() % 7) as usize) as u32)
                    })
                    .collect();
                pairs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                for j in 0..k {
                    let (l, id) = pairs.get(j).copied().unwrap_or((f32::NEG_INFINITY, 0));
                    v.extend([l, id as f32]);
                }
            }
            v
        };
        match self.cands {
            Cands::Shards { world, k } => shards(world, k, &mut rng),
            Cands::Shuffled { world, k } => {
                let v = shards(world, k, &mut rng);
                let mut pairs: Vec<[f32; 2]> = v.chunks_exact(2).map(|p| [p[0], p[1]]).collect();
                for i in (1..pairs.len()).rev() {
                    pairs.swap(i, rng.next() as usize % (i + 1));
                }
                for p in pairs.iter_mut().step_by(9) {
                    p[0] = f32::NAN;
                }
                pairs.concat()
            }
            Cands::Flat => (0..TOPK_MAX)
                .flat_map(|j| [1.0, (5 + 3 * j) as f32])
                .collect(),
            Cands::Empty => (0..8).flat_map(|_| [f32::NEG_INFINITY, 0.0]).collect(),
        }
    }
}

impl TwinCase for SampleCase {
    fn name(&self) -> String {
        let p = &self.params;
        format!(
            "sample {:?} t {} top_k {} top_p {} state {:?} tokens {}",
            self.cands, p.temperature, p.top_k, p.top_p, self.state, self.tokens_len
        )
    }
    fn shape(&self) -> (DType, usize) {
        (DType::U32, self.pairs().len() / 2)
    }
    fn bufs(&self) -> Vec<Buf> {
        let tokens: Vec<u32> = (0..self.tokens_len as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        vec![
            Buf::input(DType::F32, encode(DType::F32, &self.pairs())),
            Buf::inout(DType::U32, encode_u32(&self.state)),
            Buf::inout(DType::U32, encode_u32(&tokens)),
        ]
    }
    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B> {
        Op::Sample(ops::Sample {
            cands: v[0],
            params: self.params,
            state: v[1],
            tokens: v[2],
        })
    }
    /// Token ids: exact. (Where the device's expf and the host's differ in the last bit, a
    /// sampled token could differ when the uniform draw falls within that bit of a boundary:
    /// about 64 · 2⁻²³ per draw, 1e-5; no such case has been seen.)
    fn tol(&self) -> Tol {
        Tol::Exact
    }
}

/// Runs sample_uniform_probe over `seeds` × `positions` pairs and compares every value with
/// [`ops::sample_uniform`] bit for bit.
fn uniform_check(gpu: &CudaDevice, seeds: &[u64], positions: &[u32]) -> Result<SelftestResult> {
    let n = seeds.len();
    let sb = gpu.alloc(n * 8)?;
    let pb = gpu.alloc(n * 4)?;
    let ob = gpu.alloc(n * 4)?;
    let seed_bytes: Vec<u8> = seeds.iter().flat_map(|s| s.to_le_bytes()).collect();
    gpu.write(&sb, 0, &seed_bytes)?;
    gpu.write(&pb, 0, &encode_u32(positions))?;
    let mut p = UniformProbeParams {
        seeds: sb.addr(0, n * 8)?,
        positions: pb.addr(0, n * 4)?,
        out: ob.addr(0, n * 4)?,
        n: n as u64,
    };
    gpu.bind()?;
    let l = gpu.launcher();
    let f = l.kernels.func(Module::Sample, UNIFORM_PROBE);
    // SAFETY: UniformProbeParams is sample_uniform_probe's parameter; the three buffers hold n
    // elements each (checked by addr) and live until the sync below.
    unsafe { l.launch_fn(f, (l.grid_for(n, 256), 1, 1), 256, 0, &mut p)? };
    gpu.sync()?;
    let mut got = vec![0u8; n * 4];
    gpu.read(&ob, 0, &mut got)?;
    let detail = got
        .chunks_exact(4)
        .zip(seeds.iter().zip(positions))
        .find_map(|(g, (&s, &pos))| {
            let want = ops::sample_uniform(s, pos);
            (g != want.to_le_bytes())
                .then(|| format!("seed {s:#x} position {pos}: got {g:02x?}, expected {want}"))
        })
        .unwrap_or_default();
    Ok(SelftestResult {
        op: "sample_uniform splitmix64 (device vs ops::sample_uniform)".into(),
        dtype: DType::F32,
        elems: n,
        ok: detail.is_empty(),
        detail,
    })
}

/// The ShardTopK cases: shards of 1, 100 and 128256 logits × k 1, 8, 64 × random, tied and
/// NaN/−∞ logits × aligned and not; then odd ones (empty and tiny shards, all NaN, all −∞,
/// the threshold's fallback, sorted logits).
fn topk_cases(seed: u64) -> Vec<TopkCase> {
    let mut out = Vec::new();
    let mut case_seed = seed;
    let mut next_seed = || {
        case_seed = case_seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        case_seed
    };
    for n in [1usize, 100, 128_256] {
        for k in [1usize, 8, 64] {
            for logits in [Logits::Random, Logits::Ties, Logits::NansAndInfs] {
                for shift in [0usize, 1] {
                    let vocab_start = if shift == 0 { 0 } else { 3 * 128_256 };
                    out.push(TopkCase {
                        n,
                        k,
                        vocab_start,
                        logits,
                        shift,
                        seed: next_seed(),
                    });
                }
            }
        }
    }
    let odd = [
        (0usize, 8usize, Logits::Random, 0usize),
        (5, 64, Logits::Random, 0),
        (3, 1, Logits::AllNan, 0),
        (1000, 8, Logits::AllNan, 1),
        (1000, 1, Logits::NegInf, 0),
        (1000, 64, Logits::NegInf, 1),
        (70_000, 1, Logits::NegInf, 0),
        (
            128_256,
            64,
            Logits::Clustered {
                period: 4096,
                width: 256,
            },
            0,
        ),
        (
            128_256,
            64,
            Logits::Clustered {
                period: 1024,
                width: 64,
            },
            1,
        ),
        (
            128_256,
            8,
            Logits::Clustered {
                period: 4096,
                width: 256,
            },
            0,
        ),
        (128_256, 64, Logits::Ascending, 0),
        (128_256, 1, Logits::Ascending, 1),
        (131_071, 64, Logits::Ties, 0),
        (4099, 64, Logits::Random, 0),
    ];
    for (n, k, logits, shift) in odd {
        out.push(TopkCase {
            n,
            k,
            vocab_start: 17,
            logits,
            shift,
            seed: next_seed(),
        });
    }
    out
}

/// The Sample cases: greedy, temperature 0.8 / top_k 40 / top_p 0.9, top_k 1, and
/// temperature 1.3 over everything, on candidate sets from 1 to 64 shards, at several
/// positions; then the flat set at 40 positions.
fn sample_cases(seed: u64) -> Vec<SampleCase> {
    let mut out = Vec::new();
    let mut case_seed = seed;
    let mut next_seed = || {
        case_seed = case_seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        case_seed
    };
    let greedy = SampleParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 7,
    };
    let sampled = SampleParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        seed: 0x5eed,
    };
    let tokens_len = 50;
    // (token, position) before the step: the start, the middle, the last stored position,
    // one past the end (not stored), the u32 wrap (stored at 0), far past the end.
    let states = [
        [1u32, 0],
        [9, 20],
        [4, 48],
        [4, 49],
        [3, u32::MAX],
        [2, 1_000_000],
    ];
    let sets = [
        Cands::Shards { world: 1, k: 1 },
        Cands::Shards { world: 4, k: 1 },
        Cands::Shards { world: 1, k: 64 },
        Cands::Shards { world: 4, k: 8 },
        Cands::Shards { world: 8, k: 64 },
        Cands::Shuffled { world: 3, k: 40 },
        Cands::Shuffled { world: 64, k: 64 },
        Cands::Empty,
    ];
    for (i, cands) in sets.into_iter().enumerate() {
        for params in [
            greedy,
            sampled,
            SampleParams {
                top_k: 1,
                ..sampled
            },
            SampleParams {
                temperature: 1.3,
                top_k: 0,
                top_p: 1.0,
                seed: 99,
            },
        ] {
            for state in states.iter().skip(i % 2).step_by(2) {
                out.push(SampleCase {
                    cands,
                    params,
                    state: *state,
                    tokens_len,
                    seed: next_seed(),
                });
            }
        }
    }
    let flat = SampleParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0xdead_beef,
    };
    for position in (0..40u32).map(|i| i * 7919) {
        out.push(SampleCase {
            cands: Cands::Flat,
            params: flat,
            state: [0, position],
            tokens_len: 1 << 20,
            seed: 0,
        });
    }
    out
}

/// This family's twin cases (see `twin`), after the check of the uniform draw.
pub(crate) fn selftest(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    seed: u64,
) -> Result<Vec<SelftestResult>> {
    let mut out = Vec::new();
    // The uniform draw: edge seeds and positions, then many random pairs.
    let mut rng = super::selftest::Rng::new(seed);
    let mut seeds = vec![0, 0, u64::MAX, u64::MAX, 1, 0x9e37_79b9_7f4a_7c15];
    let mut positions = vec![0, u32::MAX, 0, u32::MAX, 1, 12345];
    for _ in 0..100_000 {
        seeds.push(rng.next());
        positions.push(rng.next() as u32);
    }
    out.push(uniform_check(gpu, &seeds, &positions)?);
    for c in topk_cases(seed) {
        out.push(twin::run(gpu, cpu, &c)?);
    }
    for c in sample_cases(seed) {
        out.push(twin::run(gpu, cpu, &c)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_the_source() {
        let src = super::super::program::SOURCES[Module::Sample as usize].1;
        for name in NAMES {
            assert!(
                src.contains(&format!(" {name}(")),
                "{name} not in sample.cu"
            );
        }
        let def = |name: &str| crate::cuda::twin::testing::cu_define(src, name);
        assert_eq!(def("TP_TOPK_THREADS"), THREADS.to_string());
        assert_eq!(def("TP_TOPK_MAX"), TOPK_MAX.to_string());
        assert_eq!(def("TP_SAMPLE_MAX_CANDS"), MAX_CANDS.to_string());
        assert_eq!(def("TP_NO_TOKEN"), format!("{:#x}u", ops::NO_TOKEN));
        assert_eq!(def("TP_NAN_BITS"), format!("{:#x}u", ops::NAN_BITS));
    }

    /// Runs `case` on the CPU twin: its inputs (outputs zeroed), the op, the buffers after.
    fn on_cpu<C: TwinCase>(cpu: &CpuDevice, case: &C) -> Vec<Vec<u8>> {
        crate::cuda::twin::run_alone(cpu, case).unwrap_or_else(|e| panic!("{}: {e}", case.name()))
    }

    /// Every case is valid and runs on the CPU twin; the top-k of a NaN-free shard is sorted
    /// and has no pads.
    #[test]
    fn cases_run_on_the_cpu() {
        let cpu = CpuDevice::new(0, 2, 0);
        for c in topk_cases(5) {
            let out = crate::dtype::decode(DType::F32, &on_cpu(&cpu, &c)[1]);
            if matches!(c.logits, Logits::Random | Logits::Ties | Logits::Ascending) && c.n >= c.k {
                assert!(out.chunks(2).all(|p| p[0].is_finite()), "{}", c.name());
                assert!(
                    out.chunks(2)
                        .zip(out.chunks(2).skip(1))
                        .all(|(a, b)| a[0] > b[0] || (a[0] == b[0] && a[1] < b[1])),
                    "{}",
                    c.name()
                );
            }
        }
        for c in sample_cases(5) {
            on_cpu(&cpu, &c);
        }
    }

    /// The flat candidate set really exposes the draw: the CPU twin picks candidate ⌊u · 64⌋.
    #[test]
    fn flat_candidates_reveal_the_uniform_draw() {
        let cpu = CpuDevice::new(0, 1, 0);
        let params = SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 3,
        };
        for pos in 0..200u32 {
            let case = SampleCase {
                cands: Cands::Flat,
                params,
                state: [0, pos],
                tokens_len: 1,
                seed: 0,
            };
            let state = crate::dtype::decode_u32(&on_cpu(&cpu, &case)[1]);
            let u = ops::sample_uniform(3, pos + 1);
            assert_eq!(state, vec![5 + 3 * (u * 64.0) as u32, pos + 1]);
        }
    }

    /// The clustered logits put more than TP_TOPK_CAP elements over the threshold (so the
    /// fallback runs): with 16-byte loads, thread t reads packs t, t + 1024, ...
    #[test]
    fn clustered_logits_defeat_the_threshold() {
        let case = TopkCase {
            n: 128_256,
            k: 64,
            vocab_start: 0,
            logits: Logits::Clustered {
                period: 4096,
                width: 256,
            },
            shift: 0,
            seed: 1,
        };
        let v = case.values();
        let mut best = vec![f32::NEG_INFINITY; 1024];
        for (i, &x) in v.iter().enumerate().take(v.len() / 4 * 4) {
            best[(i / 4) % 1024] = best[(i / 4) % 1024].max(x);
        }
        let mut sorted = best.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let tau = sorted[63];
        assert!(v.iter().filter(|&&x| x >= tau).count() > 2048);
    }

    /// Every twin case on a GPU, when there is one.
    #[test]
    fn sample_twins_on_the_gpu() {
        let Some(gpu) = crate::cuda::twin::testing::gpu_or_skip() else {
            return;
        };
        let cpu = CpuDevice::new(0, 2, 0);
        let results = selftest(&gpu, &cpu, 1).unwrap();
        crate::cuda::twin::testing::assert_all_ok("sample", &results);
    }

    /// Timings for the report (run with --ignored on a GPU machine): ShardTopK over a 128256
    /// logits shard (k = 1, 8, 64; random and clustered logits), Sample over 4 × 64 pairs; device time from graph replays.
    #[test]
    #[ignore]
    fn sample_timings() {
        let Some(gpu) = crate::cuda::twin::testing::gpu_or_skip() else {
            return;
        };
        let n = 128_256;
        for (k, logits) in [
            (1usize, Logits::Random),
            (8, Logits::Random),
            (64, Logits::Random),
            (
                64,
                Logits::Clustered {
                    period: 4096,
                    width: 256,
                },
            ),
        ] {
            let case = TopkCase {
                n,
                k,
                vocab_start: 0,
                logits,
                shift: 0,
                seed: 4,
            };
            let lb = gpu.alloc(n * 4).unwrap();
            gpu.write(&lb, 0, &encode(DType::F32, &case.values()))
                .unwrap();
            let ob = gpu.alloc(2 * k * 4).unwrap();
            let op = Op::ShardTopK(ops::ShardTopK {
                logits: View::new(&lb, 0, n, DType::F32),
                vocab_start: 0,
                k,
                out: View::new(&ob, 0, 2 * k, DType::F32),
            });
            gpu.run(&op).unwrap();
            let t = gpu
                .time(&mut || (0..200).try_for_each(|_| gpu.run(&op)))
                .unwrap()
                / 200;
            println!(
                "TIMING shard_topk n {n} k {k} {logits:?}: {:.2} us",
                t.as_secs_f64() * 1e6
            );
        }
        let case = SampleCase {
            cands: Cands::Shards { world: 4, k: 64 },
            params: SampleParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.9,
                seed: 1,
            },
            state: [0, 0],
            tokens_len: 1 << 16,
            seed: 2,
        };
        let bufs: Vec<_> = case
            .bufs()
            .iter()
            .map(|b| {
                let buf = gpu.alloc(b.len * b.dtype.size()).unwrap();
                gpu.write(&buf, 0, b.init.as_ref().unwrap()).unwrap();
                (buf, b.len, b.dtype)
            })
            .collect();
        let views: Vec<_> = bufs
            .iter()
            .map(|(b, n, d)| View::new(b, 0, *n, *d))
            .collect();
        let op = case.op(&views);
        gpu.run(&op).unwrap();
        let t = gpu
            .time(&mut || (0..200).try_for_each(|_| gpu.run(&op)))
            .unwrap()
            / 200;
        println!(
            "TIMING sample 4 x 64 pairs: {:.2} us",
            t.as_secs_f64() * 1e6
        );
    }
}
