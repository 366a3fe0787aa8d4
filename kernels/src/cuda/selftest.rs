//! `tprun selftest` for CUDA: every GPU op against its CPU twin on random inputs, outputs
//! poisoned first, reductions compared bit for bit; plus the single-process multi-rank harness
//! ([`LocalWorld`]) the tests and the timing helpers use.
//!
//! Owns: the harness and the comparisons. Must not: print (it returns results; the CLI
//! prints them).
//!
//! Several "ranks" in one process: each rank is a thread with its own [`CudaDevice`] (and
//! stream) on one ordinal. They share the device's primary context, so in `Fd` mode each rank
//! imports its peers' exports (exercising the VMM import path); in `Legacy` mode a process
//! cannot open its own IPC handles, so ranks use the peers' buffers directly, and the legacy
//! import is left to the cross-process tests.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use super::{CudaBuf, CudaDevice, Gpu, IpcMode};
use crate::comm::{AllreduceArgs, CommAlgo, CommLayout, CommSettings, SIGNAL_BYTES};
use crate::cpu::{CpuBuf, CpuDevice};
use crate::device::{Device, Op, View};
use crate::driver::Driver;
use crate::dtype::encode;
use crate::{DType, KernelError, Result};

/// One selftest check (a rank sends the failed ones to the coordinator, which prints them).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SelftestResult {
    /// "copy f32->f16", "reduce_sum 3 inputs", "allreduce oneshot world 4", ...
    pub op: String,
    pub dtype: DType,
    /// Elements.
    pub elems: usize,
    pub ok: bool,
    /// Empty when ok; else what differed first.
    pub detail: String,
}

/// xorshift64* (Marsaglia 2003; multiplier from Vigna, "An experimental exploration of
/// Marsaglia's xorshift generators"): small, seedable, good enough for test inputs.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// ±m·2^k with m uniform in [1, 2) and k uniform in `exps`; one value in 64 is ±0.
    pub(crate) fn value(&mut self, exps: std::ops::RangeInclusive<i32>) -> f32 {
        let r = self.next();
        let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
        if (r >> 1) & 63 == 0 {
            return sign * 0.0;
        }
        let span = (exps.end() - exps.start() + 1) as u64;
        let k = exps.start() + ((r >> 8) % span) as i32;
        let m = 1.0 + ((r >> 40) as f32) / (1u64 << 24) as f32;
        sign * m * 2f32.powi(k)
    }
    /// `n` random elements of `dtype` (already rounded to it), as bytes.
    pub(crate) fn bytes(
        &mut self,
        dtype: DType,
        n: usize,
        exps: std::ops::RangeInclusive<i32>,
    ) -> Vec<u8> {
        let v: Vec<f32> = (0..n).map(|_| self.value(exps.clone())).collect();
        encode(dtype, &v)
    }
}

/// Byte written around outputs and into data slots before a run: 0xff makes f32/f16/bf16
/// NaNs, so an unwritten element can never compare equal to a computed one.
const POISON: u8 = 0xff;
/// Guard bytes before and after each output, checked for stray writes.
const GUARD: usize = 64;

fn first_diff(got: &[u8], want: &[u8], esize: usize) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} bytes, expected {}", got.len(), want.len()));
    }
    got.chunks(esize)
        .zip(want.chunks(esize))
        .position(|(a, b)| a != b)
        .map(|i| {
            format!(
                "element {i}: got {:02x?}, expected {:02x?}",
                &got[i * esize..(i + 1) * esize],
                &want[i * esize..(i + 1) * esize]
            )
        })
}

/// The CPU twin of ReduceSum (rank-order f32 sum) on host copies of the inputs.
fn cpu_sum(dtype: DType, inputs: &[Vec<u8>]) -> Result<Vec<u8>> {
    let cpu = CpuDevice::new(0, 1, 0);
    let n = inputs[0].len() / dtype.size();
    let bufs = inputs
        .iter()
        .map(|b| {
            let c = cpu.alloc(b.len())?;
            cpu.write(&c, 0, b)?;
            Ok(c)
        })
        .collect::<Result<Vec<CpuBuf>>>()?;
    let out = cpu.alloc(n * dtype.size())?;
    let views: Vec<_> = bufs.iter().map(|b| View::new(b, 0, n, dtype)).collect();
    cpu.run(&Op::ReduceSum(crate::ops::ReduceSum {
        inputs: &views,
        out: View::new(&out, 0, n, dtype),
    }))?;
    let mut r = vec![0u8; n * dtype.size()];
    cpu.read(&out, 0, &mut r)?;
    Ok(r)
}

/// The CPU twin of Copy.
fn cpu_copy(src: DType, dst: DType, input: &[u8]) -> Result<Vec<u8>> {
    let cpu = CpuDevice::new(0, 1, 0);
    let n = input.len() / src.size();
    let s = cpu.alloc(input.len())?;
    cpu.write(&s, 0, input)?;
    let d = cpu.alloc(n * dst.size())?;
    cpu.run(&Op::Copy(crate::ops::Copy {
        src: View::new(&s, 0, n, src),
        dst: View::new(&d, 0, n, dst),
    }))?;
    let mut r = vec![0u8; n * dst.size()];
    cpu.read(&d, 0, &mut r)?;
    Ok(r)
}

