//! `Matmul`: `y = x · wᵀ (+ bias)` with `w` in a Linear's [out, in] layout, the one product
//! every projection and the LM head use (matrix–vector when m = 1, matrix–matrix in prefill).
//!
//! Threads split the output features (rows of `w`), so each thread streams its own slice of
//! the weight once and every weight byte is read once per call; a bf16/f16 row is widened into
//! an f32 scratch row and reused for all m tokens, four tokens per pass over the row. On
//! x86-64 CPUs with AVX2 the same code is compiled a second time for AVX2 and picked at run
//! time; both give bitwise the same results.

use super::super::reduce::SendPtr;
use super::super::{par_ranges, CpuBuf, CpuDevice};
use super::{dot, f32_ptr, fold_lanes, typed_ptr, widen, DOT_LANES, MIN_WORK_PER_THREAD};
use crate::dtype::Elem;
use crate::{with_dtype, DType, KernelError, Result, View};

#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    dev: &CpuDevice,
    x: &View<'_, CpuBuf>,
    w: &View<'_, CpuBuf>,
    bias: Option<&View<'_, CpuBuf>>,
    y: &View<'_, CpuBuf>,
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    if w.len < n * k {
        return Err(KernelError::Invalid(format!(
            "matmul: weight of {} elements, need [{n}, {k}]",
            w.len
        )));
    }
    let px = f32_ptr(x, m * k, "matmul x")?;
    let py = f32_ptr(y, m * n, "matmul y")?;
    let pb = bias.map(|b| f32_ptr(b, n, "matmul bias")).transpose()?;
    let min_rows = MIN_WORK_PER_THREAD / (m * k).max(1) + 1;
    let avx2 = has_avx2();
    with_dtype!(w.dtype, T => {
        let pw = typed_ptr::<T>(w, n * k, "matmul w")?;
        par_ranges(dev.threads(), n, min_rows, |r| {
            let a = Rows { x: px, w: pw, bias: pb, y: py, m, k, n, rows: r };
            if avx2 {
                // SAFETY: the CPU has AVX2 (checked at run time just above).
                unsafe { rows_avx2(&a) }
            } else {
                // SAFETY: `Rows` holds pointers checked for these shapes (see `rows`).
                unsafe { rows(&a) }
            }
        });
    });
    Ok(())
}

/// One thread's share of a matmul: output features `rows`.
struct Rows<T> {
    x: SendPtr<f32>,
    w: SendPtr<T>,
    bias: Option<SendPtr<f32>>,
    y: SendPtr<f32>,
    m: usize,
    k: usize,
    n: usize,
    rows: std::ops::Range<usize>,
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}
#[cfg(not(target_arch = "x86_64"))]
fn has_avx2() -> bool {
    false
}

/// [`rows`] compiled for AVX2: the same operations in the same order (so bitwise the same
/// results), eight lanes at a time instead of four.
///
/// # Safety
/// As [`rows`], and the CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rows_avx2<T: Elem>(a: &Rows<T>) {
    // SAFETY: forwarded contract.
    unsafe { rows(a) }
}
#[cfg(not(target_arch = "x86_64"))]
unsafe fn rows_avx2<T: Elem>(a: &Rows<T>) {
    // SAFETY: forwarded contract.
    unsafe { rows(a) }
}

/// `y[i, o] = x[i] · w[o] (+ bias[o])` for `o` in `a.rows`, all `i < m`.
///
/// # Safety
/// `x` holds m·k f32, `w` n·k elements, `bias` n f32, `y` m·n f32; `y` overlaps neither `x`
/// nor `w`, and no other thread writes columns `a.rows` of `y` or anything `x`/`w` hold.
#[inline(always)]
unsafe fn rows<T: Elem>(a: &Rows<T>) {
    let (m, k, n) = (a.m, a.k, a.n);
    let mut scratch = vec![0f32; if T::DTYPE == DType::F32 { 0 } else { k }];
    // SAFETY: per the contract, x holds m·k elements and is only read.
    let xs = unsafe { std::slice::from_raw_parts(a.x.get(), m * k) };
    for o in a.rows.clone() {
        // SAFETY: row o < n lies inside the n·k weight elements.
        let wr = unsafe { std::slice::from_raw_parts(a.w.get().add(o * k), k) };
        let wf: &[f32] = if T::DTYPE == DType::F32 {
            // SAFETY: T is f32 when its DTYPE is F32 (the only such Elem).
            unsafe { std::slice::from_raw_parts(wr.as_ptr().cast::<f32>(), k) }
        } else {
            widen(wr, &mut scratch);
            &scratch
        };
        // SAFETY: o < n, the bias holds n elements.
        let b = a.bias.map_or(0.0, |b| unsafe { *b.get().add(o) });
        let mut i = 0;
        // Four tokens share each load of the weight row (prefill).
        while i + 4 <= m {
            let xr = |t: usize| &xs[(i + t) * k..(i + t + 1) * k];
            let d = dot4([xr(0), xr(1), xr(2), xr(3)], wf);
            for (t, v) in d.into_iter().enumerate() {
                // SAFETY: (i+t)·n + o < m·n; column o is this thread's.
                unsafe { *a.y.get().add((i + t) * n + o) = v + b };
            }
            i += 4;
        }
        while i < m {
            let v = dot(&xs[i * k..(i + 1) * k], wf) + b;
            // SAFETY: as above.
            unsafe { *a.y.get().add(i * n + o) = v };
            i += 1;
        }
    }
}

