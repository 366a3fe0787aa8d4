//! Elementwise decode ops: `Fill`, `Add` (the residual add), `SiluMul` (the gated MLP's
//! `silu(gate) · up`) and `SigmoidMul` (Qwen3.5's attention output gate, `x · σ(gate)`).

use super::super::{par_ranges, CpuBuf, CpuDevice};
use super::f32_ptr;
use crate::{with_dtype, DType, Device, KernelError, Result, View};

/// Elements per thread below which threads do not pay: the figure `reduce.rs` uses for the
/// same kind of streaming loop.
const MIN_PER_THREAD: usize = 1 << 16;

pub(crate) fn fill(dev: &CpuDevice, dst: &View<'_, CpuBuf>, value: f32) -> Result<()> {
    with_dtype!(dst.dtype, T => {
        let d = super::typed_ptr::<T>(dst, dst.len, "fill dst")?;
        let v = <T as crate::dtype::Elem>::from_f32(value);
        par_ranges(dev.threads(), dst.len, MIN_PER_THREAD, |r| {
            for i in r {
                // SAFETY: i < dst.len, checked by `typed_ptr`; ranges are disjoint per thread.
                unsafe { *d.get().add(i) = v };
            }
        });
    });
    Ok(())
}

/// Shared shape of the two binary ops: `out[i] = f(a[i], b[i])`.
fn binary(
    dev: &CpuDevice,
    a: &View<'_, CpuBuf>,
    b: &View<'_, CpuBuf>,
    out: &View<'_, CpuBuf>,
    what: &str,
    f: impl Fn(f32, f32) -> f32 + Sync,
) -> Result<()> {
    let n = out.len;
    if a.len != n || b.len != n {
        return Err(KernelError::Invalid(format!(
            "{what}: lengths {} and {} into {n}",
            a.len, b.len
        )));
    }
    let (pa, pb, po) = (
        f32_ptr(a, n, what)?,
        f32_ptr(b, n, what)?,
        f32_ptr(out, n, what)?,
    );
    par_ranges(dev.threads(), n, MIN_PER_THREAD, |r| {
        for i in r {
            // SAFETY: i < n for all three views (checked above); `out` equals an input
            // element-for-element or is disjoint from it (the ops' validate(), which
            // Device::launch requires), and each element is read before it is written;
            // threads own disjoint ranges.
            unsafe { *po.get().add(i) = f(*pa.get().add(i), *pb.get().add(i)) };
        }
    });
    Ok(())
}

pub(crate) fn add(
    dev: &CpuDevice,
    a: &View<'_, CpuBuf>,
    b: &View<'_, CpuBuf>,
    out: &View<'_, CpuBuf>,
) -> Result<()> {
    binary(dev, a, b, out, "add", |x, y| x + y)
}

pub(crate) fn silu_mul(
    dev: &CpuDevice,
    gate: &View<'_, CpuBuf>,
    up: &View<'_, CpuBuf>,
    out: &View<'_, CpuBuf>,
) -> Result<()> {
    // silu(g) = g · sigmoid(g) = g / (1 + e^-g), as torch.nn.functional.silu.
    binary(dev, gate, up, out, "silu_mul", |g, u| {
        g / (1.0 + (-g).exp()) * u
    })
}