/// A device buffer holding `GUARD` poison bytes, then room for `bytes` (poisoned), then
/// `GUARD` more; `off` shifts the payload by a few bytes to test unaligned views.
struct Guarded {
    buf: CudaBuf,
    start: usize,
    bytes: usize,
}

impl Guarded {
    fn new(dev: &CudaDevice, bytes: usize, off: usize) -> Result<Guarded> {
        let buf = dev.alloc(2 * GUARD + off + bytes)?;
        dev.write(&buf, 0, &vec![POISON; buf.len()])?;
        Ok(Guarded {
            buf,
            start: GUARD + off,
            bytes,
        })
    }
    fn view(&self, n: usize, dtype: DType) -> View<'_, CudaBuf> {
        View::new(&self.buf, self.start, n, dtype)
    }
    /// The payload, or an error naming the guard byte that changed.
    fn read(&self, dev: &CudaDevice) -> Result<std::result::Result<Vec<u8>, String>> {
        let mut all = vec![0u8; self.buf.len()];
        dev.read(&self.buf, 0, &mut all)?;
        let end = self.start + self.bytes;
        if let Some(i) = all[..self.start]
            .iter()
            .chain(&all[end..])
            .position(|&b| b != POISON)
        {
            return Ok(Err(format!("guard byte {i} overwritten")));
        }
        Ok(Ok(all[self.start..end].to_vec()))
    }
}

/// `world` ranks of one process on one device, each with its own [`CudaDevice`] and comm
/// buffer, the peers' buffers mapped as the mode allows (module docs).
pub struct LocalWorld {
    pub devs: Vec<CudaDevice>,
    own: Vec<CudaBuf>,
    /// imported[r][q]: rank q's buffer imported by rank r (Fd mode, q != r).
    imported: Vec<Vec<Option<CudaBuf>>>,
    pub layout: CommLayout,
    /// The next call's epoch (the same on every rank).
    epoch: u32,
}

impl LocalWorld {
    /// `world` ranks on device `ordinal` of `driver`'s runtime ([`super::Gpu::driver`]).
    pub fn new(
        driver: &Arc<dyn Driver>,
        ordinal: usize,
        mode: IpcMode,
        world: usize,
        max_bytes: usize,
    ) -> Result<LocalWorld> {
        let devs = (0..world)
            .map(|_| CudaDevice::open_with(driver.clone(), ordinal, mode, &CommSettings::default()))
            .collect::<Result<Vec<_>>>()?;
        let layout = CommLayout::new(max_bytes, world);
        let mut own = Vec::new();
        let mut exports = Vec::new();
        for d in &devs {
            let (b, e) = d.alloc_shared(layout.total_bytes())?;
            own.push(b);
            exports.push(e);
        }
        let mut imported: Vec<Vec<Option<CudaBuf>>> = (0..world)
            .map(|_| (0..world).map(|_| None).collect())
            .collect();
        if devs[0].ipc_mode() == IpcMode::Fd {
            for (r, d) in devs.iter().enumerate() {
                for (q, e) in exports.iter().enumerate().filter(|&(q, _)| q != r) {
                    let fd =
                        e.fd.as_ref()
                            .map(|f| f.try_clone())
                            .transpose()
                            .map_err(|e| KernelError::os("dup of an export fd", e))?;
                    imported[r][q] = Some(d.import(crate::device::Export {
                        meta: e.meta.clone(),
                        fd,
                    })?);
                }
            }
        }
        Ok(LocalWorld {
            devs,
            own,
            imported,
            layout,
            epoch: 1,
        })
    }

    pub fn world(&self) -> usize {
        self.devs.len()
    }

    /// Every rank's comm buffer as rank `r` sees it.
    fn comm_of(&self, r: usize) -> Vec<&CudaBuf> {
        (0..self.world())
            .map(|q| self.imported[r][q].as_ref().unwrap_or(&self.own[q]))
            .collect()
    }

    /// Fills every rank's data slots with poison (between calls, when no kernel runs).
    fn poison_slots(&self) -> Result<()> {
        let slots = vec![POISON; 2 * self.layout.data_bytes];
        for (d, b) in self.devs.iter().zip(&self.own) {
            d.write(b, SIGNAL_BYTES, &slots)?;
            d.sync()?;
        }
        Ok(())
    }