/// `dot` of four vectors with one: each result is bitwise what [`dot`] gives, as every lane
/// sums the same elements in the same order.
#[inline(always)]
fn dot4(x: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
    const L: usize = DOT_LANES;
    let mut a0 = [0f32; L];
    let mut a1 = [0f32; L];
    let mut a2 = [0f32; L];
    let mut a3 = [0f32; L];
    let chunks = w
        .chunks_exact(L)
        .zip(x[0].chunks_exact(L))
        .zip(x[1].chunks_exact(L))
        .zip(x[2].chunks_exact(L))
        .zip(x[3].chunks_exact(L));
    for ((((wc, x0), x1), x2), x3) in chunks {
        for j in 0..L {
            a0[j] += x0[j] * wc[j];
            a1[j] += x1[j] * wc[j];
            a2[j] += x2[j] * wc[j];
            a3[j] += x3[j] * wc[j];
        }
    }
    let done = w.len() / L * L;
    let tail = |xt: &[f32]| {
        let mut t = 0f32;
        for (a, b) in xt[done..].iter().zip(&w[done..]) {
            t += a * b;
        }
        t
    };
    [
        fold_lanes(a0) + tail(x[0]),
        fold_lanes(a1) + tail(x[1]),
        fold_lanes(a2) + tail(x[2]),
        fold_lanes(a3) + tail(x[3]),
    ]
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::cpu::CpuDevice;
    use crate::{DType, Device, Op, View};

    #[test]
    fn matmul_matches_f64_for_every_weight_dtype() {
        let mut rng = Rng::new(6);
        for threads in [1usize, 2] {
            let dev = CpuDevice::new(0, threads, 10);
            for dtype in DType::ALL {
                for (m, k, n, with_bias) in [
                    (1usize, 64usize, 64usize, false),
                    (1, 172, 37, true),
                    (9, 100, 300, true),
                    (3, 1024, 513, false),
                ] {
                    let x = rng.vec_sym(m * k);
                    let w = rounded(dtype, &rng.vec_sym(n * k));
                    let bias = rng.vec_sym(n);
                    let want: Vec<f64> = (0..m)
                        .flat_map(|i| {
                            let (x, w, bias) = (&x, &w, &bias);
                            (0..n).map(move |o| {
                                let d: f64 = (0..k)
                                    .map(|j| x[i * k + j] as f64 * w[o * k + j] as f64)
                                    .sum();
                                d + if with_bias { bias[o] as f64 } else { 0.0 }
                            })
                        })
                        .collect();
                    let (bx, bw, bb) = (
                        upload(&dev, DType::F32, &x),
                        upload(&dev, dtype, &w),
                        upload(&dev, DType::F32, &bias),
                    );
                    let by = dev.alloc(m * n * 4).unwrap();
                    let vb = View::new(&bb, 0, n, DType::F32);
                    dev.run(&Op::Matmul(crate::ops::Matmul {
                        x: View::new(&bx, 0, m * k, DType::F32),
                        w: View::new(&bw, 0, n * k, dtype),
                        bias: with_bias.then_some(vb),
                        y: View::new(&by, 0, m * n, DType::F32),
                        m,
                        k,
                        n,
                        prologue: crate::Prologue::None,
                        epilogue: crate::ops::Epilogue::None,
                    }))
                    .unwrap();
                    let err = max_err(&download(&dev, &by, DType::F32, m * n), &want);
                    assert!(err < 1e-5, "{dtype} m{m} k{k} n{n}: {err}");
                }
            }
        }
    }
}