/// The SiluMul epilogue of a product's twin (`Matmul`, `MatmulInt4`): `product` writes the
/// whole [m, n] product into a scratch view, then y[r] = silu(gate) · up of its row's two
/// halves ([m, n/2]).
pub(crate) fn silu_mul_epilogue(
    dev: &CpuDevice,
    m: usize,
    n: usize,
    y: &View<'_, CpuBuf>,
    product: impl FnOnce(View<'_, CpuBuf>) -> Result<()>,
) -> Result<()> {
    let (h, full) = (n / 2, dev.alloc(m * n * 4)?);
    let full = View::new(&full, 0, m * n, DType::F32);
    product(full)?;
    for r in 0..m {
        let row = full.slice(r * n, n);
        silu_mul(dev, &row.slice(0, h), &row.slice(h, h), &y.slice(r * h, h))?;
    }
    Ok(())
}

pub(crate) fn sigmoid_mul(
    dev: &CpuDevice,
    x: &View<'_, CpuBuf>,
    gate: &View<'_, CpuBuf>,
    out: &View<'_, CpuBuf>,
) -> Result<()> {
    // x · torch.sigmoid(g), sigmoid(g) = 1 / (1 + e^-g).
    binary(dev, x, gate, out, "sigmoid_mul", |x, g| {
        x / (1.0 + (-g).exp())
    })
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::cpu::CpuDevice;
    use crate::{DType, Device, Op, View};

    #[test]
    fn add_and_silu_mul_match_f64() {
        let dev = CpuDevice::new(0, 2, 10);
        let mut rng = Rng::new(1);
        for n in [1usize, 17, 300_000] {
            let a = rng.vec_sym(n).iter().map(|x| x * 8.0).collect::<Vec<_>>();
            let b = rng.vec_sym(n);
            let (ba, bb) = (upload(&dev, DType::F32, &a), upload(&dev, DType::F32, &b));
            let out = dev.alloc(n * 4).unwrap();
            let va = View::new(&ba, 0, n, DType::F32);
            let vb = View::new(&bb, 0, n, DType::F32);
            let vo = View::new(&out, 0, n, DType::F32);
            dev.run(&Op::SiluMul(crate::ops::SiluMul {
                gate: va,
                up: vb,
                out: vo,
            }))
            .unwrap();
            let want: Vec<f64> = a
                .iter()
                .zip(&b)
                .map(|(&g, &u)| {
                    let g = g as f64;
                    g / (1.0 + (-g).exp()) * u as f64
                })
                .collect();
            assert!(max_err(&download(&dev, &out, DType::F32, n), &want) < 1e-6);
            // In place on `a`.
            dev.run(&Op::Add(crate::ops::Add {
                a: va,
                b: vb,
                out: va,
            }))
            .unwrap();
            let want: Vec<f64> = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| x as f64 + y as f64)
                .collect();
            assert!(max_err(&download(&dev, &ba, DType::F32, n), &want) < 1e-6);
        }
    }

    #[test]
    fn sigmoid_mul_matches_f64_in_place() {
        let dev = CpuDevice::new(0, 2, 10);
        let mut rng = Rng::new(2);
        for n in [1usize, 33, 200_000] {
            let x = rng.vec_sym(n);
            let g = rng.vec_sym(n).iter().map(|v| v * 12.0).collect::<Vec<_>>();
            let (bx, bg) = (upload(&dev, DType::F32, &x), upload(&dev, DType::F32, &g));
            let vx = View::new(&bx, 0, n, DType::F32);
            let vg = View::new(&bg, 0, n, DType::F32);
            dev.run(&Op::SigmoidMul(crate::ops::SigmoidMul {
                x: vx,
                gate: vg,
                out: vx,
            }))
            .unwrap();
            let want: Vec<f64> = x
                .iter()
                .zip(&g)
                .map(|(&x, &g)| x as f64 / (1.0 + (-(g as f64)).exp()))
                .collect();
            assert!(max_err(&download(&dev, &bx, DType::F32, n), &want) < 1e-6);
        }
    }

    #[test]
    fn fill_sets_every_element_and_partial_overlap_is_refused() {
        let dev = CpuDevice::new(0, 1, 10);
        let b = dev.alloc(64).unwrap();
        dev.run(&Op::Fill(crate::ops::Fill {
            dst: View::new(&b, 0, 16, DType::F32),
            value: 2.5,
        }))
        .unwrap();
        assert_eq!(download(&dev, &b, DType::F32, 16), vec![2.5; 16]);
        let a = View::new(&b, 0, 8, DType::F32);
        let o = View::new(&b, 4, 8, DType::F32);
        assert!(dev
            .run(&Op::Add(crate::ops::Add { a, b: a, out: o }))
            .is_err());
    }
}