    /// One allreduce of `inputs[r]` on every rank (each payload shifted by `off` bytes in its
    /// buffer); returns every rank's result, or the first error. For `HostReduce` each rank
    /// first copies its input into its slot and synchronises, as the `host` algorithm does.
    pub fn allreduce(
        &mut self,
        algo: CommAlgo,
        dtype: DType,
        inputs: &[Vec<u8>],
        off: usize,
        timeout: Duration,
    ) -> Result<Vec<std::result::Result<Vec<u8>, String>>> {
        self.poison_slots()?;
        let epoch = self.epoch;
        self.epoch = self.epoch.wrapping_add(1);
        let world = self.world();
        let n = inputs[0].len() / dtype.size();
        let this = &*self;
        // Ranks meet before launching and before freeing: cuMemFree waits for the whole
        // device, so a rank freeing while a peer has not launched yet would stall the ranks
        // already waiting for that peer until their timeout.
        let barrier = Barrier::new(world);
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let barrier = &barrier;
                    s.spawn(move || -> Result<_> {
                        let dev = &this.devs[r];
                        let g = Guarded::new(dev, inputs[r].len(), off);
                        let g = g.and_then(|g| {
                            dev.write(&g.buf, g.start, &inputs[r])?;
                            if algo == CommAlgo::HostReduce {
                                let slot = this.layout.slot_offset(epoch);
                                dev.run(&Op::Copy(crate::ops::Copy {
                                    src: g.view(n, dtype),
                                    dst: View::new(&this.own[r], slot, n, dtype),
                                }))?;
                            }
                            dev.sync()?;
                            Ok(g)
                        });
                        barrier.wait();
                        let g = g?;
                        let comm = this.comm_of(r);
                        let ran = dev.run(&Op::Allreduce(AllreduceArgs {
                            algo,
                            rank: r,
                            world,
                            epoch,
                            data: g.view(n, dtype),
                            comm: &comm,
                            layout: this.layout,
                            timeout,
                            abort: None,
                            add_norm: None,
                        }));
                        let got = ran.and_then(|()| dev.sync()).and_then(|()| g.read(dev));
                        barrier.wait();
                        got
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("rank thread panicked"))
                .collect()
        })
    }

    /// One oneshot allreduce of f32 `inputs[r]` with the add + norm epilogue (`x0` the
    /// residual, `w` the norm weight, both the same on every rank): every rank's (x, out).
    pub fn allreduce_add_norm(
        &mut self,
        inputs: &[Vec<f32>],
        x0: &[f32],
        w: &[f32],
        eps: f32,
        timeout: Duration,
    ) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        self.poison_slots()?;
        let epoch = self.epoch;
        self.epoch = self.epoch.wrapping_add(1);
        let world = self.world();
        let n = x0.len();
        let this = &*self;
        let barrier = Barrier::new(world);
        let f32s = |v: &[f32]| encode(DType::F32, v);
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let barrier = &barrier;
                    s.spawn(move || -> Result<(Vec<f32>, Vec<f32>)> {
                        let dev = &this.devs[r];
                        let bufs = (|| -> Result<_> {
                            let (d, x, wb, o) = (
                                dev.alloc(n * 4)?,
                                dev.alloc(n * 4)?,
                                dev.alloc(n * 4)?,
                                dev.alloc(n * 4)?,
                            );
                            dev.write(&d, 0, &f32s(&inputs[r]))?;
                            dev.write(&x, 0, &f32s(x0))?;
                            dev.write(&wb, 0, &f32s(w))?;
                            dev.write(&o, 0, &vec![POISON; n * 4])?;
                            dev.sync()?;
                            Ok((d, x, wb, o))
                        })();
                        barrier.wait();
                        let (d, x, wb, o) = bufs?;
                        let comm = this.comm_of(r);
                        let v = |b| View::new(b, 0, n, DType::F32);
                        let ran = dev.run(&Op::Allreduce(AllreduceArgs {
                            algo: CommAlgo::Oneshot,
                            rank: r,
                            world,
                            epoch,
                            data: v(&d),
                            comm: &comm,
                            layout: this.layout,
                            timeout,
                            abort: None,
                            add_norm: Some(crate::comm::AddNorm {
                                x: v(&x),
                                w: v(&wb),
                                out: v(&o),
                                rows: 1,
                                dim: n,
                                eps,
                            }),
                        }));
                        let got = ran.and_then(|()| dev.sync()).and_then(|()| {
                            let mut a = vec![0u8; n * 4];
                            let mut b = vec![0u8; n * 4];
                            dev.read(&x, 0, &mut a)?;
                            dev.read(&o, 0, &mut b)?;
                            Ok((
                                crate::dtype::decode(DType::F32, &a),
                                crate::dtype::decode(DType::F32, &b),
                            ))
                        });
                        barrier.wait();
                        got
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("rank thread panicked"))
                .collect()
        })
    }

    /// Mean time of one allreduce of `n` elements over `iters` back-to-back calls (after
    /// `warmup` calls), each rank timing its own stream with events; the slowest rank's.
    pub fn time_allreduce(
        &mut self,
        algo: CommAlgo,
        dtype: DType,
        n: usize,
        warmup: u32,
        iters: u32,
    ) -> Result<Duration> {
        let world = self.world();
        let first = self.epoch;
        self.epoch = self.epoch.wrapping_add(warmup + iters);
        let this = &*self;
        let barrier = Barrier::new(world);
        let timeout = Duration::from_secs(10);
        let times = std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let barrier = &barrier;
                    s.spawn(move || -> Result<Duration> {
                        let dev = &this.devs[r];
                        let data = dev.alloc(n * dtype.size())?;
                        let mut rng = Rng::new(r as u64 + 1);
                        dev.write(&data, 0, &rng.bytes(dtype, n, -4..=4))?;
                        let comm = this.comm_of(r);
                        let mut epoch = first;
                        let mut call = |dev: &CudaDevice| {
                            let e = epoch;
                            epoch = epoch.wrapping_add(1);
                            dev.run(&Op::Allreduce(AllreduceArgs {
                                algo,
                                rank: r,
                                world,
                                epoch: e,
                                data: View::new(&data, 0, n, dtype),
                                comm: &comm,
                                layout: this.layout,
                                timeout,
                                abort: None,
                                add_norm: None,
                            }))
                        };
                        let warm = (0..warmup)
                            .try_for_each(|_| call(dev))
                            .and_then(|()| dev.sync());
                        // Every rank reaches every barrier, errors or not, so no rank is left
                        // waiting for one that gave up.
                        barrier.wait();
                        warm?;
                        let t = dev.time(&mut || {
                            for _ in 0..iters {
                                call(dev)?;
                            }
                            Ok(())
                        });
                        barrier.wait();
                        Ok(t? / iters.max(1))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("rank thread panicked"))
                .collect::<Result<Vec<_>>>()
        })?;
        Ok(times.into_iter().max().unwrap_or_default())
    }
}