#[cfg(test)]
mod consistency {
    use super::super::testutil::*;
    use super::*;
    use crate::cpu::CpuDevice;
    use crate::{DType, Device, Op, View};

    /// Prefill (m tokens at once, four per pass) and decode (one token) give the same bits,
    /// and so do the AVX2 and the portable builds of the kernel.
    #[test]
    fn batched_single_and_avx2_paths_agree_bitwise() {
        let dev = CpuDevice::new(0, 1, 10);
        let mut rng = Rng::new(11);
        let (m, k, n) = (7usize, 203usize, 9usize);
        for dtype in DType::ALL {
            let x = rng.vec_sym(m * k);
            let w = upload(&dev, dtype, &rng.vec_sym(n * k));
            let bx = upload(&dev, DType::F32, &x);
            let by = dev.alloc(m * n * 4).unwrap();
            let run = |xo: usize, yo: usize, mm: usize| {
                dev.run(&Op::Matmul(crate::ops::Matmul {
                    x: View::new(&bx, xo * 4, mm * k, DType::F32),
                    w: View::new(&w, 0, n * k, dtype),
                    bias: None,
                    y: View::new(&by, yo * 4, mm * n, DType::F32),
                    m: mm,
                    k,
                    n,
                    prologue: crate::Prologue::None,
                    epilogue: crate::ops::Epilogue::None,
                }))
                .unwrap();
                download(&dev, &by, DType::F32, m * n)
            };
            let batched = run(0, 0, m);
            let mut single = Vec::new();
            for i in 0..m {
                single = run(i * k, i * n, 1);
            }
            assert_eq!(batched, single, "{dtype}");

            // The two builds of `rows`, side by side.
            let results: Vec<Vec<f32>> = [false, true]
                .into_iter()
                .filter(|&avx| !avx || has_avx2())
                .map(|avx| {
                    let mut y = vec![0f32; m * n];
                    crate::with_dtype!(dtype, T => {
                        let a = Rows::<T> {
                            x: SendPtr(x.as_ptr().cast_mut()),
                            w: SendPtr(w.typed::<T>(0, n * k, dtype).unwrap()),
                            bias: None,
                            y: SendPtr(y.as_mut_ptr()),
                            m,
                            k,
                            n,
                            rows: 0..n,
                        };
                        // SAFETY: the pointers hold the shapes above; AVX2 only when present.
                        unsafe { if avx { rows_avx2(&a) } else { rows(&a) } }
                    });
                    y
                })
                .collect();
            assert!(results.windows(2).all(|p| p[0] == p[1]), "{dtype}");
            assert_eq!(results[0], batched);
        }
    }
}

#[cfg(test)]
mod bench {
    use super::super::testutil::*;
    use crate::cpu::CpuDevice;
    use crate::{DType, Device, Op, View};

    /// `cargo test --release -p tprun-kernels matvec_speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn matvec_speed() {
        let (k, n) = (4096usize, 4096usize);
        let mut rng = Rng::new(9);
        let x = rng.vec_sym(k);
        for threads in [1usize, 2] {
            let dev = CpuDevice::new(0, threads, 10);
            for dtype in DType::ALL {
                for m in [1usize, 16] {
                    let w = upload(&dev, dtype, &rng.vec_sym(n * k));
                    let xs: Vec<f32> = (0..m).flat_map(|_| x.clone()).collect();
                    let bx = upload(&dev, DType::F32, &xs);
                    let by = dev.alloc(m * n * 4).unwrap();
                    let op = Op::Matmul(crate::ops::Matmul {
                        x: View::new(&bx, 0, m * k, DType::F32),
                        w: View::new(&w, 0, n * k, dtype),
                        bias: None,
                        y: View::new(&by, 0, m * n, DType::F32),
                        m,
                        k,
                        n,
                        prologue: crate::Prologue::None,
                        epilogue: crate::ops::Epilogue::None,
                    });
                    dev.run(&op).unwrap();
                    let reps = 20;
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        dev.run(&op).unwrap();
                    }
                    let s = t.elapsed().as_secs_f64() / reps as f64;
                    println!(
                        "threads {threads} {dtype} m {m}: {:.2} ms, {:.1} GB/s of weights, {:.1} GFLOP/s",
                        s * 1e3,
                        (n * k * dtype.size()) as f64 / s / 1e9,
                        (2 * m * n * k) as f64 / s / 1e9
                    );
                }
            }
        }
    }
}
