//! `RmsNorm`, as Hugging Face's `LlamaRMSNorm`: mean of squares in f32, `x · rsqrt(var + eps)`,
//! then times the weight.

use super::super::{par_ranges, CpuBuf, CpuDevice};
use super::{dot, f32_ptr, typed_ptr, MIN_WORK_PER_THREAD};
use crate::dtype::Elem;
use crate::{with_dtype, KernelError, Result, View};

pub(crate) fn rms_norm(
    dev: &CpuDevice,
    x: &View<'_, CpuBuf>,
    w: &View<'_, CpuBuf>,
    out: &View<'_, CpuBuf>,
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    if w.len != dim || dim == 0 {
        return Err(KernelError::Invalid(format!(
            "rms_norm: weight of {} elements for rows of {dim}",
            w.len
        )));
    }
    let n = rows * dim;
    let (px, po) = (
        f32_ptr(x, n, "rms_norm x")?,
        f32_ptr(out, n, "rms_norm out")?,
    );
    with_dtype!(w.dtype, T => {
        let pw = typed_ptr::<T>(w, dim, "rms_norm weight")?;
        // SAFETY: `w` was checked for dim elements and is only read.
        let wv: Vec<f32> = unsafe { std::slice::from_raw_parts(pw.get(), dim) }
            .iter()
            .map(|v| v.to_f32())
            .collect();
        par_ranges(dev.threads(), rows, MIN_WORK_PER_THREAD / dim + 1, |r| {
            for row in r {
                // SAFETY: the row is inside the n elements checked above; `out` is `x` or
                // disjoint from it, and the row is read in full (sum of squares) before it is
                // written, one element at a time through the same pointer arithmetic.
                unsafe {
                    let xr = std::slice::from_raw_parts(px.get().add(row * dim), dim);
                    let inv = 1.0 / (dot(xr, xr) / dim as f32 + eps).sqrt();
                    let o = po.get().add(row * dim);
                    for (i, &wi) in wv.iter().enumerate() {
                        *o.add(i) = (*px.get().add(row * dim + i) * inv) * wi;
                    }
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
    fn rms_norm_matches_f64_in_place_and_out_of_place() {
        let dev = CpuDevice::new(0, 2, 10);
        let mut rng = Rng::new(3);
        for dtype in DType::ALL {
            for (rows, dim) in [(1usize, 64usize), (7, 8), (300, 100)] {
                let x: Vec<f32> = rng.vec_sym(rows * dim).iter().map(|v| v * 3.0).collect();
                let w = rounded(dtype, &rng.vec_sym(dim));
                let eps = 1e-5f32;
                let want: Vec<f64> = (0..rows)
                    .flat_map(|r| {
                        let xr = &x[r * dim..(r + 1) * dim];
                        let ms = xr.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
                        let inv = 1.0 / (ms + eps as f64).sqrt();
                        xr.iter()
                            .zip(&w)
                            .map(move |(&v, &wi)| v as f64 * inv * wi as f64)
                            .collect::<Vec<_>>()
                    })
                    .collect();
                let bx = upload(&dev, DType::F32, &x);
                let bw = upload(&dev, dtype, &w);
                let bo = dev.alloc(rows * dim * 4).unwrap();
                let vx = View::new(&bx, 0, rows * dim, DType::F32);
                let vw = View::new(&bw, 0, dim, dtype);
                let vo = View::new(&bo, 0, rows * dim, DType::F32);
                dev.run(&Op::RmsNorm(crate::ops::RmsNorm {
                    x: vx,
                    w: vw,
                    out: vo,
                    rows,
                    dim,
                    eps,
                }))
                .unwrap();
                assert!(max_err(&download(&dev, &bo, DType::F32, rows * dim), &want) < 2e-6);
                dev.run(&Op::RmsNorm(crate::ops::RmsNorm {
                    x: vx,
                    w: vw,
                    out: vx,
                    rows,
                    dim,
                    eps,
                }))
                .unwrap();
                assert!(max_err(&download(&dev, &bx, DType::F32, rows * dim), &want) < 2e-6);
            }
        }
    }
}