/// Element counts the allreduce checks use: 1 element to a few MiB, odd counts, counts just
/// around pack (16-byte), block (512 packs) and shard boundaries.
pub fn allreduce_sizes() -> Vec<usize> {
    vec![
        1,
        2,
        3,
        5,
        7,
        8,
        9,
        17,
        31,
        33,
        255,
        1000,
        4095,
        4096,
        4097,
        12_289,
        65_539,
        (1 << 20) + 7,
    ]
}

/// Runs every GPU op on device `ordinal` of runtime `gpu` against its CPU twin: copies
/// between all dtypes, reduce_sum of 1..=5 inputs, and allreduce (oneshot with and without the
/// low-latency kernel, where the runtime has it; twoshot, the host algorithm's reduce) for
/// 1..=4 ranks of this process (see the module docs), f32/f16/bf16, many sizes.
/// `Unavailable` when there is no GPU.
pub fn selftest(gpu: Gpu, ordinal: usize, mode: IpcMode, seed: u64) -> Result<Vec<SelftestResult>> {
    let mut out = Vec::new();
    let mut rng = Rng::new(seed);
    let driver = gpu.driver()?;
    let dev = CudaDevice::open_with(driver.clone(), ordinal, mode, &CommSettings::default())?;

    // Copy: every dtype pair, a wide exponent range (f16 subnormals, overflow to inf).
    for src in DType::ALL {
        for dst in DType::ALL {
            // (elements, shift in elements off 16-byte alignment)
            for &(n, k) in &[(1usize, 0usize), (7, 1), (1000, 0), (65_537, 3)] {
                let input = rng.bytes(src, n, -30..=20);
                let want = cpu_copy(src, dst, &input)?;
                let s = Guarded::new(&dev, input.len(), k * src.size())?;
                dev.write(&s.buf, s.start, &input)?;
                let d = Guarded::new(&dev, want.len(), k * dst.size())?;
                dev.run(&Op::Copy(crate::ops::Copy {
                    src: s.view(n, src),
                    dst: d.view(n, dst),
                }))?;
                let detail = match d.read(&dev)? {
                    Ok(got) => first_diff(&got, &want, dst.size()).unwrap_or_default(),
                    Err(e) => e,
                };
                out.push(SelftestResult {
                    op: format!("copy {src}->{dst}"),
                    dtype: dst,
                    elems: n,
                    ok: detail.is_empty(),
                    detail,
                });
            }
        }
    }

    // ReduceSum: 1..=5 inputs, in place into input 0 for one case.
    for dtype in DType::ALL {
        for nin in 1..=5usize {
            for &(n, k) in &[(1usize, 0usize), (9, 1), (4097, 0), (300_001, 0)] {
                let off = k * dtype.size();
                let inputs: Vec<Vec<u8>> = (0..nin).map(|_| rng.bytes(dtype, n, -12..=6)).collect();
                let want = cpu_sum(dtype, &inputs)?;
                let gs = inputs
                    .iter()
                    .map(|b| {
                        let g = Guarded::new(&dev, b.len(), off)?;
                        dev.write(&g.buf, g.start, b)?;
                        Ok(g)
                    })
                    .collect::<Result<Vec<_>>>()?;
                let in_place = nin == 3;
                let o = Guarded::new(&dev, want.len(), off)?;
                let views: Vec<_> = gs.iter().map(|g| g.view(n, dtype)).collect();
                let out_view = if in_place { views[0] } else { o.view(n, dtype) };
                dev.run(&Op::ReduceSum(crate::ops::ReduceSum {
                    inputs: &views,
                    out: out_view,
                }))?;
                let got = if in_place {
                    gs[0].read(&dev)?
                } else {
                    o.read(&dev)?
                };
                let detail = match got {
                    Ok(got) => first_diff(&got, &want, dtype.size()).unwrap_or_default(),
                    Err(e) => e,
                };
                out.push(SelftestResult {
                    op: format!(
                        "reduce_sum {nin} inputs{}",
                        if in_place { " in place" } else { "" }
                    ),
                    dtype,
                    elems: n,
                    ok: detail.is_empty(),
                    detail,
                });
            }
        }
    }

    // The fused allreduce + add + norm (the decode seam): every rank bitwise the same, and
    // within 1e-5 of the CPU twin (rank-order sum, add, rms_norm; the norm's sum of squares
    // runs in another order).
    for world in 1..=4usize {
        for n in [1usize, 7, 1000, 4096, 8192] {
            let mut w = LocalWorld::new(&driver, ordinal, mode, world, n * 4)?;
            let vals = |rng: &mut Rng, k: usize| -> Vec<f32> {
                (0..k).map(|_| rng.value(-6..=1)).collect()
            };
            let inputs: Vec<Vec<f32>> = (0..world).map(|_| vals(&mut rng, n)).collect();
            let (x0, wt) = (vals(&mut rng, n), vals(&mut rng, n));
            let got = w.allreduce_add_norm(&inputs, &x0, &wt, 1e-5, Duration::from_secs(5));
            let cpu = CpuDevice::new(0, 1, 0);
            let up = |v: &[f32]| -> Result<CpuBuf> {
                let b = cpu.alloc(v.len() * 4)?;
                cpu.write(&b, 0, &encode(DType::F32, v))?;
                Ok(b)
            };
            let bytes: Vec<Vec<u8>> = inputs.iter().map(|v| encode(DType::F32, v)).collect();
            let sum = up(&crate::dtype::decode(
                DType::F32,
                &cpu_sum(DType::F32, &bytes)?,
            ))?;
            let (cx, cw, co) = (up(&x0)?, up(&wt)?, cpu.alloc(n * 4)?);
            let v = |b| View::new(b, 0, n, DType::F32);
            cpu.run(&Op::AddRmsNorm(crate::ops::AddRmsNorm {
                x: v(&cx),
                delta: v(&sum),
                w: v(&cw),
                out: v(&co),
                rows: 1,
                dim: n,
                eps: 1e-5,
            }))?;
            let read = |b: &CpuBuf| -> Result<Vec<f32>> {
                let mut o = vec![0u8; n * 4];
                cpu.read(b, 0, &mut o)?;
                Ok(crate::dtype::decode(DType::F32, &o))
            };
            let (wx, wo) = (read(&cx)?, read(&co)?);
            let close = |a: &[f32], b: &[f32]| {
                a.iter().zip(b).position(|(p, q)| {
                    let ok = (p - q).abs() <= 1e-5 * (1.0 + q.abs());
                    !ok
                })
            };
            let detail = match got {
                Err(e) => e.to_string(),
                Ok(ranks) => {
                    if ranks.iter().any(|r| r != &ranks[0]) {
                        "ranks differ".to_string()
                    } else if let Some(i) = close(&ranks[0].0, &wx) {
                        format!("x element {i}: got {}, expected {}", ranks[0].0[i], wx[i])
                    } else if let Some(i) = close(&ranks[0].1, &wo) {
                        format!("out element {i}: got {}, expected {}", ranks[0].1[i], wo[i])
                    } else {
                        String::new()
                    }
                }
            };
            out.push(SelftestResult {
                op: format!("allreduce+add+rms_norm world {world}"),
                dtype: DType::F32,
                elems: n,
                ok: detail.is_empty(),
                detail,
            });
        }
    }

    // Decode ops: every kernel against its CPU twin (cuda/twin.rs).
    let cpu = CpuDevice::new(0, 2, 0);
    out.extend(super::twin::cases(&dev, &cpu, rng.next())?);
    drop(dev);

    // Allreduce: every rank must equal the CPU rank-order sum, bit for bit.
    let sizes = allreduce_sizes();
    let max_bytes = sizes.iter().max().unwrap() * 4;
    for world in 1..=4usize {
        let mut w = LocalWorld::new(&driver, ordinal, mode, world, max_bytes)?;
        // A broken protocol fails every call after waiting out the timeout: give up on this
        // world after a few failures rather than spend minutes proving it.
        let mut failed = 0;
        let algos = [
            (CommAlgo::Oneshot, true, "oneshot"),
            (CommAlgo::Oneshot, false, "oneshot (flags)"),
            (CommAlgo::Twoshot, false, "twoshot"),
            (CommAlgo::HostReduce, false, "host"),
        ];
        for (algo, ll, name) in algos {
            // Where the runtime cannot run the low-latency kernel (Caps), its rows would
            // repeat the flags rows: left out.
            if ll && !w.devs[0].low_latency_supported() {
                continue;
            }
            for d in &w.devs {
                d.set_low_latency(ll);
            }
            for dtype in DType::ALL {
                for (i, &n) in sizes.iter().enumerate() {
                    if failed >= 3 {
                        break;
                    }
                    // Every third size with a payload shifted off 16-byte alignment.
                    let off = if i % 3 == 2 { dtype.size() } else { 0 };
                    let inputs: Vec<Vec<u8>> =
                        (0..world).map(|_| rng.bytes(dtype, n, -12..=6)).collect();
                    let want = cpu_sum(dtype, &inputs)?;
                    let got = match w.allreduce(algo, dtype, &inputs, off, Duration::from_secs(5)) {
                        Ok(got) => got,
                        // A device error (timeout) fails this check; the kernels still ran to
                        // the end on every rank, so the epochs stay in step for the next one.
                        Err(e) => vec![Err(e.to_string())],
                    };
                    let detail = got
                        .iter()
                        .enumerate()
                        .find_map(|(r, g)| {
                            let d = match g {
                                Ok(g) => first_diff(g, &want, dtype.size()),
                                Err(e) => Some(e.clone()),
                            };
                            d.map(|d| format!("rank {r}: {d}"))
                        })
                        .unwrap_or_default();
                    failed += usize::from(!detail.is_empty());
                    out.push(SelftestResult {
                        op: format!("allreduce {name} world {world}"),
                        dtype,
                        elems: n,
                        ok: detail.is_empty(),
                        detail,
                    });
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The CUDA driver table (only called after gpu_or_skip found a GPU).
    fn cuda() -> Arc<dyn Driver> {
        Gpu::Cuda.driver().expect("a CUDA driver")
    }

    /// None when the test should be skipped (no GPU), after saying so; panics instead when
    /// TPRUN_REQUIRE_GPU=1.
    pub(crate) fn gpu_or_skip() -> Option<()> {
        if crate::cuda::device_count() > 0 && crate::cuda::nvrtc_present() {
            return Some(());
        }
        if std::env::var("TPRUN_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("TPRUN_REQUIRE_GPU=1 but no usable CUDA GPU (driver + NVRTC)");
        }
        println!("skipped: no GPU");
        None
    }

    #[test]
    fn rng_values_cover_signs_zeros_and_range() {
        let mut r = Rng::new(7);
        let v: Vec<f32> = (0..10_000).map(|_| r.value(-3..=3)).collect();
        assert!(v.contains(&0.0));
        assert!(v.iter().any(|x| *x < 0.0) && v.iter().any(|x| *x > 0.0));
        assert!(v.iter().all(|x| x.abs() < 16.0));
    }

    #[test]
    fn new_device_is_unavailable_without_a_gpu() {
        if crate::cuda::device_count() > 0 {
            return;
        }
        match CudaDevice::new(0, IpcMode::Auto) {
            Err(KernelError::Unavailable { .. }) => {}
            Err(e) => panic!("expected Unavailable, got {e}"),
            Ok(_) => panic!("a device without a GPU"),
        }
    }

    /// Every op against its CPU twin (the whole selftest), in Fd and Auto modes.
    #[test]
    fn gpu_ops_match_cpu_twins() {
        if gpu_or_skip().is_none() {
            return;
        }
        let res = selftest(Gpu::Cuda, 0, IpcMode::Fd, 0x0074_7072_756e).unwrap();
        let bad: Vec<_> = res.iter().filter(|r| !r.ok).collect();
        println!("selftest: {} checks, {} failed", res.len(), bad.len());
        for b in &bad {
            println!("FAIL {} {} n={}: {}", b.op, b.dtype, b.elems, b.detail);
        }
        assert!(bad.is_empty());
    }

    /// Legacy mode in one process: allocation, export and ops (ranks share buffers directly;
    /// opening legacy handles needs another process, see tests/cuda_ipc.rs).
    #[test]
    fn legacy_mode_allreduce_in_process() {
        if gpu_or_skip().is_none() {
            return;
        }
        let mut w = LocalWorld::new(&cuda(), 0, IpcMode::Legacy, 3, 1 << 16).unwrap();
        let mut rng = Rng::new(3);
        for algo in [CommAlgo::Oneshot, CommAlgo::Twoshot] {
            for n in [1usize, 77, 4099] {
                let inputs: Vec<_> = (0..3).map(|_| rng.bytes(DType::BF16, n, -8..=4)).collect();
                let want = cpu_sum(DType::BF16, &inputs).unwrap();
                for g in w
                    .allreduce(algo, DType::BF16, &inputs, 0, Duration::from_secs(10))
                    .unwrap()
                {
                    assert_eq!(g.unwrap(), want);
                }
            }
        }
    }

    /// The epoch counter lives on the device; a host epoch that skips is reported.
    #[test]
    fn a_wrong_host_epoch_is_reported() {
        if gpu_or_skip().is_none() {
            return;
        }
        let w = LocalWorld::new(&cuda(), 0, IpcMode::Auto, 1, 4096).unwrap();
        let dev = &w.devs[0];
        let data = dev.alloc(64).unwrap();
        let comm = w.comm_of(0);
        let args = |epoch| {
            Op::Allreduce(AllreduceArgs {
                algo: CommAlgo::Oneshot,
                rank: 0,
                world: 1,
                epoch,
                data: View::new(&data, 0, 16, DType::F32),
                comm: &comm,
                layout: w.layout,
                timeout: Duration::from_secs(1),
                abort: None,
                add_norm: None,
            })
        };
        dev.run(&args(1)).unwrap();
        dev.sync().unwrap();
        dev.run(&args(5)).unwrap();
        match dev.sync() {
            Err(KernelError::Invalid(m)) => assert!(m.contains("epoch 5"), "{m}"),
            other => panic!("expected an epoch error, got {other:?}"),
        }
    }

    /// A peer that never comes: the device wait gives up after the timeout and names it.
    #[test]
    fn a_missing_peer_times_out_on_the_device() {
        if gpu_or_skip().is_none() {
            return;
        }
        let w = LocalWorld::new(&cuda(), 0, IpcMode::Auto, 2, 4096).unwrap();
        let dev = &w.devs[0];
        let data = dev.alloc(64).unwrap();
        let comm = w.comm_of(0);
        let t0 = std::time::Instant::now();
        dev.run(&Op::Allreduce(AllreduceArgs {
            algo: CommAlgo::Oneshot,
            rank: 0,
            world: 2,
            epoch: 1,
            data: View::new(&data, 0, 16, DType::F32),
            comm: &comm,
            layout: w.layout,
            timeout: Duration::from_millis(200),
            abort: None,
            add_norm: None,
        }))
        .unwrap();
        match dev.sync() {
            Err(KernelError::Timeout { peers, .. }) => assert_eq!(peers, vec![1]),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    /// A VMM export imported in the exporting process maps the same memory at a second
    /// address (what LocalWorld relies on in Fd mode).
    #[test]
    fn vmm_fd_import_in_process_sees_the_same_memory() {
        if gpu_or_skip().is_none() {
            return;
        }
        let dev = CudaDevice::new(0, IpcMode::Fd).unwrap();
        let (a, export) = dev.alloc_shared(100_000).unwrap();
        assert!(export.meta.bytes() >= 100_000);
        let b = dev.import(export).unwrap();
        assert_ne!(a.device_ptr(), b.device_ptr());
        let pattern: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + 3) as u8).collect();
        dev.write(&a, 0, &pattern).unwrap();
        let mut back = vec![0u8; pattern.len()];
        dev.read(&b, 0, &mut back).unwrap();
        assert_eq!(back, pattern);
    }

    /// A captured allreduce replays with a fresh epoch each time: the epoch comes from the
    /// device counter, which each replay advances (and an eager call afterwards must then use
    /// the epoch after the replays).
    #[test]
    fn captured_allreduce_replays_with_fresh_epochs() {
        if gpu_or_skip().is_none() {
            return;
        }
        let world = 2;
        let n = 3001;
        let dtype = DType::F32;
        let w = LocalWorld::new(&cuda(), 0, IpcMode::Auto, world, n * 4).unwrap();
        let replays = 3u32;
        let mut rng = Rng::new(11);
        let inputs: Vec<Vec<Vec<u8>>> = (0..=replays)
            .map(|_| (0..world).map(|_| rng.bytes(dtype, n, -8..=4)).collect())
            .collect();
        let wants: Vec<Vec<u8>> = inputs.iter().map(|i| cpu_sum(dtype, i).unwrap()).collect();
        let barrier = Barrier::new(world);
        std::thread::scope(|s| {
            for r in 0..world {
                let (w, inputs, wants, barrier) = (&w, &inputs, &wants, &barrier);
                s.spawn(move || {
                    let dev = &w.devs[r];
                    let data = dev.alloc(n * 4).unwrap();
                    let comm = w.comm_of(r);
                    let op = |epoch| {
                        Op::Allreduce(AllreduceArgs {
                            algo: CommAlgo::Oneshot,
                            rank: r,
                            world,
                            epoch,
                            data: View::new(&data, 0, n, dtype),
                            comm: &comm,
                            layout: w.layout,
                            timeout: Duration::from_secs(5),
                            abort: None,
                            add_norm: None,
                        })
                    };
                    let (st, drv) = dev.raw_stream();
                    // SAFETY: our live stream; relaxed mode because peer threads make
                    // unrelated driver calls meanwhile.
                    unsafe { drv.begin_capture(st) }.unwrap();
                    // The epoch given here is frozen into the graph and must be ignored.
                    dev.run(&op(1)).unwrap();
                    // SAFETY: capture begun above on this stream.
                    let graph = unsafe { drv.end_capture(st) }.unwrap();
                    // SAFETY: a complete graph of one kernel node.
                    let exec = unsafe { drv.graph_instantiate(graph) }.unwrap();
                    for input in inputs.iter().take(replays as usize) {
                        dev.write(&data, 0, &input[r]).unwrap();
                        // SAFETY: instantiated above; its buffers are alive until the sync.
                        unsafe { drv.graph_launch(exec, st) }.unwrap();
                        dev.sync().unwrap();
                        barrier.wait();
                    }
                    let mut got = vec![0u8; n * 4];
                    dev.read(&data, 0, &mut got).unwrap();
                    assert!(
                        got == wants[replays as usize - 1],
                        "rank {r}: last replay wrong"
                    );
                    // Eager call after three replays: the device counter is at 3.
                    dev.write(&data, 0, &inputs[replays as usize][r]).unwrap();
                    dev.run(&op(replays + 1)).unwrap();
                    dev.read(&data, 0, &mut got).unwrap();
                    assert!(got == wants[replays as usize], "rank {r}: eager call wrong");
                    barrier.wait();
                    // SAFETY: no launch of them is pending (synced above); destroyed once.
                    unsafe {
                        drv.graph_exec_destroy(exec).unwrap();
                        drv.graph_destroy(graph).unwrap();
                    }
                });
            }
        });
    }

    /// Timings for the report (run with --ignored on a GPU machine): per-call time of oneshot
    /// at 16 KiB and bandwidth at 64 MiB, ranks as threads on one GPU.
    #[test]
    #[ignore]
    fn allreduce_timings() {
        if gpu_or_skip().is_none() {
            return;
        }
        // Device copy ceiling: a 1 GiB device-to-device copy, bytes read + written.
        let dev = CudaDevice::new(0, IpcMode::Auto).unwrap();
        let n = 1usize << 28;
        let a = dev.alloc(n * 4).unwrap();
        let b = dev.alloc(n * 4).unwrap();
        let copy = |dev: &CudaDevice| {
            dev.run(&Op::Copy(crate::ops::Copy {
                src: View::new(&a, 0, n, DType::F32),
                dst: View::new(&b, 0, n, DType::F32),
            }))
        };
        copy(&dev).unwrap();
        let t = dev
            .time(&mut || {
                for _ in 0..10 {
                    copy(&dev)?;
                }
                Ok(())
            })
            .unwrap()
            / 10;
        println!(
            "TIMING device copy 1 GiB: {:.1} us, {:.2} TB/s (read + write)",
            t.as_secs_f64() * 1e6,
            2.0 * (n * 4) as f64 / t.as_secs_f64() / 1e12
        );
        for (name, n) in dev.allreduce_occupancy().unwrap() {
            println!("TIMING occupancy {name}: {n} blocks/SM");
        }
        println!(
            "TIMING comm blocks {} of capacity {}",
            dev.comm_blocks(),
            dev.comm_block_capacity().unwrap()
        );
        drop((a, b, dev));
        // (world, grid cap): the default cap, plus one rank alone with the whole GPU.
        // TPRUN_TIMING_QUICK=1 keeps the cases a short lease has time for.
        let quick = std::env::var("TPRUN_TIMING_QUICK").as_deref() == Ok("1");
        let cases: &[(usize, Option<u32>)] = if quick {
            &[(1, Some(128)), (4, None)]
        } else {
            &[(1, None), (1, Some(128)), (2, None), (4, None)]
        };
        for &(world, cap) in cases {
            let mut w = LocalWorld::new(&cuda(), 0, IpcMode::Auto, world, 64 << 20).unwrap();
            if let Some(c) = cap {
                w.devs.iter().for_each(|d| d.set_comm_blocks(c));
            }
            let blocks = w.devs[0].comm_blocks();
            for (algo, name) in [
                (CommAlgo::Oneshot, "oneshot"),
                (CommAlgo::Twoshot, "twoshot"),
            ] {
                for (bytes, dtype) in [
                    (16usize << 10, DType::BF16),
                    (16 << 10, DType::F32),
                    (64 << 20, DType::BF16),
                ] {
                    let n = bytes / dtype.size();
                    let iters = if bytes > 1 << 20 { 20 } else { 2000 };
                    let t = w.time_allreduce(algo, dtype, n, 10, iters).unwrap();
                    let s = t.as_secs_f64();
                    let algbw = bytes as f64 / s / 1e9;
                    let busbw = algbw * 2.0 * (world as f64 - 1.0) / world as f64;
                    // Device-memory bytes all ranks move per call (they share one GPU here):
                    // oneshot, per rank: copy-in read + write S, read world * S, write S
                    // (low-latency kernel, up to ll_bytes: read S twice, write S, and per
                    // peer 2S stored, 2S polled, 2S cleared);
                    // twoshot, per rank: copy-in 2S, reduce S + 2S/world, gather
                    // 2S (world - 1)/world.
                    let (wf, sz) = (world as f64, bytes as f64);
                    let moved = match algo {
                        CommAlgo::Oneshot
                            if w.devs[0].low_latency() && bytes <= w.layout.ll_bytes =>
                        {
                            wf * (3.0 + 6.0 * (wf - 1.0)) * sz
                        }
                        CommAlgo::Oneshot => wf * (3.0 + wf) * sz,
                        CommAlgo::Twoshot => {
                            wf * (3.0 * sz + 2.0 * sz / wf + 2.0 * sz * (wf - 1.0) / wf)
                        }
                        CommAlgo::HostReduce => unreachable!("not timed here"),
                    };
                    println!(
                        "TIMING {name} world {world} blocks {blocks} {dtype} {bytes} B: {:.2} us/call, algbw {algbw:.1} GB/s, busbw {busbw:.1} GB/s, device memory {:.2} TB/s",
                        s * 1e6,
                        moved / s / 1e12
                    );
                }
            }
        }
    }
}
