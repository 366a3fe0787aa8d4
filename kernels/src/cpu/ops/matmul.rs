//! `Matmul`: `y = x · wᵀ (+ bias)` with `w` in a Linear's [out, in] layout, the one product
//! every projection and the LM head use (matrix–vector when m = 1, matrix–matrix in prefill).
//!
//! Threads split the output features (rows of `w`), so each thread streams its own slice of
//! the weight once and every weight byte is read once per call; a bf16/f16 row is widened into
//! an f32 scratch row and reused for all m tokens.

use super::super::{par_ranges, CpuBuf, CpuDevice};
use super::{dot, f32_ptr, overlaps, typed_ptr, MIN_WORK_PER_THREAD};
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
    if overlaps(x, y) || overlaps(w, y) {
        return Err(KernelError::Invalid("matmul: y overlaps x or w".into()));
    }
    let px = f32_ptr(x, m * k, "matmul x")?;
    let py = f32_ptr(y, m * n, "matmul y")?;
    let pb = bias.map(|b| f32_ptr(b, n, "matmul bias")).transpose()?;
    let min_rows = MIN_WORK_PER_THREAD / (m * k).max(1) + 1;
    with_dtype!(w.dtype, T => {
        let pw = typed_ptr::<T>(w, n * k, "matmul w")?;
        let convert = w.dtype != DType::F32;
        par_ranges(dev.threads(), n, min_rows, |r| {
            let mut scratch = vec![0f32; if convert { k } else { 0 }];
            // SAFETY: x holds m·k elements (checked) and nothing writes it during the op.
            let xs = unsafe { std::slice::from_raw_parts(px.get(), m * k) };
            for o in r {
                // SAFETY: row o < n lies inside the n·k checked weight elements.
                let wr = unsafe { std::slice::from_raw_parts(pw.get().add(o * k), k) };
                let wf: &[f32] = if convert {
                    for (s, v) in scratch.iter_mut().zip(wr) {
                        *s = v.to_f32();
                    }
                    &scratch
                } else {
                    // SAFETY: T is f32 in this branch (w.dtype == F32), same size and layout.
                    unsafe { std::slice::from_raw_parts(wr.as_ptr().cast::<f32>(), k) }
                };
                // SAFETY: o < n, checked for the bias.
                let b = pb.map_or(0.0, |b| unsafe { *b.get().add(o) });
                for i in 0..m {
                    let v = dot(&xs[i * k..(i + 1) * k], wf) + b;
                    // SAFETY: i·n + o < m·n; column o belongs to this thread only; y overlaps
                    // neither x nor w (checked).
                    unsafe { *py.get().add(i * n + o) = v };
                }
            }
        });
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::cpu::CpuDevice;
    use crate::{DType, Device, Op, View};

    #[test]
    fn matmul_matches_f64_for_every_weight_dtype() {
        let mut rng = Rng(6);
        for threads in [1usize, 2] {
            let dev = CpuDevice::new(0, threads, 10);
            for dtype in DType::ALL {
                for (m, k, n, with_bias) in [
                    (1usize, 64usize, 64usize, false),
                    (1, 172, 37, true),
                    (9, 100, 300, true),
                    (3, 1024, 513, false),
                ] {
                    let x = rng.vec(m * k);
                    let w = rounded(dtype, &rng.vec(n * k));
                    let bias = rng.vec(n);
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
                    dev.run(&Op::Matmul {
                        x: View::new(&bx, 0, m * k, DType::F32),
                        w: View::new(&bw, 0, n * k, dtype),
                        bias: with_bias.then_some(vb),
                        y: View::new(&by, 0, m * n, DType::F32),
                        m,
                        k,
                        n,
                    })
                    .unwrap();
                    let err = max_err(&download(&dev, &by, DType::F32, m * n), &want);
                    assert!(err < 1e-5, "{dtype} m{m} k{k} n{n}: {err}");
                }
            }
        }
    }
}
